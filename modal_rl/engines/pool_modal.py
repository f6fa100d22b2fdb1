"""Modal engine pool: one GPU container per engine, reachable through a TLS tunnel.

The engines are their own ``modal.App`` (``modal-rl-engines``) with one function, scaled
apart from the trainer cluster: ``@app.function(gpu=spec.gpu, image=..., max_containers=
spec.max_containers, timeout=spec.serve_timeout_s)``. ``start`` opens the app, creates an
ephemeral ``modal.Dict`` as the pool's mailbox and spawns the function once per engine.

Each container (``engine_container_main``) starts the server command bound to 0.0.0.0,
waits for its health endpoint locally, opens ``modal.forward(port)`` (a TLS tunnel: Modal
terminates TLS at its edge, the address is ``tunnel.url``, ``https://...``) and writes
``addr/<i>`` to the mailbox; on a failed start it writes ``error/<i>`` with the last log lines
instead. Then it serves until the mailbox holds ``stop``, its server exits, or Modal cancels.

Auth (``spec.auth == "bearer"``): the container never holds the run key. It gets what an
engine needs, derived from it (``run_key.engine_env``: the engine bearer and the frame-read
key), only through a Modal Secret made for the run (``run_key.engine_secret``) attached to the
engine function, so the server finds them as ``MODAL_RL_ENGINE_BEARER`` /
``MODAL_RL_FRAME_READ_KEY``; they are never in the spec, the function's ``env``, the mailbox or
``describe()``. Health checks (in the container and from here) send the bearer.

Logs: the server's output goes to Modal's logs (and the mailbox's error tail) only through
``relay``, which replaces the container's keys and every key derived from them
(``redaction.Redactor``): SGLang logs ``server_args=ServerArgs(..., api_key=..., admin_api_key=...)``
with the bearer.

``start`` waits until every engine has an address that answers health from here too, within
``startup_timeout_s``; the first error, an early-finished call or the deadline stops every
engine (mailbox ``stop``, then ``FunctionCall.cancel``) and raises ``EngineStartError``.
Closing the app is the backstop: Modal stops the app's containers when ``app.run()`` exits.

Replacement (``replace(i)``, asked for by ``supervisor``): the old engine's call is
cancelled with its containers, and the function is spawned again for slot ``i`` with the next
*generation*; that container writes ``addr/<i>.<generation>`` (generation 0 keeps the plain
``addr/<i>``), so an address left in the mailbox by the dead engine is never taken for the new
one. The same spec, image, Secret and tunnel apply; the wait is the start's (health through
the tunnel, ``startup_timeout_s``).

Nothing contacts Modal before ``start``; ``build_function`` works offline for spec tests.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from modal_rl.adapters import shipped_packages
from modal_rl.cluster.backend_modal import ImageStep
from modal_rl.cluster.redaction import Redactor, held_secrets
from modal_rl.engines.health import probe, ready
from modal_rl.engines.pool import (
    EnginePool,
    EngineSpec,
    EngineStartError,
    engine_failure,
    engine_key,
)
from modal_rl.engines.pool_local import pump
from modal_rl.modal_calls import define_function, inspect_function, secret_from_name
from modal_rl.retry import wait_for
from modal_rl.run_key import ENGINE_BEARER_ENV, REDACTED, engine_secret
from modal_rl.text_safety import clean

APP_NAME = "modal-rl-engines"
CONTAINER_POLL_S = 1.0
HEALTHY = "healthy"  # the container's server answered its health check
RELAY_JOIN_S = 5.0
TAIL_LINE_CHARS = 4096
# Engines bind every interface of their container; the tunnel reaches them from outside it.
CONTAINER_HOST = "0.0.0.0"
TUNNEL = "TLS tunnel (modal.forward, https:// address)"


def function_kwargs(spec: EngineSpec) -> dict[str, Any]:
    """Plain settings of the engine function, derived from the spec only."""
    kwargs: dict[str, Any] = {
        "gpu": spec.gpu,
        "timeout": int(spec.serve_timeout_s),
        "startup_timeout": int(spec.startup_timeout_s),
        "max_containers": spec.max_containers,
    }
    if spec.min_containers is not None:
        kwargs["min_containers"] = spec.min_containers
    return kwargs


def build_image(spec: EngineSpec, extra_steps: Sequence[ImageStep] = ()):
    """The engine's registry image, its ``pip`` packages, then ``extra_steps`` (each
    ``image -> image``, in order), then this project's sources (mounted last: Modal runs no
    build step on top of a mount layer)."""
    import modal

    if not spec.image:
        raise ValueError("a Modal engine pool needs an image with the inference server (spec.image)")
    # Server images (vllm/vllm-openai, sglang) set ENTRYPOINT to the server; Modal runs its own.
    image = modal.Image.from_registry(spec.image).entrypoint([])
    if spec.pip:
        image = image.pip_install(*spec.pip)
    for step in extra_steps:
        image = step(image)
    return image.add_local_python_source(*shipped_packages())


def build_function(
    spec: EngineSpec, app_name: str = APP_NAME, key: str | None = None, image_steps: Sequence[ImageStep] = ()
):
    """(app, function) defined offline. ``key``: the run key, attached as the run's Modal
    Secret when ``spec.auth`` is set (required then; dry runs pass a placeholder);
    ``image_steps``: :func:`build_image`'s ``extra_steps``."""
    import modal

    if spec.auth is not None and not key:
        raise ValueError(
            f"{spec.name}: its server needs the run key (auth='bearer'); build_function got none"
        )
    app = modal.App(app_name)
    secrets = [secret_from_name(s) for s in spec.secrets]
    if spec.auth is not None:
        # the bearer (+ the frame-read key if it pulls frames), never the run key
        secrets.append(engine_secret(key, spec.pulls_frames))
    fn = define_function(
        app,
        engine_container_main,
        image=build_image(spec, image_steps),
        volumes=spec.volumes,
        secrets=secrets,
        env=spec.env,
        **function_kwargs(spec),
    )
    return app, fn


def slot(index: int, generation: int = 0) -> str:
    """The mailbox suffix of engine ``index``'s ``generation``-th container."""
    return f"{index}.{generation}" if generation else str(index)


def engine_container_main(spec_json: dict, index: int, mailbox, generation: int = 0) -> dict:
    """Body of one engine container; see the module docstring for the mailbox protocol."""
    import modal

    spec = EngineSpec.from_dict(spec_json)
    name = slot(index, generation)
    tail: deque[str] = deque(maxlen=30)
    held = held_secrets()  # (bearer, frame-read key): what this container holds of the run's key
    bearer = os.environ.get(ENGINE_BEARER_ENV) or None
    if spec.auth is not None and bearer is None:
        why = f"no engine key in the container ({ENGINE_BEARER_ENV}): the run's Modal Secret is not attached"
        mailbox[f"error/{name}"] = {"why": why, "tail": []}
        return {"index": index, "exit": why}
    proc = subprocess.Popen(
        spec.argv(CONTAINER_HOST, spec.port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    relaying = threading.Thread(target=relay, args=(proc.stdout, Redactor(None, held), tail), daemon=True)
    relaying.start()

    def last_lines() -> list[str]:
        if proc.poll() is not None:
            relaying.join(RELAY_JOIN_S)  # the server is gone: its last lines are on their way
        return _redacted(tail, held)

    local = f"http://127.0.0.1:{spec.port}{spec.health_path}"

    def settled() -> str | None:
        if probe(local, bearer=bearer)[0]:
            return HEALTHY
        return f"exited with code {proc.returncode}" if proc.poll() is not None else None

    try:
        why = wait_for(settled, spec.startup_timeout_s, CONTAINER_POLL_S) or "health timeout"
        if why != HEALTHY:
            mailbox[f"error/{name}"] = {"why": why, "tail": last_lines()}
            return {"index": index, "exit": why}
        # TLS (unencrypted=False): the key and the traffic cross the internet encrypted.
        with modal.forward(spec.port) as tunnel:
            mailbox[f"addr/{name}"] = tunnel.url
            while proc.poll() is None and not (
                mailbox.get("stop", False) or mailbox.get(f"stop/{name}", False)
            ):
                time.sleep(CONTAINER_POLL_S)
        if proc.poll() is not None:
            why = f"exited with code {proc.returncode}"
            mailbox[f"error/{name}"] = {"why": why, "tail": last_lines()}
        return {"index": index, "exit": proc.poll()}
    finally:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            proc.kill()


def _redacted(tail: deque, held: tuple[str, ...]) -> list[str]:
    redactor = Redactor(None, held)  # the lines are redacted already: a second pass costs nothing
    return [redactor.text(line) for line in tail]


def relay(stream, redactor: Redactor, tail: deque) -> None:
    """The engine's output (the pipe ``stream``) to this container's stdout, which Modal's logs
    keep, as it arrives and with every secret of ``redactor`` replaced; its last lines to
    ``tail``. Ends at EOF."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character cut by a read
    partial = [""]

    def write(data: bytes) -> None:
        text = clean(decoder.decode(data), multiline=True)  # the engine's bytes, shown in a terminal
        print(text, end="", flush=True)
        *done, rest = (partial[0] + text).split("\n")
        tail.extend(done)
        partial[0] = rest[-TAIL_LINE_CHARS:]  # a progress bar redrawn with \r never ends its line

    pump(stream, redactor, write)
    rest = partial[0] + decoder.decode(b"", final=True)
    rest = clean(rest, multiline=True)
    if rest:
        print(rest, flush=True)
        tail.append(rest)


class ModalEnginePool(EnginePool):
    backend = "modal"

    def __init__(
        self,
        spec: EngineSpec,
        app_name: str = APP_NAME,
        poll_s: float = 2.0,
        grace_s: float = 20.0,
        image_steps: Sequence[ImageStep] = (),
    ):
        super().__init__(spec)
        self.app_name = app_name
        self.image_steps = tuple(image_steps)  # build_image's extra_steps
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.calls: list = []
        self.generations: list[int] = []
        self._fn = None
        self._stack: contextlib.ExitStack | None = None
        self._mailbox = None

    def describe(self) -> dict[str, Any]:
        # A dry run needs no key: a placeholder stands in for the run's secret (never deployed).
        _, fn = build_function(self.spec, self.app_name, key=REDACTED, image_steps=self.image_steps)
        auth = (
            f"{TUNNEL}, bearer key required (Authorization: Bearer <engine bearer>; the bearer reaches "
            f"each engine as {ENGINE_BEARER_ENV} through a Modal Secret made for the run, never the run key)"
            if self.spec.auth
            else f"{TUNNEL}, no key (keyless server, explicitly asked for)"
        )
        return {
            "backend": self.backend,
            "app": self.app_name,
            "spec": self.spec.to_dict(),
            "modal_function": {**function_kwargs(self.spec), "inspected": inspect_function(fn)},
            "commands": [self.spec.argv(CONTAINER_HOST, self.spec.port) for _ in range(self.spec.count)],
            "reachable_as": "https://<modal tunnel host> per engine (modal.forward, TLS)",
            "auth": auth,
        }

    def start(self) -> list[str]:
        import modal

        self._key = engine_key(self.spec)
        app, fn = build_function(self.spec, self.app_name, key=self._key, image_steps=self.image_steps)
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(app.run())
            self._mailbox = self._stack.enter_context(modal.Dict.ephemeral())
            spec_json = self.spec.to_dict()
            self._fn = fn
            self.generations = [0] * self.spec.count
            self.calls = [fn.spawn(spec_json, i, self._mailbox) for i in range(self.spec.count)]
            self.addresses = self._wait_all()
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def alive(self, index: int) -> bool | None:
        """False once the engine's call has finished (crash, OOM, preemption, cancel)."""
        try:
            self.calls[index].get(timeout=0)
        except TimeoutError:
            return True
        except Exception:
            return False
        return False

    def replace(self, index: int) -> str:
        if self._fn is None or self._mailbox is None or index >= len(self.calls):
            raise EngineStartError(f"{self.spec.name} {index}: the pool is not running; nothing to replace")
        old = slot(index, self.generations[index])
        with contextlib.suppress(Exception):
            self._mailbox[f"stop/{old}"] = True
        with contextlib.suppress(Exception):
            self.calls[index].cancel(terminate_containers=True)
        self.generations[index] += 1
        self.calls[index] = self._fn.spawn(self.spec.to_dict(), index, self._mailbox, self.generations[index])
        (address,) = self._wait_all([index])
        self.addresses[index] = address
        return address

    def _wait_all(self, indices=None) -> list[str]:
        indices = list(range(self.spec.count) if indices is None else indices)
        deadline = time.monotonic() + self.spec.startup_timeout_s
        found: dict[int, str] = {}
        while len(found) < len(indices):
            for index in indices:
                if index in found:
                    continue
                name = slot(index, self.generations[index] if index < len(self.generations) else 0)
                error = self._mailbox.get(f"error/{name}")
                if error is not None:
                    raise EngineStartError(engine_failure(self.spec.name, index, error["why"], error["tail"]))
                self._check_call(index)
                address = self._mailbox.get(f"addr/{name}")
                health = ready(address, self.spec, self._key, timeout_s=5.0) if address else None
                if health is not None and health[0]:
                    found[index] = address
            if len(found) == len(indices):
                break
            if time.monotonic() > deadline:
                missing = [i for i in indices if i not in found]
                raise EngineStartError(
                    engine_failure(
                        self.spec.name,
                        missing[0],
                        f"(and {len(missing) - 1} more) not reachable within {self.spec.startup_timeout_s:g} s",
                        ["see the app's logs: modal app logs " + self.app_name],
                    )
                )
            time.sleep(self.poll_s)
        return [found[i] for i in indices]

    def _check_call(self, index: int) -> None:
        """An engine's call that already finished (crash, OOM, cancel) fails the start."""
        try:
            result = self.calls[index].get(timeout=0)
        except TimeoutError:
            return
        except Exception as exc:
            raise EngineStartError(
                engine_failure(self.spec.name, index, f"container failed: {exc!r}", [])
            ) from exc
        raise EngineStartError(engine_failure(self.spec.name, index, f"container ended early: {result}", []))

    def stop(self) -> None:
        if self._mailbox is not None:
            with contextlib.suppress(Exception):
                self._mailbox["stop"] = True
        deadline = time.monotonic() + self.grace_s
        for call in self.calls:
            with contextlib.suppress(Exception):
                call.get(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(Exception):
                call.cancel(terminate_containers=True)
        self.calls = []
        self._mailbox = None
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()
        self.addresses = []
