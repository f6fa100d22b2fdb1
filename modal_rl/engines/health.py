"""What "healthy" means for an inference engine: it answers a 1-token generation in time.

An open port, or a 200 on ``GET /health``, says the HTTP server runs; it says nothing about a
model that is stuck (a wedged GPU, a SIGSTOPped engine core, a scheduler that no longer
steps). So the check that counts is the spec's ``generate`` request (a JSON POST asking for one
token, e.g. vLLM's ``/v1/completions`` with ``max_tokens=1``, SGLang's ``/generate`` with
``max_new_tokens=1``), answered 2xx within ``timeout_s``, with the run's key.

Invariants:
- the key goes only over https or to loopback (``auth.key_safe_url``), as for ``probe``;
- every probe is bounded by ``timeout_s`` (connect and answer), so a hung engine costs at most
  that long per check; a refused connection or a dead process answers at once;
- probes never use an environment proxy (engines are reached directly).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from typing import Any

from modal_rl.engines.auth import KEYED_OPENER, bearer_header, key_safe_url, token_header

PROBE_ID_PREFIX = "modal-rl-health-"


def vllm_generate(served_name: str) -> dict[str, Any]:
    """``EngineSpec.generate`` for a vLLM OpenAI server serving ``served_name``: one greedy token."""
    body = {"model": served_name, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
    return {"path": "/v1/completions", "body": body}


def sglang_generate() -> dict[str, Any]:
    """``EngineSpec.generate`` for an SGLang server: one greedy token through ``/generate``."""
    return {"path": "/generate", "body": {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}}


def generation_probe(
    url: str, generate: dict[str, Any], key: str | None, timeout_s: float
) -> tuple[bool, str]:
    """POST ``generate`` to the engine at base ``url``; (answered 2xx within ``timeout_s``, what happened)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        if not key_safe_url(url):
            return False, "not sent: the run key goes only over https or to loopback"
        headers.update(bearer_header(key))
    body = dict(generate.get("body") or {})
    if "request_id" not in body and generate["path"] == "/v1/completions":
        body["request_id"] = PROBE_ID_PREFIX + uuid.uuid4().hex[:12]  # tells probes from traffic
    request = urllib.request.Request(
        url.rstrip("/") + generate["path"], json.dumps(body).encode(), headers, method="POST"
    )
    try:
        with KEYED_OPENER.open(request, timeout=timeout_s) as resp:
            resp.read()
            return 200 <= resp.status < 300, f"generation answered HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"generation answered HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # refused, reset, timed out (socket.timeout is an OSError)
        return False, f"generation failed: {type(exc).__name__}: {exc}"


# Engines are reached directly: an http_proxy in the environment must not reroute health checks.


def probe(
    url: str, timeout_s: float = 2.0, key: str | None = None, bearer: str | None = None
) -> tuple[bool, str]:
    """One GET, with the engine bearer (of the run key ``key``, or ``bearer`` itself) when one
    is given (only over https or to loopback: elsewhere nothing is sent; no redirect is
    followed); (answered 2xx, what happened)."""
    headers = {}
    if key is not None or bearer is not None:
        if not key_safe_url(url):
            return False, "not sent: the run key goes only over https or to loopback"
        headers = bearer_header(key) if key is not None else token_header(bearer)
    try:
        with KEYED_OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
            return 200 <= resp.status < 300, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def ready(url: str, spec, key: str | None, timeout_s: float = 2.0) -> tuple[bool, str]:
    """The start-time check: ``GET spec.health_path`` is 2xx and, if the spec names one, a
    1-token generation answers too."""
    ok, what = probe(url.rstrip("/") + spec.health_path, timeout_s=timeout_s, key=key)
    if not ok or spec.generate is None:
        return ok, what
    return generation_probe(url, spec.generate, key, timeout_s=max(timeout_s, 30.0))


def healthy(url: str, spec, key: str | None, timeout_s: float) -> tuple[bool, str]:
    """The check of a running engine: the 1-token generation (``GET health_path`` when the spec
    names no generation), bounded by ``timeout_s``."""
    if spec.generate is None:
        return probe(url.rstrip("/") + spec.health_path, timeout_s=timeout_s, key=key)
    return generation_probe(url, spec.generate, key, timeout_s)
