"""In-sandbox test harness for assert-style tests: stdlib only, written next to the program.

The host (``modal_rl.sandboxes.verdict``) sends a plan: the program's source and a list of
steps. ``exec`` steps are the test's setup (imports, helpers) and run in the program's
namespace; ``value`` steps are the expressions whose values the host judges (the calls of
``assert f(x) == <expected>``; the expected side never enters the sandbox); ``check`` steps
are whole statements the host could not split, run here and reported as passed or failed.

Output: the program's own stdout goes to stderr; one line ``MODAL_RL_RESULTS <json>`` on the
original stdout when every step has run, then ``os._exit(0)``. A program that exits, kills
itself or hangs before that line leaves no results, which the host scores as a failure: the
harness, not the exit code, says the run completed.

Values are encoded strictly (``encode``): only exact ``None/bool/int/float/complex/str/bytes``
and ``list/tuple/set/frozenset/dict`` of them. An instance of any other type, including a
subclass of a builtin or an object with its own ``__eq__``, is refused (the step fails), so
nothing the program defines takes part in the host's comparison.
"""

import base64
import builtins
import json
import os
import sys

MARK = "MODAL_RL_RESULTS "
_LEAVES = {type(None), bool, int, float, complex, str, bytes}
_SEQS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_MAX_NODES = 1_000_000


class Refused(Exception):
    """A value the host will not judge."""


def encode(value, budget=None):
    budget = budget if budget is not None else [_MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise Refused("value too large")
    t = type(value)  # exact type: subclasses are refused, never unwrapped
    if t is type(None):
        return ["none"]
    if t is bool:
        return ["bool", value]
    if t is int:
        return ["int", int.__repr__(value)]
    if t is float:
        return ["float", float.hex(value)]
    if t is complex:
        return ["complex", float.hex(value.real), float.hex(value.imag)]
    if t is str:
        return ["str", value]
    if t is bytes:
        return ["bytes", base64.b64encode(value).decode()]
    if t in _SEQS:
        return [_SEQS[t], [encode(v, budget) for v in value]]
    if t is dict:
        return ["dict", [[encode(k, budget), encode(v, budget)] for k, v in dict.items(value)]]
    raise Refused(f"a {t.__module__}.{t.__qualname__} is not a plain value")


def _err(exc):
    return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def main():
    plan = json.loads(sys.stdin.buffer.read())
    out = os.dup(1)
    os.dup2(2, 1)  # the program's prints must not mix with the results line
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(plan["program"], "solution.py", "exec"), ns)
        results = [{"ok": True}]
    except BaseException as exc:  # SystemExit included: the program did not load
        results = [_err(exc)]
    ready = results[0] == {"ok": True}
    for kind, src in plan["steps"] if ready else []:
        try:
            if kind == "exec":
                exec(compile(src, "<test>", "exec"), ns)
                results.append({"ok": True})
            elif kind == "value":
                value = eval(compile(src, "<test>", "eval"), ns)
                results.append({"value": encode(value)})
            else:
                exec(compile(src, "<test>", "exec"), ns)
                results.append({"ok": True})
        except BaseException as exc:
            results.append(_err(exc))
            if kind == "exec":
                break  # the setup failed: what follows cannot run as the test meant
    data = (MARK + json.dumps({"results": results}) + "\n").encode()
    while data:
        data = data[os.write(out, data) :]
    os._exit(0)


if __name__ == "__main__":
    main()
