"""TRL's fused LM head past its 4,096-row tile on a traced architecture (issue 28): DPO / KTO / GRPO score more
than 4,096 tokens a call there, where the tile stops growing, which has no polynomial form in batch or length. The
step is traced at the sizes asked, as before, but at reduced depth with the layers fitted (the tile is per call of
the head, after the layers), not simulated at full depth: the answer is the full-depth simulation's to the byte.
A fused loss kernel (Cut Cross Entropy, TRL's, Liger's), whose sizes no polynomial follows either, is such a head
too. The speed is recorded by benchmarks/trace_head.py, not timed here."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.test_objectives import FAMILIES  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402

LORA = dict(method="lora", lora_targets=("q_proj", "v_proj"))


@pytest.mark.slow  # three traces at reduced depth and a full-depth simulation: 20-40 s on two cores
@pytest.mark.parametrize("objective,extra", [
    ("dpo", dict(seq_len=2200, micro_batch=2)),  # chosen and rejected: 2 x 2 x 1,100 completion tokens
    ("kto", dict(seq_len=2200, micro_batch=4)),
    ("grpo", dict(seq_len=2300, micro_batch=2, num_generations=2, completion_len=2100,
                  generation_backend="vllm-server")),  # its generation on other GPUs: no decoding steps here
])
def test_past_the_heads_tile_the_layers_are_fitted_and_the_answer_is_the_full_simulation(objective, extra, tmp_path,
                                                                                        monkeypatch):
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import DIRECT, TraceStore
    from vramlab.core.objectives.shared.trl import TOKEN_CHUNK_SIZE
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = dataclasses.replace(FAMILIES["llama"], tape="traced", num_layers=6)
    setup = TrainingSetup(objective=objective, **extra, **LORA)
    assert traced.head_tokens(setup) > TOKEN_CHUNK_SIZE
    est = estimate(spec, setup, match_simulation=True)
    tape = traced.cached_tape(spec, setup, cuda=False)
    assert tape is not None and tape.mode != DIRECT  # before: simulated at the full depth of 6 layers
    assert "4,096 rows" in tape.note
    assert est.peak_allocated_bytes == simulate(spec, setup, hf=True).peak_allocated_bytes


@pytest.mark.slow  # three traces at reduced depth and a full-depth simulation
@pytest.mark.parametrize("kernel", ["cce", "trl", "liger"])
def test_a_fused_loss_kernel_on_a_traced_family_fits_the_layers(kernel, tmp_path, monkeypatch):
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import DIRECT, TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = dataclasses.replace(FAMILIES["llama"], tape="traced", num_layers=6)
    setup = TrainingSetup(seq_len=128, micro_batch=2, loss_kernel=kernel, **LORA)
    est = estimate(spec, setup, match_simulation=True)
    tape = traced.cached_tape(spec, setup, cuda=False)
    assert tape is not None and tape.mode != DIRECT  # before: simulated at the full depth of 6 layers
    assert "layers" in tape.note
    assert est.peak_allocated_bytes == simulate(spec, setup, hf=True).peak_allocated_bytes
