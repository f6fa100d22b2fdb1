"""The engine guard's allow-list: which routes of a vLLM server the engine bearer opens.

The bearer opens generation and the few control routes the run itself calls; every other
route — vLLM's weight-loading, config, LoRA, dev, profiling and schema routes, and any route a
newer vLLM adds — is refused (HTTP 403) even with the bearer. Two allowed routes carry a body
that decides what they do, and the guard reads it (at most ``MAX_CHECKED_BODY`` bytes) before
the route runs:

- ``POST /collective_rpc`` runs any worker method by name: only our own ``modal_rl_*`` methods
  pass (vLLM's ``reload_weights``, ``update_config``, ``save_sharded_state``... do not);
- ``POST /v1/load_lora_adapter`` loads from any path: only ``<staging dir>/<name>`` passes,
  ``name`` one safe path component (``adapter_name``), the staging dir ``adapter_root()``.

Invariants: ``verdict`` is a pure function of (method, path); a path not in ``ALLOWED`` or
``CHECKED`` is refused; a checked body with duplicate keys, a content encoding, or more than
``MAX_CHECKED_BODY`` bytes is refused (no parser differential between us and the server).
The table of every vLLM 0.32 route and its verdict is in docs/security.md and pinned by
``tests/engines/test_engine_routes.py``.
"""

from __future__ import annotations

import json
import os
import re

from modal_rl.weightsync.apply.adapter_dir import (  # noqa: F401  (re-exported for the guard's users)
    ADAPTER_DIR_ENV,
    SAFE_NAME,
    adapter_name,
    adapter_root,
)
from modal_rl.weightsync.apply.adapter_dir import show as _show

OPEN = "open"  # no bearer needed (GET /health: status only)
ALLOW = "allow"  # the bearer opens it
CHECK = "check"  # the bearer opens it if its body passes ``body_refusal``
REFUSE = "refuse"  # refused even with the bearer

MAX_CHECKED_BODY = 1 << 20
OUR_RPC = re.compile(r"modal_rl_[a-z0-9_]{1,64}")

# (method, path) pairs the bearer opens: generation, and the control routes the run calls
# (verl's replica proxy: sleep/wake/pause/resume/reset; vllm_push: pause/resume/reset;
# lora_push: unload). Read-only status routes the run's tests and tools read.
ALLOWED = frozenset(
    {
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/{id}"),
        ("POST", "/v1/responses/{id}/cancel"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/inference/v1/generate"),
        ("POST", "/inference/v1/abort_requests"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/models"),
        ("GET", "/version"),
        ("GET", "/ping"),
        ("GET", "/metrics"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/unload_lora_adapter"),
    }
)
CHECKED = frozenset({("POST", "/collective_rpc"), ("POST", "/v1/load_lora_adapter")})
_ID_SEGMENT = re.compile(r"^/v1/responses/[^/]+(/cancel)?$")


def verdict(method: str, path: str) -> str:
    """``OPEN``, ``ALLOW``, ``CHECK`` or ``REFUSE`` for a request to ``path`` (the route path,
    root path stripped)."""
    if method == "GET" and path == "/health":
        return OPEN
    if _ID_SEGMENT.match(path):
        path = re.sub(r"^/v1/responses/[^/]+", "/v1/responses/{id}", path)
    if (method, path) in CHECKED:
        return CHECK
    return ALLOW if (method, path) in ALLOWED else REFUSE


def body_refusal(path: str, headers: list, body: bytes) -> str | None:
    """Why a ``CHECK`` route's request is refused, or ``None`` when it may run."""
    if any(k.lower() == b"content-encoding" for k, _ in headers):
        return "a content-encoded body is not accepted here"
    try:
        doc = json.loads(body, object_pairs_hook=no_duplicate_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting: RecursionError
        return f"the body is not one JSON object ({str(exc)[:80]})"
    if not isinstance(doc, dict):
        return "the body is not one JSON object"
    if path == "/collective_rpc":
        method = doc.get("method")
        if not isinstance(method, str) or not OUR_RPC.fullmatch(method):
            return f"collective_rpc method {_show(method)} is not one of modal_rl's own (modal_rl_*)"
        return None
    try:
        name = adapter_name(doc.get("lora_name"))
        given = doc.get("lora_path")
        if not isinstance(given, str):
            raise ValueError("lora_path is missing")
        parent, _, leaf = given.rpartition("/")
        adapter_name(leaf)
    except ValueError as exc:
        return str(exc)
    root = str(adapter_root())
    if parent != root or os.path.normpath(given) != given:
        return f"lora_path must be <{ADAPTER_DIR_ENV}>/<name> (the engine's staging directory) for {name!r}"
    return None


def no_duplicate_keys(pairs: list) -> dict:
    """``json.loads``' ``object_pairs_hook``: a key given twice (which value would the engine
    read?) is refused."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate keys")
    return dict(pairs)
