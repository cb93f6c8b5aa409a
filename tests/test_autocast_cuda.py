"""CUDA autocast emulated for fake tensors on a CPU build (core/simulation/autocast_cuda.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from vramlab.core.simulation import autocast_cuda as ac


def _aten_name(func) -> str:  # noqa: ANN001
    name = func.__name__.strip("_")
    name = name[1:] if name.startswith("r") and name[1:] in ("matmul", "pow") else name
    if getattr(func, "__module__", "") == "torch.linalg" or name in ("multi_dot", "vecdot", "vector_norm",
                                                                     "matrix_norm"):
        name = f"linalg_{name}"
    return {"conv_transpose1d": "conv_transpose1d", "grid_sample": "grid_sampler"}.get(name, name)


HEADER = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


@pytest.mark.skipif(not os.path.exists(HEADER), reason="this torch build ships no ATen headers")
@pytest.mark.parametrize("ours, macro", [(ac.LOWER, "AT_FORALL_LOWER_PRECISION_FP"), (ac.FP32, "AT_FORALL_FP32"),
                                         (ac.SET_OPT_DTYPE, "AT_FORALL_FP32_SET_OPT_DTYPE"),
                                         (ac.PROMOTE, "AT_FORALL_PROMOTE")])
def test_the_lists_are_the_installed_torchs_cuda_lists(ours, macro):
    text = open(HEADER).read()
    body = text[text.index(f"#define {macro}(_)"):].split("\n\n")[0]
    listed = set(re.findall(r"_\((\w+)", body))
    assert {_aten_name(f) for f in ours} <= listed


def test_matmuls_run_in_the_autocast_dtype_with_one_cached_weight_copy():
    mode = ac.CudaAutocast(torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(2, 4)
    with ac.emulating(mode):
        assert F.linear(x, w).dtype == torch.float32  # off outside a region
        with mode.region():
            with torch.no_grad():  # a checkpointed forward: nothing saves the copy, the cache holds it
                y1 = F.linear(x, w)
            y2 = x @ w.t()
            assert y1.dtype == y2.dtype == torch.bfloat16
            assert len(mode._cache) == 1
        assert not mode._cache  # cleared when the outermost region exits


def test_fp32_ops_and_dtype_ops_upcast_and_regions_opened_by_model_code_switch_it():
    mode = ac.CudaAutocast(torch.bfloat16)
    h = torch.randn(2, 4, dtype=torch.bfloat16)
    with ac.emulating(mode), mode.region():
        assert torch.is_autocast_enabled() and torch.get_autocast_dtype("cpu") is torch.bfloat16
        assert h.pow(2).dtype == torch.float32
        assert F.layer_norm(h, (4,)).dtype == torch.float32
        assert F.softmax(h, -1).dtype == torch.float32
        assert (h + h).dtype == torch.bfloat16  # not on a list
        with torch.autocast("cpu", enabled=False):  # transformers' rotary embedding: fp32 frequencies
            assert not torch.is_autocast_enabled()
            assert (h.float() @ h.float().t()).dtype == torch.float32
        assert (h.float() @ h.float().t()).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled()


def test_a_checkpoints_recompute_in_backward_runs_under_autocast_too():
    # the autograd engine does not carry torch-function modes into backward; checkpoint re-enters autocast
    from torch.utils.checkpoint import checkpoint

    w = torch.nn.Parameter(torch.randn(8, 4))
    dtypes = []

    def layer(x):  # noqa: ANN001, ANN202
        y = F.linear(x, w)
        dtypes.append(y.dtype)
        return y

    mode = ac.CudaAutocast(torch.bfloat16)
    x = torch.randn(2, 4, requires_grad=True)
    with ac.emulating(mode):
        with mode.region():
            out = checkpoint(layer, x, use_reentrant=True)
        out.float().sum().backward()
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the forward, then the recompute in backward
    assert w.grad is not None and not mode._cache


def test_a_cuda_region_asked_for_is_on_as_on_the_gpu():
    """``torch.autocast("cuda")`` turns itself off where CUDA is not available; on the GPU an autograd Function's
    ``custom_bwd`` (fla's gated delta rule) re-enters its forward's autocast in backward: the emulation does too,
    and a region asked off stays off."""
    mode = ac.CudaAutocast(torch.bfloat16)
    a = torch.randn(4, 4)
    with ac.emulating(mode):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.mm(a, a).dtype == torch.bfloat16
        with mode.region(), torch.autocast("cuda", enabled=False):
            assert torch.mm(a, a).dtype == torch.float32
    assert torch.mm(a, a).dtype == torch.float32
