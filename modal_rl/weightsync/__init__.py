"""Lossless delta-compressed weight sync.

Pieces (each in its own module): ``codec`` (encode anchors and deltas), ``decode`` (apply a
frame, verified, with rollback), ``frames`` (the record format), ``streams`` (chunk
bodies), ``differ`` (numpy and torch diff paths), ``chain`` (``VersionChain``).
The wire format is specified in ``docs/weight-sync-format.md``.
"""

from modal_rl.weightsync.chain import VersionChain, frame_bytes
from modal_rl.weightsync.codec import CodecConfig, encode_anchor, encode_delta
from modal_rl.weightsync.decode import ApplyResult, apply_frame
from modal_rl.weightsync.differ import NumpyDiffer, TorchDiffer
from modal_rl.weightsync.errors import (
    BaseMismatchError,
    ChecksumMismatchError,
    CorruptFrameError,
    LayoutMismatchError,
    StaleVersionError,
    TruncatedFrameError,
    WeightSyncError,
)

__all__ = [
    "ApplyResult",
    "BaseMismatchError",
    "ChecksumMismatchError",
    "CodecConfig",
    "CorruptFrameError",
    "LayoutMismatchError",
    "NumpyDiffer",
    "StaleVersionError",
    "TorchDiffer",
    "TruncatedFrameError",
    "VersionChain",
    "WeightSyncError",
    "apply_frame",
    "encode_anchor",
    "encode_delta",
    "frame_bytes",
]
