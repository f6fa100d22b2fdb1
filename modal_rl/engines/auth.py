"""The engine servers' key guard: every request needs ``Authorization: Bearer <engine bearer>``.

The engine bearer is ``run_key.engine_bearer(run key)``, a key derived for this one use: an
engine holds it (``MODAL_RL_ENGINE_BEARER``) and never the run key, so whoever reads it (an
engine's log, a proxy) opens the run's engines and nothing else: no frame-server handshake, no
frame MAC, no Ray token (``tests/core/test_capabilities.py``).

vLLM loads it with ``--middleware modal_rl.engines.auth.RunKeyAuth`` (vLLM imports the
dotted path and, for a class, calls ``app.add_middleware(cls)``; added last, it wraps every
route, mounted apps such as ``/metrics`` included, and runs before CORS and vLLM's own
``--api-key`` check, which guards only ``/v1``). ``vllm_auth_args()`` gives the flag. The key
is read from ``MODAL_RL_ENGINE_BEARER`` (else derived from ``MODAL_RL_RUN_KEY``) in the
server's environment, never from a flag.

Invariants:
- the bearer opens only what the guard's route table allows (``routes`` for vLLM: generation,
  the control routes the run calls, ``modal_rl_*`` collective RPCs, LoRA loads from the staging
  directory by a safe name; ``sglang_routes`` for SGLang, through ``SglangKeyAuth``, whose two
  path-taking weight routes pass only paths under the engine's weight directories,
  ``sglang_paths``); every other route is answered 403 here with the bearer too, and a
  websocket is closed;
- a checked route's body over the table's ``MAX_CHECKED_BODY`` is refused, by its
  ``Content-Length`` before any of it is read;
- every ``http`` and ``websocket`` request without the right key is answered here (HTTP 401
  with a short body; a websocket is closed before it is accepted, which clients see as HTTP
  403) and never reaches the server: no route runs, no state changes;
- the one exception is ``GET /health`` (exactly that path and method, no key): it reaches the
  server and the caller gets only its status code (200 healthy, 503 not), with an empty body
  and no headers of the server's, so it reveals liveness and nothing else;
- keys are compared in constant time over their SHA-256 digests (no length leak);
- a server without a key does not start: building the guard without ``MODAL_RL_RUN_KEY`` exits
  with one line naming the fix;
- clients send the bearer only over TLS or to a loopback address (``key_safe_url``), through
  ``KEYED_OPENER``, which follows no redirect (a 302 would carry the header elsewhere).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import sys
import urllib.request
from urllib.parse import urlparse

from modal_rl.engines import routes as engine_routes
from modal_rl.engines import sglang_paths, sglang_routes
from modal_rl.run_key import (
    ENGINE_BEARER_ENV,
    MissingRunKeyError,
    engine_bearer,
    engine_bearer_from_env,
    same,
)
from modal_rl.text_safety import clean

MIDDLEWARE = "modal_rl.engines.auth.RunKeyAuth"
OPEN_HEALTH_PATH = "/health"
REFUSED_BODY = b'{"error":"unauthorized: this engine needs Authorization: Bearer <engine bearer>"}'
# RFC 6455 "policy violation": the close code for a refused websocket handshake.
WS_POLICY_VIOLATION = 1008


def vllm_auth_args() -> list[str]:
    """The ``vllm serve`` flags that put every route behind the run's key (no key on them)."""
    return ["--middleware", MIDDLEWARE]


def bearer_header(key: str) -> dict[str, str]:
    """The header a client holding the run key sends to an engine (its derived bearer)."""
    return token_header(engine_bearer(key))


def token_header(bearer: str) -> dict[str, str]:
    """The header for a process that holds only the engine bearer (an engine container, the
    key forwarder)."""
    return {"Authorization": f"Bearer {bearer}"}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect: a 3xx would carry ``Authorization`` to wherever it points,
    a URL ``key_safe_url`` never saw. The caller gets the 3xx as an ``HTTPError``."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


# The one opener for requests that carry the engine bearer: no proxy (the environment's
# proxy would see the header), no redirects.
KEYED_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def key_safe_url(url: str) -> bool:
    """Whether a client may send the run key to ``url``: TLS, or plain HTTP to loopback only
    (a cluster's private network is shared by its workspace, so it does not count)."""
    parsed = urlparse(url)
    if parsed.scheme == "https":
        return True
    if parsed.scheme != "http" or not parsed.hostname:
        return False
    if parsed.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parsed.hostname).is_loopback
    except ValueError:
        return False


def check_key_safe_url(url: str) -> None:
    """``ValueError`` (one line, no key) unless ``key_safe_url(url)``."""
    if not key_safe_url(url):
        raise ValueError(
            f"engine address {url!r}: the run key goes only over https:// or to a loopback "
            "http:// address; use the engine's TLS tunnel URL"
        )


class RunKeyAuth:
    """Pure ASGI middleware; see the module docstring. ``key``: the run key (the guard keeps
    only its engine bearer); default: the bearer from the environment. ``routes``: the
    allow-list (vLLM's; ``SglangKeyAuth`` has SGLang's)."""

    routes = engine_routes

    def __init__(self, app, key: str | None = None) -> None:
        self.app = app
        if key is not None:
            bearer = engine_bearer(key)
        else:
            try:
                bearer = engine_bearer_from_env()
            except MissingRunKeyError:
                # vLLM builds the middleware while it starts serving: exit, don't serve unguarded.
                print(
                    f"modal_rl.engines.auth: refusing to serve: {ENGINE_BEARER_ENV} is not "
                    "set in the engine's environment (start engines through modal_rl's engine pool, "
                    "which gives each its bearer)",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(2) from None
        self._digest = _digest(bearer.encode())

    def authorized(self, scope) -> bool:
        values = [v for k, v in scope.get("headers") or () if k.lower() == b"authorization"]
        if len(values) != 1:  # none, or an ambiguous pair that a proxy might read differently
            return False
        scheme, _, token = values[0].partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        return same(_digest(token.strip()), self._digest)

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan: the server's own start and stop
            return await self.app(scope, receive, send)
        if self.authorized(scope):
            return await self._allowed(scope, receive, send)
        if kind == "websocket":
            return await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION})
        if scope.get("method") == "GET" and _path(scope) == OPEN_HEALTH_PATH:
            return await self.app(scope, receive, _status_only(send))
        await _refuse(scope, receive, send)

    async def _allowed(self, scope, receive, send) -> None:
        """A request with the bearer: only the routes ``routes`` allows reach the
        server; a checked route's body is read and checked first, then replayed to it."""
        if scope["type"] == "websocket":  # no route of the run's is a websocket
            return await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION})
        path = _path(scope)
        rule = self.routes.verdict(scope.get("method", ""), path)
        if rule in (engine_routes.OPEN, engine_routes.ALLOW):
            return await self.app(scope, receive, send)
        if rule == engine_routes.REFUSE:
            return await _forbid(send, f"{scope.get('method')} {path} is not a route this run uses")
        limit = self.routes.MAX_CHECKED_BODY
        headers = list(scope.get("headers") or ())
        if _declared_length(headers) > limit:  # refused before a byte of the body is read
            return await _forbid(send, f"the body of {path} is over {limit} bytes")
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            if len(body) > limit:
                return await _forbid(send, f"the body of {path} is over {limit} bytes")
            if not message.get("more_body", False):
                break
        why = self.body_refusal(path, headers, body)
        if why is not None:
            return await _forbid(send, why)
        return await self.app(scope, _replay(body, receive), send)

    def body_refusal(self, path: str, headers: list, body: bytes) -> str | None:
        """Why a ``CHECK`` route's request is refused, or None (the route table's rule)."""
        return self.routes.body_refusal(path, headers, body)


class SglangKeyAuth(RunKeyAuth):
    """The guard with SGLang's allow-list (``sglang_routes``), in front of SGLang's own key
    check. ``weight_dirs``: where this engine may load weights from (``sglang_paths``);
    default: ``MODAL_RL_SGLANG_WEIGHT_DIRS`` in the environment (unset: no path passes)."""

    routes = sglang_routes

    def __init__(
        self, app, key: str | None = None, weight_dirs: sglang_paths.WeightDirs | None = None
    ) -> None:
        super().__init__(app, key=key)
        try:
            dirs = sglang_paths.WeightDirs.from_env() if weight_dirs is None else weight_dirs
            self.weight_dirs = dirs.resolved()
        except sglang_paths.WeightDirsError as exc:
            print(f"modal_rl.engines.auth: refusing to serve: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def body_refusal(self, path: str, headers: list, body: bytes) -> str | None:
        return sglang_paths.body_refusal(path, headers, body, self.weight_dirs)


def install_sglang_guard() -> None:
    """Put ``SglangKeyAuth`` in front of SGLang's HTTP app, in this process before SGLang
    starts serving it (``keyed_launch --guard=sglang``; ``sglang_routes``)."""
    from sglang.srt.entrypoints import http_server

    http_server.app.add_middleware(SglangKeyAuth)


def _declared_length(headers: list) -> int:
    """The request's ``Content-Length`` (0 when absent or unreadable: the read loop bounds it)."""
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _replay(body: bytes, receive):
    """``receive`` that gives the server the body the guard already read, then the client's."""
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


async def _forbid(send, why: str) -> None:
    body = json.dumps({"error": f"forbidden by modal_rl's engine guard: {clean(why)}"}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 403, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _path(scope) -> str:
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _status_only(send):
    """``send`` that passes the server's status on and drops its headers and body."""

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            await send(
                {
                    "type": "http.response.start",
                    "status": message["status"],
                    "headers": [(b"content-length", b"0")],
                }
            )
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            await send({"type": "http.response.body", "body": b""})

    return wrapped


async def _refuse(scope, receive, send) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(REFUSED_BODY)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": REFUSED_BODY})
