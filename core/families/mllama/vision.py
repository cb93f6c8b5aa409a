"""Llama 3.2 Vision (transformers' ``mllama``): the numbers of its vision side, in pure Python.

The model is the cross-attention shape of a vision-language model. The tower (``MllamaVisionModel``) cuts an
image into up to ``max_tiles`` tiles of ``image_size`` pixels (the processor pads every image to
``max_tiles`` tiles), embeds each tile's patches with a Conv2d, adds gated aspect-ratio tile embeddings, a CLS
position and gated position embeddings, pads each tile's ``(image_size / patch_size)² + 1`` positions to a
multiple of 8 and runs a local encoder of ``depth`` layers and a gated global encoder of ``global_depth``
layers over all tiles of an image at once. The last state and the local layers listed in
``intermediate_layers`` are concatenated (``hidden_size x (1 + len(intermediate_layers))`` features per
position) and projected by one Linear to the text width. The language model gets one ``<|image|>`` token
per image; its layers listed in ``cross_attention_layers`` are gated cross-attention layers whose keys and
values come from the projected states of every tile's positions (the padding removed).

Parameter counts here are held to transformers' ``MllamaForConditionalGeneration`` on the meta device.
"""

from __future__ import annotations

from typing import Any

from vramlab.core.checks import SetupError


def check_mllama_vision(v: Any) -> None:
    """The mllama fields of a VisionSpec: refused with a reason when they cannot describe the tower."""
    from vramlab.core.checks import check_int

    p = v.processor
    if p.kind != "mllama":
        raise SetupError(f"an mllama tower needs the mllama image processor (got {p.kind!r})")
    check_int("image_size", v.image_size, v.patch_size, 32_768, "vision image_size")
    if v.image_size % v.patch_size:
        raise SetupError(f"vision image_size {v.image_size} is not a multiple of patch_size {v.patch_size}")
    if p.tile_size != v.image_size or p.patch_size != v.patch_size:
        raise SetupError(f"the processor's tile {p.tile_size} px / patch {p.patch_size} must be the tower's "
                         f"image_size {v.image_size} / patch_size {v.patch_size}")
    check_int("max_tiles", p.max_tiles, 1, 64, "max_num_tiles")
    check_int("global_depth", v.global_depth, 0, 256, "vision num_global_layers")
    check_int("aspect_ratios", v.aspect_ratios, 1, 4096, "supported aspect ratios")
    if not v.intermediate_layers:
        raise SetupError("an mllama tower needs intermediate_layers_indices")
    if any(not 0 <= i < v.depth for i in v.intermediate_layers):
        raise SetupError(f"vision intermediate_layers_indices must lie in 0..{v.depth - 1}")
    if not v.cross_attention_layers:
        raise SetupError("an mllama model needs cross_attention_layers")
    if len(set(v.cross_attention_layers)) != len(v.cross_attention_layers) or min(v.cross_attention_layers) < 0:
        raise SetupError("cross_attention_layers must be distinct layer indices")


def check_mllama_model(spec: Any) -> None:
    """The text side agrees with the vision side (a cross-attention layer is one of the model's layers)."""
    v = spec.vision
    if max(v.cross_attention_layers) >= spec.num_layers:
        raise SetupError(f"{spec.name}: cross_attention_layers name layer {max(v.cross_attention_layers)}, "
                         f"the language model has {spec.num_layers}")
    if v.out_hidden_size != spec.hidden_size:
        raise SetupError(f"{spec.name}: the projector's output {v.out_hidden_size} is not the text width "
                         f"{spec.hidden_size}")


def check_mllama_setup(spec: Any, setup: Any) -> None:
    """What transformers cannot train: with reentrant gradient checkpointing (``ckpt_reentrant``) a
    cross-attention layer gets the vision states as a keyword argument, which the checkpoint neither detaches
    nor saves; its recompute in backward back-propagates into the tower's graph, and the second such layer
    fails ("Trying to backward through the graph a second time"; enable_input_require_grads makes even a
    frozen tower's output require grad)."""
    if setup.grad_ckpt and setup.ckpt_reentrant and setup.images:
        raise SetupError(f"{spec.name}: transformers' Llama 3.2 Vision with reentrant gradient checkpointing "
                         "fails in backward once images are given (the vision states reach every "
                         "cross-attention layer as a keyword argument); drop --grad-ckpt-reentrant (transformers' "
                         "default, non-reentrant, trains) or --grad-ckpt")


def feature_dim(v: Any) -> int:
    """``vision_output_dim``: the last state and every listed intermediate state, concatenated."""
    return v.hidden_size * (1 + len(v.intermediate_layers))


def tile_positions(v: Any) -> tuple[int, int]:
    """(positions of one tile with its CLS, the same padded to a multiple of 8)."""
    n = v.positions
    return n, n + (-n) % 8


def tower_params(v: Any) -> int:
    """``MllamaVisionModel``: Conv2d patch embedding (no bias), CLS, gated position embedding with its tile
    table, two gated aspect-ratio embeddings, two LayerNorms, the local and the gated global encoder."""
    d, tiles, rows = v.hidden_size, v.processor.max_tiles, v.aspect_ratios + 1
    n = v.positions
    conv = d * v.in_channels * v.patch_size ** 2
    position = 1 + n * d + rows * tiles * n * d
    aspect = 2 * (rows * tiles * d + 1)
    return (conv + d + position + aspect + 4 * d + v.depth * v.block_params()
            + v.global_depth * (v.block_params() + 2))


def lora_params_per_rank(v: Any) -> int:
    """LoRA on the tower: q/k/v/o_proj, fc1 and fc2 of every local and global layer."""
    d, i = v.hidden_size, v.intermediate_size
    return (4 * (d + d) + (d + i) + (i + d)) * (v.depth + v.global_depth)


# transformers' MllamaVisionConfig defaults for the keys a config may leave out
_DEFAULT_VISION = {"max_num_tiles": 4, "intermediate_layers_indices": [3, 7, 15, 23, 30],
                   "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]],
                   "num_channels": 3, "hidden_act": "gelu"}
_REQUIRED_VISION = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_global_layers", "image_size",
                    "patch_size")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _indices(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in value)


def vision_from_config(cfg: Any, source: str, warnings: list[str]) -> Any:
    """Llama 3.2 Vision's tower, projector and cross-attention layers from an ``mllama`` config.json. Its
    language model cannot be imported without them (its cross-attention layers attend to the tower), so a
    config that does not describe them is refused with the key that is missing or unreadable."""
    from vramlab.core.vision import ProcessorSpec, VisionSpec

    vc, tc = cfg.get("vision_config"), cfg.get("text_config")
    if not isinstance(vc, dict) or not isinstance(tc, dict):
        raise SetupError(f"{source}: an mllama config needs vision_config and text_config objects")
    heads = vc.get("attention_heads", vc.get("num_attention_heads"))
    for key in _REQUIRED_VISION:
        if not _count(vc.get(key)):
            raise SetupError(f"{source}: vision_config.{key} must be a positive whole number, got {vc.get(key)!r}")
    if not _count(heads):
        raise SetupError(f"{source}: vision_config.attention_heads must be a positive whole number, got {heads!r}")
    cross = tc.get("cross_attention_layers")
    if not _indices(cross):
        raise SetupError(f"{source}: text_config.cross_attention_layers must be a list of layer indices, "
                         f"got {cross!r}")
    layers_total = tc.get("num_hidden_layers")
    if _count(layers_total) and not all(0 <= i < layers_total for i in cross):
        raise SetupError(f"{source}: text_config.cross_attention_layers {cross} name layers outside the "
                         f"{layers_total} of num_hidden_layers")
    defaulted = [k for k in _DEFAULT_VISION if k not in vc]
    if defaulted:
        warnings.append(f"vision_config leaves {', '.join(defaulted)} to transformers' mllama defaults")
    get = {**_DEFAULT_VISION, **vc}.get
    tiles, layers, ratios = get("max_num_tiles"), get("intermediate_layers_indices"), get("supported_aspect_ratios")
    if not _count(tiles) or not _indices(layers) or not isinstance(ratios, list) or not ratios:
        raise SetupError(f"{source}: vision_config.max_num_tiles / intermediate_layers_indices / "
                         "supported_aspect_ratios are not readable")
    if get("hidden_act") != "gelu":
        raise SetupError(f"{source}: vision_config.hidden_act {get('hidden_act')!r} is not modelled (GELU is)")
    out_dim = vc.get("vision_output_dim", vc["hidden_size"] * (1 + len(layers)))
    if out_dim != vc["hidden_size"] * (1 + len(layers)):
        raise SetupError(f"{source}: vision_config.vision_output_dim {out_dim!r} is not hidden_size x "
                         f"(1 + {len(layers)} intermediate layers), which transformers' tower produces")
    size, patch = vc["image_size"], vc["patch_size"]
    try:
        processor = ProcessorSpec("mllama", patch_size=patch, tile_size=size, max_tiles=tiles, cls_token=True)
        return VisionSpec("mllama", depth=vc["num_hidden_layers"], global_depth=vc["num_global_layers"],
                          hidden_size=vc["hidden_size"], num_heads=heads, intermediate_size=vc["intermediate_size"],
                          out_hidden_size=tc.get("hidden_size", 4096), patch_size=patch,
                          in_channels=get("num_channels"), hidden_act="gelu", image_size=size,
                          intermediate_layers=tuple(layers), aspect_ratios=len(ratios),
                          cross_attention_layers=tuple(cross),
                          image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 128256)),
                          processor=processor)
    except (SetupError, TypeError) as e:
        raise SetupError(f"{source}: vision_config: {e}") from None
