"""Round 3 (issue 35), item 7: a request that carries the engine bearer follows no redirect.

An engine (or whatever answers at its address) that replies ``302 Location: <elsewhere>`` must
not get the client to send ``Authorization`` there: the redirect target here is a real server
on loopback reached through a name ``key_safe_url`` refuses (``127.1``), which records the
headers it is sent.
"""

from __future__ import annotations

import http.server
import threading

import pytest

from modal_rl.engines.auth import key_safe_url
from modal_rl.engines.health import generation_probe, probe
from modal_rl.engines.vllm_push import EnginePushError, _post
from modal_rl.run_key import engine_bearer
from tests.weightsync_helpers import TEST_KEY


def _serve(handler_cls) -> tuple[http.server.ThreadingHTTPServer, int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


@pytest.fixture
def stand():
    seen: list[str | None] = []

    class Target(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _any(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _any

    target, tport = _serve(Target)
    elsewhere = f"http://127.1:{tport}/stolen"  # resolves to loopback; not an IP literal key_safe_url knows
    assert not key_safe_url(elsewhere)  # a URL the client would never send the bearer to

    class Redirector(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _any(self):
            self.send_response(302)  # urllib turns a redirected POST into a GET, headers kept
            self.send_header("Location", elsewhere)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = _any

    redirector, rport = _serve(Redirector)
    yield f"http://127.0.0.1:{rport}", seen
    target.shutdown()
    redirector.shutdown()


def test_the_health_probe_follows_no_redirect_with_the_bearer(stand):
    url, seen = stand
    ok, what = probe(url + "/health", timeout_s=5, key=TEST_KEY)
    assert not ok and what == "HTTP 302"
    ok, what = generation_probe(url, {"path": "/v1/completions", "body": {}}, TEST_KEY, timeout_s=5)
    assert not ok and "302" in what
    assert seen == []  # nothing, bearer or not, reached the redirect's target


def test_a_weight_push_follows_no_redirect_with_the_bearer(stand):
    url, seen = stand
    with pytest.raises(EnginePushError, match="HTTP 302"):
        _post(url, "/collective_rpc", {}, 5.0, TEST_KEY)
    assert seen == [] and engine_bearer(TEST_KEY) not in str(seen)


def test_the_verl_replica_proxy_follows_no_redirect_with_the_bearer(stand):
    """verl's engine proxy (aiohttp) posts with the bearer: a 302 is an error, never followed."""
    import asyncio

    pytest.importorskip("verl")
    from verl_modal.replica_proxy import VLLMHttpProxy

    url, seen = stand
    proxy = VLLMHttpProxy.__new__(VLLMHttpProxy)  # only its HTTP part: no engine is started
    proxy._session, proxy._headers = None, {"Authorization": f"Bearer {engine_bearer(TEST_KEY)}"}

    async def call():
        try:
            await proxy._post_to(url, "/collective_rpc", {})
        finally:
            await proxy._session.close()

    with pytest.raises(RuntimeError, match="HTTP 302"):
        asyncio.run(call())
    assert seen == []
