"""The second source of tapes: the training step of transformers' own classes, traced.

The hand-written program (:mod:`vramlab.core.estimator.program`) mirrors a few families by hand. A trace
needs no mirror: the real model class (and peft) runs the instrumented step of :mod:`.step` under fake
tensors, as ``simulate --hf`` does, and every allocation, free and reclassification is recorded with its
kind and phase. Run

* at reduced depth: with 3 layers as the template, and once with 2 layers, whose difference is the
  events one more layer adds (pure insertions, else the layers do not repeat and the trace says so); a
  model of N layers is the template with those events repeated N - 2 times (the tape's blocks);
* at enough (batch, sequence, rank) points to determine every size exactly as an integer polynomial in
  the estimator's monomials (an exact rational solve; every event sequence must have the same form). Only
  the points that determine each tensor's *dimensions* are run (each dimension an integer polynomial in 1,
  b, s, r and bs: 4 points for full fine-tuning, 5 with LoRA, where the sizes need 5 and 8), the sizes at
  the others computed from those dimensions; and besides the template those points run the first optimizer
  step alone, each allocation of the second step sized as the one it repeats in the first (the phases of
  the two steps aligned event by event). Where that does not hold, or the tape it gives fails its
  verification, every point is traced with both steps, as the sizes were fitted before;
* and verified at a further point (another batch, sequence and rank, and 4 layers), event by event.

Where the step changes form with the sequence length (a sliding-window mask from ``s >= window`` on),
the sequence range is split at the config's window and each piece traced on its own; if the form still
changes, or a size is not a polynomial, the tape is traced for the requested sequence length only
(``SEQUENCE_FIXED``), and failing that the full-depth model is traced at exactly the requested point
(``DIRECT``, which is ``simulate --hf``). The mode and the reason are part of the result.

Under fake tensors torch runs the CPU's kernels and treats every tensor as a subclass: the tape is the
simulation's (``simulate --hf``), with the two known differences from a CUDA run that the hand-written
estimator models (see :class:`~vramlab.core.estimator.engine.Engine`) corrected here: a second gradient
added into an autograd input buffer is added in place on CUDA (under a dispatch mode torch allocates the
sum; the trace recognises the ``add`` that the engine runs between two nodes), and LayerNorm keeps its
statistics in fp32 on CUDA.

This module plans the points, fits and verifies; one run is recorded by :mod:`.capture`, and the exact solve,
the layer chunks and the tape they make are :mod:`.solve`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import numpy as np

from vramlab.core.checks import SetupError
from vramlab.core.estimator.poly import N
from vramlab.core.estimator.stored import DIRECT, FITTED, TracedTape
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.tracing import align
from vramlab.core.tracing.capture import ALLOC, PHASE, WARM, Point, Trace, TraceFailed, hf_config_at, trace_both
from vramlab.core.tracing.solve import (
    B_CHECK,
    B_FIT,
    R_CHECK,
    R_FIT,
    basis,
    choose_points,
    dim_basis,
    layer_chunks,
    make_tape,
    place_chunks,
    sizes_from_dims,
    solve_exact,
    values_at,
)

Progress = Callable[[str, float], None]  # (what is being traced, fraction done)


@dataclasses.dataclass
class Plan:
    """What to trace: the model (spec, and its transformers config for an architecture only traced),
    the recipe, and which sizes stay symbolic with the sequence values to fit them at."""

    spec: ModelSpec
    setup: TrainingSetup
    config_json: str
    layers: int
    symbolic: tuple[bool, bool, bool]
    s_fit: tuple[int, ...]  # the sequence lengths to fit at (one: the sequence is fixed)
    s_check: int
    kept: int = 0  # last layers kept at their full count in every run (a freeze recipe's trained layers)


def trace_fitted(plan: Plan, progress: Progress | None = None,
                 should_abort: Callable[[], bool] | None = None) -> dict[bool, TracedTape | TraceFailed]:
    """Trace ``plan`` at reduced depth over enough points to fit every size, verify at a further point
    (and one more layer), and return the tape of the full model as CUDA runs it (``True``) and as the
    simulation does (``False``), each a tape or the TraceFailed saying why there is none."""
    if plan.spec.vision is not None and plan.spec.vision.traced:  # a whole VLM: its tower reduced too
        from vramlab.core.tracing.vlm_fit import trace_fitted_with_tower

        made = trace_fitted_with_tower(plan, progress, should_abort)
        if made is not None:
            return made
    uneven = _uneven_layers(plan)
    if uneven:
        raise TraceFailed(uneven)
    t0 = time.perf_counter()
    setup = plan.setup
    sym_b, _sym_s, sym_r = plan.symbolic
    n = plan.layers - plan.kept  # the layers that repeat (depths below count these; plan.kept more follow)
    depth = min(n, 3)
    cols = basis(plan.symbolic)
    bs = B_FIT if sym_b else (setup.micro_batch,)
    rs = R_FIT if sym_r else (setup.lora_rank,)
    candidates = [(b, s, r) for r in rs for s in plan.s_fit for b in bs]
    points = choose_points(candidates, cols)
    # traced: the points that determine every tensor dimension; the sizes at the others follow from those
    # (traced too where they do not, or the tape they give fails its verification)
    ran = choose_points(points, dim_basis(plan.symbolic))
    check = (B_CHECK if sym_b else setup.micro_batch, plan.s_check, R_CHECK if sym_r else setup.lora_rank)
    total_runs = len(ran) + (1 if n > 3 else 0) + 1
    done = 0

    def run(d: int, p: tuple[int, int, int], steps: int = 2) -> tuple[Trace, Trace]:
        nonlocal done
        if progress is not None:
            progress(f"tracing {d + plan.kept} layers at batch {p[0]}, sequence {p[1]}"
                     + (f", rank {p[2]}" if setup.uses_lora else ""), min(done / total_runs, 0.99))
        out = trace_both(plan.spec, setup, Point(d + plan.kept, *p), plan.config_json, should_abort, steps=steps)
        done += 1
        return out

    key = (plan.config_json or repr(plan.spec), repr(setup))
    cold = key not in WARM
    if cold and len(ran) < 2:
        # the first run of a model class in a process may allocate or free a few load-time temporaries that
        # every later run does not (what it imports on first use): with nothing to compare it with, one
        # throw-away layer first, so that the runs compared have the same form
        trace_both(plan.spec, setup, Point(1 + plan.kept, *points[0]), plan.config_json, should_abort)
    WARM.add(key)
    template = run(depth, points[0])
    # the other points of `ran` run the first optimizer step only: its events are the template's first ones,
    # and each allocation of the second step has the size of the one it repeats (step_one_sources)
    sources = [step_one_sources(template[v]) for v in (0, 1)]
    first = {p: run(depth, p, steps=1) for p in ran[1:]} if None not in sources else {}
    if cold and first and not all(_prefix_of(first[ran[1]][v], template[v]) for v in (0, 1)):
        template = run(depth, points[0])  # the first run was not of the later runs' form: once more, warm
        sources = [step_one_sources(template[v]) for v in (0, 1)]
    low = run(2, points[0]) if n > 3 else None
    verify = run(4 if n > 3 else depth, check)
    full = {points[0]: template}  # two-step runs at every point (the fallback, and where ran is all there is)

    def fit(v: int) -> TracedTape:
        lower = low[v] if low else None
        if len(full) == len(points):  # every point traced: the sizes as measured
            runs = [full[p][v] for p in points]
            for tr, p in zip(runs[1:], points[1:]):
                if tr.structure() != runs[0].structure():
                    raise TraceFailed(f"the step changes form between batch/sequence/rank {points[0]} and {p}")
            return _fit(plan, points, points, check, runs, np.array([tr.sizes for tr in runs], dtype=np.int64),
                        lower, verify[v], time.perf_counter() - t0)
        tpl, src = template[v], sources[v]
        runs = [first[p][v] for p in ran[1:]]
        if src is None or not all(_prefix_of(tr, tpl) for tr in runs):
            raise TraceFailed("the first optimizer step changes form between the points")
        dims = [tpl.dims, *([tr.dims[a] for a in src] for tr in runs)]
        sizes = sizes_from_dims(dims, ran, points, dim_basis(plan.symbolic))
        return _fit(plan, points, ran, check, [tpl, *runs], sizes, lower, verify[v], time.perf_counter() - t0)

    if not first and len(points) > 1:  # no second step to read from the first: two steps at every point
        total_runs += len(points) - len(ran)
        full.update({p: run(depth, p) for p in points[1:]})
        if cold and any(full[points[1]][v].structure() != template[v].structure() for v in (0, 1)):
            template = full[points[0]] = run(depth, points[0])  # as above: the first run once more, warm
    out: dict[bool, TracedTape | TraceFailed] = {}
    for v, cuda in enumerate((True, False)):
        try:
            out[cuda] = fit(v)
        except TraceFailed as e:
            out[cuda] = e
    failed = [v for v, cuda in enumerate((True, False)) if isinstance(out[cuda], TraceFailed)]
    if failed and len(full) < len(points):  # as before: two steps at every point, the sizes as measured
        total_runs += len(points) - 1
        full.update({p: run(depth, p) for p in points[1:]})
        for v in failed:
            cuda = (True, False)[v]
            try:
                out[cuda] = fit(v)
            except TraceFailed as e:
                out[cuda] = e
    if progress is not None:
        progress("traced", 1.0)
    return out


def _uneven_layers(plan: Plan) -> str | None:
    """Why the model's layers cannot be fitted at reduced depth (None: they can). The fit runs its first three
    layers and two, and repeats the third for the rest, so every layer from the third on must be alike (class,
    ``layer_types`` entry, parameter shapes): a stack that starts with other layers (DeepSeek's dense ones) is
    fitted, one that interleaves kinds (Gemma 3's full-attention layer every six, LFM2's attention among
    convolutions) was cut to its first layers and the others silently left out. Read from the full model built
    on the meta device."""
    from vramlab.core.tracing.hfconfig import hf_config, plan_depth, task_of

    try:
        cfg = hf_config_at(plan.config_json, plan.layers) if plan.config_json else \
            hf_config(plan.spec, plan.setup.attention)
        stacks = plan_depth(task_of(cfg)).full_layers
    except (SetupError, TraceFailed, ValueError, TypeError, KeyError, AttributeError, RuntimeError):
        return None  # the trace itself says what it cannot build
    for name, sigs in stacks.items():
        kinds = list(dict.fromkeys(sigs[2:]))
        if len(kinds) > 1:
            shown = ", ".join(str(k[1] or k[0]) for k in kinds) if len({k[1] or k[0] for k in kinds}) > 1 \
                else f"{len(kinds)} parameter layouts"
            return (f"the layers of {name} are not all alike from the third on ({shown}): one more layer cannot "
                    "stand for the rest")
    return None


def _prefix_of(run: Trace, template: Trace) -> bool:
    """Whether ``run`` (the first optimizer step) has the form of the start of ``template`` (two steps)."""
    return run.ops == template.ops[:len(run.ops)] and run.phases == template.phases[:len(run.phases)] \
        and len(run.ops) < len(template.ops) and template.ops[len(run.ops)][0] == PHASE


def step_one_sources(template: Trace) -> list[int] | None:
    """For each allocation of ``template`` (two optimizer steps), the allocation of the first step whose size
    it has: itself within the first step; for the second step's, the allocation at the same place of the first
    step's phase of the same kind (each phase of the second step aligned with its counterpart, event by event;
    the optimizer's first step also creates its states). None where an allocation of the second step has no
    counterpart (the tape is then fitted from two-step runs)."""
    segments: list[tuple[str, int, int]] = []  # (phase, first op, end op)
    for i, (op, _a, _k, _nk, ph) in enumerate(template.ops):
        if op == PHASE:
            if segments:
                segments[-1] = (*segments[-1][:2], i)
            segments.append((template.phases[ph], i + 1, len(template.ops)))
    steps: dict[int, list[tuple[str, int, int]]] = {}
    for name, a, b in segments:
        kind, _, step = name.partition("@")
        if step.isdigit():
            steps.setdefault(int(step), []).append((kind, a, b))
    if sorted(steps) != [1, 2]:
        return None
    sources = list(range(len(template.sizes)))
    tokens = template.tokens()

    def same(j: int) -> tuple:  # an event without its phase's name (which names the step)
        op, k, nk, _ph, size = tokens[j]
        return op, k, nk, size

    one, two = steps[1], steps[2]
    if [k for k, _, _ in one] != [k for k, _, _ in two]:
        return None
    for (_, a1, b1), (_, a2, b2) in zip(one, two):
        mapped: dict[int, int] = {}  # difflib's alignment in linear time (the steps' phases repeat their events)
        for tag, i1, i2, j1, _j2 in align.opcodes([same(j) for j in range(a2, b2)], [same(j) for j in range(a1, b1)]):
            if tag == "equal":
                mapped.update({a2 + i: a1 + j1 + (i - i1) for i in range(i1, i2)})
        for j in range(a2, b2):
            op, alloc = template.ops[j][:2]
            if op != ALLOC:
                continue
            there = mapped.get(j)
            if there is None:
                return None
            sources[alloc] = template.ops[there][1]
    return sources


def _fit(plan: Plan, points: list[tuple[int, int, int]], ran: list[tuple[int, int, int]], check: tuple[int, int, int],
         traces: list[Trace], sizes: np.ndarray, low: Trace | None, verify: Trace, seconds: float) -> TracedTape:
    """The tape from ``traces`` (run at ``ran``; the first, at the first of ``points``, is the template, whose
    form the others have) and ``sizes`` (every allocation's size at each of ``points``), verified against
    ``verify``."""
    setup = plan.setup
    n = plan.layers - plan.kept
    depth = min(n, 3)
    sym_r = plan.symbolic[2]
    template = traces[0]
    if any(tr.managed_bytes for tr in traces):
        raise TraceFailed("paged optimizer states are not traced")
    chunks = layer_chunks(low, template) if low is not None else []
    coef = solve_exact(points, basis(plan.symbolic), sizes)
    # parameters: the template's, one layer's difference repeated (LoRA: adapters scale with the rank)
    total_at = functools.partial(_extend, template.total_params, low.total_params if low else 0, depth=depth)
    lora = setup.uses_lora and sym_r
    if lora:
        by_rank = {p[2]: tr.trainable_params for p, tr in zip(ran, traces)}
        r1, r2 = sorted(by_rank)[:2]
        per_rank, rem = divmod(by_rank[r2] - by_rank[r1], r2 - r1)
        base = by_rank[r1] - per_rank * r1
        layer, rem2 = divmod(template.trainable_params - low.trainable_params, points[0][2]) if low else (0, 0)
        if rem or rem2:
            raise TraceFailed("trainable parameters are not proportional to the LoRA rank")

        def trainable_at(d: int, r: int) -> int:
            return base + (per_rank + (d - depth) * layer) * r
    else:
        def trainable_at(d: int, r: int) -> int:
            return _extend(template.trainable_params, low.trainable_params if low else 0, d, depth)
    # verify at a point not fitted, with one more layer than the template where the model has it
    vdepth = 4 if n > 3 else depth
    codes: dict[tuple, int] = {}
    expect = np.array([codes.setdefault(t, len(codes)) for t in template.tokens(values_at(coef, *check))])
    got = np.array([codes.setdefault(t, len(codes)) for t in verify.tokens()])
    placed = place_chunks(expect, chunks, got, vdepth - 2) if chunks else \
        ([] if np.array_equal(expect, got) else None)
    where = f"batch {check[0]}, sequence {check[1]}" + (f", rank {check[2]}" if setup.uses_lora else "")
    if placed is None:
        raise TraceFailed(f"the fitted tape differs from a trace at {where} ({vdepth + plan.kept} layers)")
    chunks = placed
    if (verify.total_params, verify.trainable_params) != (total_at(vdepth), trainable_at(vdepth, check[2])):
        raise TraceFailed("the parameter counts of one more layer do not follow the fitted ones")
    tag = np.full(len(template.ops), -1, dtype=np.int64)
    for j, (a, b) in enumerate(chunks):
        tag[a:b] = j
    mult = {j: n - 2 for j in range(len(chunks))}
    base, per_rank = trainable_at(n, 0), (trainable_at(n, 1) - trainable_at(n, 0) if lora else 0)
    return make_tape(template, coef, tag, mult, plan.symbolic, total_at(n), base, per_rank, FITTED,
                     f"fitted at {len(ran)} points ({depth + plan.kept} and {(2 if n > 3 else depth) + plan.kept} "
                     f"layers{_kept_note(plan)}), verified at {where} with {vdepth + plan.kept} layers", seconds)


def _kept_note(plan: Plan) -> str:
    return f", the last {plan.kept} trained in each and the frozen ones repeated" if plan.kept else ""


def _extend(at_depth: int, at_two: int, n: int, depth: int) -> int:
    return at_depth + (n - depth) * (at_depth - at_two) if n > depth else at_depth


def trace_direct(spec: ModelSpec, setup: TrainingSetup, config_json: str, reason: str,
                 progress: Progress | None = None,
                 should_abort: Callable[[], bool] | None = None) -> dict[bool, TracedTape]:
    """The full-depth model traced at exactly the setup's batch, sequence and rank (``simulate --hf``), as
    CUDA runs it (``True``) and as the simulation does (``False``)."""
    t0 = time.perf_counter()
    if progress is not None:
        progress(f"simulating all {spec.num_layers} layers at this point", 0.0)
    both = trace_both(spec, setup, Point(spec.num_layers, setup.micro_batch, setup.seq_len, setup.lora_rank),
                      config_json, should_abort)
    if progress is not None:
        progress("simulated", 1.0)
    out = {}
    for cuda, tr in zip((True, False), both):
        if tr.managed_bytes:
            raise TraceFailed("paged optimizer states are not traced")
        coef = np.zeros((len(tr.sizes), N), dtype=np.int64)
        coef[:, 0] = tr.sizes
        out[cuda] = make_tape(tr, coef, np.full(len(tr.ops), -1, dtype=np.int64), {}, (False, False, False),
                              tr.total_params, tr.trainable_params, 0, DIRECT, reason, time.perf_counter() - t0)
    return out





def supported(setup: TrainingSetup) -> str | None:
    """Why a recipe cannot be traced at reduced depth (None: it can). Freezing is: the trained last layers
    are kept at their full count in every run (``Plan.kept``) and the frozen ones before them repeat."""
    return None


__all__ = ["Plan", "supported", "trace_direct", "trace_fitted"]
