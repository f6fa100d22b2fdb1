"""Bit-pattern views of tensors: the codec works on unsigned words, never on float values.

Invariant: ``words_of(t)`` shares memory with ``t`` (no copy) when ``t`` is a contiguous CPU
tensor or array, so writing into the words writes into the tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from modal_rl.weightsync.wire.dtype_codes import ITEMSIZE

WORD_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


_NAMES: dict[Any, str] = {}  # dtype object -> its name (a dtype's str() costs a call per tensor)


def dtype_name(tensor: Any) -> str:
    """'bfloat16', 'float32', ... for a torch tensor or a numpy array."""
    dtype = tensor.dtype
    name = _NAMES.get(dtype)
    if name is not None:
        return name
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise TypeError(f"unsupported dtype {name!r}; supported: {', '.join(sorted(ITEMSIZE))}")
    _NAMES[dtype] = name
    return name


def is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.startswith("torch")


def words_of(tensor: Any) -> np.ndarray:
    """The flat unsigned-word view of a CPU tensor/array (shares memory when contiguous)."""
    name = dtype_name(tensor)
    word = WORD_DTYPES[ITEMSIZE[name]]
    if is_torch(tensor):
        import torch

        if tensor.device.type != "cpu":
            raise ValueError("words_of needs a CPU tensor; use the torch codec path for device tensors")
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return flat.view(torch.uint8).numpy().view(word)
    array = np.ascontiguousarray(tensor).reshape(-1)
    return array.view(word)


def empty_like_spec(name: str, shape: tuple[int, ...]) -> Any:
    """A new zeroed CPU torch tensor of a given dtype name and shape."""
    import torch

    return torch.zeros(shape, dtype=getattr(torch, name))
