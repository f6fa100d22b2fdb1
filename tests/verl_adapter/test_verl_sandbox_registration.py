"""By-name registration with verl 0.9.1: the deferred-registration helper on real modules,
the ``modal_sandbox`` reward manager through the ``verl.plugins`` entry point in fresh
interpreters, and the manager scoring real responses in bubblewrap sandboxes."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from tests._sandboxes_helpers import needs_bwrap, no_processes_left

pytest.importorskip("verl")

from tests.verl_plugin_helpers import plugin_env, run_python  # noqa: E402
from verl_modal import _register  # noqa: E402

GOOD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
BAD = "```python\nprint(0)\n```"
TESTS = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]})


# -- the generic helper, on real modules written here ----------------------------------------


def _module(tmp_path, monkeypatch, name: str, body: str = "VALUE = 1\n") -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_after_import_runs_once_after_the_module_executed(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "vm_reg_target_a")
    seen = []
    _register.after_import(name, lambda: seen.append(sys.modules[name].VALUE))
    assert seen == []  # nothing imported it yet
    __import__(name)
    assert seen == [1]  # ran after the body defined VALUE
    del sys.modules[name]
    __import__(name)
    assert seen == [1]  # one shot


def test_after_import_runs_at_once_when_already_loaded(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "vm_reg_target_b")
    __import__(name)
    seen = []
    _register.after_import(name, lambda: seen.append("now"))
    assert seen == ["now"]


def test_loudly_logs_at_error_and_records(caplog):
    recorded = []

    def boom():
        raise RuntimeError("no sandbox backend")

    with caplog.at_level(logging.ERROR, logger="verl_modal"):
        _register.loudly("thing 'x'", boom, recorded.append)()  # never raises
    assert "could not register thing 'x'" in caplog.text and "no sandbox backend" in caplog.text
    assert [type(e) for e in recorded] == [RuntimeError]
    assert isinstance(_register.as_import_error(recorded[0]), ImportError)


def test_register_in_process_lists_modal_sandbox():
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    import verl_modal._sandbox_register as reg

    reg.register()  # idempotent: the class decorator registers the same class again
    cls = get_reward_manager_cls("modal_sandbox")
    assert cls.__module__ == "verl_modal.reward_manager"


# -- through the verl.plugins entry point, in fresh interpreters -----------------------------


def test_import_verl_alone_lists_modal_sandbox(tmp_path):
    out = run_python(
        """
        import sys
        import verl
        assert "verl_modal.reward_manager" not in sys.modules  # deferred: import verl stays light
        from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
        from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
        print(sorted(REWARD_MANAGER))
        print(get_reward_manager_cls("modal_sandbox").__module__)
        """,
        plugin_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    listed, module = out.stdout.strip().splitlines()[-2:]
    assert "'modal_sandbox'" in listed and "'naive'" in listed
    assert module == "verl_modal.reward_manager"


def test_a_reward_registration_failure_is_loud(tmp_path):
    out = run_python(
        """
        import sys
        sys.modules["modal_rl.sandboxes.shared"] = None  # make the manager's import fail
        import verl
        from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
        cls = get_reward_manager_cls("modal_sandbox")  # listed, so verl's config check passes
        try:
            cls(config=None, tokenizer=None, compute_score=None)
        except ImportError as exc:
            print("BUILD:", exc)
        """,
        plugin_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stderr and "could not register reward manager 'modal_sandbox'" in out.stderr
    assert "BUILD: reward manager 'modal_sandbox' failed to register" in out.stdout, out.stdout
    assert "modal_rl.sandboxes.shared" in out.stdout


# -- the manager, built by verl's own loader, scoring in real sandboxes ----------------------


def _config(**reward_kwargs):
    import verl_modal._sandbox_register  # noqa: F401  (this process's metadata may predate the entry point)
    from verl_modal.cpu.overrides import compose

    overrides = ["reward.reward_manager.name=modal_sandbox"]
    overrides += [f"+reward.reward_kwargs.{k}={v}" for k, v in reward_kwargs.items()]
    return compose(overrides)


def _batch(tokenizer, responses: list[str]):
    import numpy as np
    import torch
    from verl import DataProto

    prompt = tokenizer("print the sum", return_tensors="pt")["input_ids"][0]
    encoded = [tokenizer(r)["input_ids"] for r in responses]
    width = max(map(len, encoded))
    resp = torch.full((len(responses), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(responses), len(prompt) + width), dtype=torch.long)
    mask[:, : len(prompt)] = 1
    for i, ids in enumerate(encoded):
        resp[i, : len(ids)] = torch.tensor(ids)
        mask[i, len(prompt) : len(prompt) + len(ids)] = 1
    n = len(responses)
    return DataProto.from_dict(
        tensors={"prompts": prompt.repeat(n, 1), "responses": resp, "attention_mask": mask},
        non_tensors={
            "data_source": np.array(["verl_modal/tiny_code"] * n, dtype=object),
            "reward_model": np.array([{"ground_truth": TESTS}] * n, dtype=object),
            "extra_info": np.array([{} for _ in range(n)], dtype=object),
        },
    )


@needs_bwrap
def test_manager_scores_responses_in_sandboxes(tmp_path):
    from verl.trainer.ppo.reward import load_reward_manager

    from modal_rl.sandboxes.shared import close_shared_pools
    from verl_modal.cpu.tiny import code_rows, make_tokenizer

    tokenizer = make_tokenizer(code_rows(8, 0, "train"), 400)
    config = _config(min_warm=1, max_live=2, exec_timeout_s=5, metrics_dir=tmp_path)
    manager = load_reward_manager(config, tokenizer)
    assert type(manager).__name__ == "SandboxRewardManager"
    data = _batch(tokenizer, [GOOD, BAD])

    async def main():
        try:
            return [await manager.run_single(data[i : i + 1]) for i in range(len(data))]
        finally:
            await close_shared_pools()

    good, bad = manager.loop.run_until_complete(main())  # the loop verl's worker drives it on
    assert good["reward_score"] == 1.0 and good["reward_extra_info"]["execs"] == 2
    assert bad["reward_score"] == 0.0 and bad["reward_extra_info"]["execs"] == 1  # stops at a failure
    (metrics_file,) = tmp_path.glob("sandbox-reward-*.json")
    metrics = json.loads(metrics_file.read_text())
    assert metrics["samples"] == 2 and metrics["execs"] == 3 and metrics["sandbox_errors"] == 0
    assert metrics["pool"]["claims"] == 2
    no_processes_left()


def test_manager_rejects_unknown_reward_kwargs():
    from verl.trainer.ppo.reward import load_reward_manager

    from verl_modal.cpu.tiny import code_rows, make_tokenizer

    with pytest.raises(ValueError, match=r"unknown reward.reward_kwargs \['min_wram'\]"):
        load_reward_manager(_config(min_wram=1), make_tokenizer(code_rows(4, 0, "train"), 300))
