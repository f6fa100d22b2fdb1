"""Both frameworks' reward glue returns what ``score_sample`` returns, each in its own way.

The same samples go through verl's ``compute_score`` (a ``custom_reward_function``) and slime's
``reward_func`` and ``batched_reward_func`` (``--custom-rm-path``), on real local (bubblewrap)
sandboxes: an honest program, a wrong one, a partly right one (``partial=True``), tests that
are no test spec, a sample without tests, a plain-text expected output, and a sample whose
sandbox never starts (a provider registered by name whose every create fails, selected through
each framework's own pool settings). Each answer is read back the framework's way - verl: the
score dict (``score``, ``sandbox_masked``, ``mask_cause``, counts); slime: the returned reward,
``remove_sample`` and ``sample.metadata["modal_rl_reward"]`` - and must be the same: the same
score, the same mask, the same cause, the same counts.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from modal_rl.sandboxes.providers import PROVIDERS
from tests._sandboxes_helpers import needs_bwrap, no_processes_left

pytestmark = needs_bwrap
TIMEOUT_S = 5.0
FAILING = "test-failing"

DOUBLE = "def double(x):\n    return 2 * x\n"
ASSERTS = json.dumps({"assert": "assert double(1) == 2\nassert double(2) == 4\nassert double(5) == 10\n"})
STDIN = json.dumps([{"input": "3\n", "output": "6\n"}, {"input": "0\n", "output": "0\n"}])
# name -> (program, tests, partial, backend, expected score, expected cause)
SAMPLES = {
    "honest": (DOUBLE, ASSERTS, False, "local", 1.0, None),
    "wrong": ("def double(x):\n    return x + 2\n", ASSERTS, False, "local", 0.0, None),
    "partial": (
        "def double(x):\n    return x + 2 if x < 3 else 2 * x\n",
        ASSERTS,
        True,
        "local",
        2 / 3,
        None,
    ),
    "stdin": ("print(int(input()) * 2)\n", STDIN, False, "local", 1.0, None),
    "plain_text": ("print('hello')\n", "hello\n", False, "local", 1.0, None),
    "bad_tests": (DOUBLE, json.dumps({"nonsense": 1}), False, "local", 0.0, "bad_tests"),
    "sandbox": (DOUBLE, ASSERTS, False, FAILING, 0.0, "sandbox"),
}
FIELDS = ("score", "passed", "total", "execs", "program_decides", "masked", "cause")


@pytest.fixture(scope="module", autouse=True)
def failing_backend():
    PROVIDERS.add(FAILING, "tests._sandboxes_doubles:PermanentlyFailingProvider")
    yield


def response(program: str) -> str:
    return f"Here it is:\n```python\n{program}```\n"


def verl_answers() -> dict[str, dict]:
    from modal_rl.sandboxes.shared import close_shared_pools
    from verl_modal.reward import compute_score

    async def one(program, tests, partial, backend):
        return await compute_score(
            "code",
            response(program),
            tests,
            {},
            exec_timeout_s=TIMEOUT_S,
            partial=partial,
            sandbox_retries=1,
            backend=backend,
            min_warm=0,
            max_live=4,
        )

    async def main():
        try:
            return await asyncio.gather(*(one(p, t, part, b) for p, t, part, b, _, _ in SAMPLES.values()))
        finally:
            await close_shared_pools()

    out = dict(zip(SAMPLES, asyncio.run(main()), strict=True))
    no_processes_left()
    return {
        name: {
            **{k: a[k] for k in ("score", "passed", "total", "execs", "program_decides")},
            "masked": bool(a["sandbox_masked"]),
            "cause": a["mask_cause"] or None,
        }
        for name, a in out.items()
    }


def slime_answers(batched: bool) -> dict[str, dict]:
    from slime_modal.config import close_rollout_pools
    from slime_modal.reward import batched_reward_func, reward_func

    def args(partial, backend):
        return SimpleNamespace(
            modal_rl_reward={"timeout_s": TIMEOUT_S, "partial": partial},
            modal_rl_sandbox={"backend": backend, "min_warm": 0, "max_live": 4},
        )

    samples = {
        name: SimpleNamespace(index=i, response=response(p), label=t, metadata={}, remove_sample=False)
        for i, (name, (p, t, _, _, _, _)) in enumerate(SAMPLES.items())
    }

    async def main():
        try:
            if batched:  # one call per (partial, backend) setting: a call shares its args
                rewards = {}
                for setting in {(part, b) for _, _, part, b, _, _ in SAMPLES.values()}:
                    names = [n for n, (_, _, part, b, _, _) in SAMPLES.items() if (part, b) == setting]
                    got = await batched_reward_func(args(*setting), [samples[n] for n in names])
                    rewards.update(zip(names, got, strict=True))
                return rewards
            got = await asyncio.gather(
                *(reward_func(args(part, b), samples[n]) for n, (_, _, part, b, _, _) in SAMPLES.items())
            )
            return dict(zip(SAMPLES, got, strict=True))
        finally:
            await close_rollout_pools()

    rewards = asyncio.run(main())
    no_processes_left()
    out = {}
    for name, sample in samples.items():
        meta = sample.metadata["modal_rl_reward"]
        assert meta["masked"] is sample.remove_sample, name  # the mask slime acts on agrees
        assert rewards[name] == meta["score"], name  # the reward slime gets is the scored one
        out[name] = {k: meta[k] for k in FIELDS}
    return out


@pytest.fixture(scope="module")
def answers():
    return {"verl": verl_answers(), "slime": slime_answers(False), "slime-batched": slime_answers(True)}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_each_framework_scores_as_deserved(answers, name):
    _, _, _, _, score, cause = SAMPLES[name]
    for framework, got in answers.items():
        assert got[name]["score"] == pytest.approx(score), (framework, got[name])
        assert got[name]["masked"] is (cause is not None), (framework, got[name])
        assert got[name]["cause"] == cause, (framework, got[name])


def test_frameworks_agree_on_every_field(answers):
    assert answers["verl"] == answers["slime"] == answers["slime-batched"]


def test_a_sample_without_tests_is_bad_tests_in_both():
    """verl's ground truth and slime's label both empty: masked as a dataset problem, not scored."""
    from modal_rl.sandboxes.scoring import score_sample
    from slime_modal.reward import reward_func
    from verl_modal.reward import compute_score

    async def never_used():
        raise AssertionError("no pool is needed for a sample without tests")

    verl = asyncio.run(compute_score("code", response(DOUBLE), "", {}))
    sample = SimpleNamespace(index=0, response=response(DOUBLE), label="", metadata={}, remove_sample=False)
    slime = asyncio.run(reward_func(SimpleNamespace(), sample))
    assert verl["sandbox_masked"] == 1 and verl["mask_cause"] == "bad_tests" and verl["score"] == 0.0
    assert (
        sample.remove_sample and slime == 0.0 and sample.metadata["modal_rl_reward"]["cause"] == "bad_tests"
    )
    assert asyncio.run(score_sample(never_used, response(DOUBLE), "")).cause == "bad_tests"
