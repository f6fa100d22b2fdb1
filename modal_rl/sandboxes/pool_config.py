"""A sandbox pool's settings, validated where they are made (``PoolConfig``).

``SandboxPool(provider, spec, config)`` takes one of these; keyword settings
(``SandboxPool(provider, spec, min_warm=2)``) are the same fields, applied over the config (or the
defaults). Validation is a table of rules (``RULES``), each one line naming the field and the fix,
checked when the config is made, so a pool never starts with settings it cannot honour.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class PoolConfig:
    """Sizes, timeouts, retries and housekeeping of one pool. ``rate_limiter``: True, the
    provider's shared per-host create rate; None/False, none; or a ``TokenBucket``. ``sizer``: a
    ``WarmSizer`` (default: one from ``min_warm``/``max_warm``). ``min_remaining_s``: a sandbox
    with less lifetime left is never handed out (default: 10% of its lifetime, at most 60 s)."""

    min_warm: int = 0
    max_warm: int = 64
    max_live: int = 64
    max_starting: int = 16
    name: str = "default"
    run_id: str | None = None
    rate_limiter: Any = True
    sizer: Any = None
    create_timeout_s: float = 120.0
    ready_timeout_s: float = 60.0
    claim_timeout_s: float = 600.0
    min_remaining_s: float | None = None
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    max_consecutive_failures: int = 10
    log_interval_s: float = 60.0
    handle_signals: bool = True

    def __post_init__(self) -> None:
        for holds, message in RULES:
            if not holds(self):
                raise ValueError(message(self))

    def with_settings(self, **settings: Any) -> PoolConfig:
        """This config with ``settings`` applied; an unknown name is one line listing the known."""
        unknown = sorted(set(settings) - {f.name for f in fields(self)})
        if unknown:
            known = ", ".join(f.name for f in fields(self))
            raise TypeError(
                f"unknown sandbox pool setting(s) {', '.join(unknown)}; the settings are: {known}"
            )
        return replace(self, **settings)


RULES = (
    (
        lambda c: 0 <= c.min_warm <= c.max_warm,
        lambda c: f"need 0 <= min_warm <= max_warm; got {c.min_warm}, {c.max_warm}",
    ),
    (
        lambda c: c.max_live >= 1 and c.max_starting >= 1,
        lambda c: f"need max_live >= 1 and max_starting >= 1; got {c.max_live}, {c.max_starting}",
    ),
    (
        lambda c: c.min_warm <= c.max_live,
        lambda c: f"min_warm ({c.min_warm}) cannot exceed max_live ({c.max_live})",
    ),
    (lambda c: c.create_timeout_s > 0, lambda c: f"create_timeout_s must be > 0, got {c.create_timeout_s!r}"),
    (lambda c: c.ready_timeout_s > 0, lambda c: f"ready_timeout_s must be > 0, got {c.ready_timeout_s!r}"),
    (lambda c: c.claim_timeout_s > 0, lambda c: f"claim_timeout_s must be > 0, got {c.claim_timeout_s!r}"),
    (
        lambda c: c.max_retries >= 0 and c.max_consecutive_failures >= 1,
        lambda c: "max_retries must be >= 0 and max_consecutive_failures >= 1",
    ),
)
