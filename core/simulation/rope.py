"""transformers' ``rotate_half`` (the builder's RoPE: ``q * cos + rotate_half(q) * sin``); liger's RoPE, which the
builder runs in its place under ``--liger-kernels rope``, is ``core/simulation/liger.py`` ``rope``."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)
