"""Deferred registration with verl's by-name registries, shared by our ``verl.plugins`` modules.

verl imports every ``verl.plugins`` entry point at the end of ``import verl`` and logs a
failing one at DEBUG only. A registry usually lives in a module that ``import verl`` does
not load (the checkpoint-engine base, the reward-loop managers), and importing it from the
plugin would add seconds of Ray / transformers to every process that imports verl. So a
plugin calls :func:`after_import`: the one post-import hook (:mod:`verl_modal._post_import`)
runs the registration right after the registry's module finishes loading, and whoever can
see that registry sees our name.

Invariants:
- a registration runs at most once per process, and only after the real loader executed the
  target module (the hook never changes what the module defines);
- when the target is already imported, registration runs at once;
- a failing registration is logged at ERROR by :func:`loudly` (never swallowed silently) and
  its ``on_error`` callback can leave a marker in verl's registry, so asking verl for the
  name names the cause instead of "unknown".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from verl_modal import _post_import

log = logging.getLogger("verl_modal")


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


def after_import(target: str, register: Callable[[], None]) -> None:
    """Run ``register`` once ``target`` (a dotted module name) has been imported
    (verl_modal's one post-import hook, :mod:`verl_modal._post_import`).

    ``register`` should come from :func:`loudly`: it runs inside verl's own import statement.
    """
    _post_import.after_import(target, register)
