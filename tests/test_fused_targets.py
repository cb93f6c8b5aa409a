"""LoRA targets by the model's own module names, fused projections included.

Phi-3 computes q, k and v with one ``qkv_proj`` and gate and up with one ``gate_up_proj``; every Phi-3 LoRA
recipe names those, and they were refused ("unknown LoRA target 'qkv_proj'"). The builder and the
estimator now build Phi-3's layers as transformers does (sliced qkv, chunked gate_up, RoPE concatenated
with its pass-through part); transformers' own Phi3 class with peft is the reference.
"""

from __future__ import annotations

import json

import pytest

from vramlab.core.catalog import find_model
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.targets import parse_targets
from vramlab.core.spec.training import TrainingSetup

PHI3 = ModelSpec(id="phi3", name="Phi3-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                 intermediate_size=512, vocab_size=1000, fused_qkv=True, fused_gate_up=True, rope_pass_cat=True)
PARTIAL = ModelSpec(id="phi4m", name="Phi4-mini-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                   head_dim=64, intermediate_size=512, vocab_size=1000, fused_qkv=True, fused_gate_up=True,
                   rope_pass_cat=True, rotary_dim=48, tie_embeddings=True)  # partial_rotary_factor 0.75
LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000)
OWN = "qkv_proj,o_proj,gate_up_proj,down_proj"
SETUPS = [
    TrainingSetup(),
    TrainingSetup(method="lora", lora_targets=OWN),
    TrainingSetup(method="lora", lora_targets="qkv_proj", grad_ckpt=True),
    TrainingSetup(method="lora", lora_targets=OWN, micro_batch=2, seq_len=256, attention="eager"),
    TrainingSetup(grad_ckpt=True, micro_batch=2, seq_len=256),
    TrainingSetup(method="freeze", trainable_layers=1),
]


def test_other_families_names_parse_to_their_roles() -> None:
    assert parse_targets("qkv_proj,gate_up_proj") == ("qkv_proj", "gate_up_proj")
    assert parse_targets("query_key_value,dense,dense_h_to_4h,dense_4h_to_h") == (
        "o_proj", "up_proj", "down_proj", "qkv_proj")
    assert parse_targets("c_attn,c_proj,c_fc") == ("o_proj", "up_proj", "down_proj", "qkv_proj")


def test_phi3_takes_its_own_names_and_a_llama_refuses_them() -> None:
    phi3 = find_model("phi-3-mini-4k")
    assert phi3 is not None and phi3.fused_qkv and phi3.fused_gate_up
    TrainingSetup(method="lora", lora_targets=OWN).validate(phi3)
    with pytest.raises(SetupError, match="has no qkv_proj, gate_up_proj module: its linear layers are q_proj"):
        TrainingSetup(method="lora", lora_targets=OWN).validate(LLAMA)


def test_separate_names_on_a_fused_model_adapt_the_fused_module_and_say_so() -> None:
    setup = TrainingSetup(method="lora")  # peft's default for Llama: q_proj, v_proj
    assert PHI3.lora_modules(setup.lora_targets) == ("qkv_proj",)
    assert any("LoRA on q_proj, v_proj adapts the whole qkv_proj" in w for w in setup.warnings(PHI3))
    all_linear = TrainingSetup(method="lora", lora_targets="all-linear")
    assert not any("fuses" in w for w in all_linear.warnings(PHI3))
    notes = estimate(PHI3, all_linear).notes
    assert any("LoRA r=8 on qkv_proj, o_proj, gate_up_proj, down_proj:" in n for n in notes)


REPLAYED = [(PHI3, SETUPS[1]), (PHI3, SETUPS[3]), (PHI3, SETUPS[4]), (PHI3, SETUPS[5]), (PARTIAL, SETUPS[1])]


@pytest.mark.parametrize(("spec", "setup"), REPLAYED,
                         ids=["lora", "lora-eager-b2", "ckpt-b2", "freeze", "partial-rotary"])
def test_estimate_replays_the_builder(spec: ModelSpec, setup: TrainingSetup) -> None:
    sim = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.trainable_params == sim.trainable_params
    assert [p.bytes for p in est.phases] == [p.bytes for p in sim.phases]


@pytest.mark.parametrize(("spec", "setup"), [(PHI3, SETUPS[1]), (PHI3, SETUPS[3]), (PARTIAL, SETUPS[0])],
                         ids=["lora", "lora-eager-b2", "partial-rotary-full"])
def test_builder_matches_transformers_phi3_with_peft(spec: ModelSpec, setup: TrainingSetup) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    ours = simulate(spec, setup)
    ref = simulate(spec, setup, hf=True)
    assert ours.trainable_params == ref.trainable_params  # peft's own count of the adapters
    # as for the other families: HF's checkpointing keeps position ids
    assert abs(ours.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8 * 1024
    assert ours.peak_phase == ref.peak_phase


def test_cli_estimates_phi3_lora_on_its_own_modules(capsys: pytest.CaptureFixture[str]) -> None:
    from vramlab.core.cli import main

    assert main(["estimate", "-m", "phi-3-mini-4k", "--method", "lora", "--lora-targets", OWN, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    phi3 = find_model("phi-3-mini-4k")
    assert phi3 is not None
    h, qkv, inter, r = phi3.hidden_size, phi3.q_dim + 2 * phi3.kv_dim, phi3.intermediate_size, 8
    per_layer = r * (h + qkv) + r * (phi3.q_dim + h) + r * (h + 2 * inter) + r * (inter + h)
    assert out["trainable_params"] == phi3.num_layers * per_layer


def test_phi3_config_partial_rotary_factor_is_read() -> None:
    from vramlab.core.sources.hf_config import spec_from_hf_config

    cfg = {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 24,
           "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 200064, "tie_word_embeddings": True,
           "max_position_embeddings": 131072, "partial_rotary_factor": 0.75}
    spec = spec_from_hf_config(cfg, id="p", name="P")
    assert spec.rotary_dim == 96 and spec.rope_dim == 96 and spec.fused_qkv
    assert spec_from_hf_config({**cfg, "partial_rotary_factor": 1.0}, id="p", name="P").rope_dim == 128
    with pytest.raises(SetupError, match="partial_rotary_factor must be a number in"):
        spec_from_hf_config({**cfg, "partial_rotary_factor": 0}, id="p", name="P")
