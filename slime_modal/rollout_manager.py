"""slime's rollout actor, owning our engines: ``--rollout-manager-path slime_modal.rollout_manager.ModalRolloutManager``.

Used where slime has the rollout-manager seam (``patches/slime/0004``); the launcher names this
class and passes the engines' config in ``MODAL_RL_SLIME_ENGINES`` (``slime_modal.manager_seam``).
Imported only by slime's ``create_rollout_manager``, in the rollout actor's process: it imports
slime's ``RolloutManager`` (and with it SGLang's client-side modules) at import.

``ModalRolloutManager`` is a subclass of slime's ``RolloutManager`` (the class under its Ray
actor, which the seam makes a Ray actor again). Before slime's own constructor runs, it:

1. starts the engines from the config (``modal_rl.cluster``'s engine pool: the same keyed
   SGLang command line as the fallback) under a supervisor, behind a key forwarder in this
   process (``modal_rl.engines.forwarded``): one fixed ``http://host:port`` per engine,
   which adds the engine bearer slime cannot send;
2. gives slime those addresses as its external engines (``args.rollout_external_engine_addrs``,
   then slime's own ``apply_external_engine_info_to_args``, which reads each one's
   ``/server_info``), so slime's constructor takes its external-engine path: its router, and
   one ``SGLangEngine`` actor per forwarder port, which weight updates go through.

While the run goes on, the supervisor watches each engine (process, ``GET /health``); a dead or
hung one is replaced from the same spec, caught up to slime's newest published version through
slime's own weight path (``slime_modal.engines.sglang_engine``, its ``catch_up``: ``/pull_weights`` then
``/update_weights_from_disk``), and only then does its port route to it; meanwhile the port
holds slime's requests. Before each weight update slime calls ``recover_updatable_engines``
(with ``--use-fault-tolerance``, which the launcher adds); here that waits until every slot
serves again (an ended process is noticed then, not at the next check), so the update reaches
every engine, or raises naming the slot that could not be replaced.
``dispose`` stops the engines with slime's own cleanup.

Where the forwarder listens: as ``slime_modal.engine_job`` (``listen_plan``): 127.0.0.1 on one
node, else this node's cluster address admitting only the cluster's nodes.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from slime.backends.sglang_utils.external import apply_external_engine_info_to_args
from slime.ray.rollout import RolloutManager

from modal_rl.engines import EngineSpec, ForwardedEngines, engine_key, get_engine_pool
from modal_rl.report.parts import parts_dir, record_events
from modal_rl.settings import read
from slime_modal.engine_job import listen_plan
from slime_modal.engines import WeightPath, sglang_engine
from slime_modal.manager_seam import CONFIG_ENV

# How long a weight update waits for replacements (start + catch-up) before it fails.
RECOVER_TIMEOUT_S = read("MODAL_RL_SLIME_RECOVER_TIMEOUT_S")
EVENTS_POLL_S = 2.0


def start_engines(environ: dict[str, str] | None = None) -> ForwardedEngines:
    """The config's engines, started, supervised and behind this process's key forwarder."""
    env = os.environ if environ is None else environ
    if not env.get(CONFIG_ENV):
        raise RuntimeError(
            f"{CONFIG_ENV} is not set: ModalRolloutManager is named by python -m slime_modal "
            "--rollout-engines, which sets it; run through that launcher"
        )
    config: dict[str, Any] = json.loads(env[CONFIG_ENV])
    pool = get_engine_pool(EngineSpec.from_dict(config["spec"]), config["backend"], **config["pool"])
    weights = WeightPath(**config["weights"])
    host, peers = listen_plan(env)
    engines = ForwardedEngines(
        pool,
        sglang_engine(weights, engine_key(pool.spec)),
        host=host,
        allow_peers=peers,
        health=config["health"],
    )
    engines.start()
    return engines


class ModalRolloutManager(RolloutManager.__ray_actor_class__):
    """slime's rollout manager over engines we start, supervise and replace (module docstring)."""

    def __init__(self, args, pg):
        self.modal_engines = start_engines()
        self._events_seen = 0
        self._stopped = threading.Event()
        self._events_lock = threading.Lock()
        # engine events reported as they happen (a loss is seen by the supervisor, not by slime)
        threading.Thread(target=self._watch_events, name="modal-rl-engine-events", daemon=True).start()
        try:
            args.rollout_external_engine_addrs = list(self.modal_engines.addresses)
            args.rollout_external = True
            apply_external_engine_info_to_args(args)
            super().__init__(args, pg)
        except BaseException:
            self._stopped.set()
            self.modal_engines.stop()
            raise

    def recover_updatable_engines(self):
        self.health_monitoring_pause()
        try:
            self.modal_engines.wait_serving(RECOVER_TIMEOUT_S)
        finally:
            self._report_events()

    def dispose(self):
        try:
            super().dispose()
        finally:
            self._stopped.set()
            self._report_events()
            self.modal_engines.stop()

    def _watch_events(self) -> None:
        while not self._stopped.wait(EVENTS_POLL_S):
            self._report_events()

    def _report_events(self) -> None:
        """The supervisor's new events: one line each on the job's output, and into the run's
        parts directory (the report's engine timeline)."""
        with self._events_lock:
            events = list(self.modal_engines.supervisor.events)
            new = events[self._events_seen :]
            self._events_seen = len(events)
        record_events(parts_dir(), new)
        for event in new:
            fields = " ".join(
                f"{k}={event[k]}" for k in ("index", "generation", "pid", "version") if k in event
            )
            print(f"[modal_rl.engine] {event['kind']} {fields}", flush=True)

    def engine_report(self) -> dict[str, Any]:
        """Where each slot stands: the forwarder's addresses (what slime holds), the engines
        behind them, their local pids, and the supervisor's events."""
        supervisor = self.modal_engines.supervisor
        return {
            "addresses": list(self.modal_engines.addresses),
            "engines": supervisor.snapshot(),
            "pids": supervisor.pids(),
            "events": list(supervisor.events),
        }
