"""The slime job with keyed engines: ``python3 -m slime_modal.engine_job --engine URL... [--routes FILE] -- ENTRY ARGS``.

slime cannot send a key to its external engines: every request it makes to them (``requests``
in ``SGLangEngine``, the router's proxying, ``discover_external_engines``) is plain
``http://host:port`` with no ``Authorization`` header, and it accepts only ``http``
addresses. So the launcher submits the job through this module, which, on the job's driver
(rank 0, where Ray runs a job's entrypoint):

1. starts ``modal_rl.engines.key_forwarder`` as a child process with one port per engine,
   each adding ``Authorization: Bearer <engine bearer>`` (``run_key.engine_bearer``: the only key it holds) and forwarding to that engine's URL
   (the TLS tunnel of a Modal engine);
2. runs ``ENTRY`` (slime's ``train.py``) in this process as ``__main__`` with ``ARGS`` plus
   ``--rollout-external-engine-addrs <forwarder address per engine>``, as ``python3 ENTRY
   ARGS`` would (the entry's directory first on ``sys.path``);
3. stops the forwarder when the entry returns or raises; a killed driver takes it along
   (parent-death signal).

With ``--routes FILE`` (the launcher's, when it replaces dead engines: see
``slime_modal.engines``) the forwarder follows the file: a port whose engine is being
replaced holds its requests, and sends them to the replacement once it has slime's weights.

Where the forwarder listens: slime's engine clients are Ray actors that may sit on any node
(``SGLangEngine`` actors and ``RolloutManager`` with its router take no GPU), so on a
multi-node cluster it binds this node's cluster address (``SLIME_HOST_IP``, which the
launcher sets per node) and admits only the cluster's node addresses (from ``NO_PROXY``, which
the launcher sets to loopback plus every node); on one node it binds ``127.0.0.1``. It never
binds a wildcard address.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time

from modal_rl.run_key import ENGINE_BEARER_ENV, SECRET_ENVS, MissingRunKeyError, engine_bearer_from_env

FLAG = "--rollout-external-engine-addrs"
START_TIMEOUT_S = 60.0
_LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}


def listen_plan(environ: dict[str, str] | None = None) -> tuple[str, list[str] | None]:
    """``(listen address, allowed peers or None)`` for the forwarder on this node."""
    env = os.environ if environ is None else environ
    bypass = env.get("NO_PROXY") or env.get("no_proxy") or ""
    nodes = [a.strip() for a in bypass.split(",") if a.strip() and a.strip() not in _LOOPBACK_NAMES]
    if len(nodes) <= 1:
        return "127.0.0.1", None
    here = env.get("SLIME_HOST_IP") or env.get("MASTER_ADDR")
    if not here:
        raise ValueError("a multi-node job without SLIME_HOST_IP: start it through python -m slime_modal")
    return here, ["127.0.0.1", "::1", *nodes]


def parse(argv: list[str]) -> tuple[list[str], str, list[str], str | None]:
    """``(engine URLs, entry, entry args, routes file or None)``; ValueError with the usage."""
    usage = (
        "usage: python -m slime_modal.engine_job --engine URL [--engine URL]... [--routes FILE] "
        "-- ENTRY [ARGS...]"
    )
    if "--" not in argv:
        raise ValueError(usage)
    cut = argv.index("--")
    ours, rest = argv[:cut], argv[cut + 1 :]
    pairs = list(zip(ours[::2], ours[1::2], strict=False))
    if len(ours) % 2 or any(flag not in ("--engine", "--routes") for flag, _ in pairs) or not rest:
        raise ValueError(usage)
    engines = [value for flag, value in pairs if flag == "--engine"]
    routes = [value for flag, value in pairs if flag == "--routes"]
    if not engines or len(routes) > 1:
        raise ValueError(usage)
    if FLAG in rest or any(a.startswith(FLAG + "=") for a in rest):
        raise ValueError(f"{FLAG} is set from the engines; drop it from the command")
    return engines, rest[0], rest[1:], (routes[0] if routes else None)


def _pdeathsig() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_forwarder(
    engines: list[str], host: str, peers: list[str] | None, routes: str | None = None
) -> tuple[subprocess.Popen, list[str]]:
    """The forwarder child and its addresses (one per engine, same order)."""
    cmd = [sys.executable, "-m", "modal_rl.engines.key_forwarder", "--listen", host]
    for url in engines:
        cmd += ["--upstream", url]
    for peer in peers or []:
        cmd += ["--allow-peer", peer]
    if routes:
        cmd += ["--routes", routes]
    # The forwarder holds the engines' bearer and nothing else of the run's key.
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENVS}
    env[ENGINE_BEARER_ENV] = engine_bearer_from_env()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig, env=env
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
        if not chunk:
            stop_forwarder(proc)
            raise RuntimeError(
                f"the engine key forwarder did not start (exit {proc.returncode}); see its lines above"
            )
        line += chunk
    return proc, json.loads(line)["addresses"]


def stop_forwarder(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        engines, entry, args, routes = parse(argv)
        engine_bearer_from_env()  # the forwarder needs it; say so here, in one line, before anything starts
        host, peers = listen_plan()
    except (ValueError, MissingRunKeyError) as exc:
        print(f"slime_modal.engine_job: {exc}", file=sys.stderr)
        return 2
    proc, addresses = start_forwarder(engines, host, peers, routes)
    print(
        f"slime_modal: rollout engines reached through {' '.join(addresses)} (key forwarder)", file=sys.stderr
    )
    sys.argv = [entry, *args, FLAG, *addresses]
    sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))  # as `python3 ENTRY` has it
    try:
        runpy.run_path(entry, run_name="__main__")
    finally:
        stop_forwarder(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
