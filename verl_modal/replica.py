"""``modal_vllm``: a verl rollout replica whose vLLM server runs in its own (Modal) container.

``actor_rollout_ref.rollout.name=modal_vllm`` makes verl's ``LLMServerManager`` build these
replicas (registered by the ``verl.plugins`` entry point, ``_replica_register``). They are
standalone replicas only: ``init_standalone`` starts one engine per replica through
``modal_rl.engines.pool`` (its own Modal app and GPU function, or a local process), with a
``vllm serve`` command built from the rollout config, and allocates nothing on the trainer
cluster. A small Ray actor, ``VLLMHttpProxy``, is the replica's server handle: verl's agent
loop calls ``generate`` on it (token ids in, ``TokenOutput`` out, over vLLM's
``/v1/completions``), and the replica's control calls map to vLLM's HTTP endpoints:

    sleep -> POST /sleep?level=1          wake_up -> POST /wake_up[?tags=..]
    abort_all_requests -> POST /pause     resume_generation -> POST /resume
    clear_kv_cache -> POST /reset_prefix_cache
    release_kv_cache -> /sleep + /wake_up?tags=weights; resume_kv_cache -> /wake_up?tags=kv_cache

(sleep and the kv-cache calls only when ``free_cache_engine``, as verl's vLLM server does;
those endpoints need ``VLLM_SERVER_DEV_MODE=1``, which the engine's env sets.)

Auth: the engine runs with ``--middleware modal_rl.engines.auth.RunKeyAuth``, so every
route (dev routes included) needs ``Authorization: Bearer <engine bearer>``; the pool gives the
engine that bearer (derived from the run key, never the run key itself) through its
environment. The proxy reads the run key with ``run_key()`` (the launcher puts it in every Ray
worker's environment: it signs pulls) and sends the derived bearer on every call, only over
https (a Modal TLS tunnel) or to a loopback engine.

The proxy owns the engine (``replica_proxy``): an ``EngineSupervisor`` keeps it serving the
replica's current weights -- a dead or hung engine is replaced, the replacement catches up
from the relay before it takes requests, requests in flight are retried or masked.

Engine settings, first found wins: ``rollout.custom.modal_engines.<key>``, then the env var
``VERL_MODAL_ENGINE_<KEY>``, then the default: ``backend`` (modal | local), ``gpu`` (GPU type;
the count is the replica's TP x DP x PP), ``image``, ``volumes`` ("name:/path,..."),
``startup_timeout_s``, ``server`` (the command before the model; default: on ``local``, this
interpreter's ``python -m vllm.entrypoints.cli.main serve``, so a venv never activated still
starts its own vLLM; on ``modal``, the image's ``vllm serve``),
``weights_timeout_s`` (bound on one weight update), ``weights_expose`` (how the engine reaches
the relay worker's frame server: ``local``, ``modal``, or ``auto`` = the engine backend),
``log_dir`` (local engines: where their logs go; default a temporary directory removed at the
end), ``lora_resident`` (LoRA runs: adapter versions an engine keeps loaded; at least the
run's largest staleness + 1), ``health_interval_s``, ``health_timeout_s`` (one 1-token generation), ``health_failures``
(failed checks in a row that make a live engine lost), ``retry_wait_s`` (how long a request
whose engine died waits for the replacement before it is masked), ``running`` (what a weight
sync does to requests that are generating: ``abort``, verl's own pause and resubmit, or
``recompute``, the commit lands between two decoding steps and they go on; see
``replica_proxy``), ``cpus`` (local engines: the cores the engine's processes run on and vLLM's
CPU backend binds its threads to, e.g. ``"1"`` or ``"2-5"``; default every core. A vLLM engine
on CPU keeps one core busy in its engine loop beside its compute threads, so on a shared host a
trainer beside it is starved while it generates unless the engine stays on cores of its own).

Weights: a policy replica's engine loads ``modal_rl.weightsync.apply.vllm_extension`` and gets each
update from a relay worker on the trainer cluster (``replica_weights``); the run's
checkpoint engine must be ``modal_delta``. Reward and teacher replicas keep their weights.
In a LoRA run (``model.lora_rank > 0``, not merged) the engine serves the model path's base
with vLLM's LoRA on and each update is an adapter version, requested by name
(``verl_modal.lora``, ``modal_rl.weightsync.apply.vllm_lora``).
"""

from __future__ import annotations

import logging
import os
import shlex
import weakref

from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from modal_rl.adapters import extra_requirements
from modal_rl.engines import ENGINES, EngineSpec, get_engine, parse_cpus
from verl_modal.image import engine_image
from verl_modal.replica_proxy import RUNNING, VLLMHttpProxy

log = logging.getLogger("verl_modal")

DEFAULTS = {
    "backend": "modal",
    "gpu": "H100",
    "image": "",  # "": vLLM's server image at the version the installed verl pins (image.engine_image)
    "volumes": "",
    "startup_timeout_s": "1800",
    "server": "",  # "": default_server(backend)
    "weights_timeout_s": "600",
    "weights_expose": "auto",
    "log_dir": "",
    "health_interval_s": "5",
    "health_timeout_s": "60",
    "health_failures": "3",
    "retry_wait_s": "1800",
    "lora_resident": "2",  # LoRA runs: adapter versions kept loaded (>= max staleness + 1)
    "running": "abort",  # what a sync does to generating requests (replica_proxy.RUNNING)
    "cpus": "",  # local engines: their cores ("": every core)
}


def engine_settings(config) -> dict[str, str]:
    custom = dict((getattr(config, "custom", None) or {}).get("modal_engines") or {})
    out = {}
    for key, default in DEFAULTS.items():
        value = custom.get(key, os.environ.get(f"VERL_MODAL_ENGINE_{key.upper()}", default))
        out[key] = str(value)
    if out["backend"] not in ("modal", "local"):
        raise ValueError(f"modal_vllm: engine backend {out['backend']!r}; choose 'modal' or 'local'")
    if not out["server"]:
        out["server"] = default_server(out["backend"])
    if out["running"] not in RUNNING:
        raise ValueError(f"modal_vllm: running {out['running']!r}; choose one of {', '.join(RUNNING)}")
    if out["weights_expose"] == "auto":
        out["weights_expose"] = out["backend"]
    if out["weights_expose"] not in ("modal", "local"):
        raise ValueError(
            f"modal_vllm: weights_expose {out['weights_expose']!r}; choose 'modal', 'local' or 'auto'"
        )
    return out


def default_server(backend: str) -> str:
    """The command before the model: locally this run's own interpreter (never a ``vllm`` looked
    up on PATH, which an unactivated venv does not put there); on Modal the image's ``vllm``."""
    vllm = ENGINES.load("vllm")
    return shlex.join(vllm.LOCAL_SERVER if backend == "local" else vllm.IMAGE_SERVER)


def parse_volumes(text: str) -> dict[str, str]:
    volumes = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, path = item.partition(":")
        if not sep:
            raise ValueError(f"modal_vllm: volume {item!r}: use name:/mount/path")
        volumes[name] = path
    return volumes


def max_model_len(config) -> int:
    return int(config.max_model_len or config.prompt_length + config.response_length)


def vllm_flags(config, trust_remote_code: bool) -> list[str]:
    """The ``vllm serve`` flags of one replica, from verl's rollout config."""
    memory = config.standalone_gpu_memory_utilization or config.gpu_memory_utilization
    flags = ["--tensor-parallel-size", str(config.tensor_model_parallel_size)]
    flags += ["--data-parallel-size", str(config.data_parallel_size)]
    flags += ["--pipeline-parallel-size", str(config.pipeline_model_parallel_size)]
    flags += ["--gpu-memory-utilization", str(memory), "--max-model-len", str(max_model_len(config))]
    flags += ["--max-num-seqs", str(config.max_num_seqs)]
    flags += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    if config.load_format:  # verl's default "dummy": the weights come from the trainer's first sync
        flags += ["--load-format", str(config.load_format)]
    if config.enforce_eager:
        flags.append("--enforce-eager")
    if config.free_cache_engine:
        flags.append("--enable-sleep-mode")
    if trust_remote_code:
        flags.append("--trust-remote-code")
    for key, value in dict((config.engine_kwargs or {}).get("vllm") or {}).items():
        if value is None or value is False:
            continue
        flag = "--" + str(key).replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


class ModalVLLMReplica(RolloutReplica):
    """One vLLM engine per replica, on GPUs of its own; see the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = engine_settings(self.config)
        self.proxy_started = False
        self._engine_url = ""
        if self.nnodes != 1:
            raise ValueError(
                f"modal_vllm: a replica of {self.world_size} GPUs spans {self.nnodes} nodes; one engine "
                "container holds one node's GPUs (lower TP x DP x PP or raise rollout.n_gpus_per_node)"
            )

    @property
    def receives_weights(self) -> bool:
        """Policy replicas follow the trainer; reward and teacher models keep their weights."""
        return not (self.is_reward_model or self.is_teacher_model)

    def _refuse(self, mode: str) -> None:
        raise RuntimeError(
            f"modal_vllm runs engines on GPUs of their own and cannot start in {mode} mode; use a "
            "standalone rollout (actor_rollout_ref.hybrid_engine=False with a separate-rollout trainer)"
        )

    async def init_hybrid(self, worker_group) -> None:
        self._refuse("hybrid")

    async def init_hybrid_colocated(self, worker_group, resource_pool) -> None:
        self._refuse("hybrid")

    async def init_colocated(self, resource_pool) -> None:
        self._refuse("colocated")

    async def init_standalone(self) -> None:
        """No GPUs on the trainer cluster: the engine brings its own; a policy replica gets one
        CPU relay worker there for weight updates."""
        from verl_modal.replica_weights import check_checkpoint_engine, start_relay_worker

        self.rollout_mode = RolloutMode.STANDALONE
        if self.receives_weights:
            check_checkpoint_engine(self.config)  # before an engine is paid for
        await self.launch_servers()
        if self.receives_weights:
            self.workers = await start_relay_worker(self, self.settings["weights_expose"])

    @property
    def model_path(self) -> str:
        return str(self.model_config.path)

    @property
    def served_name(self) -> str:
        return self.model_path  # what /v1/completions' "model" must name

    @property
    def lora(self) -> dict | None:
        """A LoRA run's adapter settings for this replica's engine (None: full weights)."""
        from verl_modal.lora import adapter_settings

        return adapter_settings(self.model_config) if self.receives_weights else None

    def lora_proxy_settings(self) -> dict | None:
        lora = self.lora
        if lora is None:
            return None
        from modal_rl.weightsync.apply.lora import DEFAULT_PREFIX, adapter_config

        config = adapter_config(lora["rank"], lora["alpha"], lora["target_modules"], self.model_path)
        return {
            "prefix": DEFAULT_PREFIX,
            "max_resident": int(self.settings["lora_resident"]),
            "config": config,
        }

    def engine_spec(self) -> EngineSpec:
        engine = get_engine(
            "vllm",
            model=self.model_path,
            key=None,  # the spec carries no key: the pool gives the engine its bearer
            server=shlex.split(self.settings["server"]),
            served_name=self.served_name,  # healthy = answers a 1-token generation of it
            receives_weights=self.receives_weights,
            inplace=self.lora is None,  # a LoRA run's base is never written in place
        )
        flags = vllm_flags(self.config, bool(getattr(self.model_config, "trust_remote_code", False)))
        cpus = parse_cpus(self.settings["cpus"])
        env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))} if cpus else {}
        if self.lora is not None:
            from modal_rl.weightsync.apply.vllm_lora import RUNTIME_LORA_ENV, lora_server_args

            # The base is never synced in a LoRA run: it is the model path's, so load it for real.
            if "--load-format" in flags:
                flags[flags.index("--load-format") + 1] = "auto"
            flags += lora_server_args(int(self.settings["lora_resident"]), self.lora["rank"])
            env.update(RUNTIME_LORA_ENV)
        engine.options = {"dtype": self.config.dtype, "seed": self.config.seed, "flags": flags}
        return engine.spec(
            count=1,
            gpu=f"{self.settings['gpu']}:{self.world_size}",
            image=self.settings["image"] or engine_image(),
            volumes=parse_volumes(self.settings["volumes"]),
            env=env,
            pip=extra_requirements("engine-receiver") if self.receives_weights else (),
            startup_timeout_s=float(self.settings["startup_timeout_s"]),
            name=f"vllm-replica-{self.replica_rank}{self.name_suffix}",
            cpus=cpus,
        )

    def proxy_settings(self) -> dict:
        c = self.config
        return {
            "max_model_len": max_model_len(c),
            "prompt_length": c.prompt_length,
            "response_length": c.response_length,
            "free_cache_engine": bool(c.free_cache_engine),
            "ignore_eos": bool(c.ignore_eos),
        }

    def health_settings(self) -> dict:
        s = self.settings
        return {
            "interval_s": float(s["health_interval_s"]),
            "probe_timeout_s": float(s["health_timeout_s"]),
            "failures": int(s["health_failures"]),
        }

    async def launch_servers(self) -> None:
        import ray

        local = self.settings["backend"] == "local"
        pool_kwargs = {"log_dir": self.settings["log_dir"]} if local and self.settings["log_dir"] else {}
        proxy = (
            ray.remote(VLLMHttpProxy)
            .options(
                name=f"modal_vllm_server_{self.replica_rank}{self.name_suffix}",
                max_concurrency=self.max_concurrency,
                num_cpus=0,
            )
            .remote(
                self.engine_spec().to_dict(),
                self.settings["backend"],
                self.served_name,
                self.proxy_settings(),
                self.replica_rank,
                pool_kwargs=pool_kwargs,
                health=self.health_settings(),
                retry_wait_s=float(self.settings["retry_wait_s"]),
                weights_timeout_s=float(self.settings["weights_timeout_s"]),
                lora=self.lora_proxy_settings(),
                running=self.settings["running"],
            )
        )
        self.servers = [proxy]
        self._server_handle = proxy
        # The actor owns the engine: killing it (a dropped replica) takes local engines along
        # (parent-death signal) and ends the Modal app run it holds.
        self._finalizer = weakref.finalize(self, _kill_quietly, proxy)
        started = await proxy.start.remote()
        if started.get("run_id"):  # local engines: end every process of theirs with this replica
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _kill_quietly, proxy, started["run_id"])
        self.proxy_started = True
        address = started["address"]
        self._engine_url = address  # http://127.0.0.1:port locally, https://... through a tunnel
        self._server_address = address.split("://", 1)[1]  # verl's name for the server: no scheme
        where = f" (logs: {started['log_dir']})" if started["log_dir"] else ""
        print(f"[verl_modal] modal_vllm replica {self.replica_rank}: engine at {address}{where}", flush=True)

    async def engine_pids(self) -> list[int | None]:
        """The engine's local process id(s) (None on Modal): what a chaos test kills."""
        return await self._server_handle.engine_pids.remote()

    async def engine_events(self) -> list[dict]:
        """The supervisor's events (started, lost, replaced, serving, ...), wall-clock ``t``."""
        return await self._server_handle.engine_events.remote()

    async def shutdown(self) -> None:
        """Stop the engine and the proxy (verl has no replica teardown hook; call at the end)."""
        import ray

        for proxy in self.servers:
            try:
                await proxy.close.remote()
            finally:
                ray.kill(proxy)
        for worker in self.workers:
            ray.kill(worker)
        self.servers, self.workers, self._server_handle = [], [], None
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()  # ends what close() did not (local engines' forked cores), once


def _kill_quietly(actor, engine_run_id: str | None = None) -> None:
    import contextlib

    import ray

    from modal_rl.cluster import procs

    if engine_run_id:
        procs.end_run(engine_run_id, grace_s=2.0)

    if ray.is_initialized():  # never start a Ray instance just to kill an actor of a gone one
        with contextlib.suppress(Exception):
            ray.kill(actor)
