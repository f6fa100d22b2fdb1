"""``--help`` of the launchers says what goes after ``--`` and what every cluster flag does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPLAINED = ("--volume", "--env", "--join-timeout", "--job-timeout", "--retries", "--region", "--cloud")


def help_text(*argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.split())  # argparse wraps to the terminal width


def flag_help(parser, flag: str) -> str:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action.help or ""


@pytest.mark.parametrize(
    ("argv", "passthrough"),
    [
        (["verl_modal"], "-- [verl Hydra overrides"),
        (["slime_modal"], "-- [slime's train.py arguments"),
        (["modal_rl.cluster", "run"], "-- COMMAND [ARGS...]"),
    ],
)
def test_help_shows_the_passthrough_and_explains_every_cluster_flag(argv, passthrough):
    text = help_text(*argv)
    assert passthrough in text.split("options:")[0], text[:400]  # in the usage line
    for flag in EXPLAINED:
        assert flag in text
    from modal_rl.cli_errors import OneLineParser
    from modal_rl.cluster.cli import add_cluster_args

    parser = OneLineParser()
    add_cluster_args(parser)
    for flag in EXPLAINED:
        assert len(flag_help(parser, flag)) > 20, flag


def test_slime_help_names_every_rollout_engines_form():
    text = help_text("slime_modal")
    assert "modal:N[:TYPE[:COUNT]]" in text
    assert "modal:4:H100:2" in text and "--rollout-num-gpus-per-engine" in text


def test_every_entry_point_offers_debug():
    for argv in (
        ["verl_modal"],
        ["slime_modal"],
        ["modal_rl.cluster", "smoke"],
        ["modal_rl.sandboxes", "sweep"],
    ):
        assert "--debug" in help_text(*argv), argv
