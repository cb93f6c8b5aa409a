"""The SDPA kernel: predicted without torch (core/sdpa.py), checked against torch's own choice where this
machine can ask it (the CPU), and the rules for CUDA taken from torch's sdp_utils.cpp."""

from __future__ import annotations

import pytest
import torch

from vramlab.core.sdpa import EFFICIENT, FLASH, MATH, backend_name, mismatch_note, predict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_the_cpu_prediction_is_torchs_own_choice(dtype, gqa, head_dim):
    q = torch.zeros(1, 4, 16, head_dim, dtype=DTYPES[dtype], requires_grad=True)
    kv = torch.zeros(1, 2 if gqa else 4, 16, head_dim, dtype=DTYPES[dtype], requires_grad=True)
    chosen = backend_name(torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=gqa))
    assert predict(torch.__version__, "cpu", dtype, gqa, head_dim).backend == chosen


def test_old_cpu_torch_runs_math_for_gqa():
    assert predict("2.6.0", "cpu", "bf16", True, 64).backend == MATH
    assert predict("2.6.0", "cpu", "bf16", False, 64).backend == FLASH


def test_fp32_gqa_on_cuda_falls_back_to_math_before_efficient_attention_learnt_gqa():
    choice = predict("2.8.0+cu128", "cuda", "fp32", True, 128, (8, 9))
    assert choice.backend == MATH and "fp16/bf16" in choice.reason
    assert predict("2.13.0", "cuda", "fp32", True, 128, (8, 9)).backend == EFFICIENT
    assert predict("2.8.0", "cuda", "fp32", False, 128, (8, 9)).backend == EFFICIENT
    assert predict("2.8.0", "cuda", "bf16", True, 128, (9, 0)).backend == FLASH
    assert predict("2.8.0", "cuda", "bf16", True, 128, (7, 5)).backend == MATH  # no bf16 before sm80
    assert predict("2.8.0", "cuda", "bf16", False, 200, (8, 6)).backend == EFFICIENT  # flash refuses training


def test_a_note_only_when_the_kind_of_kernel_differs():
    assert mismatch_note(FLASH, EFFICIENT) is None and mismatch_note(FLASH, "cudnn") is None
    assert "math kernel" in mismatch_note(FLASH, MATH)


def test_the_estimate_says_when_torch_would_not_run_a_fused_kernel(monkeypatch):
    from vramlab.core import estimate as estimate_mod
    from vramlab.core.catalog import find_gpu, find_model
    from vramlab.core.estimate import sdpa_notes
    from vramlab.core.spec import TrainingSetup

    spec, gpu = find_model("llama-3.1-8b"), find_gpu("rtx-4090")  # GQA
    fp32 = TrainingSetup(method="lora", compute="fp32", weights="fp32")
    monkeypatch.setattr(estimate_mod, "_installed_torch", lambda: "2.8.0")
    note = sdpa_notes(spec, fp32, gpu)
    assert note and "math kernel" in note[0] and "torch 2.8.0" in note[0]
    assert sdpa_notes(spec, TrainingSetup(method="lora"), gpu) == []  # bf16: flash
    assert sdpa_notes(spec, fp32.replace(attention="eager"), gpu) == []
