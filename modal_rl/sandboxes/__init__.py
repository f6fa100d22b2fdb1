"""Sandboxes: an async, self-sizing ``SandboxPool`` over Modal or local (bubblewrap) providers.

``ModalProvider`` is imported lazily so that ``import modal_rl.sandboxes`` never imports modal.
"""

from modal_rl.sandboxes.errors import (
    PoolClosedError,
    PoolFailedError,
    ProviderUnavailableError,
    RateLimitedError,
    SandboxError,
    SandboxLostError,
    SandboxStartError,
    SandboxStartTimeout,
    TransientProviderError,
)
from modal_rl.sandboxes.lease import Sandbox, SandboxLease
from modal_rl.sandboxes.local import LocalProvider
from modal_rl.sandboxes.pool import SandboxPool
from modal_rl.sandboxes.pool_config import PoolConfig
from modal_rl.sandboxes.provider import TAG_POOL, TAG_RUN, Provider, SandboxHandle
from modal_rl.sandboxes.ratelimit import FileTokenBucket, TokenBucket
from modal_rl.sandboxes.sizing import WarmSizer
from modal_rl.sandboxes.spec import ExecResult, SandboxSpec

__all__ = [
    "TAG_POOL",
    "TAG_RUN",
    "ExecResult",
    "FileTokenBucket",
    "SandboxLease",
    "LocalProvider",
    "ModalProvider",
    "PoolClosedError",
    "PoolFailedError",
    "Provider",
    "ProviderUnavailableError",
    "RateLimitedError",
    "Sandbox",
    "SandboxError",
    "SandboxHandle",
    "SandboxLostError",
    "SandboxPool",
    "PoolConfig",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxStartTimeout",
    "TokenBucket",
    "TransientProviderError",
    "WarmSizer",
]


def __getattr__(name: str):
    if name == "ModalProvider":
        from modal_rl.sandboxes.modal_provider import ModalProvider

        return ModalProvider
    raise AttributeError(f"module 'modal_rl.sandboxes' has no attribute {name!r}")
