"""SGLang's custom weight loader that writes a version into the model in place.

SGLang updates a running model with ``update_weights_from_tensor(named_tensors,
load_format=...)``; a ``load_format`` naming a function registered with
``--custom-weight-loader`` makes SGLang call ``fn(model, named_tensors)`` inside its
scheduler, with generation paused for the call. :func:`inplace_loader` is that function: the
first time it sees a set of checkpoint names it loads them through the model's own
``load_weights`` and learns (and validates) where they landed (``engine_map``); after that it
writes only the words that differ from the model's storage (``inplace.stage`` then
``switch``: all or nothing), and reloads through ``load_weights`` just the tensors of
parameters that are not pure placements. SGLang's models load through the same
``weight_loader`` attributes as vLLM's, so the map is learned the same way.

Invariants: as ``inplace`` (a failed switch leaves the model as it was); one map per model
object, grown by each new set of names (slime sends a version in buckets of tensors).

Tested here with a stand-in model that loads like SGLang's (``tests/engines/test_sglang_inplace.py``);
SGLang itself does not run on this machine, so its scheduler integration (the custom loader
registration, the pause around the call, the cache flush) is untested here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from weakref import WeakKeyDictionary

from modal_rl.weightsync.apply.engine_map import EngineMap, learn_map, validate
from modal_rl.weightsync.apply.inplace import stage, switch, undo

_MAPS: WeakKeyDictionary[Any, EngineMap] = WeakKeyDictionary()


def inplace_loader(model: Any, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, int]:
    """Make ``model``'s weights equal ``named_tensors`` (see the module docstring); returns
    ``{"changed_words", "learnt", "fallback_params"}``."""
    import torch

    state = dict(named_tensors)
    emap = _MAPS.get(model)
    new = set(state) - set(emap.dtypes) if emap is not None else set(state)
    learnt = 0
    with torch.no_grad():
        if new:
            part = {n: state[n] for n in new}
            model.load_weights(iter(part.items()))  # the old way, once per name
            learned = learn_map(model, part)
            validate(learned, part)
            emap = _merge(emap, learned)
            _MAPS[model] = emap
            learnt = len(new)
        known = {n: t for n, t in state.items() if n not in new}
        if not known:
            return {"changed_words": 0, "learnt": learnt, "fallback_params": len(emap.fallback)}
        staged = stage(_only(emap, known), known, version=-1, generation=0)
        written = switch(_only(emap, known), staged, generation=0)
        if staged.fallback:
            try:
                model.load_weights(iter(staged.fallback.items()))
            except BaseException:
                undo(emap, staged)
                raise
    return {"changed_words": written, "learnt": learnt, "fallback_params": len(emap.fallback)}


def _merge(old: EngineMap | None, new: EngineMap) -> EngineMap:
    if old is None:
        return new
    old.placements.update(new.placements)
    old.dtypes.update(new.dtypes)
    old.failed |= new.failed
    old.fallback.update(new.fallback)
    for name, reached in new._all_targets.items():
        old._all_targets.setdefault(name, set()).update(reached)
    old.params.update(new.params)
    for name, places in old.placements.items():
        old.placements[name] = [p for p in places if p.param not in old.fallback]
    return old


def _only(emap: EngineMap, state: dict[str, Any]) -> EngineMap:
    """A view of ``emap`` restricted to the checkpoint names in ``state`` (one bucket)."""
    return EngineMap(
        placements={n: ps for n, ps in emap.placements.items() if n in state},
        params=emap.params,
        fallback=emap.fallback,
        dtypes={n: d for n, d in emap.dtypes.items() if n in state},
        failed=emap.failed & set(state),
        _all_targets={n: r for n, r in emap._all_targets.items() if n in state},
    )
