"""MoE experts in place, and expert-parallel receivers that take only their experts' changes.

An MoE engine fuses every expert of a layer into one parameter per projection (vLLM's
``w13_weight`` ``[experts, 2 x intermediate, hidden]`` holds gate and up, ``w2_weight`` the
down projection), while checkpoints -- and the trainers that publish them -- name one tensor
per expert and projection (``...mlp.experts.<e>.gate_proj.weight``). The engine map
(``engine_map.learn_map``) needs nothing MoE-specific for that: the model's own loader places
each expert's index tensor at its slice of the fused parameter, so every expert tensor is one
run (``Placement.is_run``) and an expert whose words did not change stages no change and costs
no write in the pause (``inplace.stage`` diffs per placement).

This module adds what a receiver that holds only *some* experts (expert parallelism) needs:

- :func:`wanted` -- the checkpoint tensors a map places (its engine rank's experts, plus every
  shared tensor); what an EP rank subscribes to from sharded publishers. Under EP vLLM's
  loader skips experts of other ranks, so they are in no placement of this rank's map;
- :func:`checkpoint_changes` -- a version's change as ``(name, positions, words)``: flat
  positions in the checkpoint tensor and the new words there. This is what a sharded
  publisher emits for the part of a tensor it holds, whatever the trainer's sharding;
- :func:`stage_changes` -- stage such changes (from one or several publishers) through a
  map: changes to tensors the map does not place are skipped without being read, so an EP
  rank pays for its own experts only; the result is an ``inplace.Staged`` that
  ``inplace.switch`` writes in the pause, all or nothing, with the usual generation check.

Invariants: :func:`stage_changes` reads the engine's storage only at the changed positions
and writes nothing; after ``switch`` every mapped engine word at a changed position equals the
new word (the caller's change list must be complete relative to the version the engine holds:
the generation check guards the engine side, the chain's base check the publisher side);
positions that no placement of this map holds (another tensor-parallel shard's part) are
skipped like other ranks' experts; words of another size than the map's dtype raise
``TypeError`` (staging writes nothing, so the engine is as it was).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from modal_rl.weightsync.apply.engine_map import EngineMap, words
from modal_rl.weightsync.apply.inplace import Change, Staged

# ``<layer>.experts.<id>.<projection>.<weight|bias>``: Qwen2/3-MoE, Mixtral (w1/w2/w3),
# DeepSeek and GLM MoE checkpoints all name their routed experts this way.
EXPERT_NAME = re.compile(r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.(?:weight|bias)$")


def expert_of(name: str) -> tuple[str, int] | None:
    """``(layer prefix, expert id)`` of a routed expert's checkpoint tensor, else None."""
    m = EXPERT_NAME.match(name)
    return (m["layer"], int(m["expert"])) if m else None


def wanted(emap: EngineMap) -> set[str]:
    """The checkpoint tensors this engine rank needs: those its map places, and those that
    feed a parameter it reloads instead (``fallback``)."""
    return set(emap.placements) | emap.fallback_tensors()


def held_experts(emap: EngineMap) -> dict[str, list[int]]:
    """Layer prefix -> the expert ids this map places (an EP rank's share of each layer)."""
    out: dict[str, set[int]] = {}
    for name, places in emap.placements.items():
        where = expert_of(name)
        if where and places:
            out.setdefault(where[0], set()).add(where[1])
    return {layer: sorted(ids) for layer, ids in sorted(out.items())}


def checkpoint_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], rows: tuple[int, int] | None = None
) -> list[tuple[str, Any, Any]]:
    """``(name, positions, words)`` for every tensor of ``new`` whose words differ from
    ``old``: increasing flat int64 positions and the new words there. ``rows=(r, n)``: only
    the part a trainer rank ``r`` of ``n`` holds under dim-0 sharding (FSDP2's layout), as
    that rank's sharded publisher would send it."""
    import torch

    out = []
    for name, t in new.items():
        if tuple(t.shape) != tuple(old[name].shape) or t.dtype != old[name].dtype:
            raise ValueError(f"{name!r} changed layout between versions: publish an anchor instead")
        nw, ow = words(t.contiguous()), words(old[name].contiguous())
        lo, hi = 0, nw.numel()
        if rows is not None and t.dim() > 0:
            rank, ranks = rows
            per = -(-t.shape[0] // ranks)  # ceil: the last rank's shard may be short
            width = nw.numel() // max(t.shape[0], 1)
            lo, hi = min(rank * per, t.shape[0]) * width, min((rank + 1) * per, t.shape[0]) * width
        elif rows is not None and rows[0] != 0:  # a 0-d tensor lives on rank 0
            continue
        pos = torch.nonzero(nw[lo:hi] != ow[lo:hi]).reshape(-1) + lo
        if pos.numel():
            out.append((name, pos, nw[pos].clone()))
    return out


def _engine_positions(emap: EngineMap, name: str, pos: Any) -> list[tuple[str, Any, Any]]:
    """(param, engine positions, which of ``pos`` they are) for every placement of ``name``."""
    import torch

    out = []
    for p in emap.placements.get(name, []):
        if p.is_run:
            sel = torch.nonzero((pos >= p.start) & (pos < p.start + p.length)).reshape(-1)
            out.append((p.param, pos[sel] - p.start + p.offset, sel))
        else:
            at = torch.searchsorted(p.src, pos).clamp(max=p.src.numel() - 1)
            sel = torch.nonzero(p.src[at] == pos).reshape(-1)
            out.append((p.param, p.dst[at[sel]], sel))
    return out


def stage_changes(
    emap: EngineMap, changes: Iterable[tuple[str, Any, Any]], version: int, generation: int
) -> Staged:
    """Stage changes in checkpoint coordinates (:func:`checkpoint_changes`, from any number of
    publishers) for ``inplace.switch``; see the module invariants. ``Staged.fallback`` lists
    the changed tensors that feed a reloaded parameter: the caller passes the *full* tensors
    of those to the loader (a change list cannot be loaded)."""
    import torch

    t0 = time.perf_counter()
    staged = Staged(version=version, generation=generation)
    per_param: dict[str, list[tuple[Any, Any, Any]]] = {}
    reload = emap.fallback_tensors()
    for name, pos, new in changes:
        if name in reload:
            staged.fallback[name] = None  # the caller supplies the tensor
        if name not in emap.placements:
            continue  # another rank's expert (or a tensor no parameter takes): never read
        if new.element_size() != _itemsize(emap.dtypes[name]):
            raise TypeError(f"{name!r}: {new.dtype} words do not fit the map's {emap.dtypes[name]}")
        for param, dst, sel in _engine_positions(emap, name, pos):
            if not sel.numel():
                continue
            pw = words(emap.params[param].data)
            dst = dst.to(pw.device)
            vals = new[sel].to(pw.device).view(pw.dtype)
            old = pw[dst]
            k = torch.nonzero(old != vals).reshape(-1)
            if k.numel():
                per_param.setdefault(param, []).append((dst[k], vals[k], old[k]))
                staged.changed_words += int(k.numel())
    for param, parts in per_param.items():
        dst, new, old = (torch.cat([part[i] for part in parts]) for i in range(3))
        order = torch.argsort(dst)
        dst, new, old = dst[order], new[order], old[order]
        if dst.device.type == "cpu":  # host storage: the compiled scatter loop, as ``stage``
            dst, new, old = dst.numpy(), new.numpy(), old.numpy()
        staged.changes.append(Change(param, dst, new, old))
    staged.diff_s = time.perf_counter() - t0
    return staged


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()
