"""engine_auth.RunKeyAuth on a tiny Starlette app served by uvicorn on 127.0.0.1 (real sockets,
real HTTP and websocket clients); fast, no vLLM. The app counts every call that reaches it, so
"refused" also means "nothing ran"."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from modal_rl.engines.auth import MIDDLEWARE, RunKeyAuth, check_key_safe_url, key_safe_url
from modal_rl.run_key import engine_bearer, new_run_key
from tests.asgi_server import serve_on_loopback

KEY = new_run_key()
BEARER = engine_bearer(KEY)  # what the guard accepts: the run key's engine bearer
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def make_app(reached: list, healthy: dict):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route, WebSocketRoute

    async def state_change(request):
        reached.append((request.method, request.url.path))
        return JSONResponse({"changed": True, "secret_state": "x"})

    async def health(request):
        reached.append(("GET", "/health"))
        return Response(b"engine details", status_code=200 if healthy["ok"] else 503, headers={"x-vllm": "1"})

    async def ws(websocket):
        reached.append(("WS", "/ws"))
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/sleep", state_change, methods=["POST"]),
        Route("/collective_rpc", state_change, methods=["POST"]),
        Route("/v1/completions", state_change, methods=["POST"]),
        Route("/metrics", state_change, methods=["GET"]),
        WebSocketRoute("/ws", ws),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(RunKeyAuth, key=KEY)
    return app


@pytest.fixture(scope="module")
def server():

    reached: list = []
    healthy = {"ok": True}
    with serve_on_loopback(make_app(reached, healthy)) as url:
        yield url, reached, healthy


def call(url: str, method: str = "POST", headers: dict | None = None) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
    for k, v in (headers or {}).items():
        request.add_header(k, v)
    try:
        with NO_PROXY.open(request, timeout=10) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


BAD_HEADERS = [
    {},
    {"Authorization": "Bearer " + new_run_key()},
    {"Authorization": "Bearer " + BEARER[:-1]},
    {"Authorization": "Bearer " + KEY},  # the run key itself is no engine bearer (round 3)
    {"Authorization": "Bearer " + BEARER + "x"},
    {"Authorization": "Basic " + KEY},
    {"Authorization": KEY},
    {"Authorization": "Bearer"},
    {"X-Api-Key": KEY},
]


@pytest.mark.parametrize(
    "path, method",
    [
        ("/sleep", "POST"),
        ("/collective_rpc", "POST"),
        ("/v1/completions", "POST"),
        ("/metrics", "GET"),
        ("/nope", "GET"),
        ("/health", "POST"),
    ],
)
@pytest.mark.parametrize("headers", BAD_HEADERS, ids=range(len(BAD_HEADERS)))
def test_requests_without_the_key_are_refused_and_reach_nothing(server, path, method, headers):
    base, reached, _ = server
    before = len(reached)
    status, body, _ = call(base + path, method, headers)
    assert status == 401 and b"Bearer <engine bearer>" in body
    assert KEY.encode() not in body
    assert len(reached) == before


def test_requests_with_the_key_reach_the_app(server):
    base, reached, _ = server
    for path in ("/sleep", "/v1/completions"):
        status, body, _ = call(base + path, headers={"Authorization": "Bearer " + BEARER})
        assert status == 200 and json.loads(body)["changed"] is True
        assert reached[-1] == ("POST", path)
    assert (
        call(base + "/metrics", "GET", {"authorization": "bearer " + BEARER})[0] == 200
    )  # case of the scheme


def test_two_authorization_headers_are_refused_even_if_one_is_right(server):
    base, reached, _ = server
    before = len(reached)
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/sleep")
    conn.putheader("Authorization", "Bearer " + BEARER)
    conn.putheader("Authorization", "Bearer wrong")
    conn.putheader("Content-Length", "0")
    conn.endheaders()
    assert conn.getresponse().status == 401 and len(reached) == before
    conn.close()


def test_keyless_health_gives_the_status_only(server):
    base, reached, healthy = server
    status, body, headers = call(base + "/health", "GET")
    assert status == 200 and body == b"" and "x-vllm" not in {k.lower() for k in headers}
    assert reached[-1] == ("GET", "/health")  # it really asked the server
    healthy["ok"] = False
    try:
        status, body, _ = call(base + "/health", "GET")
        assert status == 503 and body == b""
    finally:
        healthy["ok"] = True
    status, body, headers = call(base + "/health", "GET", {"Authorization": "Bearer " + BEARER})
    assert status == 200 and body == b"engine details" and headers.get("x-vllm") == "1"


def ws_connect(base: str, headers: dict | None) -> str:
    from websockets.asyncio.client import connect

    async def go():
        async with connect(base.replace("http://", "ws://") + "/ws", additional_headers=headers or {}) as ws:
            return await ws.recv()

    return asyncio.run(go())


@pytest.mark.parametrize("headers", BAD_HEADERS[:3], ids=range(3))
def test_websocket_without_the_key_is_refused_before_accept(server, headers):
    from websockets.exceptions import InvalidStatus

    base, reached, _ = server
    before = len(reached)
    with pytest.raises(InvalidStatus) as info:
        ws_connect(base, headers)
    assert info.value.response.status_code == 403 and len(reached) == before


def test_a_websocket_is_refused_with_the_key_too(server):
    """No route the run uses is a websocket, so the bearer opens none (the allow-list)."""
    from websockets.exceptions import InvalidStatus

    base, reached, _ = server
    before = len(reached)
    with pytest.raises(InvalidStatus) as info:
        ws_connect(base, {"Authorization": "Bearer " + BEARER})
    assert info.value.response.status_code == 403 and len(reached) == before


def test_lifespan_passes_through():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["type"])

    asyncio.run(RunKeyAuth(app, key=KEY)({"type": "lifespan"}, None, None))
    assert calls == ["lifespan"]


def test_a_server_without_the_key_refuses_to_start(tmp_path):
    """As vLLM builds it: the dotted path, no key in the environment -> one line, exit 2."""
    code = (
        f"import importlib; m, _, c = {MIDDLEWARE!r}.rpartition('.'); "
        "getattr(importlib.import_module(m), c)(lambda *a: None)"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("MODAL_RL_RUN_KEY", "RAY_AUTH_TOKEN", "MODAL_RL_ENGINE_BEARER")
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to serve: MODAL_RL_ENGINE_BEARER is not set" in lines[0]
    assert RunKeyAuth(lambda *a: None, key=KEY)._digest  # with a key it builds


@pytest.mark.parametrize(
    "url, ok",
    [
        ("https://abc.modal.host", True),
        ("http://127.0.0.1:8000", True),
        ("http://127.0.0.9:1", True),
        ("http://[::1]:80", True),
        ("http://localhost:1", True),
        ("http://10.0.0.5:8000", False),
        ("http://abc.modal.host:443", False),
        ("ftp://127.0.0.1", False),
        ("127.0.0.1:8000", False),
    ],
)
def test_key_safe_url(url, ok):
    assert key_safe_url(url) is ok
    with contextlib.nullcontext() if ok else pytest.raises(ValueError, match="https://"):
        check_key_safe_url(url)
