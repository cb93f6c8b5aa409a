"""Unsloth's attention (unsloth 2026.10.9 ``unsloth/utils/attention_dispatch.py``, ``run_attention``), as its
default install runs it in a training step: the reference of ``attention`` in ``--unsloth-kernels``
(:func:`vramlab.core.spec.unsloth.unsloth_patch`); Gemma 2's, its compiled softcapped torch attention, is
:func:`softcap_attention` (docs/levels.md).

unsloth requires xformers, not flash-attn, so ``select_attention_backend`` returns ``XFORMERS`` (no padding mask
in training). The XFORMERS branch takes ``Q.transpose(1, 2)`` and likewise K and V (``(batch, seq, heads,
head_dim)``; views of the projections' outputs after ``fast_rope_embedding``), and where a kv head serves several
query heads (``n_groups != 1``) and a gradient will be taken, ``K_t.view(b, s, kv_heads, 1, d).expand(b, s,
kv_heads, groups, d).reshape(b, s, heads, d)`` and the same of V: the reshape of an expanded tensor copies (a view
for one kv head), in K's dtype; autograd keeps nothing for the view, the expand or the reshape, and the expand's
backward sums the expanded gradient into one of K's size. Then ``xformers.ops.memory_efficient_attention(Q_t,
K_mod, V_mod, attn_bias=LowerTriangularMask())``: its autograd function saves its inputs (so the repeated K and V),
the output and the log-sum-exp, and its backward makes dq, dk and dv of its inputs' sizes; those are the tensors
torch's fused SDPA kernels keep, so the step runs torch's SDPA on the repeated K and V here (on fake tensors as the
CPU dispatches it, as the builder's). The kernel xformers dispatches to on CUDA is torch's FlashAttention-2, whose
backward scratch the reserved level counts (:func:`vramlab.core.spec.unsloth.xformers_kernel`).

:func:`install` puts it on one attention module: on transformers' attention classes as their attention interface
(``ALL_ATTENTION_FUNCTIONS`` in the forward's globals), on the built-in builder's in its ``_sdpa``'s place (the
forward rebound with that one name changed: no global patch).
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from vramlab.core.simulation.composite import sdpa as composite_sdpa
from vramlab.core.simulation.kernel_binding import rebind


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """torch's SDPA on the kernel's inputs (on meta tensors as the CPU dispatches it, as the builder's)."""
    run = composite_sdpa if q.device.type == "meta" else F.scaled_dot_product_attention
    return run(q, k, v, **kwargs)  # type: ignore[arg-type]


def xformers_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The XFORMERS branch of ``run_attention`` on q, k, v of shape ``(batch, heads, seq, head_dim)``, causal; the
    output as ``(batch, heads, seq, head_dim)`` (a view of a ``(batch, seq, heads, head_dim)`` tensor)."""
    b, n_heads, s, d = q.shape
    n_kv = k.shape[1]
    groups = n_heads // n_kv
    K_t, V_t = k.transpose(1, 2), v.transpose(1, 2)
    if groups != 1 and torch.is_grad_enabled():
        K_t = K_t.view(b, s, n_kv, 1, d).expand(b, s, n_kv, groups, d).reshape(b, s, n_heads, d)
        V_t = V_t.view(b, s, n_kv, 1, d).expand(b, s, n_kv, groups, d).reshape(b, s, n_heads, d)
    return _sdpa(q, K_t.transpose(1, 2), V_t.transpose(1, 2), is_causal=True, scale=scale,
                 enable_gqa=groups != 1 and not torch.is_grad_enabled())


class _Scores(torch.autograd.Function):
    """The compiled graph up to the probabilities (see :func:`softcap_attention`): what it keeps of them for
    backward and the buffers of its backward through the softmax, the mask, the tanh and the first bmm."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: ANN001
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, s, d = q.shape
        qs_mm, qs, kr = q.new_empty(b, h, s, d), q.new_empty(b, h, s, d), k.new_empty(b, h, s, d)
        scores = q.new_empty(b, h, s, s)
        del qs_mm  # bmm's operand; the scaled q is kept in the layout backward reads
        cap = q.new_empty((), dtype=torch.float32)  # the softcap, a 0-d fp32 constant the graph keeps
        f32 = q.new_empty(b, h, s, s, dtype=torch.float32)  # the masked, softcapped scores in fp32
        amax, total = q.new_empty(b, h, s, 1, dtype=torch.float32), q.new_empty(b, h, s, 1, dtype=torch.float32)
        probs, vr = q.new_empty(b, h, s, s), v.new_empty(b, h, s, d)
        del f32
        ctx.kv = k.shape[1]
        ctx.mark_non_differentiable(vr)
        ctx.set_materialize_grads(False)  # no zeros for the repeated v, which takes no gradient here
        ctx.save_for_backward(mask, scores, cap, amax, total, qs, kr)
        return probs, vr

    @staticmethod
    def backward(ctx, gp: torch.Tensor, _gvr: None) -> tuple:  # noqa: ANN001
        _mask, scores, _cap, _amax, _total, qs, kr = ctx.saved_tensors
        b, h, s, d = qs.shape
        f32, rows = scores.new_empty(b, h, s, s, dtype=torch.float32), qs.new_empty(b, h, s, 1, dtype=torch.float32)
        del f32, rows  # the softmax / mask / tanh backward writes the scores' gradient into gp's storage
        _gk_rep, _gq_s = kr.new_empty(b, h, d, s), qs.new_empty(b, h, s, d)  # bmm(Q^T, dS), bmm(dS, K): locals
        gk = kr.new_empty(b, ctx.kv, s, d)  # summed over each kv head's group
        gq = qs.new_empty(b, h, s, d)  # times the scale
        return gq, gk, None, None


class _Output(torch.autograd.Function):
    """The compiled graph's second bmm and the output's copy; its backward's first bmms, v's gradient summed."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, vr: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        b, h, s, d = vr.shape
        o = vr.new_empty(b, h, s, d)
        out = vr.new_empty(b, s, h, d)  # transpose(1, 2).contiguous()
        del o
        ctx.kv = v.shape[1]
        ctx.save_for_backward(probs, vr)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:  # noqa: ANN001
        probs, vr = ctx.saved_tensors
        b, h, s, d = vr.shape
        gv_rep = vr.new_empty(b, h, s, d)  # bmm(P^T, dO)
        gv = vr.new_empty(b, ctx.kv, s, d)  # summed over each kv head's group
        del gv_rep
        gp = probs.new_empty(b, h, s, s)  # bmm(dO, V^T)
        return gp, None, gv


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:  # noqa: ARG001 - the values do not matter here
    """unsloth's Gemma 2 attention (``slow_attention_softcapping``: ``_compiled_slow_attention_softcapping``
    under torch.compile) on q, k, v of shape ``(batch, heads, seq, head_dim)`` and an additive ``mask``; the output
    ``(batch, seq, heads, head_dim)``. The buffers are inductor's (torch 2.13) for that graph, in its order: with a
    gradient to take, k and v repeated to every head (expand + clone), q scaled (twice: bmm's operand, freed after
    it, and the copy backward reads), the scores, the softcap constant, the masked softcapped scores in fp32, the
    softmax's row max and sum, the bf16 probabilities, the output and its (batch, seq, heads, head_dim) copy; the
    graph keeps (min-cut partitioner) the mask, the scores, the constant, the row max and sum, the probabilities,
    the scaled q and the repeated k and v. Its backward frees each at its last use; here the probabilities and the
    repeated v go when the second bmm's backward returns, the rest when the first's does."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        probs, vr = _Scores.apply(q, k, v, mask)
        return _Output.apply(probs, vr, v)
    b, h, s, d = q.shape  # the inference graph: each buffer freed after its last use
    qs, kr = q.new_empty(b, h, s, d), k.new_empty(b, h, s, d)
    scores = q.new_empty(b, h, s, s)
    del qs, kr
    f32 = q.new_empty(b, h, s, s, dtype=torch.float32)
    amax, total = q.new_empty(b, h, s, 1, dtype=torch.float32), q.new_empty(b, h, s, 1, dtype=torch.float32)
    probs, vr = q.new_empty(b, h, s, s), v.new_empty(b, h, s, d)
    del scores, f32, amax, total
    o = q.new_empty(b, h, s, d)
    del probs
    out = vr.view(b, s, h, d)  # the copy written into the repeated v's buffer
    del vr, o
    return out


def _builder_eager(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    if attn.kv is not None:  # generation (a KV cache): unsloth's inference attention, not modelled (the estimate's)
        return type(attn)._eager(attn, q, k, v, mask)
    return softcap_attention(q, k, v, mask, attn.scaling).transpose(1, 2)


def _hf_softcapped(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: object) -> tuple[torch.Tensor, None]:
    return softcap_attention(query, key, value, attention_mask, scaling), None


def _builder_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float,
                  enable_gqa: bool = False) -> torch.Tensor:
    return xformers_attention(q, k, v, scale)


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention interface's signature; the output ``(batch, seq, heads, head_dim)``."""
    return xformers_attention(query, key, value, scaling).transpose(1, 2), None


class _Interfaces:
    """``ALL_ATTENTION_FUNCTIONS`` as the forward asks it: unsloth's attention whatever the implementation."""

    def __init__(self, function: object) -> None:
        self.function = function

    def get_interface(self, name: str, default: object = None) -> object:
        return self.function


def install(attn: nn.Module, softcapped: bool = False) -> None:
    """unsloth's attention in place of one attention module's (before :func:`~.unsloth_rope.install`): xformers',
    or with ``softcapped`` Gemma 2's compiled softcapped attention."""
    if hasattr(attn, "proj") and softcapped:  # the builder's SelfAttention: its eager path's
        attn._eager = MethodType(_builder_eager, attn)
    elif hasattr(attn, "proj"):
        rebind(attn, _sdpa=_builder_sdpa)
    else:
        rebind(attn, ALL_ATTENTION_FUNCTIONS=_Interfaces(_hf_softcapped if softcapped else _hf_attention))


__all__ = ["install", "softcap_attention", "xformers_attention"]
