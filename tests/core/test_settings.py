"""The declared settings: the code reads no undeclared ``MODAL_RL_*`` variable, the docs list
every declared one, and a bad value is one line naming the variable (never a traceback, never a
secret)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.settings import NOT_VARIABLES, VARIABLES, SettingsError, read

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"MODAL_RL_[A-Z0-9_]+")


def _named_in_code() -> set[str]:
    found: set[str] = set()
    for folder in ("modal_rl", "verl_modal", "slime_modal", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.name != "settings.py":
                found |= set(NAME.findall(path.read_text(errors="replace")))
    return found


def test_every_variable_the_code_names_is_declared():
    undeclared = sorted(_named_in_code() - set(VARIABLES) - NOT_VARIABLES)
    assert not undeclared, f"declare these in modal_rl/settings.py (and docs/settings.md): {undeclared}"


def test_the_docs_list_every_declared_variable():
    page = (ROOT / "docs" / "settings.md").read_text()
    missing = [name for name in VARIABLES if f"`{name}`" not in page]
    assert not missing, f"docs/settings.md lacks {missing}"


def test_values_parse_as_declared_and_unset_is_the_default():
    env = {
        "MODAL_RL_SANDBOX_MAX_LIVE": "8",
        "MODAL_RL_REWARD_TIMEOUT_S": "2.5",
        "MODAL_RL_SANDBOX_NETWORK": "on",
    }
    assert read("MODAL_RL_SANDBOX_MAX_LIVE", env) == 8
    assert read("MODAL_RL_REWARD_TIMEOUT_S", env) == 2.5
    assert read("MODAL_RL_SANDBOX_NETWORK", env) is True
    assert read("MODAL_RL_SANDBOX_MIN_WARM", env) == 2
    assert read("MODAL_RL_SANDBOX_MIN_WARM", {"MODAL_RL_SANDBOX_MIN_WARM": ""}) == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MODAL_RL_SANDBOX_MAX_LIVE", "lots"),
        ("MODAL_RL_REWARD_TIMEOUT_S", "-1"),
        ("MODAL_RL_PRE_READ_TIMEOUT_S", "nan"),
        ("MODAL_RL_SANDBOX_NETWORK", "maybe"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(name, value):
    with pytest.raises(SettingsError) as info:
        read(name, {name: value})
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"{name}={value!r}") and "unset it" in line


def test_an_undeclared_name_is_refused():
    with pytest.raises(KeyError, match="not a declared"):
        read("MODAL_RL_NO_SUCH_THING", {})


def test_a_bad_value_reaches_the_user_as_one_line_through_the_sandbox_settings():
    code = "from modal_rl.sandboxes.shared import settings; settings()"
    env = {"MODAL_RL_SANDBOX_MAX_LIVE": "lots", "PATH": "/usr/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "MODAL_RL_SANDBOX_MAX_LIVE='lots': give a whole number" in out.stderr
