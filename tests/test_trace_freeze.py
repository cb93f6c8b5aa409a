"""Freeze (train the last k layers) answered by the trace (issue 12): the trained layers are kept at their full
count in every run and the frozen ones before them repeat, so the tape is fitted and verified as for the other
recipes; the trained count is part of the cache key."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from vramlab.core.cache import key_digest
from vramlab.core.estimate import estimate
from vramlab.core.estimator.stored import TraceStore
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core import traced  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=7, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000, tape="traced")
FREEZE = TrainingSetup(method="freeze", trainable_layers=2, micro_batch=2, seq_len=300)


def test_the_trained_layer_count_is_part_of_the_key() -> None:
    keys = {key_digest(traced.recipe_key(FREEZE.replace(trainable_layers=k))) for k in (1, 2, 3)}
    assert len(keys) == 3
    assert key_digest(traced.recipe_key(FREEZE)) == \
        key_digest(traced.recipe_key(FREEZE.replace(micro_batch=5, seq_len=999)))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VRAMLAB_TRACE_MATRIX"), reason="a fitted trace (20-120 s on two cores): "
                    "set VRAMLAB_TRACE_MATRIX=1")
def test_freeze_is_traced_and_equals_simulate_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    plain = dataclasses.replace(LLAMA, tape="auto")
    for setup in (FREEZE, FREEZE.replace(micro_batch=3, seq_len=500)):  # neither point was fitted
        est = estimate(LLAMA, setup, match_simulation=True)
        assert est.source.startswith("traced") and "the last 2 trained" in est.notes[0]
        ref = simulate(plain, setup, hf=True)
        assert est.peak_allocated_bytes == ref.peak_allocated_bytes
        assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in ref.phases}
        assert (est.total_params, est.trainable_params) == (ref.total_params, ref.trainable_params)
