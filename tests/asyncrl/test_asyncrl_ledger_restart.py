"""A new publisher numbering its versions from 0 again is visible in the engine's ledger, and
an asyncio reader of that ledger hands each finished request its record.

The worker side runs ``VersionLogMixin`` over a minimal model runner (the three attributes
the mixin reads: ``requests`` with ``output_token_ids``, ``_update_states`` and
``cache_config``); the real vLLM path is tests/e2e/test_asyncrl_vllm.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from modal_rl.asyncrl.ledger_reader import LedgerReader, request_of
from modal_rl.asyncrl.versions import SampleVersions, VersionLedger
from modal_rl.weightsync.apply.vllm_versions import VersionLogMixin


class Runner:
    """Decodes one token per step for every running request, like vLLM's runner state."""

    def __init__(self) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.cache_config = SimpleNamespace(enable_prefix_caching=False)
        self._new: list[str] = []
        self._finished: list[str] = []

    def _update_states(self, out) -> None:
        for r in out.finished_req_ids:
            self.requests.pop(r, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(output_token_ids=[])

    def step(self, tokens: int = 1) -> None:
        out = SimpleNamespace(
            finished_req_ids=list(self._finished),
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in self._new],
        )
        self._new, self._finished = [], []
        self._update_states(out)
        for state in self.requests.values():
            state.output_token_ids += [0] * tokens

    def add(self, req_id: str) -> None:
        self._new.append(req_id)

    def finish(self, req_id: str) -> None:
        self._finished.append(req_id)


class Worker(VersionLogMixin):
    def __init__(self) -> None:
        self.model_runner = Runner()


def test_a_new_epoch_restarting_at_zero_restarts_the_ledger_visibly():
    w = Worker()
    w._modal_rl_committed(0, epoch=100)
    w._modal_rl_committed(1, epoch=100)
    run = w.model_runner
    run.add("old")
    run.step(3)
    w._modal_rl_committed(2, epoch=100)
    run.step(2)  # "old": tokens 0-2 on v1, 3-4 on v2
    assert w._modal_rl_committed(0, epoch=200) == 0  # a new trainer, numbering from 0 again
    info = w.modal_rl_versions(0)
    assert (info["committed"], info["epoch"], info["restarts"]) == (0, 200, 1)
    assert info["unordered_commits"] == 0
    run.add("new")
    run.step(2)
    w._modal_rl_committed(1, epoch=200)
    run.step(1)
    run.finish("old")
    run.finish("new")
    run.step()
    records = dict(w.modal_rl_versions(0)["records"])
    # "old" ran across the restart: its versions of two epochs are not comparable, so no record
    assert "old" not in records
    assert records["new"] == {"versions": [0, 1], "switch_at": [2], "epoch": 200}
    # the same epoch at or below the committed version is a reload, not a restart
    w._modal_rl_committed(1, epoch=200)
    assert w.modal_rl_versions(0)["unordered_commits"] == 1 and w.modal_rl_versions(0)["restarts"] == 1


def test_without_an_epoch_a_lower_version_is_counted_not_recorded():
    w = Worker()
    w._modal_rl_committed(3)
    w._modal_rl_committed(0)
    info = w.modal_rl_versions(0)
    assert (info["committed"], info["restarts"], info["unordered_commits"]) == (3, 0, 1)


def test_a_dropped_request_is_not_restarted_by_a_later_commit():
    ledger = VersionLedger(committed=4, epoch=1)
    ledger.start("a")
    assert ledger.restart(0, epoch=2) == 1
    ledger.start("a")  # the runner still holds it: it must not get an invented record
    assert ledger.live() == []
    ledger.forget("a")
    ledger.start("a")  # an id reused after it ended is a new request
    assert ledger.live() == ["a"]


def test_the_reader_hands_each_request_its_own_record():
    w = Worker()
    w._modal_rl_committed(5, epoch=1)
    run = w.model_runner
    calls = []

    async def post(body: dict) -> dict:
        calls.append(body["args"][0])
        return {"results": [getattr(w, body["method"])(*body["args"])]}

    async def main():
        reader = LedgerReader(post)
        for ours in ("a-b-c", "d"):
            reader.expect(ours)
            run.add(f"cmpl-{ours}-0-ffff")
        run.add("cmpl-someone-else-0-ffff")
        run.step(2)
        w._modal_rl_committed(6, epoch=1)
        run.step(1)
        run.finish("cmpl-a-b-c-0-ffff")
        run.step()
        got_a = await reader.record("a-b-c", 3)
        # "d" is still live in the ledger (its finish comes a step late): finalized at 3 tokens
        got_d = await reader.record("d", 3)
        assert "someone-else" not in reader._done
        return got_a, got_d

    got_a, got_d = asyncio.run(main())
    assert got_a == SampleVersions((5, 6), (2,)) == got_d
    assert calls[0] == 0 and calls[-1] >= 1  # the cursor moved on


def test_the_reader_keeps_the_engines_idle_seconds_and_its_ledgers_identity():
    w = Worker()
    w._modal_rl_committed(1)
    now = [10.0]
    w._modal_rl_ledger._clock = lambda: now[0]
    run = w.model_runner
    run.add("cmpl-a-0-ffff")
    run.step()
    run.finish("cmpl-a-0-ffff")
    now[0] = 12.0
    run.step()  # the scheduler reports the finish: nothing live from here on
    now[0] = 15.5

    async def post(body: dict) -> dict:
        return {"results": [getattr(w, body["method"])(*body["args"])]}

    reader = LedgerReader(post)
    reader.expect("a")
    assert asyncio.run(reader.record("a", 1)) == SampleVersions((1,))
    assert reader.idle_s == 3.5 and reader.ledger == w._modal_rl_ledger.ident


def test_the_reader_says_none_when_the_engine_keeps_no_ledger():
    async def post(body: dict) -> dict:
        return {"results": [{"tracked": False, "why": "asynchronous scheduling"}]}

    reader = LedgerReader(post)
    reader.expect("x")
    assert asyncio.run(reader.record("x", 4)) is None
    assert reader.tracked is False and "asynchronous" in reader.why


@pytest.mark.parametrize(
    "internal, ours", [("cmpl-a-b-c-0-ffff", "a-b-c"), ("cmpl-x-1-0", "x"), ("chatcmpl-x", None)]
)
def test_internal_ids_map_back(internal, ours):
    assert request_of(internal) == ours
