"""A tiny inference-server stand-in for engine-pool tests: real process, real HTTP, real port.

``python tests/_engine_server.py --port P [--mode ok|crash-first|hang|crash] [--state DIR]
[--setsid-child] [SGLang flags...]``. It answers ``GET /health`` and the vLLM / SGLang endpoints the adapters
call, records every request it gets to ``DIR/<port>.jsonl`` (so tests can check what reached
the server), and, for ``/v1/completions``, echoes the prompt's token ids plus one as the output.
``crash-first``: the first process to start (an O_EXCL flag file in DIR) exits 3 at start.
``--setsid-child`` forks a ``sleep`` into its own session, to test that teardown finds it.
``--require-key``: as our keyed engines, the key comes from ``MODAL_RL_RUN_KEY`` (exit 2 without
it) and every request but ``GET /health`` needs ``Authorization: Bearer <key>`` (else 401,
recorded as refused). At start it prints whether the run key is in its environment.
``--log-args``: at start it also logs what SGLang logs when ``keyed_launch`` gave it the key
(``server_args=ServerArgs(..., api_key='<key>', admin_api_key='<key>')``), and a key derived from
it in hex and base64 (as a careless engine could), a piece at a time without newlines in between
(so a pump that reads chunks sees keys cut anywhere); the key comes from ``MODAL_RL_RUN_KEY``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--state", default=None)
    ap.add_argument("--setsid-child", action="store_true")
    ap.add_argument("--require-key", action="store_true")
    ap.add_argument("--log-args", action="store_true")
    # SGLang's own flags, reported back by /server_info as SGLang does.
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--pp-size", type=int, default=1)
    ap.add_argument("--enable-memory-saver", action="store_true")
    args, unknown = ap.parse_known_args()
    info = {
        "model_path": args.model_path,
        "tp_size": args.tp_size,
        "pp_size": args.pp_size,
        "enable_memory_saver": args.enable_memory_saver,
        "unknown_args": unknown,
    }
    print(f"fake engine starting on {args.host}:{args.port} mode={args.mode}", flush=True)
    key = os.environ.get("MODAL_RL_ENGINE_BEARER")  # what a keyed engine holds: never the run key
    print(f"run key in env: {'yes' if os.environ.get('MODAL_RL_RUN_KEY') else 'no'}", flush=True)
    print(f"engine bearer in env: {'yes' if key else 'no'}", flush=True)
    if args.require_key and not key:
        print("fake engine: no MODAL_RL_ENGINE_BEARER", flush=True)
        sys.exit(2)
    if args.log_args and key:
        _log_args(args, key)
    if args.setsid_child:
        subprocess.Popen(["setsid", "sleep", "600"])
    if args.mode == "crash" or (args.mode == "crash-first" and _first(args.state)):
        print("RuntimeError: could not load model weights", flush=True)
        sys.exit(3)
    if args.mode == "hang":
        print("loading model ...", flush=True)
        time.sleep(3600)
    record = os.path.join(args.state, f"{args.port}.jsonl") if args.state else None

    class Handler(http.server.BaseHTTPRequestHandler):
        def _log(self, body, refused=False):
            if record:
                entry = {"method": self.command, "path": self.path, "body": body, "refused": refused}
                with open(record, "a") as f:
                    f.write(json.dumps(entry) + "\n")

        def _refused(self) -> bool:
            if not args.require_key or (self.command == "GET" and self.path == "/health"):
                return False
            if self.headers.get_all("Authorization") == [f"Bearer {key}"]:
                return False
            self._log(None, refused=True)
            self._reply({"error": "unauthorized"}, 401)
            return True

        def _reply(self, payload, code=200):
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self._refused():
                return
            self._log(None)
            if self.path in ("/health", "/health_generate"):
                return self._reply({})
            if self.path in ("/server_info", "/get_server_info"):
                return self._reply(info)
            return self._reply({"error": "not found"}, 404)

        def do_POST(self):  # noqa: N802
            if self._refused():
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
            self._log(body)
            if self.path == "/v1/completions":
                ids = [t + 1 for t in body["prompt"]][: body.get("max_tokens", 16)]
                choice = {"token_ids": ids, "finish_reason": "length", "text": ""}
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"token_logprobs": [-0.5] * len(ids)}
                return self._reply({"choices": [choice]})
            return self._reply({"status": "ok"})

        def log_message(self, *a):
            pass

    http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


def _log_args(args, key: str) -> None:
    import base64

    from modal_rl.run_key import derive

    # What an engine derives from what it holds: the record-MAC key, from the frame-read secret.
    reader = os.environ.get("MODAL_RL_FRAME_READ_KEY", "").partition(".")[0]
    pull = derive(reader, "weightsync-frame-mac")
    line = (
        f"server_args=ServerArgs(model_path={args.model_path!r}, host={args.host!r}, port={args.port}, "
        f"api_key={key!r}, admin_api_key={key!r}) pull_key={pull.hex()} b64={base64.b64encode(pull).decode()}\n"
    )
    for i in range(0, len(line), 7):  # pieces cut through the keys, each flushed on its own
        sys.stderr.write(line[i : i + 7])
        sys.stderr.flush()
        time.sleep(0.001)


def _first(state: str | None) -> bool:
    try:
        os.close(os.open(os.path.join(state or "/tmp", "first"), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


if __name__ == "__main__":
    main()
