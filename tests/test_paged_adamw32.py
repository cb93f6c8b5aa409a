"""bitsandbytes' paged 32-bit AdamW (transformers' and axolotl's ``paged_adamw_32bit``), bitsandbytes 0.50.2: fp32
states whatever the weights' dtype, those of tensors of 1e5 elements or more in CUDA managed memory (outside torch's
counters, on the device level), the rest in torch's allocator; held to the simulation of the same step, and read from
an axolotl config."""

from __future__ import annotations

import pytest

from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.sources.training import read_training_configs
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

SPEC = ModelSpec(id="small", name="Small", num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=4,
                 intermediate_size=1024, vocab_size=4000)
PAGED = TrainingSetup(optimizer="paged_adamw_32bit", seq_len=64)


def _large(spec: ModelSpec) -> int:
    """Elements of the trainable tensors bitsandbytes pages (1e5 elements or more)."""
    sizes = [s.in_features * s.out_features for s in (*spec.attn_linears(), *spec.mlp_linears())
             for _ in range(s.copies)] * spec.num_layers
    sizes += [spec.vocab_size * spec.hidden_size] * (1 if spec.tie_embeddings else 2)
    return sum(n for n in sizes if n >= 100_000)


def test_the_estimate_is_the_simulated_step_with_the_paged_states_on_the_device_level():
    pytest.importorskip("torch")
    from vramlab.core.simulation.simulate import simulate

    est = estimate(SPEC, PAGED, match_simulation=True)
    sim = simulate(SPEC, PAGED)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert [(p.key, p.bytes) for p in est.phases] == [(q.key, q.bytes) for q in sim.phases]
    managed = {o.name: o.bytes for o in est.overheads}["Paged optimizer states (managed)"]
    assert managed == {o.name: o.bytes for o in sim.overheads}["Paged optimizer states (managed)"]
    assert managed == 8 * _large(SPEC)  # two fp32 states per element


def test_paged_states_are_fp32_and_leave_the_tensor_level():
    adamw = estimate(SPEC, TrainingSetup(seq_len=64))  # bf16 weights: torch keeps bf16 states
    paged = estimate(SPEC, PAGED)
    small = SPEC.param_count - _large(SPEC)
    assert paged.components.get(Kind.OPTIMIZER_STATES, 0) == 8 * small  # fp32 states of the small tensors
    assert adamw.components[Kind.OPTIMIZER_STATES] == 4 * SPEC.param_count  # two bf16 states per element
    assert paged.to_json()["setup"]["optimizer_state_dtype"] == "fp32 (paged)"
    assert paged.to_json()["setup"]["optimizer_impl"] == "bitsandbytes"


def test_axolotls_example_optimizer_is_read(tmp_path):
    cfg = tmp_path / "ax.yaml"
    cfg.write_text("base_model: m\nadapter: lora\noptimizer: paged_adamw_32bit\n")
    src = read_training_configs([cfg])
    assert not src.refused and src.changes["optimizer"] == "paged_adamw_32bit"
