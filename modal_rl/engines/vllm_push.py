"""Push weight versions into a remote vLLM server that runs ``vllm_extension``.

``EnginePusher`` holds a frame server and a ``Publisher`` (so each version after the first
anchor goes out as a lossless delta), and for every version asks the engine over HTTP
(``POST /collective_rpc``) to pull it from that server and make it live: by default staged
while the engine serves and written in place in a short pause (``vllm_inplace``; see
``load_version``), with ``inplace=False`` by a full reload. The engine dials the
pusher, so the pusher's address must be reachable from the engine: ``127.0.0.1`` when both
run on one machine; inside a Modal container, ``expose="modal"`` publishes the frame
server's port through a ``modal.forward`` tunnel, because an engine container of another
app cannot reach the cluster's private addresses. That tunnel is public, so it is TLS
(``modal.forward(port)``, ``unencrypted=False``): the engine dials ``tunnel.tls_socket`` with
TLS and checks the tunnel's certificate; Modal's edge forwards plain TCP to the port.

Everything is keyed by the run's key (default: ``MODAL_RL_RUN_KEY``): every HTTP call
carries ``Authorization: Bearer <run key>`` (the engine's guard checks it), the pull request
is signed (the engine refuses others), the frame server admits only a receiver that proves
the key (and proves it back), and every record carries a MAC.

Invariants:
- ``push`` returns only after every engine worker reported the version loaded and the
  engine's prefix cache was reset (cached prefixes hold attention keys/values computed with
  the old weights; running requests are preempted and recomputed, as vLLM's
  ``reset_running_requests`` does) -- except that an in-place push with ``running="keep"``
  keeps running requests' keys/values and resets nothing (the engine runs without a prefix
  cache), and one with ``running="abort"`` aborts them and lets vLLM's pause clear the cache; on any error it raises, and an engine that did not load
  the version keeps the weights it had (it loads only verified versions);
- the frame server retains the last anchor and the deltas after it, so an engine that
  missed a version (a failed push, a restart) catches up on the next push: it asks the
  server for the frames after the version it holds;
- ``close`` ends the frame server and the tunnel; it is idempotent.

Engines that come and go (``modal_rl.engines.supervisor``): ``publish`` only publishes
and returns the ``WeightSource`` (this server's reachable address and the version);
``load_version(url, source)`` has one engine pull that version -- a new engine pulls the
retained anchor and the deltas after it, one that holds an older version only the deltas -- and
is what the supervisor runs before a replacement takes traffic. ``push`` = both, for one engine.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

from modal_rl.asyncrl.kv_policy import check_running
from modal_rl.cluster.netif import ingress_ipv4
from modal_rl.engines.auth import KEYED_OPENER, bearer_header, key_safe_url
from modal_rl.run_key import redact, run_key
from modal_rl.text_safety import clean
from modal_rl.weightsync.apply.vllm_extension import (
    METHOD,
    STAGE_METHOD,
    pull_request,
    pull_results,
)
from modal_rl.weightsync.codec.encode import CodecConfig
from modal_rl.weightsync.publisher import Publisher
from modal_rl.weightsync.source import WeightSource
from modal_rl.weightsync.transport.tcp import FrameServer
from modal_rl.weightsync.wire.auth import FROM_ENV, frame_keys

EXPOSE = ("local", "modal")
# Where the frame server listens behind a modal.forward tunnel: the container's IPv4 address on
# its default route (``netif.ingress_ipv4``), the eth0 address through which Modal's ingress
# reaches a container's port (not loopback). Not 0.0.0.0, which would listen on every
# interface: only that one, IPv4 only, so not on the workspace's IPv6 network (i6pn) nor any
# other interface; any peer that reaches it meets the keyed handshake before a frame byte.


class EnginePushError(RuntimeError):
    """A version did not reach the engine; the engine keeps the weights it had."""


@dataclass(frozen=True)
class LoadSettings:
    """How an engine loads each version (``load_version``): ``pull_timeout_s`` bounds its pull,
    ``inplace`` stages while serving and switches in a short pause (else a full reload),
    ``hold_requests`` brackets the switch with vLLM's pause/resume; ``running`` is what a commit
    does to requests still generating (``asyncrl.kv_policy``: keep, recompute or abort)."""

    pull_timeout_s: float = 600.0
    inplace: bool = True
    hold_requests: bool = False
    running: str = "recompute"

    def __post_init__(self) -> None:
        check_running(self.running)
        if isinstance(self.pull_timeout_s, bool) or not isinstance(self.pull_timeout_s, int | float):
            raise ValueError(f"pull_timeout_s={self.pull_timeout_s!r}: give a number of seconds > 0")
        if not self.pull_timeout_s > 0:
            raise ValueError(f"pull_timeout_s={self.pull_timeout_s!r}: give a number of seconds > 0")
        for name in ("inplace", "hold_requests"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: give True or False")

    def with_settings(self, **settings: Any) -> LoadSettings:
        """These settings with ``settings`` applied; an unknown name is one line listing the known."""
        unknown = sorted(set(settings) - {f.name for f in fields(self)})
        if unknown:
            known = ", ".join(f.name for f in fields(self))
            raise TypeError(
                f"unknown EnginePusher setting(s) {', '.join(unknown)}; the settings are: {known}"
            )
        return replace(self, **settings)


class EnginePusher:
    """See the module docstring. ``load``: ``LoadSettings``; its fields may also be given as
    keywords (``EnginePusher(url, inplace=False)``), applied over ``load``."""

    def __init__(
        self,
        engine_url: str | None,
        *,
        key=FROM_ENV,
        expose: str = "local",
        bind_host: str = "127.0.0.1",
        anchor_every: int = 16,
        config: CodecConfig | None = None,
        load: LoadSettings | None = None,
        **settings: Any,
    ) -> None:
        load = (load or LoadSettings()).with_settings(**settings)
        if expose not in EXPOSE:
            raise ValueError(f"expose={expose!r}: choose one of {EXPOSE}")
        if key is FROM_ENV:
            key = run_key()
        if key is None or frame_keys(key) is None:
            raise ValueError(
                "EnginePusher needs the run key: engines accept only signed pulls and keyed frames"
            )
        self._bearer = key
        self.keys = frame_keys(key)
        self.engine_url = engine_url.rstrip("/") if engine_url else None  # None: publish/load only
        self.settings = load
        self.pull_timeout_s, self.inplace, self.hold_requests = (
            load.pull_timeout_s,
            load.inplace,
            load.hold_requests,
        )
        self.running = load.running
        self._stack = contextlib.ExitStack()
        self._server = FrameServer(ingress_ipv4() if expose == "modal" else bind_host, 0, key=self.keys)
        self._stack.callback(self._server.close)
        self.publisher = Publisher(self._server, anchor_every=anchor_every, config=config)
        port = int(self._server.address[1])
        if expose == "modal":
            import modal

            # TLS tunnel (contract: no weights on an unencrypted public tunnel).
            tunnel = self._stack.enter_context(modal.forward(port))
            self.address = tuple(tunnel.tls_socket)
            self.tls = True
        else:
            self.address = (bind_host, port)
            self.tls = False

    def publish(self, tensors: dict[str, Any] | Iterable[tuple[str, Any]]) -> tuple[Any, dict[str, float]]:
        """Publish the next version on this pusher's frame server (no engine is asked);
        returns ``(WeightSource, numbers)``."""
        t0 = time.perf_counter()
        report = self.publisher.publish(tensors)
        numbers = {
            "version": float(report.version),
            "anchor": 1.0 if report.kind == "anchor" else 0.0,
            "payload_mbytes": report.bytes / (1 << 20),
            "raw_mbytes": report.raw_bytes / (1 << 20),
            "compression_ratio": report.raw_bytes / max(report.bytes, 1),
            "encode_s": time.perf_counter() - t0,
        }
        where = (str(self.address[0]), int(self.address[1]))
        return WeightSource(*where, report.version, self.tls, self.publisher.epoch), numbers

    def forward(
        self, frames: list[list[tuple[bytes, bytes]]], raw_bytes: int = 0
    ) -> tuple[Any, dict[str, float]]:
        """Re-serve frames that were verified upstream, record for record (a relay): signed
        records keep their MACs, so engines verify them with the run key as they would the
        trainer's, and nothing is decoded or encoded again. The server takes the frames'
        epoch (``open_epoch``); a pusher forwards or publishes, not both. Returns
        ``(WeightSource, numbers)`` for the last frame's version (``raw_bytes``: the state's
        size, for the numbers)."""
        from modal_rl.engines.state import WeightSource
        from modal_rl.weightsync.wire.frames import VersionHeader, record_body

        if not frames:
            raise ValueError("forward() needs at least one frame")
        t0, size = time.perf_counter(), 0
        for records in frames:
            header = VersionHeader.from_body(record_body(records[0][1]))
            if (self._server.run, self._server.epoch) != (header.run, header.epoch):
                self._server.open_epoch(header.run, header.epoch)
            for tag, raw in records:
                self._server.forward(tag, raw)
                size += len(raw)
        numbers = {
            "version": float(header.version),
            "anchor": 1.0 if header.kind == "anchor" else 0.0,
            "payload_mbytes": size / (1 << 20),
            "raw_mbytes": raw_bytes / (1 << 20),
            "compression_ratio": raw_bytes / max(size, 1),
            "encode_s": time.perf_counter() - t0,  # forwarding: no encode, the records' copy
            "forwarded_frames": float(len(frames)),
        }
        where = (str(self.address[0]), int(self.address[1]))
        return WeightSource(*where, header.version, self.tls, header.epoch), numbers

    def push(self, tensors: dict[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, float]:
        """Publish the next version and have the engine load it; returns the numbers."""
        if not self.engine_url:
            raise ValueError(
                "EnginePusher(None) has no engine to push to; use publish() and load(url, source)"
            )
        source, numbers = self.publish(tensors)
        return {**numbers, **self.load(self.engine_url, source)}

    def load(self, engine_url: str, source) -> dict[str, float]:
        """``load_version`` with this pusher's key and bound."""
        return load_version(
            engine_url,
            source,
            key=self._bearer,
            pull_timeout_s=self.pull_timeout_s,
            inplace=self.inplace,
            hold_requests=self.hold_requests,
            running=self.running,
        )

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> EnginePusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_version(
    engine_url: str,
    source,
    *,
    key=FROM_ENV,
    pull_timeout_s: float = 600.0,
    inplace: bool = True,
    hold_requests: bool = False,
    running: str = "recompute",
) -> dict[str, float]:
    """Have the vLLM engine at ``engine_url`` pull and load ``source.version`` from the frame
    server ``source`` names (a signed pull), then reset its prefix cache; the numbers, or
    ``EnginePushError`` (the engine then keeps the weights it had).

    ``inplace``: the engine stages the version while it serves and the pause is only the
    switch (``vllm_inplace``): the scatter, then the prefix-cache reset. An engine's first
    in-place push is a full load that also learns its map. ``pause_s`` is how long the engine
    did not serve: vLLM runs each ``collective_rpc`` between scheduler steps, so the sum over
    this push's calls of the time the slowest worker spent in each (for a full load the whole
    pull: fetch, decode, load; in place: the staging call, the status polls and the switch).
    ``pause_wall_s`` is the pusher's wall time of the pausing calls (the switch and the reset,
    or the pull and the reset), HTTP included, an upper bound. As in a full load, one scheduler step may run between the two
    calls, on the new weights with keys/values cached before (the reset then recomputes
    running requests); ``hold_requests`` closes that gap with vLLM's ``/pause?mode=keep`` ...
    ``/resume`` around both, for the cost of vLLM's pause (it sleeps 20 ms)."""
    if key is FROM_ENV:
        key = run_key()
    keys = frame_keys(key)
    engine_url = engine_url.rstrip("/")
    method = STAGE_METHOD if inplace else METHOD
    body = pull_request(
        source.host,
        source.port,
        source.version,
        timeout_s=pull_timeout_s,
        key=keys,
        tls=source.tls,
        method=method,
        epoch=getattr(source, "epoch", None),
    )
    t1 = time.perf_counter()
    results = _rpc(engine_url, body, source.version, key)
    blocked = [_blocked_s(results)]
    if inplace and all(r.get("mode") == "staging" for r in results):
        # The worker bounds the pull by ``pull_timeout_s`` and reports why it failed; this
        # bound (as vLLM's own for a full pull) only catches a worker that never answers.
        blocked += _wait_staged(engine_url, source.version, key, t1 + float(body["timeout"]))
        t_pause = time.perf_counter()
        pause = "abort" if running == "abort" else "keep" if hold_requests else None
        if pause:
            _post(engine_url, f"/pause?mode={pause}", {}, 60.0, key)
        try:
            switch = {"method": "modal_rl_switch_weights", "args": [source.version], "timeout": 300.0}
            results = _rpc(engine_url, switch, source.version, key)
            blocked.append(_blocked_s(results))
            if running == "recompute":
                _reset_prefix_cache(engine_url, source.version, key)
        finally:
            if pause:
                _post(engine_url, "/resume", {}, 60.0, key)
        pause_wall_s = time.perf_counter() - t_pause
    else:
        _reset_prefix_cache(engine_url, source.version, key)
        pause_wall_s = time.perf_counter() - t1
    numbers = {
        "engine_s": time.perf_counter() - t1,
        "pause_s": sum(blocked),
        "pause_wall_s": pause_wall_s,
        "engine_load_s": max(float(r.get("load_s", 0.0)) for r in results),
        "engine_fetch_s": max(float(r.get("fetch_s", 0.0)) for r in results),
        "engine_frames": float(max(int(r.get("frames", 0)) for r in results)),
        "engine_workers": float(len(results)),
        "inplace": 1.0 if all(r.get("mode") == "inplace" for r in results) else 0.0,
    }
    for k in ("fallback_params", "changed_words", "map_s", "diff_s", "switched_requests"):
        if any(k in r for r in results):
            numbers[k] = float(max(float(r.get(k, 0.0)) for r in results))
    return numbers


def _rpc(engine_url: str, body: dict, version: int, key: str) -> list[dict]:
    answer = _post(engine_url, "/collective_rpc", body, float(body.get("timeout", 300.0)) + 30.0, key)
    try:
        return pull_results(answer, version)
    except RuntimeError as exc:
        raise EnginePushError(f"{engine_url}: {exc}") from exc


def _blocked_s(results: list[dict]) -> float:
    """How long one ``collective_rpc`` held the engine's loop: its slowest worker's time in
    the call (vLLM runs it between scheduler steps, all workers together)."""
    return max(float(r.get("rpc_s", 0.0)) for r in results)


def _wait_staged(engine_url: str, version: int, key: str, deadline: float) -> list[float]:
    """Poll every worker's staging of ``version`` (each poll is one short ``collective_rpc``);
    returns each poll's blocked time."""
    blocked: list[float] = []
    poll_staging(engine_url, "modal_rl_stage_status", version, key, deadline, blocked, "version")
    return blocked


def poll_staging(
    engine_url: str, method: str, version: int, key, deadline: float, blocked: list[float], what: str
) -> list[dict]:
    """Ask every worker ``method(version)`` (one short ``collective_rpc`` each time, backing off
    from 2 ms to 50 ms) until all answer ``ready``; each poll's blocked time goes into
    ``blocked``. A ``failed`` worker or the ``deadline`` (``time.perf_counter``) raises
    ``EnginePushError`` naming ``what``. Returns the ready answers."""
    delay = 0.002
    while True:
        body = {"method": method, "args": [version], "timeout": 60.0}
        states = _rpc(engine_url, body, version, key)
        blocked.append(_blocked_s(states))
        failed = [s["error"] for s in states if s.get("state") == "failed"]
        if failed:
            raise EnginePushError(f"{engine_url}: {what} {version} failed to stage: {failed[0]}")
        if all(s.get("state") == "ready" for s in states):
            return states
        if time.perf_counter() > deadline:
            raise EnginePushError(f"{engine_url}: {what} {version} was not staged in time")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _reset_prefix_cache(engine_url: str, version: int, key: str, tries: int = 5) -> None:
    for attempt in range(tries):
        answer = _post(engine_url, "/reset_prefix_cache?reset_running_requests=true", {}, 60.0, key)
        if isinstance(answer, dict) and answer.get("success"):
            return
        time.sleep(0.2 * (attempt + 1))  # vLLM: blocks still held (e.g. in-flight KV transfers)
    raise EnginePushError(
        f"{engine_url}: version {version} is loaded but the prefix cache could not be reset "
        f"after {tries} tries; cached prefixes still hold keys/values of the old weights"
    )


def _post(engine_url: str, path: str, body: dict, timeout: float, key: str) -> Any:
    if not key_safe_url(engine_url):
        raise EnginePushError(f"{engine_url}: the engine bearer goes only over https or to loopback")
    request = urllib.request.Request(
        engine_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **bearer_header(key)},
        method="POST",
    )
    try:
        with KEYED_OPENER.open(request, timeout=timeout) as resp:  # no proxy, no redirect
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:
        detail = clean(redact(exc.read().decode(errors="replace")[-500:], key))
        raise EnginePushError(f"{engine_url}{path} answered HTTP {exc.code}: {detail}") from exc
    except OSError as exc:
        raise EnginePushError(f"{engine_url}{path}: {exc}") from exc
    if text.lstrip().startswith(("{", "[")):
        return json.loads(text)
    return text or None  # plain-text answers (vLLM's /v1/load_lora_adapter: "Success: ...")
