"""peft 0.21.2's DoRA on the builder's :class:`~.model.Linear` (its magnitude vector and its forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from collections.abc import Callable

    from vramlab.core.simulation.model import Linear


def magnitude(self: Linear) -> nn.Parameter:
    """peft 0.21.2 ``DoraLinearLayer.update_layer``: the norm of the base weight plus the scaled adapter
    weight, row by row, as the trainable magnitude (the sum's dtype)."""
    lora_weight = self.lora_B @ self.lora_A
    weight = self.weight + self.scaling * lora_weight
    weight_norm = torch.linalg.norm(weight, dim=1).to(weight.dtype)
    return nn.Parameter(weight_norm, requires_grad=True)


def forward(self: Linear, x: torch.Tensor, result: torch.Tensor,
            amp_linear: Callable[..., torch.Tensor]) -> torch.Tensor:
    """peft 0.21.2 ``DoraLinearVariant.forward`` with ``DoraLinearLayer.forward`` (variants.py, dora.py);
    ``amp_linear``: the builder's linear under its autocast."""
    plan = self.plan
    base_result = result
    if self.dropout > 0 and self.training:
        x = self._dropout(x)
        base_result = None
    eye = torch.eye(self.lora_A.shape[1], device=self.lora_A.device, dtype=self.lora_A.dtype)
    lora_weight = amp_linear(amp_linear(eye, self.lora_A, None, plan), self.lora_B, None, plan).T
    del eye
    lora_weight = lora_weight.to(x.dtype)
    weight = self.weight.to(x.dtype)
    weight_norm = torch.linalg.norm(weight + self.scaling * lora_weight.detach(), dim=1).to(weight.dtype)
    weight_norm = weight_norm.detach()
    mag_norm_scale = (self.lora_magnitude_vector / weight_norm).view(1, -1)
    lora_result = amp_linear(amp_linear(x, self.lora_A, None, plan), self.lora_B, None, plan)
    if base_result is not None:
        if self.bias is not None:
            base_result = base_result - self.bias
    else:
        base_result = amp_linear(x, weight, None, plan)
    result_dora = (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * self.scaling
    del lora_weight, weight, weight_norm, mag_norm_scale, lora_result, base_result
    return result + result_dora
