"""What the engine supervisor tracks per engine, and the values its users hold: an engine's
state and status names, a request's lease, and the error a request gets when no engine of
its version answers. A module of its own so that the request path (``request_retry``) need not
import the supervisor. The weight source engines pull from is weight sync's
(``modal_rl.weightsync.source``).
"""

from __future__ import annotations

from dataclasses import dataclass

from modal_rl.weightsync.source import WeightSource  # noqa: F401  (re-exported)

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
