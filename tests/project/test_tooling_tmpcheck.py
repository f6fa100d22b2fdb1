"""The session check of tests/conftest.py: new temp-dir entries are reported, and fail the
session under MODAL_RL_TMP_CHECK=fail. Run as a real pytest subprocess on a private TMPDIR."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import leftovers

HERE = Path(__file__).resolve().parents[1]


def test_leftovers_skips_what_is_allowed():
    before = {"old"}
    after = {"old", "pytest-of-root", "mrl-engines-x1", "modal-rl-sandboxes", "tmpab12", "ray"}
    assert leftovers(before, after) == ["mrl-engines-x1", "ray", "tmpab12"]


def _session(tmp_path: Path, body: str, mode: str) -> subprocess.CompletedProcess:
    project = tmp_path / "proj"
    project.mkdir(parents=True)
    # the suite's session checks as they are, without the shared run fixtures it loads
    # (tests/verl_runs.py: not importable from this throwaway project, and not the check)
    conftest = (HERE / "conftest.py").read_text()
    (project / "conftest.py").write_text(re.sub(r"^pytest_plugins = .*$", "", conftest, flags=re.M))
    (project / "test_it.py").write_text(body)
    private = tmp_path / "tmp"
    private.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TMPDIR=str(private), MODAL_RL_TMP_CHECK=mode)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(project)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


LEAKY = "import tempfile\n\ndef test_leaks():\n    tempfile.mkdtemp(prefix='leaky-')\n"
CLEAN = "import tempfile\n\ndef test_cleans():\n    with tempfile.TemporaryDirectory():\n        pass\n"


def test_a_leaking_test_fails_the_session_in_fail_mode(tmp_path):
    out = _session(tmp_path, LEAKY, "fail")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "temp-directory leftovers" in out.stdout and "leaky-" in out.stdout
    assert "1 passed" in out.stdout  # the test itself passed; the leftover failed the session


@pytest.mark.slow
def test_report_mode_reports_and_passes_and_clean_sessions_say_nothing(tmp_path):
    out = _session(tmp_path / "a", LEAKY, "report")
    assert out.returncode == 0 and "leaky-" in out.stdout, out.stdout + out.stderr
    out = _session(tmp_path / "b", CLEAN, "fail")
    assert out.returncode == 0 and "leftovers" not in out.stdout, out.stdout + out.stderr
