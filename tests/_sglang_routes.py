"""Print SGLang's HTTP route table as JSON, from the app its HTTP server serves, without
starting an engine.

``python tests/_sglang_routes.py`` (in the slime venv, ``.venv-slime``) ->
``[{"path", "methods", "kind"}, ...]`` for every route, mounted app and websocket route of
``sglang.srt.entrypoints.http_server.app``, sorted. The committed copy,
``tests/engines/sglang_routes.json``, is what the guard's verdict test walks; the slime-venv test
checks that it is still SGLang's table.
"""

from __future__ import annotations

import json


def routes() -> list[dict]:
    from slime_modal.cpu import torchvision_ops

    torchvision_ops.install()  # the PyPI torchvision is a CUDA build: SGLang's import needs this
    from sglang.srt.entrypoints.http_server import app

    out = []
    for route in _flat(getattr(app, "routes", [])):
        methods = sorted(getattr(route, "methods", None) or [])
        out.append({"path": route.path, "methods": methods, "kind": type(route).__name__})
    return sorted(out, key=lambda r: (r["path"], r["methods"]))


def _flat(routes):
    """Every route, those of included routers too: FastAPI >= 0.16x keeps an included router
    as one entry that has no path of its own and lists its routes on demand."""
    for route in routes:
        if hasattr(route, "effective_route_contexts"):
            for context in route.effective_route_contexts():
                yield context.starlette_route or context.original_route
        else:
            yield route


def dumps(table: list[dict]) -> str:
    """The committed file's form: one route per line."""
    return "[\n" + ",\n".join(json.dumps(r) for r in table) + "\n]\n"


if __name__ == "__main__":
    print(dumps(routes()), end="")
