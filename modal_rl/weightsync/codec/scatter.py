"""Writing a sparse chunk's changes into held host words: one compiled pass.

numpy's ``words[idx] += values`` gathers, adds and scatters through temporaries, about
30 ns per change on a small host; this loop is a few. Operations wrap in the word's
width (bit patterns, not numbers). Without numba the numpy form is used.

Invariant: ``positions`` are strictly increasing (both chunk codings produce them so), so
checking the first and the last against ``words`` bounds every write; nothing is written
when they fall outside.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from modal_rl.weightsync.codec.jit import Kernel

SET, XOR, ADD = 0, 1, 2
OPS = {"set": SET, "xor": XOR, "add": ADD}


def _scatter_loop(words, positions, shift, values, op):
    for k in range(positions.size):
        p = positions[k] - shift
        if op == ADD:
            words[p] += values[k]
        elif op == XOR:
            words[p] ^= values[k]
        else:
            words[p] = values[k]


SCATTER = Kernel(_scatter_loop)


def scatter(words: np.ndarray, positions: np.ndarray, shift: int, values: np.ndarray, op: str) -> None:
    """``words[positions - shift] op= values`` for increasing ``positions``."""
    if positions.size == 0:
        return
    if positions[0] < shift or positions[-1] - shift >= words.size or values.size != positions.size:
        raise IndexError(
            f"changes at {positions[0] - shift}..{positions[-1] - shift} outside {words.size} words"
        )
    kernel = SCATTER.get()
    if kernel is None or values.dtype != words.dtype:
        update(words, positions - shift, values, op)
        return
    kernel(words, positions, np.int64(shift), values, OPS[op])


def update(words: Any, where: Any, values: Any, op: str) -> None:
    """``words[where] op= values`` by indexing: numpy arrays, or torch tensors with torch
    indices and values."""
    if op == "set":
        words[where] = values
    elif op == "xor":
        words[where] ^= values
    else:
        words[where] += values
