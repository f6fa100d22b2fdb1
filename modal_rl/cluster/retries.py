"""Bringing a run back after a node dies: which exits mean "a node was lost", and the retry loop.

A run is retried only when the *cluster* failed around the job - a follower lost
(``EXIT_FOLLOWER_LOST``) or the head's Ray node gone (``EXIT_HEAD_FAILED``) - never when the
job itself failed or timed out, which a fresh cluster would repeat. The job is started again
with the same entrypoint; resuming is the job's own business (verl: ``trainer.resume_mode=auto``
with ``trainer.default_local_dir`` on a path that outlives the node - a Modal Volume, or on
the local backend any host path), so at most the steps since its last checkpoint are redone.

- Local backend: ``LocalBackend.run`` loops here, a fresh cluster (new run id, new ports) per
  attempt, up to ``spec.retries`` times.
- Modal: the function carries ``retries=spec.retries``; Modal retries an input whose
  container failed (preemption, a crashed container). Rank 0 sees a lost follower as an exit
  code, which Modal would count as a success: ``raise_for_retry`` turns it into an exception
  so Modal's retry applies to it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from modal_rl.cluster.plan import EXIT_FOLLOWER_LOST, EXIT_HEAD_FAILED

RETRYABLE_EXITS = (EXIT_FOLLOWER_LOST, EXIT_HEAD_FAILED)


class NodeLostError(RuntimeError):
    """Rank 0 ended because a node of the cluster was lost; raised so a platform retries."""

    def __init__(self, exit_code: int):
        super().__init__(f"a node of the cluster was lost (exit {exit_code}); the run will be retried")
        self.exit_code = exit_code


def raise_for_retry(exit_code: int, retries: int) -> int:
    """In a Modal container body: raise for a lost node when the function has retries, else
    pass the exit code through."""
    if retries > 0 and exit_code in RETRYABLE_EXITS:
        raise NodeLostError(exit_code)
    return exit_code


@dataclass
class Attempt:
    run_id: str
    exit_code: int
    started: float  # time.monotonic()
    ended: float


@dataclass
class RetryLog:
    attempts: list[Attempt] = field(default_factory=list)


def run_with_retries(
    run_once: Callable[[], tuple[str, int]], retries: int, say: Callable[[str], None], log: RetryLog
) -> int:
    """Call ``run_once`` (returns ``(run_id, exit_code)``) until it succeeds, fails for a reason
    a retry cannot fix, or ``retries`` retries are used; returns the last exit code."""
    for attempt in range(retries + 1):
        started = time.monotonic()
        run_id, code = run_once()
        log.attempts.append(Attempt(run_id, code, started, time.monotonic()))
        if code not in RETRYABLE_EXITS or attempt == retries:
            return code
        say(
            f"[modal_rl.cluster] a node was lost (exit {code}); starting the cluster again "
            f"(retry {attempt + 1} of {retries}); the job resumes from its last checkpoint"
        )
    raise AssertionError("unreachable")
