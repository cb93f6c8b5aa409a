"""The advisor: savings checked against the estimator and (for a sample) the simulation; the fit search's
answer fits and the next step up does not."""

from __future__ import annotations

import pytest

from vramlab.core.advisor import allocator_advice, budget, checklist, fit_search, savings, sweep
from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.estimate import estimate
from vramlab.core.measure.simulate import simulate
from vramlab.core.spec import ModelSpec, TrainingSetup

LLAMA = find_model("llama-3.1-8b")
GPU = find_gpu("rtx-4090")


def test_savings_are_ranked_and_each_checks_against_the_estimator():
    base = TrainingSetup(method="lora", seq_len=2048)
    out = savings(LLAMA, base, GPU)
    assert out, "an 8B LoRA at 2048 tokens has things to save"
    assert [s.saves_bytes for s in out] == sorted((s.saves_bytes for s in out), reverse=True)
    before = estimate(LLAMA, base, GPU).device_used_bytes
    for s in out:
        after = estimate(LLAMA, s.setup, GPU).device_used_bytes
        assert s.saves_bytes == before - after > 0
        assert s.fits == (after <= GPU.memory_bytes)
    keys = {s.key for s in out}
    assert {"grad_ckpt", "qlora", "chunked_loss"} <= keys


SMALL = ModelSpec(id="small", name="Small", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4,
                  intermediate_size=1536, vocab_size=32000)


ACTIVATION_BOUND = TrainingSetup(micro_batch=4, seq_len=512, attention="eager")
OPTIMIZER_BOUND = TrainingSetup(micro_batch=1, seq_len=64)


@pytest.mark.parametrize(("key", "base"), [
    ("grad_ckpt", ACTIVATION_BOUND), ("chunked_loss", ACTIVATION_BOUND), ("accumulate", ACTIVATION_BOUND),
    ("sdpa", ACTIVATION_BOUND), ("fused", OPTIMIZER_BOUND), ("adamw8bit", OPTIMIZER_BOUND),
])
def test_a_sample_of_savings_holds_in_the_simulation(key, base):
    saving = next(s for s in savings(SMALL, base) if s.key == key)
    sim_before = simulate(SMALL, base).peak_allocated_bytes
    sim_after = simulate(SMALL, saving.setup).peak_allocated_bytes
    est_before = estimate(SMALL, base).peak_allocated_bytes
    est_after = estimate(SMALL, saving.setup).peak_allocated_bytes
    assert sim_after < sim_before
    assert (est_before - est_after) == pytest.approx(sim_before - sim_after, rel=0.03)


@pytest.mark.parametrize("setup", [TrainingSetup(method="qlora", grad_ckpt=True),
                                   TrainingSetup(method="lora", grad_ckpt=True, seq_len=1024)])
def test_fit_search_answer_fits_and_the_next_step_does_not(setup):
    ans = fit_search(LLAMA, setup, GPU, margin=0.1, target_batch=64)
    limit = budget(GPU, 0.1)
    b = ans.max_micro_batch
    assert b >= 1
    assert estimate(LLAMA, setup.replace(micro_batch=b), GPU).device_used_bytes <= limit
    assert estimate(LLAMA, setup.replace(micro_batch=b + 1), GPU).device_used_bytes > limit
    s = ans.max_seq_len
    assert estimate(LLAMA, setup.replace(seq_len=s), GPU).device_used_bytes <= limit
    assert estimate(LLAMA, setup.replace(seq_len=s + 64), GPU).device_used_bytes > limit
    assert ans.grad_accum_for_target * b * setup.gpus >= 64
    assert (ans.grad_accum_for_target - 1) * b * setup.gpus < 64


def test_nothing_fits_gives_zero_and_savings():
    ans = fit_search(find_model("llama-2-70b"), TrainingSetup(), GPU)
    assert ans.max_micro_batch == 0 and not ans.fits_now and ans.savings


def test_sweeps_carry_trainable_parameters():
    pts = sweep(LLAMA, TrainingSetup(method="lora"), "lora_rank")
    ranks = [p.value for p in pts]
    trainable = [p.trainable_params for p in pts]
    assert trainable == sorted(trainable) and trainable[0] < trainable[-1]
    mem = [p.result.peak_allocated_bytes for p in pts]
    assert mem == sorted(mem)
    assert ranks[0] == 1
    q = sweep(LLAMA, TrainingSetup(method="lora"), "weights")
    assert [p.result.components for p in q if p.result]  # fp32/bf16/int8/nf4 all estimable
    assert q[-1].result.peak_allocated_bytes < q[1].result.peak_allocated_bytes  # nf4 below bf16


def test_allocator_advice_and_checklist_are_tied_to_the_setup():
    r = estimate(find_model("mistral-7b-v0.1"), TrainingSetup(seq_len=4096, micro_batch=4, grad_ckpt=True),
                 find_gpu("a100-80gb"), allocator=True)
    tips = allocator_advice(r)
    assert any("expandable_segments" in t for t in tips)
    items = [i for i, _why in checklist(LLAMA, TrainingSetup(method="lora", grad_ckpt=True), r)]
    assert any("input gradients" in i for i in items)
