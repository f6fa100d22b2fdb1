"""The frameworks' own example scripts, as a new user hands them to ``--backend modal
--dry-run``: each case is a command line written in the shape of one upstream example (named in
``mirrors``), with the plan it must produce or the one line it must be refused with.

Every line runs through the real launcher (``_conformance_runner.py``: one process, verl
imported once) with the Hugging Face Hub pointed at a closed port and ``HF_HUB_OFFLINE``
unset, so a plan that reached for the network would fail here. Each plan is read back as
JSON (``--json``); the summary a user sees by default is checked to stay within 40 lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from tests._slime_lines import GLM47_MODEL, glm47_delta, qwen3_4b

ROOT = Path(__file__).resolve().parents[2]
UV = "ray_kwargs.ray_init.runtime_env.py_executable=uv run --frozen --all-packages --extra vllm --extra fsdp"


def gsm8k(model: str, *more: str) -> list[str]:
    """The GSM8K GRPO core every verl example shares, data and model on Volumes."""
    return [
        "algorithm.adv_estimator=grpo",
        "data.train_files=/data/gsm8k/train.parquet",
        "data.val_files=/data/gsm8k/test.parquet",
        "data.train_batch_size=256",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.total_epochs=1",
        *more,
    ]


def modal(nodes: int, *more: str, gpu: str = "H100:8") -> list[str]:
    return ["--backend", "modal", "--nodes", str(nodes), "--gpu", gpu, *more]


VERL_VOLUMES = ["--volume", "data:/data", "--volume", "models:/models"]
MEGATRON = ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml"]


@dataclass
class Case:
    name: str
    mirrors: str  # the upstream script whose shape the line has
    module: str
    flags: list[str]
    line: list[str]
    # a plan: {dotted path in the --json plan: value}; or a refusal: the line's start
    plan: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    notes: list[str] = field(default_factory=list)  # stderr lines the plan must come with


VERL = version("verl")
CASES = [
    Case(
        "verl GRPO 2x8 H100 (uv runtime env)",
        "verl examples/grpo_trainer/run_qwen3_4b_fsdp.sh (Qwen3-8B, 2 x 8, uv runtime env)",
        "verl_modal",
        modal(2, *VERL_VOLUMES),
        gsm8k("Qwen/Qwen3-8B", "actor_rollout_ref.rollout.tensor_model_parallel_size=2", UV),
        plan={
            "image.framework": f"verl[vllm,fsdp]=={VERL}",
            "spec.rdma": True,
            "modal_function.inspected.rdma": True,
            "modal_function.inspected.gpu": "H100:8",
            "verl.pool_placement": {"global_pool": [0, 1]},
            "entrypoint[4:6]": ["trainer.nnodes=2", "trainer.n_gpus_per_node=8"],
            "has override": "ray_kwargs.ray_init.runtime_env.py_executable=null",
        },
        notes=["runs a uv workspace on this machine"],
    ),
    Case(
        "verl PPO with a critic, models on a Volume",
        "verl examples/ppo_trainer/run_deepseek7b_llm.sh",
        "verl_modal",
        modal(1, *VERL_VOLUMES),
        [
            *gsm8k("/models/deepseek-llm-7b-chat")[1:],
            "algorithm.adv_estimator=gae",
            "critic.model.path=/models/deepseek-llm-7b-chat",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "critic.optim.lr=1e-5",
        ],
        plan={"image.framework": f"verl[vllm,fsdp]=={VERL}", "spec.rdma": False},
    ),
    Case(
        "verl PPO with a critic model on no Volume",
        "verl examples/ppo_trainer/run_deepseek7b_llm.sh",
        "verl_modal",
        modal(1, "--volume", "data:/data"),
        [*gsm8k("deepseek-ai/deepseek-llm-7b-chat"), "critic.model.path=/models/deepseek-llm-7b-chat"],
        refused="verl_modal: critic.model.path=/models/deepseek-llm-7b-chat is not under any of the mounted "
        "Volumes ['/data']",
    ),
    Case(
        "verl RLOO",
        "verl examples/rloo_trainer/ (RLOO on GSM8K)",
        "verl_modal",
        modal(1, *VERL_VOLUMES),
        [*gsm8k("Qwen/Qwen2-7B-Instruct")[1:], "algorithm.adv_estimator=rloo"],
        plan={"verl.pool_placement": {}},
    ),
    Case(
        "verl GSPO",
        "verl examples/gspo_trainer/ (GSPO loss mode)",
        "verl_modal",
        modal(2, *VERL_VOLUMES),
        gsm8k(
            "Qwen/Qwen3-8B",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.clip_ratio_low=0.0003",
            "actor_rollout_ref.actor.clip_ratio_high=0.0004",
        ),
        plan={"spec.rdma": True},
    ),
    Case(
        "verl LoRA GRPO",
        "verl examples/grpo_trainer/run_qwen3-4b_gsm8k_grpo_lora_merge.sh",
        "verl_modal",
        modal(1, *VERL_VOLUMES),
        gsm8k(
            "Qwen/Qwen2.5-3B-Instruct",
            "actor_rollout_ref.model.lora_rank=64",
            "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.rollout.load_format=safetensors",
        ),
        plan={"image.framework": f"verl[vllm,fsdp]=={VERL}"},
    ),
    Case(
        "verl Megatron with grad_offload (removed in verl 0.9.1)",
        "verl examples/grpo_trainer/run_qwen2-7b_math_megatron.sh",
        "verl_modal",
        modal(2, *VERL_VOLUMES),
        [*MEGATRON, *gsm8k("Qwen/Qwen2-7B-Instruct"), "actor_rollout_ref.actor.megatron.grad_offload=True"],
        refused="verl_modal: unknown key actor_rollout_ref.actor.megatron.grad_offload: verl 0.9.1 removed "
        "it (param_offload and optimizer_offload remain); drop it",
    ),
    Case(
        "verl Megatron",
        "verl examples/grpo_trainer/run_qwen2-7b_math_megatron.sh",
        "verl_modal",
        modal(2, *VERL_VOLUMES),
        [
            *MEGATRON,
            *gsm8k("Qwen/Qwen2-7B-Instruct"),
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.param_offload=True",
        ],
        plan={
            "image.framework": f"verl[vllm,megatron]=={VERL}",
            "image.pinned.megatron-bridge": "*",
            "verl.config_name": "ppo_megatron_trainer",
            "entrypoint[:5]": ["python", "-m", "verl_modal.launch", "--config-name", "ppo_megatron_trainer"],
        },
    ),
    Case(
        "verl vision-language GRPO",
        "verl examples/grpo_trainer/run_qwen2_5_vl_7b_vllm_fsdp.sh",
        "verl_modal",
        modal(1, *VERL_VOLUMES),
        [
            *gsm8k("Qwen/Qwen2.5-VL-7B-Instruct")[:1],
            "data.train_files=/data/geo3k/train.parquet",
            "data.val_files=/data/geo3k/test.parquet",
            "data.image_key=images",
            *gsm8k("Qwen/Qwen2.5-VL-7B-Instruct")[3:],
        ],
        plan={"image.framework": f"verl[vllm,fsdp]=={VERL}"},
    ),
    Case(
        "verl 72B on 4 nodes",
        "verl examples/grpo_trainer/run_qwen2_5_32b_fsdp.sh scaled to Qwen2.5-72B on 4 x 8",
        "verl_modal",
        modal(4, *VERL_VOLUMES),
        gsm8k(
            "/models/Qwen2.5-72B-Instruct",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        ),
        plan={"spec.rdma": True, "verl.pool_placement": {"global_pool": [0, 1, 2, 3]}},
    ),
    Case(
        "verl 671B Megatron on 16 nodes",
        "verl examples/grpo_trainer/run_deepseek_v3_671b_megatron.sh",
        "verl_modal",
        modal(16, *VERL_VOLUMES),
        [
            *MEGATRON,
            *gsm8k("/models/DeepSeek-V3-0324"),
            "actor_rollout_ref.rollout.tensor_model_parallel_size=32",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=16",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
            "actor_rollout_ref.actor.megatron.param_offload=True",
            "actor_rollout_ref.actor.megatron.optimizer_offload=True",
            "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=16",
            "actor_rollout_ref.ref.megatron.expert_model_parallel_size=8",
        ],
        plan={
            "spec.nodes": 16,
            "spec.rdma": True,
            "image.framework": f"verl[vllm,megatron]=={VERL}",
            "modal_function.inspected.cluster_size": 16,
        },
    ),
    Case(
        "verl 671B on too few nodes",
        "verl examples/grpo_trainer/run_deepseek_v3_671b_megatron.sh",
        "verl_modal",
        modal(8, *VERL_VOLUMES),
        [*MEGATRON, *gsm8k("/models/DeepSeek-V3-0324"), "trainer.nnodes=16"],
        refused="verl_modal: trainer.nnodes=16 does not fit: the line's pools need 16 nodes (trainer 16) "
        "and the cluster has 8; use --nodes 16, or drop trainer.nnodes",
    ),
    Case(
        "verl fully-async (trainer 1 node, rollout 1 node)",
        "verl verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_12.sh",
        "verl_modal",
        modal(2, *VERL_VOLUMES),
        [
            "python3",
            "-m",
            "verl.experimental.fully_async_policy.fully_async_main",
            "--config-path=config",
            "--config-name=fully_async_ppo_trainer.yaml",
            *gsm8k("Qwen/Qwen2.5-7B-Instruct"),
            "data.train_batch_size=0",
            "actor_rollout_ref.hybrid_engine=False",
            "trainer.nnodes=1",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=8",
        ],
        plan={
            "entrypoint[:3]": ["python", "-m", "verl.experimental.fully_async_policy.fully_async_main"],
            "verl.main": "verl.experimental.fully_async_policy.fully_async_main",
            "verl.pool_placement.global_pool": [0],
        },
    ),
    Case(
        "verl on-policy distillation, teacher pool",
        "verl on-policy distillation (distillation.enabled, teacher pool)",
        "verl_modal",
        modal(2, *VERL_VOLUMES),
        gsm8k(
            "Qwen/Qwen3-1.7B",
            "distillation.enabled=true",
            "distillation.nnodes=1",
            "distillation.n_gpus_per_node=8",
            "distillation.teacher_models.teacher_model.model_path=/models/Qwen3-8B",
        ),
        plan={"entrypoint[4:6]": ["trainer.nnodes=1", "trainer.n_gpus_per_node=8"]},
    ),
    Case(
        "verl on-policy distillation on one node",
        "verl on-policy distillation (distillation.enabled, teacher pool)",
        "verl_modal",
        modal(1, *VERL_VOLUMES),
        gsm8k(
            "Qwen/Qwen3-1.7B",
            "trainer.nnodes=1",
            "distillation.enabled=true",
            "distillation.nnodes=1",
            "distillation.n_gpus_per_node=8",
            "distillation.teacher_models.teacher_model.model_path=/models/Qwen3-8B",
        ),
        refused="verl_modal: the config asks for 16 GPUs (trainer 1 x 8 + teacher 1 x 8) but the cluster has "
        "1 nodes x 8 = 8; use --nodes 2",
    ),
    Case(
        "verl local working_dir",
        "verl examples (runtime_env.working_dir=. from a checkout)",
        "verl_modal",
        modal(1, *VERL_VOLUMES),
        gsm8k("Qwen/Qwen3-8B", "++ray_kwargs.ray_init.runtime_env.working_dir=./recipe"),
        refused="verl_modal: ray_kwargs.ray_init.runtime_env.working_dir=./recipe: Ray would upload",
    ),
    Case(
        "verl bad GPU count",
        "any verl example with --gpu H100:16",
        "verl_modal",
        modal(1, gpu="H100:16"),
        gsm8k("Qwen/Qwen3-8B"),
        refused="verl_modal: gpu='H100:16': Modal gives one container at most 8 H100 GPUs",
    ),
    Case(
        "verl Volume at /root",
        "any verl example with --volume x:/root",
        "verl_modal",
        modal(1, "--volume", "x:/root"),
        gsm8k("Qwen/Qwen3-8B"),
        refused="verl_modal: --volume x:/root: Modal cannot mount a Volume at /root",
    ),
    # ---- slime -------------------------------------------------------------------------
    Case(
        "slime Qwen3-4B with a Volume at /root",
        "slime scripts/run-qwen3-4B.sh",
        "slime_modal",
        modal(1, "--data-volume", "slime-data", "--ckpt-volume", "slime-ckpt:/root"),
        qwen3_4b(root="/data"),
        refused="slime_modal: --volume",
    ),
    Case(
        "slime Qwen3-4B with its files on Volumes",
        "slime scripts/run-qwen3-4B.sh",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        qwen3_4b(root="/data"),
        plan={"slime.entry": "/root/slime/train.py", "spec.rdma": False, "slime.gpus.required": 8},
    ),
    Case(
        "slime Qwen3-30B-A3B on 2 nodes",
        "slime scripts/run-qwen3-30B-A3B.sh",
        "slime_modal",
        modal(2, "--volume", "slime-data:/data"),
        [
            *qwen3_4b(root="/data")[:1],
            "2",
            *qwen3_4b(root="/data")[2:],
            "--num-experts",
            "128",
            "--moe-router-topk",
            "8",
            "--expert-model-parallel-size",
            "8",
        ],
        plan={"spec.rdma": True, "slime.gpus.required": 16, "modal_function.inspected.rdma": True},
    ),
    Case(
        "slime Qwen3-235B-A22B on 4 nodes, one too few",
        "slime scripts/run-qwen3-235B-A22B.sh",
        "slime_modal",
        modal(3, "--volume", "slime-data:/data"),
        ["--actor-num-nodes", "4", "--actor-num-gpus-per-node", "8", "--colocate"],
        refused="slime_modal: slime asks for 32 GPUs",
    ),
    Case(
        "slime GLM-4.7 delta weight sync",
        "slime examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh",
        "slime_modal",
        modal(
            4,
            "--volume",
            "models:/root/models",
            "--volume",
            "datasets:/root/datasets",
            "--volume",
            "glm-delta:/shared/fs",
        ),
        glm47_delta(),
        plan={"spec.rdma": True, "slime.gpus.required": 32},
    ),
    Case(
        "slime GLM-4.7 without RDMA",
        "slime examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh",
        "slime_modal",
        modal(
            4,
            "--no-rdma",
            "--volume",
            "models:/root/models",
            "--volume",
            "datasets:/root/datasets",
            "--volume",
            "glm-delta:/shared/fs",
        ),
        glm47_delta(),
        plan={"spec.rdma": False},
        notes=["RDMA is off for this 4-node H100 cluster (--no-rdma)"],
    ),
    Case(
        "slime DeepSeek-R1 eval data off every Volume",
        "slime scripts/run-deepseek-r1.sh",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate", *GLM47_MODEL[:4]]
        + ["--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl"],
        refused="slime_modal: --eval-prompt-data /root/aime-2024/aime-2024.jsonl is not under any of the "
        "mounted Volumes",
    ),
    Case(
        "slime fully-async",
        "slime examples/fully_async/run-qwen3-4b-fully_async.sh",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        [
            "--actor-num-nodes",
            "1",
            "--actor-num-gpus-per-node",
            "4",
            "--rollout-num-gpus",
            "4",
            "--rollout-function-path",
            "fully_async_rollout.generate_rollout_fully_async",
            "--hf-checkpoint",
            "/data/Qwen3-4B",
            "--prompt-data",
            "/data/dapo-math-17k.jsonl",
        ],
        plan={
            "slime.entry": "/root/slime/train_async.py",
            "slime.example_paths": ["/root/slime/examples/fully_async"],
        },
        notes=["running train_async.py"],
    ),
    Case(
        "slime fully-async pasted with its python3 train_async.py head",
        "slime examples/fully_async/run-qwen3-4b-fully_async.sh (the ray job submit line as is)",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        ["python3", "train_async.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4"]
        + [
            "--rollout-num-gpus",
            "4",
            "--rollout-function-path",
            "fully_async_rollout.generate_rollout_fully_async",
        ],
        plan={"slime.entry": "/root/slime/train_async.py", "slime.argv[:2]": ["--actor-num-nodes", "1"]},
    ),
    Case(
        "slime retool",
        "slime examples/retool/retool_qwen3_4b_rl.sh",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        [*qwen3_4b(root="/data")]
        + ["--custom-generate-function-path", "generate_with_retool.generate"]
        + ["--custom-rm-path", "generate_with_retool.reward_func"],
        plan={"slime.example_paths": ["/root/slime/examples/retool"]},
    ),
    Case(
        "slime search-r1",
        "slime examples/search-r1/run_qwen2.5_3B.sh",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        [*qwen3_4b(root="/data")]
        + ["--custom-generate-function-path", "generate_with_search.generate"]
        + ["--custom-rm-path", "generate_with_search.reward_func"],
        plan={"slime.example_paths": ["/root/slime/examples/search-r1"]},
    ),
    Case(
        "slime multi-agent",
        "slime examples/multi_agent/run-qwen3-30B-A3B-multi-agent.sh",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        [*qwen3_4b(root="/data")]
        + [
            "--custom-generate-function-path",
            "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents",
        ],
        plan={"slime.example_paths": [], "slime.entry": "/root/slime/train.py"},
    ),
    Case(
        "slime on-policy distillation, teacher on localhost",
        "slime examples/on_policy_distillation/run-qwen3-8B-opd.sh",
        "slime_modal",
        modal(1, "--volume", "slime-data:/data"),
        ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4"]
        + ["--custom-rm-path", "examples.on_policy_distillation.on_policy_distillation.reward_func"]
        + ["--rm-url", "http://127.0.0.1:13141/generate"],
        refused="slime_modal: --rm-url http://127.0.0.1:13141/generate: the line expects a server on the job's "
        "own node",
    ),
]


def _get(plan: dict, path: str):
    """``a.b.c`` in the plan; ``key[i:j]`` slices a list."""
    value: Any = plan
    for part in path.split("."):
        if "[" in part:
            name, _, cut = part.partition("[")
            start, _, end = cut.rstrip("]").partition(":")
            value = value[name][int(start or 0) : int(end) if end else None]
        else:
            value = value[part]
    return value


def _run(cases: list[tuple[str, list[str]]], tmp_path: Path) -> list[dict]:
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([{"module": m, "argv": a} for m, a in cases]))
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", RAY_AUTH_MODE="disabled")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_conformance_runner.py"), str(spec)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("conformance")
    argvs = [(c.module, [*c.flags, "--dry-run", "--json", "--", *c.line]) for c in CASES]
    # the default output, for two lines: the summary a user reads
    argvs += [(c.module, [*c.flags, "--dry-run", "--", *c.line]) for c in CASES[:1] + CASES[-5:-4]]
    got = _run(argvs, tmp)
    named = {c.name: r for c, r in zip(CASES, got, strict=False)}
    named["summary verl"], named["summary slime"] = got[len(CASES) :]
    return named


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_example_line_gets_its_plan_or_one_line_refusal(case: Case, results):
    got = results[case.name]
    assert "Traceback" not in got["stderr"], got["stderr"][-2000:]
    if case.refused is not None:
        assert got["code"] == 2, (got["code"], got["stderr"][-1500:])
        lines = got["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(case.refused), lines
        assert got["stdout"] == ""
        return
    assert got["code"] == 0, got["stderr"][-1500:]
    plan = json.loads(got["stdout"])
    for path, want in case.plan.items():
        if path == "has override":
            assert want in plan["verl"]["overrides"], plan["verl"]["overrides"]
            continue
        value = _get(plan, path)
        assert value == want or (want == "*" and value), (path, value)
    for note in case.notes:
        assert note in got["stderr"], got["stderr"]
    assert plan["preflight"] == "ok"


@pytest.mark.slow
def test_default_output_is_a_summary_of_at_most_40_lines(results):
    for name in ("summary verl", "summary slime"):
        got = results[name]
        assert got["code"] == 0, got["stderr"][-1500:]
        lines = got["stdout"].splitlines()
        assert 5 < len(lines) <= 40, lines
        assert lines[0].startswith("plan (modal):") and lines[-1].startswith("preflight: ok")
        assert not got["stdout"].lstrip().startswith("{")
