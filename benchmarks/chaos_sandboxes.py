"""Chaos scenario (e): sandboxes SIGKILLed while they score samples, through verl's own path.

The scoring path is verl 0.9.1's: ``AgentLoopWorkerTQ._compute_score`` (the agent-loop method
that scores a finished trajectory, with our sample mask installed) asks the ``modal_sandbox``
reward manager, built by verl's ``load_reward_manager``, which runs each program in a real
bubblewrap sandbox. The only stand-in is the Ray actor hop between agent loop and reward
worker (a handle whose ``compute_score.remote`` calls the manager in this process).

A killer thread watches the sandbox registry and SIGKILLs the bwrap process of any sandbox
whose running program carries a chaos marker, while it runs (read through ``/proc/<pid>/cwd``,
as root can): ``# chaos: once`` is killed on its first sandbox only (the manager's retry then
scores it), ``# chaos: always`` on every attempt (the sample must be masked).

Compared with an undisturbed pass over the same samples: scored samples get the same
rewards; masked ones get an all-zero response mask and a GRPO group of their own; verl's own
``compute_grpo_outcome_advantage`` and ``agg_loss`` then give the surviving samples exactly the
advantages and loss of a batch from which the masked samples were removed (the proof that
the mask excludes them, rather than scoring them 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil

TESTS = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]})
_GOOD = "a, b = map(int, input().split())\nprint(a + b)"
_BAD = "a, b = map(int, input().split())\nprint(a - b)"
GROUP = 4  # rollout.n


def programs(count: int) -> list[str]:
    """``count`` responses, alternately right and wrong; 1 of every 4 is killed once, 1 of every
    4 always. Each sleeps a little so a kill lands while it runs."""
    out = []
    for i in range(count):
        body = "import time\ntime.sleep(0.8)\n" + (_GOOD if i % 2 == 0 else _BAD)
        mark = {1: "\n# chaos: once", 2: "\n# chaos: always"}.get(i % 4, "")
        out.append(f"```python\n# sample {i}\n{body}{mark}\n```")
    return out


class SandboxKiller(threading.Thread):
    """SIGKILLs marked sandboxes mid-exec; ``kills`` lists ``(sample, marker, monotonic t)``."""

    def __init__(self, poll_s: float = 0.02):
        super().__init__(daemon=True)
        self.poll_s = poll_s
        self.stop = threading.Event()
        self.kills: list[tuple[str, str, float]] = []
        self._once_done: set[str] = set()

    def _running_program(self, bwrap_pid: int) -> str | None:
        from modal_rl.cluster.procs import children_of

        for pid in children_of(bwrap_pid):
            try:
                if psutil.Process(pid).cmdline()[-1:] == ["solution.py"]:
                    # Through /proc/<pid>/cwd, not psutil's cwd(): the path it names lies in
                    # the sandbox's mount namespace, and only /proc reaches into it.
                    return Path(f"/proc/{pid}/cwd/solution.py").read_text()
            except (OSError, psutil.Error):
                continue
        return None

    def run(self) -> None:
        from modal_rl.sandboxes import live_records

        while not self.stop.is_set():
            for info in live_records.entries(live_records.DEFAULT_DIR):
                if "pid" not in info or not _is_child(int(info["pid"])):  # only this process's
                    continue
                program = self._running_program(int(info["pid"]))
                if program is None or "# chaos:" not in program:
                    continue
                marker = program.rsplit("# chaos:", 1)[1].strip()
                key = program
                if marker == "once" and key in self._once_done:
                    continue
                try:
                    os.kill(int(info["pid"]), signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self._once_done.add(key)
                sample = int(program.split("# sample ", 1)[1].split()[0]) if "# sample " in program else -1
                self.kills.append((sample, marker, time.monotonic()))
            self.stop.wait(self.poll_s)


def _is_child(pid: int) -> bool:
    try:
        return psutil.Process(pid).ppid() == os.getpid()
    except psutil.Error:
        return False


class _LocalRewardHandle:
    """The reward worker's Ray handle, minus Ray: ``compute_score.remote(data)`` is awaitable."""

    def __init__(self, manager):
        outer = self

        class _Method:
            def remote(self, data):
                return outer.manager.run_single(data)

        self.manager, self.compute_score = manager, _Method()


def reward_config(**reward_kwargs):
    import verl_modal._sandbox_register  # noqa: F401  (registers the manager and the mask here)
    from verl_modal.cpu.overrides import compose

    overrides = ["reward.reward_manager.name=modal_sandbox"]
    overrides += [f"+reward.reward_kwargs.{k}={v}" for k, v in reward_kwargs.items()]
    return compose(overrides)


def score_batch(responses: list[str], *, chaos: bool, sandbox_retries: int = 1) -> dict:
    """Score ``responses`` (groups of ``GROUP``) through verl's agent-loop scoring; returns rows."""
    import verl.experimental.agent_loop.agent_loop as agent_loop
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from modal_rl.sandboxes.shared import close_shared_pools
    from verl_modal.cpu.tiny import code_rows, make_tokenizer

    tokenizer = make_tokenizer(code_rows(8, 0, "train"), 400)
    config = reward_config(min_warm=2, max_live=4, exec_timeout_s=5, sandbox_retries=sandbox_retries)
    manager = load_reward_manager(config, tokenizer)
    worker_cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class  # the class under ray.remote
    worker = worker_cls.__new__(worker_cls)  # only its scoring method is used
    worker.reward_loop_worker_handles = [_LocalRewardHandle(manager)]
    worker.processor, worker.mm_processor_kwargs = None, {}
    prompt = tokenizer("print the sum of two integers")["input_ids"]
    killer = SandboxKiller() if chaos else None

    async def one(i: int, text: str) -> dict:
        ids = tokenizer(text)["input_ids"]
        out = agent_loop.AgentLoopOutput(
            prompt_ids=prompt, response_ids=ids, response_mask=[1] * len(ids), metrics={}
        )
        kwargs = {"uid": f"p{i // GROUP}", "session_id": i % GROUP, "data_source": "verl_modal/tiny_code"}
        kwargs["reward_model"] = {"ground_truth": TESTS}
        kwargs["extra_info"] = {}
        await worker._compute_score([out], kwargs=kwargs)
        info = out.extra_fields["reward_extra_info"]
        return {
            "score": out.reward_score,
            "mask": list(out.response_mask),
            "uid": kwargs["uid"],
            "info": info,
            "done_t": time.monotonic(),
        }

    async def main() -> list[dict]:
        try:
            return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(responses))))
        finally:
            pool_snapshot.update(await _pool_snapshot())
            await close_shared_pools()

    async def _pool_snapshot() -> dict:
        from modal_rl.sandboxes.shared import shared_pool

        pool = await shared_pool(**manager.pool_settings)
        for _ in range(100):  # the pool refills in the background; give it a moment
            if pool.snapshot()["warm"] >= 2:
                break
            await asyncio.sleep(0.05)
        return pool.snapshot()

    pool_snapshot: dict = {}
    if killer:
        killer.start()
    t0 = time.monotonic()
    try:
        rows = manager.loop.run_until_complete(main())
    finally:
        if killer:
            killer.stop.set()
            killer.join(5)
    return {
        "rows": rows,
        "wall_s": time.monotonic() - t0,
        "kills": killer.kills if killer else [],
        "pool": pool_snapshot,
        "counts": dict(manager.counts),
    }


def loss_check(reference: list[dict], disturbed: list[dict]) -> dict:
    """verl's GRPO advantage + token-mean loss: the disturbed batch (masked rows in) against the
    reference batch with the masked rows removed. Equal means the mask excludes them."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import agg_loss, compute_grpo_outcome_advantage

    width = max(len(r["mask"]) for r in disturbed)

    def tensors(rows):
        mask = torch.zeros(len(rows), width)
        rewards = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            mask[i, : len(r["mask"])] = torch.tensor(r["mask"], dtype=torch.float32)
            rewards[i, len(r["mask"]) - 1] = float(r["score"])
        return rewards, mask, np.array([r["uid"] for r in rows], dtype=object)

    kept = [i for i, r in enumerate(disturbed) if not r["info"].get("sandbox_masked")]
    ref_rows = [dict(reference[i], mask=[1] * len(disturbed[i]["mask"])) for i in kept]
    adv_d, _ = compute_grpo_outcome_advantage(*tensors(disturbed))
    adv_r, _ = compute_grpo_outcome_advantage(*tensors(ref_rows))
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(len(disturbed), width, generator=gen)  # any per-token loss
    _, mask_d, _ = tensors(disturbed)
    _, mask_r, _ = tensors(ref_rows)
    loss_d = agg_loss(per_token * adv_d, mask_d, "token-mean")
    loss_r = agg_loss(per_token[kept] * adv_r, mask_r, "token-mean")
    return {
        "advantages_equal": bool(torch.equal(adv_d[kept], adv_r)),
        "masked_rows_zero": bool((adv_d[[i for i in range(len(disturbed)) if i not in kept]] == 0).all()),
        "loss_disturbed": float(loss_d),
        "loss_reference_without_masked": float(loss_r),
        "loss_equal": bool(torch.allclose(loss_d, loss_r, rtol=0, atol=1e-7)),
    }


def run_scenario(quick: bool, say=print) -> dict:
    """Scenario (e) as a chaos.json entry plus its details."""
    from modal_rl.sandboxes import live_records
    from modal_rl.sandboxes.pool import RUN_ID

    count = 8 if quick else 16
    responses = programs(count)
    # Everything this process puts in a temp directory goes to a private one, checked after.
    private, saved = tempfile.mkdtemp(prefix="chaos-e-tmp-"), tempfile.tempdir
    tempfile.tempdir = private
    try:
        say(f"(e) sandboxes: reference pass over {count} samples")
        ref = score_batch(responses, chaos=False)
        say("(e) sandboxes: same samples, killing marked sandboxes mid-exec")
        dis = score_batch(responses, chaos=True)
        time.sleep(0.5)
    finally:
        tempfile.tempdir = saved
    # torch's compile cache (torchinductor_<user>) lands in the temp dir when torch first looks
    # for it; it is a per-user cache, not something a run leaves behind.
    new_tmp = sorted(n for n in os.listdir(private) if not n.startswith("torchinductor_"))
    shutil.rmtree(private, ignore_errors=True)
    ours = [
        e
        for e in live_records.entries(live_records.DEFAULT_DIR)
        if (e.get("tags") or {}).get("modal-rl-run") == RUN_ID
    ]
    leaked = [e for e in ours if _alive_entry(e)]
    leaked_procs = _sandbox_procs()
    masked = [i for i, r in enumerate(dis["rows"]) if r["info"].get("sandbox_masked")]
    expected_masked = [i for i, t in enumerate(responses) if "# chaos: always" in t]
    same_scores = all(
        dis["rows"][i]["score"] == ref["rows"][i]["score"] for i in range(count) if i not in masked
    )
    check = loss_check(ref["rows"], dis["rows"])
    # Recovery: a sample killed once is scored on a fresh sandbox; kill -> its score.
    recoveries = [dis["rows"][i]["done_t"] - t for i, marker, t in dis["kills"] if marker == "once"]
    say(f"(e) sandboxes: {len(dis['kills'])} kills, masked {masked}, loss check {check['loss_equal']}")
    return {
        "name": "e_sandbox_kill",
        "completed": bool(masked == expected_masked and same_scores and check["loss_equal"]),
        "steps_lost": 0,
        "steps_since_checkpoint": None,
        "wrong_version_samples": None,
        "recovery_s": round(max(recoveries), 3) if recoveries else None,
        "engine_cold_start_s": None,
        "anchor_transfer_s": None,
        "leaked_processes": len(leaked_procs),
        "leaked_sandboxes": len(leaked),
        "final_weights_match": None,
        "details": {
            "samples": count,
            "kills": len(dis["kills"]),
            "masked": masked,
            "expected_masked": expected_masked,
            "unmasked_scores_equal_reference": same_scores,
            "loss": check,
            "pool_after": {k: dis["pool"].get(k) for k in ("warm", "live", "leased", "terminated")},
            "reward_counts": dis["counts"],
            "new_tmp_entries": new_tmp,
            "wall_s": {"reference": round(ref["wall_s"], 3), "disturbed": round(dis["wall_s"], 3)},
        },
    }


def _alive_entry(entry: dict) -> bool:
    from modal_rl.sandboxes import live_records

    return (
        entry.get("starttime") is not None
        and live_records.proc_starttime(int(entry["pid"])) == entry["starttime"]
    )


def _sandbox_procs() -> list[int]:
    """bwrap processes below this process (a closed pool leaves none)."""
    from modal_rl.cluster.procs import alive, children_of

    out = []
    for pid in alive(children_of(os.getpid())):
        try:
            if psutil.Process(pid).name() == "bwrap":
                out.append(pid)
        except psutil.Error:
            continue
    return out
