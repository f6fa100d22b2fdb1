"""The key forwarder never hands out the run key: not through a path the engine reads as another
route, and not through any answer of an engine that echoes the key on every route (status
line, headers, body, streamed bodies, a key split across chunks, derived keys). Requests go out
as raw bytes over a socket, so no client rewrites the path before the forwarder sees it."""

from __future__ import annotations

import ast
import asyncio
import base64
import gzip
import socket
import threading
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.cluster.redaction import DERIVED_PURPOSES, Redactor, secret_forms
from modal_rl.engines.key_forwarder import BUFFER_BYTES, KeyForwarder, path_problem
from modal_rl.run_key import derive, engine_bearer, new_run_key

KEY = new_run_key()
SEED = derive(KEY, "weightsync-ed25519-seed")  # the trainer's signing key
# An engine holds its bearer, never the run key (round 3): what a careless engine could print is
# the bearer, and the key under it in the forms code prints keys in.
SECRET = engine_bearer(KEY)
RAW = derive(KEY, "engine-bearer")
LEAKS = [SECRET, RAW.hex(), base64.b64encode(RAW).decode(), RAW.hex().upper()]
ECHO = " ".join(LEAKS)
REPO = Path(__file__).resolve().parents[2]


class Stand:
    """An engine that echoes the key on every route, and a forwarder to it, on a loop thread."""

    def __init__(self):
        self.seen: list[tuple[str, str | None]] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.address = self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self):
        async def echo(request):
            self.seen.append((request.raw_path, request.headers.get("Accept-Encoding")))
            tail = request.match_info["tail"]
            if tail == "split":  # the key cut in two chunks, the second sent after a pause
                resp = web.StreamResponse(headers={"X-Echo": f"Bearer {SECRET}"})
                await resp.prepare(request)
                await resp.write(b"data: " + SECRET[:17].encode())
                await asyncio.sleep(0.2)
                await resp.write(SECRET[17:].encode() + b"\n\n")
                await resp.write_eof()
                return resp
            if tail == "big":  # longer than the forwarder buffers, the key at its end too
                return web.Response(body=b"x" * BUFFER_BYTES + ECHO.encode(), headers={"X-Echo": SECRET})
            if tail == "gzip":  # encoded although identity was asked
                return web.Response(body=gzip.compress(ECHO.encode()), headers={"Content-Encoding": "gzip"})
            body = {"api_key": SECRET, "path": request.raw_path, "echo": ECHO}
            return web.json_response(
                body, reason=f"OK {SECRET}", headers={"X-Echo": f"Bearer {SECRET}", SECRET: "1"}
            )

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", echo)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        upstream = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.logs: list[str] = []
        self.fwd = KeyForwarder([upstream], key=KEY, log=self.logs.append)
        (address,) = await self.fwd.start()
        return address

    def raw(self, target: str, method: str = "GET") -> bytes:
        """The forwarder's whole answer to ``METHOD target HTTP/1.1``, sent byte for byte."""
        host, port = self.address.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            out = b""
            while chunk := s.recv(1 << 16):
                out += chunk
        return out

    def close(self):
        async def stop():
            await self.fwd.stop()
            await self.runner.cleanup()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def stand():
    s = Stand()
    yield s
    s.close()


def leaks(answer: bytes) -> list[str]:
    return [leak for leak in LEAKS if leak.encode() in answer]


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> bytes:
    head, _, rest = answer.partition(b"\r\n\r\n")
    if b"Transfer-Encoding: chunked" not in head:
        return rest
    out = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            return out
        out, rest = out + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


# The paths that an HTTP client normalises to /server_info (and SGLang answers with its api_key).
DODGES = ["/./server_info", "/a/../server_info", "/%2e/server_info", "/v1/../server_info"]
DODGES += ["//server_info", "/server_info/.", "/%2E%2e/server_info", "/server%5Finfo", "/server_info%2F"]


@pytest.mark.parametrize("target", DODGES)
def test_a_path_not_in_normal_form_is_refused_and_never_reaches_the_engine(stand, target):
    before = len(stand.seen)
    answer = stand.raw(target)
    assert status(answer) == 400 and b"bad path" in answer
    assert len(stand.seen) == before and leaks(answer) == []


@pytest.mark.parametrize(
    "target", ["/server_info", "/get_server_info", "/v1/models", "/generate?x=1", "/", "/health"]
)
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_no_answer_of_an_engine_that_echoes_the_key_carries_it(stand, target, method):
    answer = stand.raw(target, method)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert status(answer) == 200 and leaks(answer) == []
    assert b"<redacted>" in head and body.count(b"<redacted>") == 1 + len(LEAKS)  # api_key + echo
    assert stand.seen[-1] == (target, "identity")  # asked unencoded, so the body could be checked


def test_head_keeps_its_length_and_shows_no_key(stand):
    answer = stand.raw("/server_info", "HEAD")
    assert status(answer) == 200 and b"Content-Length: " in answer and leaks(answer) == []


def test_streamed_and_long_answers_are_redacted_across_chunks(stand):
    answer = stand.raw("/split")  # chunked: the key's two halves arrive 0.2 s apart
    assert leaks(answer) == [] and body_of(answer) == b"data: <redacted>\n\n"
    answer = stand.raw("/big")
    assert leaks(answer) == [] and b"Transfer-Encoding: chunked" in answer
    # (base64 padding stays: the unpadded text is the secret)
    assert body_of(answer) == b"x" * BUFFER_BYTES + b"<redacted> <redacted> <redacted>= <redacted>"


def test_an_encoded_answer_is_a_502_not_a_body_we_cannot_check(stand):
    answer = stand.raw("/gzip")
    assert status(answer) == 502 and b"Content-Encoding 'gzip'" in answer and leaks(answer) == []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["server_info", ".", "..", "%2e", "%2E", "", "v1", "%2F", "%5F", "a;b"])))
def test_no_request_target_gets_the_key(stand, segments):
    answer = stand.raw("/" + "/".join(segments))
    assert status(answer) in (200, 400) and leaks(answer) == []
    assert not [line for line in stand.logs if any(leak in line for leak in LEAKS)]


def test_normal_form():
    for ok in ("/", "/server_info", "/v1/chat/completions", "/a%20b", "/x/", "/a;b", "/%25"):
        assert path_problem(ok) is None, ok
    for bad in DODGES + ["server_info", "/a\\..\\server_info", "/%7e", "/a/%2e%2e"]:
        assert path_problem(bad) is not None, bad


def test_the_redactor_catches_a_secret_split_anywhere_and_holds_nothing_else():
    text = f"a {KEY} b {SEED.hex()} c\n".encode()
    for cut in range(len(text)):
        r = Redactor(KEY)
        out = r.feed(text[:cut]) + r.feed(text[cut:]) + r.flush()
        assert out == b"a <redacted> b <redacted> c\n"
    r = Redactor(KEY)
    assert r.feed(b"first\n") == b"first\n"  # a line's end is never held
    assert Redactor(None).feed(KEY.encode()) == KEY.encode()  # keyless: nothing to hide


def test_every_derived_secret_of_the_project_is_redacted():
    """DERIVED_PURPOSES must name every purpose the code passes to ``derive`` for a secret."""
    purposes = set()
    for package in ("modal_rl", "slime_modal", "verl_modal", "benchmarks"):
        for path in (REPO / package).rglob("*.py"):
            if path.name == "redaction.py":  # derives each of DERIVED_PURPOSES to redact it
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "derive":
                    arg = node.args[1] if len(node.args) > 1 else None
                    assert isinstance(arg, ast.Constant), f"{path}: derive() with a computed purpose"
                    purposes.add(arg.value)
    assert "weightsync-ed25519-seed" in purposes  # the scan found the derive() calls
    missing = purposes - {"weightsync-run-id"} - set(DERIVED_PURPOSES)  # run-id: a public fingerprint
    assert not missing, f"add {sorted(missing)} to redaction.DERIVED_PURPOSES"
    forms = secret_forms(KEY)
    assert all(any(form in leak.encode() for form in forms) for leak in LEAKS)
