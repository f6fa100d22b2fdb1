"""Reading an engine's version ledger from an asyncio server (one reader per engine).

A framework's rollout server (verl's ``modal_vllm`` proxy, a slime rollout manager) sends
many requests to one vLLM engine at once and needs, for each finished one, the versions its
tokens came from. :class:`LedgerReader` asks the engine's workers (``modal_rl_versions``
over ``/collective_rpc``, see ``weightsync.apply.vllm_versions``) with a cursor, so each read
returns only the records finished since the last one, and folds them into a table of the
requests it was told about (:meth:`expect`); other clients' records are skipped.

Invariants: a record comes from the engine, never from a guess: a request whose record the
engine does not hold (an engine replaced mid-request, a ledger that stopped) gets ``None``;
reads are serialized (one rpc in flight per reader, concurrent callers share its answer);
a request whose record is still live (the scheduler reports a finish one step late) is
finalized with the caller's token count (``versions.finalize``). A ledger that numbers its
records below the cursor (a new worker process) resets the cursor, so no record is skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from modal_rl.asyncrl.versions import SampleVersions, VersionContractError, finalize

RPC_METHOD = "modal_rl_versions"


def request_of(internal_id: str) -> str | None:
    """Our request id from vLLM's internal ``cmpl-<id>-<i>-<suffix>`` (``None`` otherwise)."""
    if not internal_id.startswith("cmpl-"):
        return None
    parts = internal_id[len("cmpl-") :].rsplit("-", 2)
    return parts[0] if len(parts) == 3 else None


class LedgerReader:
    """``post(body)``: an async call of the engine's ``/collective_rpc`` with ``body``,
    returning its decoded JSON answer. After each read ``idle_s`` is the engine's idle
    seconds as its ledger counts them (``VersionLedger.idle_seconds``; ``None`` when the
    engine reports none)."""

    def __init__(self, post: Callable[[dict], Awaitable[Any]]) -> None:
        self._post = post
        self._cursor = 0
        self._expected: set[str] = set()
        self._done: dict[str, dict] = {}
        self._live: dict[str, dict] = {}
        self._lock = asyncio.Lock()
        self.tracked: bool | None = None  # None until the first read
        self.why: str | None = None
        self.committed: int | None = None
        self.idle_s: float | None = None  # the engine's idle seconds at the last read
        self.ledger: str | None = None  # the identity of the ledger that counted them

    def expect(self, request_id: str) -> None:
        """Keep ``request_id``'s record when it arrives (call before sending it)."""
        self._expected.add(request_id)

    def forget(self, request_id: str) -> None:
        self._expected.discard(request_id)
        self._done.pop(request_id, None)

    async def read(self) -> dict:
        """One ledger read; the engine's answer (``tracked``, ``committed``, ...)."""
        async with self._lock:
            answer = await self._post({"method": RPC_METHOD, "args": [self._cursor], "timeout": 60.0})
            info = answer["results"][0]
            self.tracked, self.why = bool(info.get("tracked")), info.get("why")
            idle = info.get("idle_s")
            self.idle_s = float(idle) if isinstance(idle, int | float) else None
            self.ledger = str(info["ledger"]) if info.get("ledger") is not None else None
            if not self.tracked:
                return info
            if int(info["seq"]) < self._cursor:  # a new ledger numbers its records from 0 again
                self._cursor = 0
                answer = await self._post({"method": RPC_METHOD, "args": [0], "timeout": 60.0})
                info = answer["results"][0]
            for internal, rec in info["records"]:
                ours = request_of(internal)
                if ours in self._expected:
                    self._done[ours] = rec
            self._live = {}
            for internal, rec in info.get("live_records", []):
                ours = request_of(internal)
                if ours in self._expected:
                    self._live[ours] = rec
            self._cursor = int(info["seq"])
            self.committed = int(info["committed"])
            return info

    async def record(self, request_id: str, n_tokens: int) -> SampleVersions | None:
        """The versions of a finished request's ``n_tokens`` tokens, or ``None`` when the
        engine keeps no record of it (see the module invariants)."""
        try:
            if request_id not in self._done:
                await self.read()
            rec = self._done.pop(request_id, None) or self._live.get(request_id)
            if rec is None:
                return None
            return finalize(rec, n_tokens)
        except VersionContractError:
            return None
        finally:
            self._expected.discard(request_id)
