"""Create-rate limiting for sandbox pools: the project's token bucket (``modal_rl.ratelimit``),
by default shared by every pool of this user on the host through a small file under the
user's registry dir (``live_records.default_dir``, checked private like the registry itself), so
N pools in N processes together never exceed ``rate`` creates/s (plus ``burst``).
"""

from __future__ import annotations

from modal_rl.ratelimit import FileTokenBucket, TokenBucket
from modal_rl.sandboxes import live_records

__all__ = ["FileTokenBucket", "TokenBucket", "host_bucket"]


def host_bucket(name: str, rate: float, burst: int) -> FileTokenBucket:
    """The default bucket every pool of this user on this host shares for provider ``name``."""
    base = live_records.open_dir(live_records.default_dir())
    return FileTokenBucket(base / f"ratelimit-{name}.json", rate, burst)
