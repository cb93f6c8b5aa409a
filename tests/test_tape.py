"""The tape's evaluation: many points at once agree with one at a time, and a tape that replayed each run
of identical layers once (and multiplies it) agrees with the tape that replayed every layer."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import Phase as HPhase  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vramlab.core.catalog import find_model  # noqa: E402
from vramlab.core.estimator import record_tape  # noqa: E402
from vramlab.core.estimator.engine import KINDS, Engine  # noqa: E402
from vramlab.core.estimator.poly import Poly  # noqa: E402
from vramlab.core.estimator.tape import Tape  # noqa: E402
from vramlab.core.kinds import Phase  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

SETUPS = [
    ("smollm2-135m", TrainingSetup(method="lora")),
    ("smollm2-135m", TrainingSetup(method="full", optimizer_impl="single", grad_accum=2)),
    ("qwen2.5-0.5b", TrainingSetup(method="qlora", lora_targets="all-linear", grad_ckpt=True)),
    ("qwen2.5-0.5b", TrainingSetup(method="freeze", trainable_layers=5, weights="fp32", compute="bf16")),
    ("llama-3.2-1b", TrainingSetup(method="full", master_weights=True, sharding="fsdp", gpus=2)),
]
POINTS = [(1, 128, 8), (2, 512, 16), (8, 4096, 64), (3, 257, 7), (1, 1, 1), (16, 8192, 4)]


def _same(a, b) -> None:  # noqa: ANN001
    assert a.peak == b.peak
    assert a.peak_phase == b.peak_phase
    assert a.largest_alloc == b.largest_alloc
    assert list(a.peak_kinds) == list(b.peak_kinds)
    assert list(a.phase_peaks) == list(b.phase_peaks)
    for key in a.phase_peaks:
        assert a.phase_peaks[key][0] == b.phase_peaks[key][0], key
        assert list(a.phase_peaks[key][1]) == list(b.phase_peaks[key][1]), key


@pytest.mark.parametrize(("model", "setup"), SETUPS, ids=[f"{m}-{s.method.value}" for m, s in SETUPS])
def test_many_points_at_once_match_one_at_a_time_and_the_full_depth_tape(model, setup):  # noqa: ANN001
    spec = find_model(model)
    reduced = record_tape(spec, setup).tape
    full = record_tape(spec, setup, reduced=False).tape
    assert reduced.n < full.n  # the reduced tape really repeats a block
    rank = setup.lora_rank if setup.uses_lora else 1
    points = [(b, s, rank if setup.uses_lora else 1) for b, s, _r in POINTS if (b > 1) == (setup.micro_batch > 1)]
    many = reduced.evaluate_many(np.array(points))
    for i, (b, s, r) in enumerate(points):
        one = reduced.evaluate(b, s, r)
        _same(many.point(i), one)
        _same(one, full.evaluate(b, s, r))


def test_a_size_past_what_int64_sums_hold_is_refused_not_wrapped():
    tape = record_tape(find_model("llama-2-7b"), TrainingSetup()).tape
    with pytest.raises(ValueError, match="EiB"):
        tape.evaluate(4_294_967_296, 8_589_934_592, 1)


def test_a_chain_of_thousands_of_views_is_freed_without_recursion():
    """An MoE layer's index_add_ per expert makes a view of a view per expert: 1,000 experts overflowed
    the recursion limit."""
    from vramlab.core.estimator.engine import Engine
    from vramlab.core.kinds import Kind, Phase

    e = Engine()
    e.set_phase(Phase.FORWARD, 1)
    out = e.alloc(4096, Kind.ACTIVATIONS)
    for _ in range(5_000):
        view = e.view(out)
        e.drop(out)
        out = view
    e.drop(out)
    assert e.tape[-1][1] == -1 and e.tape[-1][0] == 4096  # the storage is freed once, at the end


@pytest.mark.parametrize(("copy", "used", "gathered"), [(False, 1, 1), (True, 2, 2), (False, 0, 0)])
def test_a_gathering_view_backward_makes_one_whole_gradient_from_its_views(copy, used, gathered):  # noqa: ANN001
    """chunk / split / unbind (Ops.gathering_views): the views' gradients, one or both, become one gradient of
    the input's full size (zeros for a view that got none); unbind's reshape copies it once more; when no view
    got one, nothing is allocated."""
    from vramlab.core.estimator.ops import Ops
    from vramlab.core.kinds import Kind

    e = Engine()
    ops = Ops(e)
    w = ops.param(64, "f32", Kind.WEIGHTS, True)
    x = ops.cast(w, "bf16")  # 128 bytes; its gradient's (w's) 256
    views = ops.gathering_views(x, [32, 32], copy=copy)
    ys = [ops.unary(v) for v in views[:used]] or [ops.unary(w, numel=8)]  # a loss past the views
    loss = ops.new(1, "f32")
    e.node(loss, [(y, ops.gbytes(y)) for y in ys])
    e.set_phase(Phase.BACKWARD, 1)
    start = len(e.tape)
    e.backward(loss)
    allocs = [int(row[0].value(1, 1, 1)) for row in e.tape[start:] if row[1] == 1]
    assert allocs.count(128) == gathered  # x's whole gradient (and unbind's copy of it)
    assert allocs.count(64) == 2 * used  # each used view's own gradient (and its op's), released into it


def test_a_hundred_points_through_the_float_path_match_one_at_a_time():
    """More than 64 points are evaluated in float64 (exact below 2**52 bytes, which is checked)."""
    tape = record_tape(find_model("qwen2.5-0.5b"), TrainingSetup(method="lora", micro_batch=2)).tape
    rng = np.random.default_rng(3)
    points = np.stack([rng.integers(2, 33, 100), rng.integers(1, 16_385, 100), rng.integers(1, 257, 100)], axis=1)
    many = tape.evaluate_many(points)
    for i, (b, s, r) in enumerate(points.tolist()):
        _same(many.point(i), tape.evaluate(b, s, r))


def test_a_sequence_whose_unused_monomials_pass_int64_still_evaluates():
    """b x s^2 of a 4-billion-token sequence is past int64; without eager attention no size uses it."""
    tape = record_tape(find_model("smollm2-135m"), TrainingSetup()).tape
    assert tape.evaluate(1, 4_000_000_000, 1).peak > tape.evaluate(1, 2_000_000_000, 1).peak > 0


# ---- one point at a time (Tape._point) against many at once (Tape._columns) and the written-out tape ---------
_PHASES = ((Phase.LOAD, 0), (Phase.FORWARD, 1), (Phase.BACKWARD, 1), (Phase.OPTIMIZER, 1), (Phase.FORWARD, 2))
_SIZE = st.tuples(*(st.integers(0, 9) for _ in range(3)), st.integers(0, 3)).map(
    lambda c: Poly((c[0] * 700 + 1, c[1] * 300, c[2] * 40, 0, c[3] * 5, 0, 0, 0)))  # 1 + b + s + bs: never 0
_OPS = st.lists(st.tuples(st.sampled_from(("alloc", "free", "reclassify")), _SIZE, st.sampled_from(KINDS[:10]),
                          st.integers(0, 99)), max_size=12)


def _program(e: Engine, ops: list, live: list, mine: list) -> None:
    """``ops`` on the engine: frees and reclassifications take one of ``mine`` (tensors of this stretch)."""
    for op, size, kind, pick in ops:
        if op == "alloc" or not mine:
            h = e.alloc(size, kind)
            live.append(h)
            mine.append(h)
        elif op == "free":
            h = mine.pop(pick % len(mine))
            live.remove(h)
            e.drop(h)
        else:
            e.reclassify(mine[pick % len(mine)], kind)


def _tape(phases: list, repeats: int | None) -> Tape:
    """Each phase: a stretch, a block of ops (repeated ``repeats`` times by multiplicity, or written out when
    ``repeats`` is None), a stretch. A block frees only what it allocated in the same repetition, and what a
    block keeps is not touched after it (the written-out tape has a copy per repetition)."""
    e = Engine()
    live: list = []
    pinned: list = []
    for (phase, step), (before, block, times, after) in zip(_PHASES, phases):
        e.set_phase(phase, step)
        e.tag = 0
        if not live:
            first = e.alloc(Poly.of(4096), KINDS[0])  # freed last: every tape has a free
            live.append(first)
        _program(e, before, live, [h for h in live if h not in pinned and h is not first])
        for _ in range(1 if repeats is not None else times):
            e.tag = 1 + 2 * len(e.phases) if repeats is not None else 0
            own: list = []
            _program(e, block, live, own)
            pinned += own
        e.tag = 0
        _program(e, after, live, [h for h in live if h not in pinned and h is not first])
    e.drop(first)
    mult = {1 + 2 * (k + 1): times for k, (_b, _blk, times, _a) in enumerate(phases)} if repeats is not None else {}
    return Tape(e.tape, e.phases, mult, e.hids)


@settings(max_examples=50, phases=[HPhase.explicit, HPhase.reuse, HPhase.generate, HPhase.shrink])
@given(phases=st.lists(st.tuples(_OPS, _OPS.filter(bool), st.integers(2, 6), _OPS), min_size=1, max_size=5),
       points=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 70_000), st.integers(1, 64)), min_size=1,
                       max_size=4))
def test_one_point_at_a_time_is_many_at_once_and_the_written_out_tape(phases, points):  # noqa: ANN001
    """The single-point path (in blocks, choices in Python) against the array path and against the tape with
    every repetition written out, over programs whose peaks sit before, inside and after repeated blocks."""
    reduced, full = _tape(phases, repeats=1), _tape(phases, repeats=None)
    many = reduced.evaluate_many(np.array(points))
    for i, (b, s, r) in enumerate(points):
        one = reduced.evaluate(b, s, r)
        _same(one, many.point(i))
        _same(one, full.evaluate(b, s, r))
        assert reduced.evaluate(b, s, r) is one  # the same point again is not evaluated again
