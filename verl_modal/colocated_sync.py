"""Colocated verl + vLLM: every weight update goes into vLLM in place, from a delta.

verl's colocated (``hybrid_engine``) sync has the trainer rank hand every tensor to the vLLM
server beside it (``ServerAdapter.update_weights``, the ``naive`` backend), and vLLM reloads
the whole model each time. Here, instead, the trainer rank that owns the server publishes
each update as one verified frame on a keyed frame server of its own
(``modal_rl.weightsync``: an anchor first, lossless deltas after it), and asks vLLM's workers
through verl's own ``collective_rpc`` to pull that version and make it live:

- the first version (an anchor) is a full load through vLLM's layer-wise reload, after which
  each worker learns its engine map (``modal_rl.weightsync.apply.vllm_inplace``);
- every later version is staged (fetch, decode, verify, diff against the engine's storage)
  and written in place: only the changed words, no reload.

This is the one place the colocated path needs a patch rather than a registry entry: verl
builds this adapter from a fixed table and calls its ``update_weights`` from inside its own
sync (``ActorRolloutRefWorker.update_weights``), with no hook between the trainer's tensors
and the engine. verl's training loop, its manager and its trainer are unchanged.

Invariants:
- tensors are published in the engine's dtype (``rollout.dtype``): the cast vLLM's loader
  would make anyway, so the engine ends with the same words as a full load, and a step's
  delta is the words that moved at the engine's precision;
- the engine's weights change only after the version is verified against the sender's sums
  (a refused or late version raises, the weights stay); the pull request is signed with the
  run's key (``MODAL_RL_RUN_KEY``), and the frame server listens on 127.0.0.1 only (the
  server's workers share the trainer rank's node);
- versions follow verl's ``global_steps`` where it moves forward (as ``modal_delta``);
- LoRA adapter updates, quantized engines and ``MODAL_RL_COLOCATED_SYNC=reload`` keep verl's
  own path (every tensor, a layer-wise reload);
- only verl's colocated sync is redirected (the caller that passes ``base_sync_done``); a
  standalone replica's checkpoint-engine worker keeps its own path;
- ranks that do not own a server walk their weight generator (producing each tensor may be
  collective over the actor group) and send nothing.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

MODE_ENV = "MODAL_RL_COLOCATED_SYNC"
MODES = ("inplace", "reload")
APPLY_METHOD = "modal_rl_apply_weights"
METRIC_PREFIX = "checkpoint_engine/"


def mode() -> str:
    """``inplace`` (default) or ``reload`` (verl's own path), from :data:`MODE_ENV`."""
    value = os.environ.get(MODE_ENV, "inplace").strip().lower() or "inplace"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: choose one of {MODES}")
    return value


# -- engine side (vLLM worker processes) ------------------------------------------------


def apply_weights(self, request: str = "", signature: str = "") -> dict:
    """Worker rpc: pull the signed request's version and make it live, in one call (the
    colocated engine is idle during a sync, so staging need not overlap serving): the first
    version a full load that learns the engine map, every later one staged and switched in
    place. Raises (weights unchanged) when the version is refused or does not arrive."""
    t0 = time.perf_counter()
    out = self.modal_rl_stage_weights(request, signature)
    if out.get("mode") == "staging":
        self._modal_rl_stage_job["thread"].join()
        out = self.modal_rl_switch_weights(out["version"])
    return {**out, "rpc_s": time.perf_counter() - t0}


def graft_extension(cls: type) -> bool:
    """Give verl's colocated worker extension the in-place rpc methods of
    ``DeltaWeightsExtension`` (and :func:`apply_weights`), without replacing any method it
    has. Returns whether it grafted (False if already done)."""
    if getattr(cls, APPLY_METHOD, None) is not None:
        return False
    from modal_rl.weightsync.apply.vllm_extension import DeltaWeightsExtension

    for base in reversed(DeltaWeightsExtension.__mro__[:-1]):  # object excluded
        for name, value in vars(base).items():
            if name.startswith(("_modal_rl", "modal_rl")) and name not in vars(cls):
                setattr(cls, name, value)
    setattr(cls, APPLY_METHOD, apply_weights)
    return True


# -- trainer side (the rank that owns the vLLM server) ---------------------------------


class ColocatedPusher:
    """One trainer rank's frame server and publisher, kept across syncs (the previous
    version is the next delta's base)."""

    def __init__(self, dtype: Any, anchor_every: int | None = 16, pull_timeout_s: float = 600.0):
        from modal_rl.weightsync.publisher import Publisher
        from modal_rl.weightsync.transport.tcp import FrameServer

        self.server = FrameServer("127.0.0.1", 0)  # keyed by the run's key (raises without it)
        self.publisher = Publisher(self.server, anchor_every=anchor_every)
        self.dtype = dtype
        self.pull_timeout_s = pull_timeout_s

    def publish(self, pairs, global_steps: int | None) -> tuple[Any, dict[str, float]]:
        from verl_modal.checkpoint_engine import _target, cast_floats

        t0 = time.perf_counter()
        report = self.publisher.publish(
            cast_floats(pairs, self.dtype), _target(self.publisher.next_version, global_steps)
        )
        return report, {
            METRIC_PREFIX + "version": float(report.version),
            METRIC_PREFIX + "anchor": 1.0 if report.kind == "anchor" else 0.0,
            METRIC_PREFIX + "payload_mbytes": report.bytes / (1 << 20),
            METRIC_PREFIX + "raw_mbytes": report.raw_bytes / (1 << 20),
            METRIC_PREFIX + "compression_ratio": report.raw_bytes / max(report.bytes, 1),
            METRIC_PREFIX + "send_s": time.perf_counter() - t0,
        }

    def request(self, report) -> list[str]:
        """The signed pull request (``[REQUEST, SIGNATURE]``) for ``report``'s version."""
        from modal_rl.weightsync.apply.vllm_extension import STAGE_METHOD, pull_request

        host, port = self.server.address[:2]
        body = pull_request(
            "127.0.0.1" if host in ("", "0.0.0.0") else str(host),
            int(port),
            report.version,
            timeout_s=self.pull_timeout_s,
            method=STAGE_METHOD,
            epoch=self.publisher.epoch,
        )
        return body["args"]

    def close(self) -> None:
        self.server.close()


def _engine_dtype(adapter) -> Any:
    from verl_modal.checkpoint_engine import publish_dtype

    return publish_dtype(str(getattr(adapter.config, "dtype", "bfloat16") or "bfloat16"), "rollout.dtype")


async def _drain(weights) -> None:
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


async def update_weights_inplace(adapter, weights, global_steps: int | None = None) -> None:
    """``ServerAdapter.update_weights`` for full-model updates (module docstring). Leaves
    its numbers in ``adapter.metrics`` (``checkpoint_engine/*`` as ``modal_delta`` reports
    them, plus ``pause_s``: how long the engine was busy loading)."""
    if not adapter._ensure_server_handle():
        await _drain(weights)
        return
    pusher = getattr(adapter, "_modal_rl_pusher", None)
    if pusher is None:
        pusher = adapter._modal_rl_pusher = ColocatedPusher(_engine_dtype(adapter))
    if hasattr(weights, "__aiter__"):
        pairs = [item async for item in weights]
        report, numbers = await asyncio.to_thread(pusher.publish, pairs, global_steps)
    else:  # in the caller's thread: the generator may run collectives bound to it
        report, numbers = pusher.publish(weights, global_steps)
    t0 = time.perf_counter()
    await adapter._execute_method(
        APPLY_METHOD, args=tuple(pusher.request(report)), timeout=pusher.pull_timeout_s + 300.0
    )
    await adapter.server_handle.clear_kv_cache.remote()  # cached keys/values hold the old weights
    if global_steps is not None:
        await adapter.server_handle.set_global_steps.remote(global_steps)
    adapter.metrics = {
        **numbers,
        "pause_s": time.perf_counter() - t0,
        "inplace": float(report.kind != "anchor"),
    }


def wrap_update_weights(original):
    """Wrap ``ServerAdapter.update_weights``: full-model updates in place (see the module),
    the rest to verl's own method."""
    import functools

    @functools.wraps(original)
    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        self.metrics = {}  # this sync's numbers only (none on verl's own path)
        if (
            mode() != "inplace"
            or "base_sync_done" not in kwargs  # only verl's colocated sync passes it
            or wire_format != "named_tensors"
            or kwargs.get("peft_config")
            or _quantized(self)
        ):
            return await original(self, weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        return await update_weights_inplace(self, weights, global_steps)

    update_weights.__modal_rl_inplace__ = True
    return update_weights


def _quantized(adapter) -> bool:
    return bool(getattr(adapter.config, "quantization", None))
