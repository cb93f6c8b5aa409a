"""Offloaded gradient checkpointing (``--grad-ckpt-offload``): each checkpointed layer's input kept in host memory
instead of on the GPU, as LLaMA-Factory 0.9.5's ``use_unsloth_gc`` (``UnslothGradientCheckpointing`` in
``llamafactory/model/model_utils/checkpointing.py``) and axolotl 0.19.0's ``CPU_Offloaded_Gradient_Checkpointer``
(``axolotl/monkeypatch/gradient_checkpointing/offload_cpu.py``, the same code, after Unsloth's) run it.

An autograd function in place of ``torch.utils.checkpoint``: forward copies the layer's input to the host, runs the
layer without a graph and saves the host copy (the layer's other arguments and its partial's keywords are held on
the context, as the reentrant checkpoint holds them); backward copies the input back to the GPU as a new leaf, runs
the layer again with grad, back-propagates its output's gradient (held until it returns) through it and returns the
leaf's gradient. On the GPU, against torch's reentrant checkpoint: no layer input between forward and backward, and
a copy of it (where the reentrant one has a view of the kept input) while its layer's backward runs.

Unsloth's own (unsloth_zoo 2026.10.9: ``UnslothCheckpointFunction``) keeps GPU staging buffers and the last layer's
input: not this, but ``--unsloth-gc`` (core/simulation/unsloth_gc.py).
"""

from __future__ import annotations

from typing import Any

import torch

from vramlab.core.simulation import context


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, forward_function: Any, hidden_states: torch.Tensor, *args: Any) -> Any:
        where = torch.device("cpu") if hidden_states.is_cuda else hidden_states.device
        with context.host():  # hidden_states.to("cpu", non_blocking=True)
            saved = torch.empty_like(hidden_states, device=where)
            if not hidden_states.is_meta:
                saved.copy_(hidden_states)
        with torch.no_grad():
            outputs = forward_function(hidden_states, *args)
        ctx.save_for_backward(saved)
        ctx.device = hidden_states.device
        ctx.forward_function = forward_function
        ctx.args = args
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        (hidden_states,) = ctx.saved_tensors
        hidden_states = hidden_states.to(ctx.device, copy=True).detach()  # .to("cuda", non_blocking=True)
        hidden_states.requires_grad_(True)
        with torch.enable_grad():
            outputs = ctx.forward_function(hidden_states, *ctx.args)
            output = outputs[0] if isinstance(outputs, tuple) else outputs
        torch.autograd.backward(output, grad_output)
        return (None, hidden_states.grad) + (None,) * len(ctx.args)


def checkpoint_to_host(function: Any, *args: Any, use_reentrant: bool | None = None,
                       preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint``'s signature (what the builder and transformers' layers call), the
    offloaded checkpoint's behaviour (axolotl's ``hf_grad_checkpoint_offload_wrapper`` ignores the mode too)."""
    if kwargs:
        raise TypeError(f"the offloaded checkpoint takes its layer's arguments by position (got {sorted(kwargs)})")
    return _OffloadedCheckpoint.apply(function, *args)
