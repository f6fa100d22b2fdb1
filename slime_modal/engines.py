"""slime's rollout engines on their own machines: ``--rollout-engines modal:N[:GPU]``.

The launcher parses the flag with ``parse_engines``, prints ``describe`` in its dry-run plan,
and wraps the training job in ``running_engines``; the addresses it yields go to slime as
``external_engine_args(addresses)``, i.e. slime's ``--rollout-external-engine-addrs`` (nargs
"+", ``host:port`` or ``http://host:port``). slime then treats them as pre-launched external
SGLang engines: it reads ``/server_info`` and checks the fields it would have set itself.

The engine command line is derived from slime's own flags, so the engines match what slime
would have launched: ``--hf-checkpoint`` (model), ``--rollout-num-gpus-per-engine`` and
``--sglang-pp-size`` (tensor/pipeline parallel sizes), ``--offload``/``--offload-rollout``
(memory saver, which slime checks on external engines), ``--fp16``, ``--use-rollout-routing-
replay``, and every other ``--sglang-<flag>`` passed through as SGLang's ``--<flag>``. Each
engine's GPU count is its tensor x pipeline size; a GPU count in the flag must agree.

Engine auth (the run's key, ``MODAL_RL_RUN_KEY``): each engine runs SGLang through
``modal_rl.engines.keyed_launch``, which adds ``--api-key <key> --admin-api-key <key>`` inside
the process, so the key is never on a command line; SGLang then refuses every route without
``Authorization: Bearer <key>`` except its ``/health*``, ``/ready*`` and ``/metrics*``. Both
keys are the run key: our forwarder is the engines' only client and SGLang accepts only the
admin key on admin routes and only the API key elsewhere, so one key keeps one header valid on
every route without a per-route table that changes with SGLang's versions. slime cannot send a
key, so the job runs through ``slime_modal.engine_job``, whose key forwarder is what slime gets
as ``--rollout-external-engine-addrs`` (:func:`forwarded_job_command`).

Weight paths: the engines' guard lets ``/update_weights_from_disk`` and ``/pull_weights`` name
only paths under ``--hf-checkpoint``, ``--update-weight-disk-dir`` and (to pull into)
``--update-weight-local-checkpoint-dir`` (:func:`weight_dirs`, in each engine's environment;
``modal_rl.engines.sglang_paths``).

Health: an engine counts as up when it answers a keyed 1-token ``/generate`` (not only
``/health``); during the run a replaced-engines supervisor checks its process and ``/health``
(slime pauses engines around weight updates, and a paused engine holds a generation).

Replacement (``replacement_problem`` says when it is off): with slime's disk weight path
(``--update-weight-transport disk``, full or delta) on the local backend, the engines run
under an ``EngineSupervisor``. A dead or hung engine is lost; its slot's forwarder port stops
taking traffic at once (slime's requests to it are held, not failed); the same spec is
started again and brought to slime's newest published version through slime's own weight
path (:func:`sglang_engine`'s ``catch_up``: ``/pull_weights`` into ``--update-weight-local-checkpoint-dir`` then
``/update_weights_from_disk``, as slime's own reload does, or the full version directory
when there is no local checkpoint dir); only then does the forwarder route the slot to it.
The routes reach the job's key forwarder through a routes file (``--routes``, JSON, written
atomically) in the launcher's run temp dir, which a job on the same host reads. With NCCL
transport a replacement cannot join the groups slime opened once, and on Modal the job's
forwarder cannot see the launcher's file: there engines are health-checked, not replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from modal_rl.cluster.spec import ClusterSpecError, GpuSpec
from modal_rl.engines import ENGINES, EngineSpec, WeightDirs, engine_key, get_engine, get_engine_pool
from slime_modal.preflight import SlimeArgs

SGLANG = ENGINES.load("sglang")  # the SGLang driver: its launcher, key flags and port
KEY_FLAGS = SGLANG.KEY_FLAGS
SERVER = SGLANG.SERVER
SGLANG_PORT = SGLANG.port
DEFAULT_GPU = "H100"
DEFAULT_IMAGE = "slimerl/slime:latest"
ENGINE_JOB = "slime_modal.engine_job"
# slime sets these itself for an external engine, or they are per-engine: never passed through.
_NOT_PASSED = {"--sglang-router-ip", "--sglang-router-port", "--sglang-server-concurrency", "--sglang-config"}


@dataclass(frozen=True)
class EnginesRequest:
    """``modal:N[:TYPE[:COUNT]]``: N engines of ``gpu_type``; ``gpu_count`` None = from slime's flags."""

    count: int
    gpu_type: str
    gpu_count: int | None = None

    def __str__(self) -> str:
        gpu = self.gpu_type + (f":{self.gpu_count}" if self.gpu_count else "")
        return f"modal:{self.count}:{gpu}"


def parse_engines(text: str) -> EnginesRequest:
    """``modal:4`` / ``modal:4:H100`` / ``modal:2:H100:2``; ValueError says what is wrong."""
    parts = str(text).split(":")
    usage = "use modal:N[:GPU], e.g. modal:4 or modal:4:H100 or modal:2:H100:2"
    if parts[0] != "modal" or not 2 <= len(parts) <= 4 or "" in parts:
        raise ValueError(f"--rollout-engines {text!r}: {usage}")
    try:
        count = int(parts[1])
    except ValueError:
        raise ValueError(
            f"--rollout-engines {text!r}: engine count {parts[1]!r} is not an integer; {usage}"
        ) from None
    if count < 1:
        raise ValueError(f"--rollout-engines {text!r}: need at least one engine")
    gpu_text = ":".join(parts[2:]) or DEFAULT_GPU
    try:
        gpu = GpuSpec.parse(gpu_text)
    except ClusterSpecError as exc:
        raise ValueError(f"--rollout-engines {text!r}: {exc}") from None
    return EnginesRequest(count, gpu.type, gpu.count if len(parts) == 4 else None)


def _sglang_passthrough(argv: list[str]) -> list[str]:
    """``--sglang-foo[ v...]`` -> ``--foo[ v...]``, values being the following non-flag tokens."""
    out: list[str] = []
    taking = False
    for arg in argv:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            taking = name.startswith("--sglang-") and name not in _NOT_PASSED and name != "--sglang-pp-size"
            if taking:
                out.append("--" + arg[len("--sglang-") :])
        elif taking:
            out.append(arg)
    return out


def sglang_server(slime_argv: list[str], server: tuple[str, ...] = SERVER) -> tuple[Any, int]:
    """(the SGLang engine slime would have launched, GPUs per engine), from slime's flags."""
    argv = list(slime_argv)
    args = SlimeArgs(argv)
    model = args.get("--hf-checkpoint")
    if not model:
        raise ValueError("--rollout-engines needs --hf-checkpoint: the engines load the model from it")
    if "--colocate" in argv:
        raise ValueError("--rollout-engines puts engines on their own GPUs; it contradicts --colocate")
    for flag in KEY_FLAGS:
        if args.has("--sglang-" + flag[2:]):
            raise ValueError(
                f"--sglang-{flag[2:]}: the engines take the run's key (MODAL_RL_RUN_KEY); drop the flag"
            )
    if args.int("--sglang-tokenizer-worker-num", 1) > 1:
        raise ValueError(
            "--sglang-tokenizer-worker-num > 1: SGLang refuses API keys in multi-tokenizer mode, and "
            "the engines need the run's key; drop the flag"
        )
    if args.has("--rollout-external-engine-addrs"):
        raise ValueError(
            "--rollout-engines sets --rollout-external-engine-addrs itself; pass one or the other"
        )
    gpus = args.int("--rollout-num-gpus-per-engine", 1)
    pp = args.int("--sglang-pp-size", 1)
    if gpus < 1 or pp < 1 or gpus % pp:
        raise ValueError(
            f"--rollout-num-gpus-per-engine {gpus} must be a positive multiple of --sglang-pp-size {pp}"
        )
    flags = []
    offload = ("--offload" in argv or "--offload-rollout" in argv) and "--no-offload-rollout" not in argv
    if offload:
        flags.append("--enable-memory-saver")  # slime checks this field on external engines
    if "--fp16" in argv:
        flags += ["--dtype", "float16"]
    if "--use-rollout-routing-replay" in argv:
        flags.append("--enable-return-routed-experts")
    flags += _sglang_passthrough(argv)
    return get_engine("sglang", model=model, server=server, tp=gpus // pp, pp=pp, flags=flags), gpus


def engine_spec(
    request: EnginesRequest,
    slime_argv: list[str],
    *,
    image: str | None = None,
    volumes: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 1800.0,
    server: tuple[str, ...] = SERVER,
) -> EngineSpec:
    engine, gpus = sglang_server(slime_argv, server)
    if request.gpu_count is not None and request.gpu_count != gpus:
        raise ValueError(
            f"--rollout-engines {request}: {request.gpu_count} GPUs per engine, but "
            f"--rollout-num-gpus-per-engine is {gpus}; make them agree"
        )
    return engine.spec(
        count=request.count,
        gpu=f"{request.gpu_type}:{gpus}",
        image=image or DEFAULT_IMAGE,
        volumes=volumes or {},
        env={**weight_dirs(slime_argv).env(), **(env or {})},
        startup_timeout_s=startup_timeout_s,
        name="sglang-engine",
        pulls_frames=False,  # slime moves SGLang's weights itself: no frame-read key
    )


def weight_dirs(slime_argv: list[str]) -> WeightDirs:
    """Where slime's engines may load weights from (their guard refuses every other path on
    ``/update_weights_from_disk`` and ``/pull_weights``): ``--hf-checkpoint``,
    ``--update-weight-disk-dir``, and ``--update-weight-local-checkpoint-dir`` to pull into."""
    path = WeightPath.from_argv(slime_argv)
    for flag, value in (
        ("--update-weight-disk-dir", path.disk_dir),
        ("--update-weight-local-checkpoint-dir", path.local_checkpoint_dir),
    ):
        if value and not os.path.isabs(value):
            raise ValueError(
                f"{flag} {value!r}: give an absolute path (the engines load weights only from "
                "absolute paths under it, and their working directory is not the trainer's)"
            )
    model = SlimeArgs(slime_argv).get("--hf-checkpoint")
    return WeightDirs.of(model, load=[path.disk_dir], pull=[path.local_checkpoint_dir])


def describe(spec: EnginesRequest, slime_argv: list[str], **opts: Any) -> dict[str, Any]:
    """The engines' part of the dry-run plan (touches nothing)."""
    engines = engine_spec(spec, slime_argv, **opts)
    return {
        "rollout_engines": str(spec),
        "count": engines.count,
        "gpu_per_engine": engines.gpu,
        "image": engines.image,
        "command": engines.argv("0.0.0.0", engines.port),
        "health": engines.health_path,
        "auth": {
            "engine_key": "the engine bearer (derived from the run key; engines never hold the run key): "
            "SGLang --api-key and --admin-api-key, added in-process by modal_rl.engines.keyed_launch "
            "from MODAL_RL_ENGINE_BEARER (never on a command line)",
            "key_required": "only GET /health without the bearer; with it, the generation, status and our weight routes (modal_rl.engines.sglang_routes), every other route refused",
            "weight_dirs": "the weight routes name only paths under these (modal_rl.engines.sglang_paths): "
            + json.dumps(dataclasses.asdict(weight_dirs(slime_argv))),
            "tunnel": "Modal: TLS (modal.forward(port), https:// address); local: 127.0.0.1",
            "forwarder": "modal_rl.engines.key_forwarder on the job's driver (rank 0): 127.0.0.1 on one "
            "node, else the node's cluster address admitting only cluster nodes; adds "
            "Authorization: Bearer <engine bearer>",
        },
        "job_command": forwarded_job_command(
            ["python3", "<entry>", "<slime args>"], [f"<engine {i} url>" for i in range(engines.count)]
        ),
        "slime_args": ["--rollout-external-engine-addrs", "<forwarder http://host:port per engine>"],
    }


@dataclass(frozen=True)
class WeightPath:
    """How slime brings its engines to a new version, from its flags: what a replacement
    engine must go through to catch up."""

    transport: str
    disk_dir: str | None
    local_checkpoint_dir: str | None

    @classmethod
    def from_argv(cls, slime_argv: list[str]) -> WeightPath:
        args = SlimeArgs(slime_argv)
        return cls(
            args.get("--update-weight-transport") or "nccl",
            args.get("--update-weight-disk-dir"),
            args.get("--update-weight-local-checkpoint-dir"),
        )


def replacement_problem(slime_argv: list[str], backend: str) -> str | None:
    """Why dead engines cannot be replaced in this run (None: they are)."""
    path = WeightPath.from_argv(slime_argv)
    if path.transport != "disk" or not path.disk_dir:
        return (
            "slime pushes weights to its engines over NCCL groups it opens once, which a replacement "
            "cannot join; with --update-weight-transport disk and --update-weight-disk-dir they are replaced"
        )
    if backend != "local":
        return "on Modal the job's key forwarder cannot read the launcher's routes file (local backend only)"
    return None


def sglang_engine(path: WeightPath, key: str | None, timeout_s: float = 600.0):
    """The SGLang driver whose ``catch_up`` brings a new engine to slime's newest complete
    version under ``path.disk_dir``, the way slime's own reload does (version 0, none published
    yet, is the engine's own ``--model-path``: nothing to load)."""
    from slime_modal.weight_hooks import newest_version, version_dir  # weightsync: a heavy import

    def newest() -> tuple[int, str | None]:
        version = newest_version(path.disk_dir)
        return version, str(version_dir(path.disk_dir, version)) if version > 0 else None

    reload = SGLANG.DiskReload(newest, path.disk_dir, path.local_checkpoint_dir)
    return get_engine("sglang", key=key, reload=reload, timeout_s=timeout_s)


class EngineAddresses(list):
    """The engines' addresses, plus ``routes``: the file the job's forwarder follows (or None)."""

    routes: str | None = None
    supervisor = None


class _RoutesFile:
    """``{"upstreams": [...]}`` written atomically on every change (the forwarder polls it)."""

    def __init__(self, path: Path, upstreams: list[str]):
        self.path, self.upstreams, self._lock = path, list(upstreams), threading.Lock()
        self._write()

    def route(self, index: int, url: str | None) -> None:
        with self._lock:
            self.upstreams[index] = url
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"upstreams": self.upstreams}))
        os.replace(tmp, self.path)


@contextlib.contextmanager
def running_engines(
    spec: EnginesRequest, slime_argv: list[str], backend: str = "modal", **opts: Any
) -> Iterator[list[str]]:
    """Start the engines, yield their ``http://host:port`` addresses (an ``EngineAddresses``),
    stop them on any exit. Where :func:`replacement_problem` is None the engines are
    supervised and replaced (module docstring); ``health`` tunes the supervisor."""
    pool_kwargs = opts.pop("pool_kwargs", {})
    health = opts.pop("health", {})
    engines = engine_spec(spec, slime_argv, **opts)
    pool = get_engine_pool(engines, backend, **pool_kwargs)
    if replacement_problem(slime_argv, backend) is not None:
        with pool as addresses:
            yield EngineAddresses(addresses)
        return
    from modal_rl import run_temp
    from modal_rl.engines import EngineSupervisor

    weights = WeightPath.from_argv(slime_argv)
    temp = run_temp.make("routes-")
    try:
        routes: list[_RoutesFile] = []
        supervisor = EngineSupervisor(
            pool,
            sglang_engine(weights, engine_key(engines)),
            on_route=lambda index, url: routes[0].route(index, url),
            **health,
        )
        # slime pauses its engines around each weight update without telling us; a paused
        # SGLang holds a 1-token probe, which would make a healthy engine look hung. So the
        # checks are the process and GET /health (``paused``), never a generation.
        supervisor.paused = True
        with supervisor:
            addresses = EngineAddresses(url for url in supervisor.pool.addresses)
            routes.append(_RoutesFile(temp / "routes.json", list(addresses)))
            addresses.routes, addresses.supervisor = str(routes[0].path), supervisor
            yield addresses
    finally:
        run_temp.remove(temp)


def _forwarder_routes(engine_urls: list[str]) -> list[str]:
    routes = getattr(engine_urls, "routes", None)
    return ["--routes", routes] if routes else []


def forwarded_job_command(command: list[str], engine_urls: list[str]) -> list[str]:
    """``[python, ENTRY, *ARGS]`` -> the same job through :mod:`slime_modal.engine_job`, which puts
    a key forwarder before each engine and gives slime the forwarders' addresses."""
    if not engine_urls:
        raise ValueError("forwarded_job_command: no engine addresses")
    python, entry, *args = command
    engines = [token for url in engine_urls for token in ("--engine", url)]
    return [python, "-m", ENGINE_JOB, *engines, *_forwarder_routes(engine_urls), "--", entry, *args]


def external_engine_args(addresses: list[str]) -> list[str]:
    """slime's flag for pre-launched engines: one flag, every address after it (nargs "+")."""
    if not addresses:
        raise ValueError("external_engine_args: no engine addresses")
    for address in addresses:
        parsed = urlparse(address)
        if (
            parsed.scheme != "http"
            or not parsed.hostname
            or parsed.port is None
            or parsed.path not in ("", "/")
        ):
            raise ValueError(f"engine address {address!r}: slime needs http://host:port")
    return ["--rollout-external-engine-addrs", *addresses]
