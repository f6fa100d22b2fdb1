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

- ``previous``: the trusted runner as it was before values crossed with Python's meaning (plain
  data only, names joined as one file), built from the repository's history at
  ``PREVIOUS_RUNNER`` (skipped, and said so, outside a git checkout): what the remote module's
  meaning costs per sample, by test form.

The same programs (half right, half wrong; assert and stdin/stdout tasks) go through each, in
alternating rounds so that a noisy host weighs on all alike. Reported: time per scored sample
(one at a time) and scored samples per second (``concurrency`` at a time), and their ratios; and
one call's round trip between the tests and the program (``call_round_trip_us``: a test of
``CALLS`` calls, less a test of one, per call), for the runner as shipped and the previous one.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.report import progress
from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.coderun import parse_tests, score_code

PREVIOUS_RUNNER = "4b80b28"  # the last commit whose runner passed plain data only
_PREVIOUS_PARTS = ("_plainwire", "_program", "_isolation", "_testforms", "_runner")
CALLS = 20_000

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


def previous_runner_source() -> str | None:
    """The runner script at ``PREVIOUS_RUNNER``, assembled as its own ``testrun`` did; None
    outside a git checkout that has that commit."""
    root = Path(__file__).resolve().parents[1]
    parts = []
    for name in _PREVIOUS_PARTS:
        path = f"{PREVIOUS_RUNNER}:modal_rl/sandboxes/{name}.py"
        try:
            text = subprocess.run(
                ["git", "-C", str(root), "show", path], capture_output=True, text=True, check=True, timeout=30
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        parts.append(f"_module({name!r}, {text!r})")
    head = "import sys, types\ndef _module(name, src):\n    m = types.ModuleType(name)\n"
    head += (
        "    sys.modules[name] = m\n    exec(compile(src, name + '.py', 'exec'), m.__dict__)\n    return m\n"
    )
    return head + "\n".join(parts) + "\nsys.modules['_runner'].main()\n"


def _previous_scorer(source: str):
    """Score as the previous runner did: its payload (program, then the spec) and its report."""

    async def score(pool: SandboxPool, code: str, tests: dict) -> float:
        spec = parse_tests(tests)
        if spec.code is None:
            return await _score_before(pool, code, tests)
        program = code.encode()
        body = json.dumps({"tests": spec.code, "entry_point": spec.entry_point, "deadline_s": 9.0}).encode()
        async with pool.lease() as sb:
            r = await sb.exec(
                ["python3", "-I", "-S", "-c", source],
                timeout_s=10,
                stdin=len(program).to_bytes(4, "big") + program + body,
            )
        units = [line.split("\t") for line in r.stdout.splitlines() if line.startswith("MODAL_RL_UNIT\t")]
        done = any(line.startswith("MODAL_RL_DONE\t") for line in r.stdout.splitlines())
        return float(done and bool(units) and all(u[1] == "1" for u in units))

    return score


async def _round_trip_us(pool: SandboxPool, source: str | None) -> float | None:
    """One call's round trip (µs): a test of ``CALLS`` calls less a test of one, per call."""
    code = "def inc(x):\n    return x + 1\n"
    times = {}
    for n in (1, CALLS):
        tests = {"assert": f"for i in range({n}):\n    assert inc(i) == i + 1\n"}
        t = time.monotonic()
        if source is None:
            ok = (await score_code(pool, code, tests, timeout_s=60)).all_passed
        else:
            ok = await _previous_scorer(source)(pool, code, tests) == 1.0
        times[n] = time.monotonic() - t
        if not ok:
            return None
    return (times[CALLS] - times[1]) / (CALLS - 1) * 1e6


async def _measure(quick: bool, run_id: str) -> dict:
    rounds, concurrency = (4, 4) if quick else (12, 4)
    previous = previous_runner_source()
    pools = {}
    providers = [("before", _SharedNamespaceProvider()), ("after", LocalProvider())]
    if previous is not None:
        providers.append(("previous", LocalProvider()))
    for name, provider in providers:
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
    if previous is not None:
        scorers["previous"] = _previous_scorer(previous)
    round_trip = {"after": [], "previous": []}
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
                if name in round_trip:
                    us = await _round_trip_us(pool, previous if name == "previous" else None)
                    if us is not None:
                        round_trip[name].append(us)
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
    out["call_round_trip_us"] = {k: statistics.median(v) for k, v in round_trip.items() if v}
    if "previous" in pools:
        for form in KINDS:
            out[f"ratio_time_after_over_previous_{form}"] = by_form["after"][form] / by_form["previous"][form]
    else:
        out["previous"] = f"not measured: no git history with {PREVIOUS_RUNNER} here"
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
