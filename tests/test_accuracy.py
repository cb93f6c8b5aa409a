"""The estimator held to an independent measurement: the fake-tensor simulation of the same step.

Over 110 setups from the presets (every 8th at the preset's full depth, the others with its widths and four
layers: tests/support/matrix.py; every method, precision, optimizer and implementation, checkpointing
on and off, batch 1-8, sequence 128-8192, sharding), the estimate of the simulated run must agree with it
exactly, in total, per category and per phase. The estimate of a CUDA run differs from the simulation by
two known mechanisms (engine.Engine: out-of-place gradient accumulation under a dispatch mode, and fp32
LayerNorm statistics on CUDA); the CUDA estimate is checked to differ from the simulation by no more
than those mechanisms allow; where CUDA runs SDPA's math kernel (fp32 grouped-query attention under torch 2.13)
against the simulation with that kernel forced.
"""

from __future__ import annotations

import pytest

from tests.support.accuracy import beyond_tolerance, held
from tests.support.matrix import setups

MATRIX = setups()


def test_matrix_covers_the_dimensions():
    assert len(MATRIX) >= 100
    kinds = {
        "method": {s.method for _m, s, _l in MATRIX},
        "optimizer": {s.optimizer for _m, s, _l in MATRIX},
        "weights": {s.weight_dtype for _m, s, _l in MATRIX},
        "sharding": {s.sharding for _m, s, _l in MATRIX},
    }
    assert len(kinds["method"]) == 4 and len(kinds["optimizer"]) == 7
    assert len(kinds["weights"]) >= 5 and len(kinds["sharding"]) >= 4
    assert {s.grad_ckpt for _m, s, _l in MATRIX} == {True, False}
    assert min(s.micro_batch for _m, s, _l in MATRIX) == 1 and max(s.micro_batch for _m, s, _l in MATRIX) == 8
    assert min(s.seq_len for _m, s, _l in MATRIX) == 128 and max(s.seq_len for _m, s, _l in MATRIX) == 8192


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "setup"), [pytest.param(m, s, id=lbl) for m, s, lbl in MATRIX])
def test_estimate_equals_simulation(spec, setup):
    # which simulation each estimate is held to, and how closely: tests/support/accuracy.py (the benchmark's too)
    apart = beyond_tolerance(spec, setup, held(spec, setup))
    assert not apart, apart
