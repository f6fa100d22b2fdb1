"""Override composition against verl 0.9.1's real ``ppo_trainer`` config, the launcher's
errors, the tiny assets and the shaping reward."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_modal.cpu import overrides as ov
from verl_modal.cpu.arith_reward import compute_score, extract_answer

ROOT = Path(__file__).resolve().parents[2]


def test_override_key_parses_hydra_forms():
    assert ov.override_key("a.b=1") == "a.b"
    assert ov.override_key("+a.b=1") == "a.b"
    assert ov.override_key("++a.b=x=y") == "a.b"
    assert ov.override_key("~a.b") == "a.b"
    for bad in ["a.b", "=1", "a b=1", ""]:
        with pytest.raises(ov.OverrideError, match="key=value"):
            ov.override_key(bad)


def test_merge_later_layer_wins_and_keeps_one_per_key():
    merged = ov.merge(["a=1", "++b=2", "c=3"], ["b=5"], ["a=9"])
    assert merged == ["c=3", "b=5", "a=9"]


def test_compose_applies_cpu_layers_then_user():
    config = ov.compose(ov.cpu_overrides(["data.train_batch_size=4"], ["data.train_batch_size=8"]))
    ov.check_required(config)
    assert config.trainer.device == "cpu"
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert config.actor_rollout_ref.rollout.enable_sleep_mode is False
    assert config.algorithm.adv_estimator == "grpo"
    assert config.data.train_batch_size == 8


def test_local_node_declares_the_standalone_rollout_pool_too():
    from verl_modal.runner import logical_gpus

    colocated = ov.compose(ov.cpu_overrides([], ["trainer.n_gpus_per_node=2"]))
    assert logical_gpus(colocated) == 2
    standalone = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=1"]
    standalone.append("actor_rollout_ref.rollout.n_gpus_per_node=3")
    assert logical_gpus(ov.compose(ov.cpu_overrides([], ["trainer.n_gpus_per_node=2", *standalone]))) == 5
    declared = ov.compose(ov.cpu_overrides([], [*standalone, "++ray_kwargs.ray_init.num_gpus=7"]))
    assert logical_gpus(declared) == 7


def test_user_may_replace_an_added_key_with_plus():
    config = ov.compose(
        ov.cpu_overrides([], ["+actor_rollout_ref.model.override_config.attn_implementation=eager"])
    )
    with pytest.raises(ov.OverrideError, match=r"attn_implementation=eager .*sdpa.*blocker 5"):
        ov.check_required(config)


def test_contradicting_a_cpu_requirement_names_the_blocker():
    config = ov.compose(ov.cpu_overrides([], ["actor_rollout_ref.actor.strategy=fsdp"]))
    with pytest.raises(ov.OverrideError, match=r"actor_rollout_ref.actor.strategy=fsdp .*fsdp2.*blocker 6"):
        ov.check_required(config)


def test_unknown_key_is_an_override_error():
    with pytest.raises(ov.OverrideError, match="no_such_key"):
        ov.compose(ov.cpu_overrides([], ["trainer.no_such_key=1"]))


def test_worker_env_selects_platform_and_keeps_other_external_modules(monkeypatch):
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my.mod")
    monkeypatch.setenv("VERL_PLATFORM", "nvidia")
    env = ov.worker_env()
    assert env["VERL_PLATFORM"] == "cpu"
    assert env["VERL_ENGINE_DEVICE"] == "cuda"
    assert env["VERL_USE_EXTERNAL_MODULES"] == "my.mod,verl_modal.cpu.platform"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_runtime_env_carries_our_env_even_when_the_driver_has_it(monkeypatch):
    # verl's get_ppo_ray_runtime_env drops keys set in the driver; ours must survive.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    from verl_modal.runner import runtime_env_for

    config = ov.compose(ov.cpu_overrides([], []))
    env = ov.worker_env()
    runtime_env = runtime_env_for(config, env)
    for key, value in env.items():
        assert runtime_env["env_vars"][key] == value
    assert runtime_env["env_vars"]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


def launcher(*args: str, timeout: int = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "VLLM_"))}
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "verl_modal", *args],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out, time.monotonic() - t0


def test_launcher_modal_backend_needs_a_gpu():
    out, _ = launcher("--backend", "modal", "--", "trainer.nnodes=1")
    assert out.returncode == 2
    assert "--backend modal needs --gpu" in out.stderr


def test_launcher_rejects_a_bad_override_in_one_line():
    out, _ = launcher("--device", "cpu", "--", "trainer.total_training_steps")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("verl_modal: not a Hydra override")


def test_launcher_rejects_two_nodes_on_local_backend_before_ray(tmp_path):
    out, _ = launcher("--device", "cpu", "--tiny", str(tmp_path / "tiny"), "--", "trainer.nnodes=2")
    assert out.returncode == 2
    assert (
        "trainer.nnodes=2 does not fit: the line's pools need 2 nodes (trainer 2) and the cluster has 1"
        in out.stderr
    )


def test_launcher_rejects_a_model_that_is_not_local(tmp_path):
    out, _ = launcher("--device", "cpu", "--", f"actor_rollout_ref.model.path={tmp_path}/nope")
    assert out.returncode == 2
    assert "is not a local model directory" in out.stderr.strip().splitlines()[-1]


def test_launcher_rejects_missing_data(tmp_path):
    from verl_modal.cpu import tiny

    model = tiny.overrides_for(tmp_path)[0]
    tiny.make(tmp_path)
    out, _ = launcher("--device", "cpu", "--", model, f"data.train_files={tmp_path}/missing.parquet")
    assert out.returncode == 2
    assert f"data.train_files: {tmp_path}/missing.parquet does not exist" in out.stderr


@pytest.mark.slow
def test_launcher_dry_run_lists_the_composed_overrides(tmp_path):
    out, _ = launcher(
        "--device",
        "cpu",
        "--tiny",
        str(tmp_path / "tiny"),
        "--dry-run",
        "--json",
        "--",
        "trainer.total_epochs=1",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.strip() for line in out.stdout.splitlines()]
    assert "trainer.device=cpu" in lines
    assert f"actor_rollout_ref.model.path={(tmp_path / 'tiny' / 'model').resolve()}" in lines
    overrides = [line for line in lines if not line.startswith("verl_modal:")]
    assert overrides[-1] == "trainer.total_epochs=1"  # the user's own last: they win


def test_tiny_assets_are_local_small_and_consistent(tmp_path):
    import pandas as pd
    from transformers import AutoConfig, AutoTokenizer

    from verl_modal.cpu import tiny

    overrides = tiny.make(tmp_path)
    assert tiny.make(tmp_path) == overrides  # second call reuses
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    cfg = AutoConfig.from_pretrained(tmp_path / "model")
    assert 900 <= len(tok) <= 1003 and cfg.vocab_size >= len(tok)
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * h // cfg.num_attention_heads
    params = cfg.vocab_size * h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    assert 300_000 < params < 500_000
    train = pd.read_parquet(tmp_path / "train.parquet")
    row = train.iloc[0]
    text = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert len(tok(text)["input_ids"]) <= 64  # data.max_prompt_length in WORKLOAD_SIZES
    assert tok.decode(tok(text)["input_ids"]) == text
    question = row["extra_info"]["question"]
    a, op, b = question.split("What is ")[1].split("?")[0].split()
    assert str(eval(f"{a}{op}{b}")) == row["reward_model"]["ground_truth"]


def test_reward_is_dense_and_exact_answer_scores_two():
    assert compute_score("s", "blah #### 85", "85") == 2.0
    assert compute_score("s", "the answer is 85", "85") == 2.0
    assert compute_score("s", "#### 84", "85") == 0.5
    assert compute_score("s", "#### 185", "85") == 0.0  # position-wise, not a substring match
    assert compute_score("s", "#### -12", "-12") == 2.0
    assert compute_score("s", "no number here", "85") == 0.0
    assert extract_answer("1 then #### 7 and 9") == "7"


ONE_STEP = "verl.experimental.one_step_off_policy.main_ppo"


def test_a_config_with_its_own_rollout_pool_gets_one_replica_on_this_host():
    """verl's one-step-off config extends ppo_trainer through a search path relative to a verl
    checkout, and asks for 8 rollout GPUs in a top-level ``rollout`` section its main copies
    over ``actor_rollout_ref.rollout``: composed here (not in a checkout) with the CPU layer
    that gives it one replica and no hybrid engine; ppo_trainer gets no such layer."""
    from verl_modal import entry as E
    from verl_modal import preflight as pf
    from verl_modal.runner import logical_gpus

    assert ov.rollout_pool_defaults(ov.compose([])) == []
    one_step = E.parse(["-m", ONE_STEP])
    pf.select_config(one_step.config_name, one_step.config_dir)
    try:
        name, where = one_step.config_name, one_step.config_dir
        assert pf.searchpath_overrides(where, name, []) == ["hydra.searchpath=[pkg://verl.trainer.config]"]
        assert pf.searchpath_overrides(where, name, ["hydra.searchpath=[x]"]) == []
        fully_async = E.parse(["-m", "verl.experimental.fully_async_policy.fully_async_main"])
        assert pf.searchpath_overrides(fully_async.config_dir, fully_async.config_name, []) == []  # pkg://
        # the cluster job runs the main as itself: the same search path goes with it
        from verl_modal.launch import cluster_job

        job, _ = cluster_job(["a=1"], cpu=False, join_timeout_s=30, entry=one_step)
        assert job == ["python", "-m", ONE_STEP, "a=1", "hydra.searchpath=[pkg://verl.trainer.config]"]
        bare = pf.compose([])
        assert bare.rollout.n_gpus_per_node == 8
        layer = ov.rollout_pool_defaults(bare)
        assert layer == ov.ROLLOUT_POOL_DEFAULTS
        config = pf.compose(ov.merge(ov.required_overrides(), ov.CPU_DEFAULTS, layer))
        assert (config.rollout.nnodes, config.rollout.n_gpus_per_node) == (1, 1)
        assert config.actor_rollout_ref.hybrid_engine is False
        assert config.actor_rollout_ref.rollout.calculate_log_probs is True  # the config's own
        # a vllm rollout's replica is a pool of the main's top-level size on the local node
        vllm = pf.compose(
            ov.merge(ov.required_overrides(), ov.CPU_DEFAULTS, layer, ["rollout.n_gpus_per_node=2"])
        )
        assert pf.standalone_pool_gpus(vllm) == 2 and logical_gpus(vllm) == 3
        modal = pf.compose([*layer, "actor_rollout_ref.rollout.name=modal_vllm"])
        assert pf.standalone_pool_gpus(modal) == 0  # its engines bring their own
    finally:
        pf.select_config()


def test_a_main_that_does_not_hand_run_ppo_its_task_runner_is_refused_on_one_local_node():
    out, elapsed = launcher("--device", "cpu", "--", "-m", "verl.trainer.main_eval")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "verl_modal: -m verl.trainer.main_eval runs on a cluster (--backend modal, or --backend local "
        "--nodes 2): a one-node local run takes a main that hands its TaskRunner to verl's run_ppo, "
        "and this one does not"
    ]


def test_a_rollout_dump_the_one_step_off_trainer_cannot_write_is_refused(monkeypatch):
    """verl 0.9.1's one-step-off trainer never starts its rollout-dump executor; a line that
    asks it for a dump fails in one line before anything starts (the run report asks none)."""
    from verl_modal import upstream

    assert upstream.dumps_rollouts(None)
    if upstream.one_step_off_dumps_rollouts():
        pytest.skip("this verl's one-step-off trainer writes rollout dumps")
    assert not upstream.dumps_rollouts(ONE_STEP)
    out, _ = launcher("--device", "cpu", "--", "-m", ONE_STEP, "trainer.rollout_data_dir=/data/dumps")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"verl_modal: trainer.rollout_data_dir=/data/dumps: this verl's {ONE_STEP} never starts the executor "
        "its rollout dump writes with (its first step would fail on _dump_executor); drop it"
    )


def test_a_main_that_streams_prompts_gets_no_batch_size_from_the_workload():
    """verl's fully-async rollouter asserts ``data.train_batch_size=0`` (it streams prompts
    one at a time): the layer that says so comes after the workload's batch size, and only
    for a config with verl's ``async_training`` section; the user's line still wins."""
    from verl_modal import entry as E
    from verl_modal import preflight as pf
    from verl_modal.cpu.tiny import WORKLOAD_SIZES

    assert ov.streaming_defaults(ov.compose([])) == []
    for main, want in ((ONE_STEP, []), ("verl.experimental.fully_async_policy.fully_async_main", ["x"])):
        parsed = E.parse(["-m", main])
        pf.select_config(parsed.config_name, parsed.config_dir)
        try:
            bare = pf.compose([])
            layer = ov.streaming_defaults(bare)
            assert bool(layer) == bool(want), main
            if layer:
                config = pf.compose(ov.merge(ov.CPU_DEFAULTS, WORKLOAD_SIZES, layer))
                assert (config.data.train_batch_size, config.data.gen_batch_size) == (0, 1)
                user = pf.compose(ov.merge(WORKLOAD_SIZES, layer, ["data.train_batch_size=8"]))
                assert user.data.train_batch_size == 8
        finally:
            pf.select_config()
