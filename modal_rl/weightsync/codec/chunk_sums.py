"""How an applied delta chunk moves its tensors' ls128 sums (``linsum``), from its changes.

A receiver verifies a delta without reading its held words in full: each chunk, once
applied, reports per tensor the move that takes the tensor's sum before the chunk to its
sum after (``linsum.add_sums``), computed from the chunk's changed positions, the words now there and the words that
were there (undone from the chunk's own residuals: ``new ^ r`` for XOR codings, ``new - r``
for the subtracting ones). Cost: the chunk's changes, not its words.

Invariant: for a chunk applied to ``segments``, adding each move to the tensor's sum before
gives ``linsum.full_sum`` of the tensor after.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from modal_rl.weightsync.codec import linsum
from modal_rl.weightsync.codec.codings.chunks import DecodedChunk
from modal_rl.weightsync.codec.differ import NumpyDiffer, TorchDiffer, checksum_words
from modal_rl.weightsync.codec.dtypes import WORD_DTYPES, is_torch, words_of
from modal_rl.weightsync.codec.jit import Kernel
from modal_rl.weightsync.codec.linsum import P1, P2, S1, S2
from modal_rl.weightsync.wire.chunk_header import UNCHANGED, XOR_DENSE, XOR_SPARSE


def chunk_moves(chunk: DecodedChunk, segments: list[tuple[int, Any]]) -> list[tuple[int, str]]:
    """(segment index, move of that tensor's sum) for every tensor the applied
    ``chunk`` changed; ``segments`` as ``DecodedChunk.apply`` takes them."""
    if chunk.encoding == UNCHANGED or chunk.values is None:
        return []
    lo, hi = chunk.elem_start, chunk.elem_start + chunk.elem_count
    xor = chunk.encoding in (XOR_SPARSE, XOR_DENSE)
    if chunk.positions is None:  # dense: every word of the chunk has a residual, most of them zero
        positions = np.flatnonzero(chunk.values).astype(np.int64)
        residuals = chunk.values[positions]
    else:
        positions, residuals = chunk.positions, chunk.values
    cuts = np.searchsorted(positions, [start - lo for start, _ in segments] + [hi - lo])
    moves = []
    for k, (start, words) in enumerate(segments):
        a, b = cuts[k], cuts[k + 1]
        if a == b:
            continue
        host = isinstance(words, np.ndarray)
        if host and linsum._compiled() is not None:  # one pass, no temporaries
            moves.append((k, _host_move(words, positions[a:b], start - lo, residuals[a:b], xor)))
            continue
        local = positions[a:b] - (start - lo)
        new = words[local] if host else _gather(words, local)
        r = residuals[a:b].view(new.dtype)
        old = new ^ r if xor else new - r
        move = (NumpyDiffer() if host else TorchDiffer()).delta_sum(words, local, old)
        moves.append((k, move))
    return moves


def _residual_move_kernel(words, blocks, logper, shift, positions, offset, residuals, xor):
    """``linsum``'s delta kernel for words just written by a chunk: the old word at
    ``positions[i] - offset`` is the new one with ``residuals[i]`` undone (XOR, or subtract)."""
    a = np.uint64(0)
    c = np.uint64(0)
    per = 1 << logper
    mask = (np.uint64(1) << np.uint64(shift)) - np.uint64(1) if shift < 64 else ~np.uint64(0)
    i = 0
    n = positions.size
    while i < n:
        b = (positions[i] - offset) >> logper
        new = blocks[b] if b < blocks.size else _blk(words, b, per, shift)
        prev = new
        while i < n and ((positions[i] - offset) >> logper) == b:
            p = positions[i] - offset
            s = np.uint64((p & (per - 1)) * shift)
            w = np.uint64(words[p])
            r = np.uint64(residuals[i])
            o = (w ^ r) if xor else ((w - r) & mask)
            prev = (prev & ~(mask << s)) | (o << s)
            i += 1
        bb = np.uint64(b)
        a += _m1(new ^ (bb * P1 + S1)) - _m1(prev ^ (bb * P1 + S1))
        c += _m2(new + ((bb * P2) ^ S2)) - _m2(prev + ((bb * P2) ^ S2))
    return a, c


_m1 = _m2 = _blk = None  # linsum's compiled helpers, bound on first use
_KERNEL = Kernel(_residual_move_kernel)


def _host_move(
    words: np.ndarray, positions: np.ndarray, offset: int, residuals: np.ndarray, xor: bool
) -> str:
    global _m1, _m2, _blk
    _m1, _m2, _blk = linsum._m1, linsum._m2, linsum._blk
    per = max(1, 8 // words.itemsize)
    blocks = words[: words.size - words.size % per].view(np.uint64)
    r = residuals.view(words.dtype)
    a, c = _KERNEL.get()(words, blocks, per.bit_length() - 1, 8 * words.itemsize, positions, offset, r, xor)
    return f"{int(a):016x}{int(c):016x}"


def held_sums(state: Mapping[str, Any]) -> dict[str, str]:
    """Every held tensor's ls128, summed in full (host words, or device ones in slices)."""
    sums = {}
    for name, tensor in state.items():
        on_device = is_torch(tensor) and tensor.device.type != "cpu"
        sums[name] = (
            TorchDiffer().checksum(TorchDiffer().prepare(tensor))
            if on_device
            else checksum_words(words_of(tensor))
        )
    return sums


def _gather(words: Any, local: np.ndarray) -> np.ndarray:
    """Device words at ``local``, on the host as unsigned words."""
    import torch

    picked = words[torch.from_numpy(local.astype(np.int64)).to(words.device)].cpu().numpy()
    return picked.view(WORD_DTYPES[picked.dtype.itemsize])
