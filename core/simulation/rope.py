"""transformers' ``rotate_half`` (the builder's RoPE: ``q * cos + rotate_half(q) * sin``); liger's RoPE, which the
builder runs in its place under ``--liger-kernels rope``, is ``core/simulation/liger.py`` ``rope``; the Hub's
RoPE kernel, which transformers >= 5.25 swaps in on CUDA (core/spec/hub_kernels.py), is :func:`hub_rope`."""

from __future__ import annotations

import torch
from torch import nn

from vramlab.core.simulation.kernel_binding import bind_funcs
from vramlab.core.spec.hub_kernels import ROPE


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hub_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels-community/rotary's ``apply_rotary_transformers`` as CUDA runs it: q and k cloned (``CloneBackward``:
    their gradients pass on as they come), then each clone's halves rotated in place by ``ops.apply_rotary``, a
    CUDA kernel with no autograd kernel that allocates nothing and that autograd records nothing of (torch's
    fallback, for an op that returns nothing). Fake tensors carry no values: nothing else runs here. Its binding
    checks ``x1.dtype() == cos.dtype()``: callers run the torch path where q's dtype is not cos's (the run fails
    there; the note says so)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    return q.clone(), k.clone()


def _hub_rope_forward(self: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dtype != cos.dtype or k.dtype != cos.dtype:  # the binding's check fails: the torch path (the note says)
        return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
    return hub_rope(q, k, cos, sin, unsqueeze_dim)


def kernelize_rope(model: nn.Module) -> int:
    """The Hub's RoPE as ``kernelize(model, mode=Mode.TRAINING, device="cuda")`` puts it in: every module that
    ``use_kernelized_func`` gave a private wrapper of a function decorated ``use_kernel_forward_from_hub(
    "rotary_pos_emb")`` (its ``_kernel_funcs``) gets the layer's forward on that wrapper. Returns how many."""
    return bind_funcs(model, ROPE, _hub_rope_forward)
