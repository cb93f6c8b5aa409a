"""fla's gated delta rule (flash-linear-attention / fla-core 0.6.0, ``fla/ops/gated_delta_rule/chunk.py``): the
``chunk_gated_delta_rule`` that transformers >= 5.25 runs on CUDA for the linear attention of Qwen3.5, Qwen3-Next,
OLMo-Hybrid and the other families whose ``torch_chunk_gated_delta_rule`` is decorated
``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`` (kernels-community/fla's layer, the
Hub kernels being on by default; with them off, a run with flash-linear-attention installed calls the same function,
one without runs the torch path, which is what is counted then), as its autograd Function
``ChunkGatedDeltaRuleFunction`` allocates around its Triton kernels (the values here are not the rule's output: the
bytes are).

Forward (``input_guard``: every tensor argument made contiguous, the copies held until it returns): with
``use_qk_l2norm_in_kernel`` (transformers passes True) q and k L2-normalised into new tensors of their dtype with an
fp32 ``rstd`` per row; the gate's chunk-local cumsum (fp32, ``chunk_local_cumsum``); the WY representation ``A``
(zeros, (B, T, HV, 64) in k's dtype), ``w`` (B, T, HV, K) and ``u`` (v's shape); the chunk states ``h``
(B, NT, HV, K, V in k's dtype, NT = ceil(T / 64)) and ``v_new``; the output (v's shape). It saves the normalised q
and k, their rstd, v, the cumsum gate, beta and ``A``: ``w``, ``u``, ``h`` and ``v_new`` are freed as it returns and
recomputed in backward. Backward: ``w`` / ``u`` / ``h`` / ``v_new`` again, the local dv, the state gradients ``dh``
(h's shape) and dv2, then dq / dk at the value heads (summed to the key heads where HV > H), an fp32 ``dg`` per
K-block (``NK = ceil(K / BK)``, BK = 128 on Hopper; on Ampere / Ada kernels-community/fla's build takes 64, one more
fp32 (B, T, HV) block where K = 128, not modelled) and ``dw``, the WY gradients, the gate's reverse cumsum and the
L2 norm's backward. kernels-community/fla (huggingface/kernels-community ``fla/torch-ext``, the layer
``chunk_gated_delta_rule`` calling ``chunk_gated_delta_rule(query, key, value, g=g, beta=beta, chunk_size=64, ...)``)
vendors this same Python, allocation for allocation, without fla's backend dispatch.

And the gated norm (``FusedRMSNormGated``, :class:`LayerNormGatedFunction`), which kernels-community/fla's layer
puts in place of the forward of every module decorated ``use_kernel_forward_from_hub("RMSNormGated")``.

Not modelled: fla's FlashQLA backend (an installed fla with ``flash_qla``, Hopper / Blackwell, K = V = 128), which
replaces this path with its own TileLang kernels; packed sequences (``cu_seqlens``: the torch path is counted).
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn

from vramlab.core.simulation.kernel_binding import bind_funcs
from vramlab.core.spec.liger import LIGER_SM_COUNT

CHUNK = 64  # transformers passes no chunk_size: fla's default
LAYER = "chunk_gated_delta_rule"  # the name the decorated torch function carries (use_kernel_func_from_hub...)
NORM_LAYER = "RMSNormGated"  # the name the decorated gated norms carry (use_kernel_forward_from_hub)
RCP_LN2 = 1.4426950216
CONST_TILING = 128  # chunk_bwd_dqkwg's on Hopper (and Ampere with 16-bit tensors)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _contiguous(fn):  # noqa: ANN001, ANN202
    """fla's ``input_guard``: every tensor argument made contiguous (a copy only where it is not), the copies held
    until the function returns."""
    def wrapper(ctx, *args):  # noqa: ANN001, ANN002, ANN202
        processed = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
        return fn(ctx, *processed)
    return wrapper


def l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    x = x.view(-1, x.shape[-1])
    y = torch.empty_like(x)
    rstd = torch.empty((x.shape[0],), dtype=torch.float32, device=x.device)
    return y.view(shape), rstd.view(shape[:-1])


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    shape = y.shape
    y = y.view(-1, dy.shape[-1])
    dx = torch.empty_like(y)
    return dx.view(shape)


def chunk_local_cumsum(g: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(g, dtype=torch.float)


def recompute_w_u_fwd(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, _, K = k.shape
    w = k.new_empty(B, T, v.shape[2], K)
    u = torch.empty_like(v)
    return w, u


def fwd_h(k: torch.Tensor, u: torch.Tensor, initial_state: torch.Tensor | None,
          output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    B, T, _, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    h = k.new_empty(B, _cdiv(T, CHUNK), HV, K, V)
    final_state = k.new_zeros(B, HV, K, V, dtype=torch.float32) if output_final_state else None
    v_new = torch.empty_like(u)
    return h, v_new, final_state


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state, output_final_state):  # noqa: ANN001, ANN201
    g = chunk_local_cumsum(g)
    B, T, _, _ = k.shape
    A = torch.zeros(B, T, v.shape[2], CHUNK, device=k.device, dtype=k.dtype)
    w, u = recompute_w_u_fwd(k, v)
    h, v_new, final_state = fwd_h(k, u, initial_state, output_final_state)
    o = torch.empty_like(v_new)
    return g, o, A, final_state, initial_state


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """A value-heads gradient summed onto the key heads (``view(B, T, H, HV // H, K).sum(3)``)."""
    B, T, HV, K = x.shape
    return x.view(B, T, H, HV // H, K).sum(3) if HV != H else x


def bwd_dhu(q: torch.Tensor, h: torch.Tensor, h0: torch.Tensor | None,
            dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``chunk_gated_delta_rule_bwd_dhu``: the state gradients (h's shape, q's dtype), h0's (fp32) and dv2."""
    dh = q.new_empty(h.shape)
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(dv)
    return dh, dh0, dv2


def chunk_bwd_dqkwg(q, k, w, g):  # noqa: ANN001, ANN201
    B, T, H, K = k.shape
    HV = w.shape[2]
    BK = min(max(1 << (K - 1).bit_length(), 16), CONST_TILING)
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dg = torch.empty(_cdiv(K, BK), *g.shape, dtype=torch.float32, device=g.device)
    dw = torch.empty_like(w)
    if H != HV:
        dq = _heads(dq, H)
        dk = _heads(dk, H)
    dg = dg.sum(0)
    return dq, dk, dw, dg


def prepare_wy_repr_bwd(k, v, beta, g):  # noqa: ANN001, ANN201
    B, T, H, K = k.shape
    dk = k.new_empty(B, T, v.shape[2], K)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    db = torch.empty_like(beta)
    if H != v.shape[2]:
        dk = _heads(dk, H)
    return dk, dv, db, dg


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, initial_state, do):  # noqa: ANN001, ANN201
    w, u = recompute_w_u_fwd(k, v)
    h, v_new, _ = fwd_h(k, u, initial_state, False)
    dv = torch.empty_like(do)  # chunk_bwd_dv_local
    dh, dh0, dv = bwd_dhu(q, h, initial_state, dv)
    dq, dk, dw, dg = chunk_bwd_dqkwg(q, k, w, g)
    dk2, dv, db, dg2 = prepare_wy_repr_bwd(k, v, beta, g)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = chunk_local_cumsum(dg)
    return dq, dk, dv, db, dg, dh0


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """``ChunkGatedDeltaRuleFunction`` as transformers calls it (no packed sequences, the gate and beta computed
    outside the kernel, chunk 64): see the module's docstring."""

    @staticmethod
    @_contiguous
    @torch.amp.custom_fwd(device_type="cuda")  # fla's autocast_custom_fwd: backward runs in forward's autocast state
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state,  # noqa: ANN001, ANN205
                use_qk_l2norm_in_kernel):
        q_rstd, k_rstd = None, None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = l2norm_fwd(q)
            k, k_rstd = l2norm_fwd(k)
        g, o, A, final_state, initial_state = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state,
                                                                         output_final_state)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, initial_state)
        ctx.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel
        return o.to(q.dtype), final_state

    @staticmethod
    @_contiguous
    @torch.amp.custom_bwd(device_type="cuda")  # under autocast, the value-to-key head sums run in fp32 (sum's list)
    def backward(ctx, do, dht):  # noqa: ANN001, ANN205
        q, q_rstd, k, k_rstd, v, g, beta, A, initial_state = ctx.saved_tensors
        dq, dk, dv, db, dg, dh0 = chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, initial_state, do)
        if ctx.use_qk_l2norm_in_kernel:
            dq = l2norm_bwd(q, q_rstd, dq)
            dk = l2norm_bwd(k, k_rstd, dk)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), None, dh0, None, None


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           **_kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` (its checks pass for transformers' calls): the Function above."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel)


def _forward(self: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object,
             **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kwargs.get("cu_seqlens") is not None:  # packed sequences: fla's chunk indices are not modelled
        return type(self).forward(self, query, key, value, *args, **kwargs)
    kwargs.pop("chunk_size", None)
    return chunk_gated_delta_rule(query, key, value, *args, **kwargs)


class LayerNormGatedFunction(torch.autograd.Function):
    """fla's ``LayerNormGatedFunction`` (``fla/modules/fused_norm_gate.py``) as kernels-community/fla's
    ``FusedRMSNormGated`` calls it (``rms_norm_gated``: no bias, no residual, not prenorm, RMS). Forward: the
    output (x's shape and dtype) and an fp32 rstd per row; it saves x, the gate, the weight and rstd. Backward:
    dx and dg (both in x's dtype), the weight's fp32 partial sums (``NS = min(multiprocessor count, rows)`` x D;
    ``LIGER_SM_COUNT``: an H100 SXM's), summed and cast to the weight's dtype."""

    @staticmethod
    @_contiguous
    def forward(ctx, x, g, weight, eps):  # noqa: ANN001, ANN205
        x_shape_og, g_shape_og = x.shape, g.shape
        x = x.reshape(-1, x.shape[-1])
        g = g.reshape(-1, g.shape[-1])
        y = torch.empty_like(x)
        rstd = torch.empty((x.shape[0],), dtype=torch.float, device=x.device)
        ctx.save_for_backward(x, g, weight, rstd)
        ctx.shapes = x_shape_og, g_shape_og
        return y.reshape(x_shape_og)

    @staticmethod
    @_contiguous
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, g, weight, rstd = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])
        T, D = x.shape
        dx = torch.empty(T, D, dtype=x.dtype, device=x.device)
        dg = torch.empty(T, D, dtype=x.dtype, device=x.device)
        dw = torch.empty((min(LIGER_SM_COUNT, T), D), dtype=torch.float, device=weight.device)
        dw = dw.sum(0).to(weight.dtype)
        x_shape_og, g_shape_og = ctx.shapes
        return dx.reshape(x_shape_og), dg.reshape(g_shape_og), dw, None


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fla's ``rms_norm_gated(x, g, weight, None, activation, residual=None, eps=eps)``: see
    :class:`LayerNormGatedFunction` (the activation changes no size)."""
    return LayerNormGatedFunction.apply(x, g, weight, eps)


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """kernels-community/fla's ``FusedRMSNormGated.forward`` on transformers' gated norm (its ``weight``,
    ``variance_epsilon`` and ``activation``)."""
    return rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)


def kernelize_fla(model: nn.Module) -> int:
    """fla's ``chunk_gated_delta_rule`` as ``kernelize(model, mode=Mode.TRAINING, device="cuda")`` puts it in:
    every module that ``use_kernelized_func`` gave a wrapper of a function decorated
    ``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`` (its ``_kernel_funcs``) runs
    :func:`chunk_gated_delta_rule` there. Returns how many."""
    return bind_funcs(model, LAYER, _forward)


def kernelize_norms(model: nn.Module) -> int:
    """kernels-community/fla's ``FusedRMSNormGated`` as ``kernelize`` puts it in: every module whose class is
    decorated ``use_kernel_forward_from_hub("RMSNormGated")`` runs :func:`rms_norm_gated` on its weight. Returns
    how many."""
    swapped = 0
    for module in model.modules():
        if getattr(type(module), "kernel_layer_name", None) == NORM_LAYER:
            module.forward = MethodType(_norm_forward, module)
            swapped += 1
    return swapped


__all__ = ["ChunkGatedDeltaRuleFunction", "LayerNormGatedFunction", "chunk_gated_delta_rule",
           "kernelize_fla", "kernelize_norms", "rms_norm_gated"]
