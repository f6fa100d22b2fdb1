"""Runs many launcher command lines in one process (verl is imported once), for
``tests/e2e/test_modal_examples_conformance.py``.

``python tests/_conformance_runner.py CASES.json`` where CASES.json is a list of
``{"module": "verl_modal" | "slime_modal", "argv": [...]}``; prints one JSON list of
``{"code", "stdout", "stderr", "seconds"}``, in order. The Hugging Face Hub is pointed at a
closed local port, so a dry run that reached for the network would fail (or stall) here.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import time


def run_one(module: str, argv: list[str]) -> dict:
    main = importlib.import_module(f"{module}.__main__").main
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own exits
            code = exc.code if isinstance(exc.code, int) else 2
    return {
        "code": code,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "seconds": round(time.monotonic() - started, 2),
    }


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    results = [run_one(case["module"], case["argv"]) for case in cases]
    sys.__stdout__.write(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
