"""The SDPA kernel: predicted without torch (core/sdpa.py), checked against torch's own choice where this
machine can ask it (the CPU), and the rules for CUDA taken from torch's sdp_utils.cpp."""

from __future__ import annotations

import pytest
import torch

from vramlab.core.sdpa import CUDNN, EFFICIENT, FLASH, MATH, backend_name, mismatch_note, predict

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
    assert predict("2.13.0", "cuda", "fp32", True, 128, (8, 9)).backend == MATH
    assert predict("2.14.0", "cuda", "fp32", True, 128, (8, 9)).backend == EFFICIENT
    assert predict("2.8.0", "cuda", "fp32", False, 128, (8, 9)).backend == EFFICIENT
    assert predict("2.8.0", "cuda", "bf16", True, 128, (9, 0)).backend == FLASH
    assert predict("2.8.0", "cuda", "bf16", True, 128, (7, 5)).backend == MATH  # no bf16 before sm80
    assert predict("2.8.0", "cuda", "bf16", False, 200, (8, 6)).backend == EFFICIENT  # flash refuses training


def test_the_efficient_kernel_of_this_torch_has_grouped_query_attention_only_if_its_backward_says_so():
    """torch's own meta registration of the memory-efficient backward: where it sizes grad_k with the query's
    head count, that kernel cannot take a GQA key, and fp32 GQA (which flash and cuDNN refuse) runs math."""
    q = torch.empty(1, 8, 16, 64, device="meta")
    k = torch.empty(1, 2, 16, 64, device="meta")
    lse = torch.empty(1, 8, 32, device="meta")
    seed = torch.empty((), dtype=torch.long, device="meta")
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        q, q, k, k, None, q, lse, seed, seed, 0.0, [True, True, True, False], True)
    efficient_gqa = grads[1].shape[1] == k.shape[1]
    for cc in ((8, 0), (8, 9), (9, 0), (12, 0)):
        chosen = predict(torch.__version__, "cuda", "fp32", True, 128, cc).backend
        assert chosen == (EFFICIENT if efficient_gqa else MATH), cc
    if not efficient_gqa:  # and the docstring says the same
        assert "only for Flash_attention" in " ".join(torch.nn.functional.scaled_dot_product_attention.__doc__.split())


def test_cudnn_attention_first_on_hopper_and_blackwell_unless_deprioritized():
    for cc in ((9, 0), (10, 0)):
        assert predict("2.13.0", "cuda", "bf16", True, 128, cc, environ={}).backend == CUDNN
    off = {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}
    assert predict("2.13.0", "cuda", "bf16", True, 128, (9, 0), environ=off).backend == FLASH
    assert predict("2.13.0", "cuda", "bf16", True, 128, (8, 9), environ={}).backend == FLASH
    assert predict("2.13.0", "cuda", "bf16", True, 256, (9, 0), environ={}).backend == FLASH  # head_dim > 128
    assert predict("2.13.0", "cuda", "fp32", True, 128, (9, 0), environ={}).backend == MATH
    assert predict("2.13.0", "cuda", "bf16", True, 128, (9, 0), environ={}, cudnn_version=91000).backend == FLASH


def test_a_note_whenever_the_kernel_that_ran_is_not_the_one_modelled():
    assert mismatch_note(FLASH, FLASH) is None
    assert "cuDNN" in mismatch_note(FLASH, CUDNN)  # cuDNN is not flash: its own workspace
    assert mismatch_note(CUDNN, FLASH) is not None and mismatch_note(FLASH, EFFICIENT) is not None
    assert "math kernel" in mismatch_note(FLASH, MATH)


@pytest.mark.parametrize("setup", [
    dict(method="lora", weights="fp32", compute="fp32", seq_len=256, micro_batch=2),
    dict(method="lora", seq_len=256),  # bf16 inputs: the kernel's fp32 copies and casts back
])
def test_the_math_kernel_model_is_torchs_math_kernel_as_dispatched(monkeypatch, setup):
    """The estimator's math kernel (program.Model.sdpa_math) against the simulation of the same step with
    torch's math kernel forced on the CPU (the same composite ``_scaled_dot_product_attention_math`` CUDA
    runs): equal to the byte, in total, per category and per phase; and more than the fused kernel's."""
    import dataclasses

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import vramlab.core.estimator as est_mod
    from vramlab.core.catalog import find_model
    from vramlab.core.estimator import program, record_tape
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.spec.training import TrainingSetup

    spec = dataclasses.replace(find_model("qwen2.5-0.5b"), num_layers=4)  # GQA: 14 heads, 2 kv heads
    setup = TrainingSetup(**setup)
    fused = record_tape(spec, setup, match_simulation=True).tape.evaluate(setup.micro_batch, setup.seq_len, 8)
    with sdpa_kernel([SDPBackend.MATH]):
        sim = simulate(spec, setup)
    for mod in (est_mod, program):
        monkeypatch.setattr(mod, "tape_kernel", lambda *a, **k: MATH)
    rec = record_tape(spec, setup, match_simulation=True)
    ev = rec.tape.evaluate(setup.micro_batch, setup.seq_len, setup.lora_rank)
    assert int(ev.peak) == sim.peak_allocated_bytes > int(fused.peak)
    assert {p.key: p.bytes for p in sim.phases} == {k: int(v[0]) for k, v in ev.phase_peaks.items()}


def test_fp32_gqa_lora_on_torch_2_13_keeps_fp32_probabilities_per_layer(monkeypatch):
    """Llama-3.1-8B fp32 LoRA at 2048 (the issue's case): the CUDA estimate keeps heads x seq² fp32
    probabilities per layer; torch 2.14's efficient kernel would not."""
    from vramlab.core import sdpa
    from vramlab.core.catalog import find_model
    from vramlab.core.estimator import TapeCache
    from vramlab.core.spec.training import TrainingSetup

    spec = find_model("llama-3.1-8b")
    setup = TrainingSetup(method="lora", weights="fp32", compute="fp32", seq_len=2048)
    monkeypatch.setattr(sdpa, "installed_torch", lambda: "2.13.0")
    math = TapeCache().get(spec, setup).tape.evaluate(1, 2048, 8).peak
    monkeypatch.setattr(sdpa, "installed_torch", lambda: "2.14.0")
    fused = TapeCache().get(spec, setup).tape.evaluate(1, 2048, 8).peak
    probs = spec.num_layers * spec.num_heads * 2048 * 2048 * 4
    assert math - fused >= probs


def test_the_estimate_says_when_torch_would_not_run_a_fused_kernel(monkeypatch):
    from vramlab.core import estimate as estimate_mod
    from vramlab.core.catalog import find_gpu, find_model
    from vramlab.core.estimate import sdpa_notes
    from vramlab.core.spec.training import TrainingSetup

    spec, gpu = find_model("llama-3.1-8b"), find_gpu("rtx-4090")  # GQA
    fp32 = TrainingSetup(method="lora", compute="fp32", weights="fp32")
    monkeypatch.setattr(estimate_mod, "_installed_torch", lambda: "2.8.0")
    note = sdpa_notes(spec, fp32, gpu)
    assert note and "math kernel" in note[0] and "torch 2.8.0" in note[0]
    assert sdpa_notes(spec, TrainingSetup(method="lora"), gpu) == []  # bf16: flash
    assert sdpa_notes(spec, fp32.replace(attention="eager"), gpu) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_cuda_prediction_is_torchs_own_choice(dtype, gqa, head_dim):
    """On a GPU: the pure prediction against ``torch._fused_sdp_choice`` on this device, in this environment."""
    q = torch.zeros(1, 8, 64, head_dim, dtype=DTYPES[dtype], device="cuda", requires_grad=True)
    kv = torch.zeros(1, 2 if gqa else 8, 64, head_dim, dtype=DTYPES[dtype], device="cuda", requires_grad=True)
    chosen = backend_name(torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=gqa))
    cc = torch.cuda.get_device_capability(0)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    assert predict(torch.__version__, "cuda", dtype, gqa, head_dim, cc, cudnn_version=cudnn).backend == chosen


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_without_gqa_a_fused_kernel_runs_from_sm80(dtype, head_dim):
    """What lets the estimator's tape skip the question for models without grouped-query attention
    (sdpa.tape_kernel): every dtype has a fused kernel there on any GPU from sm80."""
    for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert predict("2.13.0", "cuda", dtype, False, head_dim, cc, environ={}).backend != MATH, cc


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [False, True])
def test_the_cuda_choice_on_fake_inputs_where_this_torch_can_make_it(dtype, gqa):
    """torch's own CUDA selection on fake CUDA tensors, where this build has it (a CUDA build with a device to
    ask for its capability). A CPU build has no CUDA kernel for the choice (DispatchStub: missing kernel), so
    here the CPU choice, the meta registrations and the docstring above stand for it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            q = torch.empty(1, 8, 64, 128, dtype=DTYPES[dtype], device="cuda", requires_grad=True)
            kv = torch.empty(1, 2 if gqa else 8, 64, 128, dtype=DTYPES[dtype], device="cuda", requires_grad=True)
            code = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=gqa)
        cc = torch.cuda.get_device_capability(0)
    except (RuntimeError, AssertionError) as e:
        pytest.skip(f"this torch build cannot make CUDA's choice here ({type(e).__name__})")
    assert predict(torch.__version__, "cuda", dtype, gqa, 128, cc).backend == backend_name(code)


def test_the_estimator_only_build_models_the_pinned_torch_and_says_so(monkeypatch):
    from vramlab.core import estimate as estimate_mod
    from vramlab.core.catalog import find_gpu, find_model
    from vramlab.core.estimate import sdpa_notes
    from vramlab.core.spec.training import TrainingSetup

    monkeypatch.setattr(estimate_mod, "_installed_torch", lambda: "")
    fp32 = TrainingSetup(method="lora", compute="fp32", weights="fp32")
    note = sdpa_notes(find_model("llama-3.1-8b"), fp32, find_gpu("rtx-4090"))
    assert note and "math kernel" in note[0] and "2.13.0 (modelled: none is installed)" in note[0]
