"""Unsloth's RoPE kernel (unsloth 2026.10.9 ``unsloth/kernels/rope_embedding.py``), as its CUDA path allocates around
its Triton kernel: the reference of ``rope`` in ``--unsloth-kernels`` (:func:`vramlab.core.spec.unsloth.unsloth_patch`).

``LlamaAttention_fast_forward`` (``unsloth/models/llama.py``; Mistral's, Qwen's and Gemma's forwards alike) views the
projections' outputs as ``(batch, heads, seq, head_dim)`` and calls ``fast_rope_embedding(Q, K, cos, sin,
position_ids)``; a training step fed by TRL's collator has no position ids (``return_position_ids`` and
``padding_free`` off), so ``Fast_RoPE_Embedding_QK_Positions`` runs: Q and K rotated in place where
``X.transpose(1, 2)`` is contiguous (a projection's output, viewed: always, on the families it runs on), into a fresh
``(batch, seq, heads, head_dim)`` buffer otherwise; cos and sin kept on ``ctx`` (no tensor saved); backward writes each
gradient into a fresh ``(batch, seq, heads, head_dim)`` buffer (``_bshd_buffer``). transformers' RoPE instead makes
``q * cos``, ``rotate_half(q)`` (a negated half and a concatenation) and their sum for q and for k, and in backward
the products' gradients and the slices' full-size zeros.

:func:`install` puts it in transformers' RoPE's place: on transformers' attention classes their forward's own
``apply_rotary_pos_emb`` (the forward rebound with that one name changed: no global patch); on the built-in builder's
attention, whose RoPE is written inline, the rotation moves to the projections' call (the q projection computes q, k
and v, as unsloth's ``apply_qkv`` does, rotates q and k, and k_proj and v_proj hand back their share) and the
attention is given no rotary table. tests/test_unsloth_rope.py runs unsloth's own function beside this one.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn

from vramlab.core.simulation.kernel_binding import rebind


def _bshd_buffer(X: torch.Tensor) -> torch.Tensor:
    """unsloth's ``_bshd_buffer``: a fresh ``(batch, seq, heads, head_dim)`` tensor, viewed as ``X``'s shape."""
    batch, n_heads, seq_len, head_dim = X.shape
    return torch.empty((batch, seq_len, n_heads, head_dim), dtype=X.dtype, device=X.device).transpose(1, 2)


class FastRoPE(torch.autograd.Function):
    """``Fast_RoPE_Embedding_QK_Positions`` on Q and K of shape ``(batch, heads, seq, head_dim)``."""

    @staticmethod
    def forward(ctx, Q, K, cos, sin):  # noqa: ANN001, ANN205
        cos, sin = cos.squeeze(), sin.squeeze()
        Q_out = Q if Q.transpose(1, 2).is_contiguous() else _bshd_buffer(Q)
        K_out = K if K.transpose(1, 2).is_contiguous() else _bshd_buffer(K)
        ctx.cos = cos
        ctx.sin = sin
        return Q_out.view(Q_out.shape), K_out.view(K_out.shape)

    @staticmethod
    def backward(ctx, dQ, dK):  # noqa: ANN001, ANN205
        return _bshd_buffer(dQ), _bshd_buffer(dK), None, None


def fast_rope_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast_rope_embedding`` without position ids, called as transformers' ``apply_rotary_pos_emb`` is."""
    return FastRoPE.apply(q, k, cos, sin)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)


def _flat(x: torch.Tensor) -> torch.Tensor:
    b, _, s, _ = x.shape
    return x.transpose(1, 2).reshape(b, s, -1)


def _attn_forward(self: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """The builder's attention, its rotary table handed to the q projection's call instead."""
    self.proj["q_proj"].unsloth_rope = (cos, sin, self.hd)
    try:
        return self.unsloth_attn_forward(x, None, None, mask)
    finally:
        self.proj["q_proj"].unsloth_rope = None


def rotate(q_mod: nn.Module, Q: torch.Tensor, K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K (the projections' outputs) rotated by the kernel where ``q_mod`` carries the rotary table."""
    cos, sin, hd = q_mod.unsloth_rope
    Q, K = FastRoPE.apply(_heads(Q, hd), _heads(K, hd), cos, sin)
    return _flat(Q), _flat(K)


def _q_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``apply_qkv`` (q, k, v projected in that order), then ``fast_rope_embedding`` on q and k."""
    k_mod, v_mod = self.unsloth_kv
    Q, K, V = self.unsloth_q_forward(X), k_mod.unsloth_own_forward(X), v_mod.unsloth_own_forward(X)
    Q, K = rotate(self, Q, K)
    k_mod.unsloth_out, v_mod.unsloth_out = K, V
    return Q


def _kv_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    out, self.unsloth_out = self.unsloth_out, None
    return out


def install(attn: nn.Module, q: nn.Module, k: nn.Module, v: nn.Module, fused_qkv: bool) -> None:
    """The kernel in transformers' RoPE's place on one attention module (``fused_qkv``: ``LoRA_QKV`` already
    computes the three at q's call, and rotates there)."""
    if not hasattr(attn, "proj"):  # transformers' attention: its forward's own apply_rotary_pos_emb replaced
        rebind(attn, apply_rotary_pos_emb=fast_rope_embedding)
        return
    attn.unsloth_attn_forward = attn.forward
    attn.forward = MethodType(_attn_forward, attn)
    q.unsloth_rope = None
    if fused_qkv:
        return
    q.__dict__["unsloth_kv"] = (k, v)  # outside the module tree
    for mod in (k, v):
        mod.unsloth_own_forward, mod.unsloth_out = mod.forward, None
        mod.forward = MethodType(_kv_forward, mod)
    q.unsloth_q_forward = q.forward
    q.forward = MethodType(_q_forward, q)


__all__ = ["FastRoPE", "fast_rope_embedding", "install", "rebind", "rotate"]
