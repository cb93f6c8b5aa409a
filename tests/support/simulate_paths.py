"""The fast simulation (meta tensors) and the reference one (FakeTensorMode) side by side: everything the
tracker recorded, so two runs compare event by event."""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramlab.core.simulation.metasim import measure_meta
from vramlab.core.simulation.step import StepRun, measure
from vramlab.core.simulation.tracker import MemoryTracker
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup


def record(run: StepRun) -> dict:
    """Every event and every peak of the step (the frees of the model's teardown, appended whenever the
    garbage collector reaches it, are not the step's)."""
    tr = run.tracker
    timeline_end, allocations_end = tr.ended_at
    return copy.deepcopy({
        "allocations": tr.alloc_log[:allocations_end], "timeline": tr.timeline[:timeline_end],
        "phase_marks": tr.phase_marks,
        "phase_peaks": tr.phase_peaks, "peak": tr.peak,
        "params": (run.total_params, run.trainable_params, run.managed_bytes),
    })


def reference(spec: ModelSpec, setup: TrainingSetup, steps: int = 2) -> dict:
    tracker = MemoryTracker(record_allocations=True)
    with FakeTensorMode(allow_non_fake_inputs=False):
        run = measure(spec, setup, torch.device("cpu"), real=False, tracker=tracker, steps=steps)
        return record(run)


def fast(spec: ModelSpec, setup: TrainingSetup, steps: int = 2) -> dict:
    return record(measure_meta(spec, setup, steps=steps))


def first_difference(a: dict, b: dict) -> str | None:
    """Where two records part (None when equal)."""
    for key, x in a.items():
        y = b[key]
        if x == y:
            continue
        if isinstance(x, list) and isinstance(y, list):
            i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"{key}[{i}]: {x[i:i + 3]} != {y[i:i + 3]} (lengths {len(x)}, {len(y)})"
        return f"{key}: {str(x)[:300]} != {str(y)[:300]}"
    return None
