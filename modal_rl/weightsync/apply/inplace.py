"""A version goes live in place: stage the changed words while serving, switch by scattering.

:func:`stage` compares a verified staged state (checkpoint layout) with what the engine's
parameters hold, through an :class:`~modal_rl.weightsync.apply.engine_map.EngineMap`, and keeps,
per placement, the engine positions whose words differ, their new words and their old
words. That work reads the engine's storage and writes nothing, so it runs while the engine
serves. :func:`switch` is the pause: it writes the new words, one indexed write per
parameter.

Invariants:
- after a successful switch every mapped engine word equals the staged state's word (the
  diff is taken against the engine's own storage, so a version the engine missed or a
  switch that failed earlier is made good by the next one);
- a switch either writes every change or none: if a write fails part way, the old words are
  written back to every placement it touched, in reverse order, and the error is raised;
- staged changes are for the storage as it was when staged: ``Staged.generation`` must
  equal the engine's current generation (every switch and full load bumps it), otherwise
  ``switch`` refuses without writing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from modal_rl.weightsync.apply.engine_map import EngineMap, words
from modal_rl.weightsync.codec.scatter import scatter


class StaleStageError(RuntimeError):
    """The engine's weights changed after these changes were staged; stage again."""


@dataclass
class Change:
    param: str
    dst: Any  # increasing int64 positions in the parameter's flat storage (numpy for host storage)
    new: Any  # words to write
    old: Any  # words there now (for the rollback)


@dataclass
class Staged:
    version: int
    generation: int
    changes: list[Change] = field(default_factory=list)
    fallback: dict[str, Any] = field(default_factory=dict)  # checkpoint tensors to reload instead
    changed_words: int = 0
    diff_s: float = 0.0


def _host_words(tensor: Any, device: Any) -> Any:
    import torch

    if not isinstance(tensor, torch.Tensor):
        tensor = torch.from_numpy(tensor)
    return words(tensor.contiguous()).to(device, non_blocking=True)


def stage(emap: EngineMap, state: dict[str, Any], version: int, generation: int) -> Staged:
    """The changes that make the engine's mapped words equal ``state`` (see the module
    invariants); reads the engine's storage, writes nothing."""
    import torch

    t0 = time.perf_counter()
    staged = Staged(version=version, generation=generation)
    per_param: dict[str, list[tuple[Any, Any, Any]]] = {}
    for name in emap.fallback_tensors():
        staged.fallback[name] = state[name]
    for name, places in emap.placements.items():
        if name not in state:
            raise KeyError(f"the staged version has no tensor {name!r}, which the engine map places")
        if str(state[name].dtype) != emap.dtypes[name]:
            raise TypeError(
                f"{name!r} is {state[name].dtype}, the engine map was learnt for {emap.dtypes[name]}"
            )
        for p in places:
            pw = words(emap.params[p.param].data)
            sw = _host_words(state[name], pw.device)
            if p.is_run:
                eng, new = pw[p.offset : p.offset + p.length], sw[p.start : p.start + p.length]
                k = torch.nonzero(eng != new).reshape(-1)
                dst = k + p.offset
            else:
                dst_all = p.dst.to(pw.device)
                eng, new = pw[dst_all], sw[p.src.to(pw.device)]
                k = torch.nonzero(eng != new).reshape(-1)
                dst = dst_all[k]
            if k.numel():
                per_param.setdefault(p.param, []).append((dst, new[k], eng[k]))
                staged.changed_words += int(k.numel())
    # One indexed write per parameter in the pause, however many checkpoint tensors feed it
    # (an MoE layer's experts, q/k/v): the per-write overhead, not the words, dominates there.
    for param, parts in per_param.items():
        dst, new, old = (torch.cat([part[i] for part in parts]) for i in range(3))
        order = torch.argsort(dst)
        dst, new, old = dst[order], new[order], old[order]
        if dst.device.type == "cpu":  # host storage: the compiled scatter loop (``scatter``)
            dst, new, old = dst.numpy(), new.numpy(), old.numpy()
        staged.changes.append(Change(param, dst, new, old))
    staged.diff_s = time.perf_counter() - t0
    return staged


def switch(emap: EngineMap, staged: Staged, generation: int, *, fail_after: int | None = None) -> int:
    """Write ``staged``'s new words into the engine (the pause); returns the words written.
    ``fail_after``: raise after writing that many parameters (tests of the rollback)."""
    import torch

    if staged.generation != generation:
        raise StaleStageError(
            f"version {staged.version} was staged against engine weights that changed since; stage it again"
        )
    done: list[Change] = []
    try:
        with torch.no_grad():
            for change in staged.changes:
                if fail_after is not None and len(done) >= fail_after:
                    raise RuntimeError(f"injected failure after {fail_after} placements")
                done.append(change)
                _write(emap.params[change.param], change.dst, change.new)
    except BaseException:
        with torch.no_grad():
            for change in reversed(done):
                _write(emap.params[change.param], change.dst, change.old)
        raise
    return staged.changed_words


def _write(param: Any, dst: Any, values: Any) -> None:
    import numpy as np

    if isinstance(dst, np.ndarray):  # increasing positions in host storage
        scatter(words(param.data).numpy(), dst, 0, values, "set")
    else:
        words(param.data)[dst] = values


def warm_up() -> None:
    """Compile the host scatter loop for the word sizes engines use, outside any pause."""
    import numpy as np

    for dtype in (np.int16, np.int32, np.uint8, np.int64):
        scatter(np.zeros(2, dtype), np.array([1], np.int64), 0, np.ones(1, dtype), "set")


def undo(emap: EngineMap, staged: Staged) -> None:
    """Put back the words a successful ``switch`` of ``staged`` replaced."""
    import torch

    with torch.no_grad():
        for change in reversed(staged.changes):
            _write(emap.params[change.param], change.dst, change.old)


def digests(model: Any) -> dict[str, str]:
    """sha256 of every parameter's bytes (deduplicated names), for bit-identity checks."""
    import hashlib

    import numpy as np

    out = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        w = words(p.data.contiguous()).cpu().numpy()
        out[name] = (
            hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest() + f":{p.dtype}:{tuple(p.shape)}"
        )
    return out
