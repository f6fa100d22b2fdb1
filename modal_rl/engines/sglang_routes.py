"""The engine guard's allow-list for SGLang, and how the guard goes in front of SGLang's app.

SGLang's own keys (``--api-key`` / ``--admin-api-key``, both the engine bearer) are all or
nothing: with the bearer, every route opens, its weight loaders and profilers too. So the
SGLang server also runs our guard (``auth.SglangKeyAuth``, this table): the bearer opens
generation, the read-only status routes slime and its router read, and the calls of the run's
own weight path (slime's disk path and ``SglangEngine.catch_up``: ``/pull_weights``,
``/update_weights_from_disk``, ``/pause_generation``, ``/flush_cache``,
``/continue_generation``), the two that take a path only when their body names a directory
this engine was launched to load from (``CHECK``: ``sglang_paths``); every other route — tensor, distributed, IPC and remote-instance
weight loading, weight-update groups, LoRA loading, memory release, profiling, logging and
internal-state routes, sessions, embeddings and scoring, schema pages, and any route a newer
SGLang adds — is answered 403 with the bearer too, before SGLang runs anything.

``auth.install_sglang_guard()`` adds the guard to ``sglang.srt.entrypoints.http_server.app``
in the process that then runs ``sglang.launch_server`` (``keyed_launch --guard=sglang``),
before the app starts. Only the single-process HTTP server serves that app object: with
``--tokenizer-worker-num`` > 1 (workers import the app afresh) or ``--enable-http2`` (another
server) the guard would not be in front, so ``refusal(argv)`` stops such a launch.

Invariants: ``verdict`` is a pure function of (method, path); a path not in ``ALLOWED`` or
``CHECKED`` is refused; the ``CHECKED`` routes are exactly ``sglang_paths.PATH_ROUTES`` (their
bodies, at most ``MAX_CHECKED_BODY`` bytes, are checked by ``sglang_paths.body_refusal``). The
table of every SGLang 0.5.15 route and its verdict is ``tests/engines/sglang_routes.json`` and
docs/security.md, pinned by ``tests/engines/test_sglang_routes.py``.
"""

from __future__ import annotations

import re

from modal_rl.engines import sglang_paths
from modal_rl.engines.routes import ALLOW, CHECK, OPEN, REFUSE

# (method, path) pairs the bearer opens on an SGLang server.
GENERATION = {
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{id}"),
    ("POST", "/v1/responses/{id}/cancel"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/abort_request"),  # slime aborts a rollout's requests
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/tokenize"),
    ("POST", "/v1/detokenize"),
    ("GET", "/health_generate"),  # slime's health monitor: a one-token generation
}
# Read-only status: slime reads the server's arguments of an external engine, its router the
# load and model; the run reads the weight version.
STATUS = {
    ("GET", "/v1/models"),
    ("GET", "/get_model_info"),
    ("GET", "/model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/server_info"),
    ("GET", "/get_load"),
    ("GET", "/v1/loads"),
    ("GET", "/get_weight_version"),
    ("GET", "/weight_version"),
    ("GET", "/ping"),
    ("GET", "/metrics"),
}
# The run's own weight path (slime's disk path, ``SglangEngine.catch_up``); the two routes that
# take a path are ``CHECKED``.
WEIGHT_PATH = {
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("GET", "/flush_cache"),
    ("POST", "/flush_cache"),
}
ALLOWED = frozenset(GENERATION | STATUS | WEIGHT_PATH)
CHECKED = frozenset(("POST", path) for path in sglang_paths.PATH_ROUTES)
MAX_CHECKED_BODY = sglang_paths.MAX_BODY
_ID_SEGMENT = re.compile(r"^/v1/responses/[^/]+(/cancel)?$")
GUARD = "sglang"
# Flags under which SGLang serves something other than the app object the guard is installed on.
_UNGUARDED = {
    "--tokenizer-worker-num": "several tokenizer workers each import SGLang's app afresh",
    "--enable-http2": "the HTTP/2 server does not serve the guarded app",
}


def verdict(method: str, path: str) -> str:
    """``OPEN``, ``ALLOW``, ``CHECK`` or ``REFUSE`` for a request to ``path`` (root path stripped)."""
    if method == "GET" and path == "/health":
        return OPEN
    if _ID_SEGMENT.match(path):
        path = re.sub(r"^/v1/responses/[^/]+", "/v1/responses/{id}", path)
    if (method, path) in CHECKED:
        return CHECK
    return ALLOW if (method, path) in ALLOWED else REFUSE


def refusal(argv: list[str]) -> str | None:
    """Why SGLang started with ``argv`` would serve without the guard in front, or None."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag not in _UNGUARDED:
            continue
        if flag == "--tokenizer-worker-num":
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            if value.strip() in ("", "1"):
                continue
        return f"{arg}: {_UNGUARDED[flag]}, so modal_rl's route guard would not be in front; drop it"
    return None
