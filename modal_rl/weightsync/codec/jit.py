"""numba, one way: a kernel is compiled on its first use, never at import.

``Kernel(fn).get()`` is ``fn`` compiled by numba (``nogil``, cached on disk, so a later
process loads it instead of compiling), or None where numba is not installed: the caller then
takes its numpy path. The diff (``diffwords``) and the sparse scatter (``scatter``) have one;
the v2 coding's rANS and residual models (``codings.ctxcoder``) have no numpy path and are
imported only when a v2 chunk is coded or decoded (``codings.chunks_v2``).

Invariant: importing a module that defines a ``Kernel`` imports no numba.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Kernel:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._lock = threading.Lock()
        self._compiled: Callable[..., Any] | None = None
        self._done = False

    def get(self) -> Callable[..., Any] | None:
        """The compiled kernel, or None without numba (then use the numpy path)."""
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        from numba import njit
                    except ImportError:
                        self._compiled = None
                    else:
                        self._compiled = njit(nogil=True, cache=True)(self.fn)
                    self._done = True
        return self._compiled
