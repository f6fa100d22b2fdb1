"""A vLLM engine (``vllm_extension`` loaded) seen through the version contract.

:class:`VersionedEngine` generates with a request id of its own, commits versions through an
``EnginePusher`` (in place, between the engine's decoding steps, with the run's choice for
running requests: ``kv_policy``), and attaches to every sample the versions its tokens came
from, read from the engine's ledger (``weightsync.apply.vllm_versions``) in one
``collective_rpc`` per batch (:meth:`VersionedEngine.stamp`).

Invariants: a sample's versions come from the engine, never from the caller's guess; a
sample whose record the engine no longer holds keeps ``versions=None`` (counted, not
invented); a request that requires a minimum version is sent only once the engine reports
that version or newer (:meth:`VersionedEngine.wait_version`).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from modal_rl.asyncrl.kv_policy import check_running
from modal_rl.asyncrl.ledger_reader import request_of as _request_of
from modal_rl.asyncrl.versions import SampleVersions, VersionTooOldError, finalize, require
from modal_rl.engines.auth import KEYED_OPENER, bearer_header, key_safe_url


class EngineVersionError(RuntimeError):
    """The engine cannot keep the version contract (no ledger, or a setting that breaks it)."""


@dataclass
class Sample:
    request_id: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None
    started_s: float
    ended_s: float
    versions: SampleVersions | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class VersionedEngine:
    def __init__(self, url: str, model: str, key: str, *, running: str = "recompute") -> None:
        if not key_safe_url(url):
            raise EngineVersionError(f"{url}: the engine bearer goes only over https or to loopback")
        self.url, self.model, self._key = url.rstrip("/"), model, key
        self.running = check_running(running)
        self._cursor = 0
        self._records: dict[str, dict] = {}  # finished records of requests this client sent
        self._issued: set[str] = set()  # sent and not yet stamped: the only records kept
        self._lock = threading.Lock()
        info = self.versions()  # also starts the engine's ledger if no weight rpc has yet
        if not info.get("tracked"):
            raise EngineVersionError(f"{url}: the engine keeps no version ledger ({info.get('why')})")
        if running == "keep" and info.get("prefix_caching"):
            raise EngineVersionError(
                f"{url}: running='keep' needs the engine's prefix cache off "
                "(start it with --no-enable-prefix-caching: local_vllm_spec(prefix_caching=False))"
            )
        self.committed = int(info["committed"])

    # -- http ------------------------------------------------------------------------------
    def _post(self, path: str, body: dict, timeout: float = 600.0) -> Any:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **bearer_header(self._key)},
            method="POST",
        )
        with KEYED_OPENER.open(request, timeout=timeout) as resp:  # no proxy, no redirect
            return json.load(resp)

    def versions(self) -> dict:
        """The engine's ledger (first worker's; all workers commit together), and every new
        finished record folded into this client's table."""
        with self._lock:
            answer = self._post(
                "/collective_rpc", {"method": "modal_rl_versions", "args": [self._cursor], "timeout": 60.0}
            )
            info = answer["results"][0]
            if not info.get("tracked"):
                return info
            for internal, rec in info["records"]:
                ours = _request_of(internal)
                if ours in self._issued:  # other clients' requests share the engine's ledger
                    self._records[ours] = rec
            self._cursor = int(info["seq"])
            self._live = {_request_of(r): rec for r, rec in info.get("live_records", [])}
            self.committed = max(getattr(self, "committed", -1), int(info["committed"]))
            return info

    # -- generation ------------------------------------------------------------------------
    def wait_version(self, min_version: int, timeout: float = 600.0) -> int:
        """Block until the engine serves ``min_version`` or newer; its version."""
        end = time.monotonic() + timeout
        while True:
            try:
                require(self.committed, min_version)
                return self.committed
            except VersionTooOldError:
                if time.monotonic() > end:
                    raise
            time.sleep(0.05)
            self.versions()

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        temperature: float = 1.0,
        seed: int | None = None,
        min_version: int | None = None,
        ignore_eos: bool = False,
    ) -> Sample:
        if min_version is not None:
            self.wait_version(min_version)
        request_id = f"mrl{uuid.uuid4().hex}"
        with self._lock:
            self._issued.add(request_id)
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "logprobs": 0,
            "return_token_ids": True,
            "request_id": request_id,
            "ignore_eos": bool(ignore_eos),
            **({"seed": int(seed)} if seed is not None else {}),
        }
        t0 = time.monotonic()
        choice = self._post("/v1/completions", body)["choices"][0]
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        return Sample(
            request_id,
            list(prompt),
            list(choice.get("token_ids") or []),
            [float(x) for x in lps],
            choice.get("finish_reason"),
            t0,
            time.monotonic(),
        )

    def stamp(self, samples: list[Sample]) -> int:
        """Attach each sample's versions (one ledger read); returns how many got them."""
        self.versions()
        got = 0
        for s in samples:
            with self._lock:
                self._issued.discard(s.request_id)
                rec = self._records.pop(s.request_id, None) or self._live.get(s.request_id)
            if rec is not None:
                s.versions = finalize(rec, len(s.tokens))
                got += 1
        return got

    # -- commits ---------------------------------------------------------------------------
    def commit(self, pusher, state: dict) -> dict[str, float]:
        """Publish ``state`` as the next version and commit it in place (``pusher`` must
        target this engine with this client's ``running`` choice); the push's numbers."""
        if pusher.running != self.running:
            raise EngineVersionError(
                f"the pusher's running={pusher.running!r}, this engine's {self.running!r}"
            )
        numbers = pusher.push(state)
        self.committed = max(self.committed, int(numbers["version"]))
        return numbers
