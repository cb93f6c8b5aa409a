"""The advisor: savings checked against the estimator and (for a sample) the simulation; the fit search's
answer fits and the next step up does not."""

from __future__ import annotations

import pytest

from vramlab.core.advisor import allocator_advice, budget, checklist, fit_search, savings, sweep
from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.estimate import estimate
from vramlab.core.report import fit_text
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

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
    assert {"grad_ckpt", "qlora", "chunked_loss", "trl_head"} <= keys


SMALL = ModelSpec(id="small", name="Small", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4,
                  intermediate_size=1536, vocab_size=32000)


ACTIVATION_BOUND = TrainingSetup(micro_batch=4, seq_len=512, attention="eager")
OPTIMIZER_BOUND = TrainingSetup(micro_batch=1, seq_len=64)
UPCAST = TrainingSetup(method="freeze", trainable_layers=2, trainable_fp32=True, micro_batch=1, seq_len=64)


@pytest.mark.parametrize(("key", "base"), [
    ("grad_ckpt", ACTIVATION_BOUND), ("chunked_loss", ACTIVATION_BOUND), ("trl_head", ACTIVATION_BOUND),
    ("accumulate", ACTIVATION_BOUND),
    ("sdpa", ACTIVATION_BOUND), ("fused", OPTIMIZER_BOUND), ("adamw8bit", OPTIMIZER_BOUND),
    ("trained_16bit", UPCAST),  # LLaMA-Factory's pure_bf16 instead of its fp32 upcast of the trained layers
])
def test_a_sample_of_savings_holds_in_the_simulation(key, base):
    saving = next(s for s in savings(SMALL, base) if s.key == key)
    sim_before = simulate(SMALL, base).peak_allocated_bytes
    sim_after = simulate(SMALL, saving.setup).peak_allocated_bytes
    est_before = estimate(SMALL, base).peak_allocated_bytes
    est_after = estimate(SMALL, saving.setup).peak_allocated_bytes
    assert sim_after < sim_before
    assert (est_before - est_after) == pytest.approx(sim_before - sim_after, rel=0.03)


@pytest.mark.parametrize("allocator", [False, True], ids=["fast", "replay"])
@pytest.mark.parametrize("setup", [TrainingSetup(method="qlora", grad_ckpt=True),
                                   TrainingSetup(method="lora", grad_ckpt=True, seq_len=1024)])
def test_fit_search_answer_fits_and_the_next_step_does_not(setup, allocator):
    """With ``allocator`` the boundary is the replayed allocator's (what ``vramlab estimate`` prints)."""
    ans = fit_search(LLAMA, setup, GPU, margin=0.1, target_batch=64, allocator=allocator)
    limit = budget(GPU, 0.1)

    def used(s: TrainingSetup) -> int:
        return estimate(LLAMA, s, GPU, allocator=allocator).device_used_bytes

    b = ans.max_micro_batch
    assert b >= 1
    assert used(setup.replace(micro_batch=b)) <= limit < used(setup.replace(micro_batch=b + 1))
    s = ans.max_seq_len
    assert used(setup.replace(seq_len=s)) <= limit < used(setup.replace(seq_len=s + 64))
    assert ans.device_used_now == used(setup)
    sug = ans.suggestion
    assert sug.micro_batch <= b and sug.grad_accum == ans.grad_accum_for_target
    assert ans.effective_batch == sug.micro_batch * sug.grad_accum * setup.gpus >= 64
    assert (sug.grad_accum - 1) * sug.micro_batch * setup.gpus < 64
    assert used(sug) <= limit


def test_the_search_finds_the_boundary_from_a_guess_on_either_side():
    from vramlab.core.advisor import _largest

    for edge in (0, 1, 7, 64, 100, 4096):
        for guess in (1, 5, 7, 8, 63, 200, 4096):
            calls = []

            def fits(v: int, edge: int = edge, calls: list = calls) -> bool:
                calls.append(v)
                return v <= edge

            assert _largest(fits, 1, 4096, guess=guess) == edge, (edge, guess)
            assert _largest(fits, 1, 4096) == edge  # from the bottom, as the fast search does
            assert all(1 <= v <= 4096 for v in calls)
    assert _largest(lambda v: v <= 1000, 64, 4096, 64, guess=900) == 960  # steps of 64 tokens


@pytest.mark.parametrize(("target", "gpus"), [(100, 1), (64, 1), (96, 4), (67, 1), (7, 2)])
def test_target_batch_is_reached_without_overshooting_a_large_gpu(target, gpus):
    """An H200 fits hundreds of QLoRA samples per micro batch: the suggestion must still be the target,
    not a micro batch past it (67 is prime: 67 x 1 fits, so it is exact too)."""
    setup = TrainingSetup(method="qlora", grad_ckpt=True, gpus=gpus, sharding="zero2" if gpus > 1 else "none")
    ans = fit_search(find_model("llama-2-7b"), setup, find_gpu("h200"), target_batch=target)
    sug = ans.suggestion
    assert ans.max_micro_batch > target
    per_gpu = -(-target // gpus)
    assert sug.micro_batch * sug.grad_accum == per_gpu and ans.effective_batch == per_gpu * gpus


def test_target_batch_past_the_largest_micro_batch_accumulates():
    setup = TrainingSetup(method="qlora", grad_ckpt=True, seq_len=2048)
    ans = fit_search(LLAMA, setup, GPU, target_batch=61)  # prime: no micro batch above 1 divides it
    b, sug = ans.max_micro_batch, ans.suggestion
    assert 1 < b < 61
    assert sug.micro_batch == b and ans.effective_batch >= 61 and (sug.grad_accum - 1) * b < 61


def test_bad_target_batch_is_refused():
    from vramlab.core.checks import SetupError

    with pytest.raises(SetupError, match="target-batch .* must be from 1"):
        fit_search(LLAMA, TrainingSetup(method="qlora"), GPU, target_batch=0)


def test_savings_in_the_fit_search_respect_the_margin():
    setup = TrainingSetup(method="lora", seq_len=2048)
    ans = fit_search(LLAMA, setup, GPU, margin=0.25)
    limit = budget(GPU, 0.25)
    assert not ans.fits_now and ans.savings
    for s in ans.savings:
        assert s.fits == (estimate(LLAMA, s.setup, GPU).device_used_bytes <= limit)
    # the case that tells the budget from the whole GPU: a change that fits the GPU but not the budget
    assert any(limit < s.after_bytes <= GPU.memory_bytes and not s.fits for s in ans.savings)


def test_sequence_search_stops_at_the_model_positions():
    spec = find_model("llama-2-7b")  # 4096 positions
    ans = fit_search(spec, TrainingSetup(method="qlora", grad_ckpt=True), find_gpu("h200"))
    assert ans.max_seq_len == spec.max_position_embeddings and ans.seq_capped
    assert "maximum positions" in fit_text(ans)


@pytest.mark.parametrize("batch", [2, 3, 6])
def test_smaller_micro_batch_keeps_the_effective_batch(batch):
    base = TrainingSetup(micro_batch=batch, grad_accum=2, seq_len=512)
    s = next(x for x in savings(SMALL, base) if x.key == "accumulate")
    assert s.setup.micro_batch < batch
    assert s.setup.micro_batch * s.setup.grad_accum == batch * 2


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


def test_the_longest_sequence_is_at_the_micro_batch_the_answer_names():
    """Issue 27: "largest micro batch: 4" was followed by the longest sequence at batch 1, which at batch 4 did
    not fit. Each of the two answers names the other dimension it holds, and fits there."""
    import re

    setup = TrainingSetup(method="lora", micro_batch=1, seq_len=512)
    gpu = find_gpu("a100-80gb")
    ans = fit_search(LLAMA, setup, gpu)
    text = fit_text(ans)
    assert ans.max_micro_batch > 1
    batch = re.search(r"largest micro batch at sequence ([\d,]+): (\d+)", text)
    seq = re.search(r"longest sequence at micro batch (\d+): ([\d,]+)", text)
    assert batch and seq, text
    for b, s in ((int(batch[2]), int(batch[1].replace(",", ""))), (int(seq[1]), int(seq[2].replace(",", "")))):
        assert estimate(LLAMA, setup.replace(micro_batch=b, seq_len=s), gpu).device_used_bytes <= ans.budget_bytes
    d = ans.to_json()
    assert (d["max_micro_batch_at_seq_len"], d["max_seq_len_at_micro_batch"]) == (512, 1)


def test_when_no_single_change_fits_the_smallest_combination_does():
    spec, gpu = find_model("qwen2.5-0.5b"), find_gpu("6GiB")
    setup = TrainingSetup(method="full", seq_len=1024, micro_batch=4)
    ans = fit_search(spec, setup, gpu)
    assert not ans.fits_now and ans.savings and not any(s.fits for s in ans.savings)
    c = ans.combination
    assert c is not None and len(c.steps) == 2  # no single change fits, so two is the fewest
    assert estimate(spec, c.setup, gpu).device_used_bytes <= ans.budget_bytes  # an independent estimate
    assert c.setup != setup and c.trainable_params == estimate(spec, c.setup, gpu).trainable_params
    text = fit_text(ans)
    assert "none is enough alone" in text and "smallest combination that fits: 2 changes" in text
    assert ans.to_json()["combination"]["changes"][0]["key"] == c.steps[0][0]


def test_when_no_combination_fits_the_answer_says_so():
    ans = fit_search(find_model("gpt2"), TrainingSetup(method="full"), find_gpu("300MiB"), margin=0.0)
    assert ans.combination is None and not ans.single_change_fits
    assert "no combination of up to 4 of these changes fits" in fit_text(ans)
