"""The cluster image of a verl line: verl at the version installed here, with the extras the
line needs, on a CUDA base, plus our verl patch series (``patches/verl``).

Which extras (verl's own ``pyproject`` names them, with the pins that release was tested with):

- the rollout engine: ``rollout.name=vllm`` -> ``vllm``; ``sglang`` -> ``sglang``;
  ``modal_vllm`` (engines in their own containers) -> ``vllm`` (the replica's client side);
- the training engine: ``actor.strategy`` / ``critic.strategy`` ``fsdp``/``fsdp2`` -> ``fsdp``;
  ``megatron`` -> ``megatron`` (megatron-core, megatron-bridge, Transformer Engine);
  ``veomni`` -> ``veomni-sft``.

The series is applied to the installed verl with ``git apply`` restricted to ``verl/`` (the
patches also carry upstream tests, which the image does not need).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from modal_rl import package_data
from modal_rl.cluster.images import ImageRecipe, unchecked_image_note

SERIES_DIR = package_data.series_dir("verl")  # packaged with the wheel, else the checkout's patches/verl
REMOTE_DIR = "/opt/modal_rl/patches/verl"
ENGINE_EXTRAS = {"vllm": "vllm", "sglang": "sglang", "modal_vllm": "vllm"}
STRATEGY_EXTRAS = {"fsdp": "fsdp", "fsdp2": "fsdp", "megatron": "megatron", "veomni": "veomni-sft"}
# What an image must import for a verl run; named in the note for a user image.
MODULES = ("verl", "torch", "ray")


def _select(config, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, default=None, throw_on_missing=False)


def series_files(series_dir: Path = SERIES_DIR) -> list[str]:
    import tomllib

    path = series_dir / "series.toml"
    if not path.is_file():
        return []
    return [entry["file"] for entry in tomllib.loads(path.read_text()).get("patch", [])]


def patch_commands(files: list[str]) -> tuple[str, ...]:
    """Apply the series to the installed verl's files (``site-packages/verl/...``)."""
    if not files:
        return ()
    site = "$(python -c 'import os, verl; print(os.path.dirname(os.path.dirname(verl.__file__)))')"
    paths = " ".join(shlex.quote(f"{REMOTE_DIR}/{name}") for name in files)
    return (f"cd {site} && git apply --include='verl/*' {paths}",)


def recipe_for(config, series_dir: Path = SERIES_DIR, requested=()) -> ImageRecipe:
    """The image recipe of a composed verl config (see the module doc); ``requested``: verl
    extras the line named itself (``uv run --extra X`` in its runtime env)."""
    why: dict[str, str] = {}
    extras: list[str] = []
    known = set(ENGINE_EXTRAS.values()) | set(STRATEGY_EXTRAS.values())
    for extra in requested:
        if extra in known and extra not in extras:
            extras.append(extra)
            why[extra] = f"uv run --extra {extra} (ray_kwargs.ray_init.runtime_env.py_executable)"
    engine = str(_select(config, "actor_rollout_ref.rollout.name") or "vllm")
    if engine in ENGINE_EXTRAS and ENGINE_EXTRAS[engine] not in extras:
        extras.append(ENGINE_EXTRAS[engine])
        why[ENGINE_EXTRAS[engine]] = f"actor_rollout_ref.rollout.name={engine}"
    for key in ("actor_rollout_ref.actor.strategy", "critic.strategy"):
        strategy = _select(config, key)
        extra = STRATEGY_EXTRAS.get(str(strategy))
        if extra and extra not in extras:
            extras.append(extra)
            why[extra] = f"{key}={strategy}"
    files = series_files(series_dir)
    return ImageRecipe(
        dist="verl",
        extras=tuple(extras),
        why=why,
        local_dirs=((str(series_dir), REMOTE_DIR),) if files else (),
        commands=patch_commands(files),
    )


def cluster_recipe(config, image: str | None, requested=()) -> ImageRecipe:
    """The recipe of a Modal run; with a user image (``--image``), which we cannot look into,
    one line on stderr says what it must hold (the recipe's pins) and how to check."""
    recipe = recipe_for(config, requested=requested)
    if image:
        print(f"verl_modal: {unchecked_image_note(image, recipe, MODULES)}", file=sys.stderr)
    return recipe


def engine_image() -> str:
    """``modal_vllm`` engines' default image: vLLM's own server image at the version the
    installed verl's ``vllm`` extra pins (the engine runs ``vllm serve``; our sources and the
    weight receiver's packages are added by the engine pool)."""
    from modal_rl.cluster.images import extra_requirements, pins

    return f"vllm/vllm-openai:v{pins(extra_requirements('verl', ('vllm',)))['vllm']}"
