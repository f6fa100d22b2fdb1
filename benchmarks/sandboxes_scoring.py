"""Part of suite ``sandboxes``: what a scored sample costs, before and after the verdict moved to
the host (issue 21), side by side in one run.

- ``before``: the verdict as it was: the asserts appended to the program, one file write and
  one exec, the exit code decides; stdin/stdout cases on one written file; execs share the
  sandbox's PID namespace (``LocalProvider.exec_namespaces = False``);
- ``after``: ``coderun.score_code`` as shipped: the split-assert harness (one exec, no file)
  and every exec in its own user + PID namespace.

The same programs (half right, half wrong; assert and stdin/stdout tasks) go through both, in
alternating rounds so that a noisy host weighs on both alike. Reported: time per scored sample
(one at a time) and scored samples per second (``concurrency`` at a time), and their ratios.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from benchmarks.report import progress
from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.coderun import parse_tests, score_code

ASSERTS = {"assert": "assert add(1, 2) == 3\nassert add(20, 22) == 42\nassert add(-5, 5) == 0\n"}
IO = {"inputs": ["2 3\n", "10 -4\n", "0 0\n"], "outputs": ["5\n", "6\n", "0\n"]}
PROGRAMS = [
    ("def add(a, b):\n    return a + b\n", ASSERTS),
    ("def add(a, b):\n    return a - b\n", ASSERTS),
    ("a, b = map(int, input().split())\nprint(a + b)\n", IO),
    ("a, b = map(int, input().split())\nprint(a - b)\n", IO),
]


class _SharedNamespaceProvider(LocalProvider):
    exec_namespaces = False


async def _score_before(pool: SandboxPool, code: str, tests: dict) -> float:
    spec = parse_tests(tests)
    async with pool.lease() as sb:
        if spec.code is not None:
            await sb.write_file("solution.py", code + "\n\n" + spec.code + "\n")
            return float((await sb.exec(["python3", "solution.py"], timeout_s=10)).ok)
        await sb.write_file("solution.py", code)
        for stdin, expected in spec.cases:
            r = await sb.exec(["python3", "solution.py"], timeout_s=10, stdin=stdin)
            if not (r.ok and r.stdout.strip() == expected.strip()):
                return 0.0
        return 1.0


async def _score_after(pool: SandboxPool, code: str, tests: dict) -> float:
    return float((await score_code(pool, code, tests, timeout_s=10)).all_passed)


async def _measure(quick: bool, run_id: str) -> dict:
    rounds, concurrency = (4, 4) if quick else (12, 4)
    pools = {}
    for name, provider in (("before", _SharedNamespaceProvider()), ("after", LocalProvider())):
        pools[name] = SandboxPool(
            provider,
            SandboxSpec(timeout_s=300),
            min_warm=concurrency,
            max_live=2 * concurrency,
            run_id=run_id,
            name=f"scoring-{name}",
            rate_limiter=False,
            log_interval_s=0,
        )
    scorers = {"before": _score_before, "after": _score_after}
    per_sample = {k: [] for k in pools}
    throughput = {k: [] for k in pools}
    scores = {k: [] for k in pools}
    try:
        for pool in pools.values():
            await pool.start()
        for _ in progress(range(rounds), total=rounds, desc="scored samples, before/after"):
            for name, pool in pools.items():
                while pool.snapshot()["warm"] < concurrency:
                    await asyncio.sleep(0.01)
                for code, tests in PROGRAMS:  # one at a time: the latency of one scored sample
                    t = time.monotonic()
                    scores[name].append(await scorers[name](pool, code, tests))
                    per_sample[name].append(time.monotonic() - t)
                while pool.snapshot()["warm"] < concurrency:
                    await asyncio.sleep(0.01)
                batch = PROGRAMS * concurrency  # many at once: samples per second
                t = time.monotonic()
                await asyncio.gather(*(scorers[name](pool, c, ts) for c, ts in batch))
                throughput[name].append(len(batch) / (time.monotonic() - t))
    finally:
        for pool in pools.values():
            await pool.close()
    out = {
        name: {
            "time_per_sample_s": statistics.median(per_sample[name]),
            "samples_per_s": statistics.median(throughput[name]),
            "scores": scores[name][: len(PROGRAMS)],
        }
        for name in pools
    }
    out["ratio_time_after_over_before"] = (
        out["after"]["time_per_sample_s"] / out["before"]["time_per_sample_s"]
    )
    out["ratio_rate_after_over_before"] = out["after"]["samples_per_s"] / out["before"]["samples_per_s"]
    out["n"] = {"rounds": rounds, "programs": len(PROGRAMS), "concurrency": concurrency}
    return out


def measure(quick: bool, run_id: str) -> dict:
    return asyncio.run(_measure(quick, run_id))


def plot(out, scoring: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.4))
    names = ["before", "after"]
    labels = ["before\n(exit code,\nshared PID ns)", "after\n(host verdict,\nPID ns per exec)"]
    for ax, key, title in (
        (axes[0], "time_per_sample_s", "time per scored sample [ms]"),
        (axes[1], "samples_per_s", "scored samples per second"),
    ):
        scale = 1000 if key == "time_per_sample_s" else 1
        ax.bar(labels, [scoring[n][key] * scale for n in names], color=["C7", "C2"])
        ax.set_title(title, fontsize=10)
    fig.suptitle(
        f"Scoring a sample: after/before time {scoring['ratio_time_after_over_before']:.2f}x, "
        f"rate {scoring['ratio_rate_after_over_before']:.2f}x",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "sandboxes-scoring.png", dpi=120)
    plt.close(fig)
    return ["sandboxes-scoring.png"]
