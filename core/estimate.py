"""`vramlab estimate`: the analytical answer, in well under a millisecond once a setup's structure is known.

The training step is replayed in bytes by the estimator engine (:mod:`vramlab.core.estimator`), which
mirrors, op by op, what the measured model builder allocates; the tape it records is evaluated for the
setup's batch, sequence length and LoRA rank. The outer levels (allocator reserved, device used) come
from :mod:`vramlab.core.levels`.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from vramlab.core.allocator import AllocatorConfig, CachingAllocator
from vramlab.core.calibration import Calibration, for_gpu
from vramlab.core.estimator import Recorded, TapeCache, evaluate, expand, structure_key, symbolic_sizes
from vramlab.core.estimator.engine import KIND_INDEX, KINDS
from vramlab.core.estimator.poly import ZERO, monomial_values
from vramlab.core.estimator.stored import DIRECT, TracedTape
from vramlab.core.estimator.tape import Tape
from vramlab.core.families import piece
from vramlab.core.kinds import Kind
from vramlab.core.levels import (
    CHURN_KINDS,
    REPLAY_BUDGET,
    attention_backward_scratch,
    attention_kernel,
    cublas_bytes,
    gpu_capability,
    outer_levels,
    slack_model,
)
from vramlab.core.result import Level, MemoryResult, PhasePeak
from vramlab.core.sdpa import (
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    MODELLED_TORCH,
    Choice,
    cuda_choice,
    installed_torch,
    tape_kernel,
)
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.hub_kernels import note as hub_note
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import DType, GenerationBackend, Method, Objective, Optimizer
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import result_notes as unsloth_notes
from vramlab.core.spec.unsloth import xformers_runs
from vramlab.core.spec.unsloth_loss import headroom_note as unsloth_headroom
from vramlab.core.spec.unsloth_loss import with_gpu as unsloth_with_gpu
from vramlab.core.traced import Progress, check_offloading, describe, traced_tape, uses_trace
from vramlab.core.units import GB, GiB
from vramlab.core.vision import vision_tokens

_CACHE = TapeCache()
_SIM_CACHE = TapeCache(match_simulation=True)


def _kinds(values: list[int] | np.ndarray) -> dict[Kind, int]:
    """Bytes by kind, the kinds with none left out (``values`` in the order of KINDS)."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    return {k: v for k, v in zip(KINDS, values) if v}


_FULL_CACHE = TapeCache(size=16, reduced=False)
_REPLAYED: OrderedDict[tuple, int] = OrderedDict()
_REPLAYED_LOCK = threading.Lock()
_EXPANDED: OrderedDict[tuple, expand.Expanded | None] = OrderedDict()  # full-depth allocations by structure
_MISSING = object()


def estimate(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None = None,
             match_simulation: bool = False, allocator: bool = False,
             alloc_conf: AllocatorConfig | None = None,
             calibration: Calibration | str | None = "auto", progress: Progress | None = None,
             should_abort: Callable[[], bool] | None = None) -> MemoryResult:
    """Predict per-GPU memory of ``setup`` on ``spec`` at the three levels, with the breakdown at the
    peak and the peak of every phase (load, then forward / backward / optimizer of steps 1 and 2).

    ``match_simulation`` predicts the fake-tensor simulation instead of a CUDA run (see
    :class:`~vramlab.core.estimator.engine.Engine`: gradient accumulation out of place while a dispatch
    mode is active, LayerNorm statistics in the input dtype on CPU).

    ``allocator``: compute the reserved level by replaying the step's allocations through the
    caching-allocator model (exact for the modelled allocator, ~0.5 s) instead of the fast model.

    ``calibration``: "auto" uses what a profile measured on ``gpu`` if one was saved, None ignores it.

    ``spec.tape`` chooses the hand-written program or the trace of transformers' own classes
    (:mod:`vramlab.core.traced`); a first trace reports to ``progress(text, fraction)`` and stops when
    ``should_abort()`` says so."""
    asked, setup = setup, unsloth_with_gpu(setup, gpu)  # what Unsloth's fused loss reads of the GPU (in the key)
    setup.validate(spec)
    check_offloading(spec, setup)
    program = piece(spec.vision.model_type, "program") if spec.vision is not None else None
    refuse = getattr(program, "check_estimate", None)  # what the family's program does not model
    if refuse is not None:
        refuse(spec, setup)
    t0 = time.perf_counter()
    traced = None
    if uses_trace(spec, setup):
        traced = traced_tape(spec, setup, progress, should_abort, cuda=not match_simulation)
        rec = Recorded(traced.tape, ZERO, traced.symbolic)
    else:
        rec = (_SIM_CACHE if match_simulation else _CACHE).get(spec, setup)
    ev, managed = evaluate(rec, setup)
    comps = _kinds(ev.peak_kinds)
    phases = tuple(PhasePeak(k, int(v[0]), _kinds(v[1])) for k, v in ev.phase_peaks.items())
    replayed = None
    skipped = 0
    # a hand-written family traced under auto: the warnings of the trace (none for the program it replaces)
    # (a transformers config's spec warns as a traced one already: no copy, whose checks cost 0.1 ms at a restart)
    as_is = traced is None or spec.tape == "traced" or bool(spec.transformers_config)
    warnings = tuple(setup.warnings(spec if as_is else replace(spec, tape="traced")))
    if allocator and traced is not None and traced.full_tape is None:
        warnings += ("the allocator-reserved level comes from the fast model: a traced tape with repeated "
                     "layers does not say which repetition frees what",)
    elif allocator:
        events = rec.tape.full_length
        if events <= REPLAY_BUDGET:
            replayed = _replayed_reserved(spec, setup, alloc_conf, traced)
        else:
            skipped = events
            warnings += (f"the allocator-reserved level comes from the fast model: a replay of this step's "
                         f"{events:,} allocations and frees would take several seconds",)
    cal = calibration
    if cal == "auto":
        cal = for_gpu(gpu.name) if gpu is not None else None
    # the SDPA kernel, asked once per estimate (none where Unsloth's attention runs xformers' instead)
    choice = None if xformers_runs(spec, setup) else cuda_choice(spec, setup, gpu_capability(gpu))
    reserved, device, overheads = outer_levels(spec, setup, ev.peak, comps, gpu, managed_bytes=managed,
                                               alloc_conf=alloc_conf, largest_alloc=ev.largest_alloc,
                                               calibration=cal, replayed_reserved=replayed, replay_skipped=skipped,
                                               kernel=choice.backend if choice is not None else None)
    total, trainable = param_counts(spec, setup) if traced is None else \
        (traced.total_params, traced.trainable(setup.lora_rank))
    notes = tuple(explain(spec, setup, comps, ev.peak_phase, traced)
                  + sdpa_notes(spec, setup, gpu, traced is not None, choice))
    if (note := unsloth_headroom(setup, gpu, device)) is not None:  # core/spec/unsloth_loss.py
        warnings += (note,)
    source = "hand-written" if traced is None else source_label(traced)
    notes += unsloth_notes(spec, setup, source, gpu_capability(gpu))  # core/spec/unsloth.py
    if traced is not None:
        notes = (describe(traced), *notes)
    return MemoryResult(
        level=Level.ESTIMATE, model=spec, setup=asked,
        peak_allocated_bytes=int(ev.peak), peak_reserved_bytes=reserved, device_used_bytes=device,
        components=comps, peak_phase=ev.peak_phase, phases=phases,
        total_params=total, trainable_params=trainable, overheads=overheads,
        warnings=warnings, notes=notes,
        gpu=gpu, timing={"total": time.perf_counter() - t0}, calibration=cal.label if cal else "",
        source=source,
    )


def source_label(traced: TracedTape) -> str:
    """The ``source`` of an answer from a traced tape: traced, or simulated where it was simulated directly."""
    if traced.mode == DIRECT:
        return "simulated (transformers + peft)"
    return f"traced (transformers {traced.transformers_version})"


def _replayed_reserved(spec: ModelSpec, setup: TrainingSetup, alloc_conf: AllocatorConfig | None,
                       traced: TracedTape | None = None) -> int:
    """The reserved level of the step replayed through the caching-allocator model; kept, so that an edit
    that changes neither the step nor the allocator's settings (a GPU, a margin, a unit) replays nothing."""
    key = (structure_key(spec, setup), setup.micro_batch, setup.seq_len, setup.lora_rank, alloc_conf,
           id(traced))
    with _REPLAYED_LOCK:
        if key in _REPLAYED:
            _REPLAYED.move_to_end(key)
            return _REPLAYED[key]
    full = _full_depth(spec, setup) if traced is None else traced.full_tape
    ids, nbytes = full.allocation_columns(setup.micro_batch, setup.seq_len, setup.lora_rank)
    reserved = CachingAllocator(alloc_conf).replay_columns(ids, nbytes).peak_reserved
    with _REPLAYED_LOCK:
        _REPLAYED[key] = reserved
        while len(_REPLAYED) > 1024:
            _REPLAYED.popitem(last=False)
    return reserved


def _full_depth(spec: ModelSpec, setup: TrainingSetup) -> expand.Expanded | Tape:
    """The step's full-depth allocations for the replay: written out from a depth-four recording where the
    layers repeat (:mod:`vramlab.core.estimator.expand`, 13-44 ms), else recorded at full depth (0.1-0.3 s);
    kept by structure either way (which of the two a structure takes is kept too)."""
    sym = symbolic_sizes(spec, setup)
    sizes = (setup.micro_batch, setup.seq_len, setup.lora_rank)
    key = (structure_key(spec, setup), *(v for i, (v, held) in enumerate(zip(sizes, sym))
                                         if not held and (i < 2 or setup.uses_lora)))
    with _REPLAYED_LOCK:
        found = _EXPANDED.get(key, _MISSING)
        if found is not _MISSING:
            _EXPANDED.move_to_end(key)
    if found is _MISSING:
        found = expand.record(spec, setup, sym)
        with _REPLAYED_LOCK:
            _EXPANDED[key] = found
            while len(_EXPANDED) > 16:
                _EXPANDED.popitem(last=False)
    return found if found is not None else _FULL_CACHE.get(spec, setup).tape


@dataclass(frozen=True)
class PointEstimates:
    """The fast estimate of one setup at many (micro batch, sequence length, LoRA rank) points, as arrays:
    point ``i`` gives the same numbers as ``estimate(spec, setup_at(i), gpu)``."""

    setup: TrainingSetup
    points: np.ndarray  # (P, 3) micro batch, sequence length, LoRA rank
    peak_allocated_bytes: np.ndarray  # (P,)
    peak_reserved_bytes: np.ndarray  # (P,)
    device_used_bytes: np.ndarray  # (P,)
    peak_phase: tuple[str, ...]  # (P,)
    components: np.ndarray  # (P, len(KINDS)) bytes per kind at the peak, in the order of KINDS

    def setup_at(self, i: int) -> TrainingSetup:
        b, s, r = (int(x) for x in self.points[i])
        return self.setup.replace(micro_batch=b, seq_len=s, lora_rank=r)


def estimate_points(spec: ModelSpec, setup: TrainingSetup, points: np.ndarray | list[tuple[int, int, int]],
                    gpu: GpuSpec | None = None, match_simulation: bool = False,
                    alloc_conf: AllocatorConfig | None = None,
                    calibration: Calibration | str | None = "auto") -> PointEstimates:
    """:func:`estimate` (fast levels) of ``setup`` with micro batch, sequence length and LoRA rank taken
    from each row of ``points``, evaluated together: a tape per structure, each tape once for all its
    points. Every distinct value of each of the three is validated as the single estimate would."""
    points = np.array(points, dtype=np.int64).reshape(-1, 3)
    setup = unsloth_with_gpu(setup, gpu)
    if not setup.uses_lora:
        points[:, 2] = setup.lora_rank
    setup.validate(spec)
    check_offloading(spec, setup)
    for column, name in enumerate(("micro_batch", "seq_len", "lora_rank")):
        for v in np.unique(points[:, column]).tolist():
            setup.replace(**{name: v}).validate(spec)
    cal = calibration
    if cal == "auto":
        cal = for_gpu(gpu.name) if gpu is not None else None
    sym_b, sym_s, sym_r = symbolic_sizes(spec, setup)
    # points sharing a tape: symbolic sizes do not change the structure (a batch of one does)
    group = points.copy()
    if sym_b:
        group[:, 0] = points[:, 0] == 1
    if sym_s:
        group[:, 1] = 0
    if sym_r or not setup.uses_lora:
        group[:, 2] = 0
    keys, which = np.unique(group, axis=0, return_inverse=True)
    which = which.reshape(-1)
    n = len(points)
    peak = np.zeros(n, dtype=np.int64)
    largest = np.zeros(n, dtype=np.int64)
    managed = np.zeros(n, dtype=np.int64)
    comps = np.zeros((n, len(KINDS)), dtype=np.int64)
    phase = [""] * n
    cache = _SIM_CACHE if match_simulation else _CACHE
    trace = uses_trace(spec, setup)
    if trace:
        # a traced tape holds the sizes it was fitted in: points share one when the same tape comes back
        found: dict[int, tuple] = {}
        which = np.zeros(n, dtype=np.int64)
        for i, (b, s, r) in enumerate(points.tolist()):
            t = traced_tape(spec, setup.replace(micro_batch=b, seq_len=s, lora_rank=r), cuda=not match_simulation)
            which[i] = found.setdefault(id(t), (len(found), t))[0]
        keys = np.zeros((len(found), 3))
        tapes = {g: Recorded(t.tape, ZERO, t.symbolic) for g, t in found.values()}
    for g in range(len(keys)):
        rows = np.flatnonzero(which == g)
        b, s, r = (int(x) for x in points[rows[0]])
        rec = tapes[g] if trace else cache.get(spec, setup.replace(micro_batch=b, seq_len=s, lora_rank=r))
        ev = rec.tape.evaluate_many(points[rows])
        peak[rows] = ev.peak
        largest[rows] = ev.largest_alloc
        comps[rows] = ev.peak_kinds
        for i, k in zip(rows.tolist(), ev.peak_phase.tolist()):
            phase[i] = ev.phase_keys[k]
        b, s, r = points[rows].T
        managed[rows] = np.array(rec.managed_bytes.coefficients, dtype=np.int64) @ np.stack(
            np.broadcast_arrays(*monomial_values(b, s, r)))
    churn = comps[:, [KIND_INDEX[k] for k in CHURN_KINDS]].sum(axis=1)
    frag = slack_model(churn, largest, alloc_conf)
    if cal is not None:
        frag = (frag * cal.slack_ratio).astype(np.int64)
    # inside the reserved level beside the slack: the cuBLAS workspaces (fixed) and the attention kernel's backward
    # scratch (by batch and sequence), as levels.outer_levels adds them for one point
    scratch = attention_backward_scratch(spec, setup, attention_kernel(spec, setup, gpu), points[:, 0], points[:, 1])
    reserved = peak + frag + cublas_bytes(gpu) + scratch
    # what lies between reserved and device (context, workspaces, NCCL) is the same at every point; the
    # paged optimizer states are not
    b, s, r = (int(x) for x in points[0])
    first = {KINDS[i]: int(v) for i, v in enumerate(comps[0]) if v}
    r0, d0, _ = outer_levels(spec, setup.replace(micro_batch=b, seq_len=s, lora_rank=r), int(peak[0]), first, gpu,
                             managed_bytes=int(managed[0]), alloc_conf=alloc_conf, largest_alloc=int(largest[0]),
                             calibration=cal)
    device = reserved + (d0 - r0 - int(managed[0])) + managed
    return PointEstimates(setup, points, peak, reserved, device, tuple(phase), comps)


def param_counts(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, int]:
    """(total parameters of the model, trainable parameters of the setup; LoRA adapters not in total)."""
    total = _param_count(spec)
    if spec.vision is not None:
        return total, _vlm_trainable(spec, setup)
    if setup.method is Method.FULL:
        return total, total
    if setup.method is Method.FREEZE:
        return total, _freeze_trainable(spec, setup)
    return total, lora_params(spec, setup)


def _freeze_trainable(spec: ModelSpec, setup: TrainingSetup) -> int:
    """The (language) model's parameters that ``--method freeze`` trains: its last layers and its extras."""
    n = int(setup.trainable_layers or 0) * spec.layer_params()
    embed = spec.vocab_size * spec.hidden_size if setup.trains("embed_tokens") else 0
    head = spec.lm_head_params() if setup.trains("lm_head") and not spec.tie_embeddings else 0
    return n + embed + head + (spec.norm_params if setup.trains("norm") else 0)


def _vlm_trainable(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Trainable parameters of a vision-language model: the language model by the method, the tower and
    projector by ``vision_tuning`` (LoRA on the tower's qkv, proj and MLP linears)."""
    v = spec.vision
    lm = spec.param_count - v.param_count
    n = lm if setup.method is Method.FULL else lora_params(spec, setup)
    if setup.method is Method.FREEZE:
        first = spec.num_layers - int(setup.trainable_layers or 0)
        n = _freeze_trainable(spec, setup) + v.freeze_extra_params(spec, first, setup.trains("embed_tokens"))
    tune = setup.vision_tuning
    if tune == "full":
        n += v.param_count
    elif tune == "projector":
        n += v.projector_params()
    elif tune == "lora":
        n += setup.lora_rank * v.lora_params_per_rank()
    return n


def lora_params(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Trainable adapter parameters: A and B (B alone with LoRA-FA; B's rows are the modules' outputs, which DoRA's
    magnitudes count too), and DoRA's magnitudes."""
    outputs = _adapted_outputs(spec, setup.lora_targets)
    n = setup.lora_rank * (outputs if setup.lora_fa else _lora_params_per_rank(spec, setup.lora_targets))
    return n + (outputs if setup.use_dora else 0)


@functools.lru_cache(maxsize=256)
def _adapted_outputs(spec: ModelSpec, targets: tuple[str, ...]) -> int:
    """Output features of every adapted module (the rows of B; one DoRA magnitude each)."""
    adapted = spec.lora_modules(targets)
    n = sum(s.copies * s.out_features for s in (*spec.attn_linears(), *spec.mlp_linears()) if s.name in adapted)
    return n * spec.num_layers + (spec.vocab_size if "lm_head" in targets else 0)


@functools.lru_cache(maxsize=256)
def _param_count(spec: ModelSpec) -> int:
    return spec.param_count


@functools.lru_cache(maxsize=256)
def _lora_params_per_rank(spec: ModelSpec, targets: tuple[str, ...]) -> int:
    n = 0
    adapted = spec.lora_modules(targets)
    for s in (*spec.attn_linears(), *spec.mlp_linears()):
        if s.name in adapted:
            n += s.copies * (s.in_features + s.out_features)
    n *= spec.num_layers
    if "lm_head" in targets:
        n += spec.hidden_size + spec.vocab_size
    return n


def optimizer_notes(setup: TrainingSetup) -> list[str]:
    """What torchao's low-bit AdamW and bitsandbytes' PagedAdamW32bit keep, in words."""
    opt = setup.optimizer
    if opt.is_torchao:
        what = {Optimizer.TORCHAO_ADAMW_8BIT: "uint8 codes, an fp32 scale per 256 elements and a 256-entry map",
                Optimizer.TORCHAO_ADAMW_4BIT: "two 4-bit codes per byte, an fp32 scale per 128 elements and a "
                                              "16-entry map",
                Optimizer.TORCHAO_ADAMW_FP8: "float8 e4m3 codes and an fp32 scale per 256 elements"}[opt]
        return [f"torchao 0.18.0 low-bit AdamW: each state of a tensor of 4096 elements or more keeps {what}; "
                "smaller tensors keep states in their own dtype. Its step is compiled per parameter "
                "(torch.compile) and fused in place on CUDA: no step temporaries are counted"]
    if opt is Optimizer.PAGED_ADAMW_32BIT:
        return ["bitsandbytes 0.50.2 PagedAdamW32bit: fp32 states, in CUDA managed memory for tensors of 100,000 "
                "elements or more (outside torch's counters; counted at the device level)"]
    return []


def lora_variant_notes(spec: ModelSpec, setup: TrainingSetup) -> list[str]:
    """What peft 0.21.2's DoRA and rsLoRA do to memory, in words."""
    out = []
    if setup.use_dora:
        biggest = max((s for s in (*spec.attn_linears(), *spec.mlp_linears())
                       if s.name in spec.lora_modules(setup.lora_targets)), default=None,
                      key=lambda s: s.in_features * s.out_features)
        size = f" ({biggest.name}: {biggest.in_features:,} x {biggest.in_features:,})" if biggest else ""
        out.append("DoRA (peft 0.21.2): a trainable magnitude vector per adapted module; each forward builds the "
                   f"adapter's full weight through an input-width identity{size}, casts the base weight to the "
                   "adapter dtype and takes the weight norm of their sum, and keeps the base output for backward. "
                   "peft adds the magnitudes once the model is built, with three temporaries the size of a module's "
                   "weight: the load phase here is that much low (it stays below the training peak)")
    if setup.lora_fa:
        out.append("LoRA-FA (peft 0.21.2 create_lorafa_optimizer): every lora_A frozen, so no gradient or state for A "
                   "and no adapter input kept for A's gradient; peft's LoraFAOptimizer keeps two states per B and "
                   "projects each B's gradient through (A A^T)^-1 under bf16 autocast")
    if setup.use_rslora:
        out.append("rsLoRA (peft 0.21.2 use_rslora) scales the adapter by alpha / sqrt(rank) instead of alpha / rank: "
                   "no tensor changes size")
    return out


# config keys that give a model's layers different kinds (attention, Mamba or linear-attention mixers, windows)
_LAYER_KINDS = ("layer_types", "attn_layer_indices", "hybrid_override_pattern", "layers_block_type")


def _uniform_cache(spec: ModelSpec) -> bool:
    """Whether generation's cache holds the same keys and values in every layer (the note's formula): not for a
    traced model whose config gives its layers different kinds (a Mamba or linear-attention hybrid, sliding windows
    beside full attention) or that has no attention."""
    if not spec.has_attention:
        return False
    if not spec.transformers_config:
        return True
    cfg = json.loads(spec.transformers_config)
    cfg = cfg.get("text_config") or cfg
    kinds = [cfg.get(k) for k in _LAYER_KINDS if cfg.get(k) is not None]
    return all(isinstance(v, list) and len({str(x) for x in v}) <= 1 for v in kinds)


def objective_notes(spec: ModelSpec, setup: TrainingSetup) -> list[str]:
    """What a DPO / GRPO step adds, in words (TRL 1.16.0; docs/levels.md)."""
    obj = setup.objective
    if obj is Objective.SFT:
        return []
    ref = {"copy": "a second frozen copy of the model", "adapters": "the policy with its LoRA adapters disabled "
           "(no second copy)", "precomputed": "precomputed log-probabilities (nothing on the GPU)",
           "none": "none (beta 0)"}[setup.reference_mode.value]
    out = [f"reference: {ref}", "log-probabilities through TRL's fused LM head: no batch x sequence x vocabulary "
           "logits, a 4096 x 32768 tile and fp32 gradient accumulators instead"]
    if obj is not Objective.GRPO:
        out.insert(0, f"{obj.value.upper()}: chosen and rejected in one forward: {2 * setup.micro_batch} rows of "
                      f"{setup.prompt_tokens} + {setup.completion_tokens} tokens")
        if spec.vision is not None and setup.vision_input().active:  # DataCollatorForVisionPreference
            out.insert(1, "each prompt's images run through the tower in its rejected row too (TRL's vision "
                          "collator repeats them), and its vision tokens are part of the prompt")
        return out
    rows = setup.micro_batch * setup.generation_steps
    images = spec.vision is not None and setup.vision_input().active
    if images:  # GRPOTrainer's processor puts the image placeholders in the prompt
        out.insert(0, "each prompt's images run through the tower in the generation's prefill and in every scoring "
                      "and loss forward; its vision tokens are part of the prompt")
    if setup.generation_backend is GenerationBackend.TRANSFORMERS and not _uniform_cache(spec):
        out.insert(0, f"GRPO: {rows} completions of {setup.completion_tokens} tokens generated with "
                      "transformers.generate; its cache (keys and values of its attention layers, the states of its "
                      "others) is counted by the trace")
    elif setup.generation_backend is GenerationBackend.TRANSFORMERS:
        # DynamicCache at the last token: keys and values of every layer (the cache dtype: the weights', fp32
        # under AMP with fp32 weights, since generation runs outside autocast), a VLM's image tokens too
        size = 4 if setup.weight_dtype is DType.FP32 else 2
        prompt = setup.prompt_tokens + (vision_tokens(spec.vision.processor, setup.vision_input()).llm_tokens
                                        if images else 0)
        kv = (2 * spec.num_layers * rows * spec.num_kv_heads * spec.head_dim
              * (prompt + setup.completion_tokens - 1) * size)
        out.insert(0, f"GRPO: {rows} completions of {setup.completion_tokens} tokens generated with "
                      f"transformers.generate; the KV cache reaches {kv / GiB:.2f} GiB at the last token")
    else:
        out.insert(0, f"GRPO: {rows} completions generated by {setup.generation_backend.value}; nothing of the "
                      "generation on the training allocator")
    return out


def explain(spec: ModelSpec, setup: TrainingSetup, comps: dict[Kind, int], peak_phase: str,
            traced: TracedTape | None = None) -> list[str]:
    """Plain-language notes: the rules of thumb this setup reproduces and where the peak sits (``traced``: the
    traced tape the estimate replays, which says what peft adapted and how much it trains)."""
    notes: list[str] = []
    p = _param_count(spec)
    w = setup.weight_dtype
    if w.is_float:
        notes.append(f"weights: {p / 1e9:.2f}B parameters x {w.itemsize} bytes ({w.value}) = "
                     f"{p * w.itemsize / GiB:.2f} GiB ({p * w.itemsize / GB:.1f} GB)")
    else:
        # a hand-written MoE's count is its own; a traced one's experts (dense layers, shared experts) the trace's
        experts = spec.fused_expert_params if not spec.transformers_config else 0
        kept = "fp32 (peft's k-bit preparation upcasts them)" if setup.kbit_upcast else setup.compute.value
        notes.append(f"weights: {(p - experts) / 1e9:.2f}B parameters in {w.value}"
                     + (" (0.5 bytes each plus block scales)" if w is DType.NF4 else " (1 byte each plus row scales)")
                     + "; embeddings, norms and lm_head stay in the compute dtype"
                     + (f"; the routed experts{f' ({experts / 1e9:.2f}B)' if experts else ''} stay in {kept}: "
                        "transformers 5 holds them as fused 3-D tensors, which bitsandbytes' quantization (of "
                        "nn.Linear layers) leaves as they are" if spec.is_moe else ""))
    if setup.method is Method.FULL and setup.optimizer is Optimizer.ADAMW:
        per = _bytes_per_param(setup)
        notes.append(f"full fine-tuning with AdamW keeps {per} bytes per parameter before activations "
                     f"(weights, gradients, two optimizer states{', fp32 master' if setup.has_master_copy else ''})")
    if setup.uses_lora:
        modules, count = spec.lora_modules(setup.lora_targets), lora_params(spec, setup)
        if traced is not None:  # what peft wrapped in transformers' own model (fused names included)
            modules, count = traced.meta.get("lora_modules") or modules, traced.trainable(setup.lora_rank)
        notes.append(f"LoRA r={setup.lora_rank} on {', '.join(modules)}: {count / 1e6:.1f}M trainable parameters "
                     f"in {setup.adapter_dtype.value}")
        notes += lora_variant_notes(spec, setup)
    notes += optimizer_notes(setup)
    logits = comps.get(Kind.LOGITS, 0)
    if logits and logits > 0.2 * sum(comps.values()):
        notes.append(f"the loss dominates: logits are upcast to fp32 for {spec.vocab_size:,} vocabulary entries "
                     "per token (about 12-14 bytes per token x vocab at the start of backward); "
                     "a chunked loss avoids it")
    notes += objective_notes(spec, setup)
    lora_modules = (traced.meta.get("lora_modules") or ()) if traced is not None and setup.uses_lora else ()
    notes += [n] if (n := hub_note(spec, setup, lora_modules)) else []
    phase, _, step = peak_phase.partition("@")
    where = {"forward": "at the end of the forward pass", "backward": "in the backward pass",
             "optimizer": "inside the optimizer step", "load": "while loading",
             "generate": "while generating completions", "reference": "in the reference forward"}.get(phase, phase)
    first = " of the first step (when the optimizer state is created)" if step == "1" else ""
    notes.append(f"the peak sits {where}{first}")
    return notes


def _bytes_per_param(setup: TrainingSetup) -> int:
    w = setup.weight_dtype.itemsize
    if setup.has_master_copy:
        return w + w + 4 + 8
    return w * 4


def sdpa_notes(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None, traced: bool = False,
               choice: Choice | None | bool = True) -> list[str]:
    """What the estimate modelled for ``--attention sdpa`` on ``gpu`` where it is not flash attention (see
    :mod:`vramlab.core.sdpa`): the math kernel (modelled on the hand-written path; a traced tape keeps the
    fused kernel of its CPU trace and says so), or cuDNN attention. ``choice``: the kernel already asked for
    (True: ask now)."""
    installed = _installed_torch()
    version = installed or MODELLED_TORCH  # the estimator-only build models the torch the project pins
    if choice is True:
        choice = cuda_choice(spec, setup, gpu_capability(gpu), torch_version=version)
    if choice is None or choice.backend in (FLASH, EFFICIENT):
        return []
    if not installed:
        version = f"{version} (modelled: none is installed)"
    if choice.backend == CUDNN:
        return [f"attention: with torch {version} SDPA runs cuDNN attention here ({choice.reason}); modelled: "
                "its saved tensors and its backward workspace"]
    if traced or tape_kernel(spec, setup, simulation=False) != MATH:
        return [f"attention: with torch {version} SDPA would run the math kernel here ({choice.reason}); this "
                "estimate assumes a fused kernel: --attention eager shows the materialised scores"]
    return [f"attention: with torch {version} SDPA runs the math kernel here ({choice.reason}); modelled: fp32 "
            "probabilities of batch x heads x seq² kept per layer"]


def _installed_torch() -> str:
    """torch's version from its metadata (no import; read once: sweeps call the estimate thousands of times)."""
    return installed_torch()
