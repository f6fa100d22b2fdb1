"""The house's shape, read from the source: no import circle, the core never imports an
adapter, no file so long that it must hold more than one concept (one concept per file: ~500
lines is fine, 600 is past it), and a new adapter ships into Modal images by declaring itself
(an entry point), with no edit to ``modal_rl``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("modal_rl", "verl_modal", "slime_modal")
CORE, ADAPTERS = "modal_rl", ("verl_modal", "slime_modal")
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every import of every module (top level and inside functions) to a module of ours."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" for a in node.names]  # a name that is no module: its module
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        part.append(top)
                        if top == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on:
                low[node] = min(low[node], index[child])
    return found


def test_the_finder_sees_a_circle_it_is_shown():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_and_the_core_imports_no_adapter():
    graph = import_graph()
    assert len(graph) > 150  # the walk found the packages
    assert circles(graph) == []
    assert (
        sorted((m, t) for m, ts in graph.items() if m.startswith(CORE) for t in ts if t.startswith(ADAPTERS))
        == []
    )


def test_no_adapter_imports_another():
    """What two adapters share lives once in the core (the tiny CPU model: ``modal_rl.tiny_model``)."""
    graph = import_graph()
    crossing = sorted(
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if m.startswith(ADAPTERS) and t.startswith(ADAPTERS) and m.split(".")[0] != t.split(".")[0]
    )
    assert crossing == []


def test_no_file_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for pkg in (*PACKAGES, "benchmarks", "patches")
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_an_adapter_declared_by_entry_point_ships_in_a_modal_dry_run_plan(tmp_path):
    """A third adapter (its own distribution on the path, one entry point) appears among the
    packages a Modal image carries, beside the two this project declares."""
    (tmp_path / "openrlhf_modal").mkdir()
    (tmp_path / "openrlhf_modal" / "__init__.py").write_text('"""A third framework adapter."""\n')
    dist = tmp_path / "openrlhf_modal-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: openrlhf-modal\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[modal_rl.adapters]\nopenrlhf_modal = openrlhf_modal.launch:main\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "RAY_AUTH_MODE": "disabled",
    }
    env.pop("MODAL_TOKEN_ID", None)
    env.pop("MODAL_TOKEN_SECRET", None)
    argv = [
        "-m",
        "modal_rl.cluster",
        "run",
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--dry-run",
        "--json",
        "--",
        "true",
    ]
    out = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["packages"] == ["modal_rl", "openrlhf_modal", "slime_modal", "verl_modal"]


def test_tests_mirror_the_packages():
    """Test files live in a folder named for what they test (``tests/weightsync/``, ``tests/verl_adapter/``,
    ...; ``tests/e2e/`` is the slow tier); only shared helpers sit at the top of ``tests/``."""
    flat = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert not flat, f"move these into a package folder under tests/: {flat}"
    folders = [p for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))]
    missing = [p.name for p in folders if not (p / "__init__.py").exists()]
    assert not missing, f"test folders without __init__.py (their modules' names would clash): {missing}"
    # A child script in tests/ runs with tests/ first on sys.path: a folder named like a module
    # it imports (verl, slime, patches, benchmarks, ...) would shadow that module there.
    probe = "import importlib.util, sys; print([n for n in sys.argv[1:] if importlib.util.find_spec(n)])"
    names = [p.name for p in folders]
    found = subprocess.run([sys.executable, "-c", probe, *names], cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "[]", f"test folders named like importable modules: {found.stdout}"


def classes_by_name() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / CORE).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module_name(path))
    return found


def test_one_meaning_per_class_name_in_the_core():
    """Two classes of one name in two modules are two meanings for one word (private ones too:
    a reader greps for the name)."""
    assert len(classes_by_name()) > 100  # the walk found the classes
    assert {name: where for name, where in classes_by_name().items() if len(where) > 1} == {}


# A constructor takes at most this many parameters (self, *args and **kwargs not counted); more
# settings go in a frozen config object validated where it is made (``sandboxes.pool_config``).
MAX_INIT_PARAMETERS = 8
LONG_INIT_ALLOWED: set[str] = set()


def test_no_constructor_over_eight_parameters_in_the_core():
    long = {}
    for path in sorted((ROOT / CORE).rglob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    a = fn.args
                    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1
                    where = f"{module_name(path)}.{cls.name}"
                    if count > MAX_INIT_PARAMETERS and where not in LONG_INIT_ALLOWED:
                        long[where] = count
    assert long == {}


def test_the_finders_see_a_repeated_name_and_a_long_constructor(tmp_path, monkeypatch):
    """The two scans above catch what they are for (run on a copy of the rules' inputs)."""
    pkg = tmp_path / CORE
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "class Lease:\n    def __init__(self, a, b, c, d, e, f, g, h, i):\n        pass\n"
    )
    (pkg / "b.py").write_text("class Lease:\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert classes_by_name() == {"Lease": [f"{CORE}.a", f"{CORE}.b"]}
    with pytest.raises(AssertionError, match="Lease"):
        test_no_constructor_over_eight_parameters_in_the_core()


# Weight sync is the lower layer: the engine side imports it, never the reverse, and it knows
# nothing of clusters. The one edge left is the LoRA pusher, whose vLLM HTTP calls are shared
# with the full-weight pusher in ``engines.vllm_push``.
WEIGHTSYNC_TO_ENGINES_ALLOWED: set[tuple[str, str]] = set()


def test_weight_sync_imports_no_cluster_and_no_engine_module():
    edges = {
        (m, t)
        for m, ts in import_graph().items()
        if m.startswith("modal_rl.weightsync")
        for t in ts
        if t.startswith(("modal_rl.cluster", "modal_rl.engines"))
    }
    assert edges - WEIGHTSYNC_TO_ENGINES_ALLOWED == set()


def test_adapters_get_engines_from_the_registry_not_from_an_engine_file():
    """An adapter names its engine (``ENGINES``) and takes the rest from the package's surface
    (``modal_rl.engines.PUBLIC``), never from one of its files: the port is the package."""
    reached = {
        (m, t)
        for m, ts in import_graph().items()
        if m.startswith(ADAPTERS)
        for t in ts
        if t.startswith("modal_rl.engines.")
    }
    assert reached == set()
