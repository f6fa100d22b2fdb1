"""The engine bearer cannot make an SGLang engine load (or pull into) any path on its disk.

``/update_weights_from_disk`` and ``/pull_weights`` are open to the bearer only for bodies whose
paths, after symlinks and ``..`` are resolved, lie under the directories the engine was launched
with (``sglang_paths``). Here the real ``SglangKeyAuth`` runs in front of a stand-in app on a
real uvicorn server on 127.0.0.1 (the app records every request that reaches it, body and all),
over a real directory tree with symlinks out of and within the roots; a hypothesis fuzz drives
the body check directly.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modal_rl.engines import keyed_launch
from modal_rl.engines.auth import SglangKeyAuth
from modal_rl.engines.sglang import DiskReload, SglangEngine
from modal_rl.engines.sglang_paths import MAX_BODY, WEIGHT_DIRS_ENV, WeightDirs, body_refusal
from modal_rl.run_key import engine_bearer, new_run_key
from tests.asgi_server import recording_app, serve_on_loopback

KEY = new_run_key()
AUTH = {"Authorization": f"Bearer {engine_bearer(KEY)}"}
UPDATE, PULL = "/update_weights_from_disk", "/pull_weights"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, str]:
    """model/, disk/weight_v00000{1,2}/, local/ (the engine's dirs) and other/ (a checkpoint
    the engine must not load), with symlinks: disk/escape -> other, disk/inner -> a version."""
    base = tmp_path_factory.mktemp("weights")
    for sub in ("model", "disk/weight_v000001", "disk/weight_v000002", "local", "other/ckpt"):
        (base / sub).mkdir(parents=True)
    (base / "disk" / "escape").symlink_to(base / "other")
    (base / "disk" / "inner").symlink_to(base / "disk" / "weight_v000001")
    (base / "disk-alias").symlink_to(base / "disk")  # a root given through a symlink
    paths = {name: str(base / name) for name in ("model", "disk", "local", "other", "disk-alias")}
    paths["base"] = str(base)
    return paths


def dirs_of(tree) -> WeightDirs:
    return WeightDirs.of(tree["model"], load=[tree["disk-alias"]], pull=[tree["local"]])


@pytest.fixture(scope="module")
def server(tree):
    """(url, reached, guard): the guard with ``dirs_of(tree)`` on uvicorn; ``reached`` lists
    (path, body) of every request that got past it."""

    reached: list = []
    app = recording_app(b'{"success": true}', lambda scope, body: reached.append((scope["path"], body)))
    guard = SglangKeyAuth(app, key=KEY, weight_dirs=dirs_of(tree))
    with serve_on_loopback(guard) as url:
        yield url, reached, guard


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", path, body=body, headers={**AUTH, **(headers or {})})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def allowed_bodies(t) -> list[tuple[str, dict]]:
    disk, local = t["disk"], t["local"]
    return [
        (UPDATE, {"model_path": f"{disk}/weight_v000002", "weight_version": "2"}),  # slime's full mode
        (UPDATE, {"model_path": local, "weight_version": "2"}),  # slime's local checkpoint
        (UPDATE, {"model_path": t["model"]}),
        (UPDATE, {"model_path": f"{t['disk-alias']}/weight_v000001", "load_format": "auto"}),
        (UPDATE, {"model_path": f"{disk}/inner"}),  # a symlink that stays inside
        (UPDATE, {"model_path": f"{disk}/weight_v000001/../weight_v000002"}),  # '..' that stays inside
        (PULL, {"local_checkpoint_dir": local, "source_dir": disk, "target_version": 2}),
        (PULL, {"local_checkpoint_dir": f"{local}/sub", "source_dir": t["disk-alias"], "target_version": 0}),
    ]


def refused_bodies(t) -> list[tuple[str, object, str]]:
    disk, local, other = t["disk"], t["local"], t["other"]
    pull = {"local_checkpoint_dir": local, "source_dir": disk, "target_version": 2}
    return [
        (UPDATE, {"model_path": f"{other}/ckpt"}, "outside"),  # an absolute path elsewhere
        (UPDATE, {"model_path": "/etc"}, "outside"),
        (UPDATE, {"model_path": f"{disk}/../other/ckpt"}, "resolves to"),
        (UPDATE, {"model_path": f"{disk}/weight_v000001/../../other"}, "resolves to"),
        (UPDATE, {"model_path": f"{disk}/escape"}, "resolves to"),  # a symlink out of the root
        (UPDATE, {"model_path": f"{disk}/escape/ckpt"}, "resolves to"),
        (UPDATE, {"model_path": f"{t['base']}/disk-aliasx"}, "outside"),  # a prefix is no parent
        (UPDATE, {"model_path": "weight_v000001"}, "not an absolute path"),
        (UPDATE, {"model_path": "Qwen/Qwen3-4B"}, "not an absolute path"),  # a hub name
        (UPDATE, {"model_path": [disk]}, "not a path string"),
        (UPDATE, {"model_path": f"{disk}\x00/x"}, "NUL"),
        (UPDATE, {"weight_version": "2"}, "model_path is missing"),
        (UPDATE, {"model_path": disk, "manifest": {}}, "'manifest' is not one the run sends"),
        (UPDATE, {"model_path": disk, "load_format": "dummy"}, "load_format 'dummy'"),
        (UPDATE, {"model_path": disk, "load_format": "remote_instance"}, "load_format"),
        (UPDATE, {"model_path": disk, "weight_version": 2}, "weight_version must be a string"),
        (PULL, {**pull, "local_checkpoint_dir": disk}, "local_checkpoint_dir"),  # a load dir is no pull dir
        (PULL, {**pull, "local_checkpoint_dir": f"{other}/ckpt"}, "local_checkpoint_dir"),
        (PULL, {**pull, "local_checkpoint_dir": f"{local}/../other"}, "resolves to"),
        (PULL, {**pull, "source_dir": other}, "source_dir"),
        (PULL, {**pull, "source_dir": f"{disk}/escape"}, "source_dir"),
        (PULL, {**pull, "target_version": -1}, "target_version"),
        (PULL, {**pull, "target_version": "2"}, "target_version"),
        (PULL, {**pull, "target_version": True}, "target_version"),
        (PULL, {**pull, "target_version": 2.0}, "target_version"),
        (PULL, {"source_dir": disk, "target_version": 2}, "local_checkpoint_dir is missing"),
        (PULL, [pull], "not one JSON object"),
    ]


def test_the_run_s_own_bodies_pass_and_reach_sglang_unchanged(server, tree):
    url, reached, _ = server
    for path, doc in allowed_bodies(tree):
        body = json.dumps(doc).encode()
        del reached[:]
        status, answer = post(url, path, body)
        assert (status, reached) == (200, [(path, body)]), (doc, answer)


def test_a_path_outside_the_engine_s_dirs_is_refused_in_one_line_and_nothing_runs(server, tree):
    url, reached, _ = server
    for path, doc, needle in refused_bodies(tree):
        del reached[:]
        status, answer = post(url, path, json.dumps(doc).encode())
        why = json.loads(answer)["error"]
        assert status == 403 and reached == [], (doc, answer)
        assert why.startswith("forbidden by modal_rl's engine guard: ") and needle in why, why
        assert "\n" not in why and "\x00" not in why and len(why) < 1200


@pytest.mark.parametrize(
    "body, headers, needle",
    [
        (b"model_path=/etc", {}, "not one UTF-8 JSON object"),
        (b"\xff\xfe{}", {}, "not one UTF-8 JSON object"),
        (b"[" * 15000, {}, "not one UTF-8 JSON object"),  # nesting deeper than the parser's stack
        (b"null", {}, "not one JSON object"),
        (b'{"model_path": "/etc", "model_path": "DISK"}', {}, "duplicate keys"),
        (b'{"model_path": "DISK"}', {"Content-Encoding": "gzip"}, "content-encoded"),
        ('{"model_path": "DISK"}', {}, "not one UTF-8 JSON object"),  # UTF-16: Python's json reads it
    ],
    ids=["form", "not-utf8", "deep", "null", "duplicate", "encoded", "utf16"],
)
def test_a_body_that_is_not_plain_json_is_refused(server, tree, body, headers, needle):
    url, reached, _ = server
    if isinstance(body, str):
        body = body.replace("DISK", tree["disk"]).encode("utf-16")
    body = body.replace(b"DISK", tree["disk"].encode())
    del reached[:]
    status, answer = post(url, UPDATE, body, headers)
    assert status == 403 and reached == [] and needle in json.loads(answer)["error"]


def test_a_huge_declared_body_is_refused_before_it_is_read(server):
    url, reached, _ = server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST {UPDATE} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
        sock.sendall((head + f"Content-Length: {1 << 40}\r\n\r\n").encode() + b'{"model_path": "')
        answer = sock.recv(4096)  # answered while 1 TiB is still "to come"
    assert answer.startswith(b"HTTP/1.1 403") and b"over 16384 bytes" in answer and reached == []


def test_a_chunked_body_over_the_bound_is_refused_without_reading_it_all(server, tree):
    url, reached, _ = server
    pad = "x" * (MAX_BODY + 1)
    body = json.dumps({"model_path": tree["disk"], "weight_version": pad}).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    chunks = (body[i : i + 4096] for i in range(0, len(body), 4096))
    conn.request("POST", UPDATE, body=chunks, headers=AUTH, encode_chunked=True)
    answer = conn.getresponse()
    assert answer.status == 403 and b"over 16384 bytes" in answer.read() and reached == []
    conn.close()


def test_without_the_bearer_even_an_allowed_body_is_401(server, tree):
    url, reached, _ = server
    path, doc = allowed_bodies(tree)[0]
    del reached[:]
    status, _ = post(url, path, json.dumps(doc).encode(), {"Authorization": "Bearer nope"})
    assert status == 401 and reached == []


def test_sglang_catch_up_passes_the_guard_its_own_env_sets_and_a_stray_dir_does_not(server, tree):
    """The driver's ``env()`` is what the engine's guard reads: catch-up's bodies pass it, and a
    ``newest()`` naming a directory outside ``source_dir`` is refused by the engine."""
    url, reached, guard = server
    newest = {"dir": f"{tree['disk']}/weight_v000002"}
    reload = DiskReload(lambda: (2, newest["dir"]), tree["disk"], tree["local"])
    engine = SglangEngine(tree["model"], key=KEY, reload=reload, timeout_s=10.0)
    saved, guard.weight_dirs = guard.weight_dirs, WeightDirs.from_env(engine.env()).resolved()
    try:
        del reached[:]
        assert engine.catch_up(url)["weight_version"] == 2
        assert [path for path, _ in reached] == [PULL, UPDATE]
        direct = SglangEngine(
            tree["model"], key=KEY, reload=DiskReload(lambda: (2, newest["dir"]), tree["disk"])
        )
        guard.weight_dirs = WeightDirs.from_env(direct.env()).resolved()
        del reached[:]
        assert direct.catch_up(url)["weight_version"] == 2 and reached[0][0] == UPDATE
        newest["dir"] = f"{tree['other']}/ckpt"
        with pytest.raises(urllib.error.HTTPError) as refused:
            direct.catch_up(url)
        assert refused.value.code == 403 and len(reached) == 1
    finally:
        guard.weight_dirs = saved


def test_with_no_weight_dirs_every_path_is_refused(monkeypatch, tree):
    monkeypatch.delenv(WEIGHT_DIRS_ENV, raising=False)
    guard = SglangKeyAuth(lambda *a: None, key=KEY)
    why = guard.body_refusal(UPDATE, [], json.dumps({"model_path": tree["model"]}).encode())
    assert "no weight directories" in why


BAD_ENV = [
    ("not json", "is not JSON"),
    ('{"load": "/x"}', "as a JSON list"),
    ('{"load": ["/"]}', "the whole disk"),
    ('{"load": ["/x/.."]}', "the whole disk"),
    ('{"pull": ["relative"]}', "not an absolute path"),
    ('{"load": [], "more": []}', "is not JSON"),
    ('{"load": [1]}', "not a path string"),
]


@pytest.mark.parametrize("value, needle", BAD_ENV)
def test_unusable_weight_dirs_stop_the_launch_in_one_line(value, needle, capsys, monkeypatch):
    monkeypatch.setenv("MODAL_RL_ENGINE_BEARER", engine_bearer(KEY))
    monkeypatch.setenv(WEIGHT_DIRS_ENV, value)
    assert keyed_launch.main(["--guard=sglang", "sglang.launch_server"]) == 2  # before SGLang's import
    err = capsys.readouterr().err.strip()
    assert err.startswith("keyed_launch: ") and needle in err and "\n" not in err
    with pytest.raises(SystemExit) as stopped:  # and the guard itself will not serve with them
        SglangKeyAuth(lambda *a: None, key=KEY)
    assert stopped.value.code == 2 and needle in capsys.readouterr().err


def test_a_root_that_is_a_symlink_to_slash_is_refused(tmp_path, monkeypatch):
    (tmp_path / "slash").symlink_to("/")
    monkeypatch.setenv(WEIGHT_DIRS_ENV, json.dumps({"load": [str(tmp_path / "slash")]}))
    with pytest.raises(SystemExit):
        SglangKeyAuth(lambda *a: None, key=KEY)


# -- fuzz -------------------------------------------------------------------------------------

SEGMENTS = st.sampled_from(["..", ".", "", "weight_v000001", "escape", "inner", "ckpt", "other", "disk", "x"])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def under(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r + "/") for r in roots)


@FUZZ
@given(st.sampled_from(["disk", "local", "model", "other", "base", "/"]), st.lists(SEGMENTS, max_size=6))
def test_fuzz_a_path_passes_exactly_when_it_resolves_under_a_root(tree, start, segments):
    dirs = dirs_of(tree).resolved()
    path = "/".join([tree.get(start, start).rstrip("/"), *segments]) or "/"
    update = body_refusal(UPDATE, [], json.dumps({"model_path": path}).encode(), dirs)
    assert (update is None) == under(os.path.realpath(path), dirs.load), (path, update)
    pull = {"local_checkpoint_dir": path, "source_dir": tree["disk"], "target_version": 1}
    refused = body_refusal(PULL, [], json.dumps(pull).encode(), dirs)
    assert (refused is None) == under(os.path.realpath(path), dirs.pull), (path, refused)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)


@FUZZ
@given(
    st.sampled_from([UPDATE, PULL]),
    st.dictionaries(
        st.sampled_from(["model_path", "weight_version", "load_format", "local_checkpoint_dir", "source_dir"])
        | st.sampled_from(["target_version", "manifest"])
        | st.text(max_size=8),
        JSON,
        max_size=4,
    ),
)
def test_fuzz_a_body_passes_only_with_the_route_s_keys_types_and_paths(tree, route, doc):
    dirs = dirs_of(tree).resolved()
    why = body_refusal(route, [], json.dumps(doc).encode(), dirs)
    if why is None:
        if route == UPDATE:
            assert set(doc) <= {"model_path", "weight_version", "load_format"}
            assert under(os.path.realpath(doc["model_path"]), dirs.load)
        else:
            assert set(doc) == {"local_checkpoint_dir", "source_dir", "target_version"}
            assert type(doc["target_version"]) is int and doc["target_version"] >= 0
            assert under(os.path.realpath(doc["local_checkpoint_dir"]), dirs.pull)
    else:
        assert isinstance(why, str) and "\n" not in why


@FUZZ
@given(st.sampled_from([UPDATE, PULL, "/other"]), st.binary(max_size=400))
def test_fuzz_raw_bytes_never_raise(tree, route, body):
    why = body_refusal(route, [], body, dirs_of(tree).resolved())
    assert why is None or (isinstance(why, str) and "\n" not in why)
