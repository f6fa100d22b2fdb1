"""Assert-style tests judged on the host: the verdict never comes from what the program controls.

``plan_asserts(test_code)`` splits a test into what runs in the sandbox and what stays here:

- ``assert <call> == <expected>`` (and ``!=``, ``<``, ``in``, ``is None``..., ``math.isclose``,
  ``abs(a - b) < tol``, ``and``/``not``): the host keeps the expression with holes
  (``template``); only the holes, the calls into the program, run in the sandbox, and their
  values come back strictly encoded (``_harness.encode``: plain builtins only). The expected
  side never enters the sandbox, so the program cannot read it from its file, its caller's
  frame or anywhere else. ``assert f(x)`` alone (truthiness) is split when ``f`` is not from a
  module the test imports (``np.allclose(...)`` would judge inside the sandbox).
- HumanEval's ``def check(candidate): <asserts>`` + ``check(f)``, pytest-style ``def test_*():``
  functions and ``for`` loops over a literal list of cases are expanded into plain asserts first.
- everything else that asserts (a loop over computed data, a helper comparing inside the
  sandbox) is **unsplit**: it runs in the sandbox as a whole statement and the harness reports
  whether it raised. Early exits cannot pass it (no results line, no pass), but a program that
  targets the harness itself could forge it; each check says ``split`` so a caller can tell.

``judge(plan, stdout)`` reads the harness's results line and returns one outcome per assert:
a missing line (the program exited, was killed or hung), a refused value or a step error is a
failure. Nothing here runs test or program code on the host: templates are evaluated by
``_host_eval`` over decoded plain values, with size guards.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any

from modal_rl.sandboxes import hosteval
from modal_rl.sandboxes._harness import MARK

_MAX_UNROLL = 1000


@dataclass
class Check:
    source: str  # the assert as the test wrote it
    split: bool
    template: ast.expr | None = None  # split: host-side expression; ``__vN`` are value steps
    holes: list[int] = field(default_factory=list)  # split: the value steps it reads
    step: int | None = None  # unsplit: the check step that runs it


@dataclass
class AssertPlan:
    steps: list[tuple[str, str]] = field(default_factory=list)  # (exec|value|check, source)
    checks: list[Check] = field(default_factory=list)

    def payload(self, program: str) -> str:
        return json.dumps({"program": program, "steps": self.steps})


def plan_asserts(test_code: str) -> AssertPlan:
    """Raises ``ValueError`` (naming the line) if the test code is not valid Python."""
    try:
        tree = ast.parse(test_code)
    except SyntaxError as exc:
        raise ValueError(f"assert test code does not parse: line {exc.lineno}: {exc.msg}") from exc
    imported = {
        (a.asname or a.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in node.names
    }
    plan = AssertPlan()
    for stmt in _expand(tree.body):
        if isinstance(stmt, ast.Assert):
            _plan_assert(plan, stmt, imported)
        elif any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            plan.checks.append(Check(ast.unparse(stmt), split=False, step=len(plan.steps)))
            plan.steps.append(("check", ast.unparse(stmt)))
        else:
            plan.steps.append(("exec", ast.unparse(stmt)))
    return plan


def _expand(body: list[ast.stmt]) -> list[ast.stmt]:
    """Inline check(candidate) calls, uncalled pytest test functions and literal case loops.
    A function that is expanded is not sent: its body holds the expected values."""
    defs = {
        s.name: s
        for s in body
        if isinstance(s, ast.FunctionDef) and any(isinstance(n, ast.Assert) for n in ast.walk(s))
    }
    called: set[str] = set()
    out: list[ast.stmt] = []
    for stmt in body:
        call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
        fn = defs.get(call.func.id) if call and isinstance(call.func, ast.Name) else None
        if isinstance(stmt, ast.FunctionDef) and stmt.name in defs:
            continue
        if fn is not None and not call.keywords and len(call.args) == len(fn.args.args) <= 1:
            called.add(fn.name)
            names = {a.arg: arg for a, arg in zip(fn.args.args, call.args, strict=True)}
            out += _expand([_Rename(names).visit(s) for s in _copy(fn.body)])
        elif isinstance(stmt, ast.For):
            out += _unroll(stmt)
        else:
            out.append(stmt)
    for name, fn in defs.items():  # pytest style: test_* functions nobody calls
        if name not in called and name.startswith("test") and not fn.args.args:
            out += _expand(_copy(fn.body))
        elif name not in called:
            out.append(fn)
    return out


def _copy(stmts: list[ast.stmt]) -> list[ast.stmt]:
    return [ast.parse(ast.unparse(s)).body[0] for s in stmts]


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, ast.expr]):
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self.names.get(node.id, node) if isinstance(node.ctx, ast.Load) else node


def _unroll(loop: ast.For) -> list[ast.stmt]:
    """``for x, y in [<literal cases>]: <asserts>`` as one assert block per case."""
    try:
        cases = ast.literal_eval(loop.iter)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return [loop]
    target = loop.target
    simple = isinstance(target, ast.Name) or (
        isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts)
    )
    if (
        not simple
        or loop.orelse
        or not all(isinstance(s, ast.Assert) for s in loop.body)
        or not isinstance(cases, list | tuple)
        or len(cases) > _MAX_UNROLL
    ):
        return [loop]
    out: list[ast.stmt] = []
    for case in cases:
        if isinstance(target, ast.Name):
            names = {target.id: _literal(case)}
        elif isinstance(case, list | tuple) and len(case) == len(target.elts):
            names = {t.id: _literal(v) for t, v in zip(target.elts, case, strict=True)}
        else:
            return [loop]
        if any(v is None for v in names.values()):
            return [loop]
        out += [_Rename(names).visit(s) for s in _copy(loop.body)]
    return out


def _literal(value: Any) -> ast.expr | None:
    try:
        node = ast.parse(repr(value), mode="eval").body
        return node if ast.literal_eval(node) == value else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None  # inf, nan and the like: keep the loop whole


# ----------------------------------------------------------------------------- splitting


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)) is not None:
        return f"{head}.{node.attr}"
    return None


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


class _Splitter:
    """Keeps host-evaluable structure, turns everything else into holes (value steps)."""

    def __init__(self, plan: AssertPlan):
        self.plan, self.holes, self.hole_nodes = plan, [], {}

    def hole(self, node: ast.expr) -> ast.Name:
        name = f"__v{len(self.holes)}"
        self.holes.append(len(self.plan.steps))
        self.hole_nodes[name] = node
        self.plan.steps.append(("value", ast.unparse(node)))
        return ast.Name(name, ast.Load())

    def visit(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name) and node.id in hosteval.TYPES:
            return node
        if isinstance(node, ast.List | ast.Tuple | ast.Set) and not any(
            isinstance(e, ast.Starred) for e in node.elts
        ):
            return type(node)(elts=[self.visit(e) for e in node.elts], ctx=ast.Load())
        if isinstance(node, ast.Dict) and None not in node.keys:
            return ast.Dict([self.visit(k) for k in node.keys], [self.visit(v) for v in node.values])
        if isinstance(node, ast.UnaryOp):
            return ast.UnaryOp(node.op, self.visit(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in hosteval.BINOPS:
            return ast.BinOp(self.visit(node.left), node.op, self.visit(node.right))
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [self.visit(v) for v in node.values])
        if isinstance(node, ast.Compare):
            return ast.Compare(self.visit(node.left), node.ops, [self.visit(c) for c in node.comparators])
        if (
            isinstance(node, ast.Call)
            and _dotted(node.func) in hosteval.CALLS
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and all(k.arg is not None for k in node.keywords)
        ):
            args = [self.visit(a) for a in node.args]
            kws = [ast.keyword(k.arg, self.visit(k.value)) for k in node.keywords]
            return ast.Call(ast.Name(_dotted(node.func), ast.Load()), args, kws)
        return self.hole(node)


def _has_hole(node: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id.startswith("__v") for n in ast.walk(node))


def _judged_here(node: ast.expr, split: _Splitter, imported: set[str]) -> bool:
    """Whether the host, not the sandbox, decides this (sub)expression's truth."""
    if isinstance(node, ast.Name) and node.id in split.hole_nodes:
        inner = split.hole_nodes[node.id]  # a bare value: its truth is the program's own answer
        return isinstance(inner, ast.Call) and _root(inner) not in imported
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _judged_here(node.operand, split, imported)
    if isinstance(node, ast.BoolOp):
        return all(_judged_here(v, split, imported) for v in node.values)
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return all(not _has_hole(a) or not _has_hole(b) for a, b in zip(sides, sides[1:], strict=False))
    if isinstance(node, ast.Call):
        return any(not _has_hole(a) for a in [*node.args, *(k.value for k in node.keywords)])
    return False


def _plan_assert(plan: AssertPlan, stmt: ast.Assert, imported: set[str]) -> None:
    steps_before = len(plan.steps)
    split = _Splitter(plan)
    template = split.visit(stmt.test)
    if _judged_here(template, split, imported):
        plan.checks.append(Check(ast.unparse(stmt), True, template, split.holes))
        return
    del plan.steps[steps_before:]  # undo the holes: the whole statement runs in the sandbox
    plan.checks.append(Check(ast.unparse(stmt), split=False, step=len(plan.steps)))
    plan.steps.append(("check", ast.unparse(stmt)))


# ----------------------------------------------------------------------------- judging


def harness_results(stdout: str, n_steps: int) -> list[dict] | None:
    """The harness's per-step results (program load first), or None if it never finished."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            try:
                results = json.loads(line[len(MARK) :])["results"]
            except (ValueError, KeyError, TypeError):
                return None
            ok = isinstance(results, list) and all(isinstance(r, dict) for r in results)
            return results if ok and len(results) <= n_steps + 1 else None
    return None


def judge(plan: AssertPlan, stdout: str) -> list[dict]:
    """One ``{"assert", "split", "ok", "why"?}`` per check of ``plan``."""
    results = harness_results(stdout, len(plan.steps))
    out = []
    for check in plan.checks:
        row = {"assert": check.source[:200], "split": check.split, "ok": False}
        out.append(row)
        if results is None:
            row["why"] = "no results: the program ended or hung before the tests finished"
            continue
        if results[0] != {"ok": True}:
            row["why"] = f"program failed to load: {results[0].get('error', '?')}"
            continue
        if not check.split:
            res = results[check.step + 1] if check.step + 1 < len(results) else {}
            row["ok"] = res == {"ok": True}
            row["why"] = None if row["ok"] else res.get("error", "not run")
            continue
        try:
            values = {}
            for k, step in enumerate(check.holes):
                res = results[step + 1] if step + 1 < len(results) else {"error": "not run"}
                if "value" not in res:
                    raise ValueError(res.get("error", "no value"))
                values[f"__v{k}"] = hosteval.decode(res["value"])
            verdict = hosteval.host_eval(check.template, values)
            row["ok"] = (
                bool(verdict) if type(verdict) in hosteval.TYPES.values() or verdict is None else False
            )
            if not row["ok"]:
                row["why"] = "assertion failed"
        except Exception as exc:  # a refused or undecodable value, or a failing comparison
            row["why"] = f"{type(exc).__name__}: {exc}"[:300]
    return out
