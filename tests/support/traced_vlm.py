"""Small configs of the vision-language families traced whole (core/tracing/vlm_traced.py), in the shape their
released config.json has (model_type, text_config, vision_config, the token ids and the projector's keys), at
tiny widths; and the processor's own token counts of an image, from transformers' image processors."""

from __future__ import annotations

from typing import Any

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}


def tiny_configs() -> dict[str, dict[str, Any]]:
    """One config per traced family (SmolVLM, Idefics3, InternVL, Qwen2-VL, Qwen3-VL, LLaVA-NeXT)."""
    siglip = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, patch_size=16,
                  image_size=64)
    return {
        "smolvlm": dict(model_type="smolvlm", image_token_id=500, scale_factor=2,
                        text_config=dict(model_type="llama", **TEXT), vision_config=siglip),
        "idefics3": dict(model_type="idefics3", image_token_id=500, scale_factor=2,
                         text_config=dict(model_type="llama", **TEXT), vision_config=siglip),
        "internvl": dict(model_type="internvl", image_token_id=500, downsample_ratio=0.5,
                         text_config=dict(model_type="qwen2", **TEXT),
                         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, patch_size=[14, 14], image_size=[56, 56])),
        "qwen2_vl": dict(model_type="qwen2_vl", image_token_id=500, video_token_id=501, vision_start_token_id=502,
                         text_config=dict(model_type="qwen2_vl_text", **TEXT, rope_parameters=_MROPE),
                         vision_config=dict(depth=3, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2)),
        "qwen3_vl": dict(model_type="qwen3_vl", image_token_id=500, video_token_id=501, vision_start_token_id=502,
                         text_config=dict(model_type="qwen3_vl_text", **TEXT, head_dim=16,
                                          rope_parameters={**_MROPE, "mrope_interleaved": True}),
                         vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4,
                                            patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                            out_hidden_size=64, num_position_embeddings=64,
                                            deepstack_visual_indexes=[1, 2])),
        "llava_next": dict(model_type="llava_next", image_token_index=500,
                           image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
                           text_config=dict(model_type="llama", **TEXT),
                           vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=3, num_attention_heads=4, patch_size=14,
                                              image_size=28, projection_dim=32)),
    }


def processor_tokens(proc: Any, width: int, height: int) -> tuple[int, int]:
    """(language tokens, tower tiles or patches) that transformers' own image processor makes of one image
    of this size under ``proc``'s settings (a core.vision.ProcessorSpec); needs Pillow and transformers."""
    import numpy as np

    image = np.zeros((height, width, 3), dtype=np.uint8)
    if proc.kind == "qwen_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        ip = Qwen2VLImageProcessorPil(patch_size=proc.patch_size, merge_size=proc.merge_size,
                                      temporal_patch_size=proc.temporal_patch_size,
                                      size={"shortest_edge": proc.min_pixels, "longest_edge": proc.max_pixels})
        out = ip(images=[image], return_tensors="np")
        return int(out["image_grid_thw"].prod(-1).sum()) // proc.merge_size ** 2, int(out["pixel_values"].shape[0])
    if proc.kind == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        ip = Idefics3ImageProcessorPil(size={"longest_edge": proc.longest_edge},
                                       max_image_size={"longest_edge": proc.tile_size})
        out = ip(images=[[image]], return_tensors="np", return_row_col_info=True)
        prompt = get_image_prompt_string(out["rows"][0][0], out["cols"][0][0], proc.tokens_per_tile,
                                         fake_token_around_image="<F>", image_token="<I>", global_image_token="<G>")
        tokens = sum(prompt.count(t) for t in ("<F>", "<I>", "<G>", "<row_", "\n"))
        return tokens, int(out["pixel_values"].shape[1])
    if proc.kind == "internvl":
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        ip = GotOcr2ImageProcessorPil(size={"height": proc.tile_size, "width": proc.tile_size}, crop_to_patches=True,
                                      max_patches=proc.max_tiles)
        out = ip(images=[image], return_tensors="np")
        tiles = int(out["num_patches"][0])
        return 2 + proc.tokens_per_tile * tiles, tiles  # InternVLProcessor: <img> + tokens per tile + </img>
    raise ValueError(proc.kind)


def generic_configs() -> dict[str, dict[str, Any]]:
    """Families with no processor rules of their own (Gemma 4, Qwen3.5, GLM-4V, Mistral 3): tiny configs made by
    transformers' own config classes, the tower's patch and pooling sizes left to the class (the processor's defaults
    match them)."""
    from transformers import AutoConfig

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    made = {
        "gemma4": AutoConfig.for_model(
            "gemma4", text_config=dict(text, global_head_dim=16, num_global_key_value_heads=2,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                       vocab_size_per_layer_input=512, hidden_size_per_layer_input=8),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=4, head_dim=8)),
        "qwen3_5": AutoConfig.for_model(
            "qwen3_5", text_config=dict(text, layer_types=["linear_attention", "linear_attention", "full_attention"],
                                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                        linear_value_head_dim=8),
            vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                               num_position_embeddings=64)),
        "glm4v": AutoConfig.for_model(
            "glm4v", text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64)),
        # Mistral Small 3.1 / Magistral: a Pixtral tower; its processor's module imports a function from Pixtral's
        # torchvision image processor module (read from the Pillow one where torchvision is absent)
        "mistral3": AutoConfig.for_model(
            "mistral3", text_config=dict(text, model_type="mistral"),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               head_dim=8)),
    }
    return {k: c.to_dict() for k, c in made.items()}
