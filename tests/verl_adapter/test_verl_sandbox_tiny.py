"""The tiny code task: its rows are valid coderun tests that the reference program passes in a
real sandbox, its overrides compose into verl's config, and bad flags exit 2 early."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.sandboxes.coderun import parse_tests
from tests._sandboxes_helpers import needs_bwrap, no_processes_left
from verl_modal.cpu import tiny

ROOT = Path(__file__).resolve().parents[2]


def test_code_rows_are_deterministic_coderun_tests():
    rows = tiny.code_rows(16, 0, "train")
    assert rows == tiny.code_rows(16, 0, "train") and rows != tiny.code_rows(16, 1, "train")
    for row in rows:
        tests = parse_tests(row["reward_model"]["ground_truth"])
        assert len(tests.cases) == 2 and tests.code is None
        assert row["data_source"] == tiny.CODE_DATA_SOURCE and row["prompt"][0]["role"] == "user"


@needs_bwrap
def test_reference_solutions_pass_in_a_sandbox():
    from modal_rl.sandboxes.shared import close_shared_pools
    from verl_modal.reward import compute_score

    rows = tiny.code_rows(3, 0, "test")

    async def main():
        try:
            return [
                await compute_score(
                    r["data_source"],
                    f"```python\n{r['extra_info']['solution']}\n```",
                    r["reward_model"]["ground_truth"],
                    min_warm=1,
                    max_live=2,
                )
                for r in rows
            ]
        finally:
            await close_shared_pools()

    results = asyncio.run(main())
    assert [r["score"] for r in results] == [1.0, 1.0, 1.0]
    assert all(r["execs"] == 2 for r in results)
    no_processes_left()


def test_code_overrides_compose_into_verls_config(tmp_path):
    from omegaconf import OmegaConf

    from verl_modal.cpu import overrides as ov

    config = ov.compose(ov.cpu_overrides(tiny.overrides_for(tmp_path, "code"), []))
    assert config.reward.reward_manager.name == "modal_sandbox"
    assert OmegaConf.to_container(config.reward.reward_kwargs) == {
        "min_warm": 1,
        "max_live": 4,
        "exec_timeout_s": 5,
        "memory_mb": 512,
    }
    assert config.reward.custom_reward_function.path is None
    assert Path(config.actor_rollout_ref.rollout.multi_turn.tool_config_path).is_file()
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"


@pytest.mark.parametrize(
    "setup, argv, message",
    [
        (None, ["--tiny-task", "code"], "--tiny-task needs --tiny DIR"),
        ("arith", ["--tiny", "{dir}", "--tiny-task", "code"], "holds tiny assets for task 'arith'"),
    ],
)
def test_bad_tiny_flags_exit_2_with_one_line(tmp_path, setup, argv, message):
    if setup:
        (tmp_path / "overrides.txt").write_text("")  # a complete DIR of the arith task (no task.txt)
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    out = subprocess.run(
        [sys.executable, "-m", "verl_modal", "--backend", "local", *argv, "--dry-run", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "RAY_AUTH_MODE": "disabled",
        },
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
