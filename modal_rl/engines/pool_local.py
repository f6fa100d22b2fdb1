"""Local engine pool: each engine a process on 127.0.0.1, on a free port, with a log file.

Invariants (beyond ``engines.EnginePool``'s):
- each engine runs in its own session (its process group is what ``stop``/``replace`` signal),
  under ``setpriv --pdeathsig KILL`` where available (a killed pool process takes its engines
  along), with ``MODAL_RL_RUN_ID`` set, so ``procs.end_run`` also finds children that left the
  group;
- engines are forked from one long-lived spawner thread (``spawn``): the parent-death signal
  follows the forking *thread*, and pools are started from short-lived ones;
- each pool owns a run temp dir (``modal_rl.run_temp``), ``<temp>/mrl-engines-*``: its engines
  get it as ``TMPDIR``, so vLLM's ipc sockets, ``vllm_dist_*`` files and torch's ``pymp-*``
  dirs land there, and ``stop()`` removes it (and, as a backstop, the process's exit), so
  runs and tests leave nothing in the temp directory, even after a SIGKILLed engine;
- logs: in ``log_dir`` when the caller names one (kept); otherwise in the run temp dir. An
  engine's output reaches its log only through ``pump``, which replaces the run key and every
  key derived from it (``redaction.Redactor``: SGLang logs ``server_args=ServerArgs(...,
  api_key=..., admin_api_key=...)`` with the key ``keyed_launch`` gave it); log files are 0600
  and the folders the pool makes (the run temp dir, a named ``log_dir`` that did not exist) 0700;
  a named folder that already existed keeps its mode;
- a command whose program is a bare name (``vllm``, ``python3``) runs the program of *this*
  environment: ``program`` looks it up in the interpreter's own ``bin/`` (a venv that was never
  activated has it there, not on ``PATH``) before ``PATH``, and one that is in neither is an
  ``EngineStartError`` of one line, before anything starts;
- a port stays ours until the engine holds it: for a server that binds with ``SO_REUSEPORT``
  (``EngineSpec.shares_port``) the pool holds the port itself (``ports.reserve_held``) from its
  pick until a listener of the engine's own process tree is on it, so no other user can bind it
  first; for any other server, a listener that is not the engine's stops the start with an
  ``EngineStartError`` and gets no bearer (``_listener_is_ours``): ``start()`` never returns a
  squatter as an engine;
- ``replace(i)`` SIGKILLs engine ``i``'s process group (it may be hung: SIGSTOPped processes
  die of SIGKILL too), starts the same command on a new free port and returns its address
  once it is up; its log is ``<name>-<i>.<generation>.log``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from modal_rl import run_temp
from modal_rl.cluster import peer_creds, procs
from modal_rl.cluster.redaction import Redactor
from modal_rl.engines.health import ready
from modal_rl.engines.pool import (
    KEY_ENVS,
    EnginePool,
    EngineSpec,
    EngineStartError,
    engine_failure,
    engine_key,
    tail_of,
)
from modal_rl.engines.routes import ADAPTER_DIR_ENV
from modal_rl.run_key import ENGINE_BEARER_ENV, engine_env, run_key_or_none

TEMP_PREFIX = f"{run_temp.PREFIX}engines-"
LOG_DIR_MODE = 0o700
LOG_FILE_MODE = 0o600
PUMP_JOIN_S = 5.0


class LocalEnginePool(EnginePool):
    """Engines as processes on 127.0.0.1 (see the module docstring). ``GPU`` is not enforced
    here: the command decides what it runs on."""

    backend = "local"
    host = "127.0.0.1"

    def __init__(
        self, spec: EngineSpec, log_dir: str | None = None, poll_s: float = 0.2, grace_s: float = 5.0
    ):
        super().__init__(spec)
        self.run_id = uuid.uuid4().hex[:12]
        self.temp_dir = run_temp.named(f"engines-{self.run_id}")  # made by start()
        self.keeps_logs = bool(log_dir)  # else the logs go with the temp dir
        self.log_dir = Path(log_dir) if log_dir else self.temp_dir
        self.generations: list[int] = []
        self._lock = threading.Lock()
        self._stopped = False
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []  # pumps[i]: engine i's output -> its log
        self.ports: list[int] = []
        self._holds: dict[int, Any] = {}  # engine index -> the socket holding its port, until it listens

    def log_path(self, index: int) -> Path:
        generation = self.generations[index] if index < len(self.generations) else 0
        suffix = f".{generation}" if generation else ""
        return self.log_dir / f"{self.spec.name}-{index}{suffix}.log"

    def alive(self, index: int) -> bool | None:
        with self._lock:
            return index < len(self.procs) and self.procs[index].poll() is None

    def pid(self, index: int) -> int | None:
        with self._lock:
            return self.procs[index].pid if index < len(self.procs) else None

    def _env(self) -> dict[str, str]:
        env = {
            **os.environ,
            **run_temp.child_env(self.temp_dir),
            **self.spec.env,
            procs.RUN_ID_ENV: self.run_id,
            "PYTHONUNBUFFERED": "1",
        }
        for name in KEY_ENVS:  # a keyless server gets no key; a keyed one only its capabilities
            env.pop(name, None)
        if self._key is not None:
            # bearer (+ the frame-read key if it pulls frames); never the run key
            env.update(engine_env(self._key, self.spec.pulls_frames))
        return env

    def describe(self) -> dict[str, Any]:
        auth = (
            "bearer key required (Authorization: Bearer <engine bearer>; each engine gets the bearer "
            f"as {ENGINE_BEARER_ENV} in its environment, never the run key); plain http on 127.0.0.1 only"
            if self.spec.auth
            else "none (keyless server, explicitly asked for); plain http on 127.0.0.1 only"
        )
        return {
            "backend": self.backend,
            "spec": self.spec.to_dict(),
            "commands": [self.spec.argv(self.host, 0) for _ in range(self.spec.count)],
            "auth": auth,
            "note": "each engine gets a free port on 127.0.0.1 at start ({port} above shows 0)",
        }

    def start(self) -> list[str]:
        self._key = engine_key(self.spec)
        self._stopped = False
        run_temp.own(self.temp_dir)  # made here (again, after a stop()): removed by stop()
        os.chmod(self.temp_dir, LOG_DIR_MODE)  # ours; engine logs may be in it
        if not self.log_dir.exists():  # a folder the caller named and that already exists is theirs
            self.log_dir.mkdir(parents=True, mode=LOG_DIR_MODE)
            os.chmod(self.log_dir, LOG_DIR_MODE)  # mkdir's mode is filtered by the umask
        self.ports = self._pick_ports(range(self.spec.count))
        self.generations = [0] * self.spec.count
        try:
            for index, port in enumerate(self.ports):
                proc, pump_thread = self._spawn(index, port)
                self.procs.append(proc)
                self.pumps.append(pump_thread)
            self._wait_all(range(self.spec.count))
        except BaseException:
            self.stop()
            raise
        self.addresses = [f"http://{self.host}:{port}" for port in self.ports]
        return list(self.addresses)

    def _pick_ports(self, indices) -> list[int]:
        """Free ports for engines ``indices``, each held until its engine listens when the
        server shares its port (module docstring)."""
        from modal_rl.cluster import ports
        from modal_rl.cluster.backend_local import free_ports

        indices = list(indices)
        if not self.spec.shares_port:
            return free_ports(len(indices), self.host)
        picked = ports.reserve_held(len(indices), self.host)
        with self._lock:
            for index, (_, hold) in zip(indices, picked, strict=True):
                self._release(index)
                self._holds[index] = hold
        return [port for port, _ in picked]

    def _release(self, index: int) -> None:
        hold = self._holds.pop(index, None)
        if hold is not None:
            hold.close()

    def _spawn(self, index: int, port: int) -> tuple[subprocess.Popen, threading.Thread]:
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        env = self._env()
        if ADAPTER_DIR_ENV not in self.spec.env:
            # Engines of a pool share its TMPDIR; each stages LoRA adapters in a directory of its
            # own, the one its guard lets /v1/load_lora_adapter read (``routes``).
            env[ADAPTER_DIR_ENV] = str(Path(self.temp_dir) / f"lora-{index}-{port}")
        first, *rest = self.spec.argv(self.host, port)
        argv = [program(first, env.get("PATH"), self.spec.name), *rest]
        log = open_log(self.log_path(index))
        try:
            proc = spawn(
                prefix + argv,
                cpus=self.spec.cpus,
                stdout=subprocess.PIPE,  # through pump(), never raw into the file
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            log.close()
            raise
        procs.remember_start(proc)  # signal_group checks it before any killpg
        redactor = Redactor(self._key or run_key_or_none())
        thread = threading.Thread(
            target=_pump_to_file, args=(proc.stdout, redactor, log), name=f"engine-log-{index}", daemon=True
        )
        thread.start()
        return proc, thread

    def replace(self, index: int) -> str:
        with self._lock:
            if self._stopped or index >= len(self.procs):
                raise EngineStartError(f"{self.spec.name} {index}: the pool is stopped; nothing to replace")
            old = self.procs[index]
        _kill_group(old)
        (port,) = self._pick_ports([index])
        with self._lock:
            if self._stopped:
                raise EngineStartError(f"{self.spec.name} {index}: the pool stopped during the replacement")
            self.generations[index] += 1
            self.ports[index] = port
            self.procs[index], self.pumps[index] = self._spawn(index, port)
            self.addresses[index] = f"http://{self.host}:{port}"
        self._wait_all([index])  # on failure the new process stays for stop() to end
        return self.addresses[index]

    def _listener_is_ours(self, index: int) -> tuple[bool, str]:
        """Whether the engine's port is held by a socket of our own user, before the probe
        sends it the bearer: another local user can bind a port between our claim and the
        engine's bind, and would otherwise receive the bearer and be taken for the engine."""
        if not peer_creds.is_loopback(self.host):
            return True, ""
        uid = peer_creds.listener_uid(self.host, self.ports[index])
        if uid is None:
            return False, "nothing listens on its port yet"
        if not peer_creds.is_ours(uid):
            raise EngineStartError(
                f"{self.spec.name} {index}: {self.host}:{self.ports[index]} is held by another user "
                f"(uid {uid}), not by the engine; the engine bearer was not sent (start the pool again "
                "for a fresh port)"
            )
        held = peer_creds.held_by_tree(self.host, self.ports[index], self.procs[index].pid)
        if held is None:
            return False, "nothing listens on its port yet"
        if not held:
            raise EngineStartError(
                f"{self.spec.name} {index}: {self.host}:{self.ports[index]} is held by a process that is "
                "not the engine nor one of its children; the engine bearer was not sent (start the pool "
                "again for a fresh port)"
            )
        return True, ""

    def _wait_all(self, indices) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        pending = set(indices)
        last: dict[int, str] = {}
        while pending:
            if self._stopped:  # a replacement that stop() overtook: give up, stop() ends it
                raise EngineStartError(f"{self.spec.name}: the pool stopped while engines were starting")
            for index in sorted(pending):
                code = self.procs[index].poll()
                if code is not None:
                    raise EngineStartError(
                        self._failure(index, f"exited with code {code} before it was healthy")
                    )
                url = f"http://{self.host}:{self.ports[index]}"
                ok, last[index] = self._listener_is_ours(index)
                if ok:  # the engine listens on its port: it holds it now
                    with self._lock:
                        self._release(index)
                    ok, last[index] = ready(url, self.spec, self._key)
                if ok:
                    pending.discard(index)
            if not pending:
                return
            if time.monotonic() > deadline:
                index = min(pending)
                raise EngineStartError(
                    self._failure(
                        index,
                        f"did not answer GET {self.spec.health_path}{' and a 1-token generation' if self.spec.generate else ''} "
                        f"within {self.spec.startup_timeout_s:g} s "
                        f"(last: {last.get(index)})",
                    )
                )
            time.sleep(self.poll_s)

    def _failure(self, index: int, why: str) -> str:
        # The log is written by the pump: let it catch up (to EOF when the engine has exited).
        self.pumps[index].join(PUMP_JOIN_S if self.procs[index].poll() is not None else 0.2)
        redactor = Redactor(self._key or run_key_or_none())
        tail = [redactor.text(line) for line in tail_of(self.log_path(index))]
        return engine_failure(self.spec.name, index, why, tail)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        for proc in self.procs:
            procs.signal_group(proc, signal.SIGTERM)  # only while its leader is still ours
        deadline = time.monotonic() + self.grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                procs.signal_group(proc, signal.SIGKILL)
                proc.wait()
        with self._lock:
            for index in list(self._holds):
                self._release(index)
        survivors = procs.end_run(self.run_id, grace_s=1.0) if self.procs else []
        if survivors:
            print(f"[modal_rl.engines] could not end PIDs {survivors}", file=sys.stderr)
        for thread in self.pumps:  # every writer of their pipes is gone: they reach EOF
            thread.join(PUMP_JOIN_S)
        self.procs = []
        self.pumps = []
        self.addresses = []
        # The engines' temp files (and the logs nobody asked for): leave nothing behind.
        run_temp.remove(self.temp_dir)


def program(name: str, path: str | None, engine: str = "engine") -> str:
    """The absolute path of an engine command's program: a path as given; a bare name from this
    interpreter's own ``bin/`` first (the run's environment, activated or not), then ``path``.
    ``EngineStartError`` (one line: what is missing and what to do) when it is in neither."""
    if os.sep in name:
        return name
    own_bin = Path(sys.executable).parent
    if (own_bin / name).is_file() and os.access(own_bin / name, os.X_OK):
        return str(own_bin / name)
    found = shutil.which(name, path=path)
    if found:
        return found
    raise EngineStartError(
        f"{engine}: its command's program {name!r} is neither in this environment ({own_bin}) nor "
        f"on PATH; install it there or name the program by its path (e.g. {sys.executable} -m ...)"
    )


def open_log(path: Path):
    """``path`` opened for writing, unbuffered, 0600 (also when a file of that name existed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, LOG_FILE_MODE)
    os.fchmod(fd, LOG_FILE_MODE)
    return os.fdopen(fd, "wb", buffering=0)


def pump(stream, redactor: Redactor, write) -> None:
    """Copy the pipe ``stream`` to ``write(bytes)`` as its bytes arrive, every secret of
    ``redactor`` replaced (a key cut between two reads too), until EOF; then close ``stream``.

    It keeps reading after ``write`` failed (a full disk, a closed sink), dropping the output:
    an engine whose pipe nobody drains would block on its next write.
    """
    fd = stream.fileno()
    sink = write
    try:
        while chunk := os.read(fd, 1 << 16):
            sink = _write(sink, redactor.feed(chunk))
        _write(sink, redactor.flush())
    finally:
        stream.close()


def _write(sink, data: bytes):
    if sink is None or not data:
        return sink
    try:
        sink(data)
        return sink
    except (OSError, ValueError) as exc:
        print(f"[modal_rl.engines] engine output dropped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _pump_to_file(stream, redactor: Redactor, log) -> None:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:  # an unbuffered file may take part of it
            view = view[log.write(view) :]

    with log:
        pump(stream, redactor, write)


def _kill_group(proc: subprocess.Popen) -> None:
    """End ``proc``'s group — only while its leader is still the engine we started (a reaped
    engine's pid may be another process's now); its other processes go with ``end_run``."""
    procs.signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


_spawn_requests: queue.Queue = queue.Queue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def spawn(argv: list[str], cpus: tuple[int, ...] = (), **popen_kwargs: Any) -> subprocess.Popen:
    """``Popen`` from one long-lived daemon thread; ``cpus``: the cores the child (and all it
    starts) may run on, else the spawner's own.

    The kernel's parent-death signal fires when the *thread* that forked the child exits, not
    the process. Callers start pools from short-lived threads (``asyncio.to_thread``, executor
    threads torn down by ``asyncio.run``); forking from them would kill the engines early.
    A child inherits the affinity of the thread that forks it, so the spawner narrows its own
    for that one fork: the child never runs a moment outside ``cpus``.
    """
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_loop, name="modal-rl-engine-spawner", daemon=True)
            _spawner.start()
    done: queue.Queue = queue.Queue(maxsize=1)
    _spawn_requests.put((argv, tuple(cpus), popen_kwargs, done))
    ok, value = done.get()
    if not ok:
        raise value
    return value


def _spawn_loop() -> None:
    while True:
        argv, cpus, kwargs, done = _spawn_requests.get()
        try:
            done.put((True, _popen_on(cpus, argv, kwargs)))
        except BaseException as exc:  # handed to the caller's thread
            done.put((False, exc))


def _popen_on(cpus: tuple[int, ...], argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen:
    if not cpus:
        return subprocess.Popen(argv, **kwargs)
    own = os.sched_getaffinity(0)  # this (spawner) thread's
    missing = sorted(set(cpus) - own)
    if missing:
        raise EngineStartError(
            f"engine cpus {list(cpus)}: cores {missing} are not available here (this process may use "
            f"{sorted(own)}); name cores among those"
        )
    os.sched_setaffinity(0, cpus)
    try:
        return subprocess.Popen(argv, **kwargs)
    finally:
        os.sched_setaffinity(0, own)
