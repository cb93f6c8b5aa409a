"""The CUDA-only parts of the outer levels (core/levels.py): cuBLAS workspaces inside the reserved level,
counted once, honouring torch's environment variables; the attention kernel's backward scratch (flash's, cuDNN's)
where that kernel runs."""

from __future__ import annotations

from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.estimate import estimate
from vramlab.core.levels import attention_backward_scratch, attention_kernel, cublas_bytes, flash_backward_scratch
from vramlab.core.result import MemLevel
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import MiB


def rows(result):
    return {o.name: o for o in result.overheads}


def test_cublas_workspaces_are_in_the_reserved_level_once():
    r = estimate(find_model("llama-3.2-1b"), TrainingSetup(method="lora", seq_len=512), find_gpu("rtx-4090"))
    o = rows(r)
    assert o["cuBLAS workspace"].level is MemLevel.RESERVED
    device_terms = sum(x.bytes for x in r.overheads if x.level is MemLevel.DEVICE)
    assert r.device_used_bytes == r.peak_reserved_bytes + device_terms  # not added a second time


def test_workspace_size_follows_the_gpu_and_torchs_variables():
    ada, hopper = find_gpu("rtx-4090"), find_gpu("h100-sxm")
    assert cublas_bytes(hopper, {}) > cublas_bytes(ada, {})
    assert cublas_bytes(ada, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == cublas_bytes(hopper, {})
    assert cublas_bytes(ada, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) < cublas_bytes(ada, {})
    # a cuBLASLt workspace of its own only with the unified workspace turned off, capped at the cuBLAS one
    small = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "65536"}
    assert cublas_bytes(ada, small) == 2 * 16 * 1024 * 8
    assert cublas_bytes(ada, small | {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == 2 * 2 * 16 * 1024 * 8


def test_the_32_mib_workspace_on_every_compute_capability_from_9_to_12():
    """torch 2.13's CublasHandlePool.cpp: 32 MiB for cc 9.x-12.x, not Hopper only; cuBLASLt shares it."""
    for name in ("h100-sxm", "b200", "rtx-5090", "rtx-pro-6000-blackwell"):
        assert cublas_bytes(find_gpu(name), {}) == 2 * 32 * MiB, name
    for name in ("rtx-4090", "a100-80gb", "t4"):
        assert cublas_bytes(find_gpu(name), {}) == 2 * (8 * MiB + 128 * 1024), name


def test_the_attention_scratch_is_the_kernels_own(monkeypatch):
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    spec = find_model("llama-3.1-8b")
    bf16 = TrainingSetup(method="lora", seq_len=2048)
    assert attention_kernel(spec, bf16, find_gpu("h100-sxm")) == "cudnn"
    assert attention_kernel(spec, bf16, find_gpu("rtx-4090")) == "flash"
    cudnn = attention_backward_scratch(spec, bf16, "cudnn")
    assert 0 < cudnn < flash_backward_scratch(spec, bf16)  # no dk / dv expanded for GQA
    r = estimate(spec, bf16, find_gpu("h100-sxm"), calibration=None)
    assert rows(r)["cuDNN attention backward workspace"].bytes == cudnn and "Flash-attention backward scratch" \
        not in rows(r)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert attention_kernel(spec, bf16, find_gpu("h100-sxm")) == "flash"
    fp32 = bf16.replace(weights="fp32", compute="fp32")
    assert attention_kernel(spec, fp32, find_gpu("h100-sxm")) == "math"
    assert attention_backward_scratch(spec, fp32, "math") == 0


def test_flash_scratch_only_where_flash_runs():
    spec = find_model("llama-3.1-8b")  # grouped-query attention: dk / dv expanded to every head
    bf16 = TrainingSetup(method="lora", seq_len=2048)
    assert flash_backward_scratch(spec, bf16) > 32 * MiB
    assert flash_backward_scratch(spec, bf16.replace(attention="eager")) == 0
    assert flash_backward_scratch(spec, bf16.replace(compute="fp32", weights="fp32")) == 0
    longer = flash_backward_scratch(spec, bf16.replace(seq_len=4096))
    assert longer == 2 * flash_backward_scratch(spec, bf16)  # linear in the sequence, not quadratic
