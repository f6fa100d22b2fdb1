"""The probes the engine map is learned from, and one group's learning pass.

A probe stands in for a checkpoint tensor in the engine's own ``load_weights``
(``engine_map``); each element says which checkpoint element it is. Two kinds:

- **materialised** (``probes="indices"``): element ``k`` of the group's tensor ``i`` holds
  ``bases[i] + k`` (``Numbering``: tensors one apart, from ``FIRST_INDEX``), one pass, as
  many words as the group's checkpoint elements;
- **broadcast** (the default): a tensor of shape ``(d0, ..., dn-1)`` is ``R = d0 * ... *
  d(n-2)`` rows of ``C = d(n-1)`` columns (a 1-D tensor: one row; 0-D: one element). Pass
  "rows" feeds each row's id (``row_bases[i] + r``: rows numbered across the group's
  tensors, one apart, from ``FIRST_INDEX``) expanded along the columns; pass "cols" feeds
  each column's number (``col_bases[i] + c``: numbered after the rows, tensors one apart,
  so a column says its tensor too) expanded along the rows. Both are stride-0 views of a
  few written words (``Iota``): the probes cost R + C words per tensor, not R * C.

Between the passes each shadow's row ids are kept as runs of equal words
(``engine_map_combine.row_runs``: a placed row is ``C`` equal words, and a sharded, fused or
copied layout keeps that), so the same shadow memory takes the column pass; a shadow whose
row ids do not compress (a transposing loader: a new row at every element) is kept whole
(``dense_rows_params``, its bytes in ``rows_bytes``). ``combined_runs`` then reads, per
element, ``bases[i] + r * C + c`` -- exactly the word the materialised pass leaves -- so both
kinds read back into the same map.

Invariants:
- the pass is the loader's, twice: an element that is a row of tensor ``i`` after pass "rows"
  must hold a column of the same ``i`` after pass "cols", an element that is not (unplaced,
  a pad) must hold the same word; otherwise its parameter falls back (``mismatched``) with
  why;
- a loader that refuses a broadcast probe (a ``.view`` that needs contiguous memory, a write
  into it) is not an error: the group is learned again with materialised probes
  (``materialised_groups``); a tensor refused by those too is ``failed``;
- probe values are written once and only read: a loader that writes into them stops
  learning (``Iota.intact``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from modal_rl.weightsync.apply.engine_map_buffers import Iota, ShadowArena
from modal_rl.weightsync.apply.engine_map_combine import Disagreement, combined_runs, row_runs
from modal_rl.weightsync.apply.engine_map_runs import FIRST_INDEX, UNPLACED, run_cap

Load = Callable[[Any, Iterator[tuple[str, Any]]], Any]
Read = Callable[[str, Any, "Numbering", Any], None]


def grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of a tensor's broadcast probes: the last dimension is the columns (a
    0-D tensor: one of each)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, (shape[-1] if shape else 1)


@dataclass(frozen=True)
class Numbering:
    """How a pass numbers checkpoint elements. Materialised: element ``k`` of tensor ``i`` is
    ``bases[i] + k``; tensors one apart (no run continues from one into the next), from
    ``FIRST_INDEX`` (a constant a loader writes, a pad, is no index). Broadcast: row ``r`` of
    tensor ``i`` is ``row_bases[i] + r``, column ``c`` is ``col_bases[i] + c``."""

    names: list[str]
    bases: list[int]
    end: int  # one past the last index (the last tensor's gap)
    row_bases: list[int]
    rows: list[int]
    col_bases: list[int]
    cols: list[int]
    row_end: int  # one past the last row id; column numbers follow, tensors one apart
    col_end: int
    dtype: Any

    @classmethod
    def for_tensors(cls, names: list[str], state: dict[str, Any]) -> Numbering:
        import torch

        bases, at, row_bases, rows, cols = [], FIRST_INDEX, [], [], []
        for n in names:
            bases.append(at)
            at += state[n].numel() + 1
            r, c = grid(tuple(state[n].shape))
            row_bases.append(row_bases[-1] + rows[-1] + 1 if rows else FIRST_INDEX)
            rows.append(r)
            cols.append(c)
        row_end = row_bases[-1] + rows[-1] + 1 if rows else FIRST_INDEX
        col_bases, col_at = [], row_end
        for c in cols:
            col_bases.append(col_at)
            col_at += c + 1
        dtype = torch.int32 if max(at, col_at) < 1 << 31 else torch.int64
        return cls(names, bases, at, row_bases, rows, col_bases, cols, row_end, col_at, dtype)

    def find(self, value: int) -> tuple[str, int] | None:
        """The tensor and position ``value`` indexes (the position may run past the tensor:
        the loader changed the value), or None for no index of this pass."""
        if not FIRST_INDEX <= value < self.end:
            return None
        i = bisect.bisect_right(self.bases, value) - 1
        return self.names[i], value - self.bases[i]

    def arrays(self) -> Any:
        """The numbering as int64 numpy arrays, for ``engine_map_combine``."""
        import types

        import numpy as np

        a = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
        return types.SimpleNamespace(
            row_bases=a(self.row_bases),
            row_counts=a(self.rows),
            widths=a(self.cols),
            base_array=a(self.bases),
            col_bases=a(self.col_bases),
            row_end=self.row_end,
        )

    def values_needed(self, broadcast: bool) -> int:
        """How many ``Iota`` words the pass's probes are views of."""
        return (self.col_end if broadcast else self.end) - FIRST_INDEX


def index_probes(state: dict, num: Numbering, only: Iterable[str], iota: Iota) -> Iterator[tuple[str, Any]]:
    values = iota.values(num.values_needed(False), num.dtype)  # values[j] == FIRST_INDEX + j
    where = dict(zip(num.names, num.bases, strict=True))
    for name in only:
        t = state[name]
        start = where[name] - FIRST_INDEX
        yield name, values[start : start + t.numel()].view(t.shape)


def row_probes(state: dict, num: Numbering, iota: Iota) -> Iterator[tuple[str, Any]]:
    values = iota.values(num.values_needed(True), num.dtype)
    for name, base, rows in zip(num.names, num.row_bases, num.rows, strict=True):
        shape = tuple(state[name].shape)
        ids = values[base - FIRST_INDEX : base - FIRST_INDEX + rows]
        yield name, ids.view(*shape[:-1], 1).expand(shape) if shape else ids.view(())


def col_probes(state: dict, num: Numbering, iota: Iota) -> Iterator[tuple[str, Any]]:
    values = iota.values(num.values_needed(True), num.dtype)
    for name, base, cols in zip(num.names, num.col_bases, num.cols, strict=True):
        shape = tuple(state[name].shape)
        cols_of = values[base - FIRST_INDEX : base - FIRST_INDEX + cols]
        yield name, cols_of.view(*(1,) * (len(shape) - 1), cols).expand(shape) if shape else cols_of.view(())


def load_indices(model: Any, state: dict, num: Numbering, load: Load, iota: Iota) -> set[str]:
    """Load every materialised probe of the pass; if the loader refuses the batch, one by
    one. Returns the checkpoint names whose load raised."""
    try:
        load(model, index_probes(state, num, num.names, iota))
        return set()
    except Exception:  # noqa: BLE001 -- which tensor? ask one at a time below
        pass
    failed = set()
    for name in num.names:
        try:
            load(model, index_probes(state, num, [name], iota))
        except Exception:  # noqa: BLE001 -- this tensor's parameters fall back
            failed.add(name)
    return failed


@dataclass
class PassResult:
    failed: set[str]  # checkpoint tensors the loader refused, even materialised
    mismatched: dict[str, str]  # parameter -> why its two passes disagree
    materialised: bool  # learned with materialised probes
    index_bytes: int  # probe values written for it
    dense_rows_params: int = 0
    rows_bytes: int = 0  # the row pass's result kept for the column pass


class _Clock:
    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def lap(self, what: str) -> None:
        now = time.perf_counter()
        self.into[what] = self.into.get(what, 0.0) + now - self.t
        self.t = now


def learn_pass(
    params: dict[str, Any],
    owned: list[str],
    members: list[str],
    state: dict,
    model: Any,
    load: Load,
    buffers: tuple[ShadowArena, Iota],
    broadcast: bool,
    read: Read,
    timings: dict[str, float],
) -> PassResult:
    """Load ``members``' probes with shadows for the ``owned`` parameters only (every other
    parameter storage-less), then ``read`` each shadow, holding index values (``Numbering``)."""
    import torch

    arena, iota = buffers
    num = Numbering.for_tensors(members, state)
    clock = _Clock(timings)
    saved = {pname: p.data for pname, p in params.items()}
    grads = {pname: p.requires_grad for pname, p in params.items()}
    own = set(owned)
    # Parameters outside the pass share one never-initialised scratch per device: on the CPU
    # its pages stay unbacked until written, and a loader writes (garbage, ignored) only
    # where a tensor of the pass lands outside its layer. (A parameter's storage cannot be
    # swapped for a ``meta`` tensor; on a GPU the scratch is real: the largest parameter.)
    scratch: dict[Any, Any] = {}
    for p in params.values():
        scratch[p.device] = max(scratch.get(p.device, 0), p.numel())
    scratch = {d: torch.empty(n, dtype=num.dtype, device=d) for d, n in scratch.items()}
    result = PassResult(set(), {}, not broadcast, 0)
    rows: dict[str, Any] = {}
    try:
        for pname, p in params.items():
            p.requires_grad_(False)  # an integer shadow cannot require gradients
            if pname not in own:
                p.data = scratch[p.device][: p.numel()].view(tuple(p.shape))
        _fresh_shadows(params, owned, num, arena)
        clock.lap("fill_s")
        if broadcast:
            rows = _broadcast_passes(params, owned, state, num, model, load, iota, result, clock)
        if result.materialised:
            rows = {}
            _fresh_shadows(params, owned, num, arena)
            clock.lap("fill_s")
            result.failed = load_indices(model, state, num, load, iota)
            result.index_bytes = num.values_needed(False) * num.dtype.itemsize
            _check_intact(iota, num, state, "indices")
            clock.lap("indices_load_s")
        shadows = {pname: params[pname].data for pname in owned}
    finally:
        for pname, p in params.items():
            p.data = saved[pname]
            p.requires_grad_(grads[pname])
    grid = num.arrays()
    for pname, shadow in shadows.items():
        flat = shadow.reshape(-1).cpu()
        runs = None
        if pname in rows:
            try:
                runs = combined_runs(flat, *rows.pop(pname), grid, run_cap(flat.numel()))
            except Disagreement as e:
                result.mismatched[pname] = (
                    "index values were changed by the loader (not a placement)"
                    if e.changed
                    else f"its two probe passes place element {e.element} differently (a loader that is not deterministic)"
                )
                continue
            finally:
                clock.lap("combine_s")
        read(pname, flat, num, runs)
        clock.lap("read_s")
    return result


def _fresh_shadows(params: dict, owned: list[str], num: Numbering, arena: ShadowArena) -> None:
    fresh = arena.shadows({pname: params[pname] for pname in owned}, num.dtype, UNPLACED)
    for pname in owned:
        params[pname].data = fresh[pname]


def _broadcast_passes(
    params: dict,
    owned: list[str],
    state: dict,
    num: Numbering,
    model: Any,
    load: Load,
    iota: Iota,
    result: PassResult,
    clock: _Clock,
) -> dict[str, Any]:
    """Pass "rows", its runs kept, then pass "cols" into the same shadows. Returns each
    parameter's row runs ((starts, values), or (empty, every row word) when they do not
    compress); sets ``result.materialised`` when the loader refused a broadcast probe."""
    import numpy as np

    result.index_bytes = num.values_needed(True) * num.dtype.itemsize
    try:
        load(model, row_probes(state, num, iota))
    except Exception:  # noqa: BLE001 -- it needs a materialised probe: learn the group so
        result.materialised = True
        return {}
    _check_intact(iota, num, state, "rows")
    clock.lap("rows_load_s")
    rows = {}
    for pname in owned:
        flat = params[pname].data.reshape(-1).cpu()
        n = flat.numel()
        runs = row_runs(flat, max(64, n * flat.element_size() // 64))  # 16 bytes a run
        if runs is None:  # no runs to speak of (a transposing loader): keep every row word
            runs = (np.empty(0, np.int64), flat.numpy().copy())
            result.dense_rows_params += 1
        rows[pname] = runs
        result.rows_bytes += runs[0].nbytes + runs[1].nbytes
    clock.lap("compress_s")
    try:
        load(model, col_probes(state, num, iota))
    except Exception:  # noqa: BLE001 -- as for the rows
        result.materialised = True
        return {}
    _check_intact(iota, num, state, "cols")
    clock.lap("cols_load_s")
    return rows


def _check_intact(iota: Iota, num: Numbering, state: dict, kind: str) -> None:
    if kind == "indices":
        starts = [b - FIRST_INDEX for b in num.bases]
        ends = [a + state[n].numel() for a, n in zip(starts, num.names, strict=True)]
    elif kind == "rows":
        starts = [b - FIRST_INDEX for b in num.row_bases]
        ends = [a + r for a, r in zip(starts, num.rows, strict=True)]
    else:
        starts = [b - FIRST_INDEX for b in num.col_bases]
        ends = [a + c for a, c in zip(starts, num.cols, strict=True)]
    if not iota.intact(starts, ends, num.dtype):
        raise RuntimeError(
            "the engine's loader wrote into the index tensors it was given: the engine map cannot be learned"
        )
