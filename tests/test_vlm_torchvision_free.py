"""Processors that transformers ships for torchvision only, run without it (issue 28; core/tracing/tv_functions.py).

LFM2-VL's image processor and the video processors of Gemma 4 and Qwen3.5 are torchvision classes. Their own code
runs here on stand-ins of the torchvision functions they call; what the run counts is held to the same processor
class's own pure-Python count (``_get_num_multimodal_tokens``, which needs no pixels) at several sizes and frame
counts, and the traced step runs the model on the run's batch (the model checks the tokens against the features).
GLM-4V's processor tells a video from images only by the markers its chat template writes around it: they are
written around each placeholder as the template does (as Qwen-VL's around each image, which M-RoPE reads).

Skipped without transformers, torch and Pillow; with torchvision installed the real classes run instead."""

from __future__ import annotations

import json

import pytest

from vramlab.core.checks import SetupError

pytest.importorskip("transformers")
pytest.importorskip("torch")
pytest.importorskip("PIL")
try:
    import torchvision  # noqa: F401
except ModuleNotFoundError:  # the stand-ins run
    pass
except (ImportError, RuntimeError, OSError):  # PyPI's CUDA build over a CPU torch: transformers' tables fail too
    pytest.skip("torchvision is installed but does not load over this torch", allow_module_level=True)


def _lfm2_vl() -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "lfm2_vl", projector_hidden_size=64,
        text_config=dict(model_type="lfm2", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         layer_types=["conv", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)).to_dict()


def _llava_next_video() -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llava_next_video",
        text_config=dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, patch_size=14, image_size=224, projection_dim=32)).to_dict()


def _configs(family: str) -> dict:
    from tests.support.traced_vlm import generic_configs

    made = {"lfm2_vl": _lfm2_vl, "llava_next_video": _llava_next_video}
    return made[family]() if family in made else generic_configs()[family]


def _built(family: str):
    """The processor as run_processor builds it (stand-in tokenizer), with its config."""
    from vramlab.core.sources.traced_config import config_from_dict
    from vramlab.core.tracing import tv_functions
    from vramlab.core.tracing.vlm_processor import _processor, processor_classes

    cfg = config_from_dict(_configs(family))
    pcls, icls = processor_classes(cfg.model_type)
    vcls = tv_functions.video_class(cfg.model_type)
    with tv_functions.bound(icls, *([vcls] if vcls else [])):
        processor, _, _ = _processor(pcls, icls, vcls, cfg, {})
    return cfg, processor, (icls, vcls)


def _run(family: str, images: int, width: int, height: int, frames: int = 0):
    from vramlab.core.sources.traced_config import canonical_text, config_from_dict
    from vramlab.core.tracing.vlm_processor import run_processor

    return run_processor(canonical_text(config_from_dict(_configs(family))), images, width, height, frames)


@pytest.mark.parametrize("width,height", [(64, 48), (640, 480), (1920, 1080)])
def test_lfm2_vl_images_are_its_processors_count(width, height):
    """LFM2-VL (no Pillow image processor): the image's placeholders as its class counts them, per size."""
    from vramlab.core.tracing import tv_functions

    cfg, processor, classes = _built("lfm2_vl")
    with tv_functions.bound(*[c for c in classes if c]):
        counted = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
    run = _run("lfm2_vl", 1, width, height)
    assert run.row.count(cfg.image_token_id) == counted["num_image_tokens"][0]
    pixels = dict((n, s) for n, _, s, _, _ in run.inputs)["pixel_values"]
    assert pixels[0] == counted["num_image_patches"][0]  # its tiles (and thumbnail)


def test_lfm2_vls_step_runs_on_its_images():
    """LFM2-VL gathers its image features by a mask it builds from the processor's spatial_shapes and an arange
    (``features[is_token]``): its step is traced (it was refused, the mask's nonzero having no size under fake
    tensors), the model's own check holds the gathered features to the image tokens, and the images cost memory."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    spec, _ = hf_config_to_spec(_configs("lfm2_vl"), id="lfm2_vl", name="lfm2_vl")
    setup = TrainingSetup(method="lora", images=2, micro_batch=2, seq_len=16, lora_rank=4, image_width=640,
                          image_height=480)
    with_images = simulate(spec, setup, steps=1)
    assert with_images.peak_allocated_bytes > simulate(spec, setup.replace(images=0), steps=1).peak_allocated_bytes


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["frozen", "full"])
def test_lfm2_vls_estimate_moves_with_its_images_as_simulate_does(tune, tmp_path, monkeypatch):
    """The traced estimate of LFM2-VL's images against simulate --hf: what the images add is the same bytes (the
    language model alone differs by a constant 1 KiB between the two, images or not)."""
    pytest.importorskip("peft")
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = hf_config_to_spec(_configs("lfm2_vl"), id="lfm2_vl", name="lfm2_vl")
    setup = TrainingSetup(method="lora", vision_tuning=tune, images=2, micro_batch=2, seq_len=64, lora_rank=4,
                          image_width=640, image_height=480)
    est = [estimate(spec, s, match_simulation=True).peak_allocated_bytes for s in (setup, setup.replace(images=0))]
    sim = [simulate(spec, s).peak_allocated_bytes for s in (setup, setup.replace(images=0))]
    assert est[0] - est[1] == sim[0] - sim[1] > 0
    assert abs(est[0] - sim[0]) <= 1024


@pytest.mark.parametrize("family,frames,width,height", [
    ("qwen3_5", 2, 64, 64), ("qwen3_5", 5, 640, 360),
    pytest.param("qwen3_5", 16, 1280, 720, marks=pytest.mark.slow),
    ("gemma4", 1, 64, 48),
    pytest.param("gemma4", 6, 1280, 720, marks=pytest.mark.slow),
])
def test_video_is_its_processors_count(family, frames, width, height):
    """The video's placeholder tokens as the processor class itself counts them from the video's size."""
    from vramlab.core.tracing import tv_functions

    cfg, processor, classes = _built(family)
    with tv_functions.bound(*[c for c in classes if c]):
        counted = processor._get_num_multimodal_tokens(video_sizes=[(frames, height, width)])
    run = _run(family, 0, width, height, frames)
    assert run.row.count(cfg.video_token_id) == counted["num_video_tokens"][0] > 0
    assert run.video_tokens == len(run.row) and run.video_patches > 0


def test_images_and_a_video_split_their_tokens():
    both, images = _run("qwen3_5", 2, 320, 240, 4), _run("qwen3_5", 2, 320, 240)
    assert both.tokens_per_image == images.tokens_per_image
    assert both.video_tokens == len(both.row) - len(images.row) > 0


def test_a_traced_video_runs_the_model():
    """--frames on a family whose video processor is a torchvision class: the step runs (the model refuses
    video tokens that disagree with the frames' features) and the video costs memory."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.vision import token_counts

    spec, _ = hf_config_to_spec(_configs("gemma4"), id="gemma4", name="gemma4")
    setup = TrainingSetup(method="lora", frames=2, seq_len=16, lora_rank=4, image_width=64, image_height=64)
    counts = token_counts(spec, setup)
    assert counts["frames"] == 2 and counts["vision_tokens"] > 0
    video = simulate(spec, setup, steps=1)
    assert video.peak_allocated_bytes > simulate(spec, setup.replace(frames=0), steps=1).peak_allocated_bytes


@pytest.mark.slow
def test_llava_next_videos_video_runs_the_model():
    """LLaVA-NeXT-Video: its processor's patch_size and feature strategy are read from the config (its checkpoint's
    processor_config.json gives them too); the model checks the video tokens against the pooled frame features."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    spec, _ = hf_config_to_spec(_configs("llava_next_video"), id="v", name="v")
    setup = TrainingSetup(method="lora", frames=3, seq_len=16, lora_rank=4, image_width=64, image_height=48)
    assert simulate(spec, setup, steps=1).peak_allocated_bytes > \
        simulate(spec, setup.replace(frames=1), steps=1).peak_allocated_bytes


def test_the_checkpoints_video_processor_settings_are_read(tmp_path):
    """video_preprocessor_config.json (or processor_config.json's video_processor) sets the video processor, as
    from_pretrained does: a smaller pixel budget, fewer tokens."""
    from vramlab.core.sources.files import load_processor_files

    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 4096, "longest_edge": 65536}}))
    settings = load_processor_files(tmp_path)
    assert json.loads(settings)["video_processor"]["size"]["longest_edge"] == 65536
    from vramlab.core.sources.traced_config import canonical_text, config_from_dict
    from vramlab.core.tracing.vlm_processor import run_processor

    text = canonical_text(config_from_dict(_configs("qwen3_5")))
    assert 0 < run_processor(text, 0, 640, 480, 4, settings).video_tokens < _run("qwen3_5", 0, 640, 480, 4).video_tokens


def test_each_image_is_between_the_chat_templates_markers():
    """Qwen3.5's processor expands a bare <|image_pad|>; its chat template writes <|vision_start|> and
    <|vision_end|> around each image (the processor names them, the config gives their ids): each image's span is
    between them, so M-RoPE tells two images apart."""
    cfg = _built("qwen3_5")[0]
    run = _run("qwen3_5", 3, 64, 64)
    row = list(run.row)
    assert row.count(cfg.vision_start_token_id) == row.count(cfg.vision_end_token_id) == 3
    assert row[0] == cfg.vision_start_token_id and row[-1] == cfg.vision_end_token_id
    assert run.tokens_per_image == row.index(cfg.vision_end_token_id) + 1


def test_several_images_in_a_sample_run_the_model():
    """Qwen3.5 with two images in one sample: the step runs (it failed in get_rope_index, the adjacent images one
    span of twice the grid's positions) and the second image costs memory."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    spec, _ = hf_config_to_spec(_configs("qwen3_5"), id="qwen3_5", name="qwen3_5")
    setup = TrainingSetup(method="lora", images=2, seq_len=16, lora_rank=4, image_width=64, image_height=64)
    assert simulate(spec, setup, steps=1).peak_allocated_bytes > \
        simulate(spec, setup.replace(images=1), steps=1).peak_allocated_bytes


@pytest.mark.slow
def test_several_images_estimate_is_simulate_hf(tmp_path, monkeypatch):
    """The traced estimate of Qwen3.5 with two images in a sample (each between its markers) is simulate --hf's."""
    pytest.importorskip("peft")
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = hf_config_to_spec(_configs("qwen3_5"), id="qwen3_5", name="qwen3_5")
    setup = TrainingSetup(method="lora", images=2, image_width=300, image_height=200, micro_batch=3, seq_len=100,
                          lora_rank=16)
    assert estimate(spec, setup, match_simulation=True).peak_allocated_bytes == \
        simulate(spec, setup).peak_allocated_bytes


def test_glm4vs_video_is_its_chat_templates_span():
    """GLM-4V's processor tells a video from images only by the <|begin_of_video|> span its chat template writes
    (the processor looks the marker up; the config gives its id): the video is counted (it was refused)."""
    cfg = _built("glm4v")[0]
    run = _run("glm4v", 0, 64, 64, 4)
    assert run.video_tokens > 0 and run.row[0] == cfg.video_start_token_id and run.row[-1] == cfg.video_end_token_id


def test_glm4vs_images_beside_a_video_are_refused_in_one_line():
    """GLM-4V's model takes every image-token position for an image, its video's frames included: images and a
    video in one sample fail in the model itself; refused, with that reason."""
    with pytest.raises(SetupError, match="not both") as e:
        _run("glm4v", 1, 64, 64, 4)
    assert "\n" not in str(e.value)


def test_glm4vs_images_are_each_between_the_configs_markers():
    """GLM-4V's processor names no image markers; its config gives <|begin_of_image|> / <|end_of_image|> ids, which
    its chat template writes around each image: there, two images in one sample are two spans to its M-RoPE."""
    cfg = _built("glm4v")[0]
    row = list(_run("glm4v", 2, 64, 64).row)
    assert row.count(cfg.image_start_token_id) == row.count(cfg.image_end_token_id) == 2
    assert row[0] == cfg.image_start_token_id and row[-1] == cfg.image_end_token_id


@pytest.mark.slow
def test_glm4vs_video_runs_the_model():
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    spec, _ = hf_config_to_spec(_configs("glm4v"), id="glm4v", name="glm4v")
    setup = TrainingSetup(method="lora", frames=4, seq_len=16, lora_rank=4, image_width=64, image_height=64)
    assert simulate(spec, setup, steps=1).peak_allocated_bytes > \
        simulate(spec, setup.replace(frames=2), steps=1).peak_allocated_bytes


def test_a_video_processors_own_refusal_is_one_line():
    """Qwen3-VL's video processor takes no fewer frames than its temporal patch: its reason, in one line."""
    with pytest.raises(SetupError, match="temporal_factor") as e:
        _run("qwen3_5", 0, 64, 64, 1)
    assert "\n" not in str(e.value)


def test_the_stand_ins_leave_nothing_bound():
    from vramlab.core.tracing import tv_functions

    if tv_functions.installed():
        pytest.skip("torchvision is installed: transformers runs its classes on it")
    import transformers.image_processing_backends as backends

    from vramlab.core.tracing.vlm_processor import run_processor

    run_processor.cache_clear()  # (a cached answer runs no processor, and binds nothing to unbind)
    _run("qwen3_5", 0, 64, 64, 2)
    assert not hasattr(backends, "tvF") and backends.pil_torch_interpolation_mapping is None


def test_video_processor_names_are_transformers_own():
    from transformers.models.auto import video_processing_auto

    from vramlab.core.tracing import tv_functions

    names = tv_functions.video_processor_names()
    assert names["qwen3_5"] == "Qwen3VLVideoProcessor" and names["gemma4"] == "Gemma4VideoProcessor"
    if tv_functions.installed():  # the loaded table keeps its names: the same
        loaded = video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES
        assert all(loaded[t]["torchvision"] == n for t, n in names.items() if t in loaded)
