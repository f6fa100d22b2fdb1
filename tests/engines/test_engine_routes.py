"""The engine guard is an allow-list: with the engine bearer, every route vLLM 0.32 serves (dev
routes and runtime LoRA on, as our engines run) gets the verdict below, answered by the real
``RunKeyAuth`` in front of a stand-in app that records what reaches it. The table is vLLM's own
(``tests/_vllm_routes.py`` prints it; ``tests/e2e/test_engine_auth_vllm.py`` checks a live engine's
table has no route missing here). SGLang's engines have their own table (``tests/engines/test_sglang_routes.py``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from modal_rl.engines import routes as engine_routes
from modal_rl.engines.auth import RunKeyAuth
from modal_rl.run_key import engine_bearer, new_run_key
from tests.asgi_server import recording_app

KEY = new_run_key()
AUTH = (b"authorization", f"Bearer {engine_bearer(KEY)}".encode())
A, C, R = engine_routes.ALLOW, engine_routes.CHECK, engine_routes.REFUSE

# Every (method, path) of vLLM 0.32's route table (``_vllm_routes.py`` with
# VLLM_SERVER_DEV_MODE=1, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora) and its verdict.
VLLM_0_32 = {
    ("GET", "/openapi.json"): R,
    ("GET", "/docs"): R,
    ("GET", "/docs/oauth2-redirect"): R,
    ("GET", "/redoc"): R,
    ("GET", "/load"): R,
    ("GET", "/version"): A,
    ("GET", "/kv_event_sources"): R,
    ("GET", "/health"): engine_routes.OPEN,
    ("GET", "/metrics"): A,
    ("POST", "/v1/load_lora_adapter"): C,
    ("POST", "/v1/unload_lora_adapter"): A,
    ("POST", "/tokenize"): A,
    ("POST", "/detokenize"): A,
    ("GET", "/v1/models"): A,
    ("POST", "/v1/systemone"): R,
    ("GET", "/ping"): A,
    ("POST", "/ping"): R,
    ("POST", "/invocations"): R,
    ("POST", "/reset_prefix_cache"): A,
    ("POST", "/reset_mm_cache"): R,
    ("POST", "/reset_encoder_cache"): R,
    ("POST", "/collective_rpc"): C,
    ("GET", "/server_info"): R,
    ("POST", "/sleep"): A,
    ("POST", "/release_kv_cache_memory"): R,
    ("POST", "/wake_up"): A,
    ("GET", "/is_sleeping"): A,
    ("POST", "/pause"): A,
    ("POST", "/resume"): A,
    ("POST", "/abort_requests"): R,
    ("GET", "/is_paused"): A,
    ("POST", "/init_weight_transfer_engine"): R,
    ("POST", "/shutdown_weight_transfer_engine"): R,
    ("POST", "/start_weight_update"): R,
    ("POST", "/start_draft_weight_update"): R,
    ("POST", "/update_weights"): R,
    ("POST", "/finish_weight_update"): R,
    ("POST", "/update_weight_version"): R,
    ("GET", "/weight_info"): R,
    ("POST", "/weight_checker"): R,
    ("GET", "/get_world_size"): R,
    ("POST", "/v1/chat/completions"): A,
    ("POST", "/v1/chat/completions/batch"): R,
    ("POST", "/v1/responses"): A,
    ("GET", "/v1/responses/{response_id}"): A,
    ("POST", "/v1/responses/{response_id}/cancel"): A,
    ("POST", "/v1/completions"): A,
    ("POST", "/v1/messages"): A,
    ("POST", "/v1/messages/count_tokens"): A,
    ("POST", "/generative_scoring"): R,
    ("POST", "/scale_elastic_ep"): R,
    ("POST", "/is_scaling_elastic_ep"): R,
    ("POST", "/v1/chat/completions/render"): R,
    ("POST", "/v1/messages/render"): R,
    ("POST", "/v1/completions/render"): R,
    ("POST", "/v1/responses/render"): R,
    ("POST", "/v1/chat/completions/derender"): R,
    ("POST", "/v1/completions/derender"): R,
    ("POST", "/inference/v1/generate"): A,
    ("POST", "/inference/v1/abort_requests"): A,
    ("POST", "/adapters"): R,
    ("DELETE", "/adapters/{adapter_name}"): R,
    # vLLM's profiler routes (on with a profiler config), and what a newer vLLM might add.
    ("POST", "/start_profile"): R,
    ("POST", "/stop_profile"): R,
    ("POST", "/update_config"): R,
    ("GET", "/no/such/route"): R,
}


def concrete(path: str) -> str:
    return path.replace("{response_id}", "resp-1").replace("{adapter_name}", "a")


def ask(method: str, path: str, body: bytes = b"{}", headers=(AUTH,), chunks: int = 1):
    """(status, response body, what reached the app) for one request through the guard."""
    reached = []
    app = recording_app(b"ran", lambda scope, got: reached.append((scope["method"], scope["path"], got)))
    size = max(1, -(-len(body) // chunks))  # contiguous pieces: the guard has to join them
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
    ]
    out = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        out.append(message)

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": list(headers)}
    asyncio.run(RunKeyAuth(app, key=KEY)(scope, receive, send))
    status = out[0]["status"]
    return status, b"".join(m.get("body", b"") for m in out[1:]), reached


def rpc(method, **extra) -> bytes:
    return json.dumps({"method": method, "args": [], **extra}).encode()


@pytest.mark.parametrize("route", sorted(VLLM_0_32), ids=lambda r: f"{r[0]} {r[1]}")
def test_every_vllm_route_gets_its_verdict_with_the_bearer(route):
    method, path = route
    want = VLLM_0_32[route]
    assert engine_routes.verdict(method, concrete(path)) == want
    body = rpc("modal_rl_stage_status") if path == "/collective_rpc" else b"{}"
    status, answer, reached = ask(method, concrete(path), body)
    if want == R:
        assert status == 403 and b"forbidden by modal_rl's engine guard" in answer and reached == []
    elif want in (A, engine_routes.OPEN) or path == "/collective_rpc":
        assert status == 200 and reached == [(method, concrete(path), body)]
    else:  # a LoRA load with no valid name and path
        assert status == 403 and reached == []


@pytest.mark.parametrize(
    "method",
    [
        "reload_weights",
        "update_config",
        "save_sharded_state",
        "sleep",
        "modal_rl_",
        "Modal_rl_x",
        "modal_rl_x/y",
    ],
)
def test_collective_rpc_runs_only_our_own_methods(method):
    status, answer, reached = ask("POST", "/collective_rpc", rpc(method))
    assert status == 403 and reached == [] and b"modal_rl_" in answer


def test_collective_rpc_with_our_method_reaches_the_engine_whole_even_in_pieces():
    body = rpc("modal_rl_pull_weights", timeout=30.0, kwargs={"pad": "x" * 5000})
    status, _, reached = ask("POST", "/collective_rpc", body, chunks=7)
    assert status == 200 and reached == [("POST", "/collective_rpc", body)]


@pytest.mark.parametrize(
    "body, headers",
    [
        (b'{"method": "modal_rl_stage_status", "method": "reload_weights"}', (AUTH,)),
        (rpc("modal_rl_stage_status"), (AUTH, (b"content-encoding", b"gzip"))),
        (b"[1]", (AUTH,)),
        (b"not json", (AUTH,)),
        (b'{"method": "modal_rl_x", "pad": "' + b"x" * (engine_routes.MAX_CHECKED_BODY + 1) + b'"}', (AUTH,)),
    ],
    ids=["duplicate-keys", "encoded", "not-an-object", "not-json", "oversized"],
)
def test_a_checked_body_that_could_be_read_two_ways_is_refused(body, headers):
    status, _, reached = ask("POST", "/collective_rpc", body, headers)
    assert status == 403 and reached == []


def test_without_the_bearer_every_route_is_401_before_any_verdict():
    for method, path in VLLM_0_32:
        if (method, path) == ("GET", "/health"):
            continue
        status, _, reached = ask(method, concrete(path), rpc("modal_rl_x"), headers=())
        assert status == 401 and reached == []


@pytest.fixture()
def staging(tmp_path, monkeypatch):
    root = tmp_path / "adapters"
    monkeypatch.setenv(engine_routes.ADAPTER_DIR_ENV, str(root))
    return root


def lora(name, path) -> bytes:
    return json.dumps({"lora_name": name, "lora_path": path}).encode()


def test_a_lora_adapter_loads_from_the_staging_directory_by_name(staging):
    body = lora("policy-v3", f"{staging}/policy-v3")
    status, _, reached = ask("POST", "/v1/load_lora_adapter", body)
    assert status == 200 and reached == [("POST", "/v1/load_lora_adapter", body)]


@pytest.mark.parametrize(
    "name, leaf",
    [
        ("policy-v3", "/etc/x"),  # an arbitrary absolute path
        ("policy-v3", "{root}/../x"),
        ("policy-v3", "{root}/sub/policy-v3"),
        ("policy-v3", "{root}//policy-v3"),
        ("policy-v3", "{root}/.hidden"),
        ("policy-v3", "{root}/"),
        ("../x", "{root}/policy-v3"),
        ("/abs", "{root}/policy-v3"),
        ("a/b", "{root}/policy-v3"),
        (None, "{root}/policy-v3"),
        ("policy-v3", None),
        ("p\x1b]52;c;eA==\x07", "{root}/policy-v3"),
    ],
)
def test_a_lora_load_from_anywhere_else_or_by_a_bad_name_is_refused(staging, name, leaf):
    path = leaf.format(root=staging) if isinstance(leaf, str) else leaf
    status, answer, reached = ask("POST", "/v1/load_lora_adapter", lora(name, path))
    assert status == 403 and reached == []
    assert b"\x1b" not in answer and b"\\u001b" not in answer  # the refusal echoes no escape


@pytest.mark.parametrize("prefix", ["/abs/dir", "../../x", "a/b", "..", ".x", "", "x" * 200])
def test_an_adapter_prefix_is_one_safe_path_component(prefix):
    from modal_rl.weightsync.apply.lora import AdapterVersions

    with pytest.raises(ValueError, match="one path component"):
        AdapterVersions(prefix=prefix)
    with pytest.raises(ValueError, match="one path component"):
        engine_routes.adapter_name(prefix)


def test_the_engine_stages_adapters_only_under_the_root_by_a_safe_name(staging, tmp_path):
    """The worker side: a signed request's prefix of ``/abs`` or ``../..`` writes nothing."""
    from modal_rl.weightsync.apply import vllm_lora

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")

    class Sub:
        live_version, refused, target_epoch = 3, [], None

        class chain:
            state = {}

        def stage_until(self, *a, **k):
            return []

    class Worker(vllm_lora.AdapterStageMixin):
        rank = 0

        def _modal_rl_verified_subscriber(self, request, signature):
            return Sub(), json.loads(request)

    for prefix in (str(victim), "../../x"):
        req = {"version": 3, "adapter": {"prefix": prefix, "keep": 1, "config": {}}}
        with pytest.raises(ValueError, match="one path component"):
            Worker().modal_rl_stage_adapter(json.dumps(req), "")
    assert (victim / "keep").read_text() == "x" and not (tmp_path / "x").exists()
    assert not staging.exists() or list(staging.iterdir()) == []


def test_each_local_engine_stages_adapters_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """Engines of one pool share its TMPDIR; their staging directories (the one place their
    guard loads adapters from) must not be shared, or one engine's pruning removes another's."""
    import sys

    from modal_rl.engines.pool import EngineSpec, get_engine_pool

    monkeypatch.delenv(engine_routes.ADAPTER_DIR_ENV, raising=False)
    serve = (
        "import os, sys, http.server; print('LORA', os.environ['MODAL_RL_LORA_DIR'], flush=True); "
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)"
        ".serve_forever()"
    )
    spec = EngineSpec(
        command=(sys.executable, "-c", serve, "{port}"),
        count=2,
        auth=None,
        health_path="/",
        startup_timeout_s=60,
    )
    pool = get_engine_pool(spec, "local", log_dir=str(tmp_path / "logs"))
    try:
        pool.start()
        dirs = set()
        for index in range(2):
            lines = pool.log_path(index).read_text().splitlines()
            dirs |= {line.split(" ", 1)[1] for line in lines if line.startswith("LORA ")}
    finally:
        pool.stop()
    assert len(dirs) == 2
