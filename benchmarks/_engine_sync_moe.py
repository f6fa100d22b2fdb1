"""The ``engine-sync`` suite's MoE row: per-expert deltas into vLLM's fused experts, in place.

The model: a Qwen2-MoE made here (:data:`SHAPE`: 16 experts, top-2, a shared expert, 4
layers, ~16 M parameters; ``_moe_engine.make_model_dir``), saved with one tensor per expert
and projection as ``save_pretrained`` writes it. The engine: a real ``vllm serve`` (CPU, the
worker extension, plain weights: ``vllm_cpu_moe`` keeps the fused ``w13_weight`` /
``w2_weight`` in the loader's layout), run through the suite's own ``run_case``: the same
versions pushed as full reloads, as deltas with a full reload, and as deltas in place, with
its greedy and bit-identity checks.

The trajectory and its sparsity (why some experts barely move): real Adam steps (lr 1e-6,
fp32 master weights, the bf16 cast published as each version) of the model on token batches
drawn from a narrow vocabulary of :data:`TASK_TOKENS` ids -- one RL task's prompts and
answers come from one domain. An expert gets a gradient in a step only if the router sent it
tokens, and the router's load from those real tokens (counted per step) is uneven: in the
deeper layers several of the 16 experts get no token in a step. Adam then moves such an
expert only by its momentum, and not at all while it has never had a token: measured per
version (``experts_unrouted``, ``experts_unchanged``, ``unrouted_changed_fraction``), not
assumed.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
    num_experts=16,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LR = 1e-6  # as the dense rows: RL fine-tuning learning rates
TASK_TOKENS = 256  # the task's vocabulary: a narrow domain, as one RL task's prompts are
BATCH, SEQ = 4, 64


def trajectory(config_dir: Path, versions: int, seed: int = 0) -> tuple[list[dict], list[Any]]:
    """``versions + 1`` checkpoints (the initial model, then after each Adam step) and, per
    step, the router's load: tokens per (layer, expert), counted from that step's batch."""
    from benchmarks._moe_engine import checkpoint_of, hf_model

    model = hf_model(config_dir, seed=seed)
    model.train()
    experts = model.config.num_experts
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    step_load: list[Any] = []

    def count(_module, _inputs, output) -> None:  # Qwen2MoeTopKRouter -> (logits, scores, indices)
        step_load.append(torch.bincount(output[2].reshape(-1), minlength=experts))

    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in model.model.layers]
    gen = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(model.config.vocab_size, generator=gen)[:TASK_TOKENS]
    states, loads = [checkpoint_of(model)], []
    try:
        for _ in range(versions):
            step_load.clear()
            tokens = vocab[torch.randint(0, TASK_TOKENS, (BATCH, SEQ), generator=gen)]
            loss = model(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            states.append(checkpoint_of(model))
            loads.append(torch.stack(step_load))  # [layers, experts]
    finally:
        for hook in hooks:
            hook.remove()
    return states, loads


def expert_motion(old: dict, new: dict, load: Any) -> dict[str, float]:
    """Per version: how many (layer, expert) pairs got no token, did not change at all, and
    the changed-word fraction of routed and unrouted experts."""
    from modal_rl.weightsync.apply.moe import expert_of

    changed: dict[tuple[str, int], list[int]] = {}
    for name, t in new.items():
        where = expert_of(name)
        if where:
            diff = int((t.view(torch.int16) != old[name].view(torch.int16)).sum())
            changed.setdefault(where, [0, 0])
            changed[where][0] += diff
            changed[where][1] += t.numel()
    layers = sorted({layer for layer, _ in changed})
    routed = {(layer, e): int(load[i][e]) > 0 for i, layer in enumerate(layers) for e in range(load.shape[1])}

    def fraction(keys: list) -> float:
        total = sum(changed[k][1] for k in keys)
        return sum(changed[k][0] for k in keys) / total if total else 0.0

    return {
        "experts": len(changed),
        "experts_unrouted": sum(not r for r in routed.values()),
        "experts_unchanged": sum(c == 0 for c, _ in changed.values()),
        "routed_changed_fraction": fraction([k for k in changed if routed[k]]),
        "unrouted_changed_fraction": fraction([k for k in changed if not routed[k]]),
    }


def run_moe_case(versions: int, out: Path) -> dict[str, Any]:
    """The MoE row: ``versions`` Adam steps pushed into a real vllm-cpu MoE engine in every
    mode (``engine_sync.run_case``), with the per-version sparsity of the trajectory."""
    from benchmarks._moe_engine import describe, make_model_dir
    from benchmarks.engine_sync import run_case

    with tempfile.TemporaryDirectory(prefix="engine-sync-moe-") as tmp:
        model_dir = make_model_dir(Path(tmp), SHAPE)
        states, loads = trajectory(model_dir, versions)
        case = run_case("moe", model_dir, states[1:], out)
        shape = describe(model_dir)
    motion = [expert_motion(states[v - 1], states[v], loads[v - 1]) for v in range(1, len(states))]
    med, s = case["medians"], case["summary"]

    def median(key: str) -> float:
        return statistics.median(m[key] for m in motion)

    return {
        "engine": "one vllm-cpu server (bf16, plain weights and plain MoE experts), the same for every mode",
        "model": {**shape, "params_m": case["params_m"], "tensors": case["tensors"]},
        "sparsity_model": f"real Adam steps (lr {LR:g}) on {BATCH}x{SEQ}-token batches from a "
        f"{TASK_TOKENS}-token vocabulary; router load counted per step",
        "versions": versions,
        "bytes_per_version": med["inplace"]["payload_mbytes"] * 1e6,
        "full_bytes_per_version": med["full"]["payload_mbytes"] * 1e6,
        "pause_s": s["delta_pause_s"],
        "full_pause_s": s["full_pause_s"],
        "reload_delta_pause_s": s["reload_delta_pause_s"],
        "params_identical": s["params_identical"],
        "completions_identical": s["completions_identical"],
        "fallback_params": s["fallback_params"],
        "experts_unrouted_median": median("experts_unrouted"),
        "experts_unchanged_median": median("experts_unchanged"),
        "routed_changed_fraction_median": median("routed_changed_fraction"),
        "unrouted_changed_fraction_median": median("unrouted_changed_fraction"),
        "motion": motion,
        "case": case,
        "problem": case["problem"],
    }


def render_moe(moe: dict[str, Any]) -> str:
    m = moe["model"]
    return (
        f"MoE ({m['num_experts']} experts top-{m['num_experts_per_tok']}, {m['num_hidden_layers']} layers, "
        f"{m['params_m']:.1f} M params; {moe['engine']}): per version {moe['bytes_per_version'] / 1e6:.3g} MB "
        f"delta vs {moe['full_bytes_per_version'] / 1e6:.3g} MB full; pause {moe['pause_s']:.3g} s in place vs "
        f"{moe['full_pause_s']:.3g} s full load; bit-identical to a full load: {moe['params_identical']}; "
        f"parameters reloaded instead: {moe['fallback_params']}; of {m['num_experts'] * m['num_hidden_layers']} "
        f"experts per version (median) {moe['experts_unrouted_median']:g} got no token, "
        f"{moe['experts_unchanged_median']:g} did not change.\n"
    )
