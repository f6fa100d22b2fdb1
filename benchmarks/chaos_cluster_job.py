"""A deterministic checkpointing training loop, run as a cluster's Ray job in chaos scenario (d).

    python -m benchmarks.chaos_cluster_job --ckpt DIR --steps N --save-every K [--step-s S]

Stands in for verl's trainer where a full verl run would cost minutes per attempt: each step
is a Ray task pinned to the last rank (``modal_rl_rank_<n-1>``), so losing that node breaks
the job the way it breaks a real one; the "weights" (a float64 vector) after step ``i``
depend only on ``i`` and the weights before it, so a run resumed from a checkpoint ends
bit-identical to an undisturbed one. Checkpoints are written the way verl's are meant to be
kept across a node's death: to a path outside the node (here a host directory; on Modal a
Volume), atomically (temp file, fsync, rename), with the step in the file, and read back at
start (``resume_mode=auto``). Appends ``resumed <step> <unix time>`` and ``step <step> <unix
time>`` lines to ``DIR/progress.log`` as they happen (the job's own log reaches rank 0's
stdout through Ray's log tail, seconds late); ``DIR/final.json`` holds the final weights' digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

DIM = 4096


def step_weights(weights, step: int):
    import numpy as np

    target = np.random.default_rng(step).normal(size=weights.shape)
    return weights - 0.1 * (weights - target)


def load(ckpt: Path):
    import numpy as np

    path = ckpt / "latest.npz"
    if not path.exists():
        return 0, np.zeros(DIM)
    with np.load(path) as data:
        return int(data["step"]), data["weights"].copy()


def save(ckpt: Path, step: int, weights) -> None:
    import numpy as np

    tmp = ckpt / "latest.tmp.npz"
    with open(tmp, "wb") as f:
        np.savez(f, step=np.array(step), weights=weights)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(ckpt / "latest.npz")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos_cluster_job")
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--nodes", type=int, default=1, help="steps run on the last rank's node")
    args = parser.parse_args(argv)
    args.ckpt.mkdir(parents=True, exist_ok=True)

    import ray

    ray.init()
    resource = {f"modal_rl_rank_{args.nodes - 1}": 0.01}

    @ray.remote(num_cpus=0, resources=resource, max_retries=0)
    def remote_step(weights, step: int, pause_s: float):
        time.sleep(pause_s)  # a step's compute
        return step_weights(weights, step)

    step, weights = load(args.ckpt)
    progress = open(args.ckpt / "progress.log", "a", buffering=1)  # noqa: SIM115 - lives as long as the job
    progress.write(f"resumed {step} {time.time()}\n")
    while step < args.steps:
        weights = ray.get(remote_step.remote(weights, step + 1, args.step_s))
        step += 1
        if step % args.save_every == 0 or step == args.steps:
            save(args.ckpt, step, weights)
        progress.write(f"step {step} {time.time()}\n")
        print(f"CHAOS_STEP {step}", flush=True)
    digest = hashlib.sha256(weights.tobytes()).hexdigest()
    (args.ckpt / "final.json").write_text(json.dumps({"step": step, "sha256": digest}))
    print(f"CHAOS_DONE {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
