"""verl glue against the real verl 0.9.1 classes: tool config loading, BaseTool lifecycle,
custom_reward_function loading; sandboxes are real bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import pytest

from tests._sandboxes_doubles import failing_pool
from tests._sandboxes_helpers import alive, needs_bwrap, no_processes_left

pytest.importorskip("verl")
from omegaconf import OmegaConf  # noqa: E402
from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.tool_registry import initialize_tools_from_config  # noqa: E402
from verl.trainer.ppo.reward import get_custom_reward_fn  # noqa: E402

from modal_rl.sandboxes.shared import close_shared_pools  # noqa: E402

pytestmark = needs_bwrap
ROOT = Path(__file__).resolve().parents[2]
TESTS = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]})
GOOD = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
BAD = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"


def test_shipped_tool_config_loads_by_class_path():
    from verl_modal.cpu.sandbox_run import TOOL_CONFIG
    from verl_modal.tools import SandboxCodeTool

    (tool,) = initialize_tools_from_config(str(TOOL_CONFIG))  # verl has no tool registry
    assert type(tool) is SandboxCodeTool and tool.name == "code_interpreter"
    assert tool.pool_settings == {"backend": "local", "min_warm": 0, "max_live": 8}
    assert tool.exec_timeout_s == 5.0 and tool.max_output_chars == 2000


def test_tool_lifecycle_via_verl_tool_config(tmp_path):
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(
        "tools:\n  - class_name: verl_modal.tools.SandboxCodeTool\n    config: {type: native, min_warm: 1, max_live: 4, exec_timeout_s: 2}\n"
    )
    (tool,) = initialize_tools_from_config(str(cfg))
    assert isinstance(tool, BaseTool) and tool.name == "code_interpreter"

    async def main():
        iid, _ = await tool.create(create_kwargs={})
        sb = tool._leases[iid]
        pid = sb._handle.pid
        resp, reward, metrics = await tool.execute(iid, {"code": "print(sum(range(10)))"})
        assert resp.text.strip() == "45" and reward == 0.0 and metrics["returncode"] == 0
        resp, _, metrics = await tool.execute(iid, {"code": "import sys; sys.exit('nope')"})
        assert "nope" in resp.text and "[exit code 1]" in resp.text
        resp, _, metrics = await tool.execute(iid, {"code": "while True: pass"})
        assert metrics["timed_out"] and "timed out" in resp.text
        resp, _, metrics = await tool.execute(iid, {"code": ""})
        assert metrics == {"bad_call": 1}
        await tool.release(iid)
        assert not alive(pid), "release must end the single-use lease"
        await close_shared_pools()

    asyncio.run(main())
    no_processes_left()


def test_reward_loads_as_async_custom_reward_function():
    config = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": str(ROOT / "verl_modal" / "reward.py"),
                    "name": "compute_score",
                    "reward_kwargs": {"min_warm": 1, "max_live": 4},
                }
            }
        }
    )
    fn = get_custom_reward_fn(config)
    assert inspect.iscoroutinefunction(fn.func)  # verl picked its async path

    async def main():
        good = await fn(data_source="x", solution_str=GOOD, ground_truth=TESTS, extra_info={})
        bad = await fn(data_source="x", solution_str=BAD, ground_truth=TESTS, extra_info={})
        asserts = await fn(
            data_source="x",
            solution_str="def f(x):\n    return 2 * x\n",
            ground_truth={"assert": "assert f(2) == 4"},
            extra_info={},
        )
        await close_shared_pools()
        return good, bad, asserts

    good, bad, asserts = asyncio.run(main())
    assert good == {
        "score": 1.0,
        "passed": 2,
        "total": 2,
        "execs": 2,
        "program_decides": 0,
        "mask_cause": "",
        "sandbox_masked": 0,
    }
    assert bad["score"] == 0.0 and bad["passed"] == 0 and bad["execs"] == 1  # stops at the first failure
    assert asserts["score"] == 1.0
    no_processes_left()


def test_reward_never_scores_a_broken_sandbox(monkeypatch):
    """A broken sandbox is a masked sample with its cause, returned (never raised, never a score)."""
    import verl_modal.reward as reward

    monkeypatch.setattr(reward, "shared_pool", failing_pool)
    out = asyncio.run(reward.compute_score("x", GOOD, TESTS, {}, sandbox_retries=1))
    assert out["sandbox_masked"] == 1 and out["mask_cause"] == "sandbox" and out["score"] == 0.0


def test_tool_reports_broken_sandbox_without_reward(monkeypatch):
    import verl_modal.tools as tools

    monkeypatch.setattr(tools, "shared_pool", failing_pool)
    tool = tools.SandboxCodeTool({"type": "native"})

    async def main():
        iid, _ = await tool.create()
        resp, reward, metrics = await tool.execute(iid, {"code": "print(1)"})
        await tool.release(iid)
        return resp, reward, metrics

    resp, reward, metrics = asyncio.run(main())
    assert "sandbox unavailable" in resp.text and reward == 0.0 and metrics == {"sandbox_error": 1}
    assert tool._leases == {}
