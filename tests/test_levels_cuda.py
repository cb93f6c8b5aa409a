"""The CUDA-only parts of the outer levels (core/levels.py): cuBLAS workspaces inside the reserved level,
counted once, honouring torch's environment variables; flash attention's backward scratch where flash runs."""

from __future__ import annotations

from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.estimate import estimate
from vramlab.core.levels import cublas_bytes, flash_backward_scratch
from vramlab.core.result import MemLevel
from vramlab.core.spec import TrainingSetup
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
    # cuBLASLt's workspace is capped at the cuBLAS one, as torch caps it
    small = cublas_bytes(ada, {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "65536"})
    assert small == 2 * 2 * 16 * 1024 * 8


def test_flash_scratch_only_where_flash_runs():
    spec = find_model("llama-3.1-8b")  # grouped-query attention: dk / dv expanded to every head
    bf16 = TrainingSetup(method="lora", seq_len=2048)
    assert flash_backward_scratch(spec, bf16) > 32 * MiB
    assert flash_backward_scratch(spec, bf16.replace(attention="eager")) == 0
    assert flash_backward_scratch(spec, bf16.replace(compute="fp32", weights="fp32")) == 0
    longer = flash_backward_scratch(spec, bf16.replace(seq_len=4096))
    assert longer == 2 * flash_backward_scratch(spec, bf16)  # linear in the sequence, not quadratic
