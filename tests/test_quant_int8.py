"""8-bit weights as bitsandbytes runs them (core/simulation/quant.py, the estimator's int8 linear): its
``MatMul8bitLt`` keeps the layer's input for backward, and transformers loads 8-bit models with the outlier
threshold 6.0. Checked through bitsandbytes' own autograd function on the CPU where it is installed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vramlab.core.simulation.quant import LLM_INT8_THRESHOLD, QuantLinearFn, QuantWeight


def _saved_storages(fn) -> set[int]:  # noqa: ANN001
    """Data pointers of the storages autograd saves while ``fn`` runs."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def test_the_int8_emulation_keeps_its_input_as_bitsandbytes_does():
    x = torch.randn(2, 16, 64, requires_grad=True)
    qw = QuantWeight(32, 64, "int8", False, torch.device("cpu"))
    kept = _saved_storages(lambda: QuantLinearFn.apply(x, None, qw))
    assert x.untyped_storage().data_ptr() in kept
    nf4 = QuantWeight(32, 64, "nf4", True, torch.device("cpu"))
    assert x.untyped_storage().data_ptr() not in _saved_storages(lambda: QuantLinearFn.apply(x, None, nf4))


def test_bitsandbytes_matmul8bitlt_keeps_its_input_A():
    """The source of the mechanism: bitsandbytes' own autograd function (its CPU kernels) keeps A, a view of
    the layer's input, as ``ctx.tensors[2]`` whenever the input needs a gradient."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    x = torch.randn(2, 16, 64, dtype=torch.float16, requires_grad=True)
    state = MatmulLtState()
    state.threshold, state.has_fp16_weights, state.is_training = LLM_INT8_THRESHOLD, False, True
    state.CB, state.SCB, _ = bnb.functional.int8_vectorwise_quant(torch.randn(32, 64, dtype=torch.float16))
    try:
        y = MatMul8bitLt.apply(x, state.CB, None, None, state)
    except (RuntimeError, NotImplementedError) as e:  # a bitsandbytes without CPU kernels
        pytest.skip(f"bitsandbytes' int8 kernels do not run on this CPU: {e}")
    kept = y.grad_fn.tensors[2]
    assert kept.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert kept.numel() == x.numel()


def test_8bit_layers_get_transformers_default_outlier_threshold():
    transformers = pytest.importorskip("transformers")
    assert LLM_INT8_THRESHOLD == transformers.BitsAndBytesConfig(load_in_8bit=True).llm_int8_threshold
    pytest.importorskip("bitsandbytes")
    from vramlab.core.simulation.quant import _bnb_linear

    layer = _bnb_linear(32, 64, "int8", False, torch.device("cpu"), 0.02, torch.bfloat16)
    assert layer.state.threshold == LLM_INT8_THRESHOLD


def test_the_estimate_keeps_the_int8_layers_inputs_as_the_simulation_does():
    """The estimator's int8 linear against the simulation of the emulation (which keeps what bitsandbytes
    keeps): equal, and above an NF4 model's activations by the inputs the int8 layers keep."""
    from vramlab.core.catalog import find_model
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.spec.training import TrainingSetup

    spec = dataclasses.replace(find_model("qwen2.5-0.5b"), num_layers=4)
    setup = TrainingSetup(method="qlora", weights="int8", seq_len=256)
    sim = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True, calibration=None)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert dict(est.components) == dict(sim.components)
