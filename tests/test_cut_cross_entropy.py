"""Cut Cross Entropy as a loss kernel (issue 28: axolotl's ``cut_cross_entropy: true``).

Held three ways. The reference (core/simulation/loss.py ``cut_cross_entropy``) against the library itself:
cut-cross-entropy 25.1.1's own Python code (``cce_linear_cross_entropy``, its autograd function, its kernel
wrappers) run on real CPU tensors with its Triton kernels launched as no-ops (they run on CUDA only; they write
into tensors the wrappers allocate, so every allocation stays the library's), every alloc and free of forward and
backward counted by the tracker, the two timelines equal byte for byte. The estimate against the reference on
transformers' classes (a text model, a traced one, a vision-language model). And where the library refuses
(fp32 hidden states in its backward), the setup is refused with its reason.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support import triton_stub
from tests.support.three_ways import HF_BUFFERS
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation import loss as loss_kernels  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)
CCE = dict(loss_kernel="cce")


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """cut_cross_entropy 25.1.1's ``cce`` module, imported over a triton whose kernels are no-ops."""
    from importlib import metadata, util

    if util.find_spec("cut_cross_entropy") is None:
        pytest.skip("pip install cut-cross-entropy==25.1.1 --no-deps")
    if metadata.version("cut-cross-entropy") != "25.1.1":
        pytest.skip("the reference models cut-cross-entropy 25.1.1")
    names = ["triton", "triton.language", "triton.language.extra", "triton.runtime", "triton.testing"]
    triton_stub.install(monkeypatch, names)
    for n in [n for n in sys.modules if n.startswith("cut_cross_entropy")]:
        monkeypatch.delitem(sys.modules, n)
    # torch.compile'd functions of the library (argsort then int32; the softcap) run eagerly: the same outputs
    monkeypatch.setattr(torch, "compile", lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f))
    from cut_cross_entropy import cce

    yield cce
    for n in [n for n in sys.modules if n.startswith("cut_cross_entropy")]:
        del sys.modules[n]


def _timeline(fn, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Live bytes after every alloc and free of ``fn``'s forward and backward; the gradients' sizes."""
    tracker = MemoryTracker(block=1)
    with tracker:
        hh = h.detach().clone().requires_grad_(True)
        ww = w.detach().clone().requires_grad_(True)
        loss = fn(hh, ww, labels)
        loss.backward()
        grads = [hh.grad.numel() * hh.grad.element_size(), ww.grad.numel() * ww.grad.element_size()]
        del loss, hh, ww
    return [c for _, c in tracker.timeline], grads


@pytest.mark.parametrize(("batch", "seq", "dim", "head_dtype"), [(2, 40, 64, torch.bfloat16),
                                                                  (1, 300, 96, torch.bfloat16),
                                                                  (3, 50, 64, torch.float32)],
                         ids=["bf16-head", "long-one-row", "fp32-head"])
def test_the_reference_allocates_what_cut_cross_entropy_allocates(library, batch: int, seq: int, dim: int,  # noqa: ANN001
                                                                  head_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    h = torch.randn(batch, seq, dim, dtype=torch.bfloat16)
    w = torch.randn(1000, dim, dtype=head_dtype)
    labels = torch.randint(0, 1000, (batch, seq))

    def theirs(hh: torch.Tensor, ww: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return library.cce_linear_cross_entropy(hh, ww, lab, shift=True, filter_eps="high")

    lib, lib_grads = _timeline(theirs, h, w, labels)
    ours, our_grads = _timeline(loss_kernels.cut_cross_entropy, h, w, labels)
    assert lib_grads == our_grads
    assert max(lib) == max(ours)
    assert lib == ours


def test_fp32_hidden_states_are_refused_with_the_librarys_reason(library) -> None:  # noqa: ANN001
    h = torch.randn(1, 8, 64, requires_grad=True)
    w = torch.randn(100, 64, requires_grad=True)
    labels = torch.randint(0, 100, (1, 8))
    with pytest.raises(AssertionError, match="Backwards requires embeddings to be bf16 or fp16"):
        library.cce_linear_cross_entropy(h, w, labels, shift=True).backward()
    with pytest.raises(SetupError, match="Backwards requires embeddings to be bf16 or fp16"):
        loss_kernels.cut_cross_entropy(h, w, labels)
    with pytest.raises(SetupError, match="Backwards requires embeddings to be bf16 or fp16"):
        TrainingSetup(weights="fp32", **CCE).validate(LLAMA)


SETUPS = {
    "lora-batch2": TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=512, micro_batch=2),
    # the reentrant mode the hand-written program models (tests/test_handwritten_vs_hf.py)
    "lora-all-checkpointing": TrainingSetup(method="lora", lora_targets="all-linear", seq_len=512, grad_ckpt=True,
                                            ckpt_reentrant=True),
    "full-odd-sizes": TrainingSetup(method="full", seq_len=300, micro_batch=3),
    "qlora": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_cce_on_transformers_classes_matches_the_estimate(name: str) -> None:
    setup = SETUPS[name].replace(**CCE)
    ref = simulate(LLAMA, setup, hf=True)  # transformers' LlamaForCausalLM (+ peft), its hidden states to CCE
    built = simulate(LLAMA, setup)  # the built-in builder, the same kernel
    est = estimate(LLAMA, setup, match_simulation=True)
    own = estimate(LLAMA, SETUPS[name], match_simulation=True)
    assert est.source == "hand-written"
    assert est.peak_allocated_bytes == built.peak_allocated_bytes
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= HF_BUFFERS
    assert est.peak_phase == ref.peak_phase
    if name != "full-odd-sizes":  # the loss holds the peak there: no logits, no fp32 copies
        assert est.peak_allocated_bytes < 0.5 * own.peak_allocated_bytes


@pytest.mark.parametrize(("extra", "needle"), [(dict(chunked_loss=True), "drop --chunked-loss"),
                                               (dict(gpus=2, sharding="zero3"), "outside lm_head's forward"),
                                               (dict(loss_fp32=False), "drop --loss-bf16")])
def test_what_cce_cannot_be_combined_with_is_refused(extra: dict, needle: str) -> None:
    with pytest.raises(SetupError, match=needle):
        TrainingSetup(**CCE, **extra).validate(LLAMA)


def test_axolotl_cut_cross_entropy_is_read_and_exported(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.export import export_setup
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "ax.yaml"
    cfg.write_text("base_model: m\nplugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n"
                   "cut_cross_entropy: true\nbf16: true\n")
    assert read_training_configs([cfg]).changes["loss_kernel"] == "cce"
    out = export_setup(TrainingSetup(**CCE), "axolotl", model="m/x")
    assert "cut_cross_entropy: true" in out.files[out.main]
    with pytest.raises(SetupError, match="cannot express"):
        export_setup(TrainingSetup(**CCE), "llamafactory", model="m/x")


def test_the_cli_takes_the_kernel_and_names_the_library_it_models(capsys) -> None:  # noqa: ANN001
    import json

    from vramlab.core.cli import main

    assert main(["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--loss-kernel", "cce", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["loss_kernel"] == "cce"
    assert out["models_versions"]["loss_kernel"] == {"cut-cross-entropy": "25.1.1"}
    assert main(["estimate", "--model", "llama-3.2-1b", "--loss-kernel", "cce", "--weights", "fp32"]) == 2
    assert "bf16 or fp16" in capsys.readouterr().err


def test_a_model_that_scales_its_logits_is_refused_not_guessed() -> None:
    from transformers import CohereConfig

    from vramlab.core.tracing import hf

    cfg = CohereConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(SetupError, match="logit_scale"):
        hf.measure_config(cfg, TrainingSetup(seq_len=32, **CCE))
