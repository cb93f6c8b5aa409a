"""The allocator replay's full-depth step written out from a depth-four recording (core/estimator/expand.py)
against the step recorded at full depth: the same allocations and frees, event for event, over varied
setups, and so the same replayed reserved level."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support import matrix  # noqa: E402
from vramlab.core import estimate as est_mod  # noqa: E402
from vramlab.core.allocator import CachingAllocator  # noqa: E402
from vramlab.core.catalog import find_model  # noqa: E402
from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.estimator import record_tape, symbolic_sizes  # noqa: E402
from vramlab.core.estimator.expand import expand_run, record  # noqa: E402
from vramlab.core.spec.options import Method  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402


def _canonical(ids: list[int]) -> list[int]:
    """Allocation ids renamed in order of first appearance (the two recordings number them differently)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(i, len(seen)) for i in ids]


@settings(max_examples=25, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(model=st.sampled_from(matrix.MODELS), depth=st.integers(5, 9), precision=st.sampled_from(matrix.PRECISIONS),
       optimizer=st.sampled_from(matrix.OPTIMIZERS), method=st.sampled_from(matrix.METHODS),
       sharding=st.sampled_from(({},) + matrix.SHARDINGS), ckpt=st.booleans(),
       batch_seq=st.sampled_from(matrix.BATCH_SEQ), point=st.tuples(st.integers(1, 6), st.integers(1, 3000)))
def test_the_written_out_step_is_the_full_depth_recording(model, depth, precision, optimizer, method, sharding,
                                                          ckpt, batch_seq, point):
    spec = matrix.shallow(find_model(model), depth)
    b, s = batch_seq
    try:
        setup = TrainingSetup(**{**precision, **optimizer, **method, **sharding}, grad_ckpt=ckpt, micro_batch=b,
                              seq_len=s)
        setup.validate(spec)
    except (SetupError, ValueError):
        hypothesis.assume(False)
    sym = symbolic_sizes(spec, setup)
    written = record(spec, setup, sym)
    runs = (depth - setup.trainable_layers, setup.trainable_layers) if setup.method is Method.FREEZE else (depth,)
    if max(runs) < 5:  # no run of alike layers long enough to write out: recorded at full depth instead
        assert written is None
        return
    assert written is not None
    full = record_tape(spec, setup, reduced=False).tape
    # at the recorded sizes, and elsewhere where they are symbolic (a batch of one is another structure)
    other = (max(point[0], 2) if sym[0] and b > 1 else b, point[1] if sym[1] else s, setup.lora_rank)
    for at in ((b, s, setup.lora_rank), other):
        ids, nbytes = full.allocation_columns(*at)
        got_ids, got_bytes = written.allocation_columns(*at)
        assert got_bytes == nbytes and _canonical(got_ids) == _canonical(ids)
    assert CachingAllocator().replay(zip(got_ids, got_bytes)).peak_reserved == \
        CachingAllocator().replay(zip(ids, nbytes)).peak_reserved


def _program(sizes: list[int]) -> tuple:
    """A hand-made depth-four step (tags 0, 1, 2, 3): each layer allocates its output (size ``sizes[layer]``)
    and a temporary, frees the temporary and the output of the layer below; a final free of the last output."""
    tag, hid, sign, size = [], [], [], []
    nxt = 1
    below = None
    for layer, nbytes in enumerate(sizes):
        out, tmp = nxt, nxt + 1
        nxt += 2
        for h, sg, n in ((out, 1, nbytes), (tmp, 1, 7), (tmp, -1, 7)) + (((below, -1, sizes[layer - 1]),)
                                                                         if below else ()):
            tag.append(layer)
            hid.append(h)
            sign.append(sg)
            size.append(n)
        below = out
    tag.append(-1)
    hid.append(below)
    sign.append(-1)
    size.append(sizes[-1])
    coef = np.zeros((len(size), 4), dtype=np.int64)
    coef[:, 0] = size
    sign_, tag_, hid_ = (np.array(x, dtype=np.int64) for x in (sign, tag, hid))
    return coef, sign_, np.zeros(len(size), dtype=np.int64), np.arange(len(size)), tag_, hid_


def test_layers_that_differ_are_not_written_out():
    """Seven layers from four: the chain of outputs runs through the copies; a middle layer of another size
    (layer 2 not like layer 1) gives None, so the caller records the full depth."""
    rows, _tags, ids = expand_run(*_program([200, 200, 200, 300]), 0, 7)
    coef, sign, *_ = _program([200, 200, 200, 300])
    events = [(int(i), int(coef[r, 0]) if sign[r] > 0 else -1) for r, i in zip(rows, ids)]
    allocs = [n for _i, n in events if n > 0]
    assert allocs == [200, 7] * 6 + [300, 7]
    freed = {i for i, n in events if n < 0}
    assert freed == {i for i, n in events if n > 0}  # every allocation freed once: the chain holds
    assert len([1 for _i, n in events if n < 0]) == len(freed)
    assert expand_run(*_program([200, 200, 250, 300]), 0, 7) is None


def test_the_replay_takes_the_written_out_step_and_falls_back_where_it_cannot(monkeypatch):
    """The reserved level through estimate() is the one replayed from the full-depth recording (the path
    taken before, and still where no run of alike layers is long enough to write out)."""
    deep, shallow = find_model("llama-3.2-1b"), matrix.shallow(find_model("llama-3.2-1b"), 4)
    for spec, setup, written in ((deep, TrainingSetup(method="lora", micro_batch=2, seq_len=700), True),
                                 (deep, TrainingSetup(method="freeze", trainable_layers=3, seq_len=300), True),
                                 (shallow, TrainingSetup(method="lora", seq_len=300), False)):
        est_mod._EXPANDED.clear()
        est_mod._REPLAYED.clear()
        got = estimate(spec, setup, allocator=True, calibration=None).peak_reserved_bytes
        assert [v is not None for v in est_mod._EXPANDED.values()] == [written]
        with monkeypatch.context() as m:
            m.setattr(est_mod.expand, "record", lambda *_a: None)
            est_mod._EXPANDED.clear()
            est_mod._REPLAYED.clear()
            assert estimate(spec, setup, allocator=True, calibration=None).peak_reserved_bytes == got


def test_allocations_empty_at_a_point_are_left_out_there_only():
    """An allocation whose size is zero at a point (here b - 1 at a batch of one) has neither its allocation nor
    its free in that point's columns, and has both at the next point (the columns keep nothing of a point
    that another needs)."""
    from vramlab.core.estimator.expand import Expanded

    coef = np.zeros((5, 8), dtype=np.int64)
    coef[0, :2] = coef[1, :2] = (-1, 1)  # b - 1 bytes: allocated by row 0, freed by row 1
    coef[2, 0] = coef[3, 0] = 100
    sign = np.array([1, -1, 1, -1, 1])
    rows, ids = np.array([4, 0, 2, 1, 3]), np.array([0, 1, 2, 1, 2])  # row 4: an event of no allocation
    written = Expanded(coef, sign, rows, ids, np.abs(coef[rows]).sum(axis=0).astype(np.float64))
    for b, want in ((3, ([1, 2, 1, 2], [2, 100, -1, -1])), (1, ([2, 2], [100, -1])),
                    (3, ([1, 2, 1, 2], [2, 100, -1, -1]))):
        assert written.allocation_columns(b, 8, 4) == want


@pytest.mark.parametrize("enabled", [True, False])
def test_the_recording_leaves_the_collector_as_it_found_it(enabled, monkeypatch):
    """record pauses the cyclic collector while it records: it resumes it where it was on (also when the
    recording fails), and leaves it off where the caller had it off (the app's workers)."""
    import gc

    spec, setup = matrix.shallow(find_model("llama-2-7b"), 6), TrainingSetup(method=Method.LORA)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        assert record(spec, setup, symbolic_sizes(spec, setup)) is not None
        assert gc.isenabled() is enabled

        def fail(*_a):  # noqa: ANN002
            raise RuntimeError("recording failed")

        monkeypatch.setattr("vramlab.core.estimator.driver.StepModel.run", fail)
        with pytest.raises(RuntimeError):
            record(spec, setup, symbolic_sizes(spec, setup))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
