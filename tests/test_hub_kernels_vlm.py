"""transformers' Hub kernels on vision-language models (issue 28: every option on every path; transformers 5.25's
``from_pretrained`` defaults ``use_kernels`` to True, so the user's run on CUDA has them).

``train()`` kernelizes a VLM whole, as a text model: every module whose class is decorated
``use_kernel_forward_from_hub("RMSNorm")`` runs kernels-community/liger-kernels' ``LigerRMSNorm``, the tower's and
projector's where they are built of such a class (Qwen2.5-VL's blocks and merger). Held here: which modules are
swapped, against the kernels library's own ``kernelize`` under transformers' own mapping, on every hand-written
family's class and on traced ones (towers with decorated norms among them); the hand-written programs' rule
against those classes; the estimate against transformers' classes kernelized by the library (``simulate --hf``),
hand-written and traced.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("kernels")

from tests.support import liger_library  # noqa: E402
from tests.support.hub_library import kernelize_as_transformers, swapped_by_library  # noqa: E402
from tests.support.traced_vlm import tiny_configs  # noqa: E402
from tests.test_vlm import LLAVA, QWEN25_VL  # noqa: E402
from tests.test_vlm_gemma3 import GEMMA3  # noqa: E402
from tests.test_vlm_mllama import TINY as MLLAMA  # noqa: E402
from tests.test_vlm_paligemma import _spec as paligemma  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.families import piece  # noqa: E402
from vramlab.core.simulation import liger  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.spec import hub_kernels  # noqa: E402
from vramlab.core.spec import liger as spec_liger  # noqa: E402
from vramlab.core.spec.options import Attention  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.tracing import hf  # noqa: E402

OFF = dict(hub_kernels=False)
HAND_WRITTEN = {"qwen2_5_vl": QWEN25_VL, "llava": LLAVA, "mllama": MLLAMA, "gemma3": GEMMA3,
                "paligemma": paligemma(224)}


def _hand_written_class(spec):  # noqa: ANN001, ANN202
    """The transformers class a hand-written family's reference builds for ``spec``, on the meta device."""
    from transformers import AutoModelForImageTextToText

    cfg = piece(spec.vision.model_type, "reference").hf_config(spec, Attention.SDPA)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(cfg)


def _traced_class(config: dict):  # noqa: ANN202
    from vramlab.core.tracing import vlm_traced

    cfg = vlm_traced.config_from_json(json.dumps(config))
    with torch.device("meta"):
        return vlm_traced.transformers_class(cfg)._from_config(cfg)


def _ours(model: torch.nn.Module) -> list[str]:
    """The modules :func:`liger.kernelize_hub` swaps (those it gives a Hub patch)."""
    liger.kernelize_hub(model, hub_kernels.HUB_RMS_NORM)
    return [name for name, m in model.named_modules() if getattr(m, "liger_patch", None) is hub_kernels.HUB_RMS_NORM]


def _rms_norms(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize("family", list(HAND_WRITTEN))
def test_the_hand_written_vlm_rule_is_what_the_kernels_library_swaps(family: str, monkeypatch) -> None:  # noqa: ANN001
    """On each hand-written family's class, the kernels library swaps the modules ours swaps, and either every
    RMSNorm of the class (the tower's and projector's too) or none, as the family's rule says: the program runs
    the kernel in every RMSNorm it has or in none."""
    spec = HAND_WRITTEN[family]
    theirs = _hand_written_class(spec)
    kernelize_as_transformers(theirs, monkeypatch)
    swapped = swapped_by_library(theirs)
    assert swapped == _ours(_hand_written_class(spec))
    assert swapped == (_rms_norms(theirs) if hub_kernels.hub_norms(spec) else [])
    assert (hub_kernels.kernel_patch(spec, TrainingSetup()) is not None) == bool(swapped)
    if family == "qwen2_5_vl":  # the vision blocks' norms and the merger's are the same decorated class
        assert any(".visual.blocks." in n for n in swapped) and any(".merger." in n for n in swapped)


# traced families: Qwen2-VL, SmolVLM (their language model's norms), and towers whose own norms are decorated
TRACED = {"qwen2_vl": tiny_configs()["qwen2_vl"], "smolvlm": tiny_configs()["smolvlm"],
          "glm4v": {"model_type": "glm4v", "text_config": {"num_hidden_layers": 1}, "vision_config": {"depth": 1}},
          "mistral3": {"model_type": "mistral3", "text_config": {"model_type": "mistral", "num_hidden_layers": 1},
                       "vision_config": {"model_type": "pixtral", "num_hidden_layers": 1}}}


@pytest.mark.parametrize("family", list(TRACED))
def test_a_traced_vlm_class_is_kernelized_as_the_kernels_library_kernelizes_it(family: str, monkeypatch) -> None:  # noqa: ANN001
    theirs = _traced_class(TRACED[family])
    kernelize_as_transformers(theirs, monkeypatch)
    swapped = swapped_by_library(theirs)
    assert swapped and swapped == _ours(_traced_class(TRACED[family]))
    if family == "glm4v":  # its tower's blocks' norms are decorated
        assert any(".visual." in n for n in swapped)
    if family == "mistral3":  # and its projector's
        assert any("multi_modal_projector" in n for n in swapped)


@pytest.fixture
def library_kernelize(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """The references kernelized by the kernels library itself (its LigerRMSNorm over liger-kernel 0.8.5's
    function, Triton launches as no-ops) in place of :func:`liger.kernelize_hub`."""
    gen = liger_library.imported(monkeypatch)
    next(gen)
    monkeypatch.setattr(spec_liger, "LIGER_SM_COUNT", 1)  # what the library takes off CUDA
    # its RMSNorm alone: a hand-written VLM's program counts its RoPE as the torch path (the note says so)
    monkeypatch.setattr(hf, "kernelize_hub", lambda model, patch: kernelize_as_transformers(model, monkeypatch,
                                                                                            ("LigerRMSNorm",)))
    yield
    next(gen, None)


def _phases(r) -> dict[str, int]:  # noqa: ANN001
    return {p.key: p.bytes for p in r.phases}


def _held(est, sim) -> None:  # noqa: ANN001
    """As tests/test_vlm.py holds a VLM step: every phase within the 1 KiB the first run in a process holds."""
    assert est.peak_phase == sim.peak_phase
    assert _phases(est).keys() == _phases(sim).keys()
    for key, b in _phases(sim).items():
        assert abs(_phases(est)[key] - b) <= 1024, (key, _phases(est)[key], b)


@pytest.mark.parametrize("spec,tune,by", [
    (QWEN25_VL, "lora", "ours"), (QWEN25_VL, "lora", "library"),
    pytest.param(LLAVA, "frozen", "library", marks=pytest.mark.slow)],
    ids=["qwen2.5-vl-tower-lora", "qwen2.5-vl-tower-lora-library", "llava-library"])
def test_a_hand_written_vlm_estimate_is_its_class_kernelized(request, spec, tune, by: str) -> None:  # noqa: ANN001
    """LoRA on the language model (and on Qwen2.5-VL's tower, so that its blocks' norms run backward): the estimate
    with the Hub kernels (the default) equals transformers' class kernelized under fake tensors (by
    :func:`liger.kernelize_hub`, which needs no optional package; by the kernels library itself over liger-kernel's
    function where liger-kernel 0.8.5 is installed), and keeps fewer activations than without them."""
    if by == "library":
        request.getfixturevalue("library_kernelize")
    setup = TrainingSetup(method="lora", vision_tuning=tune, images=1, image_width=224, image_height=168,
                          seq_len=64)
    sim = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True)
    _held(est, sim)
    off = estimate(spec, setup.replace(**OFF), match_simulation=True)
    assert est.peak_allocated_bytes < off.peak_allocated_bytes - 64 * 1024
    assert any("LigerRMSNorm" in n for n in est.notes)
    assert not any("not modelled on a vision-language model" in n for n in est.notes)


def test_a_vlm_without_decorated_norms_is_unchanged() -> None:
    """Gemma 3's offset norms and Llama 3.2 Vision's MllamaTextRMSNorm are not decorated: nothing to swap."""
    for spec in (dataclasses.replace(GEMMA3, num_layers=2), MLLAMA):
        setup = TrainingSetup(method="lora", images=1, image_width=224, image_height=168, seq_len=64)
        assert estimate(spec, setup).peak_allocated_bytes == estimate(spec, setup.replace(**OFF)).peak_allocated_bytes


def test_a_traced_vlm_build_kernelizes_its_decorated_norms() -> None:
    """Qwen2-VL traced: transformers' class built under fake tensors as the trace builds it swaps its language
    model's RMSNorms (5 layers x 2 and the final norm), and says so; without the kernels it swaps none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.tracing import vlm_traced

    spec, _ = hf_config_to_spec(tiny_configs()["qwen2_vl"], id="q", name="q")
    setup = TrainingSetup(method="lora", images=1, image_width=100, image_height=80, seq_len=24, lora_rank=4)
    with FakeTensorMode():
        on = vlm_traced.build(spec, setup, real=False)
        off = vlm_traced.build(spec, setup.replace(**OFF), real=False)
    assert len(_ours(on.inner)) == 11 and any("11 RMSNorm modules run" in n for n in on.notes)
    assert not any(getattr(m, "liger_patch", None) for m in off.inner.modules())


@pytest.mark.slow
def test_a_traced_vlm_estimate_is_its_class_kernelized(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Qwen2-VL traced (fitted at three lengths): the estimate with the Hub kernels equals ``simulate --hf`` of the
    same class at a point the trace did not fit, and keeps fewer activations than without them."""
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.sources.hf_config import hf_config_to_spec

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = hf_config_to_spec(tiny_configs()["qwen2_vl"], id="q", name="q")
    setup = TrainingSetup(method="lora", images=1, image_width=100, image_height=80, seq_len=24, lora_rank=4)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert "fitted at" in est.notes[0]
    _held(est, sim)
    assert sim.peak_allocated_bytes < simulate(spec, setup.replace(**OFF)).peak_allocated_bytes
    assert any("the RMSNorms it decorates run liger's LigerRMSNorm" in n for n in est.notes)
