"""Vision tokens (core/vision.py) equal what transformers' own image processors make of the same image.

The processors run on the CPU with Pillow (their PIL backends); without Pillow or transformers these tests
skip, and the arithmetic is still held by the rules below that need neither."""

from __future__ import annotations

import types

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.vision import ProcessorSpec, VisionInput, vision_tokens

np = pytest.importorskip("numpy")

SIZES = [(448, 448), (640, 480), (1280, 720), (333, 1000), (2048, 1536), (100, 60), (3000, 400)]

QWEN25 = ProcessorSpec("qwen_vl", patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136,
                       max_pixels=12845056)
QWEN3 = ProcessorSpec("qwen_vl", patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=65536,
                      max_pixels=16777216)
LLAVA_NEXT = ProcessorSpec("llava_next", patch_size=14, tile_size=336, cls_token=True,
                           grid_pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)))
SMOLVLM = ProcessorSpec("idefics3", patch_size=14, tile_size=384, tokens_per_tile=81, longest_edge=1536)
INTERNVL = ProcessorSpec("internvl", patch_size=14, tile_size=448, tokens_per_tile=256, max_tiles=12, cls_token=True)
MLLAMA = ProcessorSpec("mllama", patch_size=14, tile_size=560, max_tiles=4, cls_token=True)


def _processors():
    pytest.importorskip("PIL")
    return pytest.importorskip("transformers")


def _image(w: int, h: int):
    return np.zeros((h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("w,h", SIZES)
@pytest.mark.parametrize("proc,max_pixels", [(QWEN25, 0), (QWEN25, 1003520), (QWEN3, 0), (QWEN3, 262144)])
def test_qwen_vl_grid_is_the_image_processors(w, h, proc, max_pixels):
    tf = _processors()
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ip = Qwen2VLImageProcessorPil(patch_size=proc.patch_size, merge_size=proc.merge_size,
                                  temporal_patch_size=proc.temporal_patch_size,
                                  size={"shortest_edge": proc.min_pixels,
                                        "longest_edge": max_pixels or proc.max_pixels})
    assert tf is not None
    out = ip(images=[_image(w, h)] * 2, return_tensors="np")
    ours = vision_tokens(proc, VisionInput(images=2, width=w, height=h, max_pixels=max_pixels))
    assert [list(u.grid) for u in ours.units] == out["image_grid_thw"].tolist()
    assert ours.patches == out["pixel_values"].shape[0]
    merge = proc.merge_size ** 2
    assert ours.llm_tokens == int(out["image_grid_thw"].prod(-1).sum()) // merge


@pytest.mark.parametrize("w,h", SIZES)
def test_llava_next_tiles_and_tokens_are_the_processors(w, h):
    _processors()
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    pins = [list(p) for p in LLAVA_NEXT.grid_pinpoints]
    ip = LlavaNextImageProcessorPil(image_grid_pinpoints=pins, size={"shortest_edge": 336},
                                    crop_size={"height": 336, "width": 336})
    out = ip(images=[_image(w, h)], return_tensors="np")
    ours = vision_tokens(LLAVA_NEXT, VisionInput(images=1, width=w, height=h)).units[0]
    assert ours.tiles == out["pixel_values"].shape[1]
    # the processor's own token arithmetic, run on a stand-in holding the settings it reads
    stub = types.SimpleNamespace(image_processor=types.SimpleNamespace(image_grid_pinpoints=pins), patch_size=14,
                                 num_additional_image_tokens=0)
    stub._get_unpadded_features = types.MethodType(LlavaNextProcessor._get_unpadded_features, stub)
    expected = LlavaNextProcessor._get_number_of_features(stub, h, w, 336, 336)
    assert ours.llm_tokens == expected


@pytest.mark.parametrize("w,h", SIZES)
def test_smolvlm_tiles_and_prompt_are_the_processors(w, h):
    _processors()
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    ip = Idefics3ImageProcessorPil(size={"longest_edge": SMOLVLM.longest_edge},
                                   max_image_size={"longest_edge": SMOLVLM.tile_size})
    out = ip(images=[[_image(w, h)]], return_tensors="np", return_row_col_info=True)
    ours = vision_tokens(SMOLVLM, VisionInput(images=1, width=w, height=h)).units[0]
    assert ours.tiles == out["pixel_values"].shape[1]
    prompt = get_image_prompt_string(out["rows"][0][0], out["cols"][0][0], SMOLVLM.tokens_per_tile,
                                     fake_token_around_image="<F>", image_token="<I>", global_image_token="<G>")
    tokens = prompt.count("<F>") + prompt.count("<I>") + prompt.count("<G>") + prompt.count("<row_") \
        + prompt.count("\n")
    assert ours.llm_tokens == tokens


@pytest.mark.parametrize("w,h", SIZES)
def test_internvl_tiles_are_the_processors(w, h):
    _processors()
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    ip = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True, max_patches=12)
    out = ip(images=[_image(w, h)], return_tensors="np")
    ours = vision_tokens(INTERNVL, VisionInput(images=1, width=w, height=h)).units[0]
    assert ours.tiles == out["pixel_values"].shape[0] == int(out["num_patches"][0])
    assert ours.llm_tokens == 2 + 256 * ours.tiles


@pytest.mark.parametrize("w,h", SIZES)
def test_mllama_tiles_are_the_processors(w, h):
    _processors()
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    ip = MllamaImageProcessorPil(size={"height": 560, "width": 560}, max_image_tiles=4)
    out = ip(images=[[_image(w, h)]], return_tensors="np")
    ours = vision_tokens(MLLAMA, VisionInput(images=1, width=w, height=h)).units[0]
    assert ours.tiles == int(out["num_tiles"][0][0])
    # the tower always sees max_image_tiles tiles (the processor pads pixel_values to them)
    assert out["pixel_values"].shape[2] == MLLAMA.max_tiles
    assert ours.llm_tokens == 1 and ours.cross_tokens == 4 * (40 * 40 + 1)


def test_gemma3_images_are_one_896_tile_of_256_tokens():
    _processors()
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    p = ProcessorSpec("siglip_fixed", patch_size=14, tile_size=896, tokens_per_tile=256)
    ip = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    for w, h in SIZES[:3]:
        out = ip(images=[_image(w, h)], return_tensors="np")
        ours = vision_tokens(p, VisionInput(images=1, width=w, height=h))
        assert out["pixel_values"].shape == (1, 3, 896, 896)
        assert ours.units[0].sequences == (64 * 64,) and ours.llm_tokens == 256


# ---- rules that need no processor --------------------------------------------------------------------------------

def test_qwen_video_pads_frames_to_the_temporal_patch():
    odd = vision_tokens(QWEN25, VisionInput(frames=5, width=640, height=360)).video
    even = vision_tokens(QWEN25, VisionInput(frames=6, width=640, height=360)).video
    assert odd.grid[0] == even.grid[0] == 3
    assert odd.llm_tokens == even.llm_tokens


def test_lower_max_pixels_gives_fewer_tokens():
    big = vision_tokens(QWEN25, VisionInput(images=1, width=2048, height=1536))
    small = vision_tokens(QWEN25, VisionInput(images=1, width=2048, height=1536, max_pixels=401408))
    assert small.llm_tokens <= 401408 // (28 * 28) < big.llm_tokens


def test_absurd_inputs_are_refused_with_the_bound():
    with pytest.raises(SetupError, match="image width"):
        VisionInput(images=1, width=0, height=10)
    with pytest.raises(SetupError, match="aspect ratio"):
        VisionInput(images=1, width=30000, height=100)
    with pytest.raises(SetupError, match="Qwen-VL"):
        vision_tokens(MLLAMA, VisionInput(images=1, max_pixels=10000))
    with pytest.raises(SetupError, match="video"):
        vision_tokens(MLLAMA, VisionInput(frames=4))
