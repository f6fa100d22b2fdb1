"""Part of suite ``sandboxes``: what a scored sample costs, before and after the verdict left the
program's process, side by side in one run.

- ``before``: the cheapest scoring there is, and the one with no defence: the asserts appended to
  the program, one file write and one exec, the exit code decides; stdin/stdout cases on one
  written file; execs share the sandbox's PID namespace (``LocalProvider.exec_namespaces =
  False``). (Wave 3's split-assert harness cost about the same as this: one exec, no file.)
- ``after``: ``coderun.score_code`` as shipped: the trusted runner (one exec: the runner, which
  forks the isolated program and runs the tests as written: two processes per sample), every
  exec in its own user + PID namespace. A pytest-file task is timed for ``after`` only (the
  exit code of a file that only defines test functions says nothing).

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
PYTEST = {
    "assert": "import pytest\nfrom solution import add\n\n\n@pytest.mark.parametrize('a,b,c', "
    "[(1, 2, 3), (20, 22, 42), (-5, 5, 0)])\ndef test_add(a, b, c):\n    assert add(a, b) == c\n"
}
PROGRAMS = [
    ("def add(a, b):\n    return a + b\n", ASSERTS),
    ("def add(a, b):\n    return a - b\n", ASSERTS),
    ("a, b = map(int, input().split())\nprint(a + b)\n", IO),
    ("a, b = map(int, input().split())\nprint(a - b)\n", IO),
]
KINDS = {"asserts": ASSERTS, "stdin": IO, "pytest": PYTEST}
_KIND_PROGRAM = {"asserts": PROGRAMS[0][0], "stdin": PROGRAMS[2][0], "pytest": PROGRAMS[0][0]}


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
    per_kind = {k: {kind: [] for kind in KINDS} for k in pools}
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
                for kind, tests in KINDS.items():  # each test form, one correct sample
                    if name == "before" and kind == "pytest":
                        continue
                    while pool.snapshot()["warm"] < 1:
                        await asyncio.sleep(0.01)
                    t = time.monotonic()
                    await scorers[name](pool, _KIND_PROGRAM[kind], tests)
                    per_kind[name][kind].append(time.monotonic() - t)
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
            "time_per_sample_s_by_form": {k: statistics.median(v) for k, v in per_kind[name].items() if v},
        }
        for name in pools
    }
    by_form = {n: out[n]["time_per_sample_s_by_form"] for n in pools}
    out["ratio_time_after_over_before_asserts"] = by_form["after"]["asserts"] / by_form["before"]["asserts"]
    out["ratio_time_after_over_before_stdin"] = by_form["after"]["stdin"] / by_form["before"]["stdin"]
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
    labels = ["before\n(exit code,\nshared PID ns)", "after\n(trusted runner,\nisolated program)"]
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
