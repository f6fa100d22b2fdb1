"""Coding for the link (issue 24): the per-chunk choice between v2 and v1 by wire + decode
time, slime's xor shape in our frames, the publisher's link share, and the kernels'
warm-up. Correctness only: which coding was picked and that every frame is bit-exact."""

from __future__ import annotations

import io

import pytest

from modal_rl.weightsync import CodecConfig, apply_frame, encode_anchor, encode_delta, frame_bytes
from modal_rl.weightsync.codec.codings.chunks import CTX_SPARSE, UNCHANGED, XOR_DENSE
from modal_rl.weightsync.codec.codings.chunks_v2 import v2_pays
from modal_rl.weightsync.codec.warmup import start_warm_up, wait_warm, warm_up
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.transport.tcp import FrameServer
from tests.weightsync.test_weightsync_codec_v2 import BASE, NEW, chunk_encodings
from tests.weightsync_helpers import clone_state, same_state


def _delta(config: CodecConfig) -> bytes:
    return frame_bytes(encode_delta(BASE, NEW, base_version=0, version=1, config=config))


def _applies_exactly(frame: bytes) -> None:
    held = clone_state(BASE)
    apply_frame(held, io.BytesIO(frame), held_version=0, key=None)
    assert same_state(held, NEW)


def test_a_slow_link_gets_v2_chunks_and_a_fast_one_v1_both_bit_exact():
    slow = _delta(CodecConfig(chunk_elems=1 << 14, threads=2, link_bytes_per_s=1e3))
    fast = _delta(CodecConfig(chunk_elems=1 << 14, threads=2, link_bytes_per_s=1e12))
    assert CTX_SPARSE in chunk_encodings(slow)
    assert CTX_SPARSE not in chunk_encodings(fast)
    assert len(slow) < len(fast)  # v2 is smaller; on a fast link its decode time is not worth it
    _applies_exactly(slow)
    _applies_exactly(fast)


def test_v2_pays_only_when_the_wire_time_saved_exceeds_the_decode_time_added():
    # 4 Mi words, 1% changed: ~4.2 ms of extra decode (1 ns/word + 50 ns/change)
    count, k = 1 << 22, 1 << 15
    assert v2_pays(100_000, 60_000, count, k, 1e6)  # 40 KB at 1 MB/s: 40 ms saved
    assert not v2_pays(100_000, 60_000, count, k, 125e6)  # at 1 Gbps: 0.3 ms saved
    assert not v2_pays(100_000, 100_000, count, k, 1.0)  # nothing saved


def test_coding_0_carries_slime_s_dense_xor_in_our_frames():
    frame = _delta(CodecConfig(chunk_elems=1 << 14, threads=2, coding=0))
    assert set(chunk_encodings(frame)) <= {XOR_DENSE}
    _applies_exactly(frame)
    # unchanged tensors too: slime sends every tensor's XOR
    same = frame_bytes(encode_delta(BASE, BASE, base_version=0, version=1, config=CodecConfig(coding=0)))
    assert UNCHANGED not in chunk_encodings(same)


def test_link_bytes_per_s_must_be_positive():
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        CodecConfig(link_bytes_per_s=0)


def test_the_publisher_codes_for_each_receiver_s_share_of_a_rate_limited_link():
    limited = FrameServer(key=None, rate_bytes_per_s=125e6)
    unlimited = FrameServer(key=None)
    try:
        assert Publisher(limited, config=CodecConfig(threads=1))._config_for_link().link_bytes_per_s == 125e6
        assert Publisher(unlimited, config=CodecConfig(threads=1))._config_for_link().link_bytes_per_s is None
        named = CodecConfig(threads=1, link_bytes_per_s=5.0)
        assert Publisher(limited, config=named)._config_for_link().link_bytes_per_s == 5.0
    finally:
        limited.close()
        unlimited.close()


def test_the_kernels_warm_up_once_and_frames_still_round_trip():
    start_warm_up(1)
    assert wait_warm(60)
    assert warm_up(1)  # idempotent, and the coded chunk decoded to the words it coded
    anchor = frame_bytes(encode_anchor(BASE, version=0, config=CodecConfig(threads=1)))
    assert apply_frame({}, io.BytesIO(anchor), held_version=None, key=None).state is not None
    _applies_exactly(_delta(CodecConfig(chunk_elems=1 << 14, threads=1)))


@pytest.mark.slow  # a CLI process start (torch import): >10 s on a busy host
def test_receive_refuses_no_live_copy_with_out_in_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "modal_rl.weightsync", "receive", "--tcp", "127.0.0.1:9", "--until", "1"]
        + ["--keyless", "--no-live-copy", "--out", str(tmp_path / "w.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--no-live-copy" in lines[0]
