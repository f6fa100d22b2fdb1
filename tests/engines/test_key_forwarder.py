"""modal_rl.engines.key_forwarder: a real upstream on 127.0.0.1 that requires the Bearer key,
reached directly (refused) and through the forwarder (allowed), streaming both ways."""

from __future__ import annotations

import asyncio
import hashlib
import os

import aiohttp
import pytest
from aiohttp import web

from modal_rl.engines.key_forwarder import KeyForwarder, check_listen
from modal_rl.run_key import engine_bearer

KEY = "k3y-" + "x" * 40
BEARER = engine_bearer(KEY)  # what the forwarder sends: the engine bearer, not the run key
CHUNK = 1 << 20


class Upstream:
    """An aiohttp app that answers 401 without ``Bearer KEY``; records what it served."""

    def __init__(self):
        self.seen: list[tuple[str, str, str | None]] = []
        self.release = asyncio.Event()
        self.runner = None
        self.url = ""

    async def start(self):
        @web.middleware
        async def auth(request, handler):
            self.seen.append((request.method, request.path_qs, request.headers.get("Authorization")))
            if request.headers.get("Authorization") != f"Bearer {BEARER}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        async def info(request):
            return web.json_response(
                {"api_key": BEARER, "launch_command": f"serve --api-key {BEARER}", "tp_size": 1}
            )

        async def digest(request):  # reads the body as it streams in
            h, n = hashlib.sha256(), 0
            async for chunk in request.content.iter_any():
                h.update(chunk)
                n += len(chunk)
            return web.json_response(
                {"sha256": h.hexdigest(), "bytes": n, "query": request.rel_url.raw_query_string}
            )

        async def big(request):
            return web.Response(body=_blob(int(request.query["n"])))

        async def stream(request):  # first chunk, then wait for the client to have seen it
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"first\n")
            await asyncio.wait_for(self.release.wait(), 10)
            await resp.write(b"second\n")
            await resp.write_eof()
            return resp

        async def echo(request):
            return web.json_response({"method": request.method, "x": request.headers.get("X-Test")})

        app = web.Application(middlewares=[auth], client_max_size=1 << 30)
        app.router.add_get("/server_info", info)
        app.router.add_post("/digest", digest)
        app.router.add_get("/big", big)
        app.router.add_get("/stream", stream)
        app.router.add_route("*", "/echo", echo)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self):
        await self.runner.cleanup()


def _blob(n: int) -> bytes:
    return (hashlib.sha256(str(n).encode()).digest() * (n // 32 + 1))[:n]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _with(fn, **fwd_kwargs):
    up = await Upstream().start()
    logs: list[str] = []
    fwd = KeyForwarder([up.url], key=KEY, log=logs.append, **fwd_kwargs)
    (address,) = await fwd.start()
    try:
        async with aiohttp.ClientSession(trust_env=False) as client:
            return await fn(up, address, client, fwd, logs)
    finally:
        await fwd.stop()
        await up.stop()


def test_direct_without_key_is_refused_and_forwarded_is_allowed():
    async def body(up, address, client, fwd, logs):
        async with client.get(up.url + "/echo") as r:
            assert r.status == 401
        async with client.get(up.url + "/echo", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        # Through the forwarder: no key, or a wrong one, from the client; the forwarder's wins.
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for method in ("GET", "POST", "PUT", "DELETE"):
                async with client.request(method, address + "/echo", headers={**headers, "X-Test": "1"}) as r:
                    assert r.status == 200, await r.text()
                    assert await r.json() == {"method": method, "x": "1"}
        assert [a for _, _, a in up.seen[2:]] == [f"Bearer {BEARER}"] * 8
        assert not any(KEY in line for line in logs)

    run(_with(body))


def test_large_bodies_stream_both_ways():
    async def body(up, address, client, fwd, logs):
        n = 48 * CHUNK + 7

        async def gen():  # a chunked upload: the forwarder must not need a length
            data = _blob(n)
            for i in range(0, n, CHUNK):
                yield data[i : i + CHUNK]

        async with client.post(address + "/digest?a=1&b=%20x", data=gen()) as r:
            got = await r.json()
        assert got == {"sha256": hashlib.sha256(_blob(n)).hexdigest(), "bytes": n, "query": "a=1&b=%20x"}
        async with client.post(address + "/digest", data=_blob(n)) as r:  # with Content-Length
            assert (await r.json())["bytes"] == n
        async with client.get(address + f"/big?n={n}") as r:
            # Longer than the forwarder buffers: relayed chunked, as redaction may change its length.
            assert "Content-Length" not in r.headers and r.headers["Transfer-Encoding"] == "chunked"
            assert hashlib.sha256(await r.read()).digest() == hashlib.sha256(_blob(n)).digest()
        async with client.get(address + "/big?n=1000") as r:  # a short one keeps its exact length
            assert r.headers["Content-Length"] == "1000" and await r.read() == _blob(1000)

    run(_with(body))


def test_streamed_response_arrives_before_it_ends():
    async def body(up, address, client, fwd, logs):
        async with client.get(address + "/stream") as r:
            assert r.status == 200
            # The upstream sends "second" only after we saw "first": a buffering proxy deadlocks here.
            assert await asyncio.wait_for(r.content.readline(), 10) == b"first\n"
            up.release.set()
            assert await r.content.readline() == b"second\n"

    run(_with(body))


def test_info_routes_never_return_the_key():
    async def body(up, address, client, fwd, logs):
        async with client.get(address + "/server_info") as r:
            text = await r.text()
        assert r.status == 200 and BEARER not in text
        info = await _json(text)
        assert info["api_key"] == "<redacted>" and info["launch_command"] == "serve --api-key <redacted>"
        assert info["tp_size"] == 1

    run(_with(body))


async def _json(text):
    import json

    return json.loads(text)


def test_peers_outside_the_allow_list_are_closed_at_accept_and_nothing_is_forwarded():
    async def body(up, address, client, fwd, logs):
        # From 127.0.0.1, not allowed: closed at accept, before a byte of the request is read.
        with pytest.raises(aiohttp.ClientConnectionError):
            async with client.get(address + "/echo") as r:
                await r.read()
        assert up.seen == []
        assert any("127.0.0.1" in line and "not an allowed peer" in line for line in logs)
        conn = aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))
        async with (
            aiohttp.ClientSession(connector=conn, trust_env=False) as other,
            other.get(address + "/echo") as r,
        ):
            assert r.status == 200
        assert len(up.seen) == 1

    run(_with(body, allow_peers=["127.0.0.3"]))


def test_unreachable_engine_is_a_502_without_the_key():
    async def body():
        logs: list[str] = []
        fwd = KeyForwarder(["http://127.0.0.1:9"], key=KEY, log=logs.append)
        (address,) = await fwd.start()
        try:
            async with (
                aiohttp.ClientSession(trust_env=False) as client,
                client.get(address + "/server_info") as r,
            ):
                assert r.status == 502
                assert "engine unreachable" in (await r.json())["error"]
                assert KEY not in await r.text()
        finally:
            await fwd.stop()
        assert logs and not any(KEY in line for line in logs)

    run(body())


def test_listens_on_loopback_only():
    async def body(up, address, client, fwd, logs):
        import psutil

        listening = [
            c.laddr
            for c in psutil.Process(os.getpid()).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        port = int(address.rsplit(":", 1)[1])
        assert [la.ip for la in listening if la.port == port] == ["127.0.0.1"]
        assert all(la.ip.startswith("127.") for la in listening)

    run(_with(body))


@pytest.mark.parametrize(
    "host, peers, needle",
    [
        ("0.0.0.0", None, "wildcard"),
        ("::", ["10.0.0.2"], "wildcard"),
        ("10.0.0.1", None, "not loopback"),
        ("my-host", None, "give an IP address"),
    ],
)
def test_bad_listen_addresses_are_refused(host, peers, needle):
    with pytest.raises(ValueError, match=needle):
        check_listen(host, peers)
    with pytest.raises(ValueError, match=needle):
        KeyForwarder(["http://127.0.0.1:1"], host=host, key=KEY, allow_peers=peers)


def test_upstreams_must_be_base_urls():
    for bad in ("127.0.0.1:1", "ftp://a:1", "http://a:1/v1"):
        with pytest.raises(ValueError, match="upstream"):
            KeyForwarder([bad], key=KEY)


def test_plain_http_upstreams_off_loopback_are_refused():
    """Round 3: the bearer goes to an engine only over https or to loopback, at start and on
    every re-route (a replaced engine's new address)."""
    for bad in ("http://10.0.0.5:8000", "http://engine.internal:8000", "http://127.1:8000"):
        with pytest.raises(ValueError, match="goes only over https"):
            KeyForwarder([bad], key=KEY)
    fwd = KeyForwarder(["https://engine.modal.run", "http://127.0.0.1:8000"], key=KEY)
    with pytest.raises(ValueError, match="goes only over https"):
        fwd.route(0, "http://10.0.0.5:8000")
    assert fwd.upstreams == ["https://engine.modal.run", "http://127.0.0.1:8000"]
