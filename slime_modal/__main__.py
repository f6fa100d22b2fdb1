"""``python -m slime_modal [cluster flags] -- <train.py args>``: run a slime job on a cluster.

Everything after ``--`` is slime's command line, the one that follows ``python3 train.py`` in
a ``ray job submit`` script; it reaches slime byte for byte (one documented addition: the
Volume weight-sync hooks, see ``launch.with_volume_hooks``). Before ``--``: the cluster flags
of ``modal_rl.cluster`` (``--backend --nodes --gpu --volume --env --dry-run`` ...) and:

- ``--entry`` (``train.py``; ``train_async.py`` or any script; relative to ``--slime-path``);
- ``--slime-path`` / ``--megatron-path``: the checkouts in the image (slime's image layout);
- ``--hf-cache-volume`` / ``--data-volume`` / ``--ckpt-volume`` ``NAME[:PATH]``: Modal Volumes
  for the Hugging Face cache (default on Modal: ``slime-hf-cache``), data and checkpoints;
- ``--rollout-engines modal:N[:GPU]``: N SGLang engines as their own Modal function, started
  before the job; they need the run's key, which slime cannot send, so the job runs through
  ``slime_modal.engine_job`` and slime gets its key forwarders as ``--rollout-external-engine-addrs``;
  on the local backend with a slime that has ``--rollout-manager-path`` (``patches/slime/0004``),
  slime's rollout actor is our ``RolloutManager`` subclass, which starts and owns them instead
  (``slime_modal.manager_seam``).

Exit status: 0 when the job finished (or the dry run / preflight passed), 2 for bad flags,
missing Modal credentials or a slime command line that cannot run on the cluster (one line
per problem on stderr, before anything starts; see ``preflight.py``), 130 on Ctrl-C,
otherwise the job's own exit code (1 for a launcher failure: one line, ``--debug`` adds the
traceback; see ``modal_rl.cli_errors``).
"""

from __future__ import annotations

import argparse
import sys


def _named_volume(default_path: str):
    def parse(text: str) -> tuple[str, str] | bool:
        if text.lower() == "none":
            return False  # off on purpose (None: not given)
        name, _, path = text.partition(":")
        if not name:
            raise argparse.ArgumentTypeError(f"{text!r}: expected NAME or NAME:/mount/path")
        return name, path or default_path

    return parse


def build_parser() -> argparse.ArgumentParser:
    from modal_rl.cli_errors import OneLineParser, add_debug_flag
    from modal_rl.cluster import ClusterSpec, add_cluster_args
    from slime_modal import launch as L
    from slime_modal import upstream

    parser = OneLineParser(
        prog="python -m slime_modal",
        usage="%(prog)s [flags] -- [slime's train.py arguments, e.g. --actor-num-nodes 1 ...]",
        description=__doc__.split("\n")[0],
        epilog="Everything after `--` is slime's command line (what follows `python3 train.py`), passed "
        "on unchanged; see docs/quickstart-slime.md.",
    )
    add_cluster_args(parser, defaults=ClusterSpec(nodes=1))
    add_debug_flag(parser)
    g = parser.add_argument_group("slime")
    g.add_argument(
        "--entry",
        default=None,
        help="script to run; relative paths are in --slime-path (default train.py, or train_async.py "
        "when the line names slime's fully-async rollout)",
    )
    g.add_argument("--slime-path", default=L.SLIME_PATH, help="slime checkout in the image")
    g.add_argument("--megatron-path", default=L.MEGATRON_PATH, help="Megatron-LM checkout in the image")
    g.add_argument(
        "--hf-cache-volume",
        type=_named_volume(L.HF_CACHE_PATH),
        metavar="NAME[:PATH]",
        help=f"Volume for the HF cache at {L.HF_CACHE_PATH} (Modal default {L.HF_CACHE_VOLUME}; 'none': off)",
    )
    g.add_argument("--data-volume", type=_named_volume(L.DATA_PATH), metavar="NAME[:PATH]")
    g.add_argument("--ckpt-volume", type=_named_volume(L.CKPT_PATH), metavar="NAME[:PATH]")
    g.add_argument(
        "--rollout-engines",
        metavar="modal:N[:TYPE[:COUNT]]",
        help="N SGLang engines as their own Modal function, e.g. modal:4 or modal:4:H100 or modal:4:H100:2; "
        "GPU TYPE default H100, COUNT per engine default (and must equal) --rollout-num-gpus-per-engine",
    )
    g.add_argument(
        "--cpu",
        action="store_true",
        help="--backend local on a host without GPUs: SGLang and Megatron on the CPU through "
        "slime_modal.cpu's boundary (docs/quickstart-slime.md)",
    )
    upstream.add_args(g)  # --no-slime-patches
    return parser


def _fail(message: str) -> int:
    print(f"slime_modal: {message}", file=sys.stderr)
    return 2


def _volumes(args: argparse.Namespace) -> list[tuple[str, str]]:
    from slime_modal import launch as L

    hf = args.hf_cache_volume
    if hf is None and args.backend == "modal":
        hf = (L.HF_CACHE_VOLUME, L.HF_CACHE_PATH)
    return [v for v in (hf, args.data_volume, args.ckpt_volume) if v] + list(args.volume)


def main(argv: list[str] | None = None) -> int:
    from modal_rl.cli_errors import run_main

    return run_main("slime_modal", _main, argv)


def _main(argv: list[str]) -> int:
    from modal_rl.cluster import ClusterSpecError, run_job, spec_from_args, split_passthrough
    from modal_rl.cluster.cli import run_options
    from modal_rl.run_key import ensure_run_key
    from slime_modal import engines as E
    from slime_modal import launch as L
    from slime_modal import manager_seam as seam
    from slime_modal import preflight as pf
    from slime_modal import upstream
    from slime_modal.async_numbers import ENTRY_ENV

    # First: the run key (contract 1) for this process and all it starts, engines included.
    ensure_run_key()
    ours, slime_argv = split_passthrough(argv)
    parser = build_parser()
    args = parser.parse_args(ours)
    args.volume = _volumes(args)
    from slime_modal import examples as X

    try:  # a line pasted with its `python3 train_async.py` head names the entry itself
        slime_argv, args.entry = X.split_script(slime_argv, args.entry)
    except ValueError as exc:
        return _fail(str(exc))
    engines = None
    try:
        if args.rollout_engines:
            engines = E.parse_engines(args.rollout_engines)
        extra = {"image": L.SLIME_IMAGE} if args.backend == "modal" and not args.image else {}
        if args.cpu and args.backend == "local":
            extra |= L.cpu_cluster(slime_argv, engines is not None, gpu_given=bool(args.gpu))
        spec = spec_from_args(args, **extra)
        if args.backend == "modal":
            from modal_rl.cluster.backend_modal import validate_for_modal

            validate_for_modal(spec)
    except (ValueError, ClusterSpecError) as exc:
        return _fail(str(exc))
    if args.cpu and args.backend != "local":
        return _fail("--cpu runs on this machine only: use it with --backend local")

    ours_flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    for warning in pf.launcher_flag_warnings(slime_argv, ours_flags - {"--help"}):
        print(f"slime_modal: {warning}", file=sys.stderr)

    # The local backend mounts no Volumes (it accepts and ignores them): nothing to commit there.
    volumes = spec.volumes if args.backend == "modal" else {}
    mounts = list(volumes.values())
    shipped = []
    if args.backend == "modal":
        from modal_rl.cluster.local_inputs import LocalInputError

        try:
            shipped = pf.local_inputs(slime_argv, mounts, [args.slime_path, args.megatron_path])
        except LocalInputError as exc:
            return _fail(str(exc))
    need, problems = pf.check(
        slime_argv,
        backend=args.backend,
        cluster_gpus=spec.nodes * spec.gpus_per_node,
        mounts=mounts,
        image_roots=[args.slime_path, args.megatron_path],
        external_engines=engines is not None,
        shipped=[item.path for item in shipped],
    )
    entry_name, entry_note = X.entry_for(slime_argv, args.entry)
    if entry_note:
        print(f"slime_modal: {entry_note}", file=sys.stderr)
    entry = L.entry_path(entry_name, args.slime_path)
    if args.backend == "modal":
        problems += X.loopback_servers(slime_argv)
    example_paths = X.example_dirs(slime_argv, args.slime_path)
    if args.backend == "local":
        import os

        if not os.path.isfile(entry):
            problems.insert(0, f"--entry {entry}: no such file (set --slime-path to a slime checkout)")
    problems += upstream.problems(args, slime_argv)
    if problems:
        for problem in problems:
            print(f"slime_modal: {problem}", file=sys.stderr)
        return 2
    if args.backend == "modal" and not (args.dry_run or args.preflight_only):
        from modal_rl.modal_check import check_modal_access

        check_modal_access()  # after the preflight (a second, no slime import), before any Modal call
    # The image is never inspected here: a dry run's plan says what it must hold, a run says it once.
    image_note = (
        L.image_note(spec.image, args.slime_path, args.megatron_path) if args.backend == "modal" else None
    )
    if image_note and not (args.dry_run or args.preflight_only):
        print(f"slime_modal: {image_note}", file=sys.stderr)
    job_argv, hooks = L.with_volume_hooks(slime_argv, mounts)
    job_argv, grouped = L.with_reward_groups(job_argv)
    hooks += grouped
    runtime_env = L.runtime_env(
        spec.env, args.slime_path, args.megatron_path, volumes, args.backend, extra_paths=example_paths
    )
    if args.cpu:
        L.with_cpu_mode(runtime_env, spec.env)
    if ENTRY_ENV not in spec.env:  # the rollout's staleness numbers follow the entry's loop
        runtime_env["env_vars"][ENTRY_ENV] = entry.rsplit("/", 1)[-1]
    # The engines get slime's argv with our hooks: the pre-read hook is an SGLang server flag.
    engine_opts = {
        "image": spec.image,  # the cluster's image: slime's carries SGLang and slime's patches
        "volumes": volumes,
        "env": {k: v for k, v in runtime_env["env_vars"].items() if k == L.VOLUMES_ENV},
    }
    # The series (patches/slime) as extra build steps of both images (Modal only).
    steps = upstream.image_steps(args)
    try:
        engines_plan = E.describe(engines, job_argv, **engine_opts) if engines is not None else None
        # With slime's rollout-manager seam, slime's rollout actor (our subclass) owns the engines.
        owned_by_manager = seam.uses_manager(args.slime_path, args.backend, engines)
        if owned_by_manager:
            runtime_env["env_vars"].update(seam.manager_env(engines, job_argv, args.backend, **engine_opts))
            with_manager = seam.manager_argv(job_argv)
            added = with_manager[len(job_argv) :]
            hooks, job_argv = hooks + added, with_manager
            # No job wrapper and no launcher forwarder: the rollout actor holds both.
            engines_plan |= {"owner": seam.MANAGER_PATH, "job_command": None, "slime_args": added}
    except ValueError as exc:
        return _fail(str(exc))
    slime_plan = {
        "entry": entry,
        "example_paths": example_paths,
        "argv": job_argv,
        "added_argv": hooks,
        "address_env": L.address_env(spec.env),
        "gpus": {"required": need.total, "why": need.why},
    }

    def submit(engine_urls: list[str] | None = None) -> int:
        command = [sys.executable if args.backend == "local" else "python3", entry, *job_argv]
        if engine_urls:  # slime cannot send the engines' key: it reaches them through our forwarder
            command = E.forwarded_job_command(command, engine_urls)
        return run_job(
            spec,
            command,
            runtime_env,
            backend=args.backend,
            framework_argv=slime_argv,
            address_env=L.address_env(spec.env),
            local_files=shipped,
            image_steps=steps,
            plan_extra={
                "slime": slime_plan,
                "rollout_engines": engines_plan,
                "slime_patches": upstream.plan(args),
                "rollout_manager": seam.plan(args.slime_path, args.backend, engines),
                "image_note": image_note,
            },
            **run_options(args),
        )

    if args.dry_run or args.preflight_only:
        return submit()

    def launch() -> int:
        if engines is None or owned_by_manager:
            return submit()
        # The engines live exactly as long as the job: stopped on exit, failure or Ctrl-C.
        from modal_rl.engines import EngineStartError

        try:
            pool = {"pool_kwargs": {"image_steps": steps}} if steps else {}
            with E.running_engines(
                engines, job_argv, backend=args.backend, **engine_opts, **pool
            ) as addresses:
                print(
                    f"slime_modal: {len(addresses)} rollout engine(s) up: {' '.join(addresses)}",
                    file=sys.stderr,
                )
                return submit(addresses)
        except EngineStartError as exc:
            print(f"slime_modal: {exc}", file=sys.stderr)
            return 1

    # The report's facts (command, git, versions, then wall time and exit status) in run.json.
    from slime_modal import run_report

    launcher = {"backend": args.backend, "nodes": spec.nodes, "gpu": args.gpu, "entry": entry}
    launcher["rollout_engines"] = args.rollout_engines
    folder = run_report.run_folder(spec.env, args.backend)
    command = [sys.executable, "-m", "slime_modal", *argv]
    return run_report.record(folder, slime_argv, launcher, launch, command)


if __name__ == "__main__":
    sys.exit(main())
