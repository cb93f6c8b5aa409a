"""Dropout as CUDA dispatches it, for the transformers reference path under fake tensors on the CPU.

Fake tensors live on the CPU, and torch's dropout dispatches by device (``ATen/native/Dropout.cpp``):

* ``F.dropout`` in training with ``0 < p < 1``: on CUDA the fused kernel ``native_dropout`` returns the output
  and a 1-byte mask, which backward keeps; on the CPU ``_dropout_impl`` draws a noise tensor in the input's
  dtype (2 bytes a value for bf16), scales it and multiplies, and backward keeps the noise.
* ``F.scaled_dot_product_attention`` with ``dropout_p > 0``: on CUDA the fused kernels (flash, memory-efficient)
  apply dropout inside the kernel from a Philox seed and keep no mask, so the memory is the no-dropout
  kernel's; on the CPU no fused kernel takes dropout, and the math kernel materialises the scores and their
  dropout.

VRAM Lab models CUDA, so the reference does too: within :func:`emulating`, the two functions take CUDA's
path. An in-place dropout and ``p`` outside ``(0, 1)`` keep torch's own code (CUDA runs the same there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_ORIGINAL = {"dropout": F.dropout, "sdpa": F.scaled_dot_product_attention}
_ACTIVE: list[bool] = []  # a wrapper captured by a module imported inside the block acts only inside it


def _cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,  # noqa: A002
                  inplace: bool = False) -> torch.Tensor:
    if _ACTIVE and training and 0.0 < p < 1.0 and not inplace and input.is_floating_point():
        return torch.native_dropout(input, p, True)[0]
    return _ORIGINAL["dropout"](input, p, training, inplace)


def _cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, *args: object, **kwargs: object) -> torch.Tensor:
    return _ORIGINAL["sdpa"](query, key, value, attn_mask, 0.0 if _ACTIVE else dropout_p, *args, **kwargs)


@contextlib.contextmanager
def emulating() -> Iterator[None]:
    """Route ``F.dropout`` and ``F.scaled_dot_product_attention`` to what CUDA runs while the block runs."""
    _ACTIVE.append(True)
    F.dropout, F.scaled_dot_product_attention = _cuda_dropout, _cuda_sdpa
    try:
        yield
    finally:
        _ACTIVE.pop()
        if not _ACTIVE:
            F.dropout, F.scaled_dot_product_attention = _ORIGINAL["dropout"], _ORIGINAL["sdpa"]
