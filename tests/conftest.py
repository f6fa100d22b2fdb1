"""Session-wide checks for the whole suite.

Temp-directory leftovers: the entries of the temp directory (``tempfile.gettempdir()``) are
listed when the session starts and again when it ends; every new one is a file, socket or
folder some test (or a process it started) left behind, and is listed in the summary.
``MODAL_RL_TMP_CHECK=fail`` (on a machine that runs one suite at a time)
also fails the session; the default only reports, because on a shared machine other
people's runs write to the same directory. ``MODAL_RL_TMP_CHECK=off`` skips the check.

The session caches compiled kernels where the launchers do (``modal_rl.run_temp``: the
user's cache dir, not ``<temp>/torchinductor_<user>``, which ``import vllm`` would make).
"""

from __future__ import annotations

import fnmatch
import os
import signal
import tempfile

import pytest

# Session fixtures shared across test files (one real run each).
pytest_plugins = ["tests.verl_runs"]

# New entries that are not leftovers of a test, with the reason.
TMP_ALLOWED = {
    "pytest-of-*": "pytest's own tmp_path root (it keeps the last 3 runs by design)",
    "modal-rl-sandboxes*": "the user's sandbox registry (-<uid>), kept on purpose for orphan sweeps",
}

_before: set[str] | None = None
_leftovers: list[str] = []


def _mode() -> str:
    return os.environ.get("MODAL_RL_TMP_CHECK", "report").lower()


def _entries() -> set[str]:
    try:
        return set(os.listdir(tempfile.gettempdir()))
    except OSError:
        return set()


def leftovers(before: set[str], after: set[str]) -> list[str]:
    """New temp-dir entries that no rule of :data:`TMP_ALLOWED` explains, sorted."""
    new = after - before
    return sorted(n for n in new if not any(fnmatch.fnmatchcase(n, pat) for pat in TMP_ALLOWED))


def pytest_configure(config):
    # A suite started in the background by a non-interactive shell (`cmd &`) inherits SIGINT
    # ignored, and so would every process a test starts (an ignored signal survives exec):
    # the Ctrl-C tests would see their runs shrug it off. Handled signals reset on exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from modal_rl.run_temp import use_kernel_cache
    except ImportError:  # this file copied into a bare project (tests/project/test_tooling_tmpcheck.py)
        return
    use_kernel_cache()  # before any test module imports vLLM


def pytest_sessionstart(session):
    global _before
    if _mode() != "off":
        _before = _entries()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if _before is None:
        return
    _leftovers[:] = leftovers(_before, _entries())
    if _leftovers and _mode() == "fail" and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if not _leftovers:
        return
    where = tempfile.gettempdir()
    verdict = "failing the session" if _mode() == "fail" else "set MODAL_RL_TMP_CHECK=fail to fail on them"
    terminalreporter.section(f"temp-directory leftovers in {where}", sep="=", red=True)
    shown = _leftovers[:30]
    for name in shown:
        terminalreporter.line(f"  {os.path.join(where, name)}")
    if len(_leftovers) > len(shown):
        terminalreporter.line(f"  ... and {len(_leftovers) - len(shown)} more")
    terminalreporter.line(
        f"{len(_leftovers)} new entries that no test removed ({verdict}; allowed: {', '.join(TMP_ALLOWED)})"
    )
