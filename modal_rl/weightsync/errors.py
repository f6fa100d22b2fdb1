"""Typed errors of the weight-sync codec. Every refusal leaves the receiver's state unchanged."""


class WeightSyncError(Exception):
    """Base class: a frame was refused. The message is one line, fit for a log or stderr."""


class CorruptFrameError(WeightSyncError):
    """A record failed its checksum, or its contents are malformed (bad magic, bad lengths)."""


class TruncatedFrameError(CorruptFrameError):
    """The byte stream ended inside a record, or before the version's end record."""


class BaseMismatchError(WeightSyncError):
    """A delta names a base version (or base tensor checksum) other than the one held."""


class LayoutMismatchError(WeightSyncError):
    """A frame's tensor names, dtypes or shapes differ from the held state's."""


class ChecksumMismatchError(WeightSyncError):
    """The rebuilt tensor's xxh3-128 differs from the checksum the sender recorded."""


class StaleVersionError(BaseMismatchError):
    """A frame would move the receiver backwards (or nowhere): its version is not newer."""


class VersionNotReachedError(WeightSyncError):
    """A receiver could not stage its target version in time, or refused it too often; its
    staged state and live weights stay at the version it held."""
