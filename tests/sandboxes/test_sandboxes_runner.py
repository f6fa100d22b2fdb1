"""The trusted runner's isolation of the program, seen from inside the program: each test below
is a program whose own answers say what it can see, so it passes only if the isolation holds.
Real bubblewrap sandboxes, the real runner (``modal_rl.sandboxes.testrun``)."""

from __future__ import annotations

import asyncio

import pytest

from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.coderun import score_code
from tests._reward_exploits import _READS_FOR_THE_TESTS
from tests._sandboxes_helpers import needs_bwrap, no_processes_left

pytestmark = needs_bwrap

SEES = r"""
import os
def view():
    status = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "cap_eff": status["CapEff"].strip(),
        "cap_bnd": status["CapBnd"].strip(),
        "no_new_privs": status["NoNewPrivs"].strip(),
        "cwd": sorted(os.listdir(".")),
        "tmp": sorted(os.listdir("/tmp")),
        "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    }
"""


async def _score(code: str, tests: dict, timeout_s: float = 5.0):
    pool = SandboxPool(
        LocalProvider(),
        SandboxSpec(timeout_s=60),
        min_warm=1,
        max_live=2,
        name="runner-test",
        rate_limiter=False,
    )
    await pool.start()
    try:
        return await score_code(pool, code, tests, timeout_s=timeout_s)
    finally:
        await pool.close()


def test_the_program_sees_only_itself():
    tests = {
        "assert": "v = view()\nassert v['pid'] == 1\nassert v['uid'] == 65534\n"
        "assert v['cap_eff'] == '0000000000000000' and v['cap_bnd'] == '0000000000000000'\n"
        "assert v['no_new_privs'] == '1'\nassert v['cwd'] in ([], ['.tmp']) and v['tmp'] == []\n"
        "assert len(v['fds']) <= 5, v['fds']\n"  # 0-2, its socket, the listing's own fd
    }
    score = asyncio.run(_score(SEES, tests))
    assert score.passed == score.total == 6, score.details
    no_processes_left()


def test_the_reading_attack_finds_the_tests_where_they_are_reachable():
    """The corpus's ``correct_unless_it_can_read_the_tests`` has power: beside a process that
    holds the tests' text (and is as reachable as the runner would be without its isolation),
    the same search finds it."""
    program = (
        "import subprocess, sys, time\n"
        "_holder = subprocess.Popen([sys.executable, '-c', "
        "'x = bytes(reversed(b\"733 ,00013(dda\")) * 3; import time; time.sleep(30)'])\n"
        "time.sleep(0.5)\n"
        + _READS_FOR_THE_TESTS
        + "\nprint('found' if _seen else 'not found')\n_holder.kill()\n"
    )
    score = asyncio.run(_score(program, {"inputs": [""], "outputs": ["found\n"]}, timeout_s=20))
    assert score.passed == 1, score.details
    no_processes_left()


@pytest.mark.parametrize(
    ("program", "why"),
    [
        ("import time\ndef add(a, b):\n    time.sleep(60)\n", "time limit"),
        ("import os\ndef add(a, b):\n    os._exit(3)\n", "channel"),
        ("def add(a, b):\n    return 'x' * (64 << 20)\n", "add"),  # past the message bound
    ],
)
def test_a_program_that_hangs_dies_or_floods_fails_its_calls_within_the_limit(program, why):
    tests = {"assert": "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"}
    score = asyncio.run(_score(program, tests, timeout_s=3.0))
    assert score.passed == 0 and score.total == 2, score.details
    no_processes_left()
