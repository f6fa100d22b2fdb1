"""slime disk weight-sync hooks for a Modal Volume (or any directory) shared by trainer and engines.

    --custom-update-weight-post-write-path slime_modal.weight_hooks.post_write_commit
    --sglang-custom-pull-weights-pre-read-hook slime_modal.weight_hooks.pre_read_reload

Both act on ``--update-weight-disk-dir``. Where it lies under a mount named in
``MODAL_RL_VOLUMES`` (JSON ``{mount_path: volume_name}``, set by the launcher), they commit and
reload that ``modal.Volume``; elsewhere they make the writes durable (fsync) on the directory.

Trainer side: slime calls the post-write hook on every trainer rank after a barrier that follows
the writes (full and delta mode), and on rank 0 only after it empties the directory at the
delta baseline. Each node commits once (``modal_rl.weightsync.transport.volumes.publish``: a node-local
file lock; the other co-located ranks return once that commit is done), leaving a commit marker
that lists the files the node wrote. A node that cannot see the version directory wrote nothing
into it (delta mode: only PP-source ranks write) and commits nothing.

Engine side: sglang's ``/pull_weights`` calls the pre-read hook on each host with
``(source_dir, target_version)`` for ``target_version > 0``. It reloads the volume until
``weight_v{target_version:06d}/`` holds a commit marker, every file the markers list (at the
listed size), and every file named in its ``model.safetensors.index.json``; else ``TimeoutError`` after
``MODAL_RL_PRE_READ_TIMEOUT_S`` seconds (default 120), naming what is missing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from modal_rl.settings import read
from modal_rl.weightsync.transport.volumes import await_visible, publish

log = logging.getLogger(__name__)

TIMEOUT_ENV = "MODAL_RL_PRE_READ_TIMEOUT_S"
INDEX = "model.safetensors.index.json"


def version_dir(source_dir: str | Path, version: int) -> Path:
    """Where slime publishes ``version`` (both full and delta mode)."""
    return Path(source_dir) / f"weight_v{version:06d}"


def post_write_commit(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """Publish ``version_dir`` once per node; returns only after this node's commit is done."""
    if publish(version_dir):
        log.info("committed %s", version_dir)


def _index_files(vdir: Path) -> list[str]:
    """Files named by the version's HF index (none if it has no index yet, or is a single file)."""
    try:
        index = json.loads((vdir / INDEX).read_text())
    except FileNotFoundError:
        return []
    except ValueError as exc:
        raise ValueError(f"{vdir / INDEX}: not JSON ({exc})") from exc
    return sorted(set(index.get("weight_map", {}).values()))


def pre_read_reload(source_dir: str, target_version: int) -> None:
    """Reload until ``weight_v{target_version:06d}`` under ``source_dir`` is complete, or raise."""
    if not isinstance(target_version, int) or target_version < 0:
        raise ValueError(f"target_version must be a non-negative int, got {target_version!r}")
    if target_version == 0:
        return  # version 0 is the engine's own base; nothing is read from source_dir
    timeout_s = read(TIMEOUT_ENV)
    vdir = version_dir(source_dir, target_version)

    # slime barriers all trainer ranks after the post-write hook before any engine pulls, so
    # every node has committed by now; the wait covers a reload that lags a commit. The index
    # (delta mode, sharded full checkpoints) names files from every writing node: re-read it
    # after each reload.
    await_visible(vdir, lambda: _index_files(vdir) if vdir.is_dir() else [], timeout_s=timeout_s)


def complete(vdir: Path) -> bool:
    """A version directory a reader can load: its HF index and every file the index names, or
    a single-file checkpoint (``model.safetensors``)."""
    if (vdir / INDEX).is_file():
        try:
            return all((vdir / name).is_file() for name in _index_files(vdir))
        except ValueError:
            return False  # an index being written
    return (vdir / "model.safetensors").is_file()


def newest_version(source_dir: str | Path | None) -> int:
    """The highest complete ``weight_v{N:06d}`` under ``source_dir`` (0: none yet, the engines'
    own base). What a replacement engine is brought to: slime reloads its engines only from
    versions it finished publishing, so no engine of the run is ahead of this one."""
    best = 0
    try:
        entries = list(Path(source_dir).iterdir()) if source_dir else []
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        if name.startswith("weight_v") and name[8:].isdigit() and int(name[8:]) > best and complete(entry):
            best = int(name[8:])
    return best
