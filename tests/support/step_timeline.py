"""One training step of a transformers class under the tracker, allocation by allocation (for tests that hold a
patched class to the library's own patch)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vramlab.core.simulation.tracker import MemoryTracker


def step_timeline(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    """The bytes after every allocation and release of ``model``'s forward and backward on ``ids`` (its labels)."""
    tracker = MemoryTracker(block=1)
    with tracker:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        del out
    return [c for _, c in tracker.timeline]


def tiny_model(model_type: str, **config: object) -> Callable[[], torch.nn.Module]:
    """A maker of transformers' causal-LM class for ``model_type``, its config built by its own config class from
    ``config`` (eager attention, bf16 weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **config)
    cfg._attn_implementation = "eager"
    return lambda: AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
