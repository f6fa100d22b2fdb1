"""Tiny local assets for a verl run without a hub: a ~0.4 M-parameter Qwen2, its tokenizer,
and prompts in parquet for one of two tasks:

- ``arith`` (default): GSM8K-style arithmetic, scored by the shaping reward in ``arith_reward``;
- ``code``: "write a program" prompts whose ``ground_truth`` holds stdin/stdout test cases
  (``modal_rl.sandboxes.coderun`` format; model, tokenizer and task from
  ``modal_rl.tiny_model``, shared with slime's CPU run), scored by running the response in bubblewrap
  sandboxes through the ``modal_sandbox`` reward manager, with the sandboxed
  ``code_interpreter`` tool offered to verl's ``tool_agent`` loop.

``python -m verl_modal.cpu.tiny DIR [--task code]`` writes::

    DIR/model/        config.json, model.safetensors, tokenizer files (chat template inside)
    DIR/train.parquet DIR/test.parquet   verl RL rows: prompt (chat), reward_model.ground_truth
    DIR/overrides.txt the Hydra overrides that point verl at all of the above

Invariants: nothing is downloaded (works with ``HF_HUB_OFFLINE=1``); the same seed gives
the same prompts and tokenizer; :func:`make` skips work when ``DIR/overrides.txt`` exists
(it is written last, so its presence means the assets are complete) and refuses a DIR made
for the other task (``DIR/task.txt``; absent means ``arith``).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from modal_rl import tiny_model
from modal_rl.tiny_model import make_model

DATA_SOURCE = "verl_modal/tiny_arith"
CODE_DATA_SOURCE = "verl_modal/tiny_code"
REWARD_MODULE = "pkg://verl_modal.cpu.arith_reward"
TASKS = ("arith", "code")
INSTRUCTION = "Put the final answer after ####."


def arithmetic_rows(n: int, seed: int, split: str) -> list[dict]:
    """``n`` verl RL rows of two-operand integer arithmetic with decimal-string answers."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"Tom has {a} apples. What is {a} {op} {b}? {INSTRUCTION}"
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "question": question},
            }
        )
    return rows


def code_rows(n: int, seed: int, split: str, n_cases: int = 2) -> list[dict]:
    """``n`` verl RL rows of :func:`modal_rl.tiny_model.code_tasks` (the program prompts);
    ``ground_truth`` is the JSON ``{"inputs": [...], "outputs": [...]}``."""
    return [
        {
            "data_source": CODE_DATA_SOURCE,
            "prompt": [{"role": "user", "content": t["question"]}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": t["ground_truth"]},
            "extra_info": {"split": split, "index": i, "question": t["question"], "solution": t["solution"]},
        }
        for i, t in enumerate(tiny_model.code_tasks(n, seed, split, n_cases))
    ]


def make_tokenizer(rows: list[dict], vocab_size: int):
    """The shared tiny tokenizer (:func:`modal_rl.tiny_model.make_tokenizer`) on verl rows."""
    tasks = [
        {
            "question": r["prompt"][0]["content"],
            "ground_truth": r["reward_model"]["ground_truth"],
            "solution": r["extra_info"].get("solution"),
        }
        for r in rows
    ]
    return tiny_model.make_tokenizer(tasks, vocab_size)


# Batch and length sizes that fit the tiny model on a 2-core host (prompts are ~40 tokens).
WORKLOAD_SIZES = [
    "data.train_batch_size=4",
    "data.max_prompt_length=64",
    "data.max_response_length=32",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "actor_rollout_ref.rollout.max_num_batched_tokens=512",
    "actor_rollout_ref.rollout.max_model_len=128",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
]


def overrides_for(out: Path, task: str = "arith") -> list[str]:
    """Hydra overrides that point verl's model, data and reward at the assets in ``out``."""
    out = Path(out).resolve()
    assets = [
        f"actor_rollout_ref.model.path={out / 'model'}",
        f"data.train_files={out / 'train.parquet'}",
        f"data.val_files={out / 'test.parquet'}",
    ]
    if task == "code":
        from verl_modal.cpu.sandbox_run import code_task_overrides

        return [*assets, *code_task_overrides(), *WORKLOAD_SIZES]
    return [
        *assets,
        f"reward.custom_reward_function.path={REWARD_MODULE}",
        "reward.custom_reward_function.name=compute_score",
        *WORKLOAD_SIZES,
    ]


def task_of(out: Path) -> str | None:
    """The task ``out`` was made for; None when it holds no complete assets."""
    out = Path(out)
    if not (out / "overrides.txt").exists():
        return None
    marker = out / "task.txt"
    return marker.read_text().strip() if marker.exists() else "arith"


def check_dir(out: Path) -> None:
    """Make ``out`` (with parents) unless it exists; ``ValueError`` (one line) when it is a
    file or cannot be made. Cheap (no torch): the launcher calls it before anything slow."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--tiny {out}: that is a file, not a directory; give a directory for the tiny model and "
            "data (made if missing), e.g. --tiny runs/verl-cpu/tiny"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--tiny {out}: cannot make that directory ({exc.strerror or exc}); give a directory you "
            "can write, e.g. --tiny runs/verl-cpu/tiny"
        ) from None


def make(
    out: Path,
    *,
    task: str = "arith",
    seed: int = 0,
    n_train: int = 256,
    n_test: int = 32,
    vocab_size: int = 1000,
) -> list[str]:
    """Write the assets into ``out`` (skipped when complete) and return their overrides.

    Raises ``ValueError`` for an unknown task or a DIR already made for the other task."""
    import pandas as pd

    if task not in TASKS:
        raise ValueError(f"unknown tiny task {task!r}; choose one of {', '.join(TASKS)}")
    out = Path(out)
    made = task_of(out)
    if made is not None:
        if made != task:
            raise ValueError(f"{out} holds tiny assets for task {made!r}, not {task!r}; use another DIR")
        return overrides_for(out, task)
    check_dir(out)
    rows = code_rows if task == "code" else arithmetic_rows
    train, test = rows(n_train, seed, "train"), rows(n_test, seed, "test")
    tokenizer = make_tokenizer(train + test, vocab_size)
    model = make_model(tokenizer, seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" for a 2 MB file says nothing
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    pd.DataFrame(train).to_parquet(out / "train.parquet")
    pd.DataFrame(test).to_parquet(out / "test.parquet")
    (out / "task.txt").write_text(task + "\n")
    overrides = overrides_for(out, task)
    (out / "overrides.txt").write_text("\n".join(overrides) + "\n")
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_modal.cpu.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory for the model, tokenizer and parquet files")
    parser.add_argument("--task", choices=TASKS, default="arith")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        lines = make(args.out, task=args.task, seed=args.seed)
    except ValueError as exc:
        print(f"verl_modal.cpu.tiny: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
