"""Where an SGLang engine may load weights from: the guard's check of the two path-carrying bodies.

Two routes the run's weight path needs take a filesystem path in their JSON body, and SGLang
loads (or, for ``/pull_weights``, writes) whatever they name. With the engine bearer alone a
caller could otherwise make the engine load any checkpoint already on its disk, or have
``/pull_weights`` replace the files of any directory it can write. So the guard
(``auth.SglangKeyAuth``) reads these bodies first and lets them through only when every path
they name lies under a directory this engine was launched to use:

- ``POST /update_weights_from_disk``: ``model_path`` under a *load* directory — the engine's own
  ``--model-path``, the directory versions are published to (slime's
  ``--update-weight-disk-dir``, ``DiskReload.source_dir``) or a *pull* directory;
- ``POST /pull_weights``: ``source_dir`` under a load directory, ``local_checkpoint_dir`` (which
  the pull empties and refills) under a *pull* directory (slime's
  ``--update-weight-local-checkpoint-dir``, ``DiskReload.local_checkpoint_dir``).

The launcher gives the engine these directories in its environment (``WEIGHT_DIRS_ENV``, JSON
``{"load": [...], "pull": [...]}``: ``SglangEngine.env``, ``slime_modal.engines.engine_spec``);
the guard resolves them once, in the engine's process, where they exist.

Invariants:
- a path passes only if it is an absolute string and its ``os.path.realpath`` (symlinks and
  ``..`` resolved) is a directory in the set or lies beneath one; ``/`` is never such a
  directory, so no setting opens the whole disk;
- with no directories set, every path is refused (the guard fails closed);
- a body passes only if it is at most ``MAX_BODY`` bytes of UTF-8, one JSON object with no
  duplicate key and no key outside the route's own list, no ``Content-Encoding``, and values
  of the types slime sends (``load_format`` only SGLang's default loaders), so SGLang cannot
  read anything different from what was checked;
- ``body_refusal`` never raises: every refusal is one line naming the cause and the fix.

Not covered: which version is loaded. A bearer holder can still load an older version under
these directories, or the base model; and whoever can write inside them (the trainer, a
process on the engine's host) is trusted with what it writes there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from modal_rl.engines.routes import no_duplicate_keys
from modal_rl.settings import read
from modal_rl.text_safety import clean

WEIGHT_DIRS_ENV = "MODAL_RL_SGLANG_WEIGHT_DIRS"
MAX_BODY = 16 << 10  # slime's bodies are under 1 KiB; a bound before any byte is parsed
MAX_PATH = 4096  # PATH_MAX on Linux
MAX_DIRS = 16
MAX_ENV = 2 * MAX_DIRS * (MAX_PATH + 8)
MAX_VERSION_TEXT = 256
# SGLang's loaders that read an ordinary checkpoint from ``model_path`` (None: the server's own
# ``--load-format``). The others load from elsewhere or from nothing (remote, dummy, ...).
LOAD_FORMATS = (None, "auto", "safetensors")
# Each route's keys: what slime sends (``SGLangEngine.pull_weights`` /
# ``update_weights_from_disk``, ``SglangEngine.reload_from_disk``).
UPDATE_KEYS = {"model_path": True, "weight_version": False, "load_format": False}
PULL_KEYS = {"local_checkpoint_dir": True, "source_dir": True, "target_version": True}
PATH_ROUTES = ("/update_weights_from_disk", "/pull_weights")
_FIX = f"name a path under the directories the engine was started with ({WEIGHT_DIRS_ENV})"


class WeightDirsError(ValueError):
    """``WEIGHT_DIRS_ENV`` or a directory given for it is unusable (one line)."""


@dataclass(frozen=True)
class WeightDirs:
    """The directories one engine may load from (``load``) and pull into (``pull``), each an
    absolute path; ``resolved()`` gives them as the engine's filesystem sees them."""

    load: tuple[str, ...] = ()
    pull: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for role in ("load", "pull"):
            dirs = getattr(self, role)
            if not isinstance(dirs, tuple) or len(dirs) > MAX_DIRS:
                raise WeightDirsError(
                    f"{WEIGHT_DIRS_ENV} {role}: give at most {MAX_DIRS} directories as a list"
                )
            for path in dirs:
                why = _path_problem(path)
                if why:
                    raise WeightDirsError(f"{WEIGHT_DIRS_ENV} {role} directory {_show(path)}: {why}")
                if os.path.normpath(path) == "/":
                    raise WeightDirsError(
                        f"{WEIGHT_DIRS_ENV} {role} directory '/': that would open the whole disk; name the weights' own directory"
                    )

    @classmethod
    def of(cls, model: str | None = None, load: Iterable = (), pull: Iterable = ()) -> WeightDirs:
        """The directories for an engine of ``model`` (used when it is an absolute path, not
        a hub name) that also loads under ``load`` and pulls into ``pull`` (None skipped)."""
        base = [model] if isinstance(model, str) and os.path.isabs(model) else []
        loads = [str(p) for p in [*base, *load] if p]
        return cls(tuple(dict.fromkeys(loads)), tuple(dict.fromkeys(str(p) for p in pull if p)))

    def env(self) -> dict[str, str]:
        """``{WEIGHT_DIRS_ENV: JSON}`` for the engine's environment."""
        return {WEIGHT_DIRS_ENV: json.dumps({"load": list(self.load), "pull": list(self.pull)})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WeightDirs:
        """The directories the launcher set (none when it set nothing); ``WeightDirsError``."""
        text = read(WEIGHT_DIRS_ENV, environ) or ""
        if not text.strip():
            return cls()
        try:
            doc = json.loads(text) if len(text) <= MAX_ENV else None
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict) or set(doc) - {"load", "pull"}:
            raise WeightDirsError(f'{WEIGHT_DIRS_ENV} is not JSON {{"load": [dirs], "pull": [dirs]}}')
        parts = {}
        for role in ("load", "pull"):
            dirs = doc.get(role, [])
            if not isinstance(dirs, list):
                raise WeightDirsError(f"{WEIGHT_DIRS_ENV} {role}: give the directories as a JSON list")
            parts[role] = tuple(dirs)
        return cls(**parts)

    def resolved(self) -> WeightDirs:
        """The same directories with symlinks and ``..`` resolved (``os.path.realpath``), in
        this process's filesystem; a pull directory is a load directory too (the engine loads
        what it pulled). ``WeightDirsError`` if one resolves to ``/``."""
        load, pull = _real(self.load), _real(self.pull)
        return WeightDirs(tuple(dict.fromkeys(load + pull)), pull)


def _real(dirs: tuple[str, ...]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(os.path.realpath(p) for p in dirs))
    if "/" in out:
        raise WeightDirsError(
            f"{WEIGHT_DIRS_ENV}: a directory resolves to '/'; name the weights' own directory"
        )
    return out


def inside(path: object, dirs: tuple[str, ...]) -> str | None:
    """Why ``path`` is not under one of ``dirs`` (already resolved), or None when it is."""
    why = _path_problem(path)
    if why:
        return why
    real = os.path.realpath(path)
    for root in dirs:
        if real == root or real.startswith(root.rstrip("/") + "/"):
            return None
    if not dirs:
        return f"this engine was started with no weight directories ({WEIGHT_DIRS_ENV} is unset)"
    return f"it resolves to {_show(real)}, outside {', '.join(_show(d) for d in dirs)}"


def body_refusal(path: str, headers: list, body: bytes, dirs: WeightDirs) -> str | None:
    """Why a request to ``path`` (one of ``PATH_ROUTES``) with ``body`` is refused, or None.
    ``dirs`` must be ``resolved()``."""
    if path not in PATH_ROUTES:
        return f"{clean(path)[:80]} is not a route this run uses"
    name = path.lstrip("/")
    if any(bytes(k).lower() == b"content-encoding" for k, _ in headers):
        return f"{name}: a content-encoded body is not accepted here; send plain JSON"
    if len(body) > MAX_BODY:
        return f"{name}: the body is over {MAX_BODY} bytes"
    try:
        doc = json.loads(body.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return f"{name}: the body is not one UTF-8 JSON object ({clean(str(exc))[:80]})"
    if not isinstance(doc, dict):
        return f"{name}: the body is not one JSON object"
    keys = UPDATE_KEYS if path == "/update_weights_from_disk" else PULL_KEYS
    extra = sorted(set(doc) - set(keys))
    if extra:
        return f"{name}: key {_show(extra[0])} is not one the run sends (only {', '.join(keys)})"
    missing = [k for k, required in keys.items() if required and k not in doc]
    if missing:
        return f"{name}: {missing[0]} is missing"
    if path == "/update_weights_from_disk":
        return _update_refusal(doc, dirs)
    return _pull_refusal(doc, dirs)


def _update_refusal(doc: dict, dirs: WeightDirs) -> str | None:
    version = doc.get("weight_version")
    if version is not None and (not isinstance(version, str) or len(version) > MAX_VERSION_TEXT):
        return f"update_weights_from_disk: weight_version must be a string of at most {MAX_VERSION_TEXT} characters"
    if doc.get("load_format") not in LOAD_FORMATS:
        allowed = ", ".join(str(f) for f in LOAD_FORMATS[1:])
        return f"update_weights_from_disk: load_format {_show(doc.get('load_format'))} is not allowed (only {allowed} or none)"
    why = inside(doc["model_path"], dirs.load)
    if why:
        return f"update_weights_from_disk model_path {_show(doc['model_path'])}: {why}; {_FIX}"
    return None


def _pull_refusal(doc: dict, dirs: WeightDirs) -> str | None:
    target = doc["target_version"]
    if not isinstance(target, int) or isinstance(target, bool) or not 0 <= target < 1 << 63:
        return f"pull_weights: target_version {_show(target)} is not a version number (an int >= 0)"
    for key, allowed in (("source_dir", dirs.load), ("local_checkpoint_dir", dirs.pull)):
        why = inside(doc[key], allowed)
        if why:
            return f"pull_weights {key} {_show(doc[key])}: {why}; {_FIX}"
    return None


def _path_problem(path: object) -> str | None:
    if not isinstance(path, str):
        return "not a path string"
    if not path or "\x00" in path or len(path) > MAX_PATH:
        return f"not a path (empty, a NUL byte, or over {MAX_PATH} characters)"
    if not os.path.isabs(path):
        return "not an absolute path"
    return None


def _show(value: object) -> str:
    return repr(clean(str(value))[:120])
