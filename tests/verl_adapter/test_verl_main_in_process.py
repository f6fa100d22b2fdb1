"""Another verl main in our in-process driver (``verl_modal.runner.run_main``): the main runs
unchanged with the composed config, and the TaskRunner class it hands verl's ``run_ppo``
becomes ours for that call only. The real run is tests/e2e/test_verl_one_step_off.py."""

from __future__ import annotations

import sys
import types

import pytest

ONE_STEP = "verl.experimental.one_step_off_policy.main_ppo"


@pytest.fixture
def recorded_run_ppo(monkeypatch):
    import verl.trainer.main_ppo as main_ppo

    calls = []
    monkeypatch.setattr(
        main_ppo, "run_ppo", lambda cfg, task_runner_class: calls.append((cfg, task_runner_class))
    )
    return calls


def test_a_mains_task_runner_becomes_ours_with_its_options_less_its_cpus(recorded_run_ppo):
    import verl.trainer.main_ppo as main_ppo
    from verl.experimental.one_step_off_policy.main_ppo import OneStepTaskRunner

    from verl_modal.runner import run_main

    seen = main_ppo.run_ppo
    module = types.ModuleType("fake_verl_main")

    def main(config):  # as verl's async mains end: the name imported when the main runs
        from verl.trainer.main_ppo import run_ppo

        config["touched"] = True
        run_ppo(config, task_runner_class=OneStepTaskRunner)

    module.main = main
    sys.modules[module.__name__] = module
    try:
        config = {}
        run_main(module.__name__, config, cpu=True)
    finally:
        del sys.modules[module.__name__]
    assert main_ppo.run_ppo is seen  # restored after the call
    ((cfg, ours),) = recorded_run_ppo
    assert cfg is config and config["touched"]
    cls = ours.__ray_actor_class__
    assert cls.__name__ == "CpuTaskRunner" and issubclass(cls, OneStepTaskRunner.__ray_actor_class__)
    assert OneStepTaskRunner._default_options["num_cpus"] == 10  # verl's, for a GPU cluster's head
    assert "num_cpus" not in ours._default_options
    assert ours._default_options["max_concurrency"] == 100


def test_a_main_that_never_calls_run_ppo_is_an_error(recorded_run_ppo):
    from verl_modal.runner import run_main

    module = types.ModuleType("fake_verl_eval")
    module.main = lambda config: None
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(
            RuntimeError, match=r"fake_verl_eval.main returned without calling verl's run_ppo"
        ):
            run_main(module.__name__, {}, cpu=False)
    finally:
        del sys.modules[module.__name__]
    assert recorded_run_ppo == []


FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"


def test_the_fully_async_mains_own_actors_become_ours_in_its_task_runner(monkeypatch):
    """verl's fully-async TaskRunner builds its trainer and rollouter as Ray actors by their
    module-level names: in its process they become subclasses that run our setup first, with
    verl's actor options less the 10 CPUs each asks for; a second swap changes nothing."""
    import importlib

    from verl_modal.runner import MAIN_ACTORS, swap_main_actors

    main = importlib.import_module(FULLY_ASYNC)
    given = {name: getattr(main, name) for name in MAIN_ACTORS[FULLY_ASYNC]}
    for name, cls in given.items():
        monkeypatch.setattr(main, name, cls)  # restored after the test
    assert swap_main_actors(FULLY_ASYNC, cpu=True) == ["FullyAsyncTrainer", "FullyAsyncRollouter"]
    for name, cls in given.items():
        ours = getattr(main, name)
        assert ours is not cls and issubclass(ours.__ray_actor_class__, cls.__ray_actor_class__)
        assert ours.__ray_actor_class__.__name__ == name
        assert cls._default_options["num_cpus"] == 10  # verl's, for a GPU node
        assert "num_cpus" not in ours._default_options
    assert main.FullyAsyncRollouter._default_options["max_concurrency"] == 100  # verl's, kept
    assert swap_main_actors(FULLY_ASYNC, cpu=True) == []
    assert swap_main_actors(ONE_STEP, cpu=True) == []  # a main without actors of its own
