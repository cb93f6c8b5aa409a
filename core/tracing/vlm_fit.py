"""The trace's fit of a whole vision-language model with its tower cut too (issue 16): a few runs of transformers'
own class at small depths (:mod:`.capture`), solved (:mod:`.solve`) into a tape that repeats each decoder layer and
each tower block. The model itself is built by :mod:`.vlm_traced`; this module only fits, so the builder never
imports the capture that runs it."""

from __future__ import annotations

import time
from typing import Any

from vramlab.core.tracing.vlm_traced import config_from_json, tower_depth, tower_kept_whole


def trace_fitted_with_tower(plan: Any, progress: Any = None, should_abort: Any = None) -> dict | None:
    """:func:`.trace.trace_fitted` for a whole VLM with its tower cut as well: the template has 3 decoder
    layers and 3 tower blocks; one run with a decoder layer fewer and one with a block fewer say what one
    layer and one block add; one run with a layer more and one with a block more verify at a further point.
    The tape repeats each decoder layer's events ``layers - 2`` times and each block's ``blocks - 2`` times.
    None when the tower is kept whole (:func:`tower_kept_whole`) or its blocks do not repeat: then the
    plain trace runs with the tower whole."""
    from vramlab.core.tracing import capture, solve

    spec, setup = plan.spec, plan.setup
    cfg = config_from_json(plan.config_json or spec.transformers_config)
    # a freeze recipe's trained last layers (plan.kept) are in every run at their full count; the depths below
    # count the frozen layers that repeat
    blocks, layers, kept = tower_depth(cfg), plan.layers - plan.kept, plan.kept
    if tower_kept_whole(cfg) is not None or layers <= 3:
        return None
    t0 = time.perf_counter()
    sym_b, _sym_s, sym_r = plan.symbolic
    cols = solve.basis(plan.symbolic)
    bs = solve.B_FIT if sym_b else (setup.micro_batch,)
    rs = solve.R_FIT if sym_r else (setup.lora_rank,)
    points = solve.choose_points([(b, s, r) for r in rs for s in plan.s_fit for b in bs], cols)
    check = (solve.B_CHECK if sym_b else setup.micro_batch, plan.s_check, solve.R_CHECK if sym_r else setup.lora_rank)
    total_runs = len(points) + 4
    done = 0

    def run(d: int, dv: int, p: tuple[int, int, int]) -> tuple:
        nonlocal done
        if progress is not None:
            progress(f"tracing {d + kept} layers and {dv} vision blocks at batch {p[0]}, sequence {p[1]}"
                     + (f", rank {p[2]}" if setup.uses_lora else ""), done / total_runs)
        out = capture.trace_both(spec, setup, capture.Point(d + kept, *p), plan.config_json, should_abort,
                                 vision_depth=dv)
        done += 1
        return out

    key = (plan.config_json or repr(spec), repr(setup), "tower")
    if key not in capture.WARM:  # the first run of a class frees load-time temporaries elsewhere (see trace_fitted)
        capture.trace_both(spec, setup, capture.Point(1 + kept, *points[0]), plan.config_json, should_abort,
                           vision_depth=1)
        capture.WARM.add(key)
    traces = [run(3, 3, p) for p in points]
    lows = (run(2, 3, points[0]), run(3, 2, points[0]))
    more = (run(4, 3, check), run(3, 4, check))
    if progress is not None:
        progress("traced", 1.0)
    out: dict = {}
    for v, cuda in enumerate((True, False)):
        try:
            out[cuda] = _fit_with_tower(plan, points, check, [t[v] for t in traces], [t[v] for t in lows],
                                        [t[v] for t in more], blocks, time.perf_counter() - t0)
        except capture.TraceFailed:
            return None  # the blocks do not repeat here: the tower whole
    return out


def _apart(template: Any, fixed: list[tuple[int, int]], chunks: list[tuple[int, int]], target: Any,
           reps: int = 2) -> list[tuple[int, int]]:
    """``chunks`` (the vision blocks' stretches) moved off ``fixed`` (the decoder layers') where they overlap:
    inside a run of alike events (peft's adapters of both, one after the other) a stretch can be read at
    several offsets that expand to the same trace; each overlapping one is shifted to the nearest offset
    that still expands to ``target`` and overlaps nothing. Unchanged where no such offset exists."""
    import numpy as np

    from vramlab.core.tracing.solve import expanded

    def clear(a: int, b: int) -> bool:
        return all(b <= x or a >= y for x, y in fixed)

    out = list(chunks)
    for c, (a, b) in enumerate(out):
        if clear(a, b):
            continue
        lo = out[c - 1][1] if c else 0
        hi = out[c + 1][0] if c + 1 < len(out) else len(template)
        for k in sorted(range(-(b - a), b - a + 1), key=abs):
            if not (lo <= a + k and b + k <= hi) or not clear(a + k, b + k):
                continue
            trial = out[:c] + [(a + k, b + k)] + out[c + 1:]
            got, _ = expanded(template, trial, reps)
            if len(got) == len(target) and np.array_equal(got, target):
                out = trial
                break
    return out


def _fit_with_tower(plan: Any, points: list, check: tuple, traces: list, lows: list, more: list, blocks: int,
                    seconds: float) -> Any:
    import numpy as np

    from vramlab.core.estimator.stored import FITTED
    from vramlab.core.tracing import capture, solve

    setup, n = plan.setup, plan.layers - plan.kept  # the layers that repeat (plan.kept trained ones follow)
    template = traces[0]
    for t, p in zip(traces[1:], points[1:]):
        if t.structure() != template.structure():
            raise capture.TraceFailed(f"the step changes form between batch/sequence/rank {points[0]} and {p}")
    if any(t.managed_bytes for t in traces):
        raise capture.TraceFailed("paged optimizer states are not traced")
    coef = solve.solve_exact(points, solve.basis(plan.symbolic), np.array([t.sizes for t in traces], dtype=np.int64))
    codes: dict[tuple, int] = {}
    expect = np.array([codes.setdefault(t, len(codes)) for t in template.tokens(solve.values_at(coef, *check))])
    placed: list[list[tuple[int, int]]] = []
    for low, verify in zip(lows, more):
        chunks = solve.layer_chunks(low, template)
        got = np.array([codes.setdefault(t, len(codes)) for t in verify.tokens()])
        where = solve.place_chunks(expect, chunks, got, 2) if chunks else ([] if np.array_equal(expect, got) else None)
        if where is None:
            raise capture.TraceFailed("the fitted tape differs from a trace with one more layer or block")
        placed.append(where)
    placed[1] = _apart(expect, placed[0], placed[1], np.array([codes[t] for t in more[1].tokens()]))
    tag = np.full(len(template.ops), -1, dtype=np.int64)
    mult: dict[int, int] = {}
    for j, (a, b) in enumerate(sorted(placed[0] + placed[1])):
        if (tag[a:b] >= 0).any():
            raise capture.TraceFailed("a decoder layer's and a vision block's events overlap")
        tag[a:b] = j
        mult[j] = (n if (a, b) in placed[0] else blocks) - 2
    # parameters: the template's, with one layer's and one block's difference repeated
    inc = [template.total_params - low.total_params for low in lows]

    def total_at(d: int, dv: int) -> int:
        return template.total_params + (d - 3) * inc[0] + (dv - 3) * inc[1]

    r0 = points[0][2]
    grows = (setup.uses_lora and plan.symbolic[2], setup.vision_tuning == "lora" and plan.symbolic[2])
    if plan.symbolic[2] and setup.uses_lora:
        by_rank = {p[2]: t.trainable_params for p, t in zip(points, traces)}
        r1, r2 = sorted(by_rank)[:2]
        per_rank, rem = divmod(by_rank[r2] - by_rank[r1], r2 - r1)
        base = by_rank[r1] - per_rank * r1
    else:
        per_rank, rem, base = 0, 0, template.trainable_params
    step = []
    for low, g in zip(lows, grows):
        d = template.trainable_params - low.trainable_params
        q, left = divmod(d, r0) if g else (d, 0)
        rem = rem or left
        step.append((q, g))
    if rem:
        raise capture.TraceFailed("trainable parameters are not proportional to the LoRA rank")

    def trainable_at(d: int, dv: int, r: int) -> int:
        return base + per_rank * r + sum(k * (q * r if g else q) for k, (q, g) in zip((d - 3, dv - 3), step))

    for (d, dv), verify in zip(((4, 3), (3, 4)), more):
        if (verify.total_params, verify.trainable_params) != (total_at(d, dv), trainable_at(d, dv, check[2])):
            raise capture.TraceFailed("the parameter counts of one more layer or block do not follow the fitted ones")
    base_n = trainable_at(n, blocks, 0)
    where = f"batch {check[0]}, sequence {check[1]}" + (f", rank {check[2]}" if setup.uses_lora else "")
    return solve.make_tape(template, coef, tag, mult, plan.symbolic, total_at(n, blocks), base_n,
                           trainable_at(n, blocks, 1) - base_n, FITTED,
                           f"fitted at {len(points)} points ({3 + plan.kept} layers{_kept(plan)} and 3 vision "
                           f"blocks; one fewer of each), verified at {where} with one more layer and one more block",
                           seconds)


def _kept(plan: Any) -> str:
    return f" (the last {plan.kept} trained in each, the frozen ones repeated)" if plan.kept else ""
