"""A reverse proxy that adds the run's key: for clients that cannot send one (slime).

``KeyForwarder(upstreams, host=...)`` listens on one port of ``host`` per upstream engine
(``https://<tunnel>`` or ``http://host:port``) and forwards every request it gets there, any
method and path, to that engine with ``Authorization: Bearer <engine bearer>`` in place of whatever
the client sent (the engine bearer derived from it, ``run_key.engine_bearer``). Bodies stream both ways (request bodies are not buffered, responses are
relayed chunk by chunk as they arrive), so large weight-sync payloads and streamed generations
pass through at their own pace; a client that goes away closes the upstream request too.

``python -m modal_rl.engines.key_forwarder --listen HOST --upstream URL [--upstream URL]...
[--allow-peer ADDR]... [--routes FILE]`` runs one until SIGTERM; it prints one JSON line
``{"addresses": ["http://HOST:PORT", ...]}`` (upstream order) on stdout once it listens, and
logs only to stderr. It holds only the engine bearer (``run_key.engine_bearer``), from
``MODAL_RL_ENGINE_BEARER`` (its launcher gives it that and no run key), never from a flag.

Routes: a port keeps its address for the whole run, while the engine behind it may change
(a replaced engine has a new address). ``route(i, url)`` points port ``i`` at another engine;
``route(i, None)`` holds its requests (the engine is being replaced and must not take traffic
before it has the current weights) until a route is set again, up to ``hold_s`` (then 503).
``--routes FILE`` does the same from a JSON file ``{"upstreams": [url or null, ...]}`` (one
per port, written atomically by whoever replaces engines), checked every ``ROUTES_POLL_S``.

Invariants:
- the forwarder is a credential: whoever reaches its port uses the engines with the run's key.
  So it never binds a wildcard address (``0.0.0.0``, ``::``); a non-loopback address needs an
  allow-list of peer addresses (the cluster's nodes); another peer's connection is closed at
  accept, before a byte of it is read (and a request that got in anyway gets 403); loopback
  implies nothing: a loopback peer must be a socket of this process's own user
  (``peer_creds``), whatever the allow-list says;
- admission: an allowed connection holds a slot (``modal_rl.admission``) until its first
  request's headers arrive, at most ``HEADER_DEADLINE_S``;
- the key is never logged, never put in an error, and never returned to a client: every answer,
  whatever the route (SGLang's ``/server_info`` reports ``api_key``, its launch command, and any
  route may echo it), has the key and the keys derived from it (``redaction.secret_forms``) replaced by
  ``<redacted>`` in its status line, its headers and its body, streamed bodies included
  (``redaction.Redactor.feed`` also catches a key split across chunks). Engines are asked for
  ``Accept-Encoding: identity`` so bodies stay readable; an encoded answer gets 502;
- only paths in normal form are forwarded (``path_problem``): a dot segment, an empty segment, an
  encoded separator or a percent-encoding the HTTP client would rewrite gets 400, so the path the
  engine sees is byte for byte the one the client sent;
- hop-by-hop headers (RFC 9110 7.6.1) are not forwarded. A body whose length the engine declared
  and that fits ``BUFFER_BYTES`` keeps an exact ``Content-Length``; longer or open-ended ones are
  relayed chunked (redaction may change their length).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

from modal_rl.admission import Admission, peer_host
from modal_rl.cluster import peer_creds
from modal_rl.cluster.redaction import Redactor
from modal_rl.engines.auth import key_safe_url
from modal_rl.run_key import MissingRunKeyError, engine_bearer, engine_bearer_from_env
from modal_rl.text_safety import clean

BUFFER_BYTES = 1 << 20
# Admission (``modal_rl.admission``): a connection has HEADER_DEADLINE_S to send its first
# request's headers; the caps are wide because slime's router opens hundreds of connections
# from one address at once, and the allow-list already closed every other peer at accept.
HEADER_DEADLINE_S = 10.0
MAX_UNADMITTED = 1024
MAX_UNADMITTED_PER_PEER = 256
KEEPALIVE_S = 30.0
ROUTES_POLL_S = 0.2
_NO_BODY = (204, 304)
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Expect",
    )
)
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "authorization"}


def path_problem(raw_path: str) -> str | None:
    """Why ``raw_path`` (as the client sent it, percent-encoding kept) is not in normal form, or
    None when it is. Normal form: what the engine is sent is byte for byte what was checked, and
    no server on the way can read it as another route (no ``.``/``..`` or empty segment, no
    encoded ``/`` or ``\\``, no percent-encoding yarl would rewrite)."""
    from yarl import URL

    if not raw_path.startswith("/"):
        return "does not start with /"
    if "//" in raw_path:
        return "has an empty segment (//)"
    lowered = raw_path.lower()
    if "\\" in raw_path or "%2f" in lowered or "%5c" in lowered:
        return "encodes a path separator"
    if any(unquote(seg) in (".", "..") for seg in raw_path.split("/")):
        return "has a dot segment"
    if URL("http://engine" + raw_path).raw_path != raw_path:  # what aiohttp's client would send
        return "is not in canonical percent-encoding"
    return None


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def check_listen(host: str, allow_peers: list[str] | None) -> None:
    """ValueError unless ``host`` is a concrete address, and a non-loopback one has an allow-list."""
    try:
        ip = _ip(host)
    except ValueError:
        raise ValueError(f"listen address {host!r}: give an IP address (127.0.0.1 or the node's)") from None
    if ip.is_unspecified:
        raise ValueError(
            f"listen address {host}: a wildcard would offer the run's key to every network; "
            "use 127.0.0.1 or the node's cluster address"
        )
    if not ip.is_loopback and not allow_peers:
        raise ValueError(
            f"listen address {host} is not loopback: give the peers allowed to use it (the cluster's nodes)"
        )


def check_upstream(url: str) -> str:
    """``url`` without its trailing slash; ValueError unless it is an engine base URL the
    bearer may go to: https, or plain http to loopback only (``auth.key_safe_url``)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
        raise ValueError(f"upstream {url!r}: need http(s)://host[:port] with no path")
    if not key_safe_url(url):
        raise ValueError(
            f"upstream {url!r}: the engine bearer goes only over https:// or to a loopback http:// "
            "address; use the engine's TLS tunnel URL"
        )
    return url.rstrip("/")


class _Gated(asyncio.Protocol):
    """aiohttp's protocol behind ``on_accept``: a connection it refuses never reaches aiohttp."""

    def __init__(self, inner, on_accept) -> None:
        self.inner, self.on_accept, self.open = inner, on_accept, False

    def connection_made(self, transport) -> None:
        self.open = self.on_accept(transport)
        if self.open:
            self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.open:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.open else None

    def connection_lost(self, exc) -> None:
        if self.open:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.open:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.open:
            self.inner.resume_writing()


class KeyForwarder:
    """One listening port per upstream; ``start`` returns ``http://host:port`` for each, in order."""

    def __init__(
        self,
        upstreams: list[str],
        *,
        host: str = "127.0.0.1",
        key: str | None = None,
        allow_peers: list[str] | None = None,
        ports: list[int] | None = None,
        connect_timeout_s: float = 30.0,
        hold_s: float = 1800.0,
        log=None,
    ):
        if not upstreams:
            raise ValueError("KeyForwarder: no upstream engines")
        check_listen(host, allow_peers)
        self.upstreams: list[str | None] = [check_upstream(u) for u in upstreams]
        self.hold_s = hold_s
        self.host = host
        # Only the engine bearer is kept (``key``: the run key, whose bearer it derives; default:
        # ``MODAL_RL_ENGINE_BEARER``, what its launcher gives it): a forwarder holds nothing else.
        self._key = engine_bearer(key) if key is not None else engine_bearer_from_env()
        self._redactor = Redactor(
            None, (self._key,)
        )  # stateless use only (bytes/text); streams get their own
        self._allowed = None if allow_peers is None else {_ip(p) for p in allow_peers}
        self.ports = list(ports) if ports is not None else [0] * len(upstreams)
        if len(self.ports) != len(self.upstreams):
            raise ValueError("KeyForwarder: one port per upstream")
        self.connect_timeout_s = connect_timeout_s
        self.addresses: list[str] = []
        self._runners: list = []
        self._listeners: list = []
        self.unadmitted = Admission(MAX_UNADMITTED, MAX_UNADMITTED_PER_PEER, "key-forwarder connection")
        self._session = None
        sink = log or (lambda line: print(f"[key_forwarder] {line}", file=sys.stderr, flush=True))
        # A client may put the key, or terminal escapes, in a path: redacted, then cleaned.
        self._log = lambda line: sink(clean(self._redactor.text(line)))

    async def start(self) -> list[str]:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,  # bytes pass through as the engine sent them
            trust_env=False,  # an http_proxy in the job's env must not see the key
        )
        try:
            for index, port in enumerate(self.ports):
                app = web.Application(client_max_size=0)
                app.router.add_route("*", "/{tail:.*}", self._handler(index))
                runner = web.AppRunner(
                    app, access_log=None, handle_signals=False, keepalive_timeout=KEEPALIVE_S
                )
                await runner.setup()
                self._runners.append(runner)
                # Our own listener, so that a peer is judged at accept (``_admit``), before
                # aiohttp reads a byte of it.
                listener = await asyncio.get_running_loop().create_server(
                    self._admit(runner.server), self.host, port, reuse_address=True
                )
                self._listeners.append(listener)
                bound = listener.sockets[0].getsockname()[1]
                host = f"[{self.host}]" if ":" in self.host else self.host
                self.addresses.append(f"http://{host}:{bound}")
        except BaseException:
            await self.stop()
            raise
        return list(self.addresses)

    async def stop(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener.close()
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        self.addresses = []

    def _admit(self, make_protocol):
        """A protocol factory around aiohttp's: at accept, a peer outside the allow-list is
        closed before a byte is read, and every other connection holds an admission slot
        until its first request's headers arrive (``handle`` releases it), at most
        ``HEADER_DEADLINE_S``."""
        loop = asyncio.get_running_loop()
        admission = self.unadmitted

        def on_accept(transport) -> bool:
            peer = peer_host(transport)
            why = None
            if not self._peer_allowed(peer):
                why = "not an allowed peer"
            elif peer_creds.is_loopback(peer):  # loopback is every local user: ours only
                uid = peer_creds.peer_uid(
                    transport.get_extra_info("sockname"), transport.get_extra_info("peername")
                )
                why = None if peer_creds.is_ours(uid) else f"a loopback peer of another user (uid {uid})"
            if why is not None:
                transport.abort()
                self._log(f"closed a connection from {peer} at accept: {why}")
                return False
            slot = admission.hold(transport)

            def deadline() -> None:
                if id(slot) in admission.slots:
                    admission.release(slot)
                    transport.abort()

            loop.call_later(HEADER_DEADLINE_S, deadline)
            return True

        def protocol():
            return _Gated(make_protocol(), on_accept)

        return protocol

    def _peer_allowed(self, remote: str | None) -> bool:
        if self._allowed is None:
            return True
        try:
            return remote is not None and _ip(remote) in self._allowed
        except ValueError:
            return False

    def route(self, index: int, upstream: str | None) -> None:
        """Port ``index`` forwards to ``upstream`` from now on; None holds its requests."""
        self.upstreams[index] = None if upstream is None else check_upstream(upstream)

    async def _upstream(self, index: int) -> str | None:
        deadline = time.monotonic() + self.hold_s
        while self.upstreams[index] is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.upstreams[index]

    async def watch_routes(self, path: str) -> None:
        """Apply ``path``'s routes whenever the file changes (module docstring); runs until cancelled."""
        seen = None
        while True:
            stamp = None
            try:
                stamp = os.stat(path).st_mtime_ns
                if stamp != seen:
                    routes = json.loads(Path(path).read_text())["upstreams"]
                    if len(routes) != len(self.upstreams):
                        raise ValueError(f"{len(routes)} routes for {len(self.upstreams)} ports")
                    for index, upstream in enumerate(routes):
                        if upstream != self.upstreams[index]:
                            self.route(index, upstream)
                            where = urlparse(upstream).netloc if upstream else "held (engine being replaced)"
                            self._log(f"port {index} -> {where}")
                    seen = stamp
            except FileNotFoundError:
                pass
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self._log(f"routes file {path}: {exc}; keeping the current routes")
                seen = stamp
            await asyncio.sleep(ROUTES_POLL_S)

    def _handler(self, index: int):
        from aiohttp import web

        async def handle(request: web.Request) -> web.StreamResponse:
            self.unadmitted.release_transport(request.transport)
            if not self._peer_allowed(request.remote):
                self._log(
                    f"refused {request.method} {request.path} from {request.remote}: not an allowed peer"
                )
                return web.json_response({"error": "forbidden: not a cluster node"}, status=403)
            upstream = await self._upstream(index)
            if upstream is None:
                return web.json_response(
                    {"error": f"engine {index} is being replaced; no route within {self.hold_s:g} s"},
                    status=503,
                )
            return await self._forward(request, upstream)

        return handle

    async def _forward(self, request, upstream: str):
        import aiohttp
        from aiohttp import web
        from yarl import URL

        raw_path = request.rel_url.raw_path
        problem = path_problem(raw_path)
        if problem is not None:
            self._log(f"refused {request.method} {raw_path}: the path {problem}")
            return web.json_response({"error": f"bad path: it {problem}; send it in normal form"}, status=400)
        # encoded=True: sent exactly as checked above, with no further rewriting by the client.
        target = URL(upstream + request.rel_url.raw_path_qs, encoded=True)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers["Authorization"] = f"Bearer {self._key}"
        headers["Accept-Encoding"] = "identity"  # the key must be findable in every body
        body = request.content if request.body_exists else None
        started: list[bool] = []  # non-empty once the answer's head went out to the client
        try:
            async with self._session.request(
                request.method, target, headers=headers, data=body, allow_redirects=False
            ) as up:
                return await self._answer(request, up, started)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            why = self._redactor.text(f"{type(exc).__name__}: {exc}")
            self._log(f"{request.method} {raw_path} -> {urlparse(upstream).netloc} failed: {why}")
            if started:  # the answer had started: dropping the connection is all we can say
                raise
            return web.json_response({"error": f"engine unreachable: {why}"}, status=502)

    async def _answer(self, request, up, started: list[bool]):
        """The engine's answer ``up``, relayed with every secret form of the key replaced."""
        from aiohttp import web

        text = self._redactor.text
        has_body = request.method != "HEAD" and up.status not in _NO_BODY
        encoding = up.headers.get("Content-Encoding", "identity").strip().lower()
        if has_body and encoding not in ("", "identity"):
            self._log(f"{request.method} {request.rel_url.raw_path}: engine answered {encoding!r} encoded")
            return web.json_response(
                {
                    "error": f"engine answered with Content-Encoding {encoding!r} although identity was "
                    "asked; its body cannot be checked for the run key"
                },
                status=502,
            )
        out_headers = [
            (text(k), text(v))
            for k, v in up.headers.items()
            if k.lower() not in _HOP_BY_HOP | {"content-length"}
        ]
        reason = text(up.reason or "") or None
        if has_body and up.content_length is not None and up.content_length <= BUFFER_BYTES:
            data = self._redactor.bytes(await up.read())
            done = web.Response(status=up.status, reason=reason, body=data)
            done.headers.extend(out_headers)
            return done
        resp = web.StreamResponse(status=up.status, reason=reason)
        resp.headers.extend(out_headers)
        if not has_body and up.content_length is not None:
            resp.content_length = up.content_length  # HEAD: the length of the GET answer
        started.append(True)
        await resp.prepare(request)
        if has_body:
            stream = Redactor(None, (self._key,))
            async for chunk in up.content.iter_any():
                out = stream.feed(chunk)
                if out:
                    await resp.write(out)
            tail = stream.flush()
            if tail:
                await resp.write(tail)
        await resp.write_eof()
        return resp


async def _serve(args: argparse.Namespace) -> None:
    forwarder = KeyForwarder(args.upstream, host=args.listen, allow_peers=args.allow_peer or None)
    await forwarder.start()
    print(json.dumps({"addresses": forwarder.addresses}), flush=True)
    watcher = asyncio.create_task(forwarder.watch_routes(args.routes)) if args.routes else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        await forwarder.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m modal_rl.engines.key_forwarder", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--listen", default="127.0.0.1", help="address to listen on (never a wildcard)")
    ap.add_argument("--upstream", action="append", required=True, help="engine base URL; one port each")
    ap.add_argument("--allow-peer", action="append", default=[], help="peer address allowed to connect")
    ap.add_argument("--routes", help="JSON file of the current upstream per port (null: hold requests)")
    args = ap.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except (ValueError, MissingRunKeyError, OSError) as exc:
        print(f"key_forwarder: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
