"""Differs: where the bit-pattern diff and the gather of changed words run.

A ``Differ`` turns a (base, new) pair of tensor chunks into chunk-local positions of the
changed words and those words' old and new bit patterns. ``NumpyDiffer`` runs on the CPU; ``TorchDiffer`` runs
on the tensors' own device (CUDA when present), so only the sparse result crosses to the
host. Both hand the same arrays to the same packer, so their wire output is identical.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from modal_rl.weightsync.codec import linsum
from modal_rl.weightsync.codec.diffwords import diff_and_move, diff_words
from modal_rl.weightsync.codec.dtypes import WORD_DTYPES, dtype_name, is_torch, words_of
from modal_rl.weightsync.wire.dtype_codes import ITEMSIZE


class Differ(Protocol):
    def prepare(self, tensor: Any) -> Any:
        """A flat word handle of the tensor that ``diff``/``read``/``checksum`` accept."""

    def diff(self, base: Any, new: Any, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chunk-local int64 positions of changed words, their old words, their new words),
        all on the host."""

    def diff_moved(
        self, base: Any, new: Any, start: int, count: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
        """``diff`` and how the changes move the new tensor's ls128 (``delta_sum`` of them, at
        tensor positions ``start + positions``)."""

    def read(self, handle: Any, start: int, count: int) -> np.ndarray:
        """Host words of ``handle[start:start+count]``."""

    def checksum(self, handle: Any) -> str:
        """The tensor's ls128 sum (``linsum``), hex."""

    def delta_sum(self, handle: Any, positions: np.ndarray, old: np.ndarray) -> str:
        """What moves the tensor's ls128 from before a change to after it: ``handle`` holds
        the words after, ``positions`` (sorted, in the tensor) held ``old`` before."""

    def concat(self, handles: list[Any]) -> Any:
        """One handle holding the given handles' words back to back."""

    def write(self, handle: Any, start: int, positions: np.ndarray, words: np.ndarray) -> None:
        """``handle[start + positions] = words`` (the publisher's snapshot taking a delta)."""

    def copy(self, dst: Any, src: Any, start: int, count: int) -> None:
        """``dst[start:start+count] = src[start:start+count]``."""


def checksum_words(words: np.ndarray) -> str:
    """The ls128 sum of a host tensor's words (``linsum.full_sum``)."""
    return linsum.full_sum(words)


def sum_of(words: Any) -> str:
    """The ls128 sum of a tensor's words: host numpy words, or a device tensor's torch integer
    view (``TorchDiffer.prepare``), summed on the host in slices."""
    return checksum_words(words) if isinstance(words, np.ndarray) else TorchDiffer().checksum(words)


class NumpyDiffer:
    """CPU diff on shared-memory numpy views; numpy's XOR and nonzero release the GIL."""

    def prepare(self, tensor: Any) -> np.ndarray:
        return words_of(tensor)

    def diff(self, base: np.ndarray, new: np.ndarray, start: int, count: int):
        # Only the changed words are gathered: no full-size residual array is ever written.
        return diff_words(base[start : start + count], new[start : start + count])

    def diff_moved(self, base: np.ndarray, new: np.ndarray, start: int, count: int):
        per = max(1, 8 // new.itemsize)
        if start % per:  # not at a block boundary: the sum is moved after the diff
            positions, old, words = self.diff(base, new, start, count)
            return positions, old, words, linsum.delta_sum(new, positions + start, old)
        return diff_and_move(base[start : start + count], new[start : start + count], start // per)

    def read(self, handle: np.ndarray, start: int, count: int) -> np.ndarray:
        return handle[start : start + count]

    def checksum(self, handle: np.ndarray) -> str:
        return checksum_words(handle)

    def delta_sum(self, handle: np.ndarray, positions: np.ndarray, old: np.ndarray) -> str:
        return linsum.delta_sum(handle, positions, old)

    def concat(self, handles: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(handles)

    def write(self, handle: np.ndarray, start: int, positions: np.ndarray, words: np.ndarray) -> None:
        handle[start:][positions] = words

    def copy(self, dst: np.ndarray, src: np.ndarray, start: int, count: int) -> None:
        np.copyto(dst[start : start + count], src[start : start + count])


class TorchDiffer:
    """Diff and gather with torch on the tensors' device; the host sees only changed words.

    Signed integer views are used because torch's unsigned 16/32/64-bit types lack bitwise
    kernels on some devices; the bits are the same.
    """

    _SIGNED = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}

    def prepare(self, tensor: Any) -> Any:
        import torch

        if not is_torch(tensor):
            tensor = torch.from_numpy(np.ascontiguousarray(tensor))
        itemsize = ITEMSIZE[dtype_name(tensor)]
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return flat.view(getattr(torch, self._SIGNED[itemsize]))

    def diff(self, base: Any, new: Any, start: int, count: int):
        import torch

        b, n = base[start : start + count], new[start : start + count]
        positions = torch.nonzero(torch.ne(b, n)).reshape(-1)
        word = WORD_DTYPES[b.element_size()]
        host = [t.cpu().numpy() for t in (positions, b[positions], n[positions])]
        return host[0].astype(np.int64, copy=False), host[1].view(word), host[2].view(word)

    def diff_moved(self, base: Any, new: Any, start: int, count: int):
        positions, old, words = self.diff(base, new, start, count)
        return positions, old, words, self.delta_sum(new, positions + start, old)

    def read(self, handle: Any, start: int, count: int) -> np.ndarray:
        return handle[start : start + count].cpu().numpy().view(WORD_DTYPES[handle.element_size()])

    def concat(self, handles: list[Any]) -> Any:
        import torch

        return torch.cat(handles)

    def write(self, handle: Any, start: int, positions: np.ndarray, words: np.ndarray) -> None:
        import torch

        index = torch.from_numpy(positions.astype(np.int64, copy=False) + start).to(handle.device)
        signed = words.view(getattr(np, self._SIGNED[words.itemsize]))
        handle[index] = torch.from_numpy(signed).to(handle.device)

    def copy(self, dst: Any, src: Any, start: int, count: int) -> None:
        dst[start : start + count].copy_(src[start : start + count])

    def checksum(self, handle: Any, copy_elems: int = 1 << 24) -> str:
        # Summed on the host in slices so a device tensor never needs a full host copy at
        # once; ``copy_elems`` is a multiple of every block's word count.
        total, per = linsum.EMPTY, max(1, 8 // handle.element_size())
        for start in range(0, handle.numel(), copy_elems):
            part = linsum.full_sum(self.read(handle, start, copy_elems), start // per)
            total = linsum.add_sums(total, part)
        return total

    def delta_sum(self, handle: Any, positions: np.ndarray, old: np.ndarray) -> str:
        # Only the blocks that hold a change cross to the host.
        import torch

        if positions.size == 0:
            return linsum.EMPTY
        per, n = max(1, 8 // handle.element_size()), handle.numel()
        blocks = np.unique(positions // per)
        idx = (blocks[:, None] * per + np.arange(per)).reshape(-1)
        inside = idx < n
        gathered = handle[torch.from_numpy(np.minimum(idx, n - 1)).to(handle.device)].cpu().numpy()
        words = np.where(inside, gathered, 0).astype(gathered.dtype).view(WORD_DTYPES[handle.element_size()])
        compact = np.searchsorted(blocks, positions // per) * per + positions % per
        return linsum.delta_sum(words, compact, old, block_ids=blocks)


_NUMPY = NumpyDiffer()  # stateless: one for every host tensor


def default_differ(tensor: Any) -> Differ:
    """Torch on accelerators, numpy on the CPU (no per-call torch overhead there)."""
    if is_torch(tensor) and tensor.device.type != "cpu":
        return TorchDiffer()
    return _NUMPY
