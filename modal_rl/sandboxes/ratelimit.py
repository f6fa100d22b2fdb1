"""Create-rate limiting for sandbox pools: the project's token bucket (``modal_rl.ratelimit``),
by default shared by every pool on the host through a small file under the registry dir, so
N pools in N processes together never exceed ``rate`` creates/s (plus ``burst``).
"""

from __future__ import annotations

import os
from pathlib import Path

from modal_rl.ratelimit import FileTokenBucket, TokenBucket

__all__ = ["FileTokenBucket", "TokenBucket", "host_bucket"]


def host_bucket(name: str, rate: float, burst: int) -> FileTokenBucket:
    """The default bucket every pool on this host shares for provider ``name``."""
    base = Path(os.environ.get("MODAL_RL_SANDBOX_REGISTRY", "/tmp/modal-rl-sandboxes"))
    return FileTokenBucket(base / f"ratelimit-{name}.json", rate, burst)
