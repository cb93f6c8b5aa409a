"""The tape's evaluation: many points at once agree with one at a time, and a tape that replayed each run
of identical layers once (and multiplies it) agrees with the tape that replayed every layer."""

from __future__ import annotations

import numpy as np
import pytest

from vramlab.core.catalog import find_model
from vramlab.core.estimator import record_tape
from vramlab.core.spec import TrainingSetup

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
