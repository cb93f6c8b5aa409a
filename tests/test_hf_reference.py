"""The built-in decoder against transformers' own model classes (and peft), both simulated the same way.

Skipped when the optional extra is not installed. Known difference, tiny: HF's checkpointing keeps the position
ids. LoRA dropout runs as CUDA dispatches it on both sides (the fused kernel's 1-byte mask:
core/simulation/cuda_dropout.py).
"""

from __future__ import annotations

import pytest

from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000)
QWEN2 = ModelSpec(id="qwen2", name="Qwen2-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=1000, qkv_bias=True, tie_embeddings=True)
QWEN3 = ModelSpec(id="qwen3", name="Qwen3-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  head_dim=64, intermediate_size=512, vocab_size=1000, qk_norm=True)
SETUPS = [TrainingSetup(), TrainingSetup(method="lora"), TrainingSetup(method="lora", lora_targets="all-linear"),
          TrainingSetup(grad_ckpt=True, ckpt_reentrant=True),
          TrainingSetup(method="lora", grad_ckpt=True, ckpt_reentrant=True),
          TrainingSetup(attention="eager"),
          TrainingSetup(method="freeze", trainable_layers=1), TrainingSetup(micro_batch=2, seq_len=256)]


@pytest.mark.parametrize("spec", [LLAMA, QWEN2, QWEN3], ids=lambda s: s.id)
@pytest.mark.parametrize("setup", SETUPS, ids=range(len(SETUPS)))
def test_builder_matches_transformers(spec, setup):
    ours = simulate(spec, setup)
    ref = simulate(spec, setup, hf=True)
    assert abs(ours.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8 * 1024
    assert ours.peak_phase == ref.peak_phase
    for p, q in zip(ours.phases, ref.phases):
        assert p.key == q.key and abs(p.bytes - q.bytes) <= 8 * 1024


CKPT = [TrainingSetup(grad_ckpt=True), TrainingSetup(method="lora", grad_ckpt=True),
        TrainingSetup(method="freeze", trainable_layers=1, grad_ckpt=True),
        TrainingSetup(method="lora", lora_targets="all-linear", grad_ckpt=True, micro_batch=2, seq_len=256)]


@pytest.mark.parametrize("spec", [LLAMA, QWEN3], ids=lambda s: s.id)
@pytest.mark.parametrize("setup", CKPT, ids=range(len(CKPT)))
def test_both_checkpointing_modes_are_held_to_transformers(spec, setup):
    """transformers 5's default checkpointing (use_reentrant False, whose recompute stops at the layer's last
    saved tensor) and the reentrant one: the estimate and the built-in builder each equal transformers' own
    classes run that way (the reentrant one holds the recomputed layer's output and its gradient longer)."""
    from vramlab.core.estimate import estimate

    for reentrant in (False, True):
        s = setup.replace(ckpt_reentrant=reentrant)
        ref = simulate(spec, s, hf=True)
        assert abs(estimate(spec, s, match_simulation=True).peak_allocated_bytes - ref.peak_allocated_bytes) \
            <= 8 * 1024, reentrant
        assert abs(simulate(spec, s).peak_allocated_bytes - ref.peak_allocated_bytes) <= 8 * 1024, reentrant
    default = simulate(spec, setup, hf=True).peak_allocated_bytes
    assert default <= simulate(spec, setup.replace(ckpt_reentrant=True), hf=True).peak_allocated_bytes


@pytest.mark.parametrize("targets", ["down_proj", "all-linear"])
def test_qlora_checkpointing_follows_peft_4bit_lora_in_both_modes(targets):
    """peft's bnb Linear4bit.forward clones the base result and casts the scaled LoRA output to its dtype before
    adding it. Under non-reentrant checkpointing the nodes after a layer's last saved tensor (down_proj's LoRA B)
    run before its recompute, so that order decides which gradients wait through the recompute."""
    from vramlab.core.estimate import estimate

    setup = TrainingSetup(method="qlora", lora_targets=targets, grad_ckpt=True, micro_batch=2, seq_len=256)
    for reentrant in (False, True):
        s = setup.replace(ckpt_reentrant=reentrant)
        ref = simulate(LLAMA, s, hf=True)
        assert abs(estimate(LLAMA, s, match_simulation=True).peak_allocated_bytes - ref.peak_allocated_bytes) \
            <= 8 * 1024, reentrant
        assert abs(simulate(LLAMA, s).peak_allocated_bytes - ref.peak_allocated_bytes) <= 8 * 1024, reentrant


@pytest.mark.parametrize("spec", [LLAMA, QWEN3], ids=lambda s: s.id)
def test_the_builder_keeps_the_buffers_transformers_keeps(spec):
    """transformers' rotary module keeps ``original_inv_freq``, a copy of ``inv_freq``, beside it (for its dynamic
    rope types, whatever the type): one more block on the device for the whole run, which the builder lacked."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from vramlab.core.simulation.model import build_model

    config, cls = (Qwen3Config, Qwen3ForCausalLM) if spec.qk_norm else (LlamaConfig, LlamaForCausalLM)
    with torch.device("meta"):
        theirs = cls(config(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                            num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim or None,
                            vocab_size=spec.vocab_size))
        ours = build_model(spec, TrainingSetup(), "meta", real=False)
    def buffers(model) -> list:  # noqa: ANN001
        return sorted((b.numel(), b.dtype) for b in model.buffers())

    assert buffers(ours) == buffers(theirs)
