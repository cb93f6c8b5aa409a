"""Unsloth's fused loss (issue 29 item 5: the loss FastLanguageModel's forward computes in training, unsloth_zoo
2026.10.9's ``fused_linear_cross_entropy``; ``fused_loss`` in ``--unsloth-kernels``, on in ``all``).

Held three ways. The reference (core/simulation/unsloth_loss.py) against unsloth_zoo's own functions run on real
CPU tensors with its Triton kernels launched as no-ops and the GPU's answers supplied (tests/support/
unsloth_zoo_loss.py; skipped where the wheel is not unpacked: ``make conformance``): every alloc and free of forward
and backward, on both of its paths (chunked, tiled) and with a budget small enough to chunk. The estimate against
the reference in the built-in builder and on transformers' classes. And the default run: an Unsloth run's estimate
no longer counts the logits.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.three_ways import held_three_ways
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth_loss import UnslothDevice, loss_plan

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.support import unsloth_zoo_loss  # noqa: E402
from vramlab.core.simulation import unsloth_loss  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)
LORA = TrainingSetup(method="lora", lora_targets="all-linear", seq_len=256, micro_batch=2, hub_kernels=False)
H100 = (9, 0, 85520809984, 0)
RTX_4090 = (8, 9, 25393692672, 0)


def _timeline(fn, h: torch.Tensor, w: torch.Tensor, train_head: bool) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Live bytes after every allocation of ``fn``'s forward and backward, and at the end; the gradients' sizes.
    (The frees between two allocations are in the same set, not always in the same order: a function's closures
    hold some of its locals past its others when it returns.)"""
    tracker = MemoryTracker(block=1)
    labels = torch.randint(0, w.shape[0], (h.shape[0], h.shape[1]))
    with tracker:
        hh = h.detach().clone().requires_grad_(True)
        ww = w.detach().clone().requires_grad_(train_head)
        loss = fn(hh, ww, labels)
        loss.backward()
        sizes = [x.grad.numel() * x.grad.element_size() for x in (hh, ww) if x.grad is not None]
        del loss, hh, ww
    live = [c for _, c in tracker.timeline]
    return [c for before, c in zip([0, *live], live) if c > before] + live[-1:], sizes


@pytest.mark.parametrize(("gpu", "train_head", "path", "amp"), [
    (H100, False, "chunked", False),  # under 4,096 labelled rows on an 80 GB card
    ((8, 9, 25393692672, 8 << 20), False, "tiled", False),  # a 24 GiB card, 8 MiB free: tiles of 64 rows
    ((9, 0, 85520809984, 8 << 20), False, "chunked", False),  # 8 MiB free: chunks of 26 rows
    (H100, True, "chunked", False),  # a trained head: its gradient made in forward too
    (H100, True, "chunked", True),  # fp32 weights under bf16 autocast: the head and each chunk cast
])
def test_the_reference_allocates_what_unsloth_zoo_allocates(monkeypatch: pytest.MonkeyPatch, gpu: tuple,
                                                            train_head: bool, path: str, amp: bool) -> None:
    theirs = unsloth_zoo_loss.load(monkeypatch, gpu)
    dev = UnslothDevice(*gpu)
    dtype = torch.float32 if amp else torch.bfloat16
    h, w = torch.randn(2, 40, 16, dtype=dtype), torch.randn(40000, 16, dtype=dtype)
    assert loss_plan(78, 16, 40000, "bf16", train_head, dev).flash == (path == "tiled")

    def autocast(fn):  # noqa: ANN001, ANN202 - the step's autocast around the forward (the CPU's stands for CUDA's)
        def run(*a):  # noqa: ANN002, ANN202
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                return fn(*a)
        return run

    lib, lib_grads = _timeline(autocast(lambda hh, ww, lab: theirs(hh, ww, None, lab)), h, w, train_head)
    ours, our_grads = _timeline(autocast(lambda hh, ww, lab: unsloth_loss.fused_loss(hh, ww, lab, TrainingSetup(
        unsloth_gpu=gpu), torch.bfloat16 if amp else None)), h, w, train_head)
    assert lib_grads == our_grads
    assert lib == ours


def test_an_unsloth_run_never_makes_the_logits() -> None:
    """``--unsloth-kernels all`` is what FastLanguageModel runs, its forward's fused loss included: the estimate
    (equal to the builder with the same kernel) holds at least one bf16 logits tensor less than the same run with
    ``UNSLOTH_RETURN_LOGITS=1`` (``all,cross_entropy``: Fast_CrossEntropyLoss on the logits)."""
    spec = dataclasses.replace(LLAMA, vocab_size=128256)
    setup = LORA.replace(unsloth_kernels="all", seq_len=1024)
    est, logits = held_three_ways(spec, setup, setup.replace(unsloth_kernels="all,cross_entropy"))
    assert est.peak_allocated_bytes + 2 * 1024 * spec.vocab_size * 2 <= logits.peak_allocated_bytes


def test_the_gpu_chooses_the_path_and_is_part_of_the_estimate() -> None:
    """1 x 2048 tokens of a 128k vocabulary: chunks of logits on an 80 GB card (under 4,096 labelled rows), the tiled
    pass on a 24 GiB one; each estimate equals the builder on the same GPU."""
    from vramlab.core.catalog import find_gpu
    from vramlab.core.simulation.simulate import simulate

    spec = dataclasses.replace(LLAMA, vocab_size=128256)
    setup = LORA.replace(unsloth_kernels="all", seq_len=2048, micro_batch=1)
    peaks = {}
    for name in ("h100-sxm", "rtx-4090"):
        gpu = find_gpu(name)
        est = estimate(spec, setup, gpu, match_simulation=True)
        assert est.setup == setup  # the answer is the setup's; what it took of the GPU, a note
        assert f"{gpu.memory_bytes / 2**30:.2f} GiB, at least 4 GiB free" in " ".join(est.notes)
        assert est.peak_allocated_bytes == simulate(spec, setup, gpu).peak_allocated_bytes
        peaks[name] = est.peak_allocated_bytes
    assert peaks["rtx-4090"] < peaks["h100-sxm"]


def test_what_unsloth_does_not_run_is_refused_or_named() -> None:
    with pytest.raises(SetupError, match="choose one"):
        TrainingSetup(unsloth_kernels="fused_loss,cross_entropy")
    with pytest.raises(SetupError, match="both replace transformers' loss"):
        LORA.replace(unsloth_kernels="fused_loss", loss_kernel="liger").validate(LLAMA)
    with pytest.raises(SetupError, match="torch bodies"):
        LORA.replace(unsloth_kernels="fused_loss", unsloth_gpu=(6, 1, 12 << 30, 0), compute="fp16",
                     weights="fp16").validate(LLAMA)
    with pytest.raises(SetupError, match="bf16 needs 8.0"):
        LORA.replace(unsloth_kernels="fused_loss", unsloth_gpu=(7, 5, 15 << 30, 0)).validate(LLAMA)
    from vramlab.core.catalog import find_gpu

    with pytest.raises(SetupError, match="ROCm"):
        estimate(LLAMA, LORA.replace(unsloth_kernels="all"), find_gpu("mi300x"))
    with pytest.raises(SetupError, match="ROCm"):  # a free memory given does not skip the GPU's vendor
        estimate(LLAMA, LORA.replace(unsloth_kernels="all", unsloth_gpu=(9, 4, 192 << 30, 10 << 30)),
                 find_gpu("mi300x"))
    dpo = LORA.replace(unsloth_kernels="all", objective="dpo")
    assert any("fused loss (its forward's) never runs" in w for w in dpo.warnings(LLAMA))
    # where the fused loss never runs, the GPU decides nothing: not refused on ROCm, not part of the setup
    assert estimate(LLAMA, dpo, find_gpu("mi300x")).setup.unsloth_gpu == ()


def test_a_run_near_its_gpus_memory_is_told_its_chunks_follow_the_free_memory() -> None:
    """Under 4 GiB left free the budget (half the free memory, capped at 2 GiB) may be smaller than modelled: the
    estimate says so, and an explicit free memory (a budget of 4 MiB: chunks of 8 rows) lowers the peak."""
    from vramlab.core.catalog import find_gpu

    spec = dataclasses.replace(LLAMA, vocab_size=128256)
    setup = LORA.replace(unsloth_kernels="all", seq_len=1024)
    small = dataclasses.replace(find_gpu("rtx-4090"), memory_bytes=2 << 30)
    near = estimate(spec, setup, small)
    assert any("leaves under 4 GiB free" in w for w in near.warnings)
    assert not any("leaves under 4 GiB free" in w for w in estimate(spec, setup, find_gpu("h100-sxm")).warnings)
    told = estimate(spec, setup.replace(unsloth_gpu=(8, 9, 2 << 30, 8 << 20)), small)
    assert told.peak_allocated_bytes < near.peak_allocated_bytes


def test_the_free_memory_is_a_flag_and_bad_values_end_in_one_line(capsys: pytest.CaptureFixture) -> None:
    import json

    from vramlab.core.cli import main

    args = ["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--lora-targets", "all-linear",
            "--unsloth-kernels", "all", "--gpu", "rtx-4090", "--json"]
    assert main([*args, "--unsloth-free-memory", "1.5"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["unsloth_gpu"][3] == 3 << 29
    assert main([*args, "--unsloth-free-memory", "200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at most the GPU's" in err[0]
