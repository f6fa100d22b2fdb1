"""A third engine behind the Engine port, in one file: the stand-in server ``_engine_server.py``.

What docs/extending.md says adding an engine takes: one file with an ``Engine`` subclass, and one
``ENGINES.add`` line (``tests/engines/test_engines_port.py`` registers it and drives it through the port
on a real process). The stand-in records every request it gets, so a test can see what the port
sent: a weight load is ``POST /collective_rpc {"method": "load", "version": N}``, a catch-up
``POST /catch_up``; every call carries the engine bearer.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from modal_rl.engines.auth import KEYED_OPENER, bearer_header, check_key_safe_url
from modal_rl.engines.base import Engine
from modal_rl.engines.health import vllm_generate

SERVER = str(Path(__file__).with_name("_engine_server.py"))


class StandInEngine(Engine):
    """``_engine_server.py --require-key``; ``state``: the directory it records requests in."""

    name = "stand-in"

    def __init__(self, *, key: str | None = None, state: str | None = None, catch_up_to: int | None = None):
        super().__init__(key=key)
        self.state, self.catch_up_to = state, catch_up_to

    def argv(self) -> list[str]:
        state = ["--state", self.state] if self.state else []
        return [sys.executable, SERVER, "--host", "{host}", "--port", "{port}", "--require-key", *state]

    def generate_request(self) -> dict[str, Any]:
        return vllm_generate("stand-in")  # the stand-in answers /v1/completions

    def load(self, url: str, source: Any) -> dict[str, float]:
        self._post(url, "/collective_rpc", {"method": "load", "version": source.version})
        return {"version": float(source.version)}

    def catch_up(self, url: str) -> dict[str, Any]:
        if self.catch_up_to is None:
            return {}
        self._post(url, "/catch_up", {"version": self.catch_up_to})
        return {"weight_version": self.catch_up_to}

    def _post(self, url: str, path: str, body: dict) -> dict:
        check_key_safe_url(url)
        headers = {"Content-Type": "application/json", **bearer_header(self.key)}
        request = urllib.request.Request(url.rstrip("/") + path, json.dumps(body).encode(), headers)
        with KEYED_OPENER.open(request, timeout=10.0) as resp:
            return json.loads(resp.read() or b"{}")
