"""Any image-text-to-text family transformers ships, without processor rules of its own (issue 28): a Gemma 4,
Qwen3.5, GLM-4V or Mistral 3 config imports whole (tower and projector counted by transformers' class), its images
are what the installed processor class makes of them (held to the processor's own ``_get_num_multimodal_tokens``), and
``simulate --hf`` runs transformers' class on that batch (the model refuses a batch whose image tokens and
features disagree). Before, these configs were imported as their language model only and ``--images`` refused.

Tiny configs made by transformers' config classes (tests/support/traced_vlm.py). Skipped without torch,
transformers, peft and Pillow."""

from __future__ import annotations

import inspect
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("PIL")

from tests.support.traced_vlm import generic_configs  # noqa: E402
from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.kinds import Kind  # noqa: E402
from vramlab.core.sources.hf_config import hf_config_to_spec  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.vision import token_counts  # noqa: E402

FAMILIES = ("gemma4", "qwen3_5", "glm4v", "mistral3")


def _spec(family: str):
    return hf_config_to_spec(generic_configs()[family], id=family, name=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_multimodal_config_imports_whole_with_the_classes_count(family):
    import torch
    from transformers import CONFIG_MAPPING

    from vramlab.core.tracing.vlm_traced import transformers_class

    spec, warnings = _spec(family)
    cfg = dict(generic_configs()[family])
    config = CONFIG_MAPPING[cfg.pop("model_type")].from_dict(cfg)
    with torch.device("meta"):
        model = transformers_class(config)._from_config(config)
    assert spec.vision is not None and spec.vision.traced and spec.vision.processor.kind == "processor"
    assert spec.param_count == sum(p.numel() for p in model.parameters())
    assert 0 < spec.vision.projector_params() and 0 < spec.vision.tower_params() < spec.param_count
    assert not any("not counted" in w for w in warnings)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", [(100, 80), (640, 480), (333, 1000)])
def test_image_tokens_are_the_processors_own_count(family, size):
    from vramlab.core.tracing.vlm_processor import processor_classes, run_processor

    spec, _ = _spec(family)
    setup = TrainingSetup(method="lora", images=2, image_width=size[0], image_height=size[1], seq_len=16)
    counts = token_counts(spec, setup)
    run = run_processor(spec.vision.processor.config, 2, *size)
    # the processor's own per-image count (the one vLLM reads), from a processor built apart from ours
    pcls, icls = processor_classes(family)
    from vramlab.core.tracing.vlm_processor import _image_processor, _modalities_left_out, _stand_in
    from vramlab.core.tracing.vlm_traced import config_from_json

    cfg = config_from_json(spec.vision.processor.config)
    args = {a: _stand_in() if a == "tokenizer" else _image_processor(icls, cfg) if a == "image_processor" else None
            for a in pcls.get_attributes()}
    # the sizes a processor takes itself (Pixtral's patch and merge) from the config (a checkpoint's
    # processor_config.json names the tower's)
    takes = inspect.signature(pcls.__init__).parameters
    sizes = {k: getattr(cfg, k, None) or getattr(cfg.vision_config, k, None)
             for k in ("patch_size", "spatial_merge_size") if k in takes}
    with _modalities_left_out():
        processor = pcls(**args, **sizes)
    theirs = processor._get_num_multimodal_tokens(image_sizes=[(size[1], size[0])]).num_image_tokens[0]
    config = json.loads(spec.vision.processor.config)
    image_id = config.get("image_token_id", config.get("image_token_index"))
    assert run.row.count(image_id) == 2 * theirs  # the image's soft tokens, where the model puts its features
    # and the markers the processor writes around them (Gemma 4's begin / end of image)
    assert counts["vision_tokens"] == len(run.row) >= 2 * theirs
    assert counts["sequence"] == 16 + len(run.row)


@pytest.mark.parametrize("family,tune", [("gemma4", "frozen"), ("qwen3_5", "lora"), ("glm4v", "full"),
                                         ("mistral3", "frozen")])
def test_simulate_hf_runs_the_class_on_the_processors_batch(family, tune):
    from vramlab.core.simulation.simulate import simulate

    spec, _ = _spec(family)
    setup = TrainingSetup(method="lora", vision_tuning=tune, images=1, image_width=100, image_height=80, seq_len=16,
                          lora_rank=4)
    result = simulate(spec, setup, steps=1)
    forward = next(p for p in result.phases if p.key == "forward@1")
    assert forward.components.get(Kind.VISION_ACTIVATIONS, 0) > 0
    assert forward.components.get(Kind.VISION_WEIGHTS, 0) > 0
    no_images = simulate(spec, setup.replace(images=0), steps=1)
    assert result.peak_allocated_bytes > no_images.peak_allocated_bytes


def test_video_is_counted_for_a_processor_family():
    """Qwen3.5's video processor, a torchvision class, runs here (tests/test_vlm_torchvision_free.py holds it)."""
    spec, _ = _spec("qwen3_5")
    counts = token_counts(spec, TrainingSetup(method="lora", frames=4))
    assert counts["frames"] == 4 and counts["vision_tokens"] > 0


def test_a_family_with_a_torchvision_only_image_processor_is_traced_whole():
    """LFM2-VL's image processor is a torchvision class: it runs here with or without torchvision, so the config is
    traced whole, its images counted by that class (it was its language model only, with a warning)."""
    from transformers import AutoConfig

    spec, _ = hf_config_to_spec(AutoConfig.for_model("lfm2_vl").to_dict(), id="l", name="l")
    assert spec.vision is not None and spec.vision.processor.kind == "processor"
    assert token_counts(spec, TrainingSetup(method="lora", images=1))["vision_tokens"] > 0


def test_image_processors_that_do_not_import_are_a_reason_not_a_traceback(monkeypatch):
    """PyPI's torchvision (built for CUDA's torch) over a CPU-only torch fails to import ("operator torchvision::nms
    does not exist"), and transformers' image processor table with it: the family's images are refused with that
    reason and what to install, in one line (it was a traceback)."""
    import sys

    from vramlab.core.sources.traced_vlm import processor_problem
    from vramlab.core.tracing.vlm_processor import processor_classes

    processor_classes.cache_clear()
    from transformers.models import auto

    monkeypatch.setitem(sys.modules, "transformers.models.auto.image_processing_auto", None)  # its import fails
    monkeypatch.delattr(auto, "image_processing_auto", raising=False)
    try:
        problem = processor_problem("gemma4")
    finally:
        processor_classes.cache_clear()
    assert problem is not None and "do not import here" in problem and "download.pytorch.org/whl/cpu" in problem


@pytest.mark.slow
@pytest.mark.parametrize("family,tune", [
    ("gemma4", "frozen"), ("glm4v", "full"),
    # the trace fits within one 64-token chunk of Qwen3.5's gated delta rule (core/traced.py piece): it was -11 %
    # at 208 tokens when the fit spanned chunks
    ("qwen3_5", "lora"), ("mistral3", "lora"),
])
def test_traced_estimate_is_simulate_hf_of_the_same_images(family, tune, tmp_path, monkeypatch):
    _traced_against_simulated(family, tune, "lora", tmp_path, monkeypatch)


def _traced_against_simulated(family: str, tune: str, method: str, tmp_path, monkeypatch):  # noqa: ANN001, ANN202
    """The traced estimate of ``family`` with one 300 x 200 image against ``simulate`` of the same setup."""
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = _spec(family)
    setup = TrainingSetup(method=method, vision_tuning=tune, images=1, image_width=300, image_height=200,
                          micro_batch=3, seq_len=100, lora_rank=16)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    return spec, setup, sim


def test_dpo_on_a_traced_family_is_simulate_hf_of_its_preference_batch(tmp_path, monkeypatch):
    """DPO on a VLM traced whole (refused before: "not modelled yet"): the trace records TRL's step on the class,
    chosen and rejected rows each with the prompt's image, and the estimate equals ``simulate`` of it."""
    _preference_against_simulated("gemma4", "dpo", tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("family,objective", [
    ("gemma4", "kto"), ("glm4v", "dpo"), ("glm4v", "kto"), ("mistral3", "dpo"), ("mistral3", "kto"),
    # linear attention: the fit keeps to one 64-token chunk and to the length's parity (the completion is half it)
    ("qwen3_5", "dpo"), ("qwen3_5", "kto"),
])
def test_a_preference_objective_on_a_traced_family_is_simulate_hf(family, objective, tmp_path, monkeypatch):
    _preference_against_simulated(family, objective, tmp_path, monkeypatch)


def _preference_against_simulated(family: str, objective: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The traced estimate of ``objective`` on ``family`` with one 300 x 200 image, a frozen tower and LoRA against
    ``simulate`` of the same setup (within the 1 KiB buffer the first class built in a process holds more)."""
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = _spec(family)
    setup = TrainingSetup(method="lora", vision_tuning="frozen", objective=objective, images=1, image_width=300,
                          image_height=200, micro_batch=2, seq_len=64, lora_rank=8)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert est.source.startswith("traced")
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= 1024
    assert est.peak_phase == sim.peak_phase


def test_a_processor_family_rebuilt_from_its_dict_is_counted_once_the_trace_attaches_its_run():
    """core.vision never imports the tracing layer: the run comes with the spec the reader made; a spec rebuilt
    from its dict (a child process's) says so in one line until the trace's build attaches the run again."""
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.tracing.vlm_processor import attached

    spec, _ = _spec("gemma4")
    setup = TrainingSetup(method="lora", images=1, image_width=640, image_height=480, seq_len=16)
    rebuilt = ModelSpec.from_dict(spec.to_dict())
    assert rebuilt == spec and "run" not in spec.to_dict()["vision"]["processor"]
    with pytest.raises(SetupError, match="counted by its own processor class"):
        token_counts(rebuilt, setup)
    assert token_counts(attached(rebuilt), setup) == token_counts(spec, setup)


@pytest.mark.slow
@pytest.mark.parametrize("family,tune", [("gemma4", "frozen"), ("qwen3_5", "lora")])
def test_qlora_on_a_processor_family_is_simulate_hf_of_its_quantized_load(family, tune, tmp_path, monkeypatch):
    """QLoRA on Gemma 4 and Qwen3.5 traced whole (refused before: "not emulated yet"): the estimate equals the
    class loaded as bitsandbytes stores it. Gemma 4's tower casts its pixels to ``input_proj.weight.dtype`` only
    when that is a float type, and a quantized weight is not (bitsandbytes' uint8 storage), so its tower runs in
    fp32 under QLoRA: more vision activations than LoRA on a bf16 base, as in the user's run."""
    from vramlab.core.simulation.simulate import simulate

    spec, setup, sim = _traced_against_simulated(family, tune, "qlora", tmp_path, monkeypatch)
    lora = simulate(spec, setup.replace(method="lora", weights="bf16"))
    assert sim.components[Kind.WEIGHTS] < lora.components[Kind.WEIGHTS]
    fp32_tower = sim.components[Kind.VISION_ACTIVATIONS] > 1.5 * lora.components[Kind.VISION_ACTIVATIONS]
    assert fp32_tower == (family == "gemma4")


def test_pixtral_images_fill_the_towers_longest_edge():
    """Mistral Small 3.1's tower takes 1540-pixel images (its preprocessor_config.json's longest edge, beside the
    class default of 1024): a larger image is resized to 1540 on its long side, not 1024."""
    from vramlab.core.tracing.vlm_processor import run_processor

    cfg = dict(generic_configs()["mistral3"])
    cfg["vision_config"] = dict(cfg["vision_config"], image_size=1540, patch_size=14)
    pixels = dict((n, s) for n, _k, s, _v, _d in run_processor(json.dumps(cfg), 1, 2000, 1500).inputs)["pixel_values"]
    assert max(pixels[-2:]) == 1540


def _onevision(**kw) -> dict:  # noqa: ANN003
    """A tiny LLaVA-OneVision config.json: a SigLIP tower at the released 384 px and patch 14 (27 x 27 positions)."""
    from transformers import AutoConfig

    text = dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    tower = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, image_size=384, patch_size=14)
    return AutoConfig.for_model("llava_onevision", text_config=text, vision_config=tower, image_token_index=500,
                                video_token_index=501, **kw).to_dict()


@pytest.mark.parametrize(("size", "pinpoints"), [((640, 480), None), ((1200, 380), [[384, 384], [384, 768], [768, 384],
                                                                                    [768, 768]])],
                         ids=["released-pinpoints", "the-configs-own-pinpoints"])
def test_llava_onevision_from_a_bare_config_json_runs_its_processors_defaults(size, pinpoints):
    """A folder with only config.json: LlavaOnevisionProcessor is built from transformers' defaults (its
    num_image_tokens, left None by the class for processor_config.json, is the tower's positions per tile; the image
    processor's pinpoints are the config's, by which the model unpads its features) and the note says so. It was read
    as its language model only ("must be real number, not NoneType"); with the class default pinpoints against a
    config of its own, transformers' model refuses the batch ("Image features and image tokens do not match")."""
    from vramlab.core.simulation.simulate import simulate

    spec, warnings = hf_config_to_spec(_onevision(**({"image_grid_pinpoints": pinpoints} if pinpoints else {})),
                                       id="ov", name="ov")
    assert spec.vision is not None and spec.vision.processor.kind == "processor"
    assert any("LlavaOnevisionProcessor's settings are transformers' defaults" in w and "729 positions" in w
               for w in warnings)
    setup = TrainingSetup(method="lora", images=1, image_width=size[0], image_height=size[1], seq_len=16, lora_rank=4)
    # the tower's crops per image as the model splits its pixels (it reported 1: the batch dimension was read)
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    pins = pinpoints or _config_pinpoints(spec)
    assert token_counts(spec, setup)["tower_patches"] == image_size_to_num_patches((size[1], size[0]), pins, 384)
    result = simulate(spec, setup, steps=1)  # transformers' class takes the batch only where tokens and features agree
    forward = next(p for p in result.phases if p.key == "forward@1")
    assert forward.components.get(Kind.VISION_ACTIVATIONS, 0) > 0


def test_a_checkpoints_processor_files_are_no_defaults():
    """With the checkpoint's processor files read (a Hub id, a full folder) the note about defaults is not made."""
    files = json.dumps({"processor": {"num_image_tokens": 729, "vision_feature_select_strategy": "full"}})
    _, warnings = hf_config_to_spec(_onevision(), id="ov", name="ov", processor=files)
    assert not any("transformers' defaults" in w or "positions per tile" in w for w in warnings)
    _, bare = _spec("mistral3")
    assert any("PixtralProcessor's settings are transformers' defaults" in w for w in bare)


def _config_pinpoints(spec) -> list:  # noqa: ANN001
    return json.loads(spec.vision.processor.config)["image_grid_pinpoints"]
