"""A Megatron layer spec for CPU training, for slime's ``--spec``:

    --spec slime_modal.cpu.layer_spec layer_spec

(slime imports ``module.attr`` from the two words, calls ``layer_spec(args, config, vp_stage)``
and builds its GPT model with the result.) It is Megatron's local spec with two changes:

- the pre-attention and pre-MLP norms live inside ``linear_qkv`` / ``linear_fc1`` as their
  ``layer_norm_weight``, the way TransformerEngine's fused layers hold them: slime's HF <->
  Megatron converters know only those parameter names, and the separate norm modules of the
  local spec are left out (``IdentityOp``);
- core attention is torch's ``scaled_dot_product_attention``, causal, over the ``thd`` packed
  sequences slime trains on (each packed sequence attends only to itself), as well as the
  unpacked ``sbhd`` layout; Megatron's own CPU attention refuses packed input.

Tensor parallelism 1 only (the CPU try-out); anything else raises naming the setting.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


class NormedColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` after an RMSNorm whose weight is ``layer_norm_weight``."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"slime_modal.cpu.layer_spec supports RMSNorm models, got {config.normalization}"
            )
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        return super().forward(_rms_norm(input_, self.layer_norm_weight, self.eps), *args, **kwargs)


class PackedSDPA(MegatronModule):
    """Causal attention with torch's SDPA, for packed (``thd``) and unpacked (``sbhd``) input."""

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **kwargs: Any
    ):
        super().__init__(config=config)
        if config.tensor_model_parallel_size != 1 or config.context_parallel_size != 1:
            raise ValueError("slime_modal.cpu.layer_spec: tensor and context parallel size must be 1 on CPU")
        kv = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.scale = kwargs.get("softmax_scale") or config.softmax_scale or 1.0 / math.sqrt(kv)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [b, hq, s, d], k/v [b, hk, s, d]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # query [t, hq, d], key/value [t, hk, d]; segments at the (padded) cumulative offsets
            bounds = packed_seq_params.cu_seqlens_q_padded
            if bounds is None:
                bounds = packed_seq_params.cu_seqlens_q
            out = torch.zeros_like(query)
            edges = bounds.tolist()
            for start, end in zip(edges[:-1], edges[1:], strict=True):
                if end <= start:
                    continue
                q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
                out[start:end] = self._attend(q, k, v).squeeze(0).transpose(0, 1)
            return out.reshape(out.size(0), -1)
        # query [s, b, hq, d], key/value [s, b, hk, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v).permute(2, 0, 1, 3)
        return out.reshape(out.size(0), out.size(1), -1)


def layer_spec(args: Any, config: Any, vp_stage: Any = None):
    """slime's ``--spec`` entry: the local spec with fused norm names and packed SDPA."""
    if getattr(args, "num_experts", None):
        raise ValueError("slime_modal.cpu.layer_spec: dense models only")
    spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    sub = spec.submodules
    sub.input_layernorm = IdentityOp
    sub.pre_mlp_layernorm = IdentityOp
    sub.self_attention.submodules.linear_qkv = NormedColumnParallelLinear
    sub.self_attention.submodules.core_attention = PackedSDPA
    sub.mlp.submodules.linear_fc1 = NormedColumnParallelLinear
    return spec
