"""Lossless delta-compressed weight sync.

By concept: ``wire`` (the format: frames, keys, epochs), ``codec`` (encode anchors and
deltas, decode them verified with rollback, the chunk ``codings``), ``transport`` (the
``FrameSink``/``FrameSource`` ports, TCP, stores), ``apply`` (into inference engines), ``cli``;
``publisher``, ``subscriber`` and ``chain`` (``VersionChain``) at the top.
The wire format is specified in ``docs/weight-sync-format.md``.
"""

import importlib

# Loaded on first access (PEP 562), so importing one submodule (``weightsync.transport.volumes`` for
# slime's hooks, a store transport) does not load the codec's numba, numpy and zstd.
_EXPORTS = {
    "VersionChain": "chain",
    "frame_bytes": "chain",
    "CodecConfig": "codec.encode",
    "encode_anchor": "codec.encode",
    "encode_delta": "codec.encode",
    "ApplyResult": "codec.decode",
    "apply_frame": "codec.decode",
    "NumpyDiffer": "codec.differ",
    "TorchDiffer": "codec.differ",
    "BaseMismatchError": "errors",
    "ChecksumMismatchError": "errors",
    "CorruptFrameError": "errors",
    "LayoutMismatchError": "errors",
    "StaleVersionError": "errors",
    "TruncatedFrameError": "errors",
    "WeightSyncError": "errors",
}


def __getattr__(name: str):
    if name not in _EXPORTS:  # a submodule by attribute (``weightsync.chain``), imported on first use
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
