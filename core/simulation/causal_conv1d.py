"""causal-conv1d's ``causal_conv1d_fn`` (Dao-AILab/causal-conv1d 1.6.1, ``causal_conv1d/causal_conv1d_interface.py``
and ``cpp_functions.py``; kernels-community/mamba-ssm vendors the same Python in ``_causal_conv1d``): the depthwise
causal convolution that transformers >= 5.25 runs on CUDA in place of its ``causal_conv1d_fn`` (decorated
``use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")``), bound wherever a module calls it
(LFM2's short conv, the gated-delta-rule families Qwen3.5, Qwen3-Next, OLMo-Hybrid..., a Mamba-2 mixer off its fused
path), as its autograd Function ``CausalConv1dFn`` allocates around its CUDA kernels (the values here are not the
convolution's: the bytes are).

Forward: x made contiguous only where neither its channel nor its length stride is 1 (transformers passes the
transposed projections, channel-last: no copy), the output (``empty_like(x)``, x's layout); it saves x, the weight
and the bias. Backward: dout made contiguous where neither stride is 1, dx (x's layout), the weight's (and bias's)
gradient in fp32 (``zeros_like``) cast back to the weight's dtype after the kernel; the C++ op copies dout to x's
layout where they differ (``causal_conv1d.cpp``: a channel-last x with a dout whose channel stride is not 1, or
the reverse), a copy freed as the op returns.

Not modelled: ``seq_idx`` (packed sequences) and initial / final states (a cache: not in training).
"""

from __future__ import annotations

import torch
from torch import nn

from vramlab.core.simulation.kernel_binding import bind_funcs

LAYER = "causal_conv1d_fn"  # the name the decorated torch function carries


def _bwd_op(x: torch.Tensor, dout: torch.Tensor) -> None:
    """``causal_conv1d_bwd`` (C++): dout in x's layout for the kernel, a copy where it is not."""
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if not channel_last and dout.stride(2) != 1:
        dout = dout.contiguous()
    if channel_last and dout.stride(1) != 1:
        dout = dout.transpose(-1, -2).contiguous().transpose(-1, -2)


class CausalConv1dFn(torch.autograd.Function):
    """``CausalConv1dFn`` without packed sequences or states: see the module's docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):  # noqa: ANN001, ANN205
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = torch.empty_like(x)  # causal_conv1d_fwd_function
        ctx.save_for_backward(x, weight, bias)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        x, weight, bias = ctx.saved_tensors
        if dout.stride(2) != 1 and dout.stride(1) != 1:
            dout = dout.contiguous()
        dx, dweight, dbias = _bwd_function(x, weight, bias, dout)
        return dx, dweight, dbias if bias is not None else None, None


def _bwd_function(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``causal_conv1d_bwd_function``."""
    dx = torch.empty_like(x)
    dweight = torch.zeros_like(weight, dtype=torch.float32)
    dbias = None
    if bias is not None:
        dbias = torch.zeros_like(bias, dtype=torch.float32)
    _bwd_op(x, dout)
    dweight = dweight.type_as(weight)
    if dbias is not None:
        dbias = dbias.type_as(bias)
    return dx, dweight, dbias


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None) -> torch.Tensor:
    """causal-conv1d's ``causal_conv1d_fn(x, weight, bias, activation=...)``."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    return CausalConv1dFn.apply(x, weight, bias, activation)


def _forward(self: nn.Module, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str | None = None, **kwargs: object) -> torch.Tensor:
    """kernels-community/mamba-ssm's ``causal_conv1d_fn`` layer: ``causal_conv1d_fn(x=hidden_states, weight=weight,
    bias=bias, activation=activation, seq_idx=kwargs.pop("seq_idx", None))``; with ``seq_idx`` (packed sequences)
    the torch path is counted."""
    if kwargs.get("seq_idx") is not None:
        return type(self).forward(self, hidden_states, weight, bias, activation, **kwargs)
    return causal_conv1d_fn(hidden_states, weight, bias, activation)


def kernelize_conv(model: nn.Module) -> int:
    """causal-conv1d's ``causal_conv1d_fn`` as ``kernelize(model, mode=Mode.TRAINING, device="cuda")`` puts it in:
    every wrapper ``use_kernelized_func`` gave a module for it (LFM2's short conv, the gated-delta-rule layers of
    Qwen3.5, Qwen3-Next, OLMo-Hybrid..., a Mamba-2 mixer's conv off its fused path). Returns how many."""
    return bind_funcs(model, LAYER, _forward)


__all__ = ["CausalConv1dFn", "causal_conv1d_fn", "kernelize_conv"]
