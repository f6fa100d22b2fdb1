"""Child process for tests/slime_adapter/test_slime_step_metrics.py: slime's real rollout logger
(``slime.observability.rollout_metrics.log_rollout_data``, from the checkout on PYTHONPATH)
called as slime's rollout manager calls it, three rollouts, with our custom rollout log
function selected by slime's own flag. Between rollouts a weight version is published into
the disk dir and samples are masked, as a run's other processes would.

argv: OUT_DIR (gets disk/, parts/, tensorboard/, metrics.jsonl)."""

import json
import os
import sys
from argparse import Namespace
from pathlib import Path

out = Path(sys.argv[1])
os.environ["MODAL_RL_RUN_PARTS_DIR"] = str(out / "parts")
os.environ["TENSORBOARD_DIR"] = str(out / "tensorboard")
from slime.observability import rollout_metrics  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

from modal_rl.report.parts import record_mask  # noqa: E402

args = Namespace(
    custom_rollout_log_function_path="slime_modal.step_metrics.log_rollout_data",
    load_debug_rollout_data=False,
    use_wandb=False,
    use_tensorboard=True,
    tb_project_name="p",
    tb_experiment_name="e",
    advantage_estimator="grpo",
    log_passrate=False,
    log_reward_category=None,
    rollout_num_gpus=1,
    wandb_always_use_train_step=False,
    n_samples_per_prompt=2,
    update_weight_disk_dir=str(out / "disk"),
    update_weight_mode="delta",
    reward_key=None,
)


def publish(version: int, nbytes: int) -> None:
    vdir = out / "disk" / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    shard = "model-00000-of-00001.safetensors"
    (vdir / shard).write_bytes(b"\0" * nbytes)
    (vdir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))


def samples(n: int, versions: list[list[str]]) -> list:
    """``n`` samples; sample ``i`` has ``i + 1`` response tokens, answered by one SGLang
    response per entry of ``versions[i]`` (its ``meta_info["weight_version"]``), recorded by
    slime's own ``Sample.append_response_tokens``."""
    out = []
    for i in range(n):
        sample = Sample(
            index=i, prompt="1+1", reward=float(i % 2), tokens=[1, 1], status=Sample.Status.COMPLETED
        )
        turns = versions[i]
        for t, version in enumerate(turns):
            k = (i + 1) // len(turns) + (1 if t < (i + 1) % len(turns) else 0)
            meta = {"weight_version": version, "finish_reason": {"type": "stop"}}
            sample.append_response_tokens(
                args, tokens=[2] * k, log_probs=[-1.0] * k, meta_info=meta, text="2" * k
            )
        out.append(sample)
    return out


# train_async.py's loop: the trainer trains rollout r at version r + 1 (one push before rollout 0)
os.environ["MODAL_RL_SLIME_ENTRY"] = "train_async.py"
VERSIONS = [
    [["1"]] * 4,  # rollout 0: made by the first push, trained at version 1
    [["1"]] * 4,  # rollout 1: generated while the trainer made version 2
    [["1", "2"], ["2"], ["2"], ["2"]],  # rollout 2: one sample's two responses span an update
]

for rollout_id in range(3):
    if rollout_id >= 1:
        publish(rollout_id, (1 << 20) * rollout_id)
    for _ in range(rollout_id):
        record_mask("sandbox")
    extra = {} if rollout_id < 2 else None  # slime passes None when a rollout has no extra metrics
    rollout_metrics.log_rollout_data(rollout_id, args, samples(4, VERSIONS[rollout_id]), extra, 1.5)
from slime.observability.tensorboard_utils import _TensorboardAdapter  # noqa: E402

_TensorboardAdapter(args).finish()
print("ok")
