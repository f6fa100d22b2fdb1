"""LoRA adapters into a running vLLM server, adapter-only frames, versioned names.

The engine runs with ``--enable-lora`` (``--max-loras`` / ``--max-cpu-loras`` >= the resident
bound, ``--max-lora-rank`` >= the adapter's rank), ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and
the ``vllm_extension`` worker extension; its base weights are the model path's (never synced:
a LoRA run trains the adapter on a frozen base). Per version N, ``lora_push.load_adapter_version``:

1. ``POST /collective_rpc`` ``modal_rl_stage_adapter`` (the signed pull request of
   ``vllm_extension``, with the adapter's PEFT config inside what is signed): each worker
   checks the request and starts a staging thread, and answers at once (``mode:
   "staging"``); the thread stages and verifies N from the frame server -- adapter tensors
   only, anchors and deltas like any version -- and rank 0 writes it as a PEFT adapter
   directory (``lora.write_adapter``) on the engine's host. All of that runs while the
   engine serves and changes nothing it serves; ``modal_rl_adapter_status`` (a short call)
   says ``staging``, ``ready`` (with rank 0's adapter path) or ``failed``;
2. ``POST /v1/load_lora_adapter`` under the name ``<prefix>-vN``: the pause (vLLM's engine loop
   loads the adapter between steps); requests that name ``<prefix>-vN`` sample from version N;
3. ``POST /v1/unload_lora_adapter`` for the version that leaves the resident bound
   (``lora.AdapterVersions``), and its directory is removed at the next staging.

Invariants: the served adapter of a version is exactly the staged, verified tensors (a frame
refused or late fails step 1, and nothing is loaded); versions already resident keep serving
through the whole call; the prefix cache needs no reset (vLLM keys cached blocks by adapter
name and path, and every version has its own).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

from modal_rl.weightsync.apply.adapter_dir import adapter_name, adapter_root
from modal_rl.weightsync.apply.lora import write_adapter

ADAPTER_METHOD = "modal_rl_stage_adapter"
LOG_PREFIX = "[modal_rl.weightsync] vllm staged adapter"  # one line per version rank 0 writes
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values


def lora_server_args(max_resident: int, rank: int) -> list[str]:
    """``vllm serve`` flags for an engine that serves ``max_resident`` adapter versions of
    ``rank`` (rounded up to a ``--max-lora-rank`` vLLM accepts)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= int(rank)]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})")
    n = str(int(max_resident))
    return ["--enable-lora", "--max-loras", n, "--max-cpu-loras", n, "--max-lora-rank", str(fits[0])]


class AdapterStageMixin:
    """Mixed into ``DeltaWeightsExtension``: the worker side of step 1 above."""

    def modal_rl_stage_adapter(self, request: str = "", signature: str = "") -> dict:
        t_rpc = time.perf_counter()  # the engine loop is held only for the checks below
        sub, req = self._modal_rl_verified_subscriber(request, signature)  # refuses while staging
        target = int(req["version"])
        adapter = req.get("adapter") or {}
        # The prefix names one directory under the root, never a path (``/abs``, ``..``).
        prefix = adapter_name(adapter.get("prefix"))
        job: dict[str, Any] = {"kind": "adapter", "version": target, "state": "staging", "error": None}

        def work() -> None:
            try:
                job["result"] = self._modal_rl_stage_adapter_now(sub, req, prefix, adapter)
                job["state"] = "ready"
            except Exception as exc:  # noqa: BLE001 -- reported to the pusher; nothing was loaded
                job["error"], job["state"] = f"{type(exc).__name__}: {exc}", "failed"

        job["thread"] = threading.Thread(target=work, name="modal-rl-stage-adapter", daemon=True)
        self._modal_rl_stage_job = job
        job["thread"].start()
        return {"version": target, "mode": "staging", "rpc_s": time.perf_counter() - t_rpc}

    def modal_rl_adapter_status(self, version: int = -1) -> dict:
        """``staging``, ``ready`` (with the staging's numbers, and on rank 0 the adapter's
        ``path``) or ``failed`` (with the error) for adapter ``version``."""
        t_rpc = time.perf_counter()
        job = getattr(self, "_modal_rl_stage_job", None)
        if job is None or job.get("kind") != "adapter" or job["version"] != int(version):
            return {"version": int(version), "state": "failed", "error": "no adapter staging of this version"}
        out = {"version": job["version"], "state": job["state"], "error": job["error"]}
        if job["state"] == "ready":
            out.update(job["result"])
        return {**out, "rpc_s": time.perf_counter() - t_rpc}

    def _modal_rl_stage_adapter_now(self, sub, req: dict, prefix: str, adapter: dict) -> dict:
        """Stage and verify the version, and on rank 0 write it as an adapter directory."""
        refused_before = len(sub.refused)
        timings = sub.stage_until(
            int(req["version"]),
            float(req.get("timeout_s", 600.0)),
            int(req.get("max_refusals", 2)),
            epoch=sub.target_epoch,
        )
        out: dict[str, Any] = {
            "version": sub.live_version,
            "frames": len(timings),
            "payload_bytes": sum(t.bytes for t in timings),
            "fetch_s": sum(t.fetch_s for t in timings),
            "refused": len(sub.refused) - refused_before,
        }
        if getattr(self, "rank", 0) == 0:  # one copy on the host; vLLM shards it per rank itself
            from modal_rl.weightsync.apply.lora import adapter_state

            name = adapter_name(f"{prefix}-v{sub.live_version}")
            t0 = time.perf_counter()
            tensors, _ = adapter_state(sub.chain.state)
            root = self._modal_rl_adapter_root()
            path = write_adapter(root / name, tensors, adapter["config"])
            self._modal_rl_prune_adapters(root, path, int(adapter["keep"]))
            out.update({"path": str(path), "write_s": time.perf_counter() - t0})
            print(f"{LOG_PREFIX} version {sub.live_version}: {len(tensors)} tensors, {path.name}", flush=True)
        return out

    def _modal_rl_adapter_root(self) -> Path:
        root = getattr(self, "_modal_rl_adapters", None)
        if root is None:
            # The one directory the engine guard lets /v1/load_lora_adapter read from.
            root = adapter_root()
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._modal_rl_adapters = root
        return root

    def _modal_rl_prune_adapters(self, root: Path, newest: Path, keep: int) -> None:
        """Keep the ``keep`` newest adapter directories written here (the resident versions
        and the one just staged); older ones are no longer routed to."""
        written = [p for p in getattr(self, "_modal_rl_written", []) if p != newest] + [newest]
        for old in written[: max(0, len(written) - keep - 1)]:
            shutil.rmtree(old, ignore_errors=True)
        self._modal_rl_written = written[max(0, len(written) - keep - 1) :]
