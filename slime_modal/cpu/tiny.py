"""Tiny local assets for slime's ``train.py`` on CPU, made here (nothing downloaded): a
~0.4 M-parameter Qwen2 with its tokenizer, and a code task in slime's JSONL form.

``python -m slime_modal.cpu.tiny DIR`` writes::

    DIR/model/         config.json, model.safetensors, tokenizer files (chat template inside)
    DIR/train.jsonl    {"prompt": [chat], "label": "<test spec JSON>", "metadata": {"solution": ...}}
    DIR/args.txt       slime's arguments for the model and data (one token per line)

Each prompt asks for a program that reads ``a b`` and prints one arithmetic result; the label
holds stdin/stdout test cases (``modal_rl.sandboxes.coderun``), scored in bubblewrap by
``slime_modal.cpu.code_reward``. The model, tokenizer and prompts are ``modal_rl.tiny_model``'s, as
verl's code task uses them (one source for both frameworks' CPU runs). Skipped when
``DIR/args.txt`` exists (written last).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from modal_rl.tiny_model import MODEL_SHAPE, code_tasks, make_model, make_tokenizer


def model_args(vocab_size: int) -> list[str]:
    """Megatron's shape flags for the Qwen2 of :data:`MODEL_SHAPE` (slime's model scripts' form)."""
    s = MODEL_SHAPE
    return [
        "--swiglu",
        "--num-layers",
        str(s["num_hidden_layers"]),
        "--hidden-size",
        str(s["hidden_size"]),
        "--ffn-hidden-size",
        str(s["intermediate_size"]),
        "--num-attention-heads",
        str(s["num_attention_heads"]),
        "--group-query-attention",
        "--num-query-groups",
        str(s["num_key_value_heads"]),
        "--use-rotary-position-embeddings",
        "--disable-bias-linear",
        "--add-qkv-bias",
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        "1e-6",
        "--rotary-base",
        "10000",
        "--vocab-size",
        str(vocab_size),
        "--max-position-embeddings",
        str(s["max_position_embeddings"]),
        "--seq-length",
        str(s["max_position_embeddings"]),
    ]


def make(out: Path, *, seed: int = 0, n_train: int = 256, vocab_size: int = 1000) -> list[str]:
    out = Path(out).resolve()
    if (out / "args.txt").is_file():
        return (out / "args.txt").read_text().split("\n")[:-1]
    out.mkdir(parents=True, exist_ok=True)
    from slime_modal.cpu import torchvision_ops

    torchvision_ops.install()  # transformers imports torchvision
    tasks = code_tasks(n_train, seed, "train")
    tokenizer = make_tokenizer(tasks, vocab_size)
    model = make_model(tokenizer, seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    with open(out / "train.jsonl", "w") as f:
        for task in tasks:
            record = {
                "prompt": [{"role": "user", "content": task["question"]}],
                "label": task["ground_truth"],
                "metadata": {"solution": task["solution"]},
            }
            f.write(json.dumps(record) + "\n")
    args = [
        "--hf-checkpoint",
        str(out / "model"),
        "--load",
        str(out / "model"),
        "--prompt-data",
        str(out / "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--metadata-key",
        "metadata",
        "--apply-chat-template",
        *model_args(model.config.vocab_size),
    ]
    (out / "args.txt").write_text("\n".join(args) + "\n")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime_modal.cpu.tiny", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for line in make(args.out, seed=args.seed):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
