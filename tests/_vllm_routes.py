"""Print vLLM's HTTP route table as JSON, built the way ``vllm serve`` builds its app (same
flags, same environment, e.g. ``VLLM_SERVER_DEV_MODE``), without starting an engine.

``python tests/_vllm_routes.py SERVE_ARGS...`` -> ``[{"path", "methods", "kind"}, ...]`` for
every route, mounted app and websocket route, including those left out of ``/openapi.json``.
Used by the engine-auth tests so that a route a new vLLM adds is covered without a test edit.
"""

from __future__ import annotations

import json
import sys


def routes(argv: list[str]) -> list[dict]:
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    app = build_app(args, ("generate",))
    out = []
    for route in getattr(app, "routes", []):
        kind = type(route).__name__
        methods = sorted(getattr(route, "methods", None) or [])
        out.append({"path": route.path, "methods": methods, "kind": kind})
    return out


if __name__ == "__main__":
    print(json.dumps(routes(sys.argv[1:])))
