"""The memory the engine map is learned in, allocated once and reused pass after pass.

Learning writes a shadow for every parameter of a group and a probe for every checkpoint
tensor of the group (``engine_map_probes``). Fresh allocations of that size are mapped page
by page as they are first written, which costs more than the writing itself; so:

- :class:`ShadowArena`: one buffer per device, as large as the largest pass's shadows,
  carved into each pass's shadows and refilled with ``UNPLACED`` before the pass (only the
  bytes the pass uses);
- :class:`Iota`: the probe values, written once and kept; every probe of every pass is a
  view of them (materialised index values, or the row ids and column numbers that broadcast
  probes expand), so a loader that holds tensors back (grouping by module, a layer-wise
  reload) still sees each one's own.

Invariant: probe values are written once per learning and only read afterwards. A loader
that writes into the tensors it is given would corrupt later passes: after each pass the
first and last value of each of its probes' values are checked (``Iota.intact``: a scaled,
shifted or refilled tensor is caught; a write to its middle alone is not) and learning stops
(an in-place write into a broadcast probe raises in torch: that group is learned again with
materialised probes, and checked as before).
"""

from __future__ import annotations

from typing import Any

from modal_rl.weightsync.apply.engine_map_runs import FIRST_INDEX


class ShadowArena:
    """One uninitialised byte buffer per device, grown to the largest request only."""

    def __init__(self) -> None:
        self._bufs: dict[Any, Any] = {}

    def reserve(self, device: Any, nbytes: int) -> None:
        import torch

        held = self._bufs.get(device)
        if held is None or held.numel() < nbytes:
            self._bufs.pop(device, None)  # let the smaller one go before taking the larger
            self._bufs[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def shadows(self, params: dict[str, Any], dtype: Any, fill: int) -> dict[str, Any]:
        """A ``fill``-ed shadow of ``dtype`` and each parameter's shape, per parameter,
        side by side in the device's buffer (valid until the next call)."""
        import torch

        itemsize = torch.empty(0, dtype=dtype).element_size()
        need: dict[Any, int] = {}
        for p in params.values():
            need[p.device] = need.get(p.device, 0) + p.numel() * itemsize
        for device, nbytes in need.items():
            self.reserve(device, nbytes)
        used = {device: 0 for device in need}
        out = {}
        for name, p in params.items():
            start = used[p.device]
            used[p.device] = start + p.numel() * itemsize
            out[name] = self._bufs[p.device][start : used[p.device]].view(dtype).view(tuple(p.shape))
        for device, nbytes in used.items():
            self._bufs[device][:nbytes].view(dtype).fill_(fill)
        return out


class Iota:
    """``FIRST_INDEX + j`` at ``j``, written once per dtype and kept: every pass's index
    tensors are views of it (``engine_map._Tags``), so no pass writes index values again.
    Loaders only read what they load; ``intact`` checks they did."""

    def __init__(self) -> None:
        self._values: dict[Any, Any] = {}

    def values(self, n: int, dtype: Any) -> Any:
        import torch

        held = self._values.get(dtype)
        if held is None or held.numel() < n:
            self._values.pop(dtype, None)  # let the smaller one go before taking the larger
            held = self._values[dtype] = torch.arange(FIRST_INDEX, FIRST_INDEX + n, dtype=dtype)
        return held

    def intact(self, starts: list[int], ends: list[int], dtype: Any) -> bool:
        """Whether each tensor's first and last index value is still what was written."""
        held = self._values[dtype]
        return all(
            int(held[a]) == FIRST_INDEX + a and int(held[b - 1]) == FIRST_INDEX + b - 1
            for a, b in zip(starts, ends, strict=True)
            if b > a
        )
