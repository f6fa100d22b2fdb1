"""slime's command line for the CPU main job: ``python -m slime_modal.cpu.run_args TINY RUN``
makes the tiny assets in TINY (``slime_modal.cpu.tiny``) and prints, one token per line, the
``train.py`` arguments of a 3-step GRPO run writing into the run folder RUN
(``--external-engines``: for ``python -m slime_modal --rollout-engines``).

What each group is for:

- placement: one logical GPU for Megatron, one for SGLang (``python -m slime_modal --cpu``
  declares as many to Ray as slime asks for);
- SGLang on CPU: the CPU device, no CUDA graphs, torch's native attention, a small KV pool;
- Megatron on CPU: gloo, the local transformer implementation without fused kernels, and
  ``slime_modal.cpu.layer_spec`` through slime's ``--spec``;
- weight sync: slime's disk-delta path with our ``sparse`` encoding (``patches/slime/0002``),
  published and awaited through our hooks (``slime_modal.weight_hooks``);
- the reward: the sandboxed code reward plus shaping (``slime_modal.cpu.code_reward``); our
  step numbers through slime's rollout log hook (``slime_modal.step_metrics``); tensorboard.
"""

from __future__ import annotations

import sys
from pathlib import Path

from slime_modal.cpu import tiny

STEPS = 3


def run_args(tiny_dir: Path, run_dir: Path, external_engines: bool = False) -> list[str]:
    """``external_engines``: the engines are ``--rollout-engines``' (our rollout manager starts
    them), so slime reserves no rollout GPU."""
    run_dir = Path(run_dir).resolve()
    return [
        *tiny.make(tiny_dir),
        # placement
        *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"),
        *(() if external_engines else ("--rollout-num-gpus", "1")),
        *("--rollout-num-gpus-per-engine", "1"),
        # SGLang on CPU
        *("--sglang-device", "cpu", "--sglang-mem-fraction-static", "0.05", "--sglang-disable-cuda-graph"),
        *("--sglang-attention-backend", "torch_native"),
        # Megatron on CPU
        *("--distributed-backend", "gloo", "--transformer-impl", "local"),
        *("--spec", "slime_modal.cpu.layer_spec", "layer_spec"),
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion",
        "--no-rope-fusion",
        "--no-persist-layer-norm",
        *("--attention-dropout", "0.0", "--hidden-dropout", "0.0"),
        "--accumulate-allreduce-grads-in-fp32",
        "--attention-softmax-in-fp32",
        "--bf16",
        # GRPO, sized for two cores
        *("--num-rollout", str(STEPS), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "32", "--rollout-temperature", "1.0"),
        *("--global-batch-size", "16", "--micro-batch-size", "4"),
        *("--advantage-estimator", "grpo", "--optimizer", "adam", "--lr", "0.02"),
        *("--lr-decay-style", "constant", "--weight-decay", "0.0"),
        # weight sync: the disk delta with our encoding and hooks
        *("--update-weight-mode", "delta", "--update-weight-transport", "disk"),
        *("--update-weight-disk-dir", str(run_dir / "sync")),
        *("--update-weight-local-checkpoint-dir", str(run_dir / "engine-checkpoint")),
        *("--update-weight-delta-encoding", "sparse"),
        *("--custom-update-weight-post-write-path", "slime_modal.weight_hooks.post_write_commit"),
        *("--sglang-custom-pull-weights-pre-read-hook", "slime_modal.weight_hooks.pre_read_reload"),
        # reward, our step numbers, tensorboard
        *("--custom-rm-path", "slime_modal.cpu.code_reward.reward_func"),
        *("--custom-rollout-log-function-path", "slime_modal.step_metrics.log_rollout_data"),
        "--use-tensorboard",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    external = "--external-engines" in argv
    argv = [a for a in argv if a != "--external-engines"]
    if len(argv) != 2:
        print(
            "usage: python -m slime_modal.cpu.run_args TINY_DIR RUN_DIR [--external-engines]", file=sys.stderr
        )
        return 2
    for token in run_args(Path(argv[0]), Path(argv[1]), external):
        print(token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
