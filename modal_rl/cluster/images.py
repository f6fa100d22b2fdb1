"""Cluster images made from the user's own stack: a CUDA base, the framework at the version
installed where the launcher runs, with the extras the command line needs, and this project.

An adapter turns its command line into an :class:`ImageRecipe` (which distribution, which of
its extras); the recipe reads the pins from the installed distribution's own metadata
(``Requires-Dist`` of those extras), so the image holds what that framework release was
tested with, and the dry-run plan lists every pinned package. Nothing here contacts a
registry: the recipe is metadata plus a few build steps, and ``build`` defines the
``modal.Image`` lazily (offline).

Invariants:
- the framework is pinned to exactly the installed version (``dist==version``), its extras by
  name; every ``==`` pin those extras declare is listed in :meth:`ImageRecipe.describe`;
- this project's own runtime dependencies are installed too (its sources are mounted by
  the backend, its dependencies are not in a plain CUDA image);
- a user image tag is never inspected: :func:`unchecked_image_note` says in one line what it
  must hold and how to check.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, requires, version
from typing import Any

# CUDA toolkit image the framework wheels are installed on: devel, because vLLM, SGLang and
# Transformer Engine compile kernels at first use (nvcc); CUDA 13.0 matches the cu130 wheels
# (flash-attn, cupy) that verl 0.9.1 pins for torch 2.11.
CUDA_BASE = "nvidia/cuda:13.0.0-devel-ubuntu24.04"
PYTHON_VERSION = "3.12"
CORE_DISTRIBUTION = "modal-rl"
# Installed first, at the framework's pins: source builds among its pins (flash-attn) import
# torch in setup.py, so the second install runs without build isolation, on these.
BUILD_FIRST = ("torch", "torchvision", "torchaudio")
BUILD_TOOLS = ("setuptools", "wheel", "ninja", "packaging")


class ImageRecipeError(ValueError):
    """The framework the recipe names is not installed here; the message says what to install."""


def _requirement(text: str):
    from packaging.requirements import Requirement

    return Requirement(text)


def extra_requirements(dist: str, extras: tuple[str, ...]) -> list[str]:
    """Requirement strings of ``dist``'s ``extras``, with ``dist[other]`` self-references
    expanded (verl's ``vllm`` extra pulls ``verl[verl-core]``), each once, in order."""
    try:
        declared = requires(dist) or []
    except PackageNotFoundError:
        raise ImageRecipeError(f"{dist} is not installed here; install it to size its image") from None
    name = dist.lower().replace("_", "-")
    seen_extras: set[str] = set()
    out: list[str] = []
    pending = list(extras)
    while pending:
        extra = pending.pop(0)
        if extra in seen_extras:
            continue
        seen_extras.add(extra)
        for text in declared:
            req = _requirement(text)
            if req.marker is None or not req.marker.evaluate({"extra": extra}):
                continue
            if req.name.lower().replace("_", "-") == name:
                pending.extend(sorted(req.extras))
                continue
            plain = str(_requirement(text.split(";", 1)[0].strip()))
            if plain not in out:
                out.append(plain)
    return out


def pins(requirements: list[str]) -> dict[str, str]:
    """``name -> version`` of the requirements pinned with ``==``."""
    found: dict[str, str] = {}
    for text in requirements:
        req = _requirement(text)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            found[req.name] = exact[0]
    return found


def core_requirements() -> list[str]:
    """This project's runtime dependencies (no extras): the containers import its core."""
    try:
        declared = requires(CORE_DISTRIBUTION) or []
    except PackageNotFoundError:
        raise ImageRecipeError(f"{CORE_DISTRIBUTION} is not installed: run bash scripts/install.sh") from None
    return [text for text in declared if ";" not in text]


@dataclass(frozen=True)
class ImageRecipe:
    """``dist[extras]==<installed version>`` on :data:`CUDA_BASE`, plus this project's
    dependencies, plus ``commands`` (run after the installs, e.g. applying a patch series that
    ``local_dirs`` copies in). ``why`` says which parts of the command line chose the extras."""

    dist: str
    extras: tuple[str, ...]
    why: dict[str, str] = field(default_factory=dict)
    base: str = CUDA_BASE
    python: str = PYTHON_VERSION
    apt: tuple[str, ...] = ("git",)
    local_dirs: tuple[tuple[str, str], ...] = ()
    commands: tuple[str, ...] = ()

    @property
    def version(self) -> str:
        try:
            return version(self.dist)
        except PackageNotFoundError:
            raise ImageRecipeError(
                f"{self.dist} is not installed here; install it to size its image"
            ) from None

    def framework(self) -> str:
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.dist}{extras}=={self.version}"

    def requirements(self) -> list[str]:
        """Everything pip installs, framework first (its pins win), then this project's needs."""
        own = extra_requirements(self.dist, self.extras)
        named = {_requirement(t).name.lower() for t in own}
        extra = [t for t in core_requirements() if _requirement(t).name.lower() not in named]
        return [self.framework(), *extra]

    def build_first(self) -> list[str]:
        """The build tools and the pinned torch family, installed before everything else."""
        pinned = self.pinned()
        torch = [f"{name}=={pinned[name]}" for name in BUILD_FIRST if name in pinned]
        return [*BUILD_TOOLS, *torch] if torch else []

    def pinned(self) -> dict[str, str]:
        return {self.dist: self.version, **pins(extra_requirements(self.dist, self.extras))}

    def build(self):
        """The ``modal.Image`` (lazy: defining it contacts nothing)."""
        import modal

        image = modal.Image.from_registry(self.base, add_python=self.python)
        if self.apt:
            image = image.apt_install(*self.apt)
        first = self.build_first()
        if first:
            image = image.pip_install(*first)
        image = image.pip_install(*self.requirements(), extra_options="--no-build-isolation" if first else "")
        for local, remote in self.local_dirs:
            image = image.add_local_dir(local, remote, copy=True)
        if self.commands:
            image = image.run_commands(*self.commands)
        return image

    def describe(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "python": self.python,
            "framework": self.framework(),
            "chosen_by": dict(self.why),
            "pinned": self.pinned(),
            "pip_first": self.build_first(),
            "pip": self.requirements(),
            "build_commands": list(self.commands),
        }

    def summary(self) -> str:
        pinned = self.pinned()
        shown = ", ".join(f"{k}=={v}" for k, v in pinned.items() if k != self.dist)
        return f"{self.base} + {self.framework()} ({shown or 'no further pins'}) + modal-rl"


def unchecked_image_note(tag: str, recipe: ImageRecipe, modules: tuple[str, ...]) -> str:
    """One line for a user image we cannot look into: what it must hold and how to check."""
    pinned = recipe.pinned()
    want = ", ".join(f"{k}=={v}" for k, v in pinned.items() if k in (recipe.dist, "torch", "vllm", "sglang"))
    probe = "; ".join(f"import {m}" for m in modules)
    versions = ", ".join(f"{m}.__version__" for m in modules)
    check = shlex.quote(f"{probe}; print({versions})")
    return (
        f"--image {tag} is used as given (not inspected): it must hold {want} and ray; check with "
        f"`docker run --rm {tag} python -c {check}`"
    )
