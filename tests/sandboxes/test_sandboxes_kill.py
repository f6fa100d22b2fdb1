"""Sandboxes SIGKILLed mid-exec: a typed error, the pool refills, nothing leaks; through verl's
agent-loop scoring the sample is masked out of the loss (chaos scenario (e) as a test)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from modal_rl.sandboxes import LocalProvider, SandboxLostError, SandboxPool, SandboxSpec, live_records
from tests._sandboxes_helpers import descendants, needs_bwrap, no_processes_left, wait_gone

pytestmark = needs_bwrap


def _running(pid: int, marker: str) -> bool:
    for child in descendants(pid):
        try:
            if marker in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                return True
        except OSError:
            continue
    return False


def test_sandbox_killed_mid_exec_is_typed_refilled_and_gone(tmp_path):
    async def main():
        provider = LocalProvider(registry_dir=tmp_path)
        async with SandboxPool(provider, SandboxSpec(timeout_s=120), min_warm=2, max_live=4) as pool:
            async with pool.lease() as sb:
                pid = sb._handle.pid
                marker = f"chaos-{os.getpid()}"
                task = asyncio.create_task(
                    sb.exec(["python3", "-c", f"import time; time.sleep(60)  # {marker}"], timeout_s=90)
                )
                for _ in range(200):
                    if _running(pid, marker):
                        break
                    await asyncio.sleep(0.02)
                assert _running(pid, marker), "the command never started"
                inside = descendants(pid)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)  # the sandbox's bwrap process, mid-exec
                with pytest.raises(SandboxLostError, match="exited"):
                    await task
                assert time.monotonic() - killed_at < 5.0  # not the command's 60 s
                assert wait_gone(inside | {pid}) == set(), "processes of the killed sandbox survived"
                assert not any(e["id"] == sb.id for e in live_records.entries(tmp_path))
            for _ in range(200):  # the pool refills its warm buffer in the background
                if pool.snapshot()["warm"] >= 2:
                    break
                await asyncio.sleep(0.05)
            snap = pool.snapshot()
            assert snap["warm"] >= 2 and snap["leased"] == 0, snap
            async with pool.lease() as sb2:  # and what it hands out works
                r = await sb2.exec(["python3", "-c", "print(6 * 7)"], timeout_s=10)
                assert r.stdout.strip() == "42"
        assert live_records.entries(tmp_path) == []

    asyncio.run(main())
    no_processes_left()


@pytest.mark.slow
def test_killed_samples_are_masked_out_of_verl_loss():
    """Scenario (e): real verl scoring path, real sandboxes, real kills; see benchmarks/chaos_sandboxes."""
    pytest.importorskip("verl")
    from benchmarks.chaos_sandboxes import run_scenario

    result = run_scenario(quick=True, say=lambda line: None)
    d = result["details"]
    assert d["kills"] >= len(d["expected_masked"]) + 1, d  # once-killed samples were killed too
    assert d["masked"] == d["expected_masked"] and d["unmasked_scores_equal_reference"], d
    assert d["loss"]["advantages_equal"] and d["loss"]["masked_rows_zero"] and d["loss"]["loss_equal"], d
    assert d["reward_counts"]["sandbox_errors"] == len(d["expected_masked"])
    assert d["pool_after"]["warm"] >= 2 and d["pool_after"]["leased"] == 0, d  # refilled
    assert result["leaked_processes"] == 0 and result["leaked_sandboxes"] == 0 and d["new_tmp_entries"] == []
    assert result["completed"] is True and result["recovery_s"] is not None


def test_the_loss_check_fails_without_the_mask():
    """The check in scenario (e) can fail: a masked sample scored 0 in its group moves the loss."""
    pytest.importorskip("verl")
    from benchmarks.chaos_sandboxes import loss_check

    def row(score, uid, masked=False):
        return {
            "score": score,
            "mask": [0] * 3 if masked else [1] * 3,
            "uid": uid,
            "info": {"sandbox_masked": int(masked)},
        }

    reference = [row(1.0, "p0"), row(0.0, "p0"), row(1.0, "p0"), row(1.0, "p0")]
    masked = [row(1.0, "p0"), row(0.0, "p0"), row(0.0, "masked-x", True), row(1.0, "p0")]
    assert loss_check(reference, masked)["loss_equal"] is True
    scored_zero = [row(1.0, "p0"), row(0.0, "p0"), row(0.0, "p0"), row(1.0, "p0")]
    scored_zero[2]["info"] = {"sandbox_masked": 1}  # flagged, but neither mask nor group applied
    check = loss_check(reference, scored_zero)
    assert check["advantages_equal"] is False and check["loss_equal"] is False


def test_mask_wrap_on_verl_agent_loop_masks_flagged_trajectories_only():
    """The wrap on verl's real ``AgentLoopWorker._compute_score``: a flagged trajectory (sandbox
    or engine flag) gets a zero response mask and a group of its own; others are untouched;
    the legacy (non-TQ) agent loop raises instead of scoring it."""
    pytest.importorskip("verl")
    import verl.experimental.agent_loop.agent_loop as agent_loop
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from modal_rl.sandboxes import SandboxError
    from verl_modal import sample_mask

    sample_mask.install()
    sample_mask.install()  # idempotent

    def output(extra):
        return agent_loop.AgentLoopOutput(
            prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=[1, 1, 1], metrics={}, extra_fields=extra
        )

    def worker(cls):
        w = cls.__new__(cls)
        w.reward_loop_worker_handles = None  # scores are already on the outputs
        return w

    tq = worker(AgentLoopWorkerTQ.__ray_metadata__.modified_class)
    cases = {
        "plain": ({"reward_extra_info": {"sandbox_masked": 0}}, False),
        "sandbox": ({"reward_extra_info": {"sandbox_masked": 1}}, True),
        "engine": ({"modal_rl_masked": "engine lost"}, True),
    }
    for name, (extra, masked) in cases.items():
        out, kwargs = output(extra), {"uid": "p0", "session_id": 0}
        asyncio.run(tq._compute_score([out], kwargs=kwargs))
        assert (out.response_mask == [0, 0, 0]) is masked, name
        assert kwargs["uid"].startswith("masked-") is masked, name
    legacy = worker(agent_loop.AgentLoopWorker)
    with pytest.raises(SandboxError, match="legacy agent loop"):
        asyncio.run(legacy._compute_score([output(cases["sandbox"][0])], kwargs={"uid": "p0"}))


def test_slime_reward_masks_a_sample_whose_sandbox_is_killed():
    """slime's path: the killed sample gets ``remove_sample`` (slime zeroes its loss mask) and
    scores nothing; its batch-mates score as usual; the pool is closed without leftovers."""
    from dataclasses import dataclass, field

    from benchmarks.chaos_sandboxes import SandboxKiller
    from slime_modal.config import close_rollout_pools
    from slime_modal.reward import batched_reward_func

    @dataclass
    class Sample:  # the fields of slime.utils.types.Sample a reward reads or sets
        index: int = 0
        response: str = ""
        label: str | None = None
        metadata: dict = field(default_factory=dict)
        remove_sample: bool = False

    program = "```python\n# sample {i}\nimport time\ntime.sleep(0.8)\nprint(int(input()) * 3){mark}\n```"
    tests = '{"inputs": ["3\\n"], "outputs": ["9\\n"]}'
    samples = [
        Sample(i, program.format(i=i, mark="\n# chaos: always" if i == 1 else ""), tests) for i in range(3)
    ]
    killer = SandboxKiller()
    killer.start()

    async def main():
        try:
            return await batched_reward_func(None, samples)
        finally:
            await close_rollout_pools()

    try:
        scores = asyncio.run(main())
    finally:
        killer.stop.set()
        killer.join(5)
    # One scoring path (scoring.score_sample): slime retries a lost sandbox as verl does, on a
    # fresh one each time (2 retries), and masks the sample only when the retries fail too.
    assert [k[0] for k in killer.kills] == [1, 1, 1], killer.kills
    assert scores == [1.0, 0.0, 1.0]
    assert [s.remove_sample for s in samples] == [False, True, False]
    no_processes_left()
