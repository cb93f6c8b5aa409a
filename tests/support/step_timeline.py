"""One training step of a transformers class under the tracker, allocation by allocation (for tests that hold a
patched class to the library's own patch)."""

from __future__ import annotations

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
