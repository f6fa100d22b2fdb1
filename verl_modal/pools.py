"""A verl ``ResourcePoolManager`` that waits for the cluster's GPUs instead of failing at once.

verl 0.9.1 checks once, right after creating its pools, that Ray's *available* GPUs cover the
pools ("Total available GPUs X is less than total desired GPUs Y"), so a job that starts
before every node has joined dies. :class:`WaitingResourcePoolManager` polls instead until
the pools fit, or raises after a timeout naming what is missing (nodes, GPUs per node).

Invariants:
- "fit" is per node, as verl places a pool: each entry of ``process_on_nodes`` (GPUs on one
  node) must go to one node with that many free GPUs; entries are packed first-fit
  decreasing over the nodes' available GPUs (pools may share a node, as colocated pools do).
  Logical GPUs (``ray start --num-gpus`` on the local backend) count like real ones.
- The wait bound is the ``wait_timeout_s`` field, default ``$VERL_MODAL_POOL_WAIT_S`` (the
  launcher sets it to the cluster's join timeout), else :data:`DEFAULT_WAIT_S`.
- :func:`install` swaps our class in for the names verl's trainer and standalone rollout
  replicas construct, in this process only; installed files are never edited.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

WAIT_ENV = "VERL_MODAL_POOL_WAIT_S"
DEFAULT_WAIT_S = 300.0
# Modules that construct ``ResourcePoolManager`` by the name they imported.
_USERS = ("verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.ray_trainer", "verl.workers.rollout.replica")


class PoolWaitTimeout(RuntimeError):
    """The cluster's GPUs did not register in time; the message says what is missing."""


def shortfall(needs: list[int], free: dict[str, float]) -> list[int]:
    """The entries of ``needs`` (GPUs wanted on one node each) that do not fit ``free``
    (node -> available GPUs), packing first-fit decreasing. Empty when everything fits."""
    room = sorted(free.values(), reverse=True)
    missing = []
    for need in sorted(needs, reverse=True):
        for i, left in enumerate(room):
            if left >= need:
                room[i] = left - need
                break
        else:
            missing.append(need)
    return missing


def available_gpus_per_node() -> dict[str, float]:
    """node id -> available GPUs (NPUs where there are no GPUs), for ALIVE nodes, as verl reads it."""
    import ray

    per_node = ray._private.state.available_resources_per_node()
    return {node: float(res.get("GPU", res.get("NPU", 0))) for node, res in per_node.items()}


def _default_wait() -> float:
    value = os.environ.get(WAIT_ENV)
    return float(value) if value else DEFAULT_WAIT_S


def _base():
    from verl.single_controller.ray.base import ResourcePoolManager

    return ResourcePoolManager


def _make_class():
    base = _base()

    @dataclass
    class WaitingResourcePoolManager(base):
        """verl's manager; ``_check_resource_available`` waits up to ``wait_timeout_s``."""

        wait_timeout_s: float = field(default_factory=_default_wait)
        poll_s: float = 0.5

        def required(self) -> list[int]:
            return [n for nodes in self.resource_pool_spec.values() for n in nodes if n > 0]

        def _check_resource_available(self):
            needs = self.required()
            deadline = time.monotonic() + self.wait_timeout_s
            started = time.monotonic()
            said = False
            while True:
                free = available_gpus_per_node()
                missing = shortfall(needs, free)
                if not missing:
                    if said:
                        print(f"[verl_modal.pools] GPUs ready after {time.monotonic() - started:.1f} s")
                    return
                if time.monotonic() >= deadline:
                    raise PoolWaitTimeout(self.describe_missing(needs, free, missing))
                if not said:
                    print(f"[verl_modal.pools] waiting up to {self.wait_timeout_s:g} s: {self.status(free)}")
                    said = True
                time.sleep(self.poll_s)

        def status(self, free: dict[str, float]) -> str:
            have = ", ".join(f"{node[:8]}: {gpus:g}" for node, gpus in sorted(free.items())) or "none"
            return f"pools {dict(self.resource_pool_spec)} need {sum(self.required())} GPUs; free per node: {have}"

        def describe_missing(self, needs: list[int], free: dict[str, float], missing: list[int]) -> str:
            counts: dict[int, int] = {}
            for n in missing:
                counts[n] = counts.get(n, 0) + 1
            what = ", ".join(f"{c} node(s) with {n} free GPU(s)" for n, c in sorted(counts.items()))
            return (
                f"after {self.wait_timeout_s:g} s the Ray cluster still lacks {what} for verl's resource pools "
                f"({len(needs)} node slot(s), {sum(needs)} GPUs in all; {len(free)} node(s) registered with "
                f"{sum(free.values()):g} free GPUs); {self.status(free)}"
            )

    return WaitingResourcePoolManager


_CLASS = None


def manager_class():
    """Our ``ResourcePoolManager`` subclass (built on first use: it imports verl)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_class()
    return _CLASS


def install() -> list[str]:
    """Make verl's trainer and rollout replicas construct our manager; returns the modules changed."""
    import importlib

    cls = manager_class()
    changed = []
    for name in _USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "ResourcePoolManager", None) is not None:
            module.ResourcePoolManager = cls
            changed.append(name)
    return changed
