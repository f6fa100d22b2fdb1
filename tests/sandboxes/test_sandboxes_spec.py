"""SandboxSpec validation: bad input fails early with a message naming the field."""

from __future__ import annotations

import pytest

from modal_rl.sandboxes import ExecResult, SandboxSpec
from modal_rl.sandboxes.shared import settings


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"cpu": 0}, "cpu"),
        ({"cpu": float("nan")}, "cpu"),
        ({"memory_mb": 10}, "memory_mb"),
        ({"memory_mb": 512.5}, "memory_mb"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"network": "no"}, "network"),
        ({"max_procs": 1}, "max_procs"),
        ({"disk_mb": 0}, "disk_mb"),
        ({"workdir": "relative"}, "workdir"),
        ({"workdir": "/"}, "workdir"),
        ({"env": {"A": 1}}, "env"),
    ],
)
def test_bad_spec_is_rejected(kw, field):
    with pytest.raises(ValueError, match=f"SandboxSpec.{field}"):
        SandboxSpec(**kw)


def test_defaults_and_result():
    spec = SandboxSpec()
    assert (spec.cpu, spec.memory_mb, spec.network, spec.workdir) == (1.0, 1024, False, "/workspace")
    assert ExecResult(0, "", "", False, 0.1).ok
    assert not ExecResult(0, "", "", True, 0.1).ok and not ExecResult(1, "", "", False, 0.1).ok


def test_shared_settings(monkeypatch):
    monkeypatch.setenv("MODAL_RL_SANDBOX_MIN_WARM", "7")
    monkeypatch.setenv("MODAL_RL_SANDBOX_BACKEND", "modal")
    cfg = settings(max_live=9)
    assert (cfg["min_warm"], cfg["max_live"], cfg["backend"]) == (7, 9, "modal")
    with pytest.raises(ValueError, match="unknown sandbox pool settings"):
        settings(min_warn=3)
    with pytest.raises(ValueError, match=r"unknown sandbox backend 'docker'; known: \['local', 'modal'"):
        settings(backend="docker")
