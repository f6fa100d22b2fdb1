"""The one-core bounds ``weight-sync-scale`` reports beside what a rank and a receiver cost.

Both run on one core, in the benchmark's own process, over the real trajectory's previous and
new bf16 words laid out flat at a size far above any cache (``bound_words``), so they are
what this host's memory gives one core now:

- ``read``: a compiled loop that reads the previous and the new state once (an OR of their
  XORs, so nothing can be skipped). No delta encoder can do less: it must look at every word
  of both. Reported as CPU seconds per GB of one state (``read_bound_s_per_gb``);
- ``fused``: the simplest compiled compare-and-emit — eight 64-bit blocks tested together,
  a changed group's changed words written out as position and new word. What a publisher's
  diff costs before any coding, framing or Python (``fused_kernel_s_per_gb``).

Best of three runs each: the host is shared, and the bound is what it can do, not what it
did while a neighbour ran.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

GROUP = 8


def _read_kernel(a, b):
    acc = np.uint64(0)
    for i in range(a.size):
        acc |= a[i] ^ b[i]
    return acc


def _fused_kernel(a64, b64, o16, n16, pos, new):
    k = 0
    whole = a64.size - a64.size % GROUP
    for g in range(0, whole, GROUP):
        acc = np.uint64(0)
        for t in range(GROUP):
            acc |= a64[g + t] ^ b64[g + t]
        if acc:
            for t in range(GROUP):
                if a64[g + t] != b64[g + t]:
                    for j in range((g + t) * 4, (g + t) * 4 + 4):
                        pos[k] = j
                        new[k] = n16[j]
                        k += o16[j] != n16[j]
    return k


_compiled: dict[str, Any] = {}


def _kernels():
    if not _compiled:
        from numba import njit

        _compiled["read"] = njit(nogil=True, cache=True)(_read_kernel)
        _compiled["fused"] = njit(nogil=True, cache=True)(_fused_kernel)
    return _compiled["read"], _compiled["fused"]


def flat_words(state: dict[str, Any], words: int) -> np.ndarray:
    """``words`` bf16 words of ``state`` laid out flat (its tensors repeated in order)."""
    import torch

    one = torch.cat([t.reshape(-1).view(torch.int16) for t in state.values()]).numpy().view(np.uint16)
    reps = -(-words // one.size)
    return np.tile(one, reps)[:words].copy()


def one_core_bounds(prev: dict[str, Any], new: dict[str, Any], gb: float = 0.5) -> dict[str, float]:
    """CPU seconds per GB of state of the read bound and of the fused kernel, one core
    (pinned to the process's first allowed core while measuring)."""
    import os

    words = int(gb * 1e9) // 2 // 32 * 32
    a, b = flat_words(prev, words), flat_words(new, words)
    a64, b64 = a.view(np.uint64), b.view(np.uint64)
    read, fused = _kernels()
    pos, out = np.empty(words, np.int64), np.empty(words, np.uint16)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        read(a64[:64], b64[:64])
        fused(a64[:64], b64[:64], a[:256], b[:256], pos, out)
        best_read = best_fused = float("inf")
        changed = 0
        for _ in range(3):
            t0 = time.process_time()
            read(a64, b64)
            best_read = min(best_read, time.process_time() - t0)
            t0 = time.process_time()
            changed = fused(a64, b64, a, b, pos, out)
            best_fused = min(best_fused, time.process_time() - t0)
    finally:
        os.sched_setaffinity(0, allowed)
    state_gb = words * 2 / 1e9
    return {
        "read_bound_s_per_gb": best_read / state_gb,
        "fused_kernel_s_per_gb": best_fused / state_gb,
        "bound_changed_fraction": int(np.count_nonzero(a != b)) / words,
        "bound_emitted_words": int(changed),
    }
