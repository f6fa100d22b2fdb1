"""Receivers measure what a v2 chunk costs them and name it in their hello; the publisher
codes for the slowest (issue 24). Real sockets, a real frame server, real kernels."""

from __future__ import annotations

import math
import socket
import time

import pytest

from modal_rl.weightsync import CodecConfig
from modal_rl.weightsync.codec import decode_costs
from modal_rl.weightsync.codec.codings.chunks_v2 import v2_pays
from modal_rl.weightsync.codec.decode_costs import DEFAULT, DecodeCosts, from_hello, slowest
from modal_rl.weightsync.codec.warmup import warm_up
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
from tests.weightsync_helpers import TEST_KEY, client_handshake


@pytest.mark.parametrize(
    "value",
    [
        None,
        "fast",
        {"word_s": 1e-9},
        {"word_s": -1e-9, "change_s": 5e-8},
        {"word_s": math.nan, "change_s": 5e-8},
        {"word_s": 1e-9, "change_s": math.inf},
        {"word_s": True, "change_s": 5e-8},
        {"word_s": 1.0, "change_s": 5e-8},  # a second per word: no CPU is that slow
        {"word_s": 1e-9, "change_s": "5e-8"},
    ],
)
def test_a_hello_naming_no_costs_or_impossible_ones_counts_at_the_defaults(value):
    assert from_hello(value) is None
    assert slowest([from_hello(value)]) == DEFAULT


def test_the_slowest_receiver_sets_each_cost():
    fast_pass = DecodeCosts(word_s=0.2e-9, change_s=90e-9)
    slow_pass = DecodeCosts(word_s=3e-9, change_s=20e-9)
    assert slowest([fast_pass, slow_pass]) == DecodeCosts(3e-9, 90e-9)
    assert slowest([fast_pass, None]) == DecodeCosts(DEFAULT.word_s, 90e-9)  # None: the defaults
    assert slowest([]) == DEFAULT
    assert from_hello(slow_pass.hello()) == slow_pass


def test_measured_costs_follow_the_v2_pass_on_this_cpu():
    assert warm_up(1, measure_costs=True)  # loads the kernels and measures
    costs = decode_costs.measured()
    assert costs is not None
    # v2's pass over every held word is real work (~1 ns/word); v1 touches only changes
    assert 0 < costs.word_s < 1e-7 and 0 <= costs.change_s < 1e-5


def test_v2_pays_weighs_the_receiver_s_own_costs():
    count, k = 1 << 22, 1 << 15  # 40 KB saved at 10 MB/s: 4 ms of wire
    assert v2_pays(100_000, 60_000, count, k, 1e7, DecodeCosts(0.5e-9, 20e-9))  # 2.7 ms of decode
    assert not v2_pays(100_000, 60_000, count, k, 1e7, DecodeCosts(2e-9, 20e-9))  # 9 ms


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_hello_carries_the_receiver_s_costs_to_the_publisher_s_coding(monkeypatch):
    monkeypatch.setenv("MODAL_RL_RUN_KEY", TEST_KEY)
    slow = DecodeCosts(word_s=4e-9, change_s=30e-9)  # a slow pass, cheap changes
    server = FrameServer(key=TEST_KEY, rate_bytes_per_s=125e6)
    source = None
    try:
        assert server.receiver_costs == DEFAULT  # nobody connected
        monkeypatch.setattr(decode_costs, "_measured", [slow])
        source = TcpSource(*server.address, key=TEST_KEY)
        assert source._connect(None, time.monotonic() + 10)
        _wait(lambda: server.receivers == 1)
        assert server.receiver_costs == slow
        config = Publisher(server, config=CodecConfig(threads=1))._config_for_link()
        assert config.receiver_costs == slow and config.link_bytes_per_s == 125e6
        # a second receiver that names none counts at the defaults; the slowest of each wins
        plain = socket.create_connection(server.address)
        client_handshake(plain, TEST_KEY)
        _wait(lambda: server.receivers == 2)
        assert server.receiver_costs == DecodeCosts(slow.word_s, DEFAULT.change_s)
        assert Publisher(server, config=CodecConfig(threads=1))._config_for_link().link_bytes_per_s == 62.5e6
        plain.close()
    finally:
        if source is not None:
            source.close()
        server.close()


def test_a_receiver_after_a_publisher_in_one_process_still_measures():
    """Publishers warm up without measuring; a subscriber made later in the same process
    gets its measurement on a thread of its own (a fresh process: the warm-up is global)."""
    import subprocess
    import sys

    code = (
        "import time\n"
        "from modal_rl.weightsync.codec import decode_costs\n"
        "from modal_rl.weightsync.codec.warmup import start_warm_up, wait_warm\n"
        "start_warm_up(1)\n"
        "assert wait_warm(120) and decode_costs.measured() is None\n"
        "start_warm_up(1, measure_costs=True)\n"
        "deadline = time.monotonic() + 120\n"
        "while decode_costs.measured() is None and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "print(decode_costs.measured().word_s > 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "True"
