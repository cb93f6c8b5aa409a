"""Liger Kernel's fused linear cross-entropy as a loss kernel (issue 28: ``use_liger_kernel=True``, axolotl's
``liger_fused_linear_cross_entropy: true``, LLaMA-Factory's ``enable_liger_kernel: true``).

Held three ways. The reference (core/simulation/loss.py ``liger_fused_linear_cross_entropy``) against the library
itself: liger-kernel 0.8.5's own Python code (``LigerForCausalLMLoss``, its autograd function) run on real CPU
tensors with its Triton kernels launched as no-ops (they run on CUDA only; they write into tensors the library
allocates, so every allocation stays the library's) and its CUDA matmul path taken (``_can_use_mm_out``, which
asks for a CUDA device), every alloc and free of forward and backward counted by the tracker, the two timelines
equal byte for byte. The estimate against the reference on transformers' classes (hand-written families, a
softcapping one, a traced one, vision-language models). And what Liger cannot run is refused with its reason.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import liger_library
from tests.support.three_ways import held_three_ways
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import liger_chunk_rows
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation import loss as loss_kernels  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)
LIGER = dict(loss_kernel="liger")


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """liger-kernel 0.8.5's ``ops.fused_linear_cross_entropy`` and ``LigerForCausalLMLoss``, imported over a triton
    whose kernels are no-ops, with the CUDA path of its matmuls (``torch.mm(..., out=)``) taken."""
    gen = liger_library.imported(monkeypatch)
    next(gen)
    from liger_kernel.ops import fused_linear_cross_entropy as flce
    from liger_kernel.transformers.model import loss_utils

    monkeypatch.setattr(flce, "_can_use_mm_out", lambda *_a: True)  # CUDA's path: the logits tile reused
    yield flce, loss_utils
    next(gen, None)


def _timeline(fn, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,  # noqa: ANN001
              train_head: bool) -> tuple[list[int], list[int]]:
    """Live bytes after every alloc and free of ``fn``'s forward and backward; the gradients' sizes."""
    tracker = MemoryTracker(block=1)
    with tracker:
        hh = h.detach().clone().requires_grad_(True)
        ww = w.detach().clone().requires_grad_(train_head)
        loss = fn(hh, ww, labels)
        loss.backward()
        grads = [g.numel() * g.element_size() for g in (hh.grad, ww.grad) if g is not None]
        del loss, hh, ww
    return [c for _, c in tracker.timeline], grads


# the head trained only where CPU and CUDA take the same path: a 16-bit head's gradient accumulates by addmm(out=)
# on CUDA (nothing allocated), by a product and .float() on CPU
@pytest.mark.parametrize(("batch", "seq", "dim", "dtype", "train_head"),
                         [(2, 40, 64, torch.bfloat16, False), (1, 300, 96, torch.bfloat16, False),
                          (3, 50, 64, torch.float32, True), (2, 33, 48, torch.float32, False)],
                         ids=["bf16-frozen-head", "long-one-row", "fp32-trained-head", "fp32-frozen-head"])
def test_the_reference_allocates_what_liger_allocates(library, batch: int, seq: int, dim: int,  # noqa: ANN001
                                                      dtype: torch.dtype, train_head: bool) -> None:
    _flce, loss_utils = library
    torch.manual_seed(0)
    h = torch.randn(batch, seq, dim, dtype=dtype)
    w = torch.randn(1000, dim, dtype=dtype)
    labels = torch.randint(0, 1000, (batch, seq))

    def theirs(hh: torch.Tensor, ww: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return loss_utils.LigerForCausalLMLoss(hh, ww, lab, hidden_size=dim)

    lib, lib_grads = _timeline(theirs, h, w, labels, train_head)
    ours, our_grads = _timeline(loss_kernels.liger_fused_linear_cross_entropy, h, w, labels, train_head)
    assert lib_grads == our_grads
    assert max(lib) == max(ours)
    assert lib == ours


@pytest.mark.parametrize("batch", [1, 3])
def test_under_autocast_the_reference_allocates_what_liger_allocates(library, monkeypatch,  # noqa: ANN001
                                                                     batch: int) -> None:
    """fp32 hidden states and head under CUDA's bf16 autocast (emulated: core/simulation/autocast_cuda.py), the
    head frozen (a trained fp32 head's gradient accumulates by CUDA's addmm(out_dtype=), which CPU cannot run):
    the library makes each tile by ``@``, which autocast casts."""
    from vramlab.core.simulation import autocast_cuda

    flce, loss_utils = library
    monkeypatch.setattr(flce, "_can_use_mm_out", lambda *_a: False)  # CUDA's answer: autocast's dtype is not fp32
    torch.manual_seed(0)
    h = torch.randn(batch, 70, 64)
    w = torch.randn(1000, 64)
    labels = torch.randint(0, 1000, (batch, 70))

    def theirs(hh: torch.Tensor, ww: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return loss_utils.LigerForCausalLMLoss(hh, ww, lab, hidden_size=64)

    def ours(hh: torch.Tensor, ww: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return loss_kernels.liger_fused_linear_cross_entropy(hh, ww, lab, lambda a, b, _w: a @ b)

    mode = autocast_cuda.CudaAutocast(torch.bfloat16)
    with autocast_cuda.emulating(mode), mode.region():
        lib, lib_grads = _timeline(theirs, h, w, labels, False)
        mine, our_grads = _timeline(ours, h, w, labels, False)
    assert lib_grads == our_grads
    assert max(lib) == max(mine)
    assert lib == mine


def test_the_tile_is_the_librarys(library) -> None:  # noqa: ANN001
    """The logits tile's tokens as liger-kernel 0.8.5 sizes them: its default budget constant, and the tile its
    forward allocates for shapes where the power of two, the bound by the tokens and the vocabulary's ratio each
    decide."""
    import inspect

    flce, _ = library
    assert flce._CHUNK_MEM_CONST == 1
    assert inspect.signature(flce.fused_linear_cross_entropy_forward).parameters["chunk_mem_const"].default == 1
    made: list[tuple[int, ...]] = []
    real_empty = torch.empty

    def empty(*size: object, **kw: object) -> torch.Tensor:
        made.append(tuple(size[0]) if len(size) == 1 and isinstance(size[0], tuple) else tuple(size))
        return real_empty(*size, **kw)

    for bt, vocab, hidden in [(100, 1000, 64), (4096, 128256, 4096), (7, 50, 64), (300, 1000, 96)]:
        made.clear()
        x = torch.randn(bt, hidden, dtype=torch.bfloat16)
        w = torch.randn(vocab, hidden, dtype=torch.bfloat16) if vocab * hidden < 1e7 else None
        if w is None:
            continue  # too large for a CPU test: the rule's own cases below
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "empty", empty)
            flce.fused_linear_cross_entropy_forward(x, w, torch.randint(0, vocab, (bt,)))
        assert (liger_chunk_rows(bt, vocab, hidden), vocab) in made
    assert liger_chunk_rows(4096, 128256, 4096) == 128  # Llama 3: cdiv(V, H) = 32 tiles of 128 tokens
    assert liger_chunk_rows(7, 50, 64) == 7  # one tile, never more than the tokens


SETUPS = {
    "lora-batch2": TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=512, micro_batch=2),
    "lora-all-checkpointing": TrainingSetup(method="lora", lora_targets="all-linear", seq_len=512, grad_ckpt=True,
                                            ckpt_reentrant=True),
    "full-checkpointing-non-reentrant": TrainingSetup(method="full", seq_len=256, micro_batch=2, grad_ckpt=True,
                                                      ckpt_reentrant=False),
    "full-odd-sizes": TrainingSetup(method="full", seq_len=300, micro_batch=3),
    "full-fp32": TrainingSetup(method="full", seq_len=200, weights="fp32", compute="fp32"),
    "qlora": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256),
    "full-zero2-accumulation": TrainingSetup(method="full", seq_len=256, micro_batch=2, gpus=2, sharding="zero2",
                                             grad_accum=4),  # a scaled loss: backward scales both gradients in place
    "freeze": TrainingSetup(method="freeze", trainable_layers=1, seq_len=256, micro_batch=2),
    # fp32 weights under bf16 autocast: each tile cast, a trained head's bf16 copy in autocast's cache
    "full-amp": TrainingSetup(method="full", seq_len=300, micro_batch=2, weights="fp32", compute="bf16", amp=True),
    "lora-amp": TrainingSetup(method="lora", seq_len=256, micro_batch=2, weights="fp32", compute="bf16", amp=True),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_liger_on_transformers_classes_matches_the_estimate(name: str) -> None:
    setup = SETUPS[name].replace(**LIGER)
    # transformers' LlamaForCausalLM (+ peft), its hidden states to Liger, and the builder with the same kernel
    est, own = held_three_ways(LLAMA, setup, SETUPS[name])
    if name.startswith("lora"):  # the loss holds the peak there: no whole logits, no fp32 copies
        assert est.peak_allocated_bytes < 0.5 * own.peak_allocated_bytes


def test_the_gradients_live_from_the_forward() -> None:
    """Liger computes the hidden states' and the head's gradients during the forward: the forward's peak holds them
    (full fine-tuning: a head-sized gradient that HF's loss and Cut Cross Entropy make only in backward)."""
    setup = TrainingSetup(method="full", seq_len=128, micro_batch=1)
    liger = estimate(LLAMA, setup.replace(**LIGER), match_simulation=True)
    cce = estimate(LLAMA, setup.replace(loss_kernel="cce"), match_simulation=True)
    head = LLAMA.vocab_size * LLAMA.hidden_size * 2
    fwd = {p.key: p.bytes for p in liger.phases}["forward@1"]
    assert fwd - {p.key: p.bytes for p in cce.phases}["forward@1"] > 0.95 * head  # less CCE's own fp32 rows


@pytest.mark.parametrize(("extra", "needle"), [(dict(chunked_loss=True), "drop --chunked-loss"),
                                               (dict(gpus=2, sharding="zero3"), "outside lm_head's forward"),
                                               (dict(loss_fp32=False), "drop --loss-bf16"),
                                               (dict(objective="dpo", completion_len=64), "is not supported")])
def test_what_liger_is_not_modelled_with_is_refused(extra: dict, needle: str) -> None:
    with pytest.raises(SetupError, match=needle):
        TrainingSetup(**LIGER, **extra).validate(LLAMA)


@pytest.mark.parametrize("family", ["cohere", "granite"])
def test_a_model_that_scales_its_logits_is_refused_with_ligers_reason(family: str) -> None:
    from transformers import CohereConfig, GraniteConfig

    from vramlab.core.tracing import hf

    size = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)
    cfg = CohereConfig(**size) if family == "cohere" else GraniteConfig(**size, logits_scaling=8.0)
    with pytest.raises(SetupError, match="not available for Granite models"):
        hf.measure_config(cfg, TrainingSetup(seq_len=32, **LIGER))


def test_the_cli_takes_the_kernel_and_names_the_library_it_models(capsys) -> None:  # noqa: ANN001
    import json

    from vramlab.core.cli import main

    assert main(["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--loss-kernel", "liger", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["loss_kernel"] == "liger"
    assert out["models_versions"]["loss_kernel"] == {"liger-kernel": "0.8.5"}
    assert main(["estimate", "--model", "llama-3.2-1b", "--loss-kernel", "liger", "--chunked-loss"]) == 2
    assert "drop --chunked-loss" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "text", "kernel", "others"), [
    ("ax.yaml", "base_model: m\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\n"
     "liger_fused_linear_cross_entropy: true\nliger_rms_norm: true\nbf16: true\n", "liger", ["rms_norm"]),
    ("lf.yaml", "model_name_or_path: m\nstage: sft\nfinetuning_type: lora\nenable_liger_kernel: true\n", "liger",
     ["rms_norm", "glu", "layer_norm", "rope"]),
    # LLaMA-Factory keeps the logits for a stage that needs them (apply_liger_kernel's require_logits)
    ("lf-dpo.yaml", "model_name_or_path: m\nstage: dpo\nfinetuning_type: lora\nenable_liger_kernel: true\n", None,
     ["rms_norm", "glu", "layer_norm", "rope"]),
    ("args.json", '{"per_device_train_batch_size": 2, "use_liger_kernel": true}', "liger",
     ["rms_norm", "glu", "layer_norm", "rope"]),
    ("args-no-flce.json", '{"per_device_train_batch_size": 2, "use_liger_kernel": true, '
     '"liger_kernel_config": {"fused_linear_cross_entropy": false}}', None,
     ["rms_norm", "glu", "layer_norm", "rope"]),
], ids=["axolotl", "llamafactory-sft", "llamafactory-dpo", "trainer", "trainer-config-off"])
def test_the_frameworks_switches_are_read_as_the_kernel(tmp_path, name: str, text: str, kernel: str | None,  # noqa: ANN001
                                                        others: list[str]) -> None:
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / name
    cfg.write_text(text)
    read = read_training_configs([cfg])
    assert read.changes.get("loss_kernel") == kernel
    assert read.changes.get("liger_kernels") == others  # its RMSNorm / GLU kernels (tests/test_liger_kernels.py)
    liger = [r for r in read.rows if r.key in ("liger_fused_linear_cross_entropy", "enable_liger_kernel",
                                                "use_liger_kernel")]
    assert liger and "not modelled" not in liger[0].note.replace("cross-entropy is not modelled", "")
    if name == "ax.yaml":
        assert not any(r.key == "liger_rms_norm" and r.status == "not modelled" for r in read.rows)


def test_axolotl_writes_the_liger_plugin_and_nothing_else_does() -> None:
    import yaml

    from vramlab.core.sources.export import export_setup

    out = export_setup(TrainingSetup(**LIGER), "axolotl", model="m/x")
    written = yaml.safe_load(out.files[out.main])
    assert written["plugins"] == ["axolotl.integrations.liger.LigerPlugin"]
    assert written["liger_fused_linear_cross_entropy"] is True
    assert not any(k.startswith("liger_") and k != "liger_fused_linear_cross_entropy" for k in written)
    with pytest.raises(SetupError, match="cannot express"):
        export_setup(TrainingSetup(**LIGER), "llamafactory", model="m/x")
