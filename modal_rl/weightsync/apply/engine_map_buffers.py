"""The memory the engine map is learned in, allocated once and reused pass after pass.

Learning writes a shadow for every parameter of a group and an index tensor for every
checkpoint tensor of the group (``engine_map``). Fresh allocations of that size are mapped
page by page as they are first written, which costs more than the writing itself; so:

- :class:`ShadowArena`: one buffer per device, as large as the largest pass's shadows,
  carved into each pass's shadows and refilled with ``UNPLACED`` before the pass (only the
  bytes the pass uses);
- :class:`IndexBuffers`: index tensors are written into buffers kept between tensors; a
  buffer is handed out again only once nothing but this pool references its storage (the
  loader, or a view it kept, holds a reference otherwise), so a loader that holds tensors
  back (grouping by module, a layer-wise reload) gets distinct memory for each.

Invariant: a buffer is reused only when no tensor outside this module shares its storage;
without a storage use count (another torch), every index tensor gets fresh memory.
"""

from __future__ import annotations

from typing import Any


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


class IndexBuffers:
    """CPU buffers for index tensors, each handed out again once the loader let go of it."""

    def __init__(self) -> None:
        import torch

        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        self._bufs: list[tuple[Any, int]] = []  # (buffer, its use count when idle)

    def _count(self, buf: Any) -> int:
        return self._use_count(buf.untyped_storage()._cdata)

    def arange(self, start: int, n: int, dtype: Any) -> Any:
        """``torch.arange(start, start + n, dtype=dtype)``, in a reused buffer where one is free."""
        import torch

        if self._use_count is None:
            return torch.arange(start, start + n, dtype=dtype)
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        free = [(b, idle) for b, idle in self._bufs if self._count(b) == idle]
        fits = [b for b, _ in free if b.numel() >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
        else:
            # idle buffers too small for this tensor go: the new one serves what they served
            small = {id(b) for b, _ in free}
            self._bufs = [(b, idle) for b, idle in self._bufs if id(b) not in small]
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._bufs.append((buf, self._count(buf)))
        return torch.arange(start, start + n, dtype=dtype, out=buf[:nbytes].view(dtype))
