"""Weight updates for ``modal_vllm`` replicas: a relay worker on the cluster, pulls in the engine.

verl's ``CheckpointEngineManager`` updates a replica by calling ``update_weights`` on the
replica's ``workers`` — stock ``CheckpointEngineWorker`` actors, each of which receives a
version through the configured checkpoint engine and hands the ``(name, tensor)`` stream to
its *server adapter*. A ``modal_vllm`` engine runs in a container of its own, so its replica
gets one such worker on the trainer cluster, with no GPU, whose adapter is
:class:`EngineWeightsAdapter`: it forwards the frames its ``modal_delta`` receiver verified,
record for record, on its own frame server (``modal_rl.engines.vllm_push.EnginePusher.forward``: no second
encode, the trainer's MACs kept; with a sharded trainer, whose pieces the receiver puts
together, it encodes the whole version again: ``EnginePusher.publish``) and has the
engine pull it through vLLM's ``/collective_rpc`` (``vllm_extension``): the engine stages each
delta while it serves and writes only the changed words into its parameters in a short pause
(``vllm_inplace``; its first version is a full load that teaches it where each checkpoint
element lives).

So the trainer → relay hop is whatever checkpoint engine the run configures (it must work
without a GPU: ``modal_delta``), and the relay → engine hop is always compressed deltas over
TCP (a ``modal.forward`` tunnel when the relay runs in a Modal container).

The relay only *publishes*; loading is the replica's proxy's job (``load_weights``), because
the proxy's ``EngineSupervisor`` knows which engine is up: it has every serving engine pull the
version now, and a replacement engine (after a crash or hang) pull it -- the retained anchor
and the deltas after it -- before it takes a request.

Invariants: the adapter is pickled into the worker and opens its frame server there, on the
first update; ``update_weights`` returns after the version is published and every serving
engine reported it loaded (an engine that fails to load it is replaced, and serves again only
with it); the frame server keeps the last anchor and the deltas after it for replacements.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("verl_modal")

CPU_CHECKPOINT_ENGINES = ("modal_delta",)


def checkpoint_engine_problem(backend: str | None) -> str | None:
    """Why ``backend`` cannot update ``modal_vllm`` policy engines, or None if it can. Their relay
    worker has no GPU, and ``naive`` never reaches a standalone replica. Checked by the launcher's
    preflight and again by the replica (plain verl runs have no preflight)."""
    if backend in CPU_CHECKPOINT_ENGINES:
        return None
    key = "actor_rollout_ref.rollout.checkpoint_engine.backend"
    return (
        f"{key}={backend} cannot update actor_rollout_ref.rollout.name=modal_vllm engines (they run "
        f"in containers of their own); set {key}={CPU_CHECKPOINT_ENGINES[0]}"
    )


def check_checkpoint_engine(config) -> None:
    """Refuse, before an engine starts, a checkpoint engine that cannot reach it."""
    problem = checkpoint_engine_problem(config.checkpoint_engine.backend)
    if problem:
        raise ValueError(f"modal_vllm: {problem}")


class EngineWeightsAdapter:
    """The server adapter of a ``modal_vllm`` replica's relay worker (see the module docstring).

    ``expose``: ``"local"`` when the engine runs on this machine, ``"modal"`` when the relay
    runs in a Modal container and the engine in another app's container."""

    def __init__(self, server_handle, replica_rank: int, expose: str, pull_timeout_s: float) -> None:
        self.server_handle = server_handle  # the replica's VLLMHttpProxy: it tags outputs with steps
        self.replica_rank = replica_rank
        self.is_leader_rank = True  # one relay per replica
        self.expose = expose
        self.pull_timeout_s = pull_timeout_s
        self.metrics: dict[str, float] = {}
        self._pusher = None
        self._published = False  # this pusher published (encoded) a version: it never forwards

    def __getstate__(self) -> dict:
        return {
            **self.__dict__,
            "_pusher": None,
            "_published": False,
        }  # sockets and tunnels stay where they were opened

    def _ensure_pusher(self):
        if self._pusher is None:
            from modal_rl.engines import EnginePusher

            self._pusher = EnginePusher(None, expose=self.expose, pull_timeout_s=self.pull_timeout_s)
        return self._pusher

    async def update_weights(
        self, weights, global_steps: int | None = None, wire_format: str = "named_tensors", **_: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"modal_vllm: checkpoint engine wire format {wire_format!r}; need named_tensors")
        from verl_modal import checkpoint_engine

        checkpoint_engine.keep_verified_frames()  # before the receiver stages this version
        state: dict[str, Any] = {}
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                state[name] = tensor
        else:
            for name, tensor in weights:
                state[name] = tensor
        from dataclasses import asdict

        pusher = self._ensure_pusher()
        frames = checkpoint_engine.take_verified_frames()
        if frames and not self._published:
            raw = sum(t.numel() * t.element_size() for t in state.values())
            source, numbers = await asyncio.to_thread(pusher.forward, frames, raw)
        else:  # nothing to forward (a sharded trainer's pieces): encode the version here
            source, numbers = await asyncio.to_thread(pusher.publish, state)
            self._published = True
        # As verl's own adapters do, outputs carry their policy's step: the proxy tags each
        # sample with the step of the version its engine held.
        loaded = await self.server_handle.load_weights.remote(asdict(source), global_steps)
        self.metrics = {**numbers, **loaded}
        log.info(
            "modal_vllm replica %d: engine loaded v=%d (global_steps=%s) %.2f MiB in %.2fs, "
            "%s, serving paused %.3fs%s",
            self.replica_rank,
            int(self.metrics["version"]),
            global_steps,
            self.metrics["payload_mbytes"],
            self.metrics["engine_s"],
            "in place" if self.metrics.get("inplace") else "full load",
            self.metrics.get("pause_s", 0.0),
            " (frames forwarded)" if "forwarded_frames" in self.metrics else "",
        )


async def start_relay_worker(replica, expose: str) -> list:
    """One CPU ``CheckpointEngineWorker`` for ``replica``, built as verl builds a standalone
    replica's workers (a resource pool and a ``RayWorkerGroup``), with our adapter."""
    import ray
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    prefix = f"modal_vllm_relay_{replica.replica_rank}{replica.name_suffix}"
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, name_prefix=prefix, max_colocate_count=1)
    adapter = EngineWeightsAdapter(
        replica.server_handle,
        replica.replica_rank,
        expose,
        float(replica.settings["weights_timeout_s"]),
    )
    worker_cls = RayClassWithInitArgs(
        cls=ray.remote(CheckpointEngineWorker),
        rollout_config=replica.config,
        model_config=replica.model_config,
        server_adapter=adapter,
    )
    group = await asyncio.to_thread(
        RayWorkerGroup,
        resource_pool=pool,
        ray_cls_with_init=worker_cls,
        bin_pack=False,
        name_prefix=prefix,
        use_gpu=False,
        device_name="cpu",
    )
    return group.workers
