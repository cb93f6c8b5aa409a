"""One setup held three ways: the estimate against the built-in builder (exactly, phase by phase) and against
transformers' classes (+ peft) under fake tensors (within HF's few small buffers)."""

from __future__ import annotations

from vramlab.core.estimate import estimate
from vramlab.core.result import MemoryResult
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

HF_BUFFERS = 8192
"""What transformers' classes hold that the builder does not: a few small tensors (the position ids under
checkpointing, ...). The input embeddings their base model holds to the end of its forward are held by the builder
and the estimate too (tests/test_embeddings_held.py)."""


def held_three_ways(spec: ModelSpec, setup: TrainingSetup, without: TrainingSetup) -> tuple[MemoryResult,
                                                                                           MemoryResult]:
    """The estimate of ``setup`` and of ``without`` (the same setup without the option under test), after
    asserting that the first equals the builder and is within 8 KiB of transformers' classes."""
    ref = simulate(spec, setup, hf=True)
    built = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True)
    own = estimate(spec, without, match_simulation=True)
    assert est.source == "hand-written"
    assert est.peak_allocated_bytes == built.peak_allocated_bytes
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in built.phases}
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= HF_BUFFERS
    assert est.peak_phase == ref.peak_phase
    return est, own
