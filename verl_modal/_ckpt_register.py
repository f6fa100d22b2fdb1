"""``verl.plugins`` entry point: registers the ``modal_delta`` checkpoint engine with verl.

verl loads every ``verl.plugins`` entry point at the end of ``import verl`` and logs a failing
one at DEBUG only. Importing verl's checkpoint-engine stack here would add seconds (Ray,
tensordict, the rollout adapters) to every process that imports verl, so registration is
deferred: a one-shot import hook runs it right after ``verl.checkpoint_engine.base`` — where
``CheckpointEngineRegistry`` lives — finishes loading. Whoever can see the registry
therefore sees ``modal_delta`` in it.

Invariants:
- registration happens exactly once per process, and never changes what the base module
  defines (the hook only runs code after the real loader);
- a registration failure is logged at ERROR and recorded with verl's own
  ``CheckpointEngineRegistry.record_import_error``, so asking for ``modal_delta`` names the
  cause instead of "not registered".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable

log = logging.getLogger("verl_modal")

TARGET = "verl.checkpoint_engine.base"
ENGINE_MODULE = "verl_modal.checkpoint_engine"


def register() -> None:
    """Import the engine module (its class decorator registers it); make a failure loud."""
    try:
        __import__(ENGINE_MODULE)
    except Exception as exc:
        log.error("verl_modal: could not register checkpoint engine 'modal_delta': %r", exc)
        base = sys.modules.get(TARGET)
        if base is not None:
            err = exc if isinstance(exc, ImportError) else ImportError(f"{type(exc).__name__}: {exc}")
            base.CheckpointEngineRegistry.record_import_error(ENGINE_MODULE, err)


class _RunAfter(importlib.abc.Loader):
    """Wraps the real loader of a module; calls ``callback`` once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self.inner = inner
        self.callback = callback

    def __getattr__(self, name):  # get_source, get_filename, … for tools that ask
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.callback()


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, callback: Callable[[], None]) -> None:
        self.target = target
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one shot, and lets the real finders answer below
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfter(spec.loader, self.callback)
        return spec


def run_after_import(target: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` right after module ``target`` loads (now, if it already has); once."""
    if target in sys.modules:
        callback()  # the module already exists (e.g. this module was imported late)
    elif not any(isinstance(f, _Hook) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook(target, callback))


def install() -> None:
    run_after_import(TARGET, register)


install()
