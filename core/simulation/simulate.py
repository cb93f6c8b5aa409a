"""`vramlab simulate`: the real architecture, one training step, fake tensors, every allocation counted.

The model is built and trained under ``FakeTensorMode`` on the CPU: tensors carry shapes, dtypes and
strides but no data, so a 70B setup runs in seconds without allocating its memory. The tracker counts
each storage the way the CUDA caching allocator would hand it out (512-byte blocks).

The built-in builder runs on meta tensors by default (:mod:`.metasim`: the same events, several times
faster); ``fast=False`` runs it under ``FakeTensorMode`` as before, the reference the fast path is held to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramlab.core.checks import SetupError
from vramlab.core.families import piece
from vramlab.core.kinds import Kind
from vramlab.core.levels import gpu_capability
from vramlab.core.result import Level, MemoryResult, PhasePeak
from vramlab.core.simulation import context
from vramlab.core.simulation.moe import cuda_fallback
from vramlab.core.simulation.step import Aborted, PhaseCallback, StepRun, measure, preload
from vramlab.core.simulation.tracker import CUDA_BLOCK, MemoryTracker
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import result_notes as unsloth_notes
from vramlab.core.spec.unsloth_loss import with_gpu as unsloth_with_gpu


def simulate(
    spec: ModelSpec,
    setup: TrainingSetup,
    gpu: GpuSpec | None = None,
    steps: int = 2,
    block: int = CUDA_BLOCK,
    on_phase: PhaseCallback | None = None,
    should_abort: Callable[[], bool] | None = None,
    hf: bool = False,
    hf_config=None,  # noqa: ANN001 - a transformers config (the user's config.json)
    fast: bool = True,
) -> MemoryResult:
    """``hf``: measure transformers' own model class (and peft) instead of the built-in decoder.
    ``fast``: run the built-in builder on meta tensors (:mod:`.metasim`), else under FakeTensorMode."""
    asked, setup = setup, unsloth_with_gpu(setup, gpu)  # what Unsloth's fused loss reads of the GPU
    setup.validate(spec)
    preload(setup)  # before any tracked op: an import's own tensors are not the step's
    t0 = time.perf_counter()
    run = None
    with cuda_fallback():  # an MoE's grouped matmuls in fp32 / fp16, as CUDA runs them (core/simulation/moe.py)
        if fast and not hf and spec.vision is None:
            run = _measure_fast(spec, setup, block, steps, on_phase, should_abort)
        if run is None:
            run = _measure_fake(spec, setup, block, steps, on_phase, should_abort, hf, hf_config)
            hf = hf or spec.vision is not None
    elapsed = time.perf_counter() - t0
    result = result_from_run(Level.SIMULATE, spec, setup, run, gpu, {"total": elapsed, **run.timing},
                             source="simulated (transformers + peft)" if hf else "simulated (built-in builder)")
    notes = tuple(getattr(run, "notes", ()))
    if notes:  # what the HF build chose (eager attention where a class has no SDPA path, ...)
        result = dataclasses.replace(result, warnings=(*notes, *result.warnings))
    # the result answers the setup asked (the GPU's part said in a note: core/spec/unsloth.py, as the estimate's)
    notes = unsloth_notes(spec, setup, result.source, gpu_capability(gpu))
    return dataclasses.replace(result, setup=asked, notes=(*result.notes, *notes))


def _measure_fast(spec: ModelSpec, setup: TrainingSetup, block: int, steps: int, on_phase: PhaseCallback | None,
                  should_abort: Callable[[], bool] | None) -> StepRun | None:
    """The built-in builder's step on meta tensors; None where it cannot run there (the caller runs the fake
    path, which gives the same events where both run, or the error the user should see)."""
    from vramlab.core.simulation.metasim import measure_meta

    try:
        return measure_meta(spec, setup, block, steps, on_phase, should_abort)
    except (Aborted, SetupError):
        raise
    except Exception:  # noqa: BLE001 - an op without a meta kernel, a value read: the fake path runs it
        return None


def _measure_fake(spec: ModelSpec, setup: TrainingSetup, block: int, steps: int, on_phase: PhaseCallback | None,
                  should_abort: Callable[[], bool] | None, hf: bool, hf_config) -> StepRun:  # noqa: ANN001
    tracker = MemoryTracker(block=block, record_allocations=True)
    builder = None
    guard = contextlib.nullcontext()
    if spec.vision is not None and spec.vision.traced:  # transformers' own VLM class, whole (measure.vlm_traced)
        from vramlab.core.tracing import vlm_traced

        vlm_traced.check_traced_vlm(spec, setup)
        builder = functools.partial(vlm_traced.build, config=hf_config)
        guard = vlm_traced.guard(setup, spec)
        hf = True
    elif spec.vision is not None:  # the family's builder of its real transformers class (core/families/<family>/)
        reference = piece(spec.vision.model_type, "reference")
        reference.check(spec, setup)
        builder = functools.partial(reference.build, config=hf_config)
        guard = reference.guard(setup)
        hf = True
    elif hf:
        from vramlab.core.tracing import hf as hfmod

        hfmod.check(spec, setup)
        builder = functools.partial(hfmod.build_hf, config=hf_config)
        guard = hfmod.guard(setup)
    try:
        with context.exclusive(), FakeTensorMode(allow_non_fake_inputs=False), guard:
            return measure(spec, setup, torch.device("cpu"), real=False, tracker=tracker, steps=steps,
                           on_phase=on_phase, should_abort=should_abort, builder=builder)
    except (SetupError, Aborted, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - transformers, peft or fake tensors refusing this model or recipe
        if builder is None:  # the built-in builder's own failure is a bug to see whole
            raise
        first = str(e).splitlines()[0][:300] if str(e) else "no message"
        raise SetupError(f"{spec.name}: transformers' classes cannot run this step here "
                         f"({type(e).__name__}: {first})") from e


def result_from_run(level: Level, spec: ModelSpec, setup: TrainingSetup, run: StepRun, gpu: GpuSpec | None,
                    timing: dict[str, float], source: str = "") -> MemoryResult:
    """Tensor level from the tracker; the outer levels from the same model the estimator uses."""
    from vramlab.core.levels import outer_levels

    tr = run.tracker
    peak = tr.peak
    # the step's events: not the frees of the model's teardown, which the garbage collector may have
    # appended since (when it runs is Python's business, not the step's)
    ended = getattr(tr, "ended_at", None) or (len(tr.timeline), None)
    timeline = tr.timeline[:ended[0]]
    allocations = tr.alloc_log[:ended[1]] if tr.alloc_log is not None and ended[1] is not None else tr.alloc_log
    phases = tuple(PhasePeak(k, rec.total_bytes, _nonzero(rec.kinds)) for k, rec in tr.phase_peaks.items())
    alive = peak.top
    reserved, device, overheads = outer_levels(spec, setup, peak.total_bytes, _nonzero(peak.kinds), gpu,
                                               managed_bytes=run.managed_bytes, allocations=allocations)
    return MemoryResult(
        level=level, model=spec, setup=setup,
        peak_allocated_bytes=peak.total_bytes, peak_reserved_bytes=reserved, device_used_bytes=device,
        components=_nonzero(peak.kinds), peak_phase=peak.phase, phases=phases,
        total_params=run.total_params, trainable_params=run.trainable_params, overheads=overheads,
        warnings=tuple(setup.warnings(spec)), alive_at_peak=alive, gpu=gpu, timing=timing,
        timeline=tuple(timeline), phase_marks=tuple(tr.phase_marks), source=source,
    )


def _nonzero(kinds: dict[Kind, int]) -> dict[Kind, int]:
    return {k: v for k, v in kinds.items() if v}
