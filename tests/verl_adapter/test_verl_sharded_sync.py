"""``modal_delta`` with ``sharded: true`` (``verl_modal.sharded``): every actor rank publishes
the parameters it holds, from verl's own shard export (``ShardSpec``s), and the rollout
engine yields full tensors only when every rank's stream staged the version. Real sockets on
127.0.0.1, real verl classes, real FSDP2 ranks in the slow test."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from modal_rl.run_key import RUN_KEY_ENV  # noqa: E402
from tests.verl_adapter.test_verl_checkpoint_engine import CorruptNext  # noqa: E402
from tests.weightsync_helpers import TEST_KEY, bits, model_state, perturb  # noqa: E402
from verl_modal.checkpoint_engine import ModalDeltaCheckpointEngine, ModalDeltaSyncError  # noqa: E402
from verl_modal.sharded import ShardedExportError, local_pieces, piece_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def same_tensors(a: dict, b: dict) -> bool:
    """Same names (any order), dtypes, shapes and bits."""
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bits(a[k]) == bits(b[k]) for k in a
    )


def rank_export(state: dict[str, torch.Tensor], rank: int, world: int):
    """What a dim-0 sharded trainer's ``get_per_tensor_param_shard`` yields on ``rank``, with
    verl's own ``ShardSpec`` (an exporter's explicit flat ``place``, as veomni's does)."""
    from verl.workers.engine.spec import ShardSpec

    for name, full in state.items():
        rows = full.shape[0] if full.dim() else 1
        step = -(-rows // world)
        lo, hi = min(rank * step, rows), min((rank + 1) * step, rows)
        row = math.prod(full.shape[1:])
        local = full.reshape(-1)[lo * row : hi * row]
        yield name, local, ShardSpec(tuple(full.shape), place=lo * row, gather_group=object())


def sync(actors, rollout, state, step: int, live: dict) -> BaseException | None:
    """One verl sync: prepare, build_topology, init, send on every rank ‖ receive, copying
    what is yielded into ``live`` as verl's rollout adapter loads it into the model."""
    metadata = [e.prepare() for e in actors] + [rollout.prepare()]
    actor_kw, rollout_kw = ModalDeltaCheckpointEngine.build_topology(len(actors), 1, metadata)
    for i, e in enumerate(actors):
        e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
    rollout.init_process_group(**{k: v[0] for k, v in rollout_kw.items()})

    async def receive():
        async for name, tensor in rollout.receive_weights(global_steps=step):
            live[name] = tensor.clone()

    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(asyncio.run, receive())
        for r, e in enumerate(actors):
            asyncio.run(e.send_weights(rank_export(state, r, len(actors)), global_steps=step))
        error = received.exception(timeout=60)
    for e in [*actors, rollout]:
        e.finalize()
    return error


def test_ranks_publish_their_shards_and_a_corrupt_one_changes_nothing():
    states = [model_state(seed=3)]
    for v in range(1, 4):
        states.append(perturb(states[-1], 0.02, seed=v))
    actors = [
        ModalDeltaCheckpointEngine(0, is_master=r == 0, sharded=True, anchor_every=None, max_refusals=1)
        for r in range(3)
    ]
    rollout = ModalDeltaCheckpointEngine(0, max_refusals=1, receive_timeout_s=20)
    live: dict = {}
    try:
        for step, state in enumerate(states[:3]):
            error = sync(actors, rollout, state, step, live)
            assert error is None and same_tensors(live, state), f"version {step}"
            assert rollout.metrics["checkpoint_engine/ranks"] == 3
            assert rollout.metrics["checkpoint_engine/version"] == step
        held = [sum(t.numel() for t in e._publisher.snapshot.values()) for e in actors]
        full = sum(t.numel() for t in states[0].values())
        assert sum(held) == full and max(held) < full  # no rank holds the whole model
        assert len({e._publisher.epoch for e in actors}) == 1  # rank 0's epoch, adopted
        actors[1]._publisher.sink = CorruptNext(actors[1]._publisher.sink)  # rank 1's v3 is damaged
        error = sync(actors, rollout, states[3], 3, live)
        assert isinstance(error, ModalDeltaSyncError) and "refused" in str(error), error
        assert same_tensors(live, states[2])  # nothing yielded: the rollout still serves v2, whole
        assert rollout._pull.receiver.live_version == 2 and list(rollout._pull.tensors()) == []
        assert rollout._pull.receiver.staged() == [3, 2, 3]  # ranks 0 and 2 staged v3, not activated
    finally:
        for e in [*actors, rollout]:
            e.close()


def test_build_topology_hands_every_rollout_worker_every_actor_endpoint():
    cls = ModalDeltaCheckpointEngine
    eps = [
        {
            "host": f"10.0.0.{r}",
            "port": 9000 + r,
            "version": 4 + (r == 2),
            "epoch": 0xA0 + r,
            "sharded": True,
        }
        for r in range(3)
    ]
    actor, rollout = cls.build_topology(3, 2, [{"endpoint": ep} for ep in eps] + [{"endpoint": None}] * 2)
    shared = rollout["endpoint"][0]
    assert shared["endpoints"] == [{"host": f"10.0.0.{r}", "port": 9000 + r} for r in range(3)]  # rank order
    assert shared["epoch"] == 0xA0 and shared["version"] == 5
    assert rollout["rank"] == [1, 2] and rollout["endpoint"] == [shared, shared]
    assert actor["rank"] == [0, 0, 0] and actor["endpoint"] == [shared] * 3
    with pytest.raises(ValueError, match=r"ranks \[1\] announced none"):
        cls.build_topology(2, 1, [{"endpoint": eps[0]}, {"endpoint": None}, {"endpoint": None}])
    with pytest.raises(ValueError, match=r"workers \[2\] announced"):
        cls.build_topology(2, 1, [{"endpoint": eps[0]}, {"endpoint": eps[1]}, {"endpoint": eps[2]}])


def test_specs_become_flat_ranges_or_fail_naming_the_parameter():
    from verl.workers.engine.spec import BlockPlacement, ShardSpec

    local = torch.zeros(6)
    assert piece_start("plain", torch.zeros(2, 3), ShardSpec((2, 3))) == 0  # unsharded: rank 0's
    rows = BlockPlacement((2, 3), (2, 0), (4, 3))  # rows 2..3 of a 4x3 tensor
    assert piece_start("w", local, ShardSpec((4, 3), place=rows, gather_group=object())) == 6
    replica = ShardSpec((4, 3), place=rows, gather_group=object(), contributes=False)
    assert piece_start("w", local, replica) is None  # a replica another rank publishes
    cols = BlockPlacement((4, 1), (0, 2), (4, 3))
    with pytest.raises(ShardedExportError, match=r"^w: .*not a flat range.*sharded=false"):
        piece_start("w", torch.zeros(4), ShardSpec((4, 3), place=cols, gather_group=object()))
    converter = ShardSpec((4, 3), place=0, to_hf_chunk=lambda start, seg: [])
    with pytest.raises(ShardedExportError, match=r"^experts: .*converter.*sharded=false"):
        piece_start("experts", torch.zeros(12), converter)
    with pytest.raises(ShardedExportError, match="holds 5 elements"):
        piece_start("w", torch.zeros(5), ShardSpec((4, 3), place=rows, gather_group=object()))
    with pytest.raises(ShardedExportError, match="gathered full tensors"):
        list(local_pieces([("w", torch.zeros(4, 3))]))


@pytest.mark.slow
def test_real_fsdp2_ranks_sync_bit_identically_through_verl_shard_export(tmp_path):
    """Two FSDP2 ranks, verl's ``FSDPEngine.get_per_tensor_param_shard``, Adam between versions
    (``tests._verl_shard_child``): the rollout engine's tensors equal the gathered state every
    version; each rank's publisher held exactly its dim-0 rows (the plain buffer on rank 0);
    a Shard(1) parameter fails before anything is sent, naming it."""
    versions = 3
    env = {**__import__("os").environ, "VERL_PLATFORM": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests._verl_shard_child", str(tmp_path), str(versions)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    previous = None
    for v in range(versions):
        full, received = torch.load(tmp_path / f"full{v}.pt"), torch.load(tmp_path / f"recv{v}.pt")
        assert same_tensors(received, full), f"version {v}"
        assert previous is None or not same_tensors(full, previous)  # Adam moved the weights
        previous = full
    expected = [0, 0]
    for name, t in full.items():  # torch.chunk along dim 0, as FSDP2 shards; plain tensors: rank 0
        if name == "scale":
            expected[0] += t.numel()
            continue
        step = -(-t.shape[0] // 2)
        for r in range(2):
            expected[r] += max(0, min((r + 1) * step, t.shape[0]) - r * step) * t[0].numel()
    for r in range(2):
        lines = (tmp_path / f"held{r}.txt").read_text().split("\n")[:-1]
        assert [line.split() for line in lines] == [
            [str(v), str(expected[r]), str(sum(expected)), f"{float(v)}"] for v in range(versions)
        ]
        bad = (tmp_path / f"bad{r}.txt").read_text()
        assert bad.startswith("ShardedExportError: w: placements (Shard(dim=1),)"), bad
        assert "sharded=false" in bad and bad.endswith("sent=None")


class _ShardingActor:
    """A training engine exporting its shards (rank 0 of 1); its gathering export must not run."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def get_per_tensor_param_shard(self, **_):
        return rank_export(self.state, 0, 1), None

    def get_per_tensor_param(self, **_):
        raise AssertionError("the sharded path gathered")


def test_the_actor_worker_hands_a_sharded_engine_the_training_engine():
    """verl_modal.lora's ``update_weights`` wrapper: a sharded ``modal_delta`` engine gets
    ``self.actor.engine`` (verl itself does that only for ``delta_sharded``)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from verl.workers import engine_workers

    from verl_modal import lora

    lora.install()
    update = engine_workers.ActorRolloutRefWorker.update_weights

    def worker(lora_rank: int) -> SimpleNamespace:
        config = OmegaConf.create(
            {
                "rollout": {"checkpoint_engine": {"backend": "modal_delta"}, "name": "vllm"},
                "model": {"lora_rank": lora_rank},
            }
        )
        engine = ModalDeltaCheckpointEngine(0, is_master=True, sharded=True)
        return SimpleNamespace(
            config=config,
            checkpoint_engine=engine,
            actor=SimpleNamespace(engine=_ShardingActor(model_state(5))),
        )

    full = worker(0)
    try:
        metrics = asyncio.run(update(full, global_steps=7))
        assert metrics["checkpoint_engine/version"] == 7 and metrics["checkpoint_engine/anchor"] == 1
        assert sum(t.numel() for t in full.checkpoint_engine._publisher.snapshot.values()) == sum(
            t.numel() for t in model_state(5).values()
        )
    finally:
        full.checkpoint_engine.close()
    adapter = worker(8)
    with pytest.raises(ShardedExportError, match="LoRA adapter run.*sharded=false"):
        asyncio.run(update(adapter, global_steps=1))
