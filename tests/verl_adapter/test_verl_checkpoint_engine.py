"""The ``modal_delta`` verl checkpoint engine, with the real verl 0.9.1 classes, on CPU.

Every sync goes through the methods verl's ``CheckpointEngineManager`` calls, in its order:
``prepare`` on all workers → ``build_topology`` → ``init_process_group`` → ``send_weights``
(trainer) concurrently with ``receive_weights`` (rollout) → ``finalize``. Transport: real
sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("verl")

from modal_rl.run_key import RUN_KEY_ENV  # noqa: E402
from modal_rl.weightsync.transport.base import FrameSink  # noqa: E402
from tests.e2e.test_weightsync_faults_e2e import FlakyProxy  # noqa: E402
from tests.verl_plugin_helpers import plugin_env, run_python  # noqa: E402
from tests.weightsync_helpers import TEST_KEY, bits, clone_state, model_state, perturb, records, same_state  # noqa: E402
from verl_modal.checkpoint_engine import ModalDeltaSyncError  # noqa: E402


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    """modal_delta keys its frame server and receivers with the run's key from the
    environment (a launcher guarantees it in every process of a run)."""
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def registry():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    return CheckpointEngineRegistry


def trajectory(versions: int, density: float = 0.02) -> list[dict[str, torch.Tensor]]:
    """A bf16 state and its next versions, each with ``density`` of its words changed."""
    states = [model_state(seed=1)]
    for v in range(1, versions):
        states.append(perturb(states[-1], density, seed=100 + v))
    return states


class Rollout:
    """What verl's rollout adapter does with ``receive_weights``: iterate it and copy every
    tensor into the live model (here a dict), only after the iterator yields."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.live: dict[str, torch.Tensor] = {}

    def update(self, global_steps: int) -> None:
        async def consume() -> None:
            async for name, tensor in self.engine.receive_weights(global_steps=global_steps):
                self.live[name] = tensor.clone()

        asyncio.run(consume())


class Cluster:
    """One trainer (rank 0 publishes, rank 1 only walks its generator) and ``n`` rollout workers."""

    def __init__(self, n_rollout: int = 2, actor_ranks: int = 2, **engine_kwargs) -> None:
        reg = registry()
        self.cls = reg.get("modal_delta")
        self.actors = [
            reg.new("modal_delta", bucket_size=1 << 20, is_master=(r == 0), **engine_kwargs)
            for r in range(actor_ranks)
        ]
        self.rollouts = [
            Rollout(reg.new("modal_delta", bucket_size=1 << 20, **engine_kwargs)) for _ in range(n_rollout)
        ]
        self.pool = ThreadPoolExecutor(n_rollout)

    def build(self, rewrite_endpoint=None) -> None:
        engines = self.actors + [r.engine for r in self.rollouts]
        metadata = [e.prepare() for e in engines]
        if rewrite_endpoint is not None:  # e.g. route receivers through a proxy
            metadata[0] = {"endpoint": rewrite_endpoint(metadata[0]["endpoint"])}
        actor_kw, rollout_kw = self.cls.build_topology(len(self.actors), len(self.rollouts), metadata)
        for i, e in enumerate(self.actors):
            e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
        for i, r in enumerate(self.rollouts):
            r.engine.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})

    def sync(self, state: dict[str, torch.Tensor], step: int, **build_kw) -> tuple[dict, list]:
        """One ``CheckpointEngineManager.update_weights``: returns the trainer's metrics and
        each receiver's outcome (None, or the exception it raised)."""
        self.build(**build_kw)
        futures = [self.pool.submit(r.update, step) for r in self.rollouts]

        async def send_all() -> list:
            return await asyncio.gather(
                *(e.send_weights(iter(state.items()), global_steps=step) for e in self.actors)
            )

        metrics = asyncio.run(send_all())[0]
        outcomes = [f.exception(timeout=60) for f in futures]
        for e in self.actors + [r.engine for r in self.rollouts]:
            e.finalize()
        return metrics, outcomes

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for e in self.actors + [r.engine for r in self.rollouts]:
            e.close()


@pytest.mark.parametrize("snapshot_on", ["host", "device"])
def test_trajectory_is_bit_identical_every_version_with_verl_metrics(snapshot_on):
    states = trajectory(6)
    cluster = Cluster(n_rollout=2, anchor_every=3, snapshot_on=snapshot_on)
    assert cluster.actors[0].snapshot_on == snapshot_on
    try:
        for step, state in enumerate(states):  # verl syncs global_steps 0 (before training), 1, 2, ...
            metrics, outcomes = cluster.sync(state, step)
            assert outcomes == [None, None]
            for r in cluster.rollouts:
                assert same_state(r.live, state), f"version {step} differs on a receiver"
                assert r.engine.metrics["checkpoint_engine/version"] == step
            assert metrics["checkpoint_engine/version"] == step
            is_anchor = step % 3 == 0
            assert metrics["checkpoint_engine/anchor"] == float(is_anchor)
            assert metrics["checkpoint_engine/send_s"] > 0
            if not is_anchor:  # ~2% of bf16 words changed: the delta is far smaller than the state
                assert metrics["checkpoint_engine/compression_ratio"] > 5, metrics
        publisher = cluster.actors[0]._publisher
        assert (publisher.snapshot_on, type(publisher._differ).__name__) == (
            snapshot_on,
            {"host": "NoneType", "device": "TorchDiffer"}[snapshot_on],
        )
        print("last delta metrics:", metrics)
    finally:
        cluster.close()


def test_late_receiver_catches_up_from_the_last_anchor():
    states = trajectory(4)
    cluster = Cluster(n_rollout=1, anchor_every=2)
    late = None
    try:
        for step, state in enumerate(states[:3], start=1):
            assert cluster.sync(state, step)[1] == [None]
        late = Rollout(registry().new("modal_delta", bucket_size=1 << 20))
        cluster.rollouts.append(late)  # elastic scale-up: joins before version 3
        cluster.pool = ThreadPoolExecutor(2)
        assert cluster.sync(states[3], 4)[1] == [None, None]
        assert same_state(late.live, states[3])
        assert late.engine.metrics["checkpoint_engine/frames"] == 2  # anchor 2, then delta 3
    finally:
        cluster.close()


def test_damaged_stream_is_refused_then_healed_by_reconnecting():
    states = trajectory(3)
    cluster = Cluster(n_rollout=1, actor_ranks=1, anchor_every=100)
    proxy = None
    try:
        for step, state in enumerate(states[:2], start=1):
            assert cluster.sync(state, step)[1] == [None]
        upstream = cluster.actors[0]._server.address
        proxy = FlakyProxy(upstream, "flip", at_byte=300)  # the receiver reconnects through it

        def via_proxy(ep):
            return {**ep, "host": proxy.address[0], "port": proxy.address[1]}

        assert cluster.sync(states[2], 3, rewrite_endpoint=via_proxy)[1] == [None]
        rollout = cluster.rollouts[0]
        assert rollout.engine.metrics["checkpoint_engine/refused"] >= 1
        assert proxy.connections >= 2
        assert same_state(rollout.live, states[2])
    finally:
        if proxy is not None:
            proxy.close()
        cluster.close()


class CorruptNext(FrameSink):
    """A frame sink that flips one byte inside the next frame's first chunk record (its own
    record checksum catches it), then passes frames through unchanged (no link share, no
    recovery anchors: the port's defaults)."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, True

    def send(self, header, recs):
        recs = list(recs)
        if self.armed:
            self.armed = False
            frame = b"".join(recs)
            offsets = [off for off, _size, _tag in records(frame)]
            i = len(recs) // 2  # a record in the middle of the frame
            body = bytearray(recs[i])
            body[len(body) // 2] ^= 0x10
            recs[i] = bytes(body)
            assert len(offsets) == len(recs)
        return self.inner.send(header, recs)

    def close(self) -> None:
        self.inner.close()


def test_corrupt_frame_is_refused_and_the_receiver_keeps_its_weights():
    states = trajectory(3)
    cluster = Cluster(n_rollout=1, actor_ranks=1, anchor_every=100, max_refusals=1, receive_timeout_s=20)
    try:
        for step, state in enumerate(states[:2], start=1):
            assert cluster.sync(state, step)[1] == [None]
        rollout = cluster.rollouts[0]
        before_live = clone_state(rollout.live)
        before_staged = clone_state(rollout.engine._subscriber.chain.state)
        publisher = cluster.actors[0]._publisher
        publisher.sink = CorruptNext(publisher.sink)
        _metrics, outcomes = cluster.sync(states[2], 3)
        err = outcomes[0]
        assert isinstance(err, ModalDeltaSyncError), err
        assert "refused" in str(err) and "stay at version 2" in str(err), str(err)  # = global_steps
        assert same_state(rollout.live, before_live)  # the rollout's weights: untouched
        assert same_state(rollout.engine._subscriber.chain.state, before_staged)
        assert rollout.engine._subscriber.live_version == 2
        assert not same_state(rollout.live, states[2])
        assert bits(rollout.live["embed.weight"]) == bits(states[1]["embed.weight"])
    finally:
        cluster.close()


def test_snapshot_on_is_checked_when_the_engine_is_made():
    with pytest.raises(
        ValueError, match=r"modal_delta.snapshot_on must be one of \('host', 'device'\), got 'gpu'"
    ):
        registry().new("modal_delta", bucket_size=1 << 20, is_master=True, snapshot_on="gpu")


def test_dtype_publishes_floating_tensors_in_the_rollouts_dtype():
    # A float32 trainer state reaches the receivers as the bf16 an in-place engine holds (the
    # cast its loader would make); integer tensors pass unchanged.
    state = {
        "w": torch.randn(64, 32, dtype=torch.float32),
        "b": torch.randn(32, dtype=torch.float32),
        "steps": torch.arange(5, dtype=torch.int64),
    }
    cluster = Cluster(n_rollout=1, dtype="bfloat16")
    try:
        for step in (1, 2):
            _metrics, outcomes = cluster.sync(state, step)
            assert outcomes == [None]
            live = cluster.rollouts[0].live
            assert live["w"].dtype == torch.bfloat16 and live["steps"].dtype == torch.int64
            assert torch.equal(live["w"], state["w"].to(torch.bfloat16))
            assert torch.equal(live["steps"], state["steps"])
            state = {**state, "w": state["w"] + 0.5}
    finally:
        cluster.close()


@pytest.mark.parametrize("bad", ["int8", "fp42", "Tensor"])
def test_dtype_is_checked_when_the_engine_is_made(bad):
    with pytest.raises(ValueError, match=rf"modal_delta.dtype='{bad}' is not a floating torch dtype"):
        registry().new("modal_delta", bucket_size=1 << 20, is_master=True, dtype=bad)


def test_topology_rejects_a_missing_master():
    cls = registry().get("modal_delta")
    with pytest.raises(ValueError, match="rank 0 must be the master"):
        cls.build_topology(1, 1, [{"endpoint": None}, {"endpoint": None}])
    with pytest.raises(ValueError, match="expected 3 prepare"):
        cls.build_topology(2, 1, [{"endpoint": {"host": "127.0.0.1", "port": 1, "version": 0}}])


# -- registration through the verl.plugins entry point, in fresh interpreters -----------


@pytest.mark.slow
def test_import_verl_is_enough_to_list_modal_delta(tmp_path):
    out = run_python(
        """
        import sys
        import verl
        assert "verl_modal.checkpoint_engine" not in sys.modules  # deferred: import verl stays light
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
        print(sorted(CheckpointEngineRegistry._registry))
        print(CheckpointEngineRegistry.get("modal_delta").__module__)
        """,
        plugin_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    listed, module = out.stdout.strip().splitlines()[-2:]
    assert "'modal_delta'" in listed
    assert module == "verl_modal.checkpoint_engine"


@pytest.mark.slow
def test_a_registration_failure_is_loud(tmp_path):
    out = run_python(
        """
        import sys
        sys.modules["modal_rl.weightsync.transport.tcp"] = None  # make the engine's import fail
        import verl
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
        try:
            CheckpointEngineRegistry.get("modal_delta")
        except ValueError as exc:
            print("GET:", exc)
        """,
        plugin_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert "could not register checkpoint engine 'modal_delta'" in out.stderr
    assert "ERROR" in out.stderr or "error" in out.stderr.lower()
    assert "GET:" in out.stdout and "verl_modal.checkpoint_engine" in out.stdout, out.stdout


# -- through verl's CheckpointEngineManager and CheckpointEngineWorker, on a local Ray -----


class _Replica:
    """The part of ``RolloutReplica`` the manager uses: its workers, and the request
    gate it closes and reopens around a sync (no inference server here)."""

    def __init__(self, workers) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        pass

    async def resume_generation(self) -> None:
        pass

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass


def _ray_classes():
    """Ray-side classes, built lazily so that collecting this file does not import Ray."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.workers.rollout import BaseRollout
    from verl.workers.rollout.utils import ensure_async_iterator

    class TrainerWorker(Worker):
        """The trainer side as verl's ``ActorRolloutRefWorker`` does it: the engine from the
        registry (``is_master`` on rank 0), ``send_weights`` of its per-tensor params in
        ``update_weights``, its result returned as the sync's metrics."""

        def __init__(self, engine_kwargs: dict) -> None:
            super().__init__()
            self.state: dict[str, torch.Tensor] = {}
            self.checkpoint_engine = registry().new(
                "modal_delta", is_master=self.rank == 0, bucket_size=1 << 20, **engine_kwargs
            )

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def set_state(self, state: dict) -> None:
            self.state = state

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def corrupt_next_frame(self) -> None:
            publisher = self.checkpoint_engine._publisher
            publisher.sink = CorruptNext(publisher.sink)

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
            metrics = await self.checkpoint_engine.send_weights(
                iter(self.state.items()), global_steps=global_steps
            )
            return metrics or {}

    class RecordingRollout(BaseRollout):
        """A rollout adapter whose "model" is a dict: it loads what ``update_weights`` streams."""

        def __init__(self) -> None:
            self.live: dict[str, torch.Tensor] = {}
            self.replica_rank, self.is_leader_rank = 0, True

        async def resume(self, tags: list[str]) -> None:
            pass

        async def release(self) -> None:
            pass

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs) -> None:
            assert wire_format == "named_tensors", wire_format
            async for name, tensor in ensure_async_iterator(weights):
                self.live[name] = tensor.clone()

    class InspectableWorker(CheckpointEngineWorker):
        """verl's ``CheckpointEngineWorker``, plus read-only access for the assertions."""

        def live_state(self) -> dict:
            return self.server_adapter.live

        def engine_metrics(self) -> dict:
            return self.checkpoint_engine.metrics

    return TrainerWorker, RecordingRollout, InspectableWorker


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    from tests._local_ray import loopback_ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # before plugin_env reads the environment
    env = plugin_env(tmp_path_factory.mktemp("plugins"))
    with loopback_ray(tmp_path_factory, 2, {"PYTHONPATH": env["PYTHONPATH"], RUN_KEY_ENV: TEST_KEY}) as ray:
        yield ray


def _free_port() -> int:
    from modal_rl.cluster.ports import reserve

    return reserve(1)[0]


def _worker_env(rank: int = 0, world: int = 1) -> dict:
    port = str(_free_port())
    return {
        "env_vars": {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
    }


@pytest.mark.slow
def test_manager_and_workers_move_a_trajectory_bit_identically(local_ray):
    ray = local_ray
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    TrainerWorker, RecordingRollout, InspectableWorker = _ray_classes()
    kwargs = {"anchor_every": 3, "max_refusals": 1, "receive_timeout_s": 60}
    config = CheckpointEngineConfig(
        backend="modal_delta", update_weights_bucket_megabytes=1, engine_kwargs={"modal_delta": kwargs}
    )
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config)

    trainer_cls = ray.remote(TrainerWorker)
    trainer = trainer_cls.options(num_cpus=0, runtime_env=_worker_env()).remote(kwargs)
    trainer_wg = RayWorkerGroup(
        worker_handles=[trainer], ray_cls_with_init=RayClassWithInitArgs(cls=trainer_cls)
    )
    rollout_cls = ray.remote(InspectableWorker)
    rollouts = [
        rollout_cls.options(num_cpus=0, runtime_env=_worker_env()).remote(
            rollout_config, None, server_adapter=RecordingRollout()
        )
        for _ in range(2)
    ]
    manager = CheckpointEngineManager(
        config=config, actor_wg=trainer_wg, replicas=[_Replica([w]) for w in rollouts]
    )

    states = trajectory(5)
    for step, state in enumerate(states):
        trainer_wg.set_state(state)
        metrics = manager.update_weights(global_steps=step)
        assert metrics["checkpoint_engine/version"] == step, metrics
        for w in rollouts:
            assert same_state(ray.get(w.live_state.remote()), state), f"version {step} differs"
    assert metrics["checkpoint_engine/anchor"] == 0.0 and metrics["checkpoint_engine/compression_ratio"] > 5
    receiver = ray.get(rollouts[0].engine_metrics.remote())
    assert (
        receiver["checkpoint_engine/version"] == len(states) - 1
        and receiver["checkpoint_engine/refused"] == 0
    )

    # A corrupt frame: every receiver refuses it, the sync fails with the reason, weights stay.
    trainer_wg.set_state(perturb(states[-1], 0.02, seed=999))
    trainer_wg.corrupt_next_frame()
    with pytest.raises(Exception, match="refused") as info:
        manager.update_weights(global_steps=len(states) + 1)
    assert "ModalDeltaSyncError" in repr(info.value) or "ModalDeltaSyncError" in str(info.value)
    for w in rollouts:
        assert same_state(ray.get(w.live_state.remote()), states[-1])
    for h in [trainer, *rollouts]:
        ray.kill(h)


def test_a_trainer_restarted_from_a_checkpoint_resumes_its_versions_in_a_new_epoch():
    """verl restores ``global_steps`` from the checkpoint and syncs it first: the restarted
    master (same port) publishes that step as its new epoch's anchor. The receiver, which
    holds the old epoch's v3, ends at the new epoch's v2 and then v3' — never a mix."""
    states = trajectory(4)
    cluster = Cluster(n_rollout=1, actor_ranks=1, anchor_every=100)
    try:
        for step, state in enumerate(states):
            assert cluster.sync(state, step)[1] == [None]
        rollout = cluster.rollouts[0]
        old_epoch = rollout.engine._subscriber.live_epoch
        port = cluster.actors[0]._server.address[1]
        cluster.actors[0].close()  # the trainer dies; the job restarts it with resume_mode=auto
        cluster.actors = [registry().new("modal_delta", bucket_size=1 << 20, is_master=True, port=port)]
        retrained = perturb(states[2], 0.02, seed=777)  # step 3 again, trained differently
        for step, state in ((2, states[2]), (3, retrained)):  # the checkpoint of step 2, then step 3
            metrics, outcomes = cluster.sync(state, step)
            assert outcomes == [None] and metrics["checkpoint_engine/version"] == step
            assert same_state(rollout.live, state)
        assert metrics["checkpoint_engine/anchor"] == 0.0  # the new epoch's anchor was step 2
        assert rollout.engine._subscriber.live_epoch > old_epoch
        assert rollout.engine.metrics["checkpoint_engine/version"] == 3
        assert not same_state(rollout.live, states[3])
    finally:
        cluster.close()
