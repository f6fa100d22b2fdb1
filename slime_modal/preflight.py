"""slime preflight: what a slime command line asks of the cluster, read without importing slime,
sglang or Megatron (none of them is installed where the launcher runs, and importing them
costs tens of seconds).

The rules restate slime's own (``slime/utils/arguments.py`` ``slime_validate_args`` and
``slime/ray/placement_group.py`` ``_get_placement_group_layout``) so that a run that slime
would reject after a queue wait is rejected here in a second:

- GPUs: slime reserves one placement group of ``actor_nodes x actor_gpus_per_node`` GPUs,
  plus ``--rollout-num-gpus`` when engines are not colocated; colocated, the larger of the
  two; external engines (``--rollout-external-engine-addrs``, or our ``--rollout-engines``)
  need the actor's GPUs only. The critic (``--advantage-estimator ppo``) shares the actor's
  placement group, so it adds none. ``--debug-train-only`` / ``--debug-rollout-only`` reserve
  one side only.
- delta weight sync needs ``--update-weight-transport disk``, no ``--colocate`` and
  ``--update-weight-local-checkpoint-dir``; disk transport needs ``--update-weight-disk-dir``.
- paths: on ``--backend local`` the inputs (checkpoints, data) must exist; on Modal every
  absolute path that must outlive or be shared between containers must sit under a mounted
  Volume (or in the image, under ``--slime-path``); an input that exists on the launching
  machine travels with the job instead (:func:`local_inputs`, capped in size).

Each problem is one line; :func:`check` returns them all. Invariant: importing this module
and running :func:`check` start nothing and read only the file system.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Flags whose value is a file or directory the job reads; they must exist before the run.
INPUT_PATH_FLAGS = ("--hf-checkpoint", "--ref-load", "--prompt-data", "--custom-config-path")
# Flags whose value is a directory that must survive or be shared: on Modal they belong on a
# Volume. ``--load`` is here, not above: slime's scripts pass --load = --save, which does not
# exist on a first run (Megatron then starts from --ref-load). --update-weight-local-checkpoint-dir
# is host-local NVMe on purpose and is in neither list.
SHARED_OUTPUT_FLAGS = ("--load", "--save", "--update-weight-disk-dir")


class SlimeArgs:
    """Read-only view of a slime argv: the last value given for a flag, as argparse keeps it.

    Flags are matched exactly (``--flag value`` or ``--flag=value``); a value runs until the
    next token that starts with ``--`` (so ``nargs='+'`` flags read all their values).
    """

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    def values(self, flag: str) -> list[str] | None:
        """The values after the last ``flag``; ``None`` when the flag is absent."""
        found: list[str] | None = None
        i = 0
        while i < len(self.argv):
            token = self.argv[i]
            if token == flag:
                found = []
                i += 1
                while i < len(self.argv) and not self.argv[i].startswith("--"):
                    found.append(self.argv[i])
                    i += 1
                continue
            if token.startswith(flag + "="):
                found = [token[len(flag) + 1 :]]
            i += 1
        return found

    def get(self, flag: str, default: str | None = None) -> str | None:
        found = self.values(flag)
        return found[0] if found else default

    def has(self, flag: str) -> bool:
        return self.values(flag) is not None

    def int(self, flag: str, default: int | None) -> int | None:
        text = self.get(flag)
        if text is None:
            return default
        try:
            return int(text)
        except ValueError:
            raise SlimePreflightError(f"{flag} {text!r} is not an integer") from None


class SlimePreflightError(ValueError):
    """A slime command line that cannot run as given; the message is one line."""


@dataclass(frozen=True)
class GpuNeed:
    """GPUs slime's placement group asks for, and how that number came about."""

    total: int
    why: str


def required_gpus(args: SlimeArgs, external_engines: bool = False) -> GpuNeed:
    """GPUs the cluster must have for ``args`` (see the module docstring for the rules)."""
    nodes = args.int("--actor-num-nodes", 1)
    per_node = args.int("--actor-num-gpus-per-node", 8)
    actor = nodes * per_node
    rollout = args.int("--rollout-num-gpus", None)
    per_engine = args.int("--rollout-num-gpus-per-engine", 1)
    colocate = args.has("--colocate")
    actor_why = f"actor {nodes} x {per_node}"
    if args.has("--debug-train-only"):
        return GpuNeed(actor, f"{actor_why} (--debug-train-only)")
    if external_engines or args.has("--rollout-external-engine-addrs"):
        return GpuNeed(actor, f"{actor_why}; rollout on external engines")
    if rollout is not None and rollout > 0 and per_engine and rollout % per_engine:
        raise SlimePreflightError(
            f"--rollout-num-gpus {rollout} is not a multiple of --rollout-num-gpus-per-engine {per_engine}"
        )
    if args.has("--debug-rollout-only"):
        if rollout is None:
            rollout = actor if colocate else None
        if rollout is None:
            raise SlimePreflightError("--debug-rollout-only without --colocate needs --rollout-num-gpus")
        return GpuNeed(rollout, f"rollout {rollout} (--debug-rollout-only)")
    if colocate:
        rollout = actor if rollout is None else rollout
        return GpuNeed(max(actor, rollout), f"{actor_why} colocated with rollout {rollout}")
    if rollout is None:
        raise SlimePreflightError(
            "slime without --colocate needs --rollout-num-gpus (its rollout engines get their own GPUs)"
        )
    return GpuNeed(actor + rollout, f"{actor_why} + rollout {rollout}")


def weight_sync_problems(args: SlimeArgs) -> list[str]:
    """slime's own weight-sync validation, in its order."""
    mode = args.get("--update-weight-mode", "full")
    transport = args.get("--update-weight-transport", "nccl")
    problems = []
    if transport == "disk" and not args.get("--update-weight-disk-dir"):
        problems.append(
            "--update-weight-transport disk needs --update-weight-disk-dir (a dir both sides see)"
        )
    if mode == "delta":
        if transport != "disk":
            problems.append(
                f"--update-weight-mode delta needs --update-weight-transport disk, got {transport!r}"
            )
        if args.has("--colocate"):
            problems.append(
                "--update-weight-mode delta does not work with --colocate (slime syncs colocated "
                "engines through CUDA IPC); drop one of them"
            )
        if not args.get("--update-weight-local-checkpoint-dir"):
            problems.append(
                "--update-weight-mode delta needs --update-weight-local-checkpoint-dir (a local dir on "
                "each rollout host)"
            )
    return problems


def under(path: str, roots) -> str | None:
    """The root among ``roots`` that contains ``path`` (or is it), else ``None``."""
    norm = os.path.normpath(path)
    for root in roots:
        base = os.path.normpath(root)
        if norm == base or norm.startswith(base.rstrip("/") + "/"):
            return root
    return None


# Flags whose values are inputs that travel into the Modal containers when they exist on the
# launching machine (``modal_rl.cluster.local_inputs``); ``--eval-prompt-data`` takes
# ``name path`` pairs, and only values that exist here are paths.
EVAL_DATA_FLAG = "--eval-prompt-data"
SHIPPABLE_FLAGS = (*INPUT_PATH_FLAGS, EVAL_DATA_FLAG)


def local_inputs(argv: list[str], mounts: list[str], image_roots: list[str]):
    """The slime inputs that exist on this machine, outside Volumes and the image, to ship
    into the Modal containers at the same path; raises ``LocalInputError`` (one line)."""
    from modal_rl.cluster.local_inputs import collect

    args = SlimeArgs(argv)
    candidates = [(flag, value) for flag in SHIPPABLE_FLAGS for value in args.values(flag) or []]
    return collect(candidates, mounts=mounts, image_roots=image_roots)


def path_problems(
    args: SlimeArgs, backend: str, mounts: list[str], image_roots: list[str], shipped: list[str] = ()
) -> list[str]:
    """Inputs must exist (local) or sit on a Volume, in the image or on this machine (Modal:
    ``shipped`` paths travel with the job); shared outputs on a Volume (Modal). A Hub id
    (``org/name``, no leading ``/`` or ``.``) is not a path."""
    problems = []
    named = [(flag, args.get(flag)) for flag in INPUT_PATH_FLAGS + SHARED_OUTPUT_FLAGS]
    # --eval-prompt-data takes ``name path`` pairs: its absolute values are the paths.
    if backend != "local":  # a local run reads them where slime does; absent ones are slime's to name
        named += [(EVAL_DATA_FLAG, v) for v in args.values(EVAL_DATA_FLAG) or [] if os.path.isabs(v)]
    for flag, path in named:
        if not path or _hub_id(flag, path):
            continue
        is_input = flag in INPUT_PATH_FLAGS or flag == EVAL_DATA_FLAG
        if backend == "local":
            if is_input and not os.path.exists(path):
                problems.append(f"{flag} {path}: no such file or directory")
        elif os.path.isabs(path) and not under(path, mounts):
            if is_input and (under(path, image_roots) or under(path, shipped)):
                continue
            local = " nor on this machine (local inputs travel with the job)" if is_input else ""
            top = "/" + os.path.normpath(path).lstrip("/").split("/", 1)[0]
            problems.append(
                f"{flag} {path} is not under any of the mounted Volumes {sorted(mounts)}{local}, so the "
                f"containers would {'lack' if is_input else 'lose'} it; add --volume NAME:{top} "
                f"({'with the file(s) on Volume NAME' if is_input else 'kept after the run'})"
            )
    return problems


def _hub_id(flag: str, value: str) -> bool:
    return flag == "--hf-checkpoint" and not value.startswith(("/", ".", "~")) and value.count("/") == 1


def launcher_flag_warnings(argv: list[str], launcher_flags: set[str]) -> list[str]:
    """Our own flags found after ``--``: they go to slime, which has no such flag (or means
    something else by it), not to the launcher."""
    seen = []
    for token in argv:
        name = token.split("=", 1)[0]
        if name in launcher_flags and name not in seen:
            seen.append(name)
    return [
        f"warning: {name} comes after `--`, so it goes to slime, not to the launcher; "
        "put launcher flags before `--`"
        for name in seen
    ]


def check(
    argv: list[str],
    *,
    backend: str,
    cluster_gpus: int,
    mounts: list[str],
    image_roots: list[str],
    external_engines: bool = False,
    shipped: list[str] = (),
) -> tuple[GpuNeed | None, list[str]]:
    """``(gpu need, problems)`` for a slime argv on a cluster of ``cluster_gpus`` GPUs;
    ``shipped``: local inputs that travel with the job (``local_inputs``)."""
    args = SlimeArgs(argv)
    problems: list[str] = []
    need = None
    try:
        need = required_gpus(args, external_engines)
    except SlimePreflightError as exc:
        problems.append(str(exc))
    if need is not None and need.total > cluster_gpus:
        problems.append(
            f"slime asks for {need.total} GPUs ({need.why}) but the cluster has {cluster_gpus}; "
            "change --nodes/--gpu or the slime GPU flags"
        )
    problems += weight_sync_problems(args)
    problems += path_problems(args, backend, mounts, image_roots, shipped)
    return need, problems
