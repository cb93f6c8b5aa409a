"""Video frames per family, as transformers' own processor classes take them (issue 28).

* SmolVLM's and InternVL's processors take video: each frame is one tile written with the image token after the
  processor's text; the counts are held to the classes' own ``replace_video_token`` / ``_get_num_multimodal_tokens``
  (pure Python: their video processors, torchvision classes, are not needed for the count), and the traced step
  runs the model on that batch (the model refuses image tokens that disagree with the frames' features).
* Idefics3's, LLaVA-NeXT's and Mllama's processors take none: the refusal says so (held to the classes' attributes).
* A family counted by its processor class whose video cannot be counted (GLM-4V's): one line, never a traceback.

Skipped without transformers (and torch, peft and Pillow for the traced steps)."""

from __future__ import annotations

import types

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.vision import ProcessorSpec, VisionInput, vision_tokens

pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

SMOLVLM = ProcessorSpec("idefics3", patch_size=14, tile_size=384, tokens_per_tile=81, longest_edge=1536,
                        video_frame=384)
INTERNVL = ProcessorSpec("internvl", patch_size=14, tile_size=448, tokens_per_tile=256, max_tiles=12, cls_token=True)
SPECIALS = ("<F>", "<G>", "<I>", "<img>", "</img>")


def _split(prompt: str) -> int:
    """The prompt's tokens: the processor's markers one each, its text split on spaces and punctuation (the stand-in
    tokenizer's rule for a processor's plain text, core/tracing/vlm_processor.py)."""
    from tokenizers import pre_tokenizers

    n = 0
    for s in SPECIALS:
        n += prompt.count(s)
        prompt = prompt.replace(s, " ")
    split = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    return n + len(split.pre_tokenize_str(prompt))


@pytest.mark.parametrize("frames", [1, 7, 64])
def test_smolvlm_video_is_its_processors_prompt(frames, monkeypatch):
    from transformers.models.smolvlm import processing_smolvlm
    from transformers.video_utils import VideoMetadata

    monkeypatch.setattr(processing_smolvlm, "num2words", lambda n: "N")  # the spelled count: one word
    stub = types.SimpleNamespace(image_seq_len=SMOLVLM.tokens_per_tile, fake_image_token="<F>", image_token="<I>",
                                 global_image_token="<G>")
    meta = VideoMetadata(total_num_frames=frames, fps=24, frames_indices=list(range(frames)))
    prompt = processing_smolvlm.SmolVLMProcessor.replace_video_token(stub, {"video_metadata": [meta]}, 0)
    counted = processing_smolvlm.SmolVLMProcessor._get_num_multimodal_tokens(stub, video_sizes=[(frames, 720, 1280)])

    video = vision_tokens(SMOLVLM, VisionInput(frames=frames, width=1280, height=720)).video
    assert video is not None and video.tiles == frames == len(video.sequences)
    assert video.tiles * SMOLVLM.tokens_per_tile == counted["num_video_tokens"][0] == prompt.count("<I>")
    assert video.llm_tokens == _split(prompt)
    assert video.patches == frames * (SMOLVLM.video_frame // SMOLVLM.patch_size) ** 2


@pytest.mark.parametrize("frames", [1, 12])
def test_internvl_video_is_its_processors_prompt(frames):
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    stub = types.SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token="<I>",
                                 image_seq_length=INTERNVL.tokens_per_tile)
    prompt = InternVLProcessor.replace_video_token(stub, {"pixel_values_videos": [np.zeros((frames, 3))]}, 0)
    video = vision_tokens(INTERNVL, VisionInput(frames=frames)).video
    assert video is not None and video.tiles == frames
    assert video.llm_tokens == _split(prompt)


def test_smolvlm_takes_images_or_a_video_not_both():
    with pytest.raises(SetupError, match="images or a video"):
        vision_tokens(SMOLVLM, VisionInput(images=1, frames=4))


@pytest.mark.parametrize("spec,cls", [
    (ProcessorSpec("idefics3", patch_size=14, tile_size=364, tokens_per_tile=169, longest_edge=1456),
     "transformers.models.idefics3.processing_idefics3.Idefics3Processor"),
    (ProcessorSpec("llava_next", patch_size=14, tile_size=336, cls_token=True, grid_pinpoints=((336, 672),)),
     "transformers.models.llava_next.processing_llava_next.LlavaNextProcessor"),
    (ProcessorSpec("mllama", patch_size=14, tile_size=560, max_tiles=4, cls_token=True),
     "transformers.models.mllama.processing_mllama.MllamaProcessor"),
])
def test_a_processor_that_takes_no_video_is_refused_saying_so(spec, cls):
    import importlib

    module, name = cls.rsplit(".", 1)
    assert "video_processor" not in getattr(importlib.import_module(module), name).get_attributes()
    with pytest.raises(SetupError, match=rf"own processor \({name}\) takes no video"):
        vision_tokens(spec, VisionInput(frames=4))


def test_smolvlms_processor_takes_video():
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    assert "video_processor" in SmolVLMProcessor.get_attributes()


@pytest.mark.parametrize("family", ["smolvlm", "internvl"])
def test_a_traced_video_runs_the_model(family):
    """The traced step with frames: the model itself checks that the row's image tokens are the frames' features."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from tests.support.traced_vlm import tiny_configs
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup

    spec, _ = hf_config_to_spec(tiny_configs()[family], id=family, name=family)
    setup = TrainingSetup(method="lora", frames=3, seq_len=16, lora_rank=4, image_width=64, image_height=64)
    video = simulate(spec, setup, steps=1)
    assert video.peak_allocated_bytes > simulate(spec, setup.replace(frames=0), steps=1).peak_allocated_bytes


@pytest.mark.parametrize("family,images,reason", [
    # GLM-4V's video is counted (its chat template's <|begin_of_video|> written); beside images its model fails
    ("glm4v", 1, "not both"),
    ("mistral3", 0, r"own processor \(PixtralProcessor\) takes no video")])
def test_a_processor_familys_video_is_refused_in_one_line(family, images, reason):
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    from tests.support.traced_vlm import generic_configs
    from vramlab.core.sources.hf_config import hf_config_to_spec
    from vramlab.core.spec.training import TrainingSetup
    from vramlab.core.vision import token_counts

    spec, _ = hf_config_to_spec(generic_configs()[family], id=family, name=family)
    with pytest.raises(SetupError, match=reason) as e:
        token_counts(spec, TrainingSetup(method="lora", images=images, frames=4))
    assert "\n" not in str(e.value)
