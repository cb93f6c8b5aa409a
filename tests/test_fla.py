"""fla's gated delta rule (issue 29, "the user's real run"): on CUDA, transformers >= 5.25 runs fla's
``chunk_gated_delta_rule`` (kernels-community/fla, or the installed flash-linear-attention) for the linear attention
of Qwen3.5, Qwen3-Next and the other gated-delta-rule families, where the CPU runs transformers' torch path, which
materialises fp32 per-chunk matrices. It is modelled (core/simulation/fla.py).

Held to fla's own Python code on CPU tensors, its Triton kernels as no-ops: alloc for alloc."""

from __future__ import annotations

import pytest
import torch

from tests.support import fla_library
from vramlab.core.simulation import fla
from vramlab.core.simulation.tracker import MemoryTracker


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    gen = fla_library.imported(monkeypatch)
    next(gen)
    yield
    next(gen, None)


def _timeline(fn, heads: tuple[int, int], dims: tuple[int, int], contiguous: bool, final: bool) -> list[int]:  # noqa: ANN001
    H, HV = heads
    K, V = dims
    B, T = 2, 150
    torch.manual_seed(0)
    bf = torch.bfloat16
    # transformers' layout: q / k / v split off the convolution's (B, C, T) output, transposed
    mixed = torch.randn(B, 2 * H * K + HV * V, T, dtype=bf)
    tracker = MemoryTracker(block=1)
    with tracker:
        x = mixed.clone().requires_grad_() if not contiguous else None
        if contiguous:
            q, k = (torch.randn(B, T, H, K, dtype=bf, requires_grad=True) for _ in range(2))
            v = torch.randn(B, T, HV, V, dtype=bf, requires_grad=True)
        else:
            q, k, v = torch.split(x.transpose(1, 2), [H * K, H * K, HV * V], dim=-1)
            q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
        g = torch.randn(B, T, HV, requires_grad=True)  # fp32, as transformers computes it
        beta = torch.rand(B, T, HV, dtype=bf, requires_grad=True)
        o, state = fn(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=final,
                      use_qk_l2norm_in_kernel=True)
        o.backward(torch.ones_like(o))
        del o, state, q, k, v, g, beta, x
    return [c for _, c in tracker.timeline]


@pytest.mark.parametrize(("heads", "dims"), [((2, 2), (32, 32)), ((2, 4), (128, 64)), ((1, 3), (256, 128))])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("final", [False, True])
def test_the_reference_allocates_what_fla_allocates(library, heads: tuple, dims: tuple, contiguous: bool,  # noqa: ANN001
                                                    final: bool) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    own = _timeline(chunk_gated_delta_rule, heads, dims, contiguous, final)
    assert own == _timeline(fla.chunk_gated_delta_rule, heads, dims, contiguous, final)
