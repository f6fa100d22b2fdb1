"""Where every checkpoint element lives in a running engine, learned from the engine's own loader.

An engine does not store the checkpoint's tensors as they are: it fuses q/k/v and gate/up
projections, keeps only its tensor-parallel shard, ties embeddings, may transpose. Rather
than re-implement each model's layout, :func:`learn_map` asks the model's own
``load_weights``: every parameter's storage is swapped for an integer shadow filled with -1,
and every checkpoint tensor is replaced by a probe that says which of its elements each
element is (``engine_map_probes``: by default two broadcast passes, row ids then column
numbers, each a stride-0 view of a few words; ``probes="indices"``: one pass of index
values ``bases[i] + k``, as many words as the checkpoint's elements). Whatever the loader
does -- slicing, fusing, sharding, transposing, copying one tensor into two parameters --
the shadow then records, for each engine element, which checkpoint element landed there,
as the same index value either way. The real storage is put back.

Invariants:
- a placement maps checkpoint positions to positions in one parameter's contiguous storage,
  with the same word size on both sides; an element the loader wrote a constant into (a pad)
  or never wrote is in no placement;
- a parameter whose loading is not a pure placement -- a loader that failed on the index
  tensor, another dtype than the checkpoint's, storage that is not contiguous, its two probe
  passes placing different elements, or words that do not match the checkpoint after a
  full load (:func:`validate`: quantised or processed after loading) -- is in ``fallback``
  with the reason, and has no placements;
- both kinds of probe learn the same map (tested): the broadcast passes are combined into
  the word the index pass leaves, and the same reader reads it;
- learning changes no weight: shadows are swapped in and out inside one call, and the
  caller holds the engine paused meanwhile.

Learning is done group by group (``layer_group``: one transformer layer's tensors, then the
rest): only the parameters of the group being loaded get a shadow (int32 where the group's
index values fit in 31 bits, else int64); every other parameter is swapped for a view of one
uninitialised scratch buffer (on the CPU its pages are not resident until written), so what
the loader writes outside the group costs nothing and changes nothing. Fresh pages cost more
than the writes into them, so the memory is allocated once (``engine_map_buffers``):
shadows are carved from one buffer sized for the largest group, and the probe values are
written once; each group's probes are views of them. Extra memory is therefore the largest
group's shadow, plus its row runs between the two passes (a row of ``C`` columns is one
16-byte run: for ``C`` >= 64 under a quarter of an int32 shadow; a parameter whose rows do
not compress keeps its row words, ``learning["dense_rows_params"]``), plus the probe values
(rows + columns words; with ``probes="indices"``, or for a group whose loader refused a
broadcast probe, ``learning["materialised_groups"]``, the group's element count). Tensors
that landed nowhere (a layer whose parameters are named unlike its checkpoint tensors) get
one more pass, into the parameters nothing fed yet (for such a model, its extra memory is
theirs). ``timings`` says where learning's time went (fill, each pass's load, compress,
combine, read).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from modal_rl.weightsync.apply.engine_map_buffers import Iota, ShadowArena
from modal_rl.weightsync.apply.engine_map_probes import Numbering, learn_pass
from modal_rl.weightsync.apply.engine_map_runs import FIRST_INDEX, run_breaks, run_cap

_LAYER = re.compile(r"^((?:.*?\.)?(?:layers|h|blocks|layer)\.\d+\.)")
WORD = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

Load = Callable[[Any, Iterator[tuple[str, Any]]], Any]


@dataclass
class Placement:
    """Checkpoint positions ``src`` land at ``dst`` of parameter ``param`` (flat). A run
    (``src`` = ``start..start+len``, ``dst`` = ``offset..offset+len``) keeps no arrays."""

    param: str
    src: Any = None  # torch int64, increasing; None for a run
    dst: Any = None  # torch int64, same length; None for a run
    start: int = 0
    offset: int = 0
    length: int = 0

    @property
    def is_run(self) -> bool:
        return self.src is None


@dataclass
class EngineMap:
    """Checkpoint name -> placements, the parameters they write into, and the parameters
    that must be reloaded instead (name -> why)."""

    placements: dict[str, list[Placement]] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)  # name -> torch Parameter (live storage)
    fallback: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # checkpoint name -> dtype it was learnt for
    failed: set[str] = field(default_factory=set)  # checkpoint tensors the loader refused as indices
    learning: dict[str, int] = field(default_factory=dict)  # passes, largest group's shadow bytes
    timings: dict[str, float] = field(default_factory=dict)  # seconds learning spent, by step

    def fallback_tensors(self, owner: Callable[[str], str] | None = None) -> set[str]:
        """Checkpoint tensors that must be reloaded because they feed a fallback parameter
        (or, with ``owner`` mapping a parameter to its module, any parameter of its module:
        a loader processes a module once all of its weights are in)."""
        key = owner or (lambda n: n)
        modules = {key(p) for p in self.fallback}
        hit = {name for name, reached in self._all_targets.items() if any(key(p) in modules for p in reached)}
        return hit | self.failed

    _all_targets: dict[str, set[str]] = field(
        default_factory=dict
    )  # checkpoint name -> every param it reached

    def bind(self, model: Any) -> None:
        """Point at ``model``'s current parameter objects (a full load through vLLM's
        layer-wise reload makes new ones with the same layout)."""
        live = dict(model.named_parameters(remove_duplicate=True))
        missing = sorted(set(self.params) - set(live))
        if missing:
            raise KeyError(f"the engine no longer has parameters {missing[:3]}: learn the map again")
        self.params = {name: live[name] for name in self.params}

    def stats(self) -> dict[str, int]:
        places = [p for ps in self.placements.values() for p in ps]
        return {
            "tensors": len(self.placements),
            "params": len(self.params),
            "placements": len(places),
            "runs": sum(p.is_run for p in places),
            "fallback_params": len(self.fallback),
        }


def words(tensor: Any) -> Any:
    """A flat integer view of a contiguous torch tensor's storage (its bit patterns)."""
    import torch

    return tensor.detach().reshape(-1).view(getattr(torch, WORD[tensor.element_size()]))


def layer_group(name: str) -> str:
    """The learning group of a checkpoint or engine name: its layer's prefix
    (``model.layers.12.``), or ``""`` for what belongs to no layer (embeddings, norms, head)."""
    m = _LAYER.match(name)
    return m.group(1) if m else ""


def learn_map(
    model: Any,
    state: dict[str, Any],
    load: Load | None = None,
    *,
    grouped: bool = True,
    probes: str = "broadcast",
) -> EngineMap:
    """Learn where each tensor of ``state`` (checkpoint names, shapes and dtypes) lands in
    ``model``'s parameters, by loading probes through ``load(model, weights)`` (default:
    ``model.load_weights(weights)``, vLLM's and SGLang's loader entry point). ``grouped``: one
    layer at a time (the module docstring); False: every tensor in one pass. ``probes``:
    ``"broadcast"`` (row and column passes) or ``"indices"`` (one pass, materialised)."""
    import torch

    if probes not in ("broadcast", "indices"):
        raise ValueError(f"probes={probes!r}: use 'broadcast' or 'indices'")
    load = load or (lambda m, w: m.load_weights(w))
    params: dict[str, Any] = dict(model.named_parameters(remove_duplicate=True))
    names = list(state)
    emap = EngineMap(params=params, dtypes={n: str(state[n].dtype) for n in names})
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(layer_group(n) if grouped else "", []).append(n)
    by_group: dict[str, list[str]] = {}
    for pname in params:
        by_group.setdefault(layer_group(pname) if grouped else "", []).append(pname)
    passes = [(members, by_group[g]) for g, members in groups.items() if by_group.get(g)]
    buffers = ShadowArena(), Iota()
    for device, nbytes in _largest_shadows(passes, params, state).items():
        buffers[0].reserve(device, nbytes)  # once: no pass grows it
    results = []

    def run(members: list[str], owned: list[str]) -> None:
        def read(pname: str, flat: Any, num: Numbering, runs: Any) -> None:
            _read_shadow(emap, pname, flat, num, state, runs)

        results.append(
            learn_pass(
                params, owned, members, state, model, load, buffers, probes == "broadcast", read, emap.timings
            )
        )
        emap.fallback.update(results[-1].mismatched)

    for members, owned in passes:
        run(members, owned)
    failed = set().union(*(r.failed for r in results))
    # tensors that landed nowhere (their layer's parameters are named otherwise): one pass
    # over them into the parameters nothing fed yet
    orphans = [n for n in names if n not in emap.placements and n not in failed]
    fed = set().union(*emap._all_targets.values()) | set(emap.fallback)
    unfed = [p for p in params if p not in fed]
    if grouped and orphans and unfed:
        passes.append((orphans, unfed))
        run(orphans, unfed)
        failed |= results[-1].failed
    emap.failed = failed
    feeds: dict[str, list[str]] = {}
    for n, ps in emap.placements.items():
        for pname in dict.fromkeys(x.param for x in ps):
            feeds.setdefault(pname, []).append(n)
    for pname, p in params.items():
        if pname in emap.fallback:
            continue
        fed = feeds.get(pname, [])
        if failed and not fed:
            emap.fallback[pname] = f"its loader refused the index tensor ({', '.join(sorted(failed))[:120]})"
        elif fed and not p.is_contiguous():
            emap.fallback[pname] = "storage is not contiguous"
        elif any(state[n].element_size() != p.element_size() or state[n].dtype != p.dtype for n in fed):
            emap.fallback[pname] = (
                f"engine dtype {p.dtype} differs from the checkpoint's (a cast, not a placement)"
            )
    _drop_fallback(emap)
    nums = [Numbering.for_tensors(m, state) for m, _ in passes]
    emap.learning = {  # the largest group's shadow; the probe values and row runs kept (the most of a pass's)
        "passes": len(passes),
        "largest_group_bytes": max(
            (
                sum(params[p].numel() * t.dtype.itemsize for p in o)
                for t, (_, o) in zip(nums, passes, strict=True)
            ),
            default=0,
        ),
        "index_bytes": max((r.index_bytes for r in results), default=0),
        "int32_passes": sum(t.dtype == torch.int32 for t in nums),
        "materialised_groups": sum(r.materialised for r in results),
        "dense_rows_params": sum(r.dense_rows_params for r in results),
        "rows_bytes": max((r.rows_bytes for r in results), default=0),
    }
    return emap


def _largest_shadows(passes: list[tuple[list[str], list[str]]], params: dict, state: dict) -> dict:
    """Per device, the most shadow bytes one of ``passes`` needs."""
    most: dict[Any, int] = {}
    for members, owned in passes:
        itemsize = Numbering.for_tensors(members, state).dtype.itemsize
        need: dict[Any, int] = {}
        for pname in owned:
            p = params[pname]
            need[p.device] = need.get(p.device, 0) + p.numel() * itemsize
        for device, nbytes in need.items():
            most[device] = max(most.get(device, 0), nbytes)
    return most


def _read_shadow(
    emap: EngineMap, pname: str, shadow: Any, tags: Numbering, state: dict[str, Any], runs: Any = None
) -> None:
    """Record the placements ``shadow`` holds. Engines place checkpoint tensors as a few
    contiguous runs per parameter (fused q/k/v, a TP shard), so runs are found in a few
    linear passes (or given: ``runs``, as ``engine_map_combine.combined_runs`` finds them); a
    parameter with many runs (a transpose) takes the general, sorting path."""
    import torch

    flat = shadow.reshape(-1).cpu()
    n = int(flat.numel())
    if n == 0:
        return
    if runs is None:
        breaks = run_breaks(flat, run_cap(n))
        if breaks is not None:
            bounds = [0, *(b + 1 for b in breaks), n]
            runs = bounds, flat[bounds[:-1]].tolist()
    if runs is not None:
        bounds, firsts = runs
        for a, b, first in zip(bounds, bounds[1:], firsts, strict=False):
            hit = tags.find(first)
            if hit is None:
                continue  # unplaced, or a constant the loader wrote (a pad)
            name, pos = hit
            if pos + (b - a) > state[name].numel():
                emap.fallback[pname] = (
                    f"index values from {name!r} were changed by the loader (not a placement)"
                )
                return
            emap._all_targets.setdefault(name, set()).add(pname)
            emap.placements.setdefault(name, []).append(Placement(pname, start=pos, offset=a, length=b - a))
        return
    placed = (flat >= FIRST_INDEX) & (flat < tags.end)
    dst_all = torch.nonzero(placed).reshape(-1)
    if dst_all.numel() == 0:
        return
    values = flat[dst_all].to(torch.int64)
    bases = torch.tensor(tags.bases, dtype=torch.int64)
    tids = torch.bucketize(values, bases, right=True) - 1
    pos = values - bases[tids]
    for tid in torch.unique(tids).tolist():
        name = tags.names[tid]
        sel = tids == tid
        src, dst = pos[sel], dst_all[sel]
        if int(src.max()) >= state[name].numel():
            emap.fallback[pname] = f"index values from {name!r} were changed by the loader (not a placement)"
            return
        order = torch.argsort(src, stable=True)
        src, dst = src[order], dst[order]
        emap._all_targets.setdefault(name, set()).add(pname)
        emap.placements.setdefault(name, []).append(_compact(pname, src, dst))


def _compact(pname: str, src: Any, dst: Any) -> Placement:
    n = int(src.numel())
    s0, d0 = int(src[0]), int(dst[0])
    if int(src[-1]) - s0 == n - 1 and int(dst[-1]) - d0 == n - 1 and bool((dst - src == d0 - s0).all()):
        return Placement(pname, start=s0, offset=d0, length=n)
    return Placement(pname, src=src, dst=dst, length=n)


def _drop_fallback(emap: EngineMap) -> None:
    for name, places in emap.placements.items():
        emap.placements[name] = [p for p in places if p.param not in emap.fallback]


def validate(emap: EngineMap, state: dict[str, Any]) -> list[str]:
    """After a full load of ``state`` into the engine, check every placement reads back the
    checkpoint's words; parameters that do not (processed after loading) move to
    ``fallback``. Returns the parameters moved."""
    moved = []
    for name, places in emap.placements.items():
        sw = words(state[name])
        for p in places:
            if p.param in emap.fallback:
                continue
            pw = words(emap.params[p.param].data)
            if p.is_run:
                eng, ref = pw[p.offset : p.offset + p.length], sw[p.start : p.start + p.length]
            else:
                eng, ref = pw[p.dst.to(pw.device)], sw[p.src]
            if eng.numel() != ref.numel() or not bool((eng.cpu() == ref.cpu()).all()):
                emap.fallback[p.param] = (
                    f"after a full load its words differ from {name!r} (processed after loading)"
                )
                moved.append(p.param)
    _drop_fallback(emap)
    return moved
