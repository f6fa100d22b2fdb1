"""``VLLMHttpProxy``: a ``modal_vllm`` replica's server handle (a Ray actor) and engine keeper.

verl's agent loop calls ``generate`` on it (token ids in, ``TokenOutput`` out, over vLLM's
``/v1/completions``); the replica's control calls map to vLLM's HTTP endpoints (see
``replica``). The actor also owns the replica's engine: ``start`` brings up an
``EnginePool`` under an ``EngineSupervisor`` *in this actor*, so the process that routes
requests is the one that knows which engine serves which weight version.

Failures (``modal_rl.engines.supervisor``): a dead or hung engine is replaced with the
same spec; the replacement pulls the replica's current version from the relay worker's frame
server (``load_weights`` tells this actor where that is) before it takes a request. A request
whose engine is lost is sent again, to an engine holding the same version; if that cannot
happen within ``retry_wait_s`` (or the version moved on meanwhile), ``generate`` returns a
*masked* sample instead of raising (an exception would fail verl's whole batch):
``token_ids=[]`` (so verl's ``response_mask`` is all zeros and the sample adds nothing to the
policy loss), ``stop_reason="aborted"`` (verl's partial-rollout client resubmits those), and
``extra_fields[MASKED] = why``. Every sample carries ``extra_fields[WEIGHT_VERSION]``: the relay
version of the engine that answered (None before the first sync, and on masked samples), and
``global_steps`` is that version's step.

Versions per token (``modal_rl.asyncrl``): when the engine keeps a version ledger, each
sample's record is read from it after the response (``LedgerReader``, one reader per engine),
and with it the engine's idle seconds so far (``extra_fields[IDLE]``, keyed by replica and
the ledger's identity, so a replacement engine's counter is a new key):
``extra_fields[VERSIONS]`` is ``{versions, switch_at, tokens}`` in verl's steps (the engine's
own record, in relay versions, is ``extra_fields[RELAY_VERSIONS]``), and
``min_global_steps`` / ``max_global_steps`` are the steps of its first and last version (verl's
base client keeps them; ``verl_modal.async_versions`` keeps them across a partial-rollout
client's resubmissions). ``running`` decides what verl's pause around a weight sync does:
``abort`` (verl's own: requests are aborted and resubmitted by its partial-rollout client) or
``recompute`` (the pause is skipped, the in-place commit lands between two decoding steps and
running requests are recomputed on the new weights; the engine pauses for the scatter only).

Observability for benchmarks and chaos tests: ``engine_pids``, ``engine_events``,
``engine_timings``, ``engine_snapshot``, ``request_stats``; the actor is named
``modal_vllm_server_<replica rank><suffix>`` (``ray.get_actor``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from verl.workers.rollout.replica import TokenOutput

from modal_rl.asyncrl.ledger_reader import LedgerReader
from modal_rl.engines import (
    EngineLost,
    EngineSpec,
    EngineSupervisor,
    WeightSource,
    bearer_header,
    check_key_safe_url,
    get_engine,
    get_engine_pool,
)
from modal_rl.run_key import run_key

log = logging.getLogger("verl_modal")

MASKED = "modal_rl_masked"
WEIGHT_VERSION = "modal_rl_weight_version"
VERSIONS = "modal_rl_versions"  # {versions, switch_at, tokens} in verl's global steps
RELAY_VERSIONS = "modal_rl_relay_versions"  # the engine's record, in relay versions
IDLE = "modal_rl_engine_idle"  # {engine: its ledger's idle seconds when this answer was read}
RUNNING = ("abort", "recompute")
# Idle pooled connections are dropped before vLLM's server closes them (its keep-alive is 5 s),
# so a request rarely goes out on a connection the engine already closed.
KEEPALIVE_S = 3.0
READ_ATTEMPTS = 3  # ledger reads sent again after a connection error


def step_record(steps: list, switch_at, n_tokens: int) -> dict:
    """A ledger record with each version replaced by its verl step (two versions of one step,
    such as the start-up anchor and a first sync, merge into one)."""
    versions, switches = [steps[0]], []
    for step, at in zip(steps[1:], switch_at, strict=True):
        if step != versions[-1]:
            versions.append(step)
            switches.append(int(at))
    return {"versions": versions, "switch_at": switches, "tokens": int(n_tokens)}


class VLLMHttpProxy:
    """See the module docstring. ``health``: ``EngineSupervisor`` settings (interval_s,
    probe_timeout_s, failures, max_replacements); ``retry_wait_s``: how long a request waits for
    an engine of its version before it is masked."""

    def __init__(
        self,
        spec: dict,
        backend: str,
        served_name: str,
        rollout: dict,
        replica_rank: int = 0,
        pool_kwargs: dict | None = None,
        health: dict | None = None,
        retry_wait_s: float = 1800.0,
        weights_timeout_s: float = 600.0,
        lora: dict | None = None,
        running: str = "abort",
    ):
        if running not in RUNNING:
            raise ValueError(f"modal_vllm: running={running!r}; choose one of {', '.join(RUNNING)}")
        self.running = running
        self._readers: dict[str, LedgerReader] = {}  # engine url -> its ledger reader
        self.version_stats = {"stamped": 0, "unstamped": 0, "switched": 0}
        self.spec = EngineSpec.from_dict(spec)
        self.backend = backend
        self.pool_kwargs = dict(pool_kwargs or {})
        self.health = dict(health or {})
        self.retry_wait_s = retry_wait_s
        self.weights_timeout_s = weights_timeout_s
        self._key = run_key()
        self._headers = bearer_header(self._key)
        self.served_name = served_name
        self.rollout = rollout  # max_model_len, prompt/response length, free_cache_engine, ...
        self.replica_rank = replica_rank
        self.global_steps = None
        self.steps_of_version: dict[int | None, Any] = {}
        self.stats = {"requests": 0, "retried": 0, "masked": 0, "version_changed": 0}
        self.supervisor: EngineSupervisor | None = None
        self._session = None
        # LoRA runs: {"prefix", "max_resident", "config"}; each engine's resident adapter versions
        self.lora = dict(lora) if lora else None

    # -- the engine ---------------------------------------------------------------------------

    async def start(self) -> dict:
        """Start the engine (and keep it serving); returns ``{"address", "log_dir"}``."""
        settings = {"key": self._key, "pull_timeout_s": self.weights_timeout_s}
        if self.lora is None:
            engine = get_engine("vllm", **settings)
        else:
            engine = get_engine("vllm-lora", lora=self.lora, **settings)
        pool = get_engine_pool(self.spec, self.backend, **self.pool_kwargs)
        self.supervisor = EngineSupervisor(pool, engine, **self.health)
        (address,) = await asyncio.to_thread(self.supervisor.start)
        check_key_safe_url(address)  # the key goes only over TLS or to loopback
        kept = str(pool.log_dir) if getattr(pool, "keeps_logs", False) else None
        # Local engines' run id: the replica ends them by it if this actor is killed before close()
        # (a parent-death signal reaches the server process, not the engine cores it forked).
        return {"address": address, "log_dir": kept, "run_id": getattr(pool, "run_id", None)}

    def model_for(self, version: int | None) -> str:
        """What ``/v1/completions`` names for an engine at ``version``: in a LoRA run that
        version's adapter (so a request samples from the policy its engine holds), else the
        served model."""
        if self.lora is None or version is None:
            return self.served_name
        return f"{self.lora['prefix']}-v{int(version)}"

    async def load_weights(self, source: dict, global_steps: int | None = None) -> dict:
        """Make ``source`` (a ``WeightSource`` as a dict) the replica's version: every serving
        engine loads it now, a replacement before it serves. Returns the first load's numbers."""
        ws = WeightSource(**source)
        self.steps_of_version[ws.version] = global_steps
        results = await asyncio.to_thread(self.supervisor.set_source, ws)
        if global_steps is not None:
            self.global_steps = global_steps
        return results[0] if results else {"engine_s": 0.0, "engine_load_s": 0.0, "engine_workers": 0.0}

    async def engine_pids(self) -> list[int | None]:
        return self.supervisor.pids() if self.supervisor else []

    async def engine_events(self) -> list[dict]:
        return list(self.supervisor.events) if self.supervisor else []

    async def engine_timings(self) -> dict:
        return self.supervisor.timings() if self.supervisor else {}

    async def engine_snapshot(self) -> list[dict]:
        return self.supervisor.snapshot() if self.supervisor else []

    async def request_stats(self) -> dict:
        return dict(self.stats)

    # -- HTTP ---------------------------------------------------------------------------------

    async def _post_to(self, base_url: str, path: str, payload: dict | None = None, params=None) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                headers=self._headers,
                connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            )
        # allow_redirects=False: a 3xx would carry the engine bearer to wherever it points
        async with self._session.post(
            base_url + path, json=payload or {}, params=params, allow_redirects=False
        ) as resp:
            text = await resp.text()
            if resp.status >= 300:  # a redirect is not followed: an error, like a 4xx
                raise RuntimeError(f"vLLM {base_url}{path} answered HTTP {resp.status}: {text[:500]}")
            return (await resp.json(content_type=None)) if text else None

    async def _control(self, path: str, params=None) -> None:
        """A control call to every serving engine; one that is lost meanwhile is skipped (its
        replacement starts awake and unpaused, with the current weights)."""
        for lease in self.supervisor.leases():
            try:
                await self._post_to(lease.url, path, params=params)
            except Exception as exc:
                if self.supervisor.is_current(lease):
                    await asyncio.to_thread(self.supervisor.report_failure, lease, str(exc))
                if self.supervisor.is_current(lease):
                    raise
                log.warning("modal_vllm replica %d: %s skipped on a lost engine", self.replica_rank, path)

    def max_tokens(self, prompt_len: int, sampling_params: dict) -> int:
        room = self.rollout["max_model_len"] - prompt_len
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room within max_model_len")
        wanted = sampling_params.pop("max_tokens", sampling_params.pop("max_new_tokens", None))
        if wanted is None:
            r = self.rollout
            wanted = min(r["response_length"], r["prompt_length"] + r["response_length"] - prompt_len)
        return max(1, min(int(wanted), room))

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        priority: int = 0,
        **_: Any,
    ) -> TokenOutput:
        import aiohttp

        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("modal_vllm: multimodal prompts are not supported by the HTTP proxy")
        params = dict(sampling_params)
        prompt = [int(t) for t in prompt_ids]
        body = {
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": self.max_tokens(len(prompt), params),
        }
        body["logprobs"] = 0 if params.pop("logprobs", False) else None
        body.update(params)
        body.update({"return_token_ids": True, "request_id": request_id, "priority": priority})
        body.setdefault("ignore_eos", self.rollout["ignore_eos"])
        self.stats["requests"] += 1
        attempts = []

        async def send(lease):
            attempts.append(lease)
            self._reader(lease.url).expect(request_id)
            return await self._post_to(
                lease.url, "/v1/completions", {**body, "model": self.model_for(lease.version)}
            )

        transient = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
        try:
            answer, lease = await self.supervisor.run(send, wait_s=self.retry_wait_s, transient=transient)
        except EngineLost as exc:
            self.stats["masked"] += 1
            log.warning("modal_vllm replica %d: sample masked: %s", self.replica_rank, exc)
            return TokenOutput(
                token_ids=[],
                log_probs=[] if body["logprobs"] is not None else None,
                stop_reason="aborted",
                extra_fields={"global_steps": self.global_steps, MASKED: str(exc), WEIGHT_VERSION: None},
            )
        self.stats["retried"] += len(attempts) > 1
        if lease.version != (self.supervisor.source.version if self.supervisor.source else None):
            self.stats["version_changed"] += 1  # a sync landed while it ran (vLLM recomputed it)
        choice = answer["choices"][0]
        token_ids = list(choice.get("token_ids") or [])
        log_probs = None
        if body["logprobs"] is not None and choice.get("logprobs"):
            log_probs = list(choice["logprobs"]["token_logprobs"])
        finish = choice.get("finish_reason")
        stop_reason = (
            "aborted" if finish == "abort" else "completed" if finish in ("stop", "length") else finish
        )
        steps = self.steps_of_version.get(lease.version, self.global_steps)
        extra = {"global_steps": steps, MASKED: None, WEIGHT_VERSION: lease.version}
        extra.update(await self._versions_of(lease.url, request_id, len(token_ids)))
        return TokenOutput(
            token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason, extra_fields=extra
        )

    def _reader(self, url: str) -> LedgerReader:
        reader = self._readers.get(url)
        if reader is None:

            async def post(body: dict) -> dict:
                import aiohttp

                for attempt in range(READ_ATTEMPTS):
                    try:
                        return await self._post_to(url, "/collective_rpc", body)
                    except aiohttp.ClientConnectionError:
                        # a pooled connection the engine's server closed as it was reused; a
                        # ledger read only reads, so it is safe to send again
                        if attempt == READ_ATTEMPTS - 1:
                            raise

            reader = self._readers[url] = LedgerReader(post)
        return reader

    async def _versions_of(self, url: str, request_id: str, n_tokens: int) -> dict:
        """The ledger's record of one finished request as verl's version fields (empty when
        the engine keeps none, or a version has no known step: verl then uses ``global_steps``)."""
        reader = self._readers.get(url)
        if reader is None or reader.tracked is False:
            return {}
        try:
            record = await reader.record(request_id, n_tokens)
        except Exception as exc:  # noqa: BLE001 -- a missing record must not fail the sample
            log.warning("modal_vllm replica %d: version ledger unreadable: %r", self.replica_rank, exc)
            record = None
        steps = [self.steps_of_version.get(v) for v in record.versions] if record else [None]
        engine = f"{self.replica_rank}:{reader.ledger or url}"
        idle = {} if reader.idle_s is None else {IDLE: {engine: reader.idle_s}}
        if record is None or None in steps:
            self.version_stats["unstamped"] += 1
            return idle
        self.version_stats["stamped"] += 1
        self.version_stats["switched"] += record.switched
        return {
            **idle,
            VERSIONS: step_record(steps, record.switch_at, n_tokens),
            RELAY_VERSIONS: record.to_json(),
            "global_steps": steps[-1],
            "min_global_steps": steps[0],
            "max_global_steps": steps[-1],
        }

    async def version_report(self) -> dict:
        """Samples stamped from the ledger, not stamped, and stamped with a switch inside."""
        return dict(self.version_stats)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.rollout["free_cache_engine"]:
            await self._control("/wake_up", params=[("tags", t) for t in tags] if tags else None)
        self.supervisor.paused = False

    async def sleep(self) -> None:
        if self.rollout["free_cache_engine"]:
            self.supervisor.paused = True  # an asleep engine cannot generate: probe its server only
            await self._control("/sleep", params={"level": 1})

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        if self.running == "recompute" and not reject_request:
            # the commit lands between decoding steps: running requests go on (see the module)
            return {"aborted_count": 0, "request_ids": []}
        # vLLM's pause aborts in-flight requests and holds new ones until /resume.
        self.supervisor.paused = True
        await self._control("/pause", params={"clear_cache": str(bool(reset_prefix_cache)).lower()})
        return {"aborted_count": None, "request_ids": []}

    async def resume_generation(self) -> None:
        if self.running == "recompute" and not self.supervisor.paused:
            return  # nothing was paused (abort_all_requests)
        await self._control("/resume")
        self.supervisor.paused = False

    async def clear_kv_cache(self) -> None:
        await self._control("/reset_prefix_cache")

    async def release_kv_cache(self) -> None:
        if self.rollout["free_cache_engine"] and self.running == "abort":
            await self._control("/sleep", params={"level": 1})
            await self._control("/wake_up", params={"tags": "weights"})

    async def resume_kv_cache(self) -> None:
        if self.rollout["free_cache_engine"] and self.running == "abort":
            await self._control("/wake_up", params={"tags": "kv_cache"})
            await self._control("/reset_prefix_cache")

    async def start_profile(self, **kwargs) -> None:
        log.warning("modal_vllm: profiling a remote engine is not supported; ignored")

    async def stop_profile(self) -> None:
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.supervisor is not None:
            await asyncio.to_thread(self.supervisor.stop)
