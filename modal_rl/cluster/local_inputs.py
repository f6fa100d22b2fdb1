"""Local files a job names, shipped into the Modal containers at the same path.

A ``modal run`` user expects the files on their command line to travel with the job: a YAML
given to ``--custom-config-path``, a small parquet in ``data.train_files``, a reward function
file. :func:`collect` picks, from the ``(flag or key, value)`` pairs an adapter says name
inputs, those that exist on this machine, and the Modal backend mounts each into every
container at the *same absolute path* (``modal.Image.add_local_file`` / ``add_local_dir``
with ``copy=False``: attached at container start, no image rebuild), so the user's argv
reaches the framework byte for byte.

Invariants:
- a path under a mounted Volume or an image root is never shipped (the Volume or image has
  it); a path that does not exist here is left alone (it may be in the image);
- only absolute paths travel: a relative or ``~`` path that exists here is refused with the
  absolute spelling to use (the job's working directory and home in the container differ);
- the total is capped (:data:`MAX_SHIP_BYTES`); above it the error names the largest input
  and the way out (a Volume). ``--dry-run`` lists what travels (``describe``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

MAX_SHIP_BYTES = 50 * 2**20  # configs and small data; models and datasets belong on a Volume


class LocalInputError(ValueError):
    """A local input that cannot travel as given; the message is one line."""


@dataclass(frozen=True)
class LocalInput:
    path: str  # absolute; the same inside the containers
    named_by: str  # the flag or config key that names it
    bytes: int
    is_dir: bool

    def to_dict(self) -> dict:
        return asdict(self)


def size_of(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if os.path.isfile(full) and not os.path.islink(full):
                total += os.path.getsize(full)
    return total


def _under(path: str, roots: Iterable[str]) -> bool:
    norm = os.path.normpath(path)
    for root in roots:
        base = os.path.normpath(root)
        if norm == base or norm.startswith(base.rstrip("/") + "/"):
            return True
    return False


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def collect(
    candidates: Iterable[tuple[str, str]],
    *,
    mounts: Iterable[str] = (),
    image_roots: Iterable[str] = (),
    cap: int = MAX_SHIP_BYTES,
) -> list[LocalInput]:
    """The inputs to ship, in order, from ``(named_by, value)`` pairs (module docstring).

    Raises :class:`LocalInputError` for a relative/``~`` path that exists here, or when the
    total exceeds ``cap``."""
    mounts, image_roots = list(mounts), list(image_roots)
    found: dict[str, LocalInput] = {}
    for named_by, value in candidates:
        value = str(value).strip()
        if not value or "://" in value:
            continue
        expanded = os.path.expanduser(value)
        if not os.path.exists(expanded):
            continue
        if not os.path.isabs(value):
            raise LocalInputError(
                f"{named_by} {value}: a local input is shipped to the Modal containers at the same "
                f"absolute path, so write it as {os.path.abspath(expanded)}"
            )
        path = os.path.normpath(value)
        if _under(path, mounts) or _under(path, image_roots) or path in found:
            continue
        found[path] = LocalInput(path, named_by, size_of(path), os.path.isdir(path))
    # A file inside a shipped directory travels with it.
    shipped = [
        item
        for item in found.values()
        if not any(
            other.is_dir and other.path != item.path and _under(item.path, [other.path])
            for other in found.values()
        )
    ]
    total = sum(item.bytes for item in shipped)
    if total > cap:
        largest = max(shipped, key=lambda item: item.bytes)
        raise LocalInputError(
            f"local inputs for the Modal containers total {_mib(total)}, above the {_mib(cap)} that travel "
            f"with a job (largest: {largest.named_by} {largest.path}, {_mib(largest.bytes)}); put them on a "
            "Volume (--volume NAME:PATH) and name the mounted path"
        )
    return shipped


def hydra_values(value: str) -> list[str]:
    """The paths in one Hydra override value: ``a``, ``[a,b]`` or ``['a', 'b']``."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
        return [part.strip().strip("'\"") for part in text.split(",") if part.strip()]
    return [text.strip("'\"")]
