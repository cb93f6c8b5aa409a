"""The built-in builder's mixture-of-experts block, as transformers 5.25.0 runs it.

transformers 5 holds a MoE layer's experts as two fused 3-D parameters (``gate_up_proj``: experts x 2 intermediate x
hidden, ``down_proj``: experts x hidden x intermediate; ``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``) and dispatches their forward by ``config._experts_implementation``
(``integrations/moe.py``, ``use_experts_implementation``). ``from_pretrained`` sets it to ``"grouped_mm"``
wherever the class is decorated (``get_correct_experts_implementation``), and on CUDA (SM80+, torch 2.13's
``F.grouped_mm``) that is what runs: :func:`grouped_experts` is ``grouped_mm_experts_forward``, op for op and local
for local. Its tensors do not depend on the routing (the tokens are sorted by expert, and every grouped matmul
covers all of them), so the memory of any routing is this one.

The routers (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``) differ in two ways: Mixtral
takes the softmax of ``logits.float()`` and always normalises the top-k weights in place, keeping them fp32 (the
routed outputs are then weighted in fp32); the Qwen routers take ``softmax(dtype=float)``, normalise only where
``norm_topk_prob`` (Qwen3-MoE's released models; Qwen2MoeConfig's default is off) and cast the weights to the
logits' dtype. Qwen1.5/2-MoE adds a shared expert (a gated MLP of ``nn.Linear``s, run first) scaled by
``sigmoid(shared_expert_gate(x))``.

The experts are parameters, not ``nn.Linear``: bitsandbytes' quantizer leaves them in 16 bits under QLoRA (peft's
k-bit preparation then upcasts them to fp32 where it upcasts), and ``F.grouped_mm`` is not on autocast's lists
(transformers casts the input to the weights' dtype). For non-bf16 operands CUDA's ``_grouped_mm`` runs its
fallback (a loop of ``mm_out`` into the one output): :func:`cuda_fallback` lets the meta kernel, which refuses
them, answer as CUDA does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vramlab.core.families.registry import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from vramlab.core.spec.model import MlpKind

_ORIGINAL: list = []


@contextlib.contextmanager
def cuda_fallback() -> Iterator[None]:
    """torch 2.13's meta kernel for ``aten._grouped_mm`` checks for bf16 operands, as its CUDA fast path needs; CUDA
    itself then runs ``_grouped_mm_fallback`` (``ATen/native/cuda/GroupedBlas.cpp``: the output allocated as the fast
    path does, each group's ``mm_out`` written into it). Within this block a float operand pair of another dtype is
    answered with the output the fallback makes (the fast path's layout, in that dtype)."""
    import torch._meta_registrations as meta

    if _ORIGINAL:  # nested: the outer block's patch holds
        yield
        return
    original = meta._meta_grouped_mm_common

    def common(mat_a: torch.Tensor, mat_b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        dtype = mat_a.dtype
        if kwargs.get("scale_a") is None and dtype == mat_b.dtype and dtype in (torch.float32, torch.float16):
            original(*(torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta")
                       for t in (mat_a, mat_b)), **kwargs)  # its other checks
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, kwargs.get("offs"), kwargs.get("out_dtype"))
        return original(mat_a, mat_b, **kwargs)

    meta._meta_grouped_mm_common = common
    _ORIGINAL.append(original)
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = _ORIGINAL.pop()


class Experts(nn.Module):
    """``<Family>SparseMoeBlock``: the router, the fused experts (and Qwen2-MoE's shared expert), in transformers'
    parameter order (Qwen3-MoE registers its experts before its router)."""

    def __init__(self, plan, trainable: bool, linear: type, act: Callable[[torch.Tensor], torch.Tensor]) -> None:  # noqa: ANN001 - model.py's Plan
        super().__init__()
        spec = plan.spec
        self.plan, self.family, self.act = plan, spec.moe_family, act
        E, h, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate
        self.gated = spec.mlp_kind is MlpKind.GATED
        self.k = spec.experts_per_token
        # submodules in the family's order (the optimizer's order): Qwen3-MoE registers its experts first
        if self.family != QWEN3_MOE:
            self.router = linear(spec.router_linear(), plan, trainable, False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = plan.new_param(E, (2 if self.gated else 1) * inter, h, trainable=trainable)
        self.experts.down_proj = plan.new_param(E, h, inter, trainable=trainable)
        if self.family == QWEN3_MOE:
            self.router = linear(spec.router_linear(), plan, trainable, False)
        self.shared = None
        if self.family == QWEN2_MOE:
            sh = spec.shared_expert_linears()
            self.shared = nn.ModuleDict({s.name: linear(s, plan, trainable, False) for s in sh})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x2 = x.view(-1, h)
        shared = None
        if self.shared is not None:  # Qwen2MoeSparseMoeBlock: the shared expert first
            sh = self.shared
            shared = sh["shared_down_proj"](self.act(sh["shared_gate_proj"](x2)) * sh["shared_up_proj"](x2))
        _, weights, chosen = self._route(x2)  # the router's logits bound to ``_`` to the block's return
        out = grouped_experts(self, x2, chosen, weights)
        if shared is not None:
            shared = torch.sigmoid(self.shared["shared_expert_gate"](x2)) * shared
            out = out + shared
        return out.reshape(b, s, h)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.router(x)
        if self.family == MIXTRAL:  # MixtralTopKRouter
            probs = F.softmax(logits.float(), dim=-1)
            top, chosen = torch.topk(probs, self.k, dim=-1)
            top /= top.sum(dim=-1, keepdim=True)
            return logits, top, chosen
        probs = F.softmax(logits, dtype=torch.float, dim=-1)  # Qwen2MoeTopKRouter / Qwen3MoeTopKRouter
        top, chosen = torch.topk(probs, self.k, dim=-1)
        if self.family != QWEN2_MOE:  # norm_topk_prob: Qwen3-MoE's (hfconfig.py), not Qwen2MoeConfig's default
            top /= top.sum(dim=-1, keepdim=True)
        top = top.to(logits.dtype)
        return logits, top, chosen

    def apply_gate(self, proj: torch.Tensor) -> torch.Tensor:
        """``_default_apply_gate``: chunk, the activation of the gate half, times the up half."""
        if not self.gated:
            return self.act(proj)
        gate, up = proj.chunk(2, dim=-1)
        return self.act(gate) * up


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``_grouped_linear`` (not transposed, no bias) through ``_grouped_mm``: the input cast to the weights' dtype."""
    return F.grouped_mm(x.to(weight.dtype), weight.transpose(-2, -1), offs=offsets)


def grouped_experts(self: Experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5.25.0 ``grouped_mm_experts_forward`` (no expert parallelism, bias or post-expert norm)."""
    num_top_k = top_k_index.size(-1)
    num_tokens = hidden_states.size(0)
    hidden_dim = hidden_states.size(-1)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected_hidden_states_g = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    # histc: float on the CPU, int32 on CUDA (both 4 bytes a routed token)
    histc_input = expert_ids_g.float()
    num_experts = self.experts.gate_up_proj.size(0)
    tokens_per_expert = torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    proj_out = _grouped_linear(selected_hidden_states_g, self.experts.gate_up_proj, offsets)
    proj_out = self.apply_gate(proj_out)
    proj_out = _grouped_linear(proj_out, self.experts.down_proj, offsets)
    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=hidden_states.device)
    weighted_out = weighted_out[inv_perm]
    final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final_hidden_states.to(hidden_states.dtype)
