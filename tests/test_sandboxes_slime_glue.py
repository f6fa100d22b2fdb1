"""slime glue: the Sandbox protocol (slime/agent/sandbox.py) and the --custom-rm-path reward.

slime is not on PyPI; its protocol's signatures are checked as data here (and against the real
class with isinstance when slime is importable). Sandboxes are real bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

import pytest
from _sandboxes_doubles import FailingProvider
from _sandboxes_helpers import needs_bwrap, no_processes_left

from modal_rl.sandboxes import SandboxPool, SandboxSpec
from modal_rl.sandboxes.shared import close_shared_pools
from slime_modal.reward import reward_func
from slime_modal.sandbox import PoolSandbox

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
        async with PoolSandbox(min_warm=1, max_live=4) as sb:
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
        await close_shared_pools()

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
        meta = Sample(2, "print(int(input()) ** 2)", None, {"tests": TESTS})
        single = await reward_func(None, good)
        batch = await reward_func(None, [good, bad, meta])
        await close_shared_pools()
        return single, batch, (good, bad, meta)

    single, batch, samples = asyncio.run(main())
    assert single == 1.0 and batch == [1.0, 0.0, 1.0]
    assert not any(s.remove_sample for s in samples)
    no_processes_left()


def test_reward_masks_sample_on_sandbox_failure(monkeypatch):
    import slime_modal.reward as reward

    async def failing_pool(**kw):
        return SandboxPool(
            FailingProvider(),
            SandboxSpec(),
            rate_limiter=False,
            max_retries=0,
            log_interval_s=0,
            handle_signals=False,
        )

    monkeypatch.setattr(reward, "shared_pool", failing_pool)
    sample = Sample(0, "print(9)", TESTS)
    assert asyncio.run(reward_func(None, sample)) == 0.0
    assert sample.remove_sample is True


def test_reward_rejects_sample_without_tests():
    with pytest.raises(ValueError, match="no test cases"):
        asyncio.run(reward_func(None, Sample(0, "print(1)", None)))
