"""``python -m modal_rl.cluster.node --plan FILE --rank I [--addresses A,B,...]``: one node.

What the local backend starts once per rank; the same ``bootstrap`` runs in Modal containers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from modal_rl.cluster.bootstrap import bootstrap
from modal_rl.cluster.plan import BootstrapPlan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modal_rl.cluster.node")
    parser.add_argument("--plan", type=Path, required=True, help="BootstrapPlan JSON")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument(
        "--addresses", default=None, help="comma-separated node addresses; default: the plan's"
    )
    args = parser.parse_args(argv)
    plan = BootstrapPlan.from_json(args.plan.read_text())
    addresses = args.addresses.split(",") if args.addresses else plan.addresses
    if not addresses:
        parser.error("no addresses: pass --addresses or put them in the plan")
    return bootstrap(args.rank, addresses, plan)


if __name__ == "__main__":
    sys.exit(main())
