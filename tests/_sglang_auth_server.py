"""A stand-in SGLang server that enforces keys the way SGLang's HTTP server does.

Run as a module (``-m _sglang_auth_server`` or through ``modal_rl.engines.keyed_launch``):
``--host H --port P [--api-key K] [--admin-api-key A] [--model-path M] [--argv-out FILE]``.
Rules, as SGLang's ``decide_request_auth``: ``/health*``, ``/ready*``, ``/metrics*`` always
open; admin routes (``ADMIN`` below, e.g. ``/update_weights_from_disk``, ``/pull_weights``)
need the admin key when one is set (else the API key); every other route needs the API key
when one is set. ``/server_info`` reports ``api_key`` and the launch command, as SGLang does.
Every request that passed auth is appended to ``--state DIR/<port>.jsonl`` (method, path,
size, and the body's first 300 bytes); ``--argv-out``
receives this process's ``sys.argv`` as JSON at start (to check what the launcher added).
At start it logs its parsed arguments as SGLang's ``_launch_subprocesses`` does
(``logger.info(f"{server_args=}")`` through its ``[%(asctime)s] %(message)s`` format, to
stderr): ``server_args=ServerArgs(..., api_key='...', admin_api_key='...')``, keys in plain.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
import os
import sys
import time

from aiohttp import web

ADMIN = {
    "/update_weights_from_disk",
    "/pull_weights",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
}
OPEN = ("/health", "/ready", "/metrics")


@dataclasses.dataclass
class ServerArgs:  # the fields SGLang's own dataclass has, in its order; its repr is what it logs
    model_path: str | None
    host: str
    port: int
    api_key: str | None
    admin_api_key: str | None


def allowed(path: str, header: str | None, api_key: str | None, admin_key: str | None) -> bool:
    if path.startswith(OPEN):
        return True
    need = (admin_key or api_key) if path in ADMIN else api_key
    if not need:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), need.encode())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key")
    ap.add_argument("--admin-api-key")
    ap.add_argument("--model-path")
    ap.add_argument("--state")
    ap.add_argument("--argv-out")
    ap.add_argument("--enable-memory-saver", action="store_true")
    args, _ = ap.parse_known_args()
    server_args = ServerArgs(args.model_path, args.host, args.port, args.api_key, args.admin_api_key)
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {server_args=}", file=sys.stderr, flush=True)
    if args.argv_out:
        with open(args.argv_out, "w") as f:
            json.dump({"argv": sys.argv, "pid": os.getpid()}, f)

    @web.middleware
    async def auth(request, handler):
        if not allowed(request.path, request.headers.get("Authorization"), args.api_key, args.admin_api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.read()
        if args.state:
            with open(os.path.join(args.state, f"{args.port}.jsonl"), "a") as f:
                f.write(
                    json.dumps(
                        {
                            "method": request.method,
                            "path": request.path,
                            "bytes": len(body),
                            "body": body[:300].decode(errors="replace"),
                        }
                    )
                    + "\n"
                )
        return await handler(request)

    async def health(request):
        return web.json_response({})

    async def server_info(request):
        info = {
            "model_path": args.model_path,
            "tp_size": 1,
            "pp_size": 1,
            "enable_memory_saver": args.enable_memory_saver,  # SGLang reports every server arg
            "api_key": args.api_key,
            "admin_api_key": args.admin_api_key,
            "launch_command": " ".join(sys.argv),
        }
        return web.json_response(info)

    async def ok(request):
        return web.json_response({"success": True, "path": request.path})

    app = web.Application(middlewares=[auth], client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_route("*", "/{tail:.*}", ok)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
