"""Lossless delta-compressed weight sync.

Pieces (each in its own module): ``codec`` (encode anchors and deltas), ``decode`` (apply a
frame, verified, with rollback), ``frames`` (the record format), ``streams`` (chunk
bodies), ``differ`` (numpy and torch diff paths), ``chain`` (``VersionChain``).
The wire format is specified in ``docs/weight-sync-format.md``.
"""

import importlib

# Loaded on first access (PEP 562), so importing one submodule (``weightsync.volumes`` for
# slime's hooks, a store transport) does not load the codec's numba, numpy and zstd.
_EXPORTS = {
    "VersionChain": "chain",
    "frame_bytes": "chain",
    "CodecConfig": "codec",
    "encode_anchor": "codec",
    "encode_delta": "codec",
    "ApplyResult": "decode",
    "apply_frame": "decode",
    "NumpyDiffer": "differ",
    "TorchDiffer": "differ",
    "BaseMismatchError": "errors",
    "ChecksumMismatchError": "errors",
    "CorruptFrameError": "errors",
    "LayoutMismatchError": "errors",
    "StaleVersionError": "errors",
    "TruncatedFrameError": "errors",
    "WeightSyncError": "errors",
}


def __getattr__(name: str):
    if name not in _EXPORTS:  # a submodule, as the eager package used to make them attributes
        try:
            return importlib.import_module(f"modal_rl.weightsync.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'modal_rl.weightsync' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"modal_rl.weightsync.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


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
