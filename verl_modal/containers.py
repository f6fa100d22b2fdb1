"""A verl line as Modal containers will see it: the paths it names (on a Volume, on this machine
to travel with the job, or a Hub id the containers fetch) and its Ray runtime env (settings of
this machine rewritten or refused, ``modal_rl.cluster.runtime_env``). Raises
:class:`verl_modal.preflight.VerlPreflightError` with one line; reads the overrides and the
file system only."""

from __future__ import annotations

from verl_modal.preflight import VerlPreflightError, explicit_values

# Data files every verl run reads; on Modal each must be on a Volume or on this machine
# (shipped with the job: ``launch.local_input_candidates``), else the containers lack it.
DATA_KEYS = ("data.train_files", "data.val_files")
# Models a line may name by path (a Hub id, relative, is fetched in the containers).
MODEL_KEYS = (
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "reward.reward_model.model.path",
    "distillation.teacher_models.teacher_model.model_path",
    "actor_rollout_ref.model.tokenizer_path",
)


def check_modal_data_paths(user_overrides: list[str], mounts) -> None:
    """The Modal twin of slime's ``path_problems``: an absolute data path that is neither on
    this machine nor under a mounted Volume would be missing in the containers."""
    import os

    from modal_rl.cluster.local_inputs import hydra_values

    roots = [os.path.normpath(m) for m in mounts]
    given = explicit_values(user_overrides)
    for key in (*DATA_KEYS, *MODEL_KEYS):
        for path in hydra_values(given.get(key, "")):
            path = str(path).strip()
            if not path or "://" in path or os.path.exists(os.path.expanduser(path)) or path == "null":
                continue
            if not path.startswith(("/", "~")):
                if key in MODEL_KEYS:
                    continue  # a Hub id (org/name): the containers download it
                raise VerlPreflightError(
                    f"{key}={path} is relative and not on this machine; the job's working directory in "
                    "the containers is not this one: give an absolute path on a Volume (--volume NAME:/data "
                    "and /data/...) or an existing local file"
                )
            norm = os.path.normpath(path)
            if any(norm == r or norm.startswith(r.rstrip("/") + "/") for r in roots):
                continue
            top = "/" + norm.lstrip("/").split("/", 1)[0]
            raise VerlPreflightError(
                f"{key}={path} is not under any of the mounted Volumes {sorted(roots)} nor on this "
                f"machine (local inputs travel with the job), so the containers would lack it; add "
                f"--volume NAME:{top} with the file(s) on Volume NAME"
            )


RUNTIME_ENV_PREFIX = "ray_kwargs.ray_init.runtime_env."


def container_runtime_env(user_overrides: list[str], mounts) -> tuple[list[str], list[str], list[str]]:
    """``(overrides, notes, uv extras)``: the user's ``ray_kwargs.ray_init.runtime_env.*``
    settings as they must be in a container (``modal_rl.cluster.runtime_env``): a dropped
    setting becomes ``=null`` in place (Hydra order kept), each rewrite a one-line note; the
    ``--extra`` names of a ``uv run`` interpreter go to the image. Raises
    :class:`VerlPreflightError` for a setting that cannot work there."""
    from modal_rl.cluster.runtime_env import RuntimeEnvError, rewrite
    from verl_modal.cpu.overrides import override_key

    out: list[str] = []
    notes: list[str] = []
    extras: list[str] = []
    for override in user_overrides:
        key = override_key(override)
        if not key.startswith(RUNTIME_ENV_PREFIX):
            out.append(override)
            continue
        try:
            found = rewrite({key: override.partition("=")[2]}, mounts).get(key)
        except RuntimeEnvError as exc:
            raise VerlPreflightError(str(exc)) from None
        if found is None or found.note is None:
            out.append(override)
            continue
        out.append(f"{override.partition('=')[0]}=null")
        notes.append(found.note)
        extras += found.extras
    return out, notes, extras
