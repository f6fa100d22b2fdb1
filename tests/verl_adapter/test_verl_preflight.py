"""verl preflight: real Hydra composition of verl 0.9.1's ``ppo_trainer``, verl's own
``validate_config``, GPUs against the cluster; and the launcher's exit codes and timing
(``--preflight-only``, nothing provisioned)."""

from __future__ import annotations

import time

import pytest

from tests.verl_adapter.test_verl_launch import VERL_LINE, launcher
from verl_modal import preflight as pf
from verl_modal.containers import check_modal_data_paths
from verl_modal.value_types import value_type_check

TWO_BY_EIGHT = pf.ClusterShape(2, 8)
CLUSTER = ["trainer.nnodes=2", "trainer.n_gpus_per_node=8"]


def test_cluster_overrides_fill_in_and_refuse_disagreement():
    assert pf.cluster_overrides(TWO_BY_EIGHT, ["a=1"]) == CLUSTER
    assert pf.cluster_overrides(TWO_BY_EIGHT, ["++trainer.nnodes=2"]) == CLUSTER
    with pytest.raises(
        pf.VerlPreflightError,
        match=r"trainer.nnodes=3 does not fit: the line's pools need 3 nodes \(trainer 3\) and the "
        r"cluster has 2; use --nodes 3, or drop trainer.nnodes",
    ):
        pf.cluster_overrides(TWO_BY_EIGHT, ["trainer.nnodes=3"])
    with pytest.raises(pf.VerlPreflightError, match=r"fill 1 of the cluster's 2 nodes .*use --nodes 1"):
        pf.cluster_overrides(TWO_BY_EIGHT, ["trainer.nnodes=1"])
    # the line's own trainer.nnodes is kept when its pools fill the cluster: never forced
    teacher = ["distillation.enabled=true", "distillation.nnodes=1", "trainer.nnodes=1"]
    assert pf.cluster_overrides(TWO_BY_EIGHT, teacher) == ["trainer.nnodes=1", "trainer.n_gpus_per_node=8"]
    assert pf.cluster_overrides(TWO_BY_EIGHT, teacher[:2]) == [
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=8",
    ]
    with pytest.raises(pf.VerlPreflightError, match=r"trainer.n_gpus_per_node=4 disagrees"):
        pf.cluster_overrides(TWO_BY_EIGHT, ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"])
    with pytest.raises(pf.VerlPreflightError, match="is not an integer"):
        pf.cluster_overrides(TWO_BY_EIGHT, ["trainer.nnodes=two"])
    with pytest.raises(pf.VerlPreflightError, match="not a Hydra override"):
        pf.cluster_overrides(TWO_BY_EIGHT, ["trainer.nnodes"])


def test_a_valid_line_composes_and_passes_verls_validation():
    config = pf.preflight(TWO_BY_EIGHT, CLUSTER + VERL_LINE)
    assert config.trainer.nnodes == 2 and config.trainer.n_gpus_per_node == 8
    assert config.algorithm.adv_estimator == "grpo"
    assert pf.required_gpus(config) == 16


def test_unknown_key_is_named():
    with pytest.raises(pf.VerlPreflightError) as err:
        pf.preflight(TWO_BY_EIGHT, CLUSTER + VERL_LINE + ["actor_rollout_ref.actor.lr=1e-6"])
    assert str(err.value).startswith("unknown key actor_rollout_ref.actor.lr: verl's ppo_trainer config")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused(estimator):
    """Under the group rule a sample without a sibling gets advantage 0: n=1 would learn nothing."""
    line = [*VERL_LINE, f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=1"]
    with pytest.raises(pf.VerlPreflightError) as err:
        pf.preflight(TWO_BY_EIGHT, CLUSTER + line)
    assert f"algorithm.adv_estimator={estimator}" in str(err.value) and "rollout.n=2" in str(err.value)
    pf.check_group_size(pf.compose(CLUSTER + [*line[:-1], "actor_rollout_ref.rollout.n=2"]))
    gae = [*VERL_LINE, "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1"]
    pf.check_group_size(pf.compose(CLUSTER + gae))  # no groups: n=1 is fine


def test_plus_adds_a_key_on_purpose():
    config = pf.preflight(TWO_BY_EIGHT, CLUSTER + VERL_LINE + ["+trainer.my_note=hello"])
    assert config.trainer.my_note == "hello"


def test_verls_own_validation_runs():
    with pytest.raises(pf.VerlPreflightError) as err:
        pf.preflight(TWO_BY_EIGHT, CLUSTER + VERL_LINE + ["data.train_batch_size=32"])
    assert str(err.value) == (
        "verl rejected the config: train_batch_size (32) must be >= actor.ppo_mini_batch_size (64)"
    )


STANDALONE = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=1"]


def test_standalone_rollout_nodes_are_taken_from_the_trainers_share():
    three = pf.ClusterShape(3, 8)
    assert pf.cluster_overrides(three, STANDALONE) == ["trainer.nnodes=2", "trainer.n_gpus_per_node=8"]
    with pytest.raises(pf.VerlPreflightError, match=r"need 4 nodes \(trainer 3, rollout 1\) .* --nodes 4"):
        pf.cluster_overrides(three, [*STANDALONE, "trainer.nnodes=3"])
    # One node (local, logical GPUs): replicas share it with the trainer.
    assert pf.cluster_overrides(pf.ClusterShape(1, 1), STANDALONE)[0] == "trainer.nnodes=1"
    # Replicas on Modal GPUs of their own (modal_vllm) take no cluster node.
    modal_replicas = [*STANDALONE, "actor_rollout_ref.rollout.name=modal_vllm"]
    assert pf.cluster_overrides(three, modal_replicas)[0] == "trainer.nnodes=3"
    # hybrid_engine on (the default): rollout.nnodes is not a pool of its own.
    assert pf.cluster_overrides(three, STANDALONE[1:])[0] == "trainer.nnodes=3"


def test_standalone_rollout_pool_counts_against_the_cluster():
    line = [*VERL_LINE, *STANDALONE, "trainer.v1.trainer_mode=separate_async"]
    line += ["actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta"]
    config = pf.compose([*pf.cluster_overrides(TWO_BY_EIGHT, line), *line])
    assert pf.required_gpus(config) == 16  # 1 trainer node + 1 rollout node
    off_cluster = [*line, "actor_rollout_ref.rollout.name=modal_vllm"]
    config = pf.compose([*pf.cluster_overrides(TWO_BY_EIGHT, off_cluster), *off_cluster])
    assert pf.required_gpus(config) == 16  # 2 trainer nodes; the replicas' GPUs are Modal's
    too_many = [*line, "actor_rollout_ref.rollout.nnodes=2"]
    with pytest.raises(
        pf.VerlPreflightError,
        match=r"asks for 32 GPUs \(trainer 2 x 8 \+ rollout 2 x 8\) but the cluster has 2 nodes x 8 = 16; "
        r"use --nodes 4",
    ):
        pf.preflight(TWO_BY_EIGHT, [*pf.cluster_overrides(TWO_BY_EIGHT, too_many), *too_many])


def test_a_missing_mandatory_value_is_named_before_anything_runs():
    line = [o for o in VERL_LINE if not o.startswith("actor_rollout_ref.rollout.name=")]
    with pytest.raises(
        pf.VerlPreflightError, match=r"^verl needs a value for actor_rollout_ref.rollout.name "
    ):
        pf.preflight(TWO_BY_EIGHT, CLUSTER + line)


def test_separate_pools_count_against_the_cluster():
    reward_pool = ["reward.reward_model.enable_resource_pool=True", "reward.reward_model.nnodes=1"]
    reward_pool.append("reward.reward_model.n_gpus_per_node=8")
    with pytest.raises(
        pf.VerlPreflightError, match=r"asks for 24 GPUs \(trainer 2 x 8 \+ reward 1 x 8\) .* use --nodes 3"
    ):
        pf.preflight(TWO_BY_EIGHT, CLUSTER + VERL_LINE + reward_pool)


def test_rollout_tensor_parallel_larger_than_the_cluster_is_refused():
    with pytest.raises(
        pf.VerlPreflightError, match=r"tensor_model_parallel_size=32 exceeds the cluster's 16"
    ):
        pf.preflight(
            TWO_BY_EIGHT, CLUSTER + VERL_LINE + ["actor_rollout_ref.rollout.tensor_model_parallel_size=32"]
        )


# ---- the launcher: exit codes and time, nothing provisioned --------------------------------
MODAL_2x8 = ["--backend", "modal", "--nodes", "2", "--gpu", "H100:8", "--volume", "data:/data"]


def test_nodes_1_with_nnodes_2_exits_2_in_under_10_s():
    out, elapsed = launcher(
        "--backend", "modal", "--nodes", "1", "--gpu", "H100:8", "--preflight-only", "--", "trainer.nnodes=2"
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "verl_modal: trainer.nnodes=2 does not fit: the line's pools need 2 nodes (trainer 2) and the "
        "cluster has 1; use --nodes 2, or drop trainer.nnodes"
    ]
    assert elapsed < 10.0, f"took {elapsed:.1f} s"


def test_unknown_key_exits_2_in_one_line_in_under_10_s():
    out, elapsed = launcher(*MODAL_2x8, "--preflight-only", "--", *VERL_LINE, "trainer.totl_epochs=3")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "verl_modal: unknown key trainer.totl_epochs: verl's ppo_trainer config has no such key "
        "(to add a new key on purpose, write +trainer.totl_epochs=...)"
    ]
    assert elapsed < 10.0, f"took {elapsed:.1f} s"


def test_too_few_gpus_exits_2_before_verl_is_imported():
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size=32"
    out, elapsed = launcher(*MODAL_2x8, "--preflight-only", "--", *VERL_LINE, tp)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"verl_modal: {tp} exceeds the cluster's 16 GPUs"]
    assert elapsed < 10.0, f"took {elapsed:.1f} s"


def test_verl_rejection_exits_2_naming_verl():
    out, _ = launcher(*MODAL_2x8, "--preflight-only", "--", *VERL_LINE, "data.train_batch_size=32")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "verl_modal: verl rejected the config: train_batch_size (32) must be >= actor.ppo_mini_batch_size (64)"
    )


@pytest.mark.slow
def test_a_valid_line_passes_preflight_only():
    out, elapsed = launcher(*MODAL_2x8, "--preflight-only", "--", *CLUSTER, *VERL_LINE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == "preflight ok"
    assert out.stdout == ""
    # Importing verl (torch, tensordict, transformers) is most of it: ~8-11 s on the quiet 2-core
    # dev box, over 30 s under load. A time, so reported, not asserted (benchmarks measure speed).
    print(f"valid preflight took {elapsed:.1f} s")


def test_modal_vllm_needs_a_checkpoint_engine_that_reaches_its_engines():
    line = [*VERL_LINE, *STANDALONE, "actor_rollout_ref.rollout.name=modal_vllm"]
    t0 = time.monotonic()
    with pytest.raises(
        pf.VerlPreflightError,
        match=r"^actor_rollout_ref.rollout.checkpoint_engine.backend=naive cannot update "
        r"actor_rollout_ref.rollout.name=modal_vllm engines .*; set "
        r"actor_rollout_ref.rollout.checkpoint_engine.backend=modal_delta$",
    ):
        pf.preflight(TWO_BY_EIGHT, [*pf.cluster_overrides(TWO_BY_EIGHT, line), *line])
    assert time.monotonic() - t0 < 10.0  # before verl is imported


# ---- mistakes that used to pass silently (issue 27) ----------------------------------------
def test_a_word_for_a_null_default_integer_is_refused():
    bad = ["trainer.total_training_steps=three"]
    with pytest.raises(pf.VerlPreflightError, match=r"total_training_steps=three: verl expects an integer"):
        pf.preflight(TWO_BY_EIGHT, CLUSTER + VERL_LINE + bad, checks=[value_type_check(bad)])
    ok = ["trainer.total_training_steps=3"]
    value_type_check(ok)(pf.compose(CLUSTER + VERL_LINE + ok))


def test_rollout_tensor_parallel_larger_than_a_logical_local_node_is_refused():
    logical = pf.ClusterShape(1, 1, declares_what_is_asked=True)
    line = ["trainer.nnodes=1", "trainer.n_gpus_per_node=1", *VERL_LINE]
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    config = pf.compose([*line, tp])
    with pytest.raises(pf.VerlPreflightError, match=r"size=2 exceeds the 1 logical GPU\(s\).*at least 2$"):
        pf.check_gpus(config, logical)


def test_modal_data_files_must_be_on_a_volume_or_this_machine(tmp_path):
    here = tmp_path / "train.parquet"
    here.write_bytes(b"x")
    check_modal_data_paths([f"data.train_files={here}", "data.val_files=/data/v.parquet"], ["/data"])
    check_modal_data_paths(["data.train_files=[/data/a.parquet,hf://x/y]"], ["/data"])
    with pytest.raises(pf.VerlPreflightError, match=r"data.train_files=/home/me/x is not under any"):
        check_modal_data_paths(["data.train_files=/home/me/x"], ["/data"])
    out, elapsed = launcher(
        "--backend", "modal", "--gpu", "H100:8", "--dry-run", "--json", "--", "data.train_files=/home/me/x"
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "verl_modal: data.train_files=/home/me/x is not under any of the mounted Volumes [] nor on this "
        "machine (local inputs travel with the job), so the containers would lack it; add --volume "
        "NAME:/home with the file(s) on Volume NAME"
    ]
    # a model named by path needs a Volume too; a Hub id is the containers' to fetch
    with pytest.raises(pf.VerlPreflightError, match=r"critic.model.path=/models/q .*--volume NAME:/models"):
        check_modal_data_paths(["critic.model.path=/models/q"], ["/data"])
    check_modal_data_paths(["critic.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.model.path=/m/x"], ["/m"])
    with pytest.raises(pf.VerlPreflightError, match=r"data.val_files=data/v.parquet is relative"):
        check_modal_data_paths(["data.val_files=data/v.parquet"], ["/data"])
    assert elapsed < 10.0, f"took {elapsed:.1f} s"


def test_retries_on_a_one_node_local_run_is_refused():
    out, elapsed = launcher("--retries", "1", "--", "trainer.total_epochs=1")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "verl_modal: --retries restarts a lost cluster, and a one-node --backend local run is in-process "
        "(no cluster); drop --retries, or add --nodes 2 for a local cluster"
    ]
    assert elapsed < 10.0, f"took {elapsed:.1f} s"
