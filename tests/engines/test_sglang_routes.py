"""The engine guard in front of SGLang is an allow-list too: with the engine bearer, every route
SGLang 0.5.15 serves (``sglang_routes.json``, listed from its own app by ``tests/_sglang_routes.py``)
gets the verdict below, answered by the real ``SglangKeyAuth`` in front of a stand-in app that
records what reaches it. What passes is what slime and the run call on an SGLang engine:
generation, status reads, and the run's own weight path; every other weight loader, LoRA,
memory, profiling and admin route is refused with the bearer. In the slime venv, the file is
checked against SGLang's live app, and the guard that ``keyed_launch --guard=sglang`` installs is
checked on that app.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from modal_rl.engines import keyed_launch, sglang_routes
from modal_rl.engines.auth import SglangKeyAuth
from modal_rl.engines.sglang_paths import WeightDirs
from modal_rl.run_key import engine_bearer, new_run_key

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(__file__).with_name("sglang_routes.json")
SLIME_PYTHON = Path(os.environ.get("MODAL_RL_SLIME_VENV", ROOT / ".venv-slime")) / "bin" / "python"
KEY = new_run_key()
AUTH = (b"authorization", f"Bearer {engine_bearer(KEY)}".encode())
A, R, OPEN, C = sglang_routes.ALLOW, sglang_routes.REFUSE, sglang_routes.OPEN, sglang_routes.CHECK
WS = "WEBSOCKET"

ALLOWED = {
    # generation
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/abort_request"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/tokenize"),
    ("POST", "/v1/detokenize"),
    ("GET", "/health_generate"),
    # status reads (slime's external-engine discovery, its router, the weight version)
    ("GET", "/v1/models"),
    ("GET", "/get_model_info"),
    ("GET", "/model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/server_info"),
    ("GET", "/get_load"),
    ("GET", "/v1/loads"),
    ("GET", "/get_weight_version"),
    ("GET", "/weight_version"),
    ("GET", "/ping"),
    # the run's weight path: slime's disk path and SglangEngine.catch_up
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("GET", "/flush_cache"),
    ("POST", "/flush_cache"),
}
# The two weight routes that take a path: open only for a body naming the engine's own weight
# directories (tests/engines/test_sglang_weight_paths.py); the ``{}`` sent here names none.
CHECKED = {("POST", "/pull_weights"), ("POST", "/update_weights_from_disk")}
# Routes SGLang adds at launch (not in the app's table at import) or a newer one might.
EXTRA = {
    ("GET", "/metrics"): A,  # --enable-metrics mounts it at start
    ("POST", "/update_weights_from_agent"): R,
    ("GET", "/no/such/route"): R,
}


def listed() -> list[tuple[str, str]]:
    """(method, path) for every route in the committed list (a websocket as ``WEBSOCKET``)."""
    out = []
    for route in json.loads(LIST.read_text()):
        for method in route["methods"] or [WS]:
            out.append((method, route["path"]))
    return out


def want(route) -> str:
    if route == ("GET", "/health"):
        return OPEN
    if route in EXTRA:
        return EXTRA[route]
    if route in CHECKED:
        return C
    return A if route in ALLOWED else R


def concrete(path: str) -> str:
    return path.replace("{response_id}", "resp-1").replace("{model:path}", "m")


def ask(method: str, path: str, headers=(AUTH,), kind: str = "http"):
    """(status or close code, what reached the app) for one request through the guard."""
    reached = []

    async def app(scope, receive, send):
        reached.append((scope["method"] if kind == "http" else WS, scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ran"})

    out = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        out.append(message)

    scope = {"type": kind, "path": path, "root_path": "", "headers": list(headers)}
    if kind == "http":
        scope["method"] = method
    asyncio.run(SglangKeyAuth(app, key=KEY)(scope, receive, send))
    first = out[0]
    return first.get("status", first.get("code")), reached


def test_the_list_is_sglangs_table_and_every_allowed_route_is_in_it():
    routes = listed()
    assert len(routes) > 80 and ("POST", "/update_weights_from_tensor") in routes
    assert set(routes) >= ALLOWED | CHECKED  # no allowed row for a route SGLang does not have


@pytest.mark.parametrize("route", sorted(set(listed()) | set(EXTRA)), ids=lambda r: f"{r[0]} {r[1]}")
def test_every_sglang_route_gets_its_verdict_with_the_bearer(route):
    method, path = route
    if method == WS:  # no route of the run's is a websocket: closed before it is accepted
        code, reached = ask("GET", path, kind="websocket")
        assert code == 1008 and reached == []
        return
    expected = want(route)
    assert sglang_routes.verdict(method, concrete(path)) == expected
    status, reached = ask(method, concrete(path))
    if expected in (R, C):  # a checked route's body ``{}`` names no path: refused too
        assert status == 403 and reached == []
    else:
        assert status == 200 and reached == [(method, concrete(path))]


@pytest.mark.parametrize(
    "route", sorted(set(listed()) - {("GET", "/health")}), ids=lambda r: f"{r[0]} {r[1]}"
)
def test_without_the_bearer_only_the_health_status_passes(route):
    method, path = route
    if method == WS:
        return
    status, reached = ask(method, concrete(path), headers=())
    assert status == 401 and reached == []


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--guard=sglang", "sglang.launch_server", "--tokenizer-worker-num", "2"], "tokenizer workers"),
        (["--guard=sglang", "sglang.launch_server", "--tokenizer-worker-num=4"], "tokenizer workers"),
        (["--guard=sglang", "sglang.launch_server", "--enable-http2"], "HTTP/2"),
        (["--guard=vllm", "sglang.launch_server"], "the one guard is --guard=sglang"),
    ],
)
def test_a_launch_the_guard_would_not_cover_stops_in_one_line(args, needle, capsys, monkeypatch):
    monkeypatch.setenv("MODAL_RL_ENGINE_BEARER", engine_bearer(KEY))
    assert keyed_launch.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and engine_bearer(KEY) not in err
    ok = ["--guard=sglang", "m", "--tokenizer-worker-num", "1"]
    assert keyed_launch.parse_argv(ok) == ([], "sglang", "m", ["--tokenizer-worker-num", "1"])


LIVE_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tests._sglang_routes import dumps, routes
table = routes()  # imports SGLang's http_server
from modal_rl.engines.auth import install_sglang_guard
install_sglang_guard()  # what keyed_launch --guard=sglang does before SGLang starts
from starlette.testclient import TestClient
from sglang.srt.entrypoints.http_server import app
bearer = {"Authorization": "Bearer " + sys.argv[2]}
client = TestClient(app, raise_server_exceptions=False)  # no lifespan: SGLang's start stays off
seen = {}
inside = {"model_path": sys.argv[3] + "/weight_v000001"}  # under MODAL_RL_SGLANG_WEIGHT_DIRS
for method, path, body in [("POST", "/update_weights_from_tensor", {}), ("POST", "/load_lora_adapter", {}),
                           ("POST", "/init_weights_update_group", {}), ("GET", "/get_model_info", {}),
                           ("POST", "/update_weights_from_disk", inside),
                           ("POST", "/update_weights_from_disk", {"model_path": "/etc"})]:
    answer = client.request(method, path, headers=bearer, json=body)
    label = method + " " + path + (" " + json.dumps(body) if body else "")
    seen[label] = [answer.status_code, "modal_rl's engine guard" in answer.text]
print(json.dumps({"list": dumps(table), "seen": seen}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not SLIME_PYTHON.exists(), reason="needs the slime venv (scripts/install_slime_cpu.sh)")
def test_the_list_matches_sglangs_live_app_and_the_installed_guard_refuses_there(tmp_path):
    env = {**os.environ, "MODAL_RL_ENGINE_BEARER": engine_bearer(KEY), "TMPDIR": str(tmp_path)}
    env.update(WeightDirs.of(load=[str(tmp_path)]).env())
    run = subprocess.run(
        [str(SLIME_PYTHON), "-c", LIVE_CHECK, str(ROOT), engine_bearer(KEY), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["list"] == LIST.read_text(), (
        "SGLang's routes changed: regenerate sglang_routes.json and give each new route a verdict"
    )
    seen = got["seen"]
    inside = json.dumps({"model_path": f"{tmp_path}/weight_v000001"})
    for refused in (
        "POST /update_weights_from_tensor",
        "POST /load_lora_adapter",
        "POST /init_weights_update_group",
        'POST /update_weights_from_disk {"model_path": "/etc"}',
    ):
        assert seen[refused] == [403, True], seen
    for allowed in ("GET /get_model_info", f"POST /update_weights_from_disk {inside}"):
        assert seen[allowed][0] != 403 and not seen[allowed][1], seen  # past the guard, SGLang answers
