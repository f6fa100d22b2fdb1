"""Suite ``sandboxes``: local bubblewrap pool measurements + a simulated Modal-latency workload.

Local (real bubblewrap sandboxes on this host): cold create→ready latency, warm claim latency
under a paced rollout workload, exec round trip, burst create throughput, and leaks (live
processes or registry entries of this run) after everything closed.
Simulation (``_sandboxes_sim``): consumer wait per 1,000 rollouts for no pool, fixed pools,
the adaptive pool, and the issue's p99 formula; the oracle is the smallest fixed pool with zero
wait. All policies see the same arrivals and provider luck per seed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from pathlib import Path

import psutil

from benchmarks import _sandboxes_sim as sim
from benchmarks import sandboxes_scoring
from benchmarks.report import markdown_table, progress, write_json
from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.live_records import entries
from modal_rl.sandboxes.sizing import percentile

SUITE = "sandboxes"


def _descendants(root: int) -> set[int]:
    """Live (non-zombie) descendants of ``root``."""
    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    out = set()
    for kid in kids:
        try:
            if kid.status() != psutil.STATUS_ZOMBIE:
                out.add(kid.pid)
        except psutil.NoSuchProcess:
            continue
    return out


async def _local(quick: bool, run_id: str) -> dict:
    provider = LocalProvider()
    spec = SandboxSpec(timeout_s=300)
    tags = {"modal-rl-run": run_id}
    n_cold, n_claims, n_exec, n_burst = (20, 40, 50, 8) if quick else (100, 200, 300, 32)

    cold = []
    for _ in progress(range(n_cold), total=n_cold, desc="cold create→ready"):
        t0 = time.monotonic()
        sb = await provider.create(spec, tags=tags)
        await sb.ready()
        cold.append(time.monotonic() - t0)
        await sb.terminate()

    t0 = time.monotonic()
    burst = await asyncio.gather(*(provider.create(spec, tags=tags) for _ in range(n_burst)))
    await asyncio.gather(*(sb.ready() for sb in burst))
    creates_per_s = n_burst / (time.monotonic() - t0)
    await asyncio.gather(*(sb.terminate() for sb in burst))

    exec_rtt = []
    async with SandboxPool(
        provider,
        spec,
        min_warm=4,
        max_live=32,
        run_id=run_id,
        name="bench",
        rate_limiter=False,
        log_interval_s=0,
    ) as pool:
        while pool.snapshot()["warm"] < 4:
            await asyncio.sleep(0.01)
        async with pool.lease(reuse=True) as sb:
            for _ in progress(range(n_exec), total=n_exec, desc="exec round trip"):
                t = time.monotonic()
                r = await sb.exec(["true"], timeout_s=10)
                exec_rtt.append(time.monotonic() - t)
                assert r.returncode == 0, r.stderr
        # Paced rollouts: 5 claims/s, each runs one short command in its single-use sandbox.
        claims = []

        async def rollout():
            t = time.monotonic()
            async with pool.lease() as sb:
                claims.append(time.monotonic() - t)
                await sb.exec(["python3", "-c", "print(sum(range(1000)))"], timeout_s=30)

        tasks = []
        for _ in progress(range(n_claims), total=n_claims, desc="paced warm claims"):
            tasks.append(asyncio.ensure_future(rollout()))
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks)
        snapshot = pool.snapshot()

    await asyncio.sleep(0.2)
    leaked = len(_descendants(os.getpid())) + sum(
        1 for e in entries(provider.registry_dir) if e.get("tags", {}).get("modal-rl-run") == run_id
    )
    return {
        "cold_p50_s": percentile(cold, 50),
        "cold_p99_s": percentile(cold, 99),
        "warm_claim_p50_s": percentile(claims, 50),
        "warm_claim_p99_s": percentile(claims, 99),
        "exec_rtt_p50_s": percentile(exec_rtt, 50),
        "exec_rtt_p99_s": percentile(exec_rtt, 99),
        "creates_per_s": creates_per_s,
        "leaked": leaked,
        "n": {"cold": n_cold, "claims": n_claims, "exec": n_exec, "burst": n_burst},
        "pool_snapshot": {k: v for k, v in snapshot.items() if k not in ("pool", "run")},
        "_cold": cold,
        "_claims": claims,
    }


def _simulate(quick: bool) -> dict:
    seeds = range(3 if quick else 10)
    sizes = [0, 4, 8, 12, 16, 20, 24, 32, 48]
    rows = {"none": [], "adaptive": [], "p99": [], "oracle": []}
    fixed = {n: [] for n in sizes}
    for seed in progress(seeds, total=len(seeds), desc="simulation seeds"):
        rows["none"].append(sim.simulate("none", seed=seed))
        rows["adaptive"].append(sim.simulate("adaptive", seed=seed))
        rows["p99"].append(sim.simulate("adaptive", seed=seed, sizing="p99"))
        rows["oracle"].append(sim.oracle(1000, 2.0, seed)[0])
        for n in sizes:
            fixed[n].append(sim.simulate(f"fixed:{n}", seed=seed).wait_s)

    def mean(xs):
        return statistics.fmean(xs)

    # A changing claim rate (1 → 4 → 1 claims/s, a third of the rollouts each): where sizing
    # online pays, and where its lag after a rate jump shows.
    phases = (1.0, 4.0, 1.0)
    ph = {"none": [], "adaptive": [], "oracle": []}
    for seed in seeds:
        ph["none"].append(sim.simulate("none", seed=seed, rates=phases).wait_s)
        a = sim.simulate("adaptive", seed=seed, rates=phases)
        ph["adaptive"].append((a.mean_size, a.wait_s))
        ph["oracle"].append(sim.oracle(1000, 2.0, seed, rates=phases)[0])
    phased = {
        "claims_per_s": list(phases),
        "oracle_size": mean(ph["oracle"]),
        "adaptive_mean_size": mean([m for m, _ in ph["adaptive"]]),
        "adaptive_wait_s": mean([w for _, w in ph["adaptive"]]),
        "no_pool_wait_s": mean(ph["none"]),
    }

    return {
        "workload": {
            "rollouts": 1000,
            "claims_per_s": 2.0,
            "seeds": len(seeds),
            "provider": vars(sim.ProviderModel()),
        },
        "oracle_size": mean(rows["oracle"]),
        "oracle_sizes": rows["oracle"],
        "adaptive_mean_size": mean([r.mean_size for r in rows["adaptive"]]),
        "adaptive_wait_s": mean([r.wait_s for r in rows["adaptive"]]),
        "no_pool_wait_s": mean([r.wait_s for r in rows["none"]]),
        "p99_formula_mean_size": mean([r.mean_size for r in rows["p99"]]),
        "p99_formula_wait_s": mean([r.wait_s for r in rows["p99"]]),
        "fixed_wait_s": {str(n): mean(w) for n, w in fixed.items()},
        "phased": phased,
    }


def _plots(out: Path, local: dict, s: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = [int(n) for n in s["fixed_wait_s"]]
    ax.plot(xs, [max(s["fixed_wait_s"][str(n)], 0.1) for n in xs], "o-", label="fixed pool")
    ax.plot([0], [s["no_pool_wait_s"]], "s", color="C3", label="no pool")
    ax.plot(
        [s["adaptive_mean_size"]],
        [max(s["adaptive_wait_s"], 0.1)],
        "*",
        ms=14,
        color="C2",
        label="adaptive (lead-time)",
    )
    ax.plot(
        [s["p99_formula_mean_size"]],
        [max(s["p99_formula_wait_s"], 0.1)],
        "^",
        ms=10,
        color="C4",
        label="adaptive (p99 formula)",
    )
    ax.axvline(s["oracle_size"], ls="--", color="gray", label="oracle (smallest zero-wait fixed)")
    ax.set_yscale("log")
    ax.set_xlabel("sandboxes held ready-or-starting (mean)")
    ax.set_ylabel("consumer wait per 1,000 rollouts [s] (0 drawn at 0.1)")
    ax.set_title("Simulated Modal cold starts, 2 claims/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sandboxes-sim.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key, label in (("_cold", "cold create→ready"), ("_claims", "warm claim (pool)")):
        data = sorted(local[key])
        ax.plot(data, [(i + 1) / len(data) for i in range(len(data))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("CDF")
    ax.set_title("Local bubblewrap sandboxes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sandboxes-local.png", dpi=120)
    plt.close(fig)
    return ["sandboxes-sim.png", "sandboxes-local.png"]


def run(quick: bool, out: Path) -> dict:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    local = asyncio.run(_local(quick, run_id))
    scoring = sandboxes_scoring.measure(quick, run_id)
    s = _simulate(quick)
    plots = _plots(out, local, s) + sandboxes_scoring.plot(out, scoring)
    checks = {
        "leaked == 0": local["leaked"] == 0,
        "assert sample time after <= 1.5x before": scoring["ratio_time_after_over_before_asserts"] <= 1.5,
        "same scores before and after": scoring["before"]["scores"] == scoring["after"]["scores"],
        **{
            f"{form} sample time after <= 1.2x previous runner": scoring[
                f"ratio_time_after_over_previous_{form}"
            ]
            <= 1.2
            for form in ("asserts", "pytest", "stdin")
            if f"ratio_time_after_over_previous_{form}" in scoring
        },
        "warm_claim_p99_s <= 0.1 * cold_p50_s": local["warm_claim_p99_s"] <= 0.1 * local["cold_p50_s"],
        "adaptive_wait_s <= 0.02 * no_pool_wait_s": s["adaptive_wait_s"] <= 0.02 * s["no_pool_wait_s"],
        "adaptive_mean_size <= 1.2 * oracle_size": s["adaptive_mean_size"] <= 1.2 * s["oracle_size"],
    }
    public_local = {k: v for k, v in local.items() if not k.startswith("_")}
    payload = {"quick": quick, "local": public_local, "scoring": scoring, "sim": s, "checks": checks}
    payload["plots"] = plots
    write_json(out, SUITE, payload)
    lt = markdown_table(
        ["metric", "value"],
        [(k, v) for k, v in public_local.items() if isinstance(v, int | float)],
    )
    st = markdown_table(
        ["policy", "mean size", "wait per 1,000 rollouts [s]"],
        [("no pool", 0, s["no_pool_wait_s"])]
        + [(f"fixed {n}", int(n), w) for n, w in s["fixed_wait_s"].items()]
        + [
            ("adaptive (lead-time, default)", s["adaptive_mean_size"], s["adaptive_wait_s"]),
            ("adaptive (issue's p99 formula)", s["p99_formula_mean_size"], s["p99_formula_wait_s"]),
            ("oracle (smallest zero-wait fixed)", s["oracle_size"], 0.0),
        ],
    )
    ph = s["phased"]
    pt = markdown_table(
        ["phased workload (claims/s 1 → 4 → 1)", "mean size", "wait per 1,000 rollouts [s]"],
        [
            ("no pool", 0, ph["no_pool_wait_s"]),
            ("adaptive", ph["adaptive_mean_size"], ph["adaptive_wait_s"]),
            ("oracle (smallest zero-wait fixed)", ph["oracle_size"], 0.0),
        ],
    )
    previous = scoring["previous"] if isinstance(scoring.get("previous"), dict) else None
    forms = markdown_table(
        ["test form", "before [s]", "previous runner [s]", "after [s]", "after / previous"],
        [
            (
                k,
                scoring["before"]["time_per_sample_s_by_form"].get(k, "-"),
                previous["time_per_sample_s_by_form"].get(k, "-") if previous else "-",
                v,
                scoring.get(f"ratio_time_after_over_previous_{k}", "-"),
            )
            for k, v in scoring["after"]["time_per_sample_s_by_form"].items()
        ],
    )
    rt = markdown_table(
        ["runner", "one call's round trip [µs]"], list(scoring.get("call_round_trip_us", {}).items())
    )
    sc = markdown_table(
        ["scoring", "time per scored sample [s]", "scored samples/s"],
        [(k, scoring[k]["time_per_sample_s"], scoring[k]["samples_per_s"]) for k in ("before", "after")]
        + [
            (
                "after / before",
                scoring["ratio_time_after_over_before"],
                scoring["ratio_rate_after_over_before"],
            )
        ],
    )
    ct = markdown_table(["done-when check", "holds"], checks.items())
    md = f"# sandboxes\n\n## Local bubblewrap pool\n\n{lt}\n\n## Scoring: a trusted runner, the program isolated from it\n\n{sc}\n\n{forms}\n\n{rt}\n\n## Simulation (Modal latencies, 2 claims/s)\n\n{st}\n\n{pt}\n\n{ct}\n"
    md += "".join(f"\n![{p}]({p})\n" for p in plots)
    (out / f"{SUITE}.md").write_text(md)
    print(md)
    return payload
