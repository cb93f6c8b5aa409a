"""fla's gated delta rule (issue 29, "the user's real run"): on CUDA, transformers >= 5.25 runs fla's
``chunk_gated_delta_rule`` (kernels-community/fla, or the installed flash-linear-attention) for the linear attention
of Qwen3.5, Qwen3-Next and the other gated-delta-rule families, where the CPU runs transformers' torch path, which
materialises fp32 per-chunk matrices. It is modelled (core/simulation/fla.py).

Held to fla's own Python code on CPU tensors, its Triton kernels as no-ops: alloc for alloc."""

from __future__ import annotations

import pytest
import torch

from tests.support import fla_library
from vramlab.core.simulation import autocast_cuda, fla
from vramlab.core.simulation.tracker import MemoryTracker


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    gen = fla_library.imported(monkeypatch)
    next(gen)
    from fla.modules.norm import fused_norm_gate

    monkeypatch.setattr(fused_norm_gate, "get_multiprocessor_count", lambda *_a, **_k: fla.LIGER_SM_COUNT)
    yield
    next(gen, None)


def _timeline(fn, heads: tuple[int, int], dims: tuple[int, int], contiguous: bool, final: bool,  # noqa: ANN001
              amp: bool = False) -> list[int]:
    H, HV = heads
    K, V = dims
    B, T = 2, 150
    torch.manual_seed(0)
    bf = torch.bfloat16
    # transformers' layout: q / k / v split off the convolution's (B, C, T) output, transposed
    mixed = torch.randn(B, 2 * H * K + HV * V, T, dtype=bf)
    tracker = MemoryTracker(block=1)
    mode = autocast_cuda.CudaAutocast(bf)
    with tracker, autocast_cuda.emulating(mode), mode.region(amp):
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
@pytest.mark.parametrize("amp", [False, True])
def test_the_reference_allocates_what_fla_allocates(library, heads: tuple, dims: tuple, contiguous: bool,  # noqa: ANN001
                                                    final: bool, amp: bool) -> None:
    """Value heads as many as key heads or more (their gradients summed back), q / k / v split off the
    convolution's transposed output or contiguous, the final state or not, and under CUDA autocast (emulated:
    fla's ``autocast_custom_bwd`` runs backward in it, where ``sum`` runs in fp32) or not."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    own = _timeline(chunk_gated_delta_rule, heads, dims, contiguous, final, amp)
    assert own == _timeline(fla.chunk_gated_delta_rule, heads, dims, contiguous, final, amp)


@pytest.mark.parametrize(("rows", "dtypes"), [(150, (torch.bfloat16, torch.bfloat16)), (40, (torch.bfloat16,
                                                                                              torch.float32))])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("trains", [True, False])
def test_the_gated_norm_reference_allocates_what_fla_allocates(library, rows: int, dtypes: tuple,  # noqa: ANN001
                                                               contiguous: bool, trains: bool) -> None:
    """fla's ``rms_norm_gated`` as kernels-community/fla's ``FusedRMSNormGated`` calls it (no bias, no residual,
    the module's activation and ``variance_epsilon``), over fewer rows than the multiprocessors and more, a gate
    that is not contiguous (transformers splits it off a projection), the weight frozen (LoRA) or trained."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    dtype, wdtype = dtypes
    D = 48

    def timeline(fn) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        tracker = MemoryTracker(block=1)
        with tracker:
            x = torch.randn(rows, D, dtype=dtype, requires_grad=True)
            both = torch.randn(rows, 2 * D, dtype=dtype, requires_grad=True)
            g = both[:, D:] if not contiguous else both[:, :D].detach().clone().requires_grad_()
            w = torch.ones(D, dtype=wdtype, requires_grad=trains)
            y = fn(x, g, w)
            y.backward(torch.ones_like(y))
            del y, x, g, w, both
        return [c for _, c in tracker.timeline]

    own = timeline(lambda x, g, w: rms_norm_gated(x, g, w, None, "silu", residual=None, eps=1e-6, prenorm=False,
                                                  residual_in_fp32=False))
    assert own == timeline(lambda x, g, w: fla.rms_norm_gated(x, g, w, 1e-6))


TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
FAMILIES = {"qwen3_5_text": {}, "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=32)}


def _model(model_type: str):  # noqa: ANN202
    from tests.support.step_timeline import tiny_model

    return tiny_model(model_type, **TEXT, **FAMILIES[model_type])


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("lora", [False, True])
def test_transformers_classes_kernelized_run_what_fla_runs(library, model_type: str, lora: bool) -> None:  # noqa: ANN001
    """transformers' Qwen3.5 and Qwen3-Next classes with fla's own ``chunk_gated_delta_rule`` where ``kernelize``
    puts kernels-community/fla's (the wrapper ``use_kernelized_func`` gives each linear-attention module) and fla's
    ``rms_norm_gated`` as kernels-community/fla's ``FusedRMSNormGated`` calls it, and with
    :func:`fla.kernelize_fla` / :func:`fla.kernelize_norms`: the same step, alloc for alloc, and not the torch
    path's."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from types import MethodType

    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from tests.support.step_timeline import step_timeline

    make = _model(model_type)
    ids = torch.randint(0, 128, (2, 100))

    def hub_norm(self, hidden_states, gate=None):  # noqa: ANN001, ANN202 - kernels-community/fla's layer
        return rms_norm_gated(hidden_states, gate, self.weight, None, self.activation, residual=None,
                              eps=self.variance_epsilon, prenorm=False, residual_in_fp32=False)

    def own(model: torch.nn.Module) -> int:
        n = 0
        for m in model.modules():
            if getattr(type(m), "kernel_layer_name", None) == fla.NORM_LAYER:
                m.forward = MethodType(hub_norm, m)
            for func in (vars(m).get("_kernel_funcs") or {}).values():
                if getattr(type(func), "kernel_layer_name", None) == fla.LAYER:
                    func.forward = MethodType(lambda _self, *a, **k: chunk_gated_delta_rule(*a, **k), func)
                    n += 1
        return n

    def ours(model: torch.nn.Module) -> int:
        assert fla.kernelize_norms(model) == 1
        return fla.kernelize_fla(model)

    def run(patcher) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        model = make()
        if lora:
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["in_proj_qkv", "in_proj_qkvz",
                                                                                    "q_proj", "out_proj"]))
        assert patcher(model) == 1
        return step_timeline(model, ids)

    lib = run(own)
    assert lib == run(ours)
    assert lib != run(fla.kernelize_fla)  # the gated norm's torch path
    assert run(fla.kernelize_fla) != run(lambda model: 1)  # the torch path of both


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_trace_kernelizes_the_gated_delta_rule_and_names_what_remains(model_type: str) -> None:
    """The trace's Hub kernels (core/tracing/hf.py ``hub_kernels``, fake tensors) bind fla's function, its gated
    norm and causal-conv1d's convolution on each linear-attention module, and the note names them (none left as
    the torch path); with the Hub kernels off, nothing is bound."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.tracing import hf

    def wrappers(model: torch.nn.Module) -> list:
        return [f for m in model.modules() for f in (vars(m).get("_kernel_funcs") or {}).values()
                if getattr(type(f), "kernel_layer_name", None) == fla.LAYER]

    with FakeTensorMode():
        on, off = _model(model_type)(), _model(model_type)()
        note = " ".join(hf.hub_kernels(on, None, TrainingSetup(hub_kernels=True), real=False))
        assert hf.hub_kernels(off, None, TrainingSetup(hub_kernels=False), real=False) == ()
    assert "1 linear-attention modules run fla's chunk_gated_delta_rule" in note
    assert "1 gated norms run fla's FusedRMSNormGated" in note
    assert "1 convolutions run causal-conv1d's causal_conv1d_fn" in note and "not modelled" not in note
    assert [vars(f).get("forward") for f in wrappers(off)] == [None]
    assert [vars(f).get("forward") for f in wrappers(on)] != [None]

