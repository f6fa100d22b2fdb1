"""A chunk's header and its coding tags (``docs/weight-sync-format.md``): what every coding of
a chunk shares, so the codings (``chunks`` v1, ``chunks_v2``) and the tools that name them
(the CLI's ``inspect``) need not import each other.
"""

from __future__ import annotations

import struct

UNCHANGED, XOR_SPARSE, XOR_DENSE, FULL, SUB_SPARSE, SUB_DENSE = 0, 1, 2, 3, 4, 5
CTX_SPARSE = 6  # chunk coding v2: context-conditioned coding (``chunks_v2``)
ENCODING_NAMES = {
    UNCHANGED: "unchanged",
    XOR_SPARSE: "xor-sparse",
    XOR_DENSE: "xor-dense",
    FULL: "full",
    SUB_SPARSE: "sub-sparse",
    SUB_DENSE: "sub-dense",
    CTX_SPARSE: "ctx-sparse",
}
SPARSE, DENSE = {XOR_SPARSE, SUB_SPARSE, CTX_SPARSE}, {XOR_DENSE, SUB_DENSE}
# chunk_index u32, elem_count u32, nchanged u32, encoding u8, nstreams u8
CHUNK_HEADER = struct.Struct("<IIIBB")
