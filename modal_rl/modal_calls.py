"""What this project hands to Modal, recorded as it is handed over, through Modal's public API only.

Offline plan checks (dry runs, spec tests) need to say what a built function will ask Modal
for: GPU, volumes, secrets, cluster size, timeout, retries, the local files an image attaches.
Modal's objects keep those in private attributes that move between releases, so nothing here
reads them: the few calls that build Modal objects go through these helpers, which make the
object with the public call and remember, beside it, a plain description of the arguments.

Invariants:
- only public Modal names are used (``modal.App.function``, ``modal.clustered``,
  ``modal.Secret.from_name`` / ``from_dict``, ``modal.Volume.from_name``,
  ``Image.add_local_file`` / ``add_local_dir``), so the ``modal`` pin can follow its releases;
- a secret's description holds its name or its variable names, never a value;
- descriptions live in weak maps keyed by the Modal object: they go when the object goes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_SECRETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IMAGE_FILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def secret_from_name(name: str):
    """``modal.Secret.from_name(name)``, described as ``Secret.from_name('<name>')``."""
    import modal

    secret = modal.Secret.from_name(name)
    _SECRETS[secret] = f"Secret.from_name({name!r})"
    return secret


def secret_from_dict(env: Mapping[str, str]):
    """``modal.Secret.from_dict(env)``, described by its variable names only."""
    import modal

    secret = modal.Secret.from_dict(dict(env))
    _SECRETS[secret] = f"Secret.from_dict([{', '.join(env)}])"
    return secret


def describe_secret(secret) -> str:
    return _SECRETS.get(secret, type(secret).__name__)


def define_function(
    app,
    body: Callable,
    *,
    image,
    volumes: Mapping[str, str],
    secrets: Sequence[Any],
    env: Mapping[str, str],
    cluster_size: int | None = None,
    rdma: bool = False,
    **kwargs: Any,
):
    """``app.function(...)`` over ``body`` (over ``modal.clustered(size, rdma)`` when
    ``cluster_size`` is set), serialized. ``volumes``: volume name -> mount path (created if
    missing). ``kwargs``: plain settings (gpu, timeout, retries, cloud, region, cpu, ...).
    The description :func:`inspect_function` returns is recorded only once Modal accepted the
    arguments (its ``InvalidError`` passes through)."""
    import modal

    mounts = {path: modal.Volume.from_name(name, create_if_missing=True) for name, path in volumes.items()}
    target = modal.clustered(size=cluster_size, rdma=rdma)(body) if cluster_size is not None else body
    fn = app.function(
        image=image, volumes=mounts, secrets=list(secrets), env=dict(env), serialized=True, **kwargs
    )(target)
    _FUNCTIONS[fn] = {
        "gpu": kwargs.get("gpu"),
        "volumes": {path: name for name, path in volumes.items()},
        "secrets": [describe_secret(s) for s in secrets],
        "env": sorted(env),
        "cloud": kwargs.get("cloud"),
        "region": kwargs.get("region"),
        "cluster_size": cluster_size,
        "rdma": rdma if cluster_size is not None else None,
        "timeout": kwargs.get("timeout"),
        "retries": kwargs.get("retries") or 0,
        "settings": {k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool, type(None)))},
        "body": getattr(body, "__qualname__", repr(body)),
    }
    return fn


def inspect_function(fn) -> dict[str, Any]:
    """What ``fn`` was defined with, as handed to Modal (a copy); ``{}`` for a function not
    defined through :func:`define_function`."""
    record = _FUNCTIONS.get(fn)
    return {k: (v.copy() if isinstance(v, (dict, list)) else v) for k, v in (record or {}).items()}


def attach_local(image, local: str, remote: str, *, is_dir: bool):
    """``image`` plus a local file or directory at ``remote``, attached at container start
    (``copy=False``); the new image remembers every attachment up its chain."""
    out = (image.add_local_dir if is_dir else image.add_local_file)(local, remote, copy=False)
    _IMAGE_FILES[out] = [*_IMAGE_FILES.get(image, []), {"local": str(local), "remote": str(remote)}]
    return out


def image_local_files(image) -> list[dict[str, str]]:
    """The local files and directories attached with :func:`attach_local`, by remote path."""
    return sorted((dict(item) for item in _IMAGE_FILES.get(image, [])), key=lambda item: item["remote"])
