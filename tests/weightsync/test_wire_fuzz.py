"""Round 3 (issue 35), item 2: every wire and store parser is bounded and total.

Hypothesis throws arbitrary lines at each parser (the frame server's hello and proof line,
the control channel, frame headers, ``latest`` and lease records, the key forwarder's path
check): each must answer with its one documented refusal, never another exception (no
``RecursionError``, ``OverflowError``, ``TypeError``). Then the inputs the review used (a
10**400 integer, 100 000 nested arrays, an oversize line) go over real sockets to a real
frame server and control server: each gets one refusal line (or a dropped connection) and a
one-line log, never a traceback, and the servers keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modal_rl import wire_json
from modal_rl.cluster import control
from modal_rl.engines.key_forwarder import path_problem
from modal_rl.run_key import RUN_KEY_ENV
from modal_rl.weightsync.codec.decode_costs import from_hello
from modal_rl.weightsync.errors import WeightSyncError
from modal_rl.weightsync.transport import hello as hello_lines
from modal_rl.weightsync.transport import tcp as transport_tcp
from modal_rl.weightsync.transport.lease import StoreLease, read_pointer
from modal_rl.weightsync.wire.auth import frame_keys, sign_json
from modal_rl.weightsync.wire.frames import FORMAT_VERSION, MAGIC, VersionHeader
from tests.weightsync_helpers import TEST_KEY

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HOSTILE = [
    b'{"have": ' + b"9" * 400 + b"}\n",
    b'{"have": 1e400, "decode": {"word_s": ' + b"9" * 400 + b', "change_s": 1}}\n',
    b'{"decode": {"word_s": 1e999, "change_s": NaN}}\n',
    b"[" * 100_000 + b"]" * 100_000 + b"\n",
    b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n",
    b'{"have": "' + b"x" * 10_000 + b'"}\n',
    b"\xff\xfe\n",
    b"null\n",
    b"[]\n",
    b"5\n",
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
hello_objects = st.fixed_dictionaries(
    {},
    optional={
        "have": json_values | st.integers(),
        "epoch": json_values | st.integers(min_value=-(10**30), max_value=10**30),
        "decode": json_values | st.fixed_dictionaries({"word_s": json_values, "change_s": json_values}),
        "auth": json_values,
        "nonce": json_values,
        "proof": json_values,
    },
)
lines = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    hello_objects.map(lambda v: json.dumps(v).encode()),
    st.sampled_from(HOSTILE),
    st.integers(min_value=1, max_value=3000).map(lambda n: b"[" * n + b"]" * n),
)


@FUZZ
@given(lines)
def test_wire_json_refuses_with_wire_error_only(line):
    try:
        wire_json.loads(line, max_bytes=4096, max_depth=8)
    except wire_json.WireError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(lines)
def test_the_frame_server_hello_parser_is_total(line):
    try:
        hello = hello_lines.parse(line, "hello")
        for name in ("have", "epoch"):
            got = hello_lines.counter(hello, name)
            assert got is None or 0 <= got <= hello_lines.MAX_COUNTER
        from_hello(hello.get("decode"))
    except hello_lines.Refused as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(lines)
def test_the_control_channel_parser_is_total(line):
    server = control.ControlServer(nodes=3, lost_after_s=5.0, key=TEST_KEY)
    try:
        msg = control._message(line, control.MAX_HELLO)
    except wire_json.WireError:
        return
    assert server._admitted(msg, "nonce") in (True, False)


@FUZZ
@given(lines)
def test_a_frame_header_parser_is_total(line):
    try:
        VersionHeader.from_body(MAGIC + struct.pack("<H", FORMAT_VERSION) + line)
    except WeightSyncError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(lines)
def test_store_records_parsers_are_total(tmp_path_factory, line):
    keys = frame_keys(TEST_KEY)
    root = tmp_path_factory.mktemp("store")
    (root / "latest").write_bytes(line)
    try:
        read_pointer(root / "latest", keys)
    except WeightSyncError as exc:
        assert "\n" not in str(exc)
    (root / "lease").write_bytes(line)
    lease = StoreLease(root, keys, lambda p, d: p.write_bytes(d), lambda: None, heartbeat=False)
    assert lease.read() is None  # nothing unsigned counts, and nothing raises


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))
def test_the_forwarders_path_check_is_total(path):
    got = path_problem(path)
    assert got is None or (isinstance(got, str) and "\n" not in got)


def test_a_signed_lease_with_a_huge_number_is_refused_not_raised(tmp_path):
    keys = frame_keys(TEST_KEY)
    record = {"run": "r", "holder": "h", "epoch": 10**60, "renewed_at": 1.0, "expires_at": 2.0, "ttl_s": 1.0}
    (tmp_path / "lease").write_text(json.dumps(sign_json(keys, record)))
    lease = StoreLease(tmp_path, keys, lambda p, d: p.write_bytes(d), lambda: None, heartbeat=False)
    assert lease.read() is None


# -- over real sockets -------------------------------------------------------------------


@pytest.fixture
def frame_server(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)
    srv = transport_tcp.FrameServer()
    yield srv
    srv.close()


def _exchange(address, data: bytes) -> bytes:
    with socket.create_connection(address, timeout=10) as sock:
        # the server may refuse mid-send (the line is over the limit): then read what it said
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


@pytest.mark.parametrize("line", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_hello_gets_one_refusal_line_and_a_one_line_log(frame_server, line, caplog):
    caplog.set_level(logging.DEBUG)
    got = _exchange(frame_server.address, line)
    assert got.count(b"\n") == 1 and "error" in json.loads(got), got[:200]
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].exc_info is None and "\n" not in refusals[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert frame_server.receivers == 0


def test_the_control_server_drops_hostile_lines_with_a_log_line_and_no_traceback(caplog):
    caplog.set_level(logging.DEBUG)

    async def scenario() -> int:
        server = control.ControlServer(nodes=2, lost_after_s=30.0, key=TEST_KEY)
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]
        for line in HOSTILE + [b'{"hello": true}\n']:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await reader.readline()  # the challenge
            writer.write(line)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # dropped, nothing said
            writer.close()
        await server.release(0)
        return server.refused

    assert asyncio.run(scenario()) == len(HOSTILE) + 1
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert [r for r in caplog.records if "control channel" in r.getMessage()]
