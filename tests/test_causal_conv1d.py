"""causal-conv1d's ``causal_conv1d_fn`` (issue 29, "the user's real run"): on CUDA, transformers >= 5.25 runs
causal-conv1d's autograd Function (kernels-community/mamba-ssm's copy, or the installed causal-conv1d) for the
convolution of Qwen3.5, Qwen3-Next and the other linear-attention and Mamba families, where the CPU runs
transformers' torch path (``F.conv1d`` over a padded sequence, the activation on its slice). It is modelled
(core/simulation/causal_conv1d.py).

Held to causal-conv1d 1.6.1's own Python on CPU tensors (``pip install causal-conv1d`` builds CUDA code: put its
``causal_conv1d`` package on the path), its CUDA extension stubbed: the forward kernel writes nothing, the backward
one copies ``dout`` to x's layout where they differ, as ``causal_conv1d.cpp`` does."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vramlab.core.simulation import causal_conv1d as conv
from vramlab.core.simulation.tracker import MemoryTracker


def _bwd(x, weight, bias, dout, *_a: object) -> None:  # noqa: ANN001
    """``causal_conv1d_bwd`` (C++, causal_conv1d.cpp): dout in x's layout for the kernel."""
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if not channel_last and dout.stride(2) != 1:
        dout = dout.contiguous()
    if channel_last and dout.stride(1) != 1:
        dout = dout.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """causal-conv1d 1.6.1's Python, its CUDA extension a stub and its two custom ops (``torch.library.custom_op``,
    one opaque op to the tracker) plain calls of the stub, so the copy the C++ op makes shows."""
    if "causal_conv1d_cuda" not in sys.modules:
        stub = types.ModuleType("causal_conv1d_cuda")
        stub.causal_conv1d_fwd = stub.causal_conv1d_update = lambda *_a: None
        stub.causal_conv1d_bwd = _bwd
        monkeypatch.setitem(sys.modules, "causal_conv1d_cuda", stub)
    own = pytest.importorskip("causal_conv1d")
    if getattr(own, "__version__", "") != "1.6.1":
        pytest.skip("the reference models causal-conv1d 1.6.1")
    from causal_conv1d import cpp_functions

    monkeypatch.setattr(cpp_functions, "_causal_conv1d_fwd_cpp", lambda **_k: None)
    monkeypatch.setattr(cpp_functions, "_causal_conv1d_bwd_cpp", lambda **k: _bwd(k["x"], k["weight"], k["bias"],
                                                                                 k["dout"]))
    return own.causal_conv1d_fn


@pytest.mark.parametrize("layout", ["channel-last", "contiguous", "strided"])
@pytest.mark.parametrize("grad_layout", ["channel-last", "contiguous", "strided"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trains", [False, True])
def test_the_reference_allocates_what_causal_conv1d_allocates(library, layout: str, grad_layout: str,  # noqa: ANN001
                                                              bias: bool, trains: bool) -> None:
    """x as transformers passes it (the projections transposed: channel-last), contiguous, or neither (copied);
    the output's gradient in either layout (transformers' gives it back contiguous: the C++ op copies it to x's)
    or in neither (its Python copy)."""
    B, C, T, W = 2, 48, 70, 4

    def timeline(fn) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        tracker = MemoryTracker(block=1)
        with tracker:
            if layout == "channel-last":  # transformers' mixed_qkv.transpose(1, 2)
                base = torch.randn(B, T, C, dtype=torch.bfloat16, requires_grad=True)
                x = base.transpose(1, 2)
            elif layout == "contiguous":
                base = x = torch.randn(B, C, T, dtype=torch.bfloat16, requires_grad=True)
            else:  # neither stride 1: a copy
                base = torch.randn(B, C, 2 * T, dtype=torch.bfloat16, requires_grad=True)
                x = base[:, :, ::2]
            w = torch.randn(C, W, dtype=torch.bfloat16, requires_grad=trains)
            b = torch.randn(C, dtype=torch.bfloat16, requires_grad=trains) if bias else None
            out = fn(x, w, b, activation="silu")
            grad = (torch.ones(B, T, C, dtype=out.dtype).transpose(1, 2) if grad_layout == "channel-last" else
                    torch.ones(B, C, 2 * T, dtype=out.dtype)[:, :, ::2] if grad_layout == "strided" else
                    torch.ones(B, C, T, dtype=out.dtype))
            out.backward(grad)
            del out, grad, x, base, w, b
        return [c for _, c in tracker.timeline]

    assert timeline(library) == timeline(conv.causal_conv1d_fn)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_transformers_classes_kernelized_run_what_causal_conv1d_runs(library, model_type: str) -> None:  # noqa: ANN001
    """transformers' Qwen3.5 and Qwen3-Next classes with causal-conv1d's own ``causal_conv1d_fn`` where ``kernelize``
    puts kernels-community/mamba-ssm's layer (its forward: ``causal_conv1d_fn(x=hidden_states, weight=weight,
    bias=bias, activation=activation, seq_idx=...)``) and with :func:`conv.kernelize_conv`: the same step, alloc
    for alloc, and not the torch path's."""
    pytest.importorskip("transformers")
    from types import MethodType

    from tests.support.step_timeline import step_timeline
    from tests.test_fla import _model

    def hub_layer(_self, hidden_states, weight, bias=None, activation=None, **kwargs):  # noqa: ANN001, ANN202
        return library(x=hidden_states, weight=weight, bias=bias, activation=activation,
                       seq_idx=kwargs.pop("seq_idx", None))

    def own(model: torch.nn.Module) -> int:
        funcs = [f for m in model.modules() for f in (vars(m).get("_kernel_funcs") or {}).values()
                 if getattr(type(f), "kernel_layer_name", None) == conv.LAYER]
        for f in funcs:
            f.forward = MethodType(hub_layer, f)
        return len(funcs)

    make = _model(model_type)
    ids = torch.randint(0, 128, (2, 100))

    def run(patcher) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        model = make()
        assert patcher(model) == 1
        return step_timeline(model, ids)

    lib = run(own)
    assert lib == run(conv.kernelize_conv)
    assert lib != run(lambda model: 1)  # the torch path
