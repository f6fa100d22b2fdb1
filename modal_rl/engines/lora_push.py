"""The pushing side of LoRA adapter versions into a vLLM server (protocol: ``vllm_lora``).

Invariants: an adapter version is loaded only after every engine worker staged and verified
it (the signed ``modal_rl_stage_adapter`` call starts the staging, ``modal_rl_adapter_status``
answers ``ready`` with rank 0's adapter path); the engine serves while it stages, so the
engine's loop is held only by those short calls and the load itself; the
resident set (``lora.AdapterVersions``) moves only after vLLM loaded the new version, and
the version it evicts is unloaded by name after that.
"""

from __future__ import annotations

import time

from modal_rl.engines.vllm_push import EnginePushError, _blocked_s, _post, _rpc, poll_staging
from modal_rl.weightsync.apply.lora import AdapterVersions
from modal_rl.weightsync.apply.vllm_extension import pull_request
from modal_rl.weightsync.apply.vllm_lora import ADAPTER_METHOD
from modal_rl.weightsync.wire.auth import frame_keys


def load_adapter_version(
    engine_url: str,
    source,
    versions: AdapterVersions,
    config: dict,
    *,
    key,
    pull_timeout_s: float = 600.0,
) -> dict[str, float]:
    """Steps 1-3 of the module docstring for ``source.version``; the numbers. ``versions`` is
    this engine's resident set (one per engine: a replacement starts empty)."""
    engine_url = engine_url.rstrip("/")
    epoch = getattr(source, "epoch", None)
    admission = versions.plan(int(source.version), epoch or 0)
    adapter = {"prefix": versions.prefix, "keep": versions.max_resident, "config": config}
    body = pull_request(
        source.host,
        source.port,
        source.version,
        timeout_s=pull_timeout_s,
        key=frame_keys(key),
        tls=source.tls,
        method=ADAPTER_METHOD,
        epoch=epoch,
        adapter=adapter,
    )
    t0 = time.perf_counter()
    results = _rpc(engine_url, body, source.version, key)
    blocked = [_blocked_s(results)]
    if all(r.get("mode") == "staging" for r in results):
        results = _wait_adapter(engine_url, source.version, key, t0 + float(body["timeout"]), blocked)
    paths = [r["path"] for r in results if r.get("path")]
    if not paths:
        raise EnginePushError(f"{engine_url}: no worker wrote adapter version {source.version}")
    t_pause = time.perf_counter()
    _post(
        engine_url, "/v1/load_lora_adapter", {"lora_name": admission.name, "lora_path": paths[0]}, 300.0, key
    )
    pause_wall_s = time.perf_counter() - t_pause
    versions.commit(admission, epoch or 0)
    if admission.evicted is not None and admission.evicted != admission.version:
        _post(
            engine_url, "/v1/unload_lora_adapter", {"lora_name": versions.name(admission.evicted)}, 60.0, key
        )
    return {
        "engine_s": time.perf_counter() - t0,
        # The engine's loop is held by the short staging calls (the staging itself runs
        # while it serves) and by the adapter load.
        "pause_s": sum(blocked) + pause_wall_s,
        "pause_wall_s": pause_wall_s,
        "stage_s": t_pause - t0,
        "stage_rpc_s": sum(blocked),
        "engine_load_s": pause_wall_s,
        "engine_fetch_s": max(float(r.get("fetch_s", 0.0)) for r in results),
        "engine_frames": float(max(int(r.get("frames", 0)) for r in results)),
        "engine_workers": float(len(results)),
        "adapter": 1.0,
        "inplace": 0.0,
    }


def _wait_adapter(engine_url: str, version: int, key, deadline: float, blocked: list[float]) -> list[dict]:
    """Poll every worker's staging of adapter ``version`` until all are ready; each poll's
    blocked time goes into ``blocked``. Returns the ready answers (rank 0's has the path)."""
    return poll_staging(
        engine_url, "modal_rl_adapter_status", version, key, deadline, blocked, "adapter version"
    )
