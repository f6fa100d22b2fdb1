"""The broadcast probes' kernels: the row pass kept as runs, then combined with the column pass.

Learnt with broadcast probes (``engine_map_probes``), a shadow first holds row ids: row ``r``
of the group's tensor ``i`` is ``row_bases[i] + r``, and a row of ``C`` columns lands as
``C`` equal words. ``row_runs`` keeps them as (start, value) runs, so the same shadow can take
the column pass (column ``c`` of tensor ``i`` is ``col_bases[i] + c``: the column number
says the tensor too). ``combined_runs`` then reads the column pass against the row runs and
finds, without writing, the runs (``engine_map_runs``) of the words one materialised pass
would have left: ``bases[i] + r * C + c``; ``combine`` writes those words, for a shadow
read element by element (a transposing loader: too many runs).

Invariants, with or without numba: ``row_runs`` returns every maximal run of equal words,
or None (more than its cap); an element is combined only when its row pass holds a row of
tensor ``i`` and its column pass a column of the same tensor ``i``; an element the row pass
did not place (unplaced, a pad) must hold the same word after the column pass; the first
element breaking either is reported (``Disagreement``) instead of a map. The breaks and
run-first words ``combined_runs`` finds are exactly those ``run_breaks`` finds on what
``combine`` writes.
"""

from __future__ import annotations

import bisect
from typing import Any

from modal_rl.weightsync.apply.engine_map_runs import FIRST_INDEX, UNPLACED, run_breaks
from modal_rl.weightsync.codec.jit import Kernel


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
    for s in range(0, n, 256):
        blk = flat[s : s + 256]  # a view: numba vectorises a loop over it from 0
        off = blk[0] ^ cur
        for j in range(blk.shape[0]):
            off |= blk[j] ^ cur
        if off != 0:
            for j in range(blk.shape[0]):
                w = blk[j]
                if w != cur:
                    if k == cap:
                        return -1
                    starts[k] = s + j
                    values[k] = w
                    k += 1
                    cur = w
    return k


def _combine_loop(flat, out, starts, values, row_bases, row_counts, widths, bases, col_bases, row_end, err):  # noqa: ANN001, ANN202
    """Write into ``out`` (``flat`` itself, or as long) the word a materialised pass leaves,
    run by run of the row pass (``starts`` empty: ``values`` holds one row word per element).
    Returns 0; 1 for an element whose passes disagree (``err``: element, column word, row
    word); 2 for a row id past its tensor's rows (``err[0]``: the element)."""
    n = flat.shape[0]
    dense = starts.shape[0] == 0
    m = n if dense else values.shape[0]
    t = row_bases.shape[0]
    for j in range(m):
        a = j if dense else starts[j]
        b = j + 1 if dense else (starts[j + 1] if j + 1 < m else n)
        v = values[j]
        if v < row_bases[0] or v >= row_end:  # no row: unplaced or a pad, in both passes
            for e in range(a, b):
                if flat[e] != v:
                    err[0], err[1], err[2] = e, flat[e], v
                    return 1
                out[e] = v
            continue
        i, hi = 0, t  # the last tensor whose first row id is <= v
        while hi - i > 1:
            mid = (i + hi) // 2
            if row_bases[mid] <= v:
                i = mid
            else:
                hi = mid
        r = v - row_bases[i]
        if r >= row_counts[i]:
            err[0] = a
            return 2
        lo, width = col_bases[i], widths[i]
        delta = bases[i] + r * width - lo
        for e in range(a, b):
            w = flat[e]
            if w < lo or w >= lo + width:
                err[0], err[1], err[2] = e, w, v
                return 1
            out[e] = w + delta
    return 0


def _combined_runs_loop(
    flat, starts, values, row_bases, row_counts, widths, bases, col_bases, row_end, breaks, firsts, err
):  # noqa: ANN001, ANN202, PLR0912
    """``_combine_loop`` then ``_breaks_loop`` on its words, reading ``flat`` once and writing
    nothing: the breaks (``breaks[k]``, the word after it ``firsts[k]``; the first element's
    word in ``err[3]``). A row run whose columns are in order (the usual case) is checked
    with one branch-free OR and its two ends. Returns the break count; -1 when more than
    ``breaks`` holds (nothing past that was checked); -2 / -3 for ``_combine_loop``'s 1 / 2."""
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
        run = flat[a:b]  # a view: numba vectorises a loop over it from 0
        is_row = v >= row_bases[0] and v < row_end
        delta, lo, width = 0, 0, 0
        if is_row:
            i, hi = 0, t  # the last tensor whose first row id is <= v
            while hi - i > 1:
                mid = (i + hi) // 2
                if row_bases[mid] <= v:
                    i = mid
                else:
                    hi = mid
            r = v - row_bases[i]
            if r >= row_counts[i]:
                err[0] = a
                return -3
            lo, width = col_bases[i], widths[i]
            delta = bases[i] + r * width - lo
            w0 = run[0]
            off = w0 - w0
            for e in range(run.shape[0]):
                off |= run[e] - (w0 + flat.dtype.type(e))  # in the word's type: it vectorises
            if off == 0:  # columns in order (no wrap: the ends are checked in int64)
                bad = w0 < lo or w0 + (b - a) - 1 >= lo + width
            else:
                bad = False
                for e in range(run.shape[0]):
                    bad |= (run[e] < lo) | (run[e] >= lo + width)
            first, last = w0 + delta, run[b - a - 1] + delta
        else:  # no row: unplaced or a pad, in both passes
            off = 0 if v == UNPLACED else 1
            bad = False
            for e in range(run.shape[0]):
                bad |= run[e] != v
            first, last = v, v
        if bad:
            for e in range(a, b):
                w = flat[e]
                if (w < lo or w >= lo + width) if is_row else w != v:
                    err[0], err[1], err[2] = e, w, v
                    return -2
        if a == 0:
            err[3] = first
        elif not ((prev >= 0 and first == prev + 1) or (prev == UNPLACED and first == UNPLACED)):
            if k == cap:
                return -1
            breaks[k], firsts[k] = a - 1, first
            k += 1
        if off != 0:  # breaks inside the run: pair by pair
            before = first
            for e in range(1, b - a):
                c = run[e] + delta if is_row else v
                if not ((before >= 0 and c == before + 1) or (before == UNPLACED and c == UNPLACED)):
                    if k == cap:
                        return -1
                    breaks[k], firsts[k] = a + e - 1, c
                    k += 1
                before = c
        prev = last
    return k


ROW_RUNS = Kernel(_row_runs_loop)  # numba on first use (``codec.jit``)
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


class Disagreement(Exception):
    """The two passes do not place one element alike (``changed``: the column pass holds a
    word no probe holds -- the loader changed the values -- rather than another element's)."""

    def __init__(self, element: int, changed: bool) -> None:
        super().__init__(element, changed)
        self.element, self.changed = element, changed


def _disagreement(kind: int, err: Any, grid: Any) -> Disagreement:
    """Kind 2: a row id past its tensor's rows (a changed value). Kind 1: the column word is
    unplaced, a pad, or not rewritten (placed by one pass only), or another tensor's column
    (placed from another tensor): a disagreement; any other word was changed."""
    e, w, v = (int(x) for x in err[:3])
    if kind == 2:
        return Disagreement(e, True)
    if w < FIRST_INDEX or w == v:
        return Disagreement(e, False)
    i = bisect.bisect_right(grid.col_bases.tolist(), w) - 1
    is_col = i >= 0 and w >= grid.row_end and w - int(grid.col_bases[i]) < int(grid.widths[i])
    return Disagreement(e, not is_col)


def _args(grid: Any) -> tuple:
    return grid.row_bases, grid.row_counts, grid.widths, grid.base_array, grid.col_bases, grid.row_end


def combine(flat: Any, starts: Any, values: Any, grid: Any) -> None:
    """Write, in place of ``flat``'s column words, the words a materialised pass leaves
    (``_combine_loop``; ``grid``: ``Numbering.arrays``). Raises ``Disagreement``."""
    import numpy as np

    arr = flat.numpy()
    err = np.zeros(4, np.int64)
    kernel = COMBINE.get()
    kind = (
        kernel(arr, arr, starts, values, *_args(grid), err)
        if kernel
        else _combine_numpy(arr, starts, values, grid, err)
    )
    if kind:
        raise _disagreement(kind, err, grid)


def combined_runs(flat: Any, starts: Any, values: Any, grid: Any, cap: int) -> Any:
    """The runs ``run_breaks`` would find after ``combine``, as (bounds -- the run starts,
    then ``n`` -- and each run's first word), ``flat`` unwritten; or None when there are more
    than ``cap`` breaks, ``flat`` then combined (read it element by element). Raises
    ``Disagreement``."""
    import numpy as np

    kernel = COMBINED_RUNS.get()
    n = int(flat.numel())
    if kernel is not None and n:
        breaks, firsts, err = np.empty(cap, np.int64), np.empty(cap, np.int64), np.zeros(4, np.int64)
        k = kernel(flat.numpy(), starts, values, *_args(grid), breaks, firsts, err)
        if k <= -2:
            raise _disagreement(-1 - k, err, grid)
        if k >= 0:
            return [0, *(breaks[:k] + 1).tolist(), n], [int(err[3]), *firsts[:k].tolist()]
    combine(flat, starts, values, grid)
    if not n:
        return [0, 0], []
    found = run_breaks(flat, cap)
    if found is None:
        return None
    bounds = [0, *(b + 1 for b in found), n]
    return bounds, flat[bounds[:-1]].tolist()


def _combine_numpy(arr: Any, starts: Any, values: Any, grid: Any, err: Any) -> int:
    """``_combine_loop`` without numba: per element, in a few numpy passes."""
    import numpy as np

    n = arr.shape[0]
    v = np.repeat(values, np.diff(np.append(starts, n))) if starts.size else values.astype(np.int64)
    w = arr.astype(np.int64)
    is_row = (v >= grid.row_bases[0]) & (v < grid.row_end)
    i = np.clip(np.searchsorted(grid.row_bases, v, side="right") - 1, 0, None)
    r = v - grid.row_bases[i]
    past = is_row & (r >= grid.row_counts[i])
    lo, width = grid.col_bases[i], grid.widths[i]
    wrong = np.where(is_row, (w < lo) | (w >= lo + width), w != v)
    bad = np.flatnonzero(past | wrong)
    if bad.size:
        e = int(bad[0])
        err[0], err[1], err[2] = e, w[e], v[e]
        return 2 if past[e] else 1
    arr[:] = np.where(is_row, grid.base_array[i] + r * width + (w - lo), w).astype(arr.dtype)
    return 0
