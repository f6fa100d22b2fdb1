"""Delta weight sync into a running vLLM server: a worker extension that pulls versions.

Start the server with ``--worker-extension-cls`` set to :data:`EXTENSION` and
``VLLM_SERVER_DEV_MODE=1``, then ask it to load a version with vLLM's own
``POST /collective_rpc``::

    {"method": "modal_rl_pull_weights", "args": ["{\"host\": H, \"port\": P, \"version\": N}"]}

(vLLM passes only string arguments to ``collective_rpc``, hence one JSON string; optional
keys ``timeout_s`` and ``max_refusals``). Every worker process of the engine (one per
tensor/pipeline-parallel rank) runs the call: it connects to the frame server at H:P
(``modal_rl.weightsync.transport_tcp``), stages and verifies version N, and loads the whole
model from it. :func:`pull_request` builds the request and :func:`pull_results` reads the
answer, for the side that pushes.

Invariants:
- each worker keeps one ``Subscriber`` across calls; its staged state is the next delta's
  base, so after the first anchor only deltas cross the wire;
- the model is touched only after version N is staged with every tensor matching the
  publisher's checksum; a version that does not arrive in time, or is refused more than
  ``max_refusals`` times, raises (the HTTP call fails) and leaves the model as it was;
- weights go in through vLLM's layer-wise reload (``initialize_layerwise_reload`` /
  ``finalize_layerwise_reload``), which puts back parameters a backend repacked after
  loading (the CPU backend does) and re-runs the post-load processing; a load that fails
  half way is an engine error, not a refusal, and is reported as such.
"""

from __future__ import annotations

import json
import time
from typing import Any

from modal_rl.weightsync.codec import CodecConfig
from modal_rl.weightsync.subscriber import tcp_subscriber

EXTENSION = "modal_rl.weightsync.vllm_extension.DeltaWeightsExtension"
METHOD = "modal_rl_pull_weights"
LOG_PREFIX = "[modal_rl.weightsync] vllm loaded"


def pull_request(host: str, port: int, version: int, timeout_s: float = 600.0, max_refusals: int = 2) -> dict:
    """The ``/collective_rpc`` body asking every worker to load ``version`` from ``host:port``."""
    args = {"host": host, "port": int(port), "version": int(version), "timeout_s": float(timeout_s),
            "max_refusals": int(max_refusals)}  # fmt: skip
    # vLLM's own wait is bounded too: give it the pull's bound plus the load.
    return {"method": METHOD, "args": [json.dumps(args)], "timeout": float(timeout_s) + 300.0}


def pull_results(answer: Any, version: int) -> list[dict]:
    """Check ``/collective_rpc``'s answer: one result per worker, each at ``version``."""
    results = (answer or {}).get("results") if isinstance(answer, dict) else None
    if not results:
        raise RuntimeError(f"vLLM answered the weight pull without results: {str(answer)[:300]}")
    wrong = [r for r in results if not isinstance(r, dict) or r.get("version") != version]
    if wrong:
        raise RuntimeError(f"vLLM workers did not load version {version}: {str(wrong)[:300]}")
    return results


class DeltaWeightsExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); see the module docstring."""

    def modal_rl_pull_weights(self, request: str) -> dict:
        req = json.loads(request)
        target = int(req["version"])
        addr = (str(req["host"]), int(req["port"]))
        config = getattr(self, "_modal_rl_codec", None) or CodecConfig()
        self._modal_rl_codec = config
        sub = tcp_subscriber(getattr(self, "_modal_rl_subscriber", None), addr, target, config)
        self._modal_rl_subscriber = sub
        refused_before = len(sub.refused)
        timings = sub.stage_until(target, float(req.get("timeout_s", 600.0)), int(req.get("max_refusals", 2)))
        t0 = time.perf_counter()
        state = sub.chain.state
        self._modal_rl_load(state)
        load_s = time.perf_counter() - t0
        print(f"{LOG_PREFIX} version {sub.live_version}: {len(state)} tensors in {load_s:.2f}s", flush=True)
        return {
            "version": sub.live_version,
            "frames": len(timings),
            "payload_bytes": sum(t.bytes for t in timings),
            "fetch_s": sum(t.fetch_s for t in timings),
            "decode_s": sum(t.decode_s for t in timings),
            "load_s": load_s,
            "refused": len(sub.refused) - refused_before,
        }

    def _modal_rl_load(self, state: dict) -> None:
        import torch
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        runner = self.model_runner
        model = runner.model
        with torch.no_grad():
            initialize_layerwise_reload(model)
            try:
                model.load_weights(weights=iter(state.items()))
            finally:
                finalize_layerwise_reload(model, runner.vllm_config.model_config)
