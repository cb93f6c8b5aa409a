"""transformers' Hub kernels, on by default since 5.25.0 (issues 28 / 29: the user's real run on CUDA).

``from_pretrained`` defaults ``use_kernels`` to True and the model's ``train()`` kernelizes it in training mode for
the device it is on: every RMSNorm decorated ``use_kernel_forward_from_hub("RMSNorm")`` runs
kernels-community/liger-kernels' ``LigerRMSNorm``. Held three ways: which modules are swapped and what the swapped
forward allocates, against the kernels library's own ``kernelize`` with transformers' own mapping (the Hub repo
stood in by its layer as its source writes it, over liger-kernel 0.8.5's function with Triton launches as no-ops);
the rule the hand-written programs follow, against transformers' classes; the estimate against the builder and
transformers' classes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.support import liger_library
from tests.support.hub_library import kernelize_as_transformers
from tests.support.step_timeline import step_timeline
from tests.support.three_ways import held_three_ways
from vramlab.core.catalog import find_model
from vramlab.core.estimate import estimate
from vramlab.core.spec import hub_kernels
from vramlab.core.spec import liger as spec_liger
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("kernels")

from vramlab.core.simulation import liger, rope  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)
OFF = dict(hub_kernels=False)


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    gen = liger_library.imported(monkeypatch)
    next(gen)
    monkeypatch.setattr(spec_liger, "LIGER_SM_COUNT", 1)  # what the library takes off CUDA
    yield
    next(gen, None)


def _config(name: str):  # noqa: ANN202
    import transformers as tf

    size = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    return {"llama": tf.LlamaConfig(**size), "qwen3": tf.Qwen3Config(**size, head_dim=16),
            "granite": tf.GraniteConfig(**size), "gemma2": tf.Gemma2Config(**size, head_dim=16)}[name]


@pytest.mark.parametrize("name", ["llama", "qwen3", pytest.param("granite", marks=pytest.mark.slow),
                                  pytest.param("gemma2", marks=pytest.mark.slow)])
def test_the_trace_kernelizes_what_the_kernels_library_kernelizes(library, monkeypatch, name: str) -> None:  # noqa: ANN001
    """transformers' class with LoRA, kernelized by the kernels library and by :func:`liger.kernelize_hub` and
    :func:`rope.kernelize_rope`: the same tensors, alloc for alloc, through forward and backward (Qwen 3's q / k
    norms too; Granite, a traced family; Gemma 2, whose offset norms are not decorated: its RoPE swapped)."""
    import peft
    from transformers import AutoModelForCausalLM

    cfg = _config(name)
    cfg._attn_implementation = "eager"
    ids = torch.randint(0, 32, (2, 24))

    def run(kernelize) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
        kernelize(model)
        return step_timeline(model, ids)

    theirs = run(lambda model: kernelize_as_transformers(model, monkeypatch))
    swapped = []
    ours = run(lambda model: swapped.append(liger.kernelize_hub(model, hub_kernels.HUB_RMS_NORM)
                                            + rope.kernelize_rope(model)))
    plain = run(lambda model: None)
    assert theirs == ours
    assert ours != plain and swapped[0] > 0


# a preset of each hand-written family and the model type of its transformers class
HAND_WRITTEN = {"llama-3.2-1b": "llama", "mistral-7b-v0.1": "mistral", "qwen2.5-0.5b": "qwen2", "qwen3-0.6b": "qwen3",
                "phi-3-mini-4k": "phi3", "gemma-2b": "gemma", "gemma-2-2b": "gemma2", "gemma-3-1b": "gemma3_text",
                "phi-2": "phi", "gpt2": "gpt2", "mixtral-8x7b": "mixtral", "qwen1.5-moe-a2.7b": "qwen2_moe",
                "qwen3-30b-a3b": "qwen3_moe"}


def test_the_hand_written_rule_is_transformers_decorators() -> None:
    """The hand-written programs swap the norm where :func:`hub_kernels.hub_norms` says so: exactly the families
    whose transformers class is decorated ``use_kernel_forward_from_hub("RMSNorm")`` (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    seen = set()
    for preset, model_type in HAND_WRITTEN.items():
        spec = find_model(preset)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, num_hidden_layers=1))
        names = {getattr(type(m), "kernel_layer_name", None) for m in model.modules()}
        assert ("RMSNorm" in names) == hub_kernels.hub_norms(spec), preset
        seen.add(hub_kernels.hub_norms(spec))
    assert seen == {True, False}


@pytest.mark.parametrize("name", ["lora", pytest.param("full-checkpointing", marks=pytest.mark.slow)])
def test_the_estimate_holds_the_hub_norm_three_ways(name: str) -> None:
    setup = {"lora": TrainingSetup(method="lora", lora_targets="all-linear", seq_len=256, micro_batch=2),
             "full-checkpointing": TrainingSetup(method="full", seq_len=256, grad_ckpt=True)}[name]
    est, off = held_three_ways(LLAMA, setup, setup.replace(**OFF))
    assert est.peak_allocated_bytes < off.peak_allocated_bytes  # the kernel saves fewer activations
    assert any("Hub kernels" in n for n in est.notes)
    assert not any("Hub kernels" in n for n in off.notes)


def test_families_whose_norms_are_not_decorated_change_by_their_rope_alone() -> None:
    """Gemma's offset norms are not decorated, its RoPE is (tests/test_hub_rope.py); GPT-2 has neither."""
    setup = TrainingSetup(method="lora", seq_len=256)
    for preset, rope_only in (("gemma-2b", True), ("gpt2", False)):
        spec = dataclasses.replace(find_model(preset), num_layers=2)
        on, off = estimate(spec, setup), estimate(spec, setup.replace(**OFF))
        assert (on.peak_allocated_bytes != off.peak_allocated_bytes) == rope_only
        assert (hub_kernels.ROPE_GRADIENT in " ".join(on.notes)) == rope_only


def test_liger_and_the_hub_norm_together_are_one_norm() -> None:
    """Liger's patch and the Hub's kernel swap in the same function (Llama's casting, in place): on together they
    count it once, as liger's rms_norm alone does. Liger's RoPE rebinds the modeling module's apply_rotary_pos_emb,
    so the decorated function the Hub's RoPE replaces is never called: liger's alone is counted."""
    setup = TrainingSetup(method="lora", seq_len=256)
    both = estimate(LLAMA, setup.replace(liger_kernels="rms_norm")).peak_allocated_bytes
    assert both == estimate(LLAMA, setup).peak_allocated_bytes
    assert both != estimate(LLAMA, setup.replace(liger_kernels="rms_norm", **OFF)).peak_allocated_bytes  # RoPE
    liger = setup.replace(liger_kernels="rms_norm,rope")
    assert estimate(LLAMA, liger).peak_allocated_bytes == estimate(LLAMA, liger.replace(**OFF)).peak_allocated_bytes
    assert hub_kernels.ROPE_GRADIENT not in " ".join(estimate(LLAMA, liger).notes)


def test_an_unsloth_run_has_none_of_them() -> None:
    """unsloth 2026.10.9 requires transformers <= 5.17.0 (its wheel's Requires-Dist), before from_pretrained
    kernelized by default: an Unsloth run is its run without the Hub kernels, and says why."""
    setup = TrainingSetup(method="lora", lora_targets="all-linear", seq_len=1024, grad_ckpt=True, unsloth_gc=True)
    on, off = estimate(LLAMA, setup), estimate(LLAMA, setup.replace(**OFF))
    assert on.peak_allocated_bytes == off.peak_allocated_bytes
    assert any("Hub kernels off in an Unsloth run" in n for n in on.notes)
    assert "hub_kernels" not in on.models_versions()
    # --unsloth-gc without checkpointing asks for nothing (the CLI says it is ignored): the Hub kernels stay
    plain = setup.replace(grad_ckpt=False, unsloth_gc=False)
    ignored = estimate(LLAMA, plain.replace(unsloth_gc=True))
    assert ignored.peak_allocated_bytes == estimate(LLAMA, plain).peak_allocated_bytes


def test_transformers_releases_before_the_default() -> None:
    assert hub_kernels.default_on("5.25.0") and hub_kernels.default_on("5.25.0.dev0")
    assert not hub_kernels.default_on("5.24.0") and not hub_kernels.default_on("")


def test_the_cli_turns_them_off(capsys) -> None:  # noqa: ANN001
    from vramlab.core.cli import main

    args = ["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--json"]
    assert main(args) == 0
    on = json.loads(capsys.readouterr().out)
    assert main([*args, "--no-hub-kernels"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert on["setup"]["hub_kernels"] is True and off["setup"]["hub_kernels"] is False
    assert off["peak_allocated_bytes"] > on["peak_allocated_bytes"]


@pytest.mark.parametrize(("name", "text", "on"), [
    ("sft.json", '{"max_length": 512}', True),
    ("sft-off.json", '{"max_length": 512, "model_init_kwargs": {"use_kernels": false}}', False),
    ("ax.yaml", "base_model: m\nadapter: lora\n", False),
    ("ax-on.yaml", "base_model: m\nadapter: lora\nuse_kernels: true\n", True),
    ("lf.yaml", "model_name_or_path: m\nstage: sft\nfinetuning_type: lora\n", False),
    ("swift.sh", "swift sft --model m --train_type lora --max_length 512\n", False),
], ids=["trl", "trl-off", "axolotl", "axolotl-on", "llamafactory", "ms-swift"])
def test_the_frameworks_runs_load_with_or_without_them(tmp_path, name: str, text: str, on: bool) -> None:  # noqa: ANN001
    """TRL passes model_init_kwargs to from_pretrained (transformers 5.25's default on); axolotl 0.19.0 pins
    transformers 5.16.1 and passes use_kernels only when set; LLaMA-Factory 0.9.5 installs transformers <= 5.6.0,
    ms-swift 4.6.0 transformers < 5.20.0."""
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / name
    cfg.write_text(text)
    read = read_training_configs([cfg])
    assert read.changes["hub_kernels"] is on
    assert TrainingSetup().replace(**read.changes).hub_kernels is on


def test_a_setup_file_that_says_anything_but_true_or_false_is_one_clear_error() -> None:
    from vramlab.core.checks import SetupError

    with pytest.raises(SetupError, match="true or false"):
        TrainingSetup(hub_kernels="sometimes").check_fields()
