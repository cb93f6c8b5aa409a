"""Every fused loss kernel on every path (issue 28: an option is a transformation of any step): Cut Cross Entropy,
TRL's fused LM head and Liger's fused linear cross-entropy, each on a softcapped hand-written family, a traced
family and the hand-written vision-language families, held to transformers' own classes (or the VLM's simulation).
Each kernel's own file holds the kernel to its library (tests/test_cut_cross_entropy.py, test_trl_loss.py,
test_liger_kernel.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import LossKernel
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation.simulate import simulate  # noqa: E402

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=8000)
FUSED = [k.value for k in LossKernel if k is not LossKernel.HF]
# what each kernel's note says when a traced family simulates it directly at the setup's sizes
NOTE = {"cce": "Cut Cross Entropy", "trl": "TRL's fused LM head", "liger": "Liger"}


def test_every_fused_kernel_is_held_here() -> None:
    assert set(FUSED) == set(NOTE)


@pytest.mark.parametrize("kernel", FUSED)
def test_a_softcapped_head_matches_transformers(kernel: str) -> None:
    from tests.test_handwritten_vs_hf import GEMMA2
    from vramlab.core.sources.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({**GEMMA2, "vocab_size": 8000, "num_hidden_layers": 4}, id="g2", name="Gemma 2")
    setup = TrainingSetup(method="full", seq_len=128, micro_batch=2, weights="bf16", loss_kernel=kernel)
    est = estimate(spec, setup, match_simulation=True)
    ref = simulate(spec, setup, hf=True)
    assert est.peak_allocated_bytes == simulate(spec, setup).peak_allocated_bytes
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8192
    assert est.peak_phase == ref.peak_phase


@pytest.mark.parametrize("kernel", FUSED)
def test_a_traced_family_is_simulated_on_transformers_classes(kernel: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec = dataclasses.replace(LLAMA, tape="traced")
    setup = TrainingSetup(method="lora", seq_len=128, micro_batch=2, loss_kernel=kernel)
    est = estimate(spec, setup, match_simulation=True)
    ref = simulate(dataclasses.replace(spec, tape="auto"), setup, hf=True)
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes
    assert NOTE[kernel] in est.notes[0]


@pytest.mark.parametrize("family", ["llava", "qwen"])
@pytest.mark.parametrize("kernel", FUSED)
def test_a_vlm_matches_its_simulation(kernel: str, family: str) -> None:
    from tests.test_vlm import LLAVA, QWEN25_VL, _setup

    spec = QWEN25_VL if family == "qwen" else LLAVA
    setup = _setup("lora", "lora", (640, 480), 2, "sdpa").replace(loss_kernel=kernel)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= 1024
    assert est.peak_phase == sim.peak_phase


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("kernel", FUSED)
def test_fsdp_gathers_the_head_a_fused_loss_reads(kernel: str, method: str) -> None:
    """The kernels read lm_head.weight inside the causal LM's forward: FSDP's root unit (embeddings, final norm,
    head) is gathered around that whole forward, so the head is whole there, as in transformers' classes."""
    setup = TrainingSetup(method=method, seq_len=128, micro_batch=2, gpus=2, sharding="fsdp", loss_kernel=kernel)
    est = estimate(LLAMA, setup, match_simulation=True)
    assert est.peak_allocated_bytes == simulate(LLAMA, setup).peak_allocated_bytes
    assert abs(est.peak_allocated_bytes - simulate(LLAMA, setup, hf=True).peak_allocated_bytes) <= 8192
