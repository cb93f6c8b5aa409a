"""The estimator: invariants, small cases counted by hand, and the seed's rules of thumb.

Accuracy against an independent measurement (the simulation) is in test_accuracy.py.
"""

from __future__ import annotations

import math

import pytest

from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import GB, GiB

LLAMA7 = find_model("llama-2-7b")
TINY = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                 intermediate_size=512, vocab_size=1000)


def r512(n: int) -> int:
    return -(-n // 512) * 512


def test_components_sum_to_the_peak_in_every_phase():
    for setup in (TrainingSetup(), TrainingSetup(method="qlora"), TrainingSetup(grad_accum=4, grad_ckpt=True)):
        r = estimate(LLAMA7, setup)
        assert sum(r.components.values()) == r.peak_allocated_bytes
        for p in r.phases:
            assert sum(p.components.values()) == p.bytes
        assert r.peak_allocated_bytes == max(p.bytes for p in r.phases)
        assert r.peak_allocated_bytes <= r.peak_reserved_bytes <= r.device_used_bytes


def test_load_phase_of_a_tiny_model_counted_by_hand():
    # 2 layers of: q (256x256), k (128x256), v (128x256), o (256x256), gate/up (512x256), down (256x512),
    # two norms (256); embedding and lm_head 1000x256; final norm 256; bf16 = 2 bytes each, every
    # tensor rounded up to a 512-byte block. Plus RoPE's inv_freq (32 fp32 -> one block) and, at the
    # moment of the peak, three temporaries that compute it (arange().float(), the power, the reciprocal).
    per_layer = [256 * 256, 128 * 256, 128 * 256, 256 * 256, 512 * 256, 512 * 256, 256 * 512, 256, 256]
    weights = 2 * sum(r512(2 * n) for n in per_layer) + 2 * r512(2 * 1000 * 256) + r512(2 * 256)
    r = estimate(TINY, TrainingSetup())
    load = r.phases[0]
    assert load.key == "load"
    assert load.components[Kind.WEIGHTS] == weights + 4 * 512
    assert load.bytes == weights + 4 * 512


def test_adam_states_of_a_tiny_model_counted_by_hand():
    # pure bf16 full fine-tuning: two bf16 AdamW states per parameter tensor, each rounded to 512 bytes
    per_layer = [256 * 256, 128 * 256, 128 * 256, 256 * 256, 512 * 256, 512 * 256, 256 * 512, 256, 256]
    tensors = 2 * per_layer + [1000 * 256, 1000 * 256, 256]
    states = 2 * sum(r512(2 * n) for n in tensors)
    r = estimate(TINY, TrainingSetup())
    opt = next(p for p in r.phases if p.key == "optimizer@2")
    assert opt.components[Kind.OPTIMIZER_STATES] == states


def test_loss_costs_twelve_bytes_per_logit_at_the_start_of_backward():
    # log-softmax output (fp32) + grad of the log-probabilities + grad of the logits, all fp32
    r = estimate(TINY, TrainingSetup(micro_batch=1, seq_len=512))
    back = next(p for p in r.phases if p.key == "backward@1")
    assert back.components[Kind.LOGITS] >= 3 * r512(4 * 512 * 1000)


@pytest.mark.parametrize("field", ["micro_batch", "seq_len"])
def test_monotonic_in_batch_and_sequence(field):
    prev = 0
    for v in (1, 2, 4, 8) if field == "micro_batch" else (128, 512, 2048, 8192):
        peak = estimate(LLAMA7, TrainingSetup(method="lora", **{field: v})).peak_allocated_bytes
        assert peak > prev
        prev = peak


def test_lora_below_full_and_qlora_below_lora():
    for seq in (512, 4096):
        full = estimate(LLAMA7, TrainingSetup(seq_len=seq)).peak_allocated_bytes
        lora = estimate(LLAMA7, TrainingSetup(method="lora", seq_len=seq)).peak_allocated_bytes
        qlora = estimate(LLAMA7, TrainingSetup(method="qlora", seq_len=seq)).peak_allocated_bytes
        assert qlora < lora < full


def test_checkpointing_saves_activations_but_not_weights():
    a = estimate(LLAMA7, TrainingSetup(method="lora", seq_len=4096))
    b = estimate(LLAMA7, TrainingSetup(method="lora", seq_len=4096, grad_ckpt=True))
    assert b.peak_allocated_bytes < a.peak_allocated_bytes
    assert b.components[Kind.WEIGHTS] == a.components[Kind.WEIGHTS]


def test_fused_adamw_has_no_optimizer_temporaries_and_foreach_one_copy():
    foreach = estimate(TINY, TrainingSetup(optimizer_impl="foreach"))
    fused = estimate(TINY, TrainingSetup(optimizer_impl="fused"))
    opt_f = next(p for p in foreach.phases if p.key == "optimizer@2").components
    opt_u = next(p for p in fused.phases if p.key == "optimizer@2").components
    assert opt_u.get(Kind.OPTIMIZER_TEMPS, 0) == 0
    # foreach: one temporary the size of all (bf16) parameters at once
    # inv_freq and original_inv_freq are buffers, not parameters
    assert opt_f[Kind.OPTIMIZER_TEMPS] == opt_f[Kind.WEIGHTS] - 2 * 512


# ---- the seed's rules of thumb for Llama-2-7B ------------------------------------------------------------

def test_bf16_weights_of_llama2_7b():
    r = estimate(LLAMA7, TrainingSetup(method="lora"))
    weights = r.components[Kind.WEIGHTS]
    assert weights / GiB == pytest.approx(12.55, abs=0.01)
    assert weights / GB == pytest.approx(13.5, abs=0.05)


def test_lora_r8_qv_fits_the_rule_of_thumb():
    r = estimate(LLAMA7, TrainingSetup(method="lora", lora_rank=8, lora_targets="q_proj,v_proj"))
    assert 14 * GiB <= r.device_used_bytes <= 18 * GiB


def test_qlora_nf4_fits_the_rule_of_thumb():
    r = estimate(LLAMA7, TrainingSetup(method="qlora"))
    assert 5 * GiB <= r.device_used_bytes <= 10 * GiB


def test_full_amp_adamw_needs_sixteen_bytes_per_parameter_before_activations():
    r = estimate(LLAMA7, TrainingSetup(weights="fp32", compute="bf16", optimizer_impl="fused"))
    opt = next(p for p in r.phases if p.key == "optimizer@1").components
    static = opt[Kind.WEIGHTS] + opt.get(Kind.GRADIENTS, 0) + opt[Kind.OPTIMIZER_STATES]
    assert static >= 16 * LLAMA7.param_count
    assert r.peak_allocated_bytes >= 16 * LLAMA7.param_count


def test_fits_verdict_and_headroom():
    r = estimate(LLAMA7, TrainingSetup(method="qlora"), find_gpu("rtx-4090"))
    assert r.fits() and r.headroom_bytes() == r.gpu.memory_bytes - r.device_used_bytes
    big = estimate(LLAMA7, TrainingSetup(weights="fp32", compute="bf16"), find_gpu("rtx-4090"))
    assert big.fits() is False and big.headroom_bytes() < 0


def test_notes_explain_the_peak():
    r = estimate(find_model("llama-3.1-8b"), TrainingSetup(method="qlora", seq_len=4096, grad_ckpt=True))
    text = " ".join(r.notes)
    assert "peak sits" in text
    assert "vocabulary" in text  # a 128k vocabulary: the loss dominates


def test_trainable_parameter_counts():
    r = estimate(LLAMA7, TrainingSetup(method="lora", lora_rank=8, lora_targets="q_proj,v_proj"))
    assert r.trainable_params == 32 * 2 * 8 * (4096 + 4096)  # A (8x4096) + B (4096x8) for q and v
    f = estimate(LLAMA7, TrainingSetup(method="freeze", trainable_layers=2))
    assert f.trainable_params == 2 * LLAMA7.layer_params()  # the final norm and the head stay frozen
    g = estimate(LLAMA7, TrainingSetup(method="freeze", trainable_layers=2, freeze_extra=("norm", "lm_head")))
    assert g.trainable_params == 2 * LLAMA7.layer_params() + 4096 + 32000 * 4096
    assert math.isclose(estimate(LLAMA7, TrainingSetup()).trainable_params, LLAMA7.param_count)
