"""A reverse proxy that adds the run's key: for clients that cannot send one (slime).

``KeyForwarder(upstreams, host=...)`` listens on one port of ``host`` per upstream engine
(``https://<tunnel>`` or ``http://host:port``) and forwards every request it gets there, any
method and path, to that engine with ``Authorization: Bearer <run key>`` in place of whatever
the client sent. Bodies stream both ways (request bodies are not buffered, responses are
relayed chunk by chunk as they arrive), so large weight-sync payloads and streamed generations
pass through at their own pace; a client that goes away closes the upstream request too.

``python -m modal_rl.cluster.key_forwarder --listen HOST --upstream URL [--upstream URL]...
[--allow-peer ADDR]...`` runs one until SIGTERM; it prints one JSON line
``{"addresses": ["http://HOST:PORT", ...]}`` (upstream order) on stdout once it listens, and
logs only to stderr. The key comes from ``MODAL_RL_RUN_KEY``, never from a flag.

Invariants:
- the forwarder is a credential: whoever reaches its port uses the engines with the run's key.
  So it never binds a wildcard address (``0.0.0.0``, ``::``); a non-loopback address needs an
  allow-list of peer addresses (the cluster's nodes), and other peers get 403 and nothing is
  forwarded;
- the key is never logged, never put in an error, and never returned to a client: responses of
  the info routes (``REDACT_PATHS``: SGLang's ``/server_info`` reports ``api_key`` and its launch
  command) are read whole and every occurrence of the key is replaced by ``<redacted>``;
- hop-by-hop headers (RFC 9110 7.6.1) are not forwarded; everything else passes unchanged,
  content encodings included (no decompression on the way).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import signal
import sys
from urllib.parse import urlparse

from modal_rl.run_key import REDACTED, MissingRunKeyError, run_key

REDACT_PATHS = frozenset({"/server_info", "/get_server_info"})
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
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
        raise ValueError(f"upstream {url!r}: need http(s)://host[:port] with no path")
    return url.rstrip("/")


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
        log=None,
    ):
        if not upstreams:
            raise ValueError("KeyForwarder: no upstream engines")
        check_listen(host, allow_peers)
        self.upstreams = [check_upstream(u) for u in upstreams]
        self.host = host
        self._key = key if key is not None else run_key()
        self._allowed = None if allow_peers is None else {_ip(p) for p in allow_peers}
        self.ports = list(ports) if ports is not None else [0] * len(upstreams)
        if len(self.ports) != len(self.upstreams):
            raise ValueError("KeyForwarder: one port per upstream")
        self.connect_timeout_s = connect_timeout_s
        self.addresses: list[str] = []
        self._runners: list = []
        self._session = None
        self._log = log or (lambda line: print(f"[key_forwarder] {line}", file=sys.stderr, flush=True))

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
            for upstream, port in zip(self.upstreams, self.ports, strict=True):
                app = web.Application(client_max_size=0)
                app.router.add_route("*", "/{tail:.*}", self._handler(upstream))
                runner = web.AppRunner(app, access_log=None, handle_signals=False)
                await runner.setup()
                self._runners.append(runner)
                site = web.TCPSite(runner, self.host, port)
                await site.start()
                bound = site._server.sockets[0].getsockname()[1]
                host = f"[{self.host}]" if ":" in self.host else self.host
                self.addresses.append(f"http://{host}:{bound}")
        except BaseException:
            await self.stop()
            raise
        return list(self.addresses)

    async def stop(self) -> None:
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        self.addresses = []

    def _peer_allowed(self, remote: str | None) -> bool:
        if self._allowed is None:
            return True
        try:
            return remote is not None and _ip(remote) in self._allowed
        except ValueError:
            return False

    def _handler(self, upstream: str):
        from aiohttp import web

        async def handle(request: web.Request) -> web.StreamResponse:
            if not self._peer_allowed(request.remote):
                self._log(
                    f"refused {request.method} {request.path} from {request.remote}: not an allowed peer"
                )
                return web.json_response({"error": "forbidden: not a cluster node"}, status=403)
            return await self._forward(request, upstream)

        return handle

    async def _forward(self, request, upstream: str):
        import aiohttp
        from aiohttp import web

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers["Authorization"] = f"Bearer {self._key}"
        redact = request.path in REDACT_PATHS
        if redact:
            headers["Accept-Encoding"] = "identity"  # the key must be findable in the body
        body = request.content if request.body_exists else None
        resp = None
        try:
            async with self._session.request(
                request.method,
                upstream + request.rel_url.raw_path_qs,
                headers=headers,
                data=body,
                allow_redirects=False,
            ) as up:
                out_headers = [
                    (k, v) for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP | {"content-length"}
                ]
                if redact:
                    data = (await up.read()).replace(self._key.encode(), REDACTED.encode())
                    done = web.Response(status=up.status, reason=up.reason, body=data)
                    done.headers.extend(out_headers)
                    return done
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                resp.headers.extend(out_headers)
                if up.content_length is not None:
                    resp.content_length = up.content_length
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}".replace(self._key, REDACTED)
            self._log(f"{request.method} {request.path} -> {urlparse(upstream).netloc} failed: {why}")
            if resp is not None:  # the response had started: dropping the connection is all we can say
                raise
            return web.json_response({"error": f"engine unreachable: {why}"}, status=502)


async def _serve(args: argparse.Namespace) -> None:
    forwarder = KeyForwarder(args.upstream, host=args.listen, allow_peers=args.allow_peer or None)
    await forwarder.start()
    print(json.dumps({"addresses": forwarder.addresses}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await forwarder.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m modal_rl.cluster.key_forwarder", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--listen", default="127.0.0.1", help="address to listen on (never a wildcard)")
    ap.add_argument("--upstream", action="append", required=True, help="engine base URL; one port each")
    ap.add_argument("--allow-peer", action="append", default=[], help="peer address allowed to connect")
    args = ap.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except (ValueError, MissingRunKeyError, OSError) as exc:
        print(f"key_forwarder: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
