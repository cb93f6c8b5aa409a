"""The Mamba-2 models (pure and hybrid) estimated from their trace, as Granite 4 is: transformers' own classes
under fake tensors, mamba-ssm's fused Mamba-2 mixer and causal-conv1d's conv as CUDA runs them. They were refused
from config.json alone as state-space models; the estimate now equals simulate --hf at a size the fit did not
see. The Mamba-1 ones (mamba-ssm's selective_scan_fn / mamba_inner_fn, not modelled) and Zamba 2 stay refused
with their reason."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=128, vocab_size=256, num_attention_heads=4, num_key_value_heads=2)
# a tiny config per type, deeper than the trace's cut (the fit extrapolates over the depth)
TINY = {
    "mamba2": dict(hidden_size=64, vocab_size=256, num_hidden_layers=4, num_heads=4, head_dim=32, state_size=16,
                   n_groups=1, expand=2),
    "bamba": dict(**COMMON, num_hidden_layers=4, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                  mamba_n_groups=1, attn_layer_indices=[1, 3]),
    "nemotron_h": dict(**COMMON, num_hidden_layers=6, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16,
                       n_groups=1, hybrid_override_pattern="M*-M*-"),
    "falcon_h1": dict(**COMMON, num_hidden_layers=4, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                      mamba_n_groups=1, head_dim=16, mamba_d_ssm=128),
}
# LoRA on what peft 0.21.2 allows: the attention's q / v; Mamba-2's in_proj (peft refuses out_proj on it)
TARGETS = {"mamba2": ("in_proj",)}


def _spec(model_type: str):  # noqa: ANN202
    from transformers import AutoConfig

    from vramlab.core.sources.hf_config import hf_config_to_spec

    cfg = AutoConfig.for_model(model_type, **TINY[model_type])
    return hf_config_to_spec(json.loads(cfg.to_json_string(use_diff=False)), id=model_type, name=model_type)[0]


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_a_mamba2_model_is_estimated_from_its_trace_as_simulate_hf_measures_it(model_type: str) -> None:
    """Was refused ("a state-space / recurrent model"): LoRA's estimate equals transformers' own classes (and
    peft) under fake tensors, at a batch and sequence the fit did not trace."""
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.tracing.capture import hf_config_at

    spec = _spec(model_type)
    setup = TrainingSetup(micro_batch=2, seq_len=200, method="lora", lora_rank=8,
                          lora_targets=TARGETS.get(model_type, ("q_proj", "v_proj")))
    est = estimate(spec, setup, match_simulation=True)
    ref = simulate(spec, setup, hf=True, hf_config=hf_config_at(spec.transformers_config, spec.num_layers))
    assert est.trainable_params == ref.trainable_params > 0
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes


def test_pure_mamba2_names_its_linear_layers_for_the_default_lora_targets() -> None:
    """Mamba-2 has no q_proj / v_proj (LoRA's default targets): refused with the modules it has."""
    from vramlab.core.checks import SetupError
    from vramlab.core.estimate import estimate
    from vramlab.core.spec.training import TrainingSetup

    setup = TrainingSetup(micro_batch=1, seq_len=64, method="lora", lora_targets=("q_proj", "v_proj"))
    with pytest.raises(SetupError, match="no module for LoRA target q_proj, v_proj: its linear layers are in_proj, "
                                         "out_proj"):
        estimate(_spec("mamba2"), setup)


@pytest.mark.parametrize(("model_type", "why"), [
    ("mamba", "selective_scan_fn / mamba_inner_fn"), ("falcon_mamba", "selective_scan_fn / mamba_inner_fn"),
    ("jamba", "selective_scan_fn / mamba_inner_fn"), ("zamba2", "mixes two classes"),
])
def test_the_state_space_models_not_modelled_stay_refused_with_their_reason(model_type: str, why: str) -> None:
    from vramlab.core.checks import SetupError
    from vramlab.core.sources.hf_config import hf_config_to_spec

    with pytest.raises(SetupError, match=why):
        hf_config_to_spec({"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
                           "num_attention_heads": 4}, id=model_type, name=model_type)


def test_pure_mamba2_has_no_attention_backward_scratch() -> None:
    """Mamba-2's num_heads are its mixer's heads: the reserved level counted flash attention's backward scratch
    for attention it does not have (68 MB at 1 x 2048 on transformers' default Mamba-2's shape). A hybrid's
    attention keeps it."""
    from vramlab.core.levels import FLASH, attention_backward_scratch
    from vramlab.core.spec.training import TrainingSetup

    setup = TrainingSetup(micro_batch=1, seq_len=2048, method="lora")
    assert attention_backward_scratch(_spec("mamba2"), setup, FLASH) == 0
    assert attention_backward_scratch(_spec("nemotron_h"), setup, FLASH) > 0


def test_simulate_hf_gives_one_line_where_peft_refuses_the_targets(tmp_path, capsys) -> None:
    """peft refuses all-linear on Mamba-2 (out_proj and conv1d "incompatible with Mamba-based models"): simulate
    --hf says so in one line and exit 2, as the estimate does, not a traceback."""
    from transformers import AutoConfig

    from vramlab.core.cli import main

    path = tmp_path / "config.json"
    path.write_text(AutoConfig.for_model("mamba2", **TINY["mamba2"]).to_json_string(use_diff=False))
    code = main(["simulate", "--hf", "--model", str(path), "--method", "lora", "--lora-targets", "all-linear",
                 "--seq", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]


def test_the_grpo_note_gives_no_kv_figure_for_a_hybrid_cache() -> None:
    """The note's formula (keys and values of every layer) holds for a model whose layers all attend; for a hybrid
    (Bamba: two attention layers of four, Mamba-2 mixers caching states) or an attention-free model it would be
    wrong, so the note says the trace counts the cache instead."""
    from vramlab.core.catalog import find_model
    from vramlab.core.estimate import objective_notes
    from vramlab.core.spec.training import TrainingSetup

    grpo = TrainingSetup(method="lora", objective="grpo", lora_targets=("in_proj",))
    for spec in (_spec("bamba"), _spec("mamba2")):
        note = objective_notes(spec, grpo)[0]
        assert "KV cache reaches" not in note and "counted by the trace" in note
    assert "KV cache reaches" in objective_notes(find_model("llama-3.1-8b"), grpo)[0]
