"""Entry point: ``python -m benchmarks <suite> [--quick] [--out DIR]``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import benchmarks


def available_suites() -> list[str]:
    """Suite names are module names with '-' for '_'; private modules are helpers, not suites."""
    names = []
    for info in pkgutil.iter_modules(benchmarks.__path__):
        if info.name.startswith("_") or info.name == "report":
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        if hasattr(module, "run"):
            names.append(info.name.replace("_", "-"))
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("suite", help="suite to run; 'list' prints the available ones")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI and a first look")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks"), help="output directory")
    parser.add_argument(
        "--slime-src", type=Path, help="weight-sync: also measure slime's own code from this checkout"
    )
    parser.add_argument(
        "--only",
        help="chaos: run only this scenario (e.g. a_engine_kill); weight-sync-scale: only these "
        "comma-separated rows (e.g. moe-0.15gb-1x1-pinned)",
    )
    args = parser.parse_args(argv)
    if args.suite == "list":
        print("\n".join(available_suites()))
        return 0
    module_name = f"benchmarks.{args.suite.replace('-', '_')}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"unknown suite {args.suite!r}; available: {', '.join(available_suites())}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    extra = {"slime_src": args.slime_src} if args.slime_src else {}  # only weight-sync takes it
    extra |= {"only": args.only} if args.only else {}  # only chaos and weight-sync-scale take it
    from modal_rl.progress import phase

    with phase(f"benchmark suite {args.suite}{' (quick)' if args.quick else ''}", prefix="[benchmarks] "):
        module.run(quick=args.quick, out=args.out, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
