"""slime's own plugin contract tests, run against our plugins (needs a slime checkout).

    SLIME_PATH=/path/to/slime pytest tests/slime_adapter/test_slime_contracts.py

slime is not on PyPI, so without ``SLIME_PATH`` these tests skip; the CI-runnable checks of the
same signatures are in test_slime_hooks.py and test_sandboxes_slime_glue.py. Each contract file
runs in a subprocess the way slime documents it (``python <file> --custom-rm-path ...``), with
slime's checkout and this repository on ``PYTHONPATH``; the file stubs ray / transformers /
sglang_router itself. The reward contract scores slime's sample (``response="response-3"``,
``label="label-3"``) for real: a plain-text label is the expected stdout, so the reward runs
that "program" in a bubblewrap sandbox and scores 0.0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._sandboxes_helpers import needs_bwrap

ROOT = Path(__file__).resolve().parents[2]
SLIME = Path(os.environ.get("SLIME_PATH", "/nonexistent"))
CONTRACTS = SLIME / "tests" / "plugin_contracts"

pytestmark = [
    pytest.mark.skipif(not CONTRACTS.is_dir(), reason="SLIME_PATH does not point at a slime checkout"),
    needs_bwrap,
]


def run_in_slime(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SLIME), str(ROOT), str(ROOT / "tests")])}
    env["RAY_AUTH_MODE"] = "disabled"
    return subprocess.run(
        [sys.executable, *argv], cwd=SLIME, env=env, capture_output=True, text=True, timeout=timeout
    )


def passed(out: subprocess.CompletedProcess) -> int:
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and "failed" not in summary and "error" not in summary, (
        out.stdout[-3000:] + out.stderr[-2000:]
    )
    return int(re.search(r"(\d+) passed", summary).group(1))


@pytest.mark.parametrize(
    "flags",
    [
        ["--custom-rm-path", "slime_modal.reward.reward_func"],
        ["--group-rm", "--custom-rm-path", "slime_modal.reward.batched_reward_func"],
    ],
    ids=["single", "group-rm"],
)
def test_custom_rm_contract(flags):
    out = run_in_slime(
        [str(CONTRACTS / "test_plugin_path_loading_contracts.py"), *flags, "-q", "-p", "no:cacheprovider"]
    )
    assert passed(out) >= 16  # the file's 16 tests at the time of writing, ours among them


CHECK = r"""
import inspect
from pathlib import Path
from slime.agent.sandbox import Sandbox
from slime_modal.sandbox import PoolSandbox
from slime_modal import weight_hooks

assert isinstance(PoolSandbox(), Sandbox)
for name in ("exec", "write_file", "read_file"):
    ours, theirs = inspect.signature(getattr(PoolSandbox, name)), inspect.signature(getattr(Sandbox, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ], name

# the call sites our hooks are written for, as they stand in this checkout
base = Path("slime/backends/megatron_utils/update_weight")
for f in ("update_weight_from_disk.py", "update_weight_from_disk_delta.py"):
    src = (base / f).read_text()
    assert "load_function(args.custom_update_weight_post_write_path)" in src, f
    assert "self._post_write_hook(self.args, " in src and "list(self.rollout_engines))" in src, f
patch = Path("docker/patch/latest/sglang-pull_weights.patch").read_text()
assert "_load_hook(pre_read_hook)(source_dir, target_version)" in patch
assert 'f"weight_v{version:06d}"' in patch
assert str(weight_hooks.version_dir("d", 7)) == "d/weight_v000007"
print("ok")
"""


def test_sandbox_protocol_and_hook_call_sites():
    out = run_in_slime(["-c", CHECK], timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout[-2000:] + out.stderr[-2000:]
