"""Ray runtime-env settings of the user's machine, as a container needs them
(``modal_rl.cluster.runtime_env``), and the verl adapter's use of them."""

from __future__ import annotations

import pytest

from modal_rl.cluster.runtime_env import RuntimeEnvError, rewrite, uv_extras
from verl_modal.containers import container_runtime_env
from verl_modal.preflight import VerlPreflightError

KEY = "ray_kwargs.ray_init.runtime_env."


def test_uv_interpreter_is_dropped_and_its_extras_kept():
    value = "uv -v run --frozen --all-packages --extra vllm --extra=megatron"
    found = rewrite({KEY + "py_executable": value})[KEY + "py_executable"]
    assert found.value is None and found.extras == ["vllm", "megatron"]
    assert "uv workspace on this machine" in found.note
    assert uv_extras(["uv", "run", "--extra", "sglang"]) == ["sglang"]


@pytest.mark.parametrize("value", ["null", "python3", ""])
def test_plain_interpreters_pass_unchanged(value):
    found = rewrite({KEY + "py_executable": value})[KEY + "py_executable"]
    assert found.value == value and found.note is None


def test_local_venv_interpreter_is_dropped_and_unknown_command_refused():
    found = rewrite({KEY + "py_executable": "/home/me/verl/.venv/bin/python3"})[KEY + "py_executable"]
    assert found.value is None and "interpreter on this machine" in found.note
    with pytest.raises(RuntimeEnvError, match="set it to python3"):
        rewrite({KEY + "py_executable": "conda run -n rl python"})


def test_local_working_dir_is_refused_unless_on_a_volume_or_remote():
    with pytest.raises(RuntimeEnvError, match=r"--volume NAME:/code"):
        rewrite({KEY + "working_dir": "./recipe"})
    assert rewrite({KEY + "working_dir": "/code/recipe"}, ["/code"])[KEY + "working_dir"].note is None
    assert rewrite({KEY + "working_dir": "s3://b/code.zip"})[KEY + "working_dir"].note is None
    with pytest.raises(RuntimeEnvError, match="py_modules"):
        rewrite({KEY + "py_modules": "[/home/me/mods]"})


def test_verl_overrides_keep_their_order_with_the_setting_nulled():
    line = ["a.b=1", f"{KEY}py_executable=uv run --extra fsdp", "c=2"]
    out, notes, extras = container_runtime_env(line, [])
    assert out == ["a.b=1", f"{KEY}py_executable=null", "c=2"]
    assert len(notes) == 1 and extras == ["fsdp"]
    assert container_runtime_env(["a=1"], []) == (["a=1"], [], [])
    with pytest.raises(VerlPreflightError, match="working_dir"):
        container_runtime_env([f"++{KEY}working_dir=/home/x"], [])
