"""Offloaded checkpointing (``--grad-ckpt-offload``) and Unsloth's (``--unsloth-gc``) on vision-language models
(issue 28: an option is a transformation of any step).

transformers' VLM classes checkpoint every GradientCheckpointingLayer, the tower's blocks and the language model's
decoder layers, with the one function ``_set_gradient_checkpointing`` gives them: LLaMA-Factory's
``UnslothGradientCheckpointing`` / axolotl's offloaded checkpointer, or unsloth_zoo's ``UnslothCheckpointFunction``
(FastVisionModel installs it as FastLanguageModel does: ``apply_unsloth_gradient_checkpointing`` then
``prepare_model_for_training``'s ``_set_gradient_checkpointing()``, reentrant on one GPU). Held here to the
libraries' own functions run on transformers' classes under fake tensors (a hand-written family's reference and a
traced family's class), and the estimate to those classes.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support import offload_libraries as libs
from tests.test_vlm import QWEN25_VL as TINY
from vramlab.core.estimate import estimate
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation.simulate import simulate  # noqa: E402

# one 700 x 700 image: 50 x 50 patches into the tower's 512-wide blocks (2.4 MiB of bf16, over unsloth_zoo's
# 2 MiB), 625 merged tokens and 600 of text into the 256-wide language model (0.6 MiB a layer input, under it)
QWEN25_VL = dataclasses.replace(TINY, vision=dataclasses.replace(TINY.vision, hidden_size=512, intermediate_size=512))
BIG = dict(images=1, image_width=700, image_height=700)
TOWER_INPUT = 50 * 50 * 512 * 2
SETUP = TrainingSetup(method="lora", vision_tuning="frozen", micro_batch=1, seq_len=600, grad_ckpt=True,
                      hub_kernels=False, **BIG)
OFFLOADED = SETUP.replace(ckpt_offload=True)
UNSLOTH = SETUP.replace(unsloth_gc=True)


def _framework(name: str) -> None:
    """Skip before any simulation where the framework is not installed (CI has no conformance extra)."""
    import importlib.util
    import sys

    if name not in sys.modules and importlib.util.find_spec(name) is None:  # a bare package has no spec
        pytest.skip(f"{name} is not installed: pip install -e .[conformance]")


def _phases(r) -> dict[str, int]:  # noqa: ANN001
    return {p.key: p.bytes for p in r.phases}


def _estimate_is_the_classes(setup: TrainingSetup, sim=None):  # noqa: ANN001, ANN202
    est, sim = estimate(QWEN25_VL, setup, match_simulation=True), sim or simulate(QWEN25_VL, setup)
    assert est.peak_phase == sim.peak_phase
    for key, b in _phases(sim).items():  # as tests/test_vlm.py holds a checkpointed VLM step: 1 %
        assert abs(_phases(est)[key] - b) <= max(1024, b // 100), key
    return est


def test_the_offloaded_checkpoint_on_a_vlm_is_estimated_from_transformers_classes():
    est = _estimate_is_the_classes(OFFLOADED)
    kept = estimate(QWEN25_VL, SETUP.replace(ckpt_reentrant=True), match_simulation=True)
    # every checkpointed input leaves the GPU between forward and backward, the tower's blocks' with the rest
    assert _phases(est)["forward@1"] < _phases(kept)["forward@1"]


def test_the_offloaded_checkpoint_on_a_vlm_is_llamafactorys_own_on_transformers_classes():
    _framework("llamafactory")
    ours = simulate(QWEN25_VL, OFFLOADED)
    with pytest.MonkeyPatch.context() as mp:
        libs.offloaded_checkpoint(mp, "llamafactory")
        theirs = simulate(QWEN25_VL, OFFLOADED)
    assert _above_load(ours) == _above_load(theirs)


def test_unsloths_checkpointing_on_a_vlm_offloads_the_tower_blocks_inputs():
    est = _estimate_is_the_classes(UNSLOTH)
    plain = estimate(QWEN25_VL, SETUP.replace(ckpt_reentrant=True), match_simulation=True)
    ours, theirs = _phases(est), _phases(plain)
    # only the tower's inputs are over 2 MiB: staging buffer A grows to one of them, B stays at 2 MiB after the
    # first pass and grows too from the second (double buffering), and both live across the steps
    assert ours["optimizer@1"] - theirs["optimizer@1"] == TOWER_INPUT + 2 * 1024 * 1024
    assert ours["optimizer@2"] - theirs["optimizer@2"] == 2 * TOWER_INPUT
    assert est.models_versions()["unsloth_gc"] == {"unsloth": "2026.10.9", "unsloth_zoo": "2026.10.9"}


@pytest.mark.parametrize("hf", [pytest.param(True, id="qwen2_5_vl"), pytest.param(False, id="traced_smolvlm",
                                                                                    marks=pytest.mark.slow)])
def test_unsloths_checkpointing_on_a_vlm_is_unsloth_zoos_own(hf: bool) -> None:
    from tests.support import unsloth_zoo_gc

    unsloth_zoo_gc.source()
    spec, setup = (QWEN25_VL, UNSLOTH) if hf else _traced(UNSLOTH)
    ours = simulate(spec, setup)
    with pytest.MonkeyPatch.context() as mp:
        unsloth_zoo_gc.in_place_of_ours(mp)
        theirs = simulate(spec, setup)
    assert _above_load(ours) == _above_load(theirs)


def _traced(setup: TrainingSetup, big: bool = True):  # noqa: ANN202
    """SmolVLM traced whole; ``big``: a tower block's input over 2 MiB (Unsloth's threshold)."""
    from tests.support.traced_vlm import tiny_configs
    from vramlab.core.sources.hf_config import hf_config_to_spec

    cfg = tiny_configs()["smolvlm"]
    if big:
        cfg["vision_config"].update(hidden_size=512, intermediate_size=512)
    spec, _ = hf_config_to_spec(cfg, id="smolvlm", name="smolvlm")
    if not big:
        return spec, setup.replace(micro_batch=1, seq_len=64, image_width=64, image_height=64)
    return spec, setup.replace(micro_batch=2, seq_len=2048, image_width=512, image_height=512)


@pytest.mark.parametrize("framework", ["llamafactory", pytest.param("axolotl", marks=pytest.mark.slow)])
def test_the_offloaded_checkpoint_on_a_traced_vlm_is_the_frameworks_own(framework: str) -> None:
    _framework(framework)
    spec, setup = _traced(OFFLOADED, big=False)
    ours = simulate(spec, setup)
    with pytest.MonkeyPatch.context() as mp:
        libs.offloaded_checkpoint(mp, framework)
        theirs = simulate(spec, setup)
    assert _above_load(ours) == _above_load(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("option", [{"ckpt_offload": True}, {"unsloth_gc": True}], ids=["offloaded", "unsloth"])
def test_the_traced_vlm_estimate_is_its_classes_at_the_sizes_asked(option: dict, tmp_path, monkeypatch) -> None:
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, setup = _traced(SETUP.replace(**option))
    est = estimate(spec, setup, match_simulation=True)
    assert est.peak_allocated_bytes == simulate(spec, setup).peak_allocated_bytes


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"vision_tuning": "lora"}, {"vision_ckpt": False}, {"method": "full",
                                                                                         "vision_tuning": "full"}])
def test_the_options_on_a_vlm_matrix(change: dict) -> None:
    for option in ({"ckpt_offload": True}, {"unsloth_gc": True}):
        _estimate_is_the_classes(SETUP.replace(**option, **change))


def test_the_llava_tower_takes_the_checkpoint_function_too():
    _framework("llamafactory")
    from tests.test_vlm import LLAVA

    llava = dataclasses.replace(LLAVA)
    setup = OFFLOADED.replace(image_width=56, image_height=56, micro_batch=2, seq_len=64)
    ours = simulate(llava, setup)
    with pytest.MonkeyPatch.context() as mp:
        libs.offloaded_checkpoint(mp, "llamafactory")
        theirs = simulate(llava, setup)
    assert _above_load(ours) == _above_load(theirs)
    est = estimate(llava, setup, match_simulation=True)
    assert abs(est.peak_allocated_bytes - ours.peak_allocated_bytes) <= max(1024, ours.peak_allocated_bytes // 100)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["paligemma", "gemma3"])
def test_the_options_on_the_other_hand_written_vlms(family: str) -> None:
    from tests.test_vlm_gemma3 import GEMMA3
    from tests.test_vlm_paligemma import _spec

    spec = _spec(224) if family == "paligemma" else GEMMA3
    for option in ({"ckpt_offload": True}, {"unsloth_gc": True}):
        setup = SETUP.replace(image_width=224, image_height=224, micro_batch=2, **option)
        est, sim = estimate(spec, setup, match_simulation=True), simulate(spec, setup)
        assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= max(1024, sim.peak_allocated_bytes // 100)


@pytest.mark.slow
def test_llama_3_2_visions_cross_attention_layers_take_llamafactorys_function() -> None:
    """Its estimate refuses checkpointing with images; ``simulate`` runs the classes with the offloaded function
    (the cross-attention states bound into the layer's partial, as LLaMA-Factory's function receives them)."""
    from tests.test_vlm_mllama import TINY

    _framework("llamafactory")
    setup = OFFLOADED.replace(image_width=56, image_height=56, micro_batch=2, seq_len=64)
    ours = simulate(TINY, setup)
    with pytest.MonkeyPatch.context() as mp:
        libs.offloaded_checkpoint(mp, "llamafactory")
        theirs = simulate(TINY, setup)
    assert _above_load(ours) == _above_load(theirs)  # a first build in a process keeps one more 1 KiB buffer


def _above_load(r) -> dict[str, int]:  # noqa: ANN001
    load = next(p.bytes for p in r.phases if p.key == "load")
    return {p.key: p.bytes - load for p in r.phases}


@pytest.mark.slow
def test_the_offloaded_checkpoint_on_a_vlm_under_zero2() -> None:
    _estimate_is_the_classes(OFFLOADED.replace(gpus=2, sharding="zero2"))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero3", "fsdp"])
def test_the_offloaded_checkpoint_on_a_vlm_under_zero3_fsdp(sharding: str) -> None:
    """The tower's and the decoder's units gathered again for the recompute (refused before): the estimate against
    the classes as on one GPU (its 1 %: 314,880 B short in backward here, as without sharding)."""
    _estimate_is_the_classes(OFFLOADED.replace(gpus=2, sharding=sharding))


def test_unsloths_checkpointing_on_a_vlm_on_several_gpus_is_refused_with_fastvisionmodels_reason() -> None:
    from vramlab.core.checks import SetupError

    with pytest.raises(SetupError, match="FastVisionModel on several GPUs"):
        estimate(QWEN25_VL, UNSLOTH.replace(gpus=2, sharding="zero2"))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "zero3"])
def test_activation_offloading_on_a_hand_written_vlm_traces_its_classes(sharding: str) -> None:
    """Activation offloading is estimated from a trace; on a hand-written family that trace built the text model
    alone (Qwen2.5-VL here: 74.8 MB short in forward, the tower's weights missing) instead of the family's
    classes."""
    setup = SETUP.replace(offload_activations=True, grad_ckpt=False, gpus=2 if sharding != "none" else 1,
                          sharding=sharding)
    est, sim = estimate(QWEN25_VL, setup, match_simulation=True), simulate(QWEN25_VL, setup)
    assert est.total_params == sim.total_params
    assert _above_load(est) == _above_load(sim)
