"""What the engine supervisor tracks per engine, and the values its users hold: an engine's
state and status names, a request's lease, the weight source engines pull from, and the error
a request gets when no engine of its version answers. A module of its own so that the request
path (``engine_requests``) and the weight pusher (``weightsync.apply.engine_push``) need not import
the supervisor.
"""

from __future__ import annotations

from dataclasses import dataclass

SERVING, LOADING, LOST, REPLACING, FAILED = "serving", "loading", "lost", "replacing", "failed"
EVENT_KINDS = (
    "started",
    "lost",
    "replaced",
    "caught_up",
    "serving",
    "replace_failed",
    "version",
    "route_failed",
)


class EngineLost(RuntimeError):
    """No engine of the right weight version could answer a request in time: drop and mask it."""


@dataclass(frozen=True)
class WeightSource:
    """Where engines pull the pool's current weights from (a ``FrameServer``), and which version."""

    host: str
    port: int
    version: int
    tls: bool = False
    epoch: int | None = None  # the publisher's epoch: signed into the pull (engines' floor)


@dataclass
class EngineState:
    index: int
    url: str
    generation: int = 0
    status: str = SERVING
    version: int | None = None
    failures: int = 0
    lost_at: float | None = None
    progress: int = 0  # requests that finished on this engine since its last check


@dataclass(frozen=True)
class EngineLease:
    """One request's engine: stays valid while ``supervisor.is_current(lease)``."""

    index: int
    generation: int
    url: str
    version: int | None
