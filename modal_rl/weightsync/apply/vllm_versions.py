"""The version contract inside a vLLM worker: which committed version made each token.

Mixed into ``DeltaWeightsExtension``. On its first weight rpc the worker starts a
:class:`~modal_rl.asyncrl.versions.VersionLedger` and wraps its model runner's
``_update_states`` (the one place the runner learns of new and finished requests, once per
scheduler step): a request is started in the ledger when it is first scheduled, on the
version committed then, and finished with its final token count when the scheduler reports
it finished (done or aborted). Every weight change (a full load, an in-place switch) calls
:meth:`VersionLogMixin._modal_rl_committed`, which runs inside the ``collective_rpc`` --
between two scheduler steps -- and records, for every request the runner holds, how many
tokens it has: the next token is the first of the new version.

``modal_rl_versions(SINCE)`` (a ``collective_rpc``) answers the committed version, the
number of commits, the records finished after cursor ``SINCE`` (the caller keeps the
returned ``seq`` as its next cursor) and the records of live requests: the scheduler tells
the runner a request finished only at its next step, so a caller holding a finished
response may find its record still live and ``finalize`` it with the token count. It also
answers ``idle_s``, the seconds this worker's runner held no request since its first one
(``VersionLedger.idle_seconds``; the scheduler reports the last finish in one more step, so
an idle stretch starts within a step of it), and ``ledger``, the ledger's identity. Request
ids are vLLM's internal ones (``cmpl-<request_id>-<i>-<suffix>``);
``asyncrl.engine_client`` maps them back.

Invariants: the runner's token counts are exact at a commit because the CPU backend (and
any backend without asynchronous scheduling) appends each sampled token to the request's
state in the step that sampled it; with asynchronous scheduling a count could trail by one
step, so :meth:`_modal_rl_track` refuses to track then (records are absent, never wrong);
a ledger error at a commit stops tracking (``modal_rl_versions`` says why) and never fails
the switch, whose weights are already in.
Versions are compared within one publisher epoch. A version of a new epoch (a new trainer
restarting at 0) restarts the ledger (``VersionLedger.restart``): live requests lose their
records, ``restarts`` counts it and later records carry the new ``epoch``. A version at or
below the committed one of the same epoch (or with no epoch: a reload of the same version)
leaves the ledger as it is and is counted in ``unordered_commits``.
"""

from __future__ import annotations

from typing import Any

from modal_rl.asyncrl.versions import VersionContractError, VersionLedger


class VersionLogMixin:
    _modal_rl_ledger: VersionLedger | None = None
    _modal_rl_unordered = 0
    _modal_rl_untracked: str | None = None

    def _modal_rl_track(self) -> VersionLedger | None:
        """The ledger, wrapping the runner's state update on first use; ``None`` when this
        runner's token counts would not be exact (see the module invariants)."""
        if self._modal_rl_ledger is not None or self._modal_rl_untracked:
            return self._modal_rl_ledger
        runner = getattr(self, "model_runner", None)
        if runner is None or not hasattr(runner, "_update_states"):
            # a worker without vLLM's GPU-style runner (or a stand-in): no token counts to read
            self._modal_rl_untracked = "this worker has no model runner whose steps can be followed"
            return None
        if getattr(runner, "use_async_scheduling", False):
            self._modal_rl_untracked = "asynchronous scheduling: token counts trail by a step"
            return None
        ledger = VersionLedger()
        for req_id in list(runner.requests):  # requests already running: on the start weights
            ledger.start(req_id)
        original = runner._update_states

        def update_states(scheduler_output: Any):
            for req_id in scheduler_output.finished_req_ids:
                ledger.forget(req_id)
                if req_id in ledger._live:
                    state = runner.requests.get(req_id)
                    try:
                        ledger.finish(req_id, len(state.output_token_ids) if state is not None else 0)
                    except VersionContractError:  # never stop the engine for a record: drop it
                        ledger.discard(req_id)
            out = original(scheduler_output)
            for new in scheduler_output.scheduled_new_reqs:
                if new.req_id not in ledger._live:
                    ledger.start(new.req_id)
            return out

        runner._update_states = update_states  # an instance attribute: this runner only
        self._modal_rl_ledger = ledger
        return ledger

    def _modal_rl_committed(self, version: int | None, epoch: int | None = None) -> int:
        """Record that ``version`` (of publisher ``epoch``) is now served (called between
        scheduler steps, after the weights changed); returns how many running requests
        switched mid-generation."""
        ledger = self._modal_rl_track()
        if ledger is None or version is None:
            return 0
        restarted = epoch is not None and ledger.epoch is not None and epoch != ledger.epoch
        if restarted and int(version) <= ledger.committed:  # a new publisher, numbering afresh
            ledger.restart(int(version), epoch)
            return 0
        if epoch is not None:
            ledger.epoch = epoch if int(version) > ledger.committed else ledger.epoch
        if int(version) <= ledger.committed:
            self._modal_rl_unordered += 1
            return 0
        try:
            held = self.model_runner.requests
            for req_id in held:
                if req_id not in ledger._live:
                    ledger.start(req_id)
            tokens = {r: len(held[r].output_token_ids) for r in held}
            for req_id in ledger.live():
                if req_id not in tokens:  # gone from the runner without a finish report
                    ledger.finish(req_id, 0)
            return ledger.commit(int(version), tokens)
        except Exception as exc:  # noqa: BLE001 -- the weights are in: a record must not fail the switch
            self._modal_rl_ledger, self._modal_rl_untracked = (
                None,
                f"ledger stopped: {type(exc).__name__}: {exc}",
            )
            return 0

    def modal_rl_versions(self, since: int = 0) -> dict:
        ledger = self._modal_rl_track()
        if ledger is None:
            return {"tracked": False, "why": self._modal_rl_untracked}
        seq, records = ledger.finished_since(int(since))
        return {
            "tracked": True,
            "committed": ledger.committed,
            "commits": ledger.commits,
            "epoch": ledger.epoch,
            "restarts": ledger.restarts,
            "unordered_commits": self._modal_rl_unordered,
            "live": len(ledger.live()),
            "idle_s": ledger.idle_seconds(),
            "ledger": ledger.ident,
            "seq": seq,
            "records": [[req_id, rec] for req_id, rec in records],
            "live_records": [[req_id, rec] for req_id, rec in ledger.live_records()],
            "prefix_caching": bool(getattr(self.model_runner.cache_config, "enable_prefix_caching", False)),
        }
