"""slime disk weight-sync hooks: post-write commit (trainer) and pre-read reload (engine).

Called the way slime calls them (``hook(args, version_dir, rollout_engines)`` from every trainer
rank after a barrier; ``hook(source_dir, target_version)`` from sglang's /pull_weights), on
version directories in slime's disk-delta layout (zstd XOR diffs in safetensors shards plus a
``model.safetensors.index.json``). The Modal Volume is replaced by a double at the server
boundary only: each container's mount is a real directory; ``commit`` uploads the container's
view to the double's store and ``reload`` replaces the view with the store's.
"""

from __future__ import annotations

import importlib
import inspect
import json
import multiprocessing
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.numpy
import zstandard

from modal_rl.weightsync.transport import volumes
from slime_modal import weight_hooks
from slime_modal.weight_hooks import post_write_commit, pre_read_reload, version_dir

ARGS = SimpleNamespace(update_weight_disk_dir=None, custom_update_weight_post_write_path="x")
RNG = np.random.default_rng(0)
BASE = {f"layers.{i}.weight": RNG.integers(0, 255, 4096, dtype=np.uint8) for i in range(4)}


def new_weights() -> dict[str, np.ndarray]:
    out = {}
    for name, old in BASE.items():
        new = old.copy()
        new[RNG.integers(0, new.size, 40)] ^= 1  # a few bytes change, as at RL learning rates
        out[name] = new
    return out


def write_shard(vdir: Path, shard: int, total: int, names: list[str], new: dict) -> str:
    """One writing rank's part of a delta version: a safetensors file of zstd-compressed XOR diffs."""
    vdir.mkdir(parents=True, exist_ok=True)
    fname = f"model-{shard:05d}-of-{total:05d}.safetensors"
    comp = zstandard.ZstdCompressor(level=1)
    diffs = {n: np.frombuffer(comp.compress((new[n] ^ BASE[n]).tobytes()), np.uint8) for n in names}
    (vdir / fname).write_bytes(safetensors.numpy.save(diffs, metadata={n: "digest" for n in names}))
    return fname


def write_index(vdir: Path, version: int, weight_map: dict[str, str]) -> None:
    meta = {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": "xor"}
    meta |= {"compression_format": "zstd", "checksum_format": "xxh3-128"}
    (vdir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": meta, "weight_map": weight_map})
    )


def apply_version(vdir: Path) -> dict[str, np.ndarray]:
    """What an engine host does with a version once it can read it: rebuild the new tensors."""
    index = json.loads((vdir / "model.safetensors.index.json").read_text())
    out, dec = {}, zstandard.ZstdDecompressor()
    for name, fname in index["weight_map"].items():
        blob = safetensors.numpy.load_file(str(vdir / fname))[name]
        out[name] = np.frombuffer(dec.decompress(blob.tobytes()), np.uint8) ^ BASE[name]
    return out


class VolumeServer:
    """Stands in for Modal's volume service: committed state plus every call made to it."""

    def __init__(self, root: Path):
        self.store = root / "server"
        self.store.mkdir()
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def view(self, mount: Path) -> ContainerVolume:
        return ContainerVolume(self, mount)


class ContainerVolume:
    """``modal.Volume`` as seen from one container with the volume mounted at ``mount``."""

    def __init__(self, server: VolumeServer, mount: Path):
        self.server, self.mount = server, mount

    def commit(self) -> None:
        with self.server._lock:
            self.server.calls.append(("commit", str(self.mount)))
            shutil.copytree(self.mount, self.server.store, dirs_exist_ok=True)

    def reload(self) -> None:
        with self.server._lock:
            self.server.calls.append(("reload", str(self.mount)))
            shutil.copytree(self.server.store, self.mount, dirs_exist_ok=True)


@pytest.fixture
def modal_env(tmp_path, monkeypatch):
    """Two containers (trainer node, engine node) mounting volume ``weights``; switch with ``enter``."""
    server = VolumeServer(tmp_path)
    mounts = {"trainer": tmp_path / "trainer-mnt", "engine": tmp_path / "engine-mnt"}

    def enter(container: str) -> Path:
        mount = mounts[container]
        mount.mkdir(exist_ok=True)
        monkeypatch.setenv(volumes.VOLUMES_ENV, json.dumps({str(mount): "weights"}))
        monkeypatch.setenv(volumes.NODE_ID_ENV, container)
        monkeypatch.setenv(volumes.NODE_STATE_ENV, str(tmp_path / f"state-{container}"))
        monkeypatch.setattr(volumes, "_VOLUMES", {})  # a new container: a new process's objects
        monkeypatch.setattr(volumes, "_open_volume", lambda name: server.view(mount))
        return mount

    return server, enter


def test_hook_signatures_match_slime_call_sites():
    assert tuple(inspect.signature(post_write_commit).parameters) == (
        "args",
        "version_dir",
        "rollout_engines",
    )
    assert tuple(inspect.signature(pre_read_reload).parameters) == ("source_dir", "target_version")
    # sglang's patch resolves the hook as module path + attribute, slime with load_function
    for path in ("slime_modal.weight_hooks.post_write_commit", "slime_modal.weight_hooks.pre_read_reload"):
        module, _, name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name))


def test_every_rank_calls_but_one_commit_per_node(modal_env):
    server, enter = modal_env
    mount = enter("trainer")
    new = new_weights()
    vdir = version_dir(mount / "delta", 1)
    names = sorted(new)
    files = [write_shard(vdir, i, 2, names[i * 2 : i * 2 + 2], new) for i in range(2)]
    write_index(vdir, 1, {n: files[i // 2] for i, n in enumerate(names)})
    ranks = [threading.Thread(target=post_write_commit, args=(ARGS, str(vdir), [])) for _ in range(8)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert server.calls == [("commit", str(mount))]
    marker = json.loads((vdir / volumes.MARKER_DIR / "trainer.json").read_text())
    assert marker["files"] == {f: (vdir / f).stat().st_size for f in [*files, "model.safetensors.index.json"]}
    post_write_commit(ARGS, str(vdir), [])  # same state again: nothing new to commit
    assert len(server.calls) == 1
    (vdir / "extra.json").write_text("{}")
    post_write_commit(ARGS, str(vdir), [])  # new writes in the same dir: committed
    assert len(server.calls) == 2


def _rank(vdir: str, out) -> None:
    out.put(volumes.publish(vdir))


def test_one_commit_per_node_across_processes(tmp_path, monkeypatch):
    """Ranks are processes: the node-local file lock lets exactly one of them commit."""
    monkeypatch.setenv(volumes.NODE_STATE_ENV, str(tmp_path / "state"))
    vdir = tmp_path / "delta" / "weight_v000001"
    write_shard(vdir, 0, 1, sorted(BASE), new_weights())
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(vdir), out)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert sorted(out.get(timeout=5) for _ in procs) == [False, False, False, True]
    assert all(p.exitcode == 0 for p in procs)


def test_engine_reads_what_trainer_committed(modal_env):
    server, enter = modal_env
    new = new_weights()
    trainer = enter("trainer")
    vdir = version_dir(trainer / "delta", 3)
    fname = write_shard(vdir, 0, 1, sorted(new), new)
    write_index(vdir, 3, dict.fromkeys(new, fname))
    post_write_commit(ARGS, str(vdir), [])

    engine = enter("engine")
    pre_read_reload(str(engine / "delta"), 3)
    assert server.calls[-1] == ("reload", str(engine))
    got = apply_version(version_dir(engine / "delta", 3))
    assert all(np.array_equal(got[n], new[n]) for n in new)
    pre_read_reload(str(engine / "delta"), 0)  # the engine's own base: nothing to read, no reload
    assert server.calls[-1] == ("reload", str(engine))
    assert len(server.calls) == 2


def test_engine_times_out_naming_what_is_missing(modal_env, monkeypatch):
    server, enter = modal_env
    monkeypatch.setenv(weight_hooks.TIMEOUT_ENV, "0.3")
    trainer = enter("trainer")
    vdir = version_dir(trainer / "delta", 1)
    write_shard(vdir, 0, 1, sorted(BASE), new_weights())  # written, never committed
    engine = enter("engine")
    with pytest.raises(TimeoutError, match=r"weight_v000001 not complete after 0.3s.*directory"):
        pre_read_reload(str(engine / "delta"), 1)
    assert {c for c, _ in server.calls} == {"reload"} and len(server.calls) >= 2  # it kept reloading


def test_engine_waits_for_every_node_the_index_names(tmp_path, monkeypatch):
    """Two trainer nodes write one shard each into a local shared directory; rank 0 writes the
    index. Until the second node has published, the engine reports its shard missing."""
    monkeypatch.setenv(weight_hooks.TIMEOUT_ENV, "0.3")
    new = new_weights()
    names = sorted(new)
    vdir = version_dir(tmp_path / "delta", 2)
    a = write_shard(vdir, 0, 2, names[:2], new)
    write_index(
        vdir, 2, {n: (a if i < 2 else "model-00001-of-00002.safetensors") for i, n in enumerate(names)}
    )
    monkeypatch.setenv(volumes.NODE_ID_ENV, "node-a")
    monkeypatch.setenv(volumes.NODE_STATE_ENV, str(tmp_path / "state-a"))
    post_write_commit(ARGS, str(vdir), [])
    with pytest.raises(TimeoutError, match=r"model-00001-of-00002.safetensors \(required\)"):
        pre_read_reload(str(tmp_path / "delta"), 2)

    write_shard(vdir, 1, 2, names[2:], new)
    monkeypatch.setenv(volumes.NODE_ID_ENV, "node-b")
    monkeypatch.setenv(volumes.NODE_STATE_ENV, str(tmp_path / "state-b"))
    post_write_commit(ARGS, str(vdir), [])
    pre_read_reload(str(tmp_path / "delta"), 2)
    assert sorted(p.stem for p in (vdir / volumes.MARKER_DIR).iterdir()) == ["node-a", "node-b"]
    got = apply_version(vdir)
    assert all(np.array_equal(got[n], new[n]) for n in new)


def test_truncated_file_is_not_complete(tmp_path, monkeypatch):
    monkeypatch.setenv(volumes.NODE_STATE_ENV, str(tmp_path / "state"))
    monkeypatch.setenv(weight_hooks.TIMEOUT_ENV, "0.2")
    vdir = version_dir(tmp_path, 1)
    fname = write_shard(vdir, 0, 1, sorted(BASE), new_weights())
    post_write_commit(ARGS, str(vdir), [])
    pre_read_reload(str(tmp_path), 1)
    with open(vdir / fname, "r+b") as f:  # a view that surfaced metadata before all the bytes
        f.truncate(100)
    with pytest.raises(TimeoutError, match=fname):
        pre_read_reload(str(tmp_path), 1)


def test_baseline_call_on_the_stream_root(modal_env):
    """Delta baseline: rank 0 empties --update-weight-disk-dir and calls the hook on the root."""
    server, enter = modal_env
    root = enter("trainer") / "delta"
    root.mkdir()
    post_write_commit(ARGS, str(root), [])
    assert server.calls == [("commit", str(root.parent))]


def test_local_commit_fsyncs_and_leaves_a_durable_marker(tmp_path, monkeypatch):
    monkeypatch.setenv(volumes.NODE_STATE_ENV, str(tmp_path / "state"))
    monkeypatch.delenv(volumes.VOLUMES_ENV, raising=False)
    synced = []
    real_fsync = volumes.os.fsync
    monkeypatch.setattr(volumes.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    vdir = version_dir(tmp_path / "delta", 1)
    write_shard(vdir, 0, 1, sorted(BASE), new_weights())
    assert isinstance(volumes.sync_for(vdir), volumes.LocalDirSync)
    post_write_commit(ARGS, str(vdir), [])
    # marker (temp file), then shard, marker, marker dir, version dir
    assert len(synced) == 5
    assert (vdir / volumes.MARKER_DIR / f"{volumes.node_id()}.json").is_file()


def test_volume_mapping(monkeypatch, tmp_path):
    monkeypatch.setattr(volumes, "_VOLUMES", {})
    monkeypatch.setattr(volumes, "_open_volume", lambda name: SimpleNamespace(name=name))
    monkeypatch.setenv(volumes.VOLUMES_ENV, json.dumps({"/vol": "outer", "/vol/inner/": "inner"}))
    assert volumes.sync_for("/vol/inner/delta/weight_v000001").volume.name == "inner"
    assert volumes.sync_for("/vol/delta").volume.name == "outer"
    assert volumes.sync_for("/vol").mount == "/vol"
    assert isinstance(volumes.sync_for("/volume-other/x"), volumes.LocalDirSync)
    monkeypatch.setenv(volumes.VOLUMES_ENV, "/vol=weights")
    with pytest.raises(ValueError, match="MODAL_RL_VOLUMES must be JSON"):
        volumes.sync_for("/vol/x")
    monkeypatch.setenv(volumes.VOLUMES_ENV, json.dumps({"relative": "weights"}))
    with pytest.raises(ValueError, match="absolute mount paths"):
        volumes.sync_for("/vol/x")


def test_node_that_wrote_nothing_commits_nothing(modal_env):
    """Delta mode: only PP-source ranks create the version dir; on a node with none of them the
    directory is not even visible, and its ranks still call the hook."""
    server, enter = modal_env
    mount = enter("trainer")
    post_write_commit(ARGS, str(version_dir(mount / "delta", 1)), [])
    assert server.calls == [] and not (mount / "delta").exists()


def test_bad_target_version_fails_clearly(tmp_path):
    for bad in (-1, "3", 1.0):
        with pytest.raises(ValueError, match="non-negative int"):
            pre_read_reload(str(tmp_path), bad)
