"""Unsloth's fused LoRA kernels (issue 29 item 5: ``LoRA_MLP``, ``LoRA_QKV``, ``LoRA_W`` of unsloth 2026.10.9, what
``FastLanguageModel.get_peft_model`` and LLaMA-Factory's ``use_unsloth`` run).

Held three ways: the estimate against the built-in builder with the kernels installed (exactly, phase by phase)
and against transformers' classes under peft with the same kernels installed by core/simulation/unsloth.py's
``patch_model`` (within HF's few small buffers); the families unsloth dispatches elsewhere refused; the configs'
keys read (LLaMA-Factory's ``use_unsloth``; axolotl 0.19.0's removed ``unsloth_*`` keys refused, as axolotl does).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.three_ways import held_three_ways
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import unsloth_patch

pytest.importorskip("transformers")
pytest.importorskip("peft")

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)

SETUPS = {
    "lora": TrainingSetup(method="lora", lora_targets="all-linear", seq_len=256, micro_batch=2),
    "qlora": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256, micro_batch=2),
    "qlora-checkpointing": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256, grad_ckpt=True),
    "lora-attention": TrainingSetup(method="lora", lora_targets="q_proj,k_proj,v_proj,o_proj", seq_len=200),
}


@pytest.mark.parametrize("name", ["lora", "qlora", pytest.param("qlora-checkpointing", marks=pytest.mark.slow),
                                  pytest.param("lora-attention", marks=pytest.mark.slow)])
def test_the_estimate_matches_the_kernels_on_transformers_classes(name: str) -> None:
    setup = SETUPS[name].replace(unsloth_kernels="all")
    est, own = held_three_ways(LLAMA, setup, SETUPS[name])
    if not setup.grad_ckpt:  # activations hold the peak: the kernels keep no fp32 input copies nor h
        assert est.peak_allocated_bytes < own.peak_allocated_bytes


def test_each_kernel_is_its_own_switch() -> None:
    s = SETUPS["lora"]
    peaks = {k: estimate(LLAMA, s.replace(unsloth_kernels=k), match_simulation=True).peak_allocated_bytes
             for k in ("none", "lora_mlp", "lora_qkv", "lora_o", "all")}
    assert len(set(peaks.values())) == 5
    assert peaks["all"] == min(peaks.values())


def _small(preset: str) -> ModelSpec:
    from vramlab.core.catalog import find_model

    return dataclasses.replace(find_model(preset), num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                               head_dim=64, intermediate_size=512, vocab_size=32000)


@pytest.mark.parametrize("preset", ["phi-3-mini-4k", "gemma-3-1b", "mixtral-8x7b"])
def test_families_unsloth_loads_through_fastmodel_are_refused(preset: str) -> None:
    from vramlab.core.catalog import find_model

    with pytest.raises(SetupError, match="FastModel"):
        SETUPS["lora"].replace(unsloth_kernels="all").validate(find_model(preset))


def test_qwen2s_biased_qkv_runs_peft_and_its_other_projections_the_kernels() -> None:
    spec = _small("qwen2.5-0.5b")
    assert spec.qkv_bias
    patch = unsloth_patch(spec, SETUPS["lora"].replace(unsloth_kernels="all"))
    assert patch is not None and not patch.qkv and patch.o and patch.mlp


@pytest.mark.parametrize("change", [dict(method="full"), dict(use_dora=True), dict(weights="fp32"),
                                    dict(lora_targets="q_proj,v_proj")])
def test_where_unsloth_falls_back_to_peft_the_option_changes_nothing(change: dict) -> None:
    setup = SETUPS["lora"].replace(unsloth_kernels="all", **change)
    assert unsloth_patch(LLAMA, setup) is None
    if setup.uses_lora:
        assert any("changes nothing" in w for w in setup.warnings(LLAMA))


def test_what_is_not_modelled_is_refused() -> None:
    with pytest.raises(SetupError, match="lora_dropout"):
        SETUPS["lora"].replace(unsloth_kernels="all", lora_dropout=0.05).validate(LLAMA)
    with pytest.raises(SetupError, match="Unsloth kernels must be"):
        TrainingSetup(unsloth_kernels="rope")


def test_llamafactorys_use_unsloth_turns_the_kernels_on(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "lf.yaml"
    cfg.write_text("model_name_or_path: x\nstage: sft\nfinetuning_type: lora\nlora_target: all\nuse_unsloth: true\n")
    src = read_training_configs([cfg])
    assert src.changes["unsloth_kernels"] == ["lora_mlp", "lora_qkv", "lora_o"]
    row = next(r for r in src.rows if r.key == "use_unsloth")
    assert "offloaded checkpointing" in row.note  # what the row does not model is named


def test_axolotls_removed_unsloth_keys_are_refused(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "ax.yaml"
    cfg.write_text("base_model: x\nadapter: lora\nlora_target_linear: true\nunsloth_lora_mlp: true\n")
    row = next(r for r in read_training_configs([cfg]).rows if r.key == "unsloth_lora_mlp")
    assert row.status == "refused" and "removed from axolotl" in row.note
