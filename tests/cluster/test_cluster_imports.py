"""The core does not know a framework, and engines and the weight pusher depend one way.

Scans every import statement (module level and inside functions) of ``modal_rl/cluster``:
none names ``verl_modal`` or ``slime_modal`` (adapters import the core, never the reverse),
and none names an engine or the vLLM weight pusher (``modal_rl.engines`` builds on the
cluster's spec and process helpers, so the cluster package must not import it back).
"""

from __future__ import annotations

import ast
from pathlib import Path

CLUSTER = Path(__file__).resolve().parents[2] / "modal_rl" / "cluster"
FRAMEWORKS = ("verl_modal", "slime_modal", "verl", "slime")
PUSHER = (
    "modal_rl.engines",
    "modal_rl.weightsync.apply.vllm_extension",
    "modal_rl.weightsync.apply.vllm_inplace",
)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def offenders(banned: tuple[str, ...]) -> list[str]:
    hits = []
    for path in sorted(CLUSTER.rglob("*.py")):
        for line, module in imported_modules(path):
            if any(module == b or module.startswith(b + ".") for b in banned):
                hits.append(f"{path.name}:{line} imports {module}")
    return hits


def test_the_cluster_package_imports_no_framework_adapter():
    assert offenders(FRAMEWORKS) == []


def test_the_cluster_package_does_not_import_the_weight_pusher_back():
    assert offenders(PUSHER) == []


def test_the_scan_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("def f():\n    from verl_modal.cpu import tiny\n    import slime_modal.x\n")
    assert [m for _, m in imported_modules(sample)] == [
        "verl_modal.cpu",
        "verl_modal.cpu.tiny",
        "slime_modal.x",
    ]
