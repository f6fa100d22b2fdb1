"""The run kernels of the engine map: where a learnt shadow's runs end, and the two-pass
(row, column) probes' compression and combination.

A shadow (``engine_map``) holds, per engine element, the checkpoint word that landed there:
its index value (``FIRST_INDEX`` and up), or ``UNPLACED``. Engines place checkpoint tensors as a few
contiguous runs per parameter, so the reader looks for run ends; a block of the shadow that
is one run -- the usual case -- is checked with one branch-free OR (numba, ``codec.jit``).

Learnt with broadcast probes (``engine_map_probes``), a shadow first holds row ids: runs of
equal words (``row_runs``: a row of ``C`` columns lands as ``C`` equal words), kept as
(start, value) pairs while the same shadow takes the column pass; ``combine`` then turns
(row id, column) back into the index value one materialised pass would have left there.

Invariants, with or without numba: the breaks returned are exactly the ``i`` where
``flat[i + 1]`` neither continues ``flat[i]`` (``flat[i] >= 0`` and ``flat[i + 1] == flat[i] + 1``)
nor is unplaced after unplaced; ``row_runs`` returns every maximal run of equal words or
None (more than its cap); ``combine`` writes the index value only where both passes placed
the same checkpoint tensor's element, and otherwise reports the first element that differs.
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


def _row_runs_loop(flat: Any, starts: Any, values: Any) -> int:
    """Maximal runs of equal words: run ``k`` starts at ``starts[k]`` and holds ``values[k]``.
    Returns the run count, or -1 when there are more than ``starts`` holds. A block equal to
    the current run's word (the usual case: a row is one run) is checked with one OR."""
    n = flat.shape[0]
    cap = starts.shape[0]
    if n == 0:
        return 0
    if cap == 0:
        return -1
    starts[0] = 0
    values[0] = flat[0]
    cur = flat[0]
    k = 1
    s = 1
    while s < n:
        e = min(s + 256, n)
        off = 0
        for j in range(s, e):
            off |= flat[j] ^ cur
        if off != 0:
            for j in range(s, e):
                w = flat[j]
                if w != cur:
                    if k == cap:
                        return -1
                    starts[k] = j
                    values[k] = w
                    k += 1
                    cur = w
        s = e
    return k


def _combine_loop(flat, starts, values, row_bases, row_counts, widths, bases, row_end, err):  # noqa: ANN001, ANN202
    """Turn column words into index values in place, run by run of the row pass (``starts``
    empty: ``values`` holds one row word per element). A row run of tensor ``i``'s row ``r``
    must hold columns ``row_end .. row_end + widths[i] - 1``; the element becomes
    ``bases[i] + r * widths[i] + column``. A run that is no row id (unplaced, a pad) must hold
    the same word after the column pass. Returns 0, or 1 (placed by one pass only) / 2 (a
    word the loader changed) with the element in ``err[0]``."""
    n = flat.shape[0]
    dense = starts.shape[0] == 0
    m = n if dense else values.shape[0]
    t = row_bases.shape[0]
    for j in range(m):
        a = j if dense else starts[j]
        b = j + 1 if dense else (starts[j + 1] if j + 1 < m else n)
        v = values[j]
        if t == 0 or v < row_bases[0] or v >= row_end:
            bad = 0
            for e in range(a, b):
                bad |= flat[e] != v
            if bad:
                for e in range(a, b):
                    if flat[e] != v:
                        err[0] = e
                        return 1
            continue
        lo, hi = 0, t
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if row_bases[mid] <= v:
                lo = mid
            else:
                hi = mid
        r = v - row_bases[lo]
        if r >= row_counts[lo]:
            err[0] = a
            return 2
        width = widths[lo]
        delta = bases[lo] + r * width - row_end
        bad = 0
        for e in range(a, b):
            w = flat[e]
            bad |= (w < row_end) | (w >= row_end + width)
            flat[e] = w + delta
        if bad:
            for e in range(a, b):
                w = flat[e] - delta
                if w < row_end or w >= row_end + width:
                    err[0] = e
                    return 1 if w == v or w < FIRST_INDEX else 2
    return 0


def _combined_runs_loop(
    flat, starts, values, row_bases, row_counts, widths, bases, row_end, breaks, firsts, err
):  # noqa: ANN001, ANN202, PLR0912, PLR0915
    """``_combine_loop`` and ``_breaks_loop`` at once, writing nothing: the breaks of the
    words ``_combine_loop`` would write, and each run's first word (``firsts[k]`` follows
    ``breaks[k]``; the first element's word in ``err[1]``). A row run whose columns are in
    order (the usual case) is checked with two branch-free ORs. Returns the break count, -1
    when more than ``breaks`` holds (nothing was checked past that), -2 / -3 for
    ``_combine_loop``'s 1 / 2 (the element in ``err[0]``)."""
    n = flat.shape[0]
    dense = starts.shape[0] == 0
    m = n if dense else values.shape[0]
    t = row_bases.shape[0]
    cap = breaks.shape[0]
    k = 0
    prev = 0
    for j in range(m):
        a = j if dense else starts[j]
        b = j + 1 if dense else (starts[j + 1] if j + 1 < m else n)
        v = values[j]
        is_row = t > 0 and v >= row_bases[0] and v < row_end
        delta = 0
        off = 0
        bad = 0
        if is_row:
            lo, hi = 0, t
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if row_bases[mid] <= v:
                    lo = mid
                else:
                    hi = mid
            r = v - row_bases[lo]
            if r >= row_counts[lo]:
                err[0] = a
                return -3
            width = widths[lo]
            delta = bases[lo] + r * width - row_end
            w0 = flat[a]
            for e in range(a, b):
                w = flat[e]
                bad |= (w < row_end) | (w >= row_end + width)
                off |= w - w0 - (e - a)
            if bad:
                for e in range(a, b):
                    w = flat[e]
                    if w < row_end or w >= row_end + width:
                        err[0] = e
                        return -2 if w == v or w < FIRST_INDEX else -3
            first = w0 + delta
            last = flat[b - 1] + delta
        else:
            for e in range(a, b):
                bad |= flat[e] != v
            if bad:
                for e in range(a, b):
                    if flat[e] != v:
                        err[0] = e
                        return -2
            first = v
            last = v
            off = 0 if v == UNPLACED else 1
        if a == 0:
            err[1] = first
        elif not ((prev >= 0 and first == prev + 1) or (prev == UNPLACED and first == UNPLACED)):
            if k == cap:
                return -1
            breaks[k] = a - 1
            firsts[k] = first
            k += 1
        if off != 0:
            before = first
            for e in range(a + 1, b):
                c = flat[e] + delta if is_row else v
                if not ((before >= 0 and c == before + 1) or (before == UNPLACED and c == UNPLACED)):
                    if k == cap:
                        return -1
                    breaks[k] = e - 1
                    firsts[k] = c
                    k += 1
                before = c
        prev = last
    return k


ROW_RUNS = Kernel(_row_runs_loop)
COMBINE = Kernel(_combine_loop)
COMBINED_RUNS = Kernel(_combined_runs_loop)


def row_runs(flat: Any, cap: int) -> tuple[Any, Any] | None:
    """The maximal runs of equal words of ``flat`` (a flat CPU torch tensor) as (starts,
    values) int64 numpy arrays, or None when there are more than ``cap``."""
    import numpy as np

    kernel = ROW_RUNS.get()
    arr = flat.numpy()
    if kernel is not None:
        starts, values = np.empty(cap, np.int64), np.empty(cap, np.int64)
        k = kernel(arr, starts, values)
        return None if k < 0 else (starts[:k].copy(), values[:k].copy())
    if arr.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    starts = np.concatenate([[0], np.flatnonzero(arr[1:] != arr[:-1]) + 1]).astype(np.int64)
    return None if starts.size > cap else (starts, arr[starts].astype(np.int64))


def combine(flat: Any, starts: Any, values: Any, grid: Any) -> tuple[int, int]:
    """``_combine_loop`` on ``flat`` (a flat CPU torch tensor, written in place) with the
    row runs (``starts`` empty: ``values`` per element) and ``grid`` (``row_bases``,
    ``row_counts``, ``widths``, ``bases``: int64 numpy arrays; ``row_end``). Returns
    (0, 0) or (kind, element)."""
    import numpy as np

    arr = flat.numpy()
    args = (grid.row_bases, grid.row_counts, grid.widths, grid.base_array, grid.row_end)
    kernel = COMBINE.get()
    if kernel is not None:
        err = np.zeros(1, np.int64)
        kind = kernel(arr, starts, values, *args, err)
        return int(kind), int(err[0])
    return _combine_numpy(arr, starts, values, *args)


def combined_runs(flat: Any, starts: Any, values: Any, grid: Any, cap: int) -> tuple[int, int, Any]:
    """What ``combine`` then ``run_breaks`` give, without writing ``flat`` when the runs are
    few: (kind, element, runs). ``kind`` 0: ``runs`` is (bounds, first word of each run)
    -- ``bounds`` the run starts, then ``n`` -- or None when there are more than ``cap``
    breaks, and then ``flat`` holds the index values (the caller reads it element by
    element). ``kind`` 1 / 2: as ``combine``'s."""
    import numpy as np

    kernel = COMBINED_RUNS.get()
    n = int(flat.numel())
    if kernel is not None and n:
        args = (grid.row_bases, grid.row_counts, grid.widths, grid.base_array, grid.row_end)
        breaks, firsts, err = np.empty(cap, np.int64), np.empty(cap, np.int64), np.zeros(2, np.int64)
        k = kernel(flat.numpy(), starts, values, *args, breaks, firsts, err)
        if k <= -2:
            return -1 - k, int(err[0]), None
        if k >= 0:
            return 0, 0, ([0, *(breaks[:k] + 1).tolist(), n], [int(err[1]), *firsts[:k].tolist()])
    kind, at = combine(flat, starts, values, grid)
    if kind or not n:
        return kind, at, ([0, n], [UNPLACED]) if not kind else None
    found = run_breaks(flat, cap)
    if found is None:
        return 0, 0, None
    bounds = [0, *(b + 1 for b in found), n]
    return 0, 0, (bounds, flat[bounds[:-1]].tolist())


def _combine_numpy(arr, starts, values, row_bases, row_counts, widths, bases, row_end):  # noqa: ANN001, ANN202
    """``_combine_loop`` without numba: per element, in a few numpy passes (a group has at
    least one tensor, so ``row_bases`` is not empty)."""
    import numpy as np

    n = arr.shape[0]
    v = np.repeat(values, np.diff(np.append(starts, n))) if starts.size else values.astype(np.int64)
    w = arr.astype(np.int64)
    is_row = (v >= row_bases[0]) & (v < row_end)
    i = np.clip(np.searchsorted(row_bases, v, side="right") - 1, 0, None)
    r = v - row_bases[i]
    changed = is_row & (r >= row_counts[i])
    width = np.where(is_row, widths[i], 0)
    wrong = np.where(is_row, (w < row_end) | (w >= row_end + width), w != v)
    bad = np.flatnonzero(changed | wrong)
    if bad.size:
        e = int(bad[0])
        by_loader = changed[e] or (is_row[e] and w[e] >= FIRST_INDEX and w[e] != v[e])
        return (2 if by_loader else 1), e
    arr[:] = np.where(is_row, bases[i] + r * width + (w - row_end), w).astype(arr.dtype)
    return 0, 0
