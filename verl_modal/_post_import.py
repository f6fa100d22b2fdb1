"""verl_modal's one post-import hook: run a callback right after a named module executes.

Both users need code to run inside someone else's import: the ``verl.plugins`` registrations
(``verl_modal._register``: register a name once verl's registry module has loaded) and the CPU
run-time fixes (``verl_modal.cpu.patches``: wrap a vLLM / verl function once its module has
loaded, in worker processes that import it late). One ``sys.meta_path`` finder serves both.

Invariants:
- a callback runs at most once per process, and only after the real loader executed the
  target module (the hook never changes what the module defines, only wraps its loader);
- when the target is already imported, the callback runs at once;
- the finder answers only for targets with pending callbacks, and asks the other finders on
  ``sys.meta_path`` for the real spec (so editable installs and namespace finders still work);
- callbacks must not raise (they run inside another module's import statement): wrap them,
  e.g. with ``verl_modal._register.loudly``.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

_PENDING: dict[str, list[Callable[[], None]]] = {}  # target module -> callbacks waiting for it


class _RunAfter(importlib.abc.Loader):
    """Wraps the real loader of a target module; runs its pending callbacks after it."""

    def __init__(self, inner: importlib.abc.Loader, target: str) -> None:
        self.inner, self.target = inner, target

    def __getattr__(self, name):  # get_source, get_filename, is_package … for tools that ask
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        for callback in _PENDING.pop(self.target, []):
            callback()


class _Hook(importlib.abc.MetaPathFinder):
    """One finder for all pending targets; answers only for those, once each."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RunAfter(spec.loader, fullname)
                return spec
        return None


_HOOK = _Hook()


def after_import(target: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` once ``target`` (a dotted module name) has been imported."""
    if target in sys.modules:
        callback()
        return
    _PENDING.setdefault(target, []).append(callback)
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def pending(target: str) -> bool:
    """Whether callbacks wait for ``target`` in this process."""
    return bool(_PENDING.get(target))
