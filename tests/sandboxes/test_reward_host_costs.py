"""A program's output costs the scoring process bounded memory and never stalls its event loop:
flooding stdout and stderr, or one endless line, scores 0.0 while the scoring process grows by
less than 200 MiB and a ticker on its loop never waits 2 s; honest large output still passes.
Real bubblewrap sandboxes through ``scoring.score_sample``."""

from __future__ import annotations

import asyncio
import json
import threading

import psutil
import pytest

from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.scoring import score_sample
from tests._reward_exploits import response
from tests._sandboxes_helpers import needs_bwrap, no_processes_left

pytestmark = needs_bwrap
MIB = 1 << 20
STDIN_TASK = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["2\n", "4\n", "6\n"]}
CALL_TASK = {"fn_name": "double", "inputs": [[1], [2], [3]], "outputs": [[2], [4], [6]]}
# 8 MiB of short stdout lines (a line list of them is what costs a host that splits), 8 MiB
# of stderr.
FLOOD = "import sys\nsys.stdout.write('10\\n' * ((8 << 20) // 3))\nsys.stderr.write('e' * (8 << 20))\n"
ONE_LINE = "import sys\nsys.stdout.write('7' * 100_000_000)\n"
CALL_FLOOD = (
    "import sys\n\ndef double(x):\n    sys.stdout.write('10\\n' * ((8 << 20) // 3))\n"
    "    sys.stderr.write('e' * (8 << 20))\n    return 2 * x + 1\n"
)


async def _measured(pool, program: str, tests: dict, copies: int):
    """The ``copies`` samples' scores (scored at once, as a batch is), the scoring process's RSS
    growth (peak, sampled every 5 ms by a thread, so a blocked loop cannot hide it) and the
    longest its event loop went without running a 10 ms ticker."""
    proc, loop = psutil.Process(), asyncio.get_running_loop()
    base = proc.memory_info().rss
    seen = {"peak": base, "lag": 0.0}
    done, stopped = asyncio.Event(), threading.Event()

    def sampler():
        while not stopped.wait(0.005):
            seen["peak"] = max(seen["peak"], proc.memory_info().rss)

    async def ticker():
        last = loop.time()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = loop.time()
            seen["lag"] = max(seen["lag"], now - last - 0.01)
            last = now

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    tick = asyncio.create_task(ticker())
    try:
        scores = await asyncio.gather(
            *(
                score_sample(pool, response(program), json.dumps(tests), partial=True, timeout_s=10.0)
                for _ in range(copies)
            )
        )
    finally:
        done.set()
        await tick
        stopped.set()
        watcher.join()
    return scores, (seen["peak"] - base) / MIB, seen["lag"]


def _run(program: str, tests: dict, copies: int):
    async def main():
        pool = SandboxPool(
            LocalProvider(),
            SandboxSpec(timeout_s=120),
            min_warm=copies,
            max_live=copies,
            name="costs",
            rate_limiter=False,
        )
        await pool.start()
        try:
            await score_sample(pool, response("print(1)\n"), json.dumps(STDIN_TASK))  # warm the path
            return await _measured(pool, program, tests, copies)
        finally:
            await pool.close()

    out = asyncio.run(main())
    no_processes_left()
    return out


@pytest.mark.parametrize(
    ("program", "tests"),
    [(FLOOD, STDIN_TASK), (ONE_LINE, STDIN_TASK), (CALL_FLOOD, CALL_TASK)],
    ids=["8MiB_out_8MiB_err", "one_100MB_line", "call_based_flood"],
)
def test_floods_score_zero_at_bounded_cost(program, tests):
    scores, grew_mib, lag_s = _run(program, tests, copies=4)
    print(f"scores={[s.score for s in scores]} grew={grew_mib:.1f} MiB lag={lag_s:.3f} s")
    assert all(s.score == 0.0 and not s.masked for s in scores), scores
    assert grew_mib < 200, grew_mib
    assert lag_s < 2.0, lag_s


def test_honest_large_output_still_passes():
    n = 400_000  # about 2.6 MB of expected output per case
    tests = {"inputs": [f"{n}\n"], "outputs": ["".join(f"{i}\n" for i in range(n))]}
    program = "import sys\nn = int(input())\nsys.stdout.write(''.join(f'{i}\\n' for i in range(n)))\n"
    (score,), grew_mib, lag_s = _run(program, tests, copies=1)
    print(f"score={score.score} grew={grew_mib:.1f} MiB lag={lag_s:.3f} s")
    assert score.score == 1.0, score
    assert lag_s < 2.0, lag_s
