"""The maintainers' CLI as a user runs it: a real subprocess on real safetensors files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.weightsync_helpers import model_state, perturb, same_state

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "modal_rl.weightsync", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
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
