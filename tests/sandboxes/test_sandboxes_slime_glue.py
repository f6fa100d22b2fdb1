"""slime glue: the Sandbox protocol (slime/agent/sandbox.py), the --custom-rm-path rewards, and
their settings from slime's --custom-config-path YAML.

slime is not on PyPI; its protocol's signatures are checked as data here (and against the real
class with isinstance when slime is importable; tests/slime_adapter/test_slime_contracts.py runs slime's own
contract tests). Sandboxes are real bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from slime_modal.config import close_rollout_pools, reward_settings, sandbox_settings
from slime_modal.reward import batched_reward_func, reward_func
from slime_modal.sandbox import PoolSandbox
from tests._sandboxes_doubles import failing_pool
from tests._sandboxes_helpers import needs_bwrap, no_processes_left, wait_gone

ROOT = Path(__file__).resolve().parents[2]

pytestmark = needs_bwrap

# slime.agent.sandbox.Sandbox, as documented there: name -> (keyword-only params with defaults).
PROTOCOL = {
    "exec": {"user": "root", "env": None, "timeout": 120, "check": False, "idempotent": True},
    "write_file": {"user": "root"},
    "read_file": {"user": "root"},
}


def test_signatures_match_slime_protocol():
    for name, kwonly in PROTOCOL.items():
        sig = inspect.signature(getattr(PoolSandbox, name))
        assert inspect.iscoroutinefunction(getattr(PoolSandbox, name))
        got = {p.name: p.default for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}
        assert got == kwonly, name
    assert inspect.iscoroutinefunction(PoolSandbox.__aenter__) and inspect.iscoroutinefunction(
        PoolSandbox.__aexit__
    )
    try:
        from slime.agent.sandbox import Sandbox
    except ImportError:
        return
    assert isinstance(PoolSandbox(), Sandbox)


def test_pool_sandbox_behaviour(tmp_path):
    host_file = tmp_path / "in.txt"
    host_file.write_text("from host")

    async def main():
        async with PoolSandbox(SimpleNamespace(modal_rl_sandbox={"min_warm": 1}), max_live=4) as sb:
            assert sb.sandbox_id
            assert await sb.exec("echo $X; echo e >&2", env={"X": "hi"}) == (0, "hi\n", "e\n")
            rc, _, _ = await sb.exec("sleep 30", timeout=1)
            assert rc == 124
            with pytest.raises(RuntimeError, match="exit=3"):
                await sb.exec("exit 3", check=True)
            await sb.write_file("/workspace/a.txt", "text")
            await sb.write_file("b.bin", b"\x01\x02")
            await sb.write_file("c.txt", host_file)
            assert await sb.read_file("/workspace/a.txt") == "text"
            assert await sb.read_file("c.txt") == "from host"
            assert await sb.read_file("missing") == ""
            rc, _, err = await sb.exec("id", user="agent")
            assert rc != 0 and err  # no capabilities locally to switch users: a clear failure
        await close_rollout_pools()

    asyncio.run(main())
    no_processes_left()


@dataclass
class Sample:
    """The fields of slime.utils.types.Sample that a reward function reads or sets."""

    index: int = 0
    response: str = ""
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    remove_sample: bool = False


TESTS = '{"inputs": ["3\\n"], "outputs": ["9\\n"]}'


def test_reward_single_and_batched():
    async def main():
        good = Sample(0, "```python\nn = int(input())\nprint(n * n)\n```", TESTS)
        bad = Sample(1, "```python\nprint(0)\n```", TESTS)
        meta = Sample(2, "print(int(input()) ** 2)", "a reference answer", {"tests": TESTS})
        text = Sample(3, "print(6 * 7)", "42")  # plain-text label: the expected stdout
        wrong_text = Sample(4, "response-4", "label-4")  # slime's contract sample: not a program
        single = await reward_func(None, good)
        batch = await batched_reward_func(None, [good, bad, meta, text, wrong_text])
        await close_rollout_pools()
        return single, batch, (good, bad, meta, text, wrong_text)

    single, batch, samples = asyncio.run(main())
    assert single == 1.0 and batch == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert not any(s.remove_sample for s in samples)
    no_processes_left()


def test_reward_partial_credit_from_custom_config():
    tests = json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["1\n", "5\n"]})
    args = SimpleNamespace(
        modal_rl_reward={"partial": True, "timeout_s": 5}, modal_rl_sandbox={"min_warm": 1}
    )

    async def main():
        r = await reward_func(args, Sample(0, "print(int(input()))", tests))
        await close_rollout_pools()
        return r

    assert asyncio.run(main()) == 0.5
    no_processes_left()


def test_reward_masks_sample_on_sandbox_failure(monkeypatch):
    import slime_modal.reward as reward

    monkeypatch.setattr(reward, "rollout_pool", failing_pool)
    sample = Sample(0, "print(9)", TESTS)
    assert asyncio.run(reward_func(None, sample)) == 0.0
    assert sample.remove_sample is True


def test_reward_rejects_bad_calls(caplog):
    # A sample without usable tests is masked with its cause logged (one line), never raised:
    # in a batch, raising would lose every other sample's score.
    for label, cause in ((None, "no test cases"), ('{"answer": 1}', "test cases must be")):
        sample = Sample(0, "print(1)", label)
        with caplog.at_level("ERROR", logger="slime_modal.reward"):
            assert asyncio.run(reward_func(None, sample)) == 0.0
        assert sample.remove_sample is True
        assert cause in caplog.text and "Traceback" not in caplog.text
        caplog.clear()
    with pytest.raises(TypeError, match="batched_reward_func"):
        asyncio.run(reward_func(None, [Sample(0, "print(1)", "1")]))
    with pytest.raises(TypeError, match="list of samples"):
        asyncio.run(batched_reward_func(None, Sample(0, "print(1)", "1")))
    assert tuple(inspect.signature(reward_func).parameters)[:2] == ("args", "sample")
    assert tuple(inspect.signature(batched_reward_func).parameters)[:2] == ("args", "samples")


def slime_args(tmp_path, config: dict) -> SimpleNamespace:
    """args as slime's parse_args leaves them after --custom-config-path: YAML keys as attributes."""
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(config))
    args = SimpleNamespace(custom_config_path=str(path))
    for key, value in (yaml.safe_load(path.read_text()) or {}).items():
        setattr(args, key, value)
    return args


def test_settings_from_custom_config(tmp_path, monkeypatch):
    monkeypatch.setenv("MODAL_RL_SANDBOX_MEMORY_MB", "512")
    monkeypatch.setenv("MODAL_RL_REWARD_TIMEOUT_S", "7")
    args = slime_args(
        tmp_path, {"modal_rl_sandbox": {"backend": "modal", "min_warm": 8, "cpu": 2}, "modal_rl_reward": {}}
    )
    assert sandbox_settings(args) == {"backend": "modal", "min_warm": 8, "cpu": 2}
    assert reward_settings(args) == (7.0, False)
    assert sandbox_settings(None) == {} and sandbox_settings(SimpleNamespace()) == {}
    bad = {
        "modal_rl_sandbox": [
            ("provider", "unknown keys"),
            ("min_warm", "must be int"),
            ("backend", "unknown sandbox backend"),
        ],
        "modal_rl_reward": [("partial", "true or false"), ("timeout_s", "positive number")],
    }
    values = {"provider": "modal", "min_warm": "8", "backend": "docker", "partial": "yes", "timeout_s": 0}
    for key, cases in bad.items():
        for field_name, message in cases:
            args = slime_args(tmp_path, {key: {field_name: values[field_name]}})
            with pytest.raises(ValueError, match=message):
                (sandbox_settings if key == "modal_rl_sandbox" else reward_settings)(args)
    with pytest.raises(ValueError, match="must be a mapping"):
        sandbox_settings(slime_args(tmp_path, {"modal_rl_sandbox": "modal"}))


def test_rollout_process_exit_leaves_no_sandbox():
    """A slime-like rollout process exits without closing its pool: the pool is closed at exit
    on its own loop (not just killed), and every sandbox process is gone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_slime_rollout_child.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["rewards"] == [1.0, 1.0] and len(lines[0]["pids"]) >= 2
    assert lines[1] == {"closed_at_exit": True}
    assert not wait_gone(lines[0]["pids"]), "sandbox processes outlived the rollout process"


def test_one_pool_per_process_across_caller_loops():
    """A caller that uses asyncio.run per call (as slime's contract tests do) gets the same pool,
    and its loop's shutdown does not hang on, or cancel, sandbox work."""
    sample = Sample(0, "print(5)", "5")

    async def call():
        from slime_modal.config import rollout_pool

        return await reward_func(None, sample), await rollout_pool(None)

    (r1, pool1), (r2, pool2) = asyncio.run(call()), asyncio.run(call())
    assert r1 == r2 == 1.0 and pool1 is pool2 and not pool1._closed
    asyncio.run(close_rollout_pools())
    assert pool1._closed
    no_processes_left()
