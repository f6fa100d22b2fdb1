"""How an applied delta chunk moves its tensors' ls128 sums (``linsum``), from its changes.

A receiver verifies a delta without reading its held words in full: each chunk, once
applied, reports per tensor the move that takes the tensor's sum before the chunk to its
sum after (``linsum.add_sums``), computed from the chunk's changed positions, the words now
there and the words that were there (undone from the chunk's own residuals: ``new ^ r`` for
XOR codings, ``new - r`` for the subtracting ones). Cost: the chunk's changes, not its words.

Invariant: for a chunk applied to ``segments``, adding each move to the tensor's sum before
gives ``linsum.full_sum`` of the tensor after.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from modal_rl.weightsync.codec import linsum
from modal_rl.weightsync.codec.codings.chunks import DecodedChunk
from modal_rl.weightsync.codec.differ import NumpyDiffer, TorchDiffer, sum_of
from modal_rl.weightsync.codec.dtypes import WORD_DTYPES, is_torch, words_of
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
        move = (
            linsum.moved_by_residuals(words, positions[a:b], start - lo, residuals[a:b], xor)
            if host
            else None
        )
        if move is not None:  # one compiled pass, no temporaries
            moves.append((k, move))
            continue
        local = positions[a:b] - (start - lo)
        new = words[local] if host else _gather(words, local)
        r = residuals[a:b].view(new.dtype)
        old = new ^ r if xor else new - r
        move = (NumpyDiffer() if host else TorchDiffer()).delta_sum(words, local, old)
        moves.append((k, move))
    return moves


def held_sums(state: Mapping[str, Any]) -> dict[str, str]:
    """Every held tensor's ls128, summed in full (host words, or device ones in slices)."""
    sums = {}
    for name, tensor in state.items():
        on_device = is_torch(tensor) and tensor.device.type != "cpu"
        sums[name] = sum_of(TorchDiffer().prepare(tensor) if on_device else words_of(tensor))
    return sums


def _gather(words: Any, local: np.ndarray) -> np.ndarray:
    """Device words at ``local``, on the host as unsigned words."""
    import torch

    picked = words[torch.from_numpy(local.astype(np.int64)).to(words.device)].cpu().numpy()
    return picked.view(WORD_DTYPES[picked.dtype.itemsize])
