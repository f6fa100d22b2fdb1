"""The LoRA trajectory of the ``engine-sync`` suite's LoRA row (and ``tests/weightsync/test_lora_sync.py``).

A PEFT LoRA adapter on a Qwen2 made here (no hub: the suite's row uses the ``engine-sync`` 22 M
model with rank 16 on every linear layer, an adapter/model ratio a real run has; the tests'
child uses the ~0.4 M tiny one of ``verl_modal.cpu.tiny`` at rank 8), trained with real Adam steps
(fp32, as trainers keep adapters) on random token batches with the causal LM loss; the base
stays frozen. Per version: the adapter alone (cast to bf16, the engine's LoRA dtype, under
PEFT's saved names: what an adapter-only sync publishes) and the merged weights (base + B·A·alpha/r, cast to bf16: what a
merged-weights sync publishes, under the checkpoint's names).

Invariants: version ``i`` is the state after ``i + 1`` steps; the same seed gives the same
states; the merged state's names are the base checkpoint's (tied weights once), so it loads
into an engine of the base model.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

RANK, ALPHA = 8, 16
TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")
# The suite's row: rank 16 on every linear layer of the 22 M model (~4% of its parameters).
ROW_RANK = 16
ROW_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LR = 1e-4  # LoRA RL runs use larger rates than full fine-tuning (1e-5 .. 1e-4)
BATCH, SEQ = 4, 32


def lora_config_dict(model_dir: Path, rank: int = RANK, targets: tuple = TARGETS) -> dict:
    from modal_rl.weightsync.apply.lora import adapter_config

    return adapter_config(rank, ALPHA, list(targets), base_model=str(model_dir))


def lora_versions(
    model_dir: Path, versions: int, lr: float = LR, seed: int = 0, rank: int = RANK, targets: tuple = TARGETS
) -> list[dict]:
    """``versions`` dicts ``{"adapter": {name: bf16}, "merged": {name: bf16}}``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from benchmarks._engine_sync_model import adam_steps
    from modal_rl.weightsync.apply.lora import adapter_state

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=list(targets), lora_dropout=0.0)
    )
    trainable = [p for p in model.parameters() if p.requires_grad]

    def snapshot(model) -> dict:
        # bf16 on the wire: the engine's LoRA dtype (the model's); see lora.adapter_state
        adapter, _ = adapter_state(
            ((n, p.detach().clone()) for n, p in model.named_parameters()), torch.bfloat16
        )
        return {"adapter": adapter, "merged": merged_state(model)}

    return adam_steps(model, trainable, versions, lr, seed, snapshot, batch=(BATCH, SEQ))


def merged_state(peft_model) -> dict:
    """The bf16 weights an engine of the base model serves at this adapter version: each
    adapted layer's frozen fp32 base plus PEFT's own ``get_delta_weight`` (B·A·alpha/r), the
    base model itself left untouched (merging and unmerging in place would drift it)."""
    from peft.tuners.lora import LoraLayer

    inner = peft_model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in inner.named_modules():
            if isinstance(module, LoraLayer):
                deltas[f"{name}.weight"] = module.get_delta_weight("default")
        state, seen = {}, set()
        for name, param in inner.named_parameters():
            if ".lora_" in name or id(param) in seen:
                continue  # tied embeddings once, as the checkpoint holds them
            seen.add(id(param))
            name = name.replace(".base_layer", "")
            value = param.detach() + deltas[name] if name in deltas else param.detach()
            state[name] = value.to(torch.bfloat16).clone()
    return state


# --- the suite's LoRA row ------------------------------------------------------------------
MAX_RESIDENT = 2  # = resident_for_staleness(1): an async run one step off policy
LOGPROB_TOL = 0.05  # LoRA kernels (B·A applied at run time) vs bf16 merged weights: see docs
ADAPTER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_engine_spec(model_dir: Path, rank: int = ROW_RANK):
    """One local ``vllm serve`` of the base model with LoRA on: ``MAX_RESIDENT`` slots (and as
    many adapters kept on the CPU), up to ``rank``, adapters loaded at run time over HTTP."""
    import dataclasses

    from modal_rl.engines.vllm import local_vllm_spec

    spec = local_vllm_spec(str(model_dir), max_model_len=256, name="vllm-engine-sync-lora", inplace=False)
    extra = [
        "--enable-lora",
        "--max-loras",
        str(MAX_RESIDENT),
        "--max-cpu-loras",
        str(MAX_RESIDENT),
        "--max-lora-rank",
        str(rank),
    ]
    return dataclasses.replace(spec, command=[*spec.command, *extra], env={**spec.env, **ADAPTER_ENV})


def adapter_path(model_dir: Path, trajectory: list[dict], log_dir: Path) -> dict:
    """Adapter-only frames published on a frame server (``EnginePusher.publish``) and loaded
    by the engine as versioned adapters (``lora_push.load_adapter_version``: its workers stage
    and verify each version while the engine serves, then ``/v1/load_lora_adapter``); per
    version: bytes, the pause,
    publish to live; greedy completions of each version, and what the engine lists at the end."""
    from benchmarks.engine_sync import _post, complete
    from modal_rl.engines.lora_push import load_adapter_version
    from modal_rl.engines.pool import get_engine_pool
    from modal_rl.engines.vllm_push import EnginePusher
    from modal_rl.run_key import run_key
    from modal_rl.weightsync.apply.lora import AdapterVersions

    pool = get_engine_pool(lora_engine_spec(model_dir), "local", log_dir=str(log_dir))
    versions = AdapterVersions(MAX_RESIDENT)
    try:
        (url,) = pool.start()
        base = complete(url, str(model_dir))
        rows, completions = [], []
        with EnginePusher(None, anchor_every=16) as pusher:
            for state in trajectory:
                t0 = time.perf_counter()
                source, numbers = pusher.publish(state["adapter"])
                loaded = load_adapter_version(
                    url, source, versions, lora_config_dict(model_dir, ROW_RANK, ROW_TARGETS), key=run_key()
                )
                rows.append({**numbers, **loaded, "engine_s": time.perf_counter() - t0})
                completions.append(complete(url, versions.name(source.version)))
        # The previous version is still resident and answers as it did (an async run's
        # requests in flight on it finish on it); the one before that was unloaded.
        # (After a prefix-cache reset: a prompt whose first block is cached is computed in two
        # parts, which moves its logprobs in the last digits on this CPU.)
        _post(url + "/reset_prefix_cache")
        previous = complete(url, versions.name(len(trajectory) - 2))
        listed = sorted(m["id"] for m in _get(url + "/v1/models")["data"])
    finally:
        pool.stop()
    return {
        "rows": rows,
        "base": base,
        "completions": completions,
        "previous_still_served": previous["tokens"] == completions[-2]["tokens"],
        "previous_max_logprob_diff": _max_diff(previous, completions[-2]),
        "listed": listed,
        "resident": {versions.name(v): i for v, i in versions.resident().items()},
    }


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def _get(url: str) -> dict:
    import json
    import urllib.request

    from modal_rl.engines.auth import bearer_header
    from modal_rl.run_key import run_key

    with urllib.request.urlopen(
        urllib.request.Request(url, headers=bearer_header(run_key())), timeout=60
    ) as r:
        return json.loads(r.read().decode())


def merged_path(model_dir: Path, trajectory: list[dict], log_dir: Path) -> dict:
    """The same versions as merged bf16 weights, pushed as lossless deltas in place into an
    engine of the base model (``engine-sync``'s ``inplace`` mode); the final completion."""
    from benchmarks.engine_sync import _post, _rpc, complete, engine_spec, push_all
    from modal_rl.engines.pool import get_engine_pool

    pool = get_engine_pool(engine_spec(model_dir, "vllm-engine-sync-merged"), "local", log_dir=str(log_dir))
    try:
        (url,) = pool.start()
        rows = push_all(url, [s["merged"] for s in trajectory], "inplace")
        _post(url + "/reset_prefix_cache")
        final = complete(url, str(model_dir))
        fallback = int(max(m.get("fallback_params", 0) for m in _rpc(url, "modal_rl_engine_map")))
    finally:
        pool.stop()
    return {"rows": rows, "final": final, "fallback_params": fallback}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if r["version"] >= 1)


def run_lora(quick: bool, out: Path) -> dict:
    """The suite's ``lora`` object (see docs/benchmarks.md); raises if the adapter engine's
    completions do not follow the versions or differ from the merged engine's."""
    import tempfile

    from benchmarks._engine_sync_model import make_model_dir

    versions = 4 if quick else 9
    logs = out / "engine-sync-logs"
    with tempfile.TemporaryDirectory(prefix="engine-sync-lora-") as tmp:
        model_dir = make_model_dir(Path(tmp))  # the suite's 22 M model, in both modes
        trajectory = lora_versions(model_dir, versions, rank=ROW_RANK, targets=ROW_TARGETS)
        adapter = adapter_path(model_dir, trajectory, logs / "lora-adapter")
        merged = merged_path(model_dir, trajectory, logs / "lora-merged")
    final = adapter["completions"][-1]
    diff = _max_diff(final, merged["final"])
    result = {
        "versions": versions,
        "rank": ROW_RANK,
        "alpha": ALPHA,
        "targets": list(ROW_TARGETS),
        "lr": LR,
        "max_resident": MAX_RESIDENT,
        "adapter_params": sum(t.numel() for t in trajectory[0]["adapter"].values()),
        "model_params": sum(t.numel() for t in trajectory[0]["merged"].values()),
        "adapter_ratio": sum(t.numel() for t in trajectory[0]["adapter"].values())
        / sum(t.numel() for t in trajectory[0]["merged"].values()),
        "bytes_per_version": _median(adapter["rows"], "payload_mbytes") * (1 << 20),
        "full_bytes_per_version": _median(merged["rows"], "payload_mbytes") * (1 << 20),
        "pause_s": _median(adapter["rows"], "pause_s"),
        "pause_wall_s": _median(adapter["rows"], "pause_wall_s"),
        "full_pause_s": _median(merged["rows"], "pause_s"),
        "full_pause_wall_s": _median(merged["rows"], "pause_wall_s"),
        "wall_s": _median(adapter["rows"], "engine_s"),
        "full_wall_s": _median(merged["rows"], "engine_s"),
        "completions_match": final["tokens"] == merged["final"]["tokens"] and diff <= LOGPROB_TOL,
        "max_logprob_diff": diff,
        "logprob_tolerance": LOGPROB_TOL,
        "completions_changed": final != adapter["base"],
        "versions_distinct": len({tuple(c["logprobs"]) for c in adapter["completions"]}) == versions,
        "previous_still_served": adapter["previous_still_served"],
        "previous_max_logprob_diff": adapter["previous_max_logprob_diff"],
        "resident": adapter["resident"],
        "listed": adapter["listed"],
        "fallback_params": 0,  # every version is one whole adapter load: nothing falls back
        "full_fallback_params": merged["fallback_params"],
        "per_version": {"adapter": adapter["rows"], "merged": merged["rows"]},
    }
    problems = [
        k
        for k in ("completions_match", "completions_changed", "versions_distinct", "previous_still_served")
        if not result[k]
    ]
    if problems:
        result["problem"] = f"LoRA row failed {problems}: adapter {final}, merged {merged['final']}"
    return result


def render_lora(lora: dict) -> str:
    from benchmarks.report import markdown_table

    mb = 1 << 20
    rows = [
        [
            "adapter only (versioned LoRA adapters)",
            lora["bytes_per_version"] / mb,
            lora["pause_s"],
            lora["pause_wall_s"],
            lora["wall_s"],
        ],
        [
            "merged weights (lossless delta, in place)",
            lora["full_bytes_per_version"] / mb,
            lora["full_pause_s"],
            lora["full_pause_wall_s"],
            lora["full_wall_s"],
        ],
    ]
    headers = [
        "LoRA sync, per version (median, v1..)",
        "wire MB",
        "pause s",
        "pause wall s (HTTP incl.)",
        "publish to live s",
    ]
    return (
        f"## LoRA: adapter only vs merged weights\n\nrank {lora['rank']} on {', '.join(lora['targets'])} "
        f"({lora['adapter_params']:,} adapter parameters; model {lora['model_params']:,}; both bf16 on the wire), "
        f"Adam lr {lora['lr']:g}, {lora['versions']} versions, {lora['max_resident']} resident.\n\n"
        f"{markdown_table(headers, rows)}\n\n"
        f"Completions of the adapter engine equal the merged-weights engine's: {lora['completions_match']} "
        f"(max logprob diff {lora['max_logprob_diff']:.3g}, tolerance {lora['logprob_tolerance']:g}); "
        f"changed from the base: {lora['completions_changed']}; the previous version still served: "
        f"{lora['previous_still_served']}; engine lists {lora['listed']}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks._engine_sync_lora [--quick] [--out DIR]``: the LoRA row alone."""
    import argparse
    import json
    import os

    from modal_rl.run_key import RUN_KEY_ENV, new_run_key

    parser = argparse.ArgumentParser(prog="python -m benchmarks._engine_sync_lora")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks"))
    args = parser.parse_args(argv)
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())  # the engine and the receiver share it
    args.out.mkdir(parents=True, exist_ok=True)
    lora = run_lora(args.quick, args.out)
    (args.out / "engine-sync-lora.json").write_text(json.dumps(lora, indent=1))
    print(render_lora(lora))
    if lora.get("problem"):
        print(lora["problem"])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
