"""verl on a ``modal_rl.cluster`` cluster: the job we hand the cluster, and the job's driver.

Two halves of one launch:

- on the launching machine, :func:`cluster_job` turns a composed verl command line into the
  ``(entrypoint, runtime_env)`` the cluster layer runs as its Ray job (``run_job``); the
  container image is :mod:`verl_modal.image`'s;
- on the cluster's rank 0, ``python -m verl_modal.launch [--cpu] -- <overrides>`` is that
  job's driver (:func:`job_main`): it composes verl's ``ppo_trainer`` again from the same
  overrides, attaches to the running cluster and calls verl's ``run_ppo`` with our TaskRunner,
  in the run folder the launcher named (``modal_rl.cluster.run_folder``: on Modal, a Volume),
  where it leaves metrics.jsonl and the run report.

Invariants:
- The overrides the driver gets are the complete, already preflighted list (cluster layer,
  CPU layers, workload, user) in Hydra order, so the driver's config is the one that passed.
- Every env var our pieces need is in the job's runtime env explicitly (verl's runtime env
  drops keys the driver has set; see ``runner.runtime_env_for``); the resource-pool wait
  (:data:`verl_modal.pools.WAIT_ENV`) is the cluster's join timeout, and the pools' placement
  on ranks (:data:`verl_modal.pools.PLACEMENT_ENV`) is the launcher's plan.
"""

from __future__ import annotations

import sys


def cluster_job(
    overrides: list[str],
    *,
    cpu: bool,
    join_timeout_s: float,
    python: str = "python",
    placement: dict[str, list[int]] | None = None,
    entry=None,
) -> tuple[list[str], dict]:
    """``(entrypoint, runtime_env)`` of the Ray job that runs verl on the cluster: verl's PPO
    main through our driver (with the line's config name when it is not ``ppo_trainer``), or
    another of verl's mains as itself with the line's own config flags (``entry.VerlEntry``)."""
    import json

    from verl_modal.pools import PLACEMENT_ENV, WAIT_ENV

    if entry is not None and not entry.ours:
        from verl_modal.preflight import searchpath_overrides

        # the config's own search path may name a verl checkout the job does not run in
        found = searchpath_overrides(entry.config_dir, entry.config_name, overrides)
        entrypoint = [python, "-m", entry.module, *entry.config_args, *overrides, *found]
    else:
        named = entry is not None and entry.config_name != "ppo_trainer"
        flags = (["--cpu"] if cpu else []) + (["--config-name", entry.config_name] if named else [])
        entrypoint = [python, "-m", "verl_modal.launch", *flags, "--", *overrides]
    env = {WAIT_ENV: f"{join_timeout_s:g}"}
    if placement:
        env[PLACEMENT_ENV] = json.dumps(placement, sort_keys=True)
    if cpu:
        from verl_modal.cpu.overrides import worker_env

        env.update(worker_env())
    return entrypoint, {"env_vars": env}


# Keys of verl's config whose value names a file or directory the job reads (the last
# component of the key; ``data.train_files``, ``actor_rollout_ref.model.path``,
# ``reward.custom_reward_function.path``, ``...multi_turn.tool_config_path``, ...). Outputs
# (``trainer.default_local_dir``, profiler ``save_path``) are not inputs.
INPUT_KEY_ENDINGS = (
    "train_files",
    "val_files",
    "path",
    "tokenizer_path",
    "hf_config_path",
    "adapter_path",
    "lora_adapter_path",
    "model_path",
    "tool_config_path",
    "interaction_config_path",
    "agent_loop_config_path",
    "function_tool_path",
    "router_config_path",
    "quantization_config_path",
    "quantization_config_file",
    "resume_from_path",
)


def local_input_candidates(user_overrides: list[str]) -> list[tuple[str, str]]:
    """``(key, path)`` for every path the user's overrides give to an input key of verl's
    config; ``modal_rl.cluster.local_inputs.collect`` keeps those that exist here."""
    from modal_rl.cluster.local_inputs import hydra_values
    from verl_modal.preflight import explicit_values

    out = []
    for key, value in explicit_values(user_overrides).items():
        if key.rsplit(".", 1)[-1] in INPUT_KEY_ENDINGS:
            out += [(key, path) for path in hydra_values(value)]
    return out


def plan_text(plan: dict, *, as_json: bool) -> str:
    """A dry run's plan as printed: the whole JSON, or the summary, where the verl section's
    overrides are a count (they are the job's command line, already shown once)."""
    import json

    if as_json:
        return json.dumps(plan, indent=2, default=str) + "\n"
    from modal_rl.cluster.summary import render

    verl = dict(plan.get("verl") or {})
    verl["overrides"] = f"{len(verl.get('overrides') or [])} (--json lists them)"
    return render({**plan, "verl": verl})


def job_main(argv: list[str] | None = None) -> int:
    """The Ray job's driver on rank 0: compose, attach to the cluster, ``run_ppo``."""
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    flags, overrides = argv[:cut], argv[cut + 1 :]
    if {"-h", "--help"} & set(flags):
        print(
            "usage: python -m verl_modal.launch [--cpu] [--config-name NAME] -- <verl overrides>\n\n"
            "The Ray job's driver on a cluster's rank 0 (python -m verl_modal starts it there):\n"
            "composes verl's ppo_trainer from the overrides, attaches to the running cluster\n"
            "and runs verl's run_ppo.\n\n  --cpu  the CPU-only variant (gloo, the cpu platform)"
        )
        return 0
    config_name = "ppo_trainer"
    if "--config-name" in flags:  # one of verl's trainer configs, e.g. ppo_megatron_trainer
        at = flags.index("--config-name")
        config_name = flags[at + 1] if at + 1 < len(flags) else ""
        flags = flags[:at] + flags[at + 2 :]
    unknown = [f for f in flags if f != "--cpu"]
    if unknown or not config_name:
        print(f"verl_modal.launch: unknown flags {unknown or ['--config-name']}", file=sys.stderr)
        return 2
    cpu = "--cpu" in flags

    from verl_modal.runner import attach_ray, prepare_process_env, run

    env: dict[str, str] = {}
    if cpu:
        from verl_modal.cpu.overrides import worker_env

        env = worker_env()
    prepare_process_env(env, local=False)  # before verl is imported: it picks its platform then

    from verl_modal.pools import PLACEMENT_ENV, WAIT_ENV
    from verl_modal.preflight import compose, select_config, validate

    select_config(config_name)
    config = compose(overrides)
    validate(config)
    import os

    for key in (WAIT_ENV, PLACEMENT_ENV):  # to the TaskRunner, which builds the pools
        if key in os.environ:
            env[key] = os.environ[key]
    from verl_modal.run_report import run_in_folder

    # the run folder the launcher named (modal_rl.cluster.run_folder): metrics, report
    run_in_folder(config, env, lambda cfg, env_vars: run(cfg, env_vars, cpu=cpu, bring_up=attach_ray))
    return 0


if __name__ == "__main__":
    sys.exit(job_main())
