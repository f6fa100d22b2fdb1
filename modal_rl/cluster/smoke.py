"""``python -m modal_rl.cluster smoke``: bring a cluster up, all-reduce across it, tear it down.

Prints exactly one JSON line on stdout: the collective job's report (``nodes_alive``,
``allreduce_ok``, ...) plus ``exit_code``, ``wall_s`` and, for the local backend,
``leftover_pids`` (processes of this run still alive after teardown; must be 0).
Everything else (Ray's and the job's logs) goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time

from modal_rl.cluster.backend import JobRequest
from modal_rl.cluster.backends import get_backend
from modal_rl.cluster.collective import MARKER
from modal_rl.cluster.spec import ClusterSpec


def smoke_job(nodes: int, timeout_s: float = 120.0) -> JobRequest:
    return JobRequest(
        [
            sys.executable,
            "-m",
            "modal_rl.cluster.collective",
            "--nodes",
            str(nodes),
            "--timeout",
            str(timeout_s),
        ]
    )


def run_smoke(spec: ClusterSpec, backend_name: str = "local") -> dict:
    from modal_rl.cluster import procs

    found: list[dict] = []

    def on_line(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if line.startswith(MARKER + " "):
            found.append(json.loads(line[len(MARKER) + 1 :]))

    backend = get_backend(backend_name, on_line=on_line)
    started = time.monotonic()
    code = backend.run(spec, smoke_job(spec.nodes))
    report = (
        found[-1]
        if found
        else {"nodes_alive": None, "allreduce_ok": False, "error": "no report from the job"}
    )
    report["exit_code"] = code
    report["wall_s"] = round(time.monotonic() - started, 2)
    if getattr(backend, "last_run_id", None):  # a backend whose processes run here
        report["leftover_pids"] = len(procs.pids_of_run(backend.last_run_id))
        report["run_id"] = backend.last_run_id
    return report
