"""vLLM behind the Engine port: its launch command, health request, and weight and control calls.

The server is vLLM's OpenAI server (``vllm serve``) with our worker extension
(``weightsync.apply.vllm_extension``) when it takes weight versions, and our middleware
(``engines.auth.RunKeyAuth``) so every route needs the engine bearer. Its HTTP calls:

    stage   -> POST /collective_rpc modal_rl_stage_weights, then modal_rl_stage_status polls
    commit  -> POST /collective_rpc modal_rl_switch_weights, then POST /reset_prefix_cache
    load    -> both (``vllm_push.load_version``, which also measures the pause)
    pause   -> POST /pause?mode=keep           resume -> POST /resume
    reset_prefix_cache -> POST /reset_prefix_cache?reset_running_requests=true
    load_adapter -> POST /v1/load_lora_adapter   unload_adapter -> POST /v1/unload_lora_adapter

Invariants: ``vllm_argv`` is the only place a ``vllm serve`` command is built (the pusher's
local spec and verl's replicas both use it); the command never carries a key; ``commit``
switches only a version this driver staged on that server (a worker's first in-place pull is a
full load that is live at once, and then only the cache is reset).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

from modal_rl.engines.auth import vllm_auth_args
from modal_rl.engines.base import Engine
from modal_rl.engines.health import vllm_generate
from modal_rl.engines.pool import parse_cpus
from modal_rl.run_key import run_key
from modal_rl.weightsync.apply.vllm_extension import EXTENSION, STAGE_METHOD, pull_request
from modal_rl.weightsync.apply.vllm_inplace import PLAIN_WEIGHTS_ENV
from modal_rl.weightsync.wire.auth import FROM_ENV, frame_keys

# This interpreter's vLLM, never a ``vllm`` found on PATH (an unactivated venv has none there).
LOCAL_SERVER = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
IMAGE_SERVER = ("vllm", "serve")  # an engine image's own vLLM


def vllm_argv(
    server: Iterable[str],
    model: str,
    *,
    served_name: str | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    flags: Iterable[str] = (),
    receives_weights: bool = False,
) -> list[str]:
    """``vllm serve`` of ``model``: ``server`` (the command before the model), ``{host}`` and
    ``{port}`` left open, every route behind the engine bearer, then ``flags`` as given, and
    the worker extension when the server takes weight versions."""
    cmd = [*server, str(model), "--host", "{host}", "--port", "{port}", *vllm_auth_args()]
    if served_name is not None:
        cmd += ["--served-model-name", served_name]
    if dtype is not None:
        cmd += ["--dtype", str(dtype)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    cmd += [str(flag) for flag in flags]
    if receives_weights:
        cmd += ["--worker-extension-cls", EXTENSION]
    return cmd


def vllm_env(*, receives_weights: bool, inplace: bool = True) -> dict[str, str]:
    """The server's environment: dev routes on (sleep, pause, reset and ``collective_rpc``, each
    still behind the route guard), and plain weights on a CPU engine so versions are written in
    place (no effect on GPUs)."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if receives_weights and inplace:
        env[PLAIN_WEIGHTS_ENV] = "1"
    return env


def local_vllm_spec(
    model_dir: str,
    *,
    dtype: str = "bfloat16",
    max_model_len: int = 256,
    name: str = "vllm",
    startup_timeout_s: float = 600.0,
    inplace: bool = True,
    prefix_caching: bool = True,
    max_num_seqs: int = 4,
    cpus: str | None = None,
):
    """An ``EngineSpec`` for one local ``vllm serve`` of ``model_dir`` that takes pushes: the
    extension loaded, dev endpoints on, 32-token KV blocks (the CPU backend's smallest, so
    short prompts already exercise the prefix cache), eager mode, no hub access. ``inplace``:
    linear weights stay plain parameters the CPU kernel reads (``vllm_inplace``), so a
    version can be written into them in place. ``prefix_caching=False`` for runs that keep
    running requests' KV cache across a commit (``asyncrl.kv_policy``: ``keep``). ``cpus``: the
    cores the server's processes run on and the CPU backend's threads are bound to (``"1"``,
    ``"2-5"``; default: every core), so a trainer beside it on the same host keeps cores of its
    own (vLLM's engine loop keeps a core busy while it generates)."""
    engine = VllmEngine(str(model_dir), key=None, inplace=inplace)
    flags = ["--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    flags += ["--block-size", "32", *([] if prefix_caching else ["--no-enable-prefix-caching"])]
    engine.options = {"dtype": dtype, "seed": 0, "flags": flags}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cores = parse_cpus(cpus or "")
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return engine.spec(env=env, startup_timeout_s=startup_timeout_s, name=name, cpus=cores)


class VllmEngine(Engine):
    """A vLLM server; see the module docstring. ``options`` are ``vllm_argv``'s keywords."""

    name = "vllm"
    port = 8000
    # for users that hold only the class (the adapters get it from the registry)
    LOCAL_SERVER = LOCAL_SERVER
    IMAGE_SERVER = IMAGE_SERVER

    def __init__(
        self,
        model: str = "",
        *,
        key: Any = FROM_ENV,
        server: Iterable[str] = LOCAL_SERVER,
        served_name: str | None = None,
        receives_weights: bool = True,
        inplace: bool = True,
        pull_timeout_s: float = 600.0,
        hold_requests: bool = False,
    ) -> None:
        super().__init__(key=run_key() if key is FROM_ENV else key)
        self.model, self.server, self.served_name = model, tuple(server), served_name
        self.receives_weights, self.inplace = receives_weights, inplace
        self.pull_timeout_s, self.hold_requests = pull_timeout_s, hold_requests
        self.options: dict[str, Any] = {}
        self._staged: dict[str, int] = {}  # url -> version staged there, not yet live

    def argv(self) -> list[str]:
        return vllm_argv(
            self.server,
            self.model,
            served_name=self.served_name,
            receives_weights=self.receives_weights,
            **self.options,
        )

    def generate_request(self) -> dict[str, Any]:
        return vllm_generate(self.served_name or self.model)

    def env(self) -> dict[str, str]:
        return vllm_env(receives_weights=self.receives_weights, inplace=self.inplace)

    # -- weights ---------------------------------------------------------------------------

    def load(self, url: str, source: Any) -> dict[str, float]:
        from modal_rl.engines.vllm_push import load_version

        return load_version(
            url,
            source,
            key=self.key,
            pull_timeout_s=self.pull_timeout_s,
            inplace=self.inplace,
            hold_requests=self.hold_requests,
        )

    def stage(self, url: str, source: Any) -> dict[str, float]:
        from modal_rl.engines.vllm_push import _rpc, _wait_staged

        url = url.rstrip("/")
        body = pull_request(
            source.host,
            source.port,
            source.version,
            timeout_s=self.pull_timeout_s,
            key=frame_keys(self.key),
            tls=source.tls,
            method=STAGE_METHOD,
            epoch=getattr(source, "epoch", None),
        )
        t0 = time.perf_counter()
        results = _rpc(url, body, source.version, self.key)
        if all(r.get("mode") == "staging" for r in results):
            _wait_staged(url, source.version, self.key, t0 + float(body["timeout"]))
            self._staged[url] = source.version
        else:  # a worker's first pull is a full load: live already
            self._staged.pop(url, None)
        return {"stage_s": time.perf_counter() - t0, "staged": 1.0 if url in self._staged else 0.0}

    def commit(self, url: str, version: int) -> dict[str, float]:
        from modal_rl.engines.vllm_push import EnginePushError, _rpc

        url = url.rstrip("/")
        t0 = time.perf_counter()
        staged = self._staged.pop(url, None)
        if staged is not None:
            if staged != version:
                raise EnginePushError(f"{url}: version {version} is not the staged one (v{staged})")
            switch = {"method": "modal_rl_switch_weights", "args": [version], "timeout": 300.0}
            _rpc(url, switch, version, self.key)
        self.reset_prefix_cache(url, version)
        return {"commit_s": time.perf_counter() - t0}

    # -- serving control -------------------------------------------------------------------

    def pause(self, url: str) -> None:
        self._post(url, "/pause?mode=keep", {})

    def resume(self, url: str) -> None:
        self._post(url, "/resume", {})

    def reset_prefix_cache(self, url: str, version: int | None = None) -> None:
        from modal_rl.engines.vllm_push import _reset_prefix_cache

        _reset_prefix_cache(url.rstrip("/"), version if version is not None else -1, self.key)

    def load_adapter(self, url: str, name: str, path: str) -> None:
        self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, url: str, name: str) -> None:
        self._post(url, "/v1/unload_lora_adapter", {"lora_name": name})

    def _post(self, url: str, path: str, body: dict, timeout_s: float = 60.0) -> Any:
        from modal_rl.engines.vllm_push import _post

        return _post(url.rstrip("/"), path, body, timeout_s, self.key)


class VllmLoraEngine(VllmEngine):
    """A vLLM server with LoRA on, whose weight versions are adapter versions: ``load`` has the
    workers stage version N and vLLM load it as adapter ``<prefix>-vN``, keeping at most
    ``max_resident`` loaded (``engines.lora_push``). ``lora``: ``{"prefix",
    "max_resident", "config"}``. A server seen for the first time (a replacement) starts with
    no adapter. Full-weight staging does not apply: ``stage``/``commit`` are unsupported."""

    name = "vllm-lora"

    def __init__(self, lora: dict[str, Any], **settings: Any) -> None:
        super().__init__(**settings)
        self.lora = dict(lora)
        self._adapters: dict[str, Any] = {}  # url -> that server's resident AdapterVersions

    def load(self, url: str, source: Any) -> dict[str, float]:
        from modal_rl.engines.lora_push import load_adapter_version
        from modal_rl.weightsync.apply.lora import AdapterVersions

        versions = self._adapters.get(url)
        if versions is None:
            versions = AdapterVersions(int(self.lora["max_resident"]), self.lora["prefix"])
            self._adapters[url] = versions
        return load_adapter_version(
            url, source, versions, self.lora["config"], key=self.key, pull_timeout_s=self.pull_timeout_s
        )

    def stage(self, url: str, source: Any) -> dict[str, float]:
        self.unsupported("stage of full weights (its versions are LoRA adapters: use load)")

    def commit(self, url: str, version: int) -> dict[str, float]:
        self.unsupported("commit of full weights (its versions are LoRA adapters: use load)")
