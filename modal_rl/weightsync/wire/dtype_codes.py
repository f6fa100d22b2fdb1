"""The dtypes a frame can carry: names, word widths and wire codes (part of the format).

Plain tables, no numpy: the frame format (``frames``) and a store's file reader need them
without loading the codec.
"""

from __future__ import annotations

import sys

if sys.byteorder != "little":  # the wire format's byte planes are defined little-endian
    raise ImportError("modal_rl.weightsync supports little-endian hosts only")


# Every dtype a state dict may hold, with its word width in bytes. Floats are what RL
# frameworks sync; the integer types come along because buffers (e.g. step counters) exist.
ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


# Wire codes of the dtypes. Part of the frame format: append only, never renumber.
DTYPE_CODES = {
    "bfloat16": 1,
    "float16": 2,
    "float32": 3,
    "float64": 4,
    "float8_e4m3fn": 5,
    "float8_e5m2": 6,
    "int8": 7,
    "uint8": 8,
    "int16": 9,
    "int32": 10,
    "int64": 11,
    "bool": 12,
}
DTYPE_BY_CODE = {code: name for name, code in DTYPE_CODES.items()}
