"""Typed errors of the weight-sync codec. Every refusal leaves the receiver's state unchanged."""


class WeightSyncError(Exception):
    """Base class: a frame was refused. The message is one line, fit for a log or stderr."""


class CorruptFrameError(WeightSyncError):
    """A record failed its checksum, or its contents are malformed (bad magic, bad lengths)."""


class TruncatedFrameError(CorruptFrameError):
    """The byte stream ended inside a record, or before the version's end record."""


class FrameInterruptedError(TruncatedFrameError):
    """A frame being applied as it arrived lost its connection (or stalled, or a new frame
    began) before its end record: not the frame's fault, so the receiver rolls back and
    asks again without counting a refusal."""


class BaseMismatchError(WeightSyncError):
    """A delta names a base version (or base tensor checksum) other than the one held."""


class LayoutMismatchError(WeightSyncError):
    """A frame's tensor names, dtypes or shapes differ from the held state's."""


class ChecksumMismatchError(WeightSyncError):
    """The rebuilt tensor's ls128 sum differs from the one the sender recorded."""


class StaleVersionError(BaseMismatchError):
    """A frame would move the receiver backwards (or nowhere): its version is not newer."""


class VersionNotReachedError(WeightSyncError):
    """A receiver could not stage its target version in time, or refused it too often; its
    staged state and live weights stay at the version it held."""


class AuthenticationError(WeightSyncError):
    """A frame, record, peer or request could not be shown to come from this run (its key).
    Raised before anything it carried was used."""


class UnsignedFrameError(AuthenticationError):
    """A receiver that holds the run's key was given a keyless (unsigned) frame."""


class SignedFrameError(AuthenticationError):
    """A keyless receiver (``key=None``) was given a frame signed with a run key."""


class RecordMacError(AuthenticationError):
    """A signed record's MAC does not match: altered (even with its checksum recomputed),
    moved, spliced from another frame, or signed with another run's key."""


class HandshakeError(AuthenticationError):
    """The frame server and the receiver could not prove to each other that they hold the
    same run key (or one of them is keyless); no frame byte was exchanged."""


class PullRefusedError(AuthenticationError):
    """An engine refused a weight-pull request that was not signed with the run's key (or
    was altered, expired or replayed); it dialled nothing and its weights are unchanged."""


class ForeignRunError(BaseMismatchError):
    """A frame names another run than the one the receiver follows (same key, other run)."""


class StaleEpochError(StaleVersionError):
    """A frame comes from an older epoch than the one held: its trainer was replaced by a
    newer start of the same run, so its versions no longer count."""


class EpochMismatchError(BaseMismatchError):
    """A delta from an epoch the receiver does not hold: a new epoch starts with its anchor."""


class LeaseHeldError(WeightSyncError):
    """Another publisher holds the run's lease on this store: one trainer at a time."""


class LeaseLostError(WeightSyncError):
    """This publisher's lease lapsed and another trainer took it (or a newer epoch of the
    run is publishing): this trainer must stop publishing."""


class StoreFileError(CorruptFrameError):
    """A file in a frame store is not one its format allows: a symbolic link (never
    followed), not a regular file, larger than its format declares (bytes after a frame's
    end record, a record longer than its cap), or named for another version than the one
    it holds. Refused before anything it carries is used."""


class RolledBackError(StaleVersionError):
    """A store's ``latest`` names a version older than this receiver's floor (a version
    it was told is current, e.g. by a signed pull): a rolled-back or stale store."""
