"""Which verl main and config a line names (``verl_modal.entry``): read from the installed
verl's files, nothing imported."""

from __future__ import annotations

import pytest

from verl_modal import entry as E
from verl_modal import preflight as pf

ASYNC = "verl.experimental.fully_async_policy.fully_async_main"


def test_plain_overrides_are_main_ppo_with_ppo_trainer():
    got = E.parse(["a=1", "+b=2"])
    assert (got.module, got.config_name, got.overrides, got.ours) == (
        E.MAIN_PPO,
        "ppo_trainer",
        ["a=1", "+b=2"],
        True,
    )
    assert got.config_dir == pf.verl_config_dir()


@pytest.mark.parametrize(
    "flags",
    [
        ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml"],
        ["--config-path", "config", "--config-name", "ppo_megatron_trainer"],
        ["-cn", "ppo_megatron_trainer"],
    ],
)
def test_config_flags_pick_the_megatron_trainer(flags):
    got = E.parse([*flags, "a=1"])
    assert got.config_name == "ppo_megatron_trainer" and got.overrides == ["a=1"] and got.ours
    assert got.config_args == flags


def test_python_m_of_the_ppo_main_is_ours():
    got = E.parse(["python3", "-m", E.MAIN_PPO, "--config-name=ppo_megatron_trainer", "a=1"])
    assert got.ours and got.config_name == "ppo_megatron_trainer" and got.overrides == ["a=1"]


def test_python_m_picks_another_main_with_its_own_default_config():
    got = E.parse(["python3", "-m", ASYNC, "a=1"])
    assert (got.module, got.config_name, got.ours) == (ASYNC, "fully_async_ppo_trainer", False)
    one_step = E.parse(["-m", "verl.experimental.one_step_off_policy.main_ppo"])
    assert one_step.config_name == "one_step_off_ppo_trainer"


def test_mains_that_hand_run_ppo_their_task_runner_can_run_in_process():
    """Read from the main's file: verl's async mains call run_ppo(config, task_runner_class=...),
    so a one-node local run takes them through our driver; an evaluation main does not."""
    assert E.parse(["a=1"]).via_run_ppo
    assert E.parse(["-m", ASYNC]).via_run_ppo
    assert E.parse(["-m", "verl.experimental.one_step_off_policy.main_ppo"]).via_run_ppo
    assert not E.parse(["-m", "verl.trainer.main_eval"]).via_run_ppo


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (["--foo", "a=1"], "neither a Hydra override"),
        (["-m", "recipe.dapo.main_dapo"], "the image holds verl and modal-rl only"),
        (["-m", "verl.trainer.nope"], "no such module"),
        (["--config-name=nope"], "no nope.yaml in"),
        (["--config-path=/somewhere", "--config-name=x"], "the image holds verl's own configs"),
        (["python3", "train.py"], "python3 -m MODULE"),
    ],
)
def test_unusable_entries_are_one_line(line, needle):
    with pytest.raises(E.EntryError, match=None) as err:
        E.parse(line)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_removed_megatron_key_says_drop_it():
    pf.select_config("ppo_megatron_trainer")
    try:
        with pytest.raises(pf.VerlPreflightError, match=r"grad_offload: verl 0.9.1 removed it .*; drop it$"):
            pf.compose(["actor_rollout_ref.actor.megatron.grad_offload=True"])
    finally:
        pf.select_config()
