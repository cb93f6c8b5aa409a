"""Unsloth's attention (unsloth 2026.10.9 ``unsloth/utils/attention_dispatch.py``, ``run_attention``), as its
default install runs it in a training step: the reference of ``attention`` in ``--unsloth-kernels``
(:func:`vramlab.core.spec.unsloth.unsloth_patch`).

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
CPU dispatches it, as the builder's). The kernel's own workspace (xformers' FA3 / cutlass
forward and backward on an H100) is not counted.

:func:`install` puts it on one attention module: on transformers' attention classes as their attention interface
(``ALL_ATTENTION_FUNCTIONS`` in the forward's globals), on the built-in builder's in its ``_sdpa``'s place (the
forward rebound with that one name changed: no global patch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vramlab.core.simulation.composite import sdpa as composite_sdpa
from vramlab.core.simulation.unsloth_rope import rebind


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

    @staticmethod
    def get_interface(name: str, default: object = None) -> object:
        return _hf_attention


def install(attn: nn.Module) -> None:
    """unsloth's attention in place of one attention module's (before :func:`~.unsloth_rope.install`)."""
    if hasattr(attn, "proj"):  # the builder's SelfAttention
        rebind(attn, _sdpa=_builder_sdpa)
    else:
        rebind(attn, ALL_ATTENTION_FUNCTIONS=_Interfaces())


__all__ = ["install", "xformers_attention"]
