"""Differs: where the bit-pattern diff and the gather of changed words run.

A ``Differ`` turns a (base, new) pair of tensor chunks into chunk-local positions of the
changed words and those words' old and new bit patterns. ``NumpyDiffer`` runs on the CPU; ``TorchDiffer`` runs
on the tensors' own device (CUDA when present), so only the sparse result crosses to the
host. Both hand the same arrays to the same packer, so their wire output is identical.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import xxhash

from modal_rl.weightsync.codec.diffwords import diff_words
from modal_rl.weightsync.codec.dtypes import WORD_DTYPES, dtype_name, is_torch, words_of
from modal_rl.weightsync.wire.dtype_codes import ITEMSIZE


class Differ(Protocol):
    def prepare(self, tensor: Any) -> Any:
        """A flat word handle of the tensor that ``diff``/``read``/``checksum`` accept."""

    def diff(self, base: Any, new: Any, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chunk-local int64 positions of changed words, their old words, their new words),
        all on the host."""

    def read(self, handle: Any, start: int, count: int) -> np.ndarray:
        """Host words of ``handle[start:start+count]``."""

    def checksum(self, handle: Any) -> str:
        """xxh3-128 hex digest of the tensor's bytes."""

    def concat(self, handles: list[Any]) -> Any:
        """One handle holding the given handles' words back to back."""

    def write(self, handle: Any, start: int, positions: np.ndarray, words: np.ndarray) -> None:
        """``handle[start + positions] = words`` (the publisher's snapshot taking a delta)."""

    def copy(self, dst: Any, src: Any, start: int, count: int) -> None:
        """``dst[start:start+count] = src[start:start+count]``."""


def checksum_words(words: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(words.view(np.uint8)) if words.size else xxhash.xxh3_128_hexdigest(b"")


class NumpyDiffer:
    """CPU diff on shared-memory numpy views; numpy's XOR and nonzero release the GIL."""

    def prepare(self, tensor: Any) -> np.ndarray:
        return words_of(tensor)

    def diff(self, base: np.ndarray, new: np.ndarray, start: int, count: int):
        # Only the changed words are gathered: no full-size residual array is ever written.
        return diff_words(base[start : start + count], new[start : start + count])

    def read(self, handle: np.ndarray, start: int, count: int) -> np.ndarray:
        return handle[start : start + count]

    def checksum(self, handle: np.ndarray) -> str:
        return checksum_words(handle)

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
        # Hash on the host in slices so a device tensor never needs a full host copy at once.
        h = xxhash.xxh3_128()
        for start in range(0, handle.numel(), copy_elems):
            h.update(self.read(handle, start, copy_elems).view(np.uint8))
        return h.hexdigest()


def default_differ(tensor: Any) -> Differ:
    """Torch on accelerators, numpy on the CPU (no per-call torch overhead there)."""
    if is_torch(tensor) and tensor.device.type != "cpu":
        return TorchDiffer()
    return NumpyDiffer()
