"""Fresh interpreters that see this checkout's ``verl.plugins`` entry points, as
``pip install -e .`` would install them (the installed metadata may be another checkout's)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plugin_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``modal-rl`` distribution metadata carries this checkout's
    ``[project.entry-points."verl.plugins"]`` table, ahead of any installed copy, with this
    checkout first on the import path."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["verl.plugins"]
    dist = tmp_path / "modal_rl-0.1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: modal-rl\nVersion: 0.1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in table.items())
    (dist / "entry_points.txt").write_text("[verl.plugins]\n" + lines)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return env


def run_python(code: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
