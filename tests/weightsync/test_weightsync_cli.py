"""The maintainers' CLI as a user runs it: a real subprocess on real safetensors files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modal_rl.run_key import RUN_KEY_ENV
from tests.weightsync_helpers import OTHER_KEY, TEST_KEY, model_state, perturb, records, reseal, same_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def run_key_env(monkeypatch):
    """The CLI signs and verifies with the run key from the environment (the subprocesses
    inherit it); tests of the keyless mode say ``--keyless``."""
    monkeypatch.setenv(RUN_KEY_ENV, TEST_KEY)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modal_rl.weightsync", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture()
def files(tmp_path):
    base = {k: v for k, v in model_state().items() if v.dim()}  # safetensors keeps 0-dim too, keep it simple
    new = perturb(base, 0.03)
    save_file(base, tmp_path / "A.safetensors")
    save_file(new, tmp_path / "B.safetensors")
    return tmp_path, base, new


def test_encode_apply_inspect_roundtrip(files):
    tmp, base, new = files
    r = cli("encode", "--base", tmp / "A.safetensors", "--new", tmp / "B.safetensors", "--out", tmp / "D")
    assert r.returncode == 0, r.stderr
    r = cli("apply", "--base", tmp / "A.safetensors", "--delta", tmp / "D", "--out", tmp / "C.safetensors")
    assert r.returncode == 0, r.stderr
    assert same_state(load_file(tmp / "C.safetensors"), load_file(tmp / "B.safetensors"))
    r = cli("inspect", tmp / "D", "--json")
    info = json.loads(r.stdout)
    changed = sum(
        int((base[k].view(torch.uint8) != new[k].view(torch.uint8)).view(-1, 2).any(1).sum()) for k in base
    )
    assert info["changed"] == changed
    assert info["kind"] == "delta" and info["tensors"] == len(base)
    assert info["frame_bytes"] == (tmp / "D").stat().st_size
    human = cli("inspect", tmp / "D")
    assert "density" in human.stdout and "ratio" in human.stdout


def test_anchor_encode_and_apply(files):
    tmp, _, new = files
    assert cli("encode", "--new", tmp / "B.safetensors", "--out", tmp / "anchor").returncode == 0
    r = cli(
        "apply", "--base", tmp / "A.safetensors", "--delta", tmp / "anchor", "--out", tmp / "C.safetensors"
    )
    assert r.returncode == 0, r.stderr
    assert same_state(load_file(tmp / "C.safetensors"), load_file(tmp / "B.safetensors"))
    assert set(new) == set(load_file(tmp / "C.safetensors"))


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_wrong_base_is_refused_and_writes_nothing(files):
    tmp, _, _ = files
    cli("encode", "--base", tmp / "A.safetensors", "--new", tmp / "B.safetensors", "--out", tmp / "D")
    r = cli("apply", "--base", tmp / "B.safetensors", "--delta", tmp / "D", "--out", tmp / "C.safetensors")
    assert "other weights" in one_error_line(r)
    assert not (tmp / "C.safetensors").exists()
    assert [p.name for p in tmp.iterdir() if p.name.startswith(".")] == []


def test_mismatched_shapes_are_refused(files):
    tmp, base, _ = files
    other = dict(base)
    other["layer.0.q.bias"] = torch.zeros(65, dtype=torch.bfloat16)
    save_file(other, tmp / "X.safetensors")
    r = cli("encode", "--base", tmp / "A.safetensors", "--new", tmp / "X.safetensors", "--out", tmp / "D")
    assert "layer.0.q.bias" in one_error_line(r)
    assert not (tmp / "D").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_delta_is_refused(files, damage):
    tmp, _, _ = files
    cli("encode", "--base", tmp / "A.safetensors", "--new", tmp / "B.safetensors", "--out", tmp / "D")
    data = bytearray((tmp / "D").read_bytes())
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    else:
        data[len(data) // 2] ^= 0x40
    (tmp / "D").write_bytes(bytes(data))
    r = cli("apply", "--base", tmp / "A.safetensors", "--delta", tmp / "D", "--out", tmp / "C.safetensors")
    line = one_error_line(r)
    assert line.startswith("error:")
    assert not (tmp / "C.safetensors").exists()


def test_missing_input_is_one_clear_line(tmp_path):
    r = cli(
        "apply", "--base", tmp_path / "nope.safetensors", "--delta", tmp_path / "D", "--out", tmp_path / "C"
    )
    assert "no such file" in one_error_line(r)


def _env(**changes) -> dict:
    import os

    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def test_a_byte_flipped_with_its_checksum_recomputed_is_refused_by_the_mac(files):
    tmp, _, _ = files
    cli("encode", "--base", tmp / "A.safetensors", "--new", tmp / "B.safetensors", "--out", tmp / "D")
    data = (tmp / "D").read_bytes()
    offset, size, tag = next(r for r in records(data) if r[2] == b"C")
    body = bytearray(data[offset + 5 : offset + size - 40])
    body[len(body) // 2] ^= 0x01
    (tmp / "D").write_bytes(reseal(data, offset, bytes(body)))
    for command in (
        ["apply", "--base", tmp / "A.safetensors", "--delta", tmp / "D", "--out", tmp / "C"],
        ["inspect", tmp / "D"],
    ):
        line = one_error_line(cli(*command))
        assert "fails its MAC" in line, line
    assert not (tmp / "C").exists()


def test_keys_must_match_and_keyless_is_explicit(files):
    tmp, _, _ = files
    assert cli("encode", "--new", tmp / "B.safetensors", "--out", tmp / "signed").returncode == 0
    assert cli("encode", "--keyless", "--new", tmp / "B.safetensors", "--out", tmp / "plain").returncode == 0
    apply = ["apply", "--base", tmp / "A.safetensors", "--out", tmp / "C.safetensors", "--delta"]
    # Signed with another run's key: refused at the first record.
    assert "fails its MAC" in one_error_line(
        cli(*apply, tmp / "signed", env=_env(**{RUN_KEY_ENV: OTHER_KEY}))
    )
    # A keyed reader refuses an unsigned frame; a keyless one refuses a signed frame.
    assert "not signed" in one_error_line(cli(*apply, tmp / "plain"))
    assert "keyless" in one_error_line(cli(*apply, tmp / "signed", "--keyless"))
    # No key in the environment and no --keyless: one line that says how to fix it.
    line = one_error_line(cli(*apply, tmp / "signed", env=_env(**{RUN_KEY_ENV: None})))
    assert RUN_KEY_ENV in line
    assert not (tmp / "C.safetensors").exists()
    # Keyless (v1) frames still decode when asked for explicitly.
    assert cli(*apply, tmp / "plain", "--keyless").returncode == 0
    assert same_state(load_file(tmp / "C.safetensors"), load_file(tmp / "B.safetensors"))
    for r in (
        cli("inspect", tmp / "signed"),
        cli("encode", "--new", tmp / "B.safetensors", "--out", tmp / "x"),
    ):
        assert TEST_KEY not in r.stdout + r.stderr


# -- exit codes and one-line failures (issue 15) ------------------------------------------


def test_bad_input_exits_2_and_names_the_cause(files):
    tmp, _, _ = files
    r = cli("apply", "--base", tmp / "nope.safetensors", "--delta", tmp / "D", "--out", tmp / "C")
    assert r.returncode == 2 and "no such file" in one_error_line(r)
    r = cli("receive", "--tcp", "no-port-here", "--until", "1")
    assert r.returncode == 2 and "HOST:PORT" in one_error_line(r)


def test_apply_into_a_missing_directory_fails_and_creates_nothing(files):
    tmp, _, _ = files
    cli("encode", "--base", tmp / "A.safetensors", "--new", tmp / "B.safetensors", "--out", tmp / "D")
    out = tmp / "nonexistent" / "dir" / "C.safetensors"
    r = cli("apply", "--base", tmp / "A.safetensors", "--delta", tmp / "D", "--out", out)
    line = one_error_line(r)
    assert r.returncode == 2 and "does not exist" in line and "nonexistent" in line
    assert not (tmp / "nonexistent").exists()


def test_receive_from_a_closed_port_says_connection_refused(tmp_path):

    from modal_rl.cluster.ports import reserve

    (port,) = reserve(1)  # claimed and never bound: nobody listens on it
    r = cli("receive", "--tcp", f"127.0.0.1:{port}", "--until", "1", "--connect-timeout", "1")
    line = one_error_line(r)
    assert r.returncode == 1 and "connection refused" in line and f"127.0.0.1:{port}" in line
    assert "--tcp" in line and "not live" not in line


def test_receive_keeps_a_status_file_with_the_epoch_it_serves(tmp_path):
    from modal_rl.weightsync import CodecConfig
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.transport.store import DirectoryStore

    state = {k: v for k, v in model_state().items() if v.dim()}
    publisher = Publisher(DirectoryStore(tmp_path / "store", lease_wait_s=0), config=CodecConfig(threads=1))
    publisher.publish(state)
    publisher.publish(perturb(state, 0.02))
    status = tmp_path / "status.json"
    r = cli("receive", "--store", tmp_path / "store", "--until", "1", "--status-file", status)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(e["version"], e["epoch"]) for e in events if e["event"] == "activated"] == [
        (0, publisher.epoch),
        (1, publisher.epoch),
    ]
    held = json.loads(status.read_text())
    assert (held["epoch"], held["version"], held["run"]) == (publisher.epoch, 1, publisher.run)
    assert held["activated_at"] >= held["started_at"] and held["activations"] == 2
    publisher.sink.close()


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["encode", "--bse", "A.safetensors", "--new", "B.safetensors", "--out", "D"],
            "unrecognized arguments: --bse",
        ),
        (["encdoe"], "invalid choice: 'encdoe'"),
        (["--keyless", "inspect", "D"], "--keyless goes after the subcommand (e.g. inspect D --keyless)"),
        (["inspect", "A.safetensors", "--keyless"], "A.safetensors is not a weight-sync frame"),
        (
            ["apply", "--base", "A.safetensors", "--delta", "B.safetensors", "--out", "C"],
            "is not a weight-sync",
        ),
    ],
)
def test_usage_and_non_frame_errors_are_one_line(files, argv, says):
    tmp, _, _ = files
    out = subprocess.run(
        [sys.executable, "-m", "modal_rl.weightsync", *argv],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("error: "), out.stderr


def test_messages_name_the_file_the_tensor_and_the_fix(files):
    tmp, base, _ = files
    a, b, d = tmp / "A.safetensors", tmp / "B.safetensors", tmp / "D"
    r = cli("encode", "--base", a, "--new", b, "--out", d)
    # encode: one summary line (versions, tensors, changed words, bytes, ratio)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stdout
    assert f"delta 0 -> 1, {len(base)} tensors" in r.stdout and "words changed" in r.stdout
    assert "ratio" in r.stdout and str(d) in r.stdout
    # a directory where a file belongs is called a directory
    line = one_error_line(cli("apply", "--base", tmp, "--delta", d, "--out", tmp / "C.safetensors"))
    assert f"{tmp} is a directory" in line
    # a base without a tensor the delta changes: the tensor, both files and the fix
    dropped = sorted(base)[0]
    save_file({k: v for k, v in base.items() if k != dropped}, tmp / "short.safetensors")
    line = one_error_line(cli("apply", "--base", tmp / "short.safetensors", "--delta", d, "--out", tmp / "C"))
    assert repr(dropped) in line and "short.safetensors" in line and "pass the base" in line
    # a truncated frame: the file and what to do
    (tmp / "cut").write_bytes(d.read_bytes()[: d.stat().st_size * 2 // 3])
    line = one_error_line(cli("apply", "--base", a, "--delta", tmp / "cut", "--out", tmp / "C"))
    assert str(tmp / "cut") in line and "cut short" in line and "encode" in line
    assert not (tmp / "C").exists()
    # inspect reads the headers without the key, and says it did not check signatures
    env = {k: v for k, v in os.environ.items() if k != RUN_KEY_ENV}
    r = cli("inspect", d, env=env)
    assert r.returncode == 0 and "without checking signatures" in r.stdout, r.stderr
    # a reader that goes away (`| head`) ends the command quietly
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        quiet = subprocess.run(
            [sys.executable, "-m", "modal_rl.weightsync", "inspect", str(d)],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert quiet.returncode == 0 and quiet.stderr == ""
