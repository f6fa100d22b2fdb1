"""Deferred registration with verl's by-name registries, shared by our ``verl.plugins`` modules.

verl imports every ``verl.plugins`` entry point at the end of ``import verl`` and logs a
failing one at DEBUG only. A registry usually lives in a module that ``import verl`` does
not load (the checkpoint-engine base, the reward-loop managers), and importing it from the
plugin would add seconds of Ray / transformers to every process that imports verl. So a
plugin calls :func:`after_import`: a one-shot import hook runs the registration right after
the registry's module finishes loading, and whoever can see that registry sees our name.

Invariants:
- a registration runs at most once per process, and only after the real loader executed the
  target module (the hook never changes what the module defines);
- when the target is already imported, registration runs at once;
- a failing registration is logged at ERROR by :func:`loudly` (never swallowed silently) and
  its ``on_error`` callback can leave a marker in verl's registry, so asking verl for the
  name names the cause instead of "unknown".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable

log = logging.getLogger("verl_modal")

_PENDING: dict[str, list[Callable[[], None]]] = {}  # target module -> registrations waiting for it


def loudly(what: str, register: Callable[[], None], on_error: Callable[[Exception], None] | None = None):
    """``register`` wrapped so that a failure is logged at ERROR (naming ``what``) and handed
    to ``on_error``; the wrapper itself never raises (it runs inside someone else's import)."""

    def run() -> None:
        try:
            register()
        except Exception as exc:
            log.error("verl_modal: could not register %s: %r", what, exc)
            if on_error is not None:
                try:
                    on_error(exc)
                except Exception as marker_exc:  # the marker is best effort; the log above is not
                    log.error("verl_modal: could not record the failure for %s: %r", what, marker_exc)

    return run


def as_import_error(exc: Exception) -> ImportError:
    return exc if isinstance(exc, ImportError) else ImportError(f"{type(exc).__name__}: {exc}")


class _RunAfter(importlib.abc.Loader):
    """Wraps the real loader of a target module; runs its pending registrations after it."""

    def __init__(self, inner: importlib.abc.Loader, target: str) -> None:
        self.inner, self.target = inner, target

    def __getattr__(self, name):  # get_source, get_filename, is_package … for tools that ask
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        for register in _PENDING.pop(self.target, []):
            register()


class _Hook(importlib.abc.MetaPathFinder):
    """One finder for all pending targets; answers only for those, once each."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfter(spec.loader, fullname)
        return spec


_HOOK = _Hook()


def after_import(target: str, register: Callable[[], None]) -> None:
    """Run ``register`` once ``target`` (a dotted module name) has been imported.

    ``register`` should come from :func:`loudly`: it runs inside verl's own import statement.
    """
    if target in sys.modules:
        register()
        return
    _PENDING.setdefault(target, []).append(register)
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
