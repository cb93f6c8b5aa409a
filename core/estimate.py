"""`vramlab estimate`: the analytical answer, in well under a millisecond once a setup's structure is known.

The training step is replayed in bytes by the estimator engine (:mod:`vramlab.core.estimator`), which
mirrors, op by op, what the measured model builder allocates; the tape it records is evaluated for the
setup's batch, sequence length and LoRA rank. The outer levels (allocator reserved, device used) come
from :mod:`vramlab.core.levels`.
"""

from __future__ import annotations

import time

import numpy as np

from .allocator import AllocatorConfig
from .calibration import Calibration, for_gpu
from .estimator import TapeCache, evaluate
from .estimator.engine import KINDS
from .kinds import Kind
from .levels import outer_levels
from .result import Level, MemoryResult, PhasePeak
from .spec import DType, GpuSpec, Method, ModelSpec, Optimizer, TrainingSetup
from .units import GB, GiB

_CACHE = TapeCache()
_SIM_CACHE = TapeCache(match_simulation=True)


def _kinds(arr: np.ndarray) -> dict[Kind, int]:
    return {KINDS[i]: int(v) for i, v in enumerate(arr) if v}


_FULL_CACHE = TapeCache(size=16, reduced=False)


def estimate(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None = None,
             match_simulation: bool = False, allocator: bool = False,
             alloc_conf: AllocatorConfig | None = None,
             calibration: Calibration | str | None = "auto") -> MemoryResult:
    """Predict per-GPU memory of ``setup`` on ``spec`` at the three levels, with the breakdown at the
    peak and the peak of every phase (load, then forward / backward / optimizer of steps 1 and 2).

    ``match_simulation`` predicts the fake-tensor simulation instead of a CUDA run (see
    :class:`~vramlab.core.estimator.engine.Engine`: gradient accumulation out of place while a dispatch
    mode is active, LayerNorm statistics in the input dtype on CPU).

    ``allocator``: compute the reserved level by replaying the step's allocations through the
    caching-allocator model (exact for the modelled allocator, ~0.5 s) instead of the fast model.

    ``calibration``: "auto" uses what a profile measured on ``gpu`` if one was saved, None ignores it."""
    setup.validate(spec)
    t0 = time.perf_counter()
    rec = (_SIM_CACHE if match_simulation else _CACHE).get(spec, setup)
    ev, managed = evaluate(rec, setup)
    comps = _kinds(ev.peak_kinds)
    phases = tuple(PhasePeak(k, int(v[0]), _kinds(v[1])) for k, v in ev.phase_peaks.items())
    allocations = None
    if allocator:
        full = _FULL_CACHE.get(spec, setup)
        allocations = full.tape.allocations(setup.micro_batch, setup.seq_len, setup.lora_rank)
    cal = calibration
    if cal == "auto":
        cal = for_gpu(gpu.name) if gpu is not None else None
    reserved, device, overheads = outer_levels(spec, setup, ev.peak, comps, gpu, managed_bytes=managed,
                                               allocations=allocations, alloc_conf=alloc_conf,
                                               largest_alloc=ev.largest_alloc, calibration=cal)
    total, trainable = param_counts(spec, setup)
    return MemoryResult(
        level=Level.ESTIMATE, model=spec, setup=setup,
        peak_allocated_bytes=int(ev.peak), peak_reserved_bytes=reserved, device_used_bytes=device,
        components=comps, peak_phase=ev.peak_phase, phases=phases,
        total_params=total, trainable_params=trainable, overheads=overheads,
        warnings=tuple(setup.warnings(spec)), notes=tuple(explain(spec, setup, comps, ev.peak_phase)),
        gpu=gpu, timing={"total": time.perf_counter() - t0}, calibration=cal.label if cal else "",
        source="hand-written",
    )


def param_counts(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, int]:
    """(total parameters of the model, trainable parameters of the setup; LoRA adapters not in total)."""
    total = spec.param_count
    if setup.method is Method.FULL:
        return total, total
    if setup.method is Method.FREEZE:
        n = int(setup.trainable_layers or 0)
        head = spec.lm_head_params() if not spec.tie_embeddings else 0
        return total, n * spec.layer_params() + spec.norm_params + head
    return total, lora_params(spec, setup)


def lora_params(spec: ModelSpec, setup: TrainingSetup) -> int:
    r = setup.lora_rank
    n = 0
    adapted = spec.lora_modules(setup.lora_targets)
    for s in (*spec.attn_linears(), *spec.mlp_linears()):
        if s.name in adapted:
            n += s.copies * r * (s.in_features + s.out_features)
    n *= spec.num_layers
    if "lm_head" in setup.lora_targets:
        n += r * (spec.hidden_size + spec.vocab_size)
    return n


def explain(spec: ModelSpec, setup: TrainingSetup, comps: dict[Kind, int], peak_phase: str) -> list[str]:
    """Plain-language notes: the rules of thumb this setup reproduces and where the peak sits."""
    notes: list[str] = []
    p = spec.param_count
    w = setup.weight_dtype
    if w.is_float:
        notes.append(f"weights: {p / 1e9:.2f}B parameters x {w.itemsize} bytes ({w.value}) = "
                     f"{p * w.itemsize / GiB:.2f} GiB ({p * w.itemsize / GB:.1f} GB)")
    else:
        notes.append(f"weights: {p / 1e9:.2f}B parameters in {w.value}"
                     + (" (0.5 bytes each plus block scales)" if w is DType.NF4 else " (1 byte each plus row scales)")
                     + "; embeddings, norms and lm_head stay in the compute dtype")
    if setup.method is Method.FULL and setup.optimizer is Optimizer.ADAMW:
        per = _bytes_per_param(setup)
        notes.append(f"full fine-tuning with AdamW keeps {per} bytes per parameter before activations "
                     f"(weights, gradients, two optimizer states{', fp32 master' if setup.has_master_copy else ''})")
    if setup.uses_lora:
        notes.append(f"LoRA r={setup.lora_rank} on {', '.join(spec.lora_modules(setup.lora_targets))}: "
                     f"{lora_params(spec, setup) / 1e6:.1f}M trainable parameters in {setup.adapter_dtype.value}")
    logits = comps.get(Kind.LOGITS, 0)
    if logits and logits > 0.2 * sum(comps.values()):
        notes.append(f"the loss dominates: logits are upcast to fp32 for {spec.vocab_size:,} vocabulary entries "
                     "per token (about 12-14 bytes per token x vocab at the start of backward); "
                     "a chunked loss avoids it")
    phase, _, step = peak_phase.partition("@")
    where = {"forward": "at the end of the forward pass", "backward": "in the backward pass",
             "optimizer": "inside the optimizer step", "load": "while loading"}.get(phase, phase)
    first = " of the first step (when the optimizer state is created)" if step == "1" else ""
    notes.append(f"the peak sits {where}{first}")
    return notes


def _bytes_per_param(setup: TrainingSetup) -> int:
    w = setup.weight_dtype.itemsize
    if setup.has_master_copy:
        return w + w + 4 + 8
    return w * 4

