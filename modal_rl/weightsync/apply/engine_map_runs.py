"""The run reader of the engine map: where a learnt shadow's runs end.

A shadow (``engine_map``) holds, per engine element, the checkpoint word that landed there:
its index value (``FIRST_INDEX`` and up), or ``UNPLACED``. Engines place checkpoint tensors as a few
contiguous runs per parameter, so the reader looks for run ends; a block of the shadow that
is one run -- the usual case -- is checked with one branch-free OR (numba, ``codec.jit``).

Invariant: the breaks returned are exactly the ``i`` where ``flat[i + 1]`` neither continues
``flat[i]`` (``flat[i] >= 0`` and ``flat[i + 1] == flat[i] + 1``) nor is unplaced after unplaced,
with or without numba (``engine_map_combine`` finds the same breaks for broadcast probes).
"""

from __future__ import annotations

from typing import Any

from modal_rl.weightsync.codec.jit import Kernel

UNPLACED = -1
FIRST_INDEX = 1 << 24  # index values start here: smaller constants written by a loader are pads


def _breaks_loop(flat: Any, out: Any) -> int:
    """Where runs end: ``i`` such that ``flat[i + 1]`` does not continue ``flat[i]`` (the next
    checkpoint position, or unplaced after unplaced). Fills ``out``; -1 when it is too small.
    A block that is one run (``flat[s + j] == flat[s] + j``, ``flat[s] >= 0``: the usual
    case) is checked with one branch-free OR over it; any other block, pair by pair."""
    n = flat.shape[0]
    k = 0
    s = 0
    while s < n - 1:
        e = min(s + 4096, n - 1)  # the pairs (i, i + 1) for s <= i < e
        one_run = False
        if flat[s] >= 0:
            first = flat[s]
            off = 0
            for j in range(e + 1 - s):
                off |= flat[s + j] - first - j
            one_run = off == 0
        if not one_run:
            for i in range(s, e):
                a, b = flat[i], flat[i + 1]
                if (a >= 0 and b == a + 1) or (a == -1 and b == -1):
                    continue
                if k == out.shape[0]:
                    return -1
                out[k] = i
                k += 1
        s = e
    return k


RUN_BREAKS = Kernel(_breaks_loop)  # numba on first use (``codec.jit``)


def run_cap(n: int) -> int:
    """The most run breaks a shadow of ``n`` elements is read as runs with (more: element by
    element, ``engine_map._read_shadow``)."""
    return max(64, n // 64)


def run_breaks(flat: Any, cap: int) -> list[int] | None:
    """The run ends of ``flat`` (see ``_breaks_loop``), or None when there are more than ``cap``."""
    import numpy as np
    import torch

    kernel = RUN_BREAKS.get()
    if kernel is not None:
        out = np.empty(cap, dtype=np.int64)
        k = kernel(flat.numpy(), out)
        return None if k < 0 else out[:k].tolist()
    head, tail = flat[:-1], flat[1:]  # without numba: the same in a few torch passes
    goes_on = ((tail - head == 1) & (head >= 0)) | ((tail == UNPLACED) & (head == UNPLACED))
    breaks = torch.nonzero(~goes_on).reshape(-1)
    return None if breaks.numel() > cap else breaks.tolist()
