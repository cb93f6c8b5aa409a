"""Pixtral-12B (issue 28): a LLaVA wrapper (``model_type: llava``) around a Pixtral tower, which LLaVA's folder does
not model, is traced whole from LlavaForConditionalGeneration, and its images are what the installed PixtralProcessor
makes of them: the processor class its ``processor_config.json`` names, with that file's tokens and patch size and the
``preprocessor_config.json``'s longest edge (the class built as ``from_pretrained`` builds it, from those files as
data). Before, the config was read as its language model only and ``--images`` was refused.

Tiny configs written to a tmp folder in the shape of the released files (no network). Skipped without torch,
transformers, peft and Pillow."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("PIL")

from vramlab.core.sources.folder import load_model_source  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.vision import token_counts  # noqa: E402

IMAGE_TOKEN = 10  # mistral-community/pixtral-12b's image_token_index ("[IMG]")
# mistral-community/pixtral-12b's processor_config.json and preprocessor_config.json, the longest edge made small
# (its release says 1024) so that a test image is resized and the file's value shows
PROCESSOR = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
             "patch_size": 16, "processor_class": "PixtralProcessor"}
PREPROCESSOR = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "PixtralImageProcessor",
                "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": {"height": 16, "width": 16},
                "processor_class": "PixtralProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
                "size": {"longest_edge": 512}}


def _config() -> dict:
    from transformers import AutoConfig

    text = dict(model_type="mistral", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tower = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, head_dim=8, image_size=1024, patch_size=16)
    return AutoConfig.for_model("llava", text_config=text, vision_config=tower, image_token_index=IMAGE_TOKEN,
                                vision_feature_layer=-1, vision_feature_select_strategy="full",
                                projector_hidden_act="gelu").to_dict()


def _folder(tmp_path, files: bool = True):  # noqa: ANN001, ANN202
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    if files:
        (tmp_path / "processor_config.json").write_text(json.dumps(PROCESSOR))
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return load_model_source(tmp_path)


def _theirs(width: int, height: int, longest_edge: int) -> int:
    """The [IMG] tokens the installed PixtralProcessor says an image has (``_get_num_multimodal_tokens``, what vLLM
    reads), built from the files apart from the code under test."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    from vramlab.core.tracing.vlm_processor import _stand_in

    image_processor = PixtralImageProcessorPil.from_dict(dict(PREPROCESSOR, size={"longest_edge": longest_edge}))
    tokenizer = _stand_in()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    processor = PixtralProcessor(image_processor, tokenizer, patch_size=16)
    return processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0]


def test_pixtral_12b_is_traced_whole_with_the_classes_count(tmp_path):
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    model = _folder(tmp_path)
    spec = model.spec
    assert spec.vision is not None and spec.vision.traced and spec.vision.processor.kind == "processor"
    with torch.device("meta"):
        built = LlavaForConditionalGeneration._from_config(LlavaConfig.from_dict(_config()))
    assert spec.param_count == sum(p.numel() for p in built.parameters())
    assert 0 < spec.vision.tower_params() < spec.param_count
    assert not any("not counted" in w for w in model.warnings)


@pytest.mark.parametrize("size", [(100, 80), (640, 480), (333, 1000)])
def test_pixtral_images_are_the_installed_processors_count_under_its_files(tmp_path, size):
    """The [IMG] tokens are PixtralProcessor's own count under the checkpoint's files (the preprocessor's longest edge
    of 512, not the class default or the tower's 1024), and the [IMG_BREAK] / [IMG_END] markers it writes are in the
    sequence too."""
    from vramlab.core.tracing.vlm_processor import run_processor

    spec = _folder(tmp_path).spec
    setup = TrainingSetup(method="lora", images=2, image_width=size[0], image_height=size[1], seq_len=16)
    counts = token_counts(spec, setup)
    p = spec.vision.processor
    run = run_processor(p.config, 2, *size, 0, p.settings)
    assert run.processor == "PixtralProcessor"
    assert run.row.count(IMAGE_TOKEN) == 2 * _theirs(*size, longest_edge=512)
    assert counts["vision_tokens"] == len(run.row) > run.row.count(IMAGE_TOKEN)
    assert counts["sequence"] == 16 + len(run.row)


def test_without_its_processor_files_the_towers_image_size_is_the_longest_edge(tmp_path):
    """A config.json alone: Pixtral's processor still makes the images (not LLaVA's CLIP processor), the tower's
    image_size (1024 in the release) its longest edge."""
    spec = _folder(tmp_path, files=False).spec
    assert spec.vision.processor.settings == ""
    setup = TrainingSetup(method="lora", images=1, image_width=2000, image_height=1500, seq_len=16)
    counts = token_counts(spec, setup)
    assert counts["vision_tokens"] > _theirs(2000, 1500, longest_edge=1024) > _theirs(2000, 1500, longest_edge=512)


@pytest.mark.slow  # about 30 s of tracing; Mistral 3's case (tests/test_vlm_any.py) holds the Pixtral tower by default
def test_pixtral_12b_traced_estimate_is_simulate_hf_of_its_images(tmp_path, monkeypatch):
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.kinds import Kind
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path / "store"))
    (tmp_path / "model").mkdir()
    spec = _folder(tmp_path / "model").spec
    setup = TrainingSetup(method="lora", vision_tuning="lora", images=1, image_width=300, image_height=200,
                          micro_batch=2, seq_len=64, lora_rank=8)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert est.source.startswith("traced")
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert sim.components.get(Kind.VISION_ACTIVATIONS, 0) > 0


def test_a_hub_models_processor_files_in_the_cache_are_read(tmp_path, monkeypatch):
    """A Hub id read by its config and headers (no weights downloaded): the processor files already in the local
    cache (as transformers' AutoProcessor leaves them) are read too, with no request of their own."""
    import os

    from huggingface_hub import hf_hub_download

    from tests.support.hub_server import Repo, serve_hub
    from vramlab.core.sources.hub import load_hub_model

    files = {"config.json": _config(), "processor_config.json": PROCESSOR, "preprocessor_config.json": PREPROCESSOR}
    for hub in serve_hub(tmp_path, monkeypatch):
        hub.repos["acme/pixtral"] = Repo({k: json.dumps(v).encode() for k, v in files.items()}, "c" * 40)
        for name in files:
            hf_hub_download("acme/pixtral", name, cache_dir=tmp_path / "hf" / "hub", endpoint=os.environ["HF_ENDPOINT"])
        asked = len([r for r in hub.log if "processor" in r.filename])
        spec = load_hub_model("acme/pixtral").imported.spec
        assert json.loads(spec.vision.processor.settings)["image_processor"]["size"] == {"longest_edge": 512}
        assert len([r for r in hub.log if "processor" in r.filename]) == asked  # no request of their own


def test_a_processor_file_that_is_not_an_object_is_left_out_with_a_warning(tmp_path):
    """User files are data: a processor_config.json that is not a JSON object does not stop the import (the files
    matter only where a processor class counts the images); the warning names the file."""
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    (tmp_path / "processor_config.json").write_text("[1, 2]")
    model = load_model_source(tmp_path)
    assert model.spec.vision is not None and model.spec.vision.processor.settings == ""
    assert any("processor_config.json" in w and "not read" in w for w in model.warnings)
