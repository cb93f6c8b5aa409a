"""Images and video frames as vision tokens, by each model family's own processor rules (pure Python).

A vision-language model sees an image twice: the **vision tower** runs over its patches (one attention
sequence per image, crop or tile), and the **language model** sees the tokens the processor inserts for
it (or, for Llama 3.2 Vision, attends to the tower's output through cross-attention layers). Both counts
follow from the image size and the processor's settings; this module computes them the way the
transformers image processors do, so that the estimate runs on the same sequence lengths a real batch has.

Families (``ProcessorSpec.kind``):

* ``qwen_vl`` - Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``smart_resize`` to multiples of patch x merge within
  [min_pixels, max_pixels]; patches of ``patch_size``, ``temporal_patch_size`` frames per patch (an image
  is repeated to fill it), ``merge_size``\\ ² patches merged into one language token. Video: every frame
  resized alike, frames padded to a multiple of the temporal patch (Qwen3-VL resizes against the whole
  clip's pixel budget).
* ``siglip_fixed`` - Gemma 3 (SigLIP at 896 px, average-pooled to ``tokens_per_tile`` = 256 tokens) and
  LLaVA-1.5 (CLIP at 336 px, 576 tokens, the CLS dropped): every image resized to one square tile.
  Gemma 3's pan-and-scan (off by default; ``VisionInput.pan_and_scan``) adds crops of a wide or tall
  image, each resized to the tile like the image itself (:func:`pan_and_scan_crops`).
* ``llava_next`` - LLaVA-NeXT anyres: the best grid resolution from ``grid_pinpoints``, tiles of
  ``tile_size`` plus the base image; the language model gets the unpadded features plus a newline per row.
* ``idefics3`` - SmolVLM / Idefics3: longest edge resized, split into ``tile_size`` tiles plus a global
  image, each tile ``tokens_per_tile`` tokens after pixel shuffle, with row/column marker tokens. Video
  (SmolVLM's processor only; Idefics3's takes none): every frame one global view of ``video_frame`` pixels,
  written into the prompt after a sentence and a timestamp (:func:`_smolvlm_video`).
* ``internvl`` - InternVL: the tile grid whose aspect ratio is closest to the image's (1..max_tiles
  tiles of ``tile_size``), plus a thumbnail when more than one tile; ``tokens_per_tile`` tokens each.
* ``mllama`` - Llama 3.2 Vision: the canvas of up to ``max_tiles`` tiles of 560 px; the tower always runs
  over ``max_tiles`` tiles per image (the processor pads), and the language model gets one ``<|image|>``
  token per image while its cross-attention layers attend to every tile's patches.

* ``processor`` - every other image-text-to-text family transformers ships: no rules here; the family's own
  processor class runs on a synthetic image of the size asked (``ProcessorSpec.run``: the run of
  :mod:`vramlab.core.tracing.vlm_processor`, which needs transformers and Pillow, handed over where the spec
  is made; this module never imports it).

Everything else here is arithmetic on ints; no torch, no images.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from vramlab.core.checks import SetupError, check_int
from vramlab.core.families import hand_written_towers, piece
from vramlab.core.families.registry import (
    KIND_IDEFICS3,
    KIND_INTERNVL,
    KIND_LLAVA_NEXT,
    KIND_MLLAMA,
    KIND_PROCESSOR,
    KIND_QWEN_VL,
    KIND_SIGLIP_FIXED,
    PROCESSOR_KINDS,
    TRACED_TOWERS,
)

KINDS = PROCESSOR_KINDS

# Bounds on what a user may ask for: far above any real dataset, low enough that the arithmetic stays small.
MAX_IMAGE_SIDE = 32_768
MAX_IMAGES = 256
MAX_FRAMES = 4096


@dataclass(frozen=True)
class ProcessorSpec:
    """A family's image-processor settings, as its ``preprocessor_config.json`` gives them."""

    kind: str
    patch_size: int = 14
    merge_size: int = 1  # qwen_vl spatial merge; idefics3/internvl pixel-shuffle factor
    temporal_patch_size: int = 1  # qwen_vl
    min_pixels: int = 0  # qwen_vl
    max_pixels: int = 0  # qwen_vl
    video_min_pixels: int = 0
    video_max_pixels: int = 0
    video_whole_clip: bool = False  # Qwen3-VL: the pixel budget is for the whole clip (t x h x w)
    tile_size: int = 0  # the tower's input side (siglip_fixed, llava_next, idefics3, internvl, mllama)
    tokens_per_tile: int = 0  # language tokens per tile (siglip_fixed, idefics3, internvl)
    max_tiles: int = 1
    min_tiles: int = 1
    longest_edge: int = 0  # idefics3: the image's longest edge before splitting
    video_frame: int = 0  # idefics3: the square side every video frame is resized to (SmolVLM); 0: no video (Idefics3)
    grid_pinpoints: tuple[tuple[int, int], ...] = ()  # llava_next (height, width)
    cls_token: bool = False  # the tower adds a CLS position (CLIP, InternViT, Mllama)
    use_thumbnail: bool = True  # internvl
    # Gemma 3 pan-and-scan (siglip_fixed): 0 crops means the processor has none
    pan_and_scan_max_crops: int = 0
    pan_and_scan_min_crop: int = 256
    pan_and_scan_min_ratio: float = 1.2
    # processor: the family's own processor class run on a synthetic image, for the model of this canonical
    # config: ``run`` is that run (core/tracing/vlm_processor.run_processor), given where the spec is made (it
    # needs transformers; a spec rebuilt from its dict has none until the tracing layer attaches it)
    config: str = ""
    settings: str = ""  # the checkpoint's processor_config.json / preprocessor_config.json, where they were read
    run: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SetupError(f"unknown image processor kind {self.kind!r}; known: {', '.join(KINDS)}")
        object.__setattr__(self, "grid_pinpoints", tuple(tuple(int(v) for v in p) for p in self.grid_pinpoints))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProcessorSpec:
        names = set(cls.__dataclass_fields__) - {"run"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SetupError(f"image processor: unknown key(s) {', '.join(unknown)}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        default = ProcessorSpec(self.kind)
        for name in self.__dataclass_fields__:
            if name == "run":
                continue
            v = getattr(self, name)
            if name == "kind" or v != getattr(default, name):
                out[name] = [list(p) for p in v] if name == "grid_pinpoints" else v
        return out

    @property
    def patches_per_tile(self) -> int:
        """Positions of one tile in the tower (patches, plus the CLS where the tower has one)."""
        return (self.tile_size // self.patch_size) ** 2 + (1 if self.cls_token else 0)


@dataclass(frozen=True)
class VisionInput:
    """What the user knows about a sample: images and their size, video frames, and ``max_pixels``
    (the Qwen processors' resolution cap; 0 keeps the processor's own)."""

    images: int = 0
    width: int = 448
    height: int = 448
    frames: int = 0  # video frames per sample (one video), 0: no video
    max_pixels: int = 0
    pan_and_scan: bool = False  # Gemma 3's processor option do_pan_and_scan

    def __post_init__(self) -> None:
        check_int("images", self.images, 0, MAX_IMAGES, "images per sample")
        check_int("width", self.width, 1, MAX_IMAGE_SIDE, "image width")
        check_int("height", self.height, 1, MAX_IMAGE_SIDE, "image height")
        check_int("frames", self.frames, 0, MAX_FRAMES, "video frames")
        check_int("max_pixels", self.max_pixels, 0, MAX_IMAGE_SIDE ** 2, "max pixels")
        if max(self.width, self.height) / min(self.width, self.height) > 200:
            raise SetupError(f"image {self.width}x{self.height}: the processors refuse aspect ratios above 200")

    @property
    def active(self) -> bool:
        return self.images > 0 or self.frames > 0


@dataclass(frozen=True)
class Unit:
    """One image or video as the model sees it.

    ``sequences``: the tower's attention sequences (patch counts), one per tile/crop/image; ``grid``: the
    Qwen (t, h, w) patch grid (empty for other kinds); ``llm_tokens``: the placeholder tokens the processor
    inserts into the text (markers included where the processor writes them); ``cross_tokens``: positions a
    cross-attention layer attends to (Llama 3.2 Vision)."""

    resized: tuple[int, int]  # (height, width) in pixels after the processor's resize
    sequences: tuple[int, ...]
    llm_tokens: int
    grid: tuple[int, int, int] = ()
    tiles: int = 1
    cross_tokens: int = 0

    @property
    def patches(self) -> int:
        return sum(self.sequences)


@dataclass(frozen=True)
class VisionTokens:
    """All images and the video of one sample."""

    units: tuple[Unit, ...] = field(default_factory=tuple)
    video: Unit | None = None

    @property
    def all_units(self) -> tuple[Unit, ...]:
        return self.units + ((self.video,) if self.video is not None else ())

    @property
    def llm_tokens(self) -> int:
        return sum(u.llm_tokens for u in self.all_units)

    @property
    def patches(self) -> int:
        return sum(u.patches for u in self.all_units)

    @property
    def cross_tokens(self) -> int:
        return sum(u.cross_tokens for u in self.all_units)

    def describe(self) -> str:
        if not self.all_units:
            return "no images"
        parts = []
        if self.units:
            u = self.units[0]
            parts.append(f"{len(self.units)} image(s) at {u.resized[1]}x{u.resized[0]}: {u.patches:,} patches, "
                         f"{u.llm_tokens:,} tokens each")
        if self.video is not None:
            v = self.video
            parts.append(f"video at {v.resized[1]}x{v.resized[0]}: {v.patches:,} patches, {v.llm_tokens:,} tokens")
        if self.cross_tokens:
            tiles = f"{self.units[0].tiles} tile(s) an image (the tower runs over the padded maximum); " \
                if self.units else ""
            parts.append(f"{tiles}{self.cross_tokens:,} cross-attention positions")
        return "; ".join(parts)


# ---- Qwen2-VL / Qwen2.5-VL / Qwen3-VL -------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: both sides multiples of ``factor``, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_clip(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: the budget applies to frames x height x width."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _qwen_unit(p: ProcessorSpec, h: int, w: int, t: int) -> Unit:
    gh, gw = h // p.patch_size, w // p.patch_size
    gt = -(-t // p.temporal_patch_size)
    n = gt * gh * gw
    return Unit((h, w), (n,), n // (p.merge_size ** 2), (gt, gh, gw))


def _qwen(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    factor = p.patch_size * p.merge_size
    max_px = x.max_pixels or p.max_pixels
    units: list[Unit] = []
    if x.images:
        h, w = smart_resize(x.height, x.width, factor, p.min_pixels, max_px)
        units = [_qwen_unit(p, h, w, 1)] * x.images
    video = None
    if x.frames:
        vmax = x.max_pixels or p.video_max_pixels or p.max_pixels
        vmin = p.video_min_pixels or p.min_pixels
        if p.video_whole_clip:
            frames = max(x.frames, p.temporal_patch_size)
            h, w = smart_resize_clip(frames, x.height, x.width, p.temporal_patch_size, factor, vmin, vmax)
        else:
            h, w = smart_resize(x.height, x.width, factor, vmin, vmax)
        video = _qwen_unit(p, h, w, x.frames)
    return VisionTokens(tuple(units), video)


# ---- fixed-size towers (Gemma 3, LLaVA-1.5) --------------------------------------------------------------------

def pan_and_scan_crops(p: ProcessorSpec, height: int, width: int) -> int:
    """Gemma 3's ``pan_and_scan``: how many crops a wide (or tall) image adds to itself, 0 when its aspect
    ratio is below the threshold or a crop would be smaller than the minimum crop size."""
    long, short = (width, height) if width >= height else (height, width)
    if long / short < p.pan_and_scan_min_ratio:
        return 0
    n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / p.pan_and_scan_min_crop)))
    n = min(p.pan_and_scan_max_crops, max(2, n))
    if min(int(math.ceil(long / n)), short) < p.pan_and_scan_min_crop:
        return 0
    return n


def _fixed(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    tiles = 1 + (pan_and_scan_crops(p, x.height, x.width) if x.pan_and_scan else 0)
    u = Unit((p.tile_size, p.tile_size), (p.patches_per_tile,) * tiles, p.tokens_per_tile * tiles, tiles=tiles)
    video = None
    if x.frames:
        video = Unit((p.tile_size, p.tile_size), (p.patches_per_tile,) * x.frames, p.tokens_per_tile * x.frames,
                     tiles=x.frames)
    return VisionTokens((u,) * x.images, video)


# ---- LLaVA-NeXT anyres -------------------------------------------------------------------------------------------

def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """LLaVA-NeXT: the grid resolution that keeps most of the image and wastes least."""
    best = pinpoints[0]
    max_eff, min_waste = 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        dw, dh = int(width * scale), int(height * scale)
        eff = min(dw * dh, width * height)
        waste = pw * ph - eff
        if eff > max_eff or (eff == max_eff and waste < min_waste):
            max_eff, min_waste, best = eff, waste, (ph, pw)
    return best


def _llava_next(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    if not p.grid_pinpoints:
        raise SetupError("LLaVA-NeXT needs image_grid_pinpoints")
    h, w = x.height, x.width
    bh, bw = select_best_resolution(h, w, p.grid_pinpoints)
    sh, sw = bh // p.tile_size, bw // p.tile_size
    side = p.tile_size // p.patch_size
    cur_h, cur_w = side * sh, side * sw
    if w / h > cur_w / cur_h:
        new_h = int(round(h * (cur_w / w), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(w * (cur_h / h), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    tokens = cur_h * cur_w + cur_h + side * side  # unpadded features, a newline per row, the base image
    tiles = sh * sw + 1
    u = Unit((bh, bw), (p.patches_per_tile,) * tiles, tokens, tiles=tiles)
    return VisionTokens((u,) * x.images, None)


# ---- SmolVLM / Idefics3 ------------------------------------------------------------------------------------------

def _idefics3(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    h, w = x.height, x.width
    # resize: the longest edge to longest_edge (even sides), then under 4096
    ar = w / h
    if w >= h:
        w = p.longest_edge
        h = int(w / ar)
        h += h % 2
    else:
        h = p.longest_edge
        w = int(h * ar)
        w += w % 2
    if w >= h and w > 4096:
        w, h = 4096, int(4096 / ar)
    elif h > w and h > 4096:
        h, w = 4096, int(4096 * ar)
    h, w = max(h, 1), max(w, 1)
    # resize_for_vision_encoder: multiples of the tile
    t = p.tile_size
    ar = w / h
    if w >= h:
        w = math.ceil(w / t) * t
        h = math.ceil(int(w / ar) / t) * t
    else:
        h = math.ceil(h / t) * t
        w = math.ceil(int(h * ar) / t) * t
    rows = cols = 0
    tiles = 1
    if h > t or w > t:
        rows, cols = (h - t) // t + 1, (w - t) // t + 1
        tiles = rows * cols + 1
    n = p.tokens_per_tile
    # the processor's prompt: per tile <fake><row_i_col_j> + n image tokens, a newline per row, then
    # "\n" <fake><global-img> + n + <fake>; one image alone: <fake><global-img> + n + <fake>
    markers = rows * cols * 2 + rows + 4 if rows else 3
    per = Unit((h, w), ((t // p.patch_size) ** 2,) * tiles, tiles * n + markers, tiles=tiles)
    return VisionTokens((per,) * x.images, _smolvlm_video(p, x))


# SmolVLMProcessor.replace_video_token's plain text, split on spaces and punctuation (as a traced family's processor
# text is counted, core/tracing/vlm_processor.py): the intro "You are provided the following series of {count}
# frames from a {H:MM:SS} [H:MM:SS] video.\n" (the count spelled out by num2words: one token here), per frame
# "\nFrame from {MM:SS}:", the outro "\n\n"
_SMOLVLM_INTRO_TEXT = 25
_SMOLVLM_FRAME_TEXT = 6
_SMOLVLM_FRAME_MARKERS = 3  # <fake_token_around_image><global-img> ... <fake_token_around_image>


def _smolvlm_video(p: ProcessorSpec, x: VisionInput) -> Unit | None:
    """SmolVLM's video: its video processor resizes every frame to one ``video_frame`` square (no splitting), and
    its processor writes each as one global image after the clip's sentence and the frame's timestamp."""
    if not x.frames:
        return None
    if x.images:  # ProcessorMixin.__call__ merges the two outputs as {**images, **videos}
        raise SetupError("SmolVLM's processor returns a video's frames as pixel_values, which replace the images' "
                         "pixel_values: one sample holds images or a video, not both")
    f = p.video_frame
    per_frame = p.tokens_per_tile + _SMOLVLM_FRAME_MARKERS + _SMOLVLM_FRAME_TEXT
    return Unit((f, f), ((f // p.patch_size) ** 2,) * x.frames, _SMOLVLM_INTRO_TEXT + x.frames * per_frame,
                tiles=x.frames)


# ---- InternVL ----------------------------------------------------------------------------------------------------

def internvl_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """GotOcr2 ``get_optimal_tiled_canvas``: (columns, rows) whose ratio is closest to the image's; ties go
    to more tiles while the image covers more than half of them."""
    arrangements = sorted({(i, j) for n in range(min_tiles, max_tiles + 1) for i in range(1, n + 1)
                           for j in range(1, n + 1) if min_tiles <= i * j <= max_tiles}, key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in arrangements:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


_INTERNVL_FRAME_TEXT = 2  # "Frame{i}:" split on spaces and punctuation (as SmolVLM's prompt text is counted)


def _internvl(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    cols, rows = internvl_grid(x.height, x.width, p.tile_size, p.min_tiles, p.max_tiles)
    tiles = cols * rows + (1 if p.use_thumbnail and cols * rows != 1 else 0)
    u = Unit((rows * p.tile_size, cols * p.tile_size), (p.patches_per_tile,) * tiles,
             2 + p.tokens_per_tile * tiles, tiles=tiles)
    video = None
    if x.frames:  # InternVLProcessor.replace_video_token: "Frame{i}: <img>" + the tile's tokens + "</img>" a frame
        video = Unit((p.tile_size, p.tile_size), (p.patches_per_tile,) * x.frames,
                     x.frames * (_INTERNVL_FRAME_TEXT + 2 + p.tokens_per_tile), tiles=x.frames)
    return VisionTokens((u,) * x.images, video)


# ---- Llama 3.2 Vision --------------------------------------------------------------------------------------------

def mllama_canvas(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """Mllama ``get_optimal_tiled_canvas``: the smallest upscale, else the largest downscale; ties to the
    smallest area. Returns (canvas height, canvas width)."""
    sizes = [(h * tile, w * tile) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
             if w * h <= max_tiles]
    scales = [min(ch / height, cw / width) for ch, cw in sizes]
    up = [s for s in scales if s >= 1]
    chosen_scale = min(up) if up else max(s for s in scales if s < 1)
    chosen = [c for c, s in zip(sizes, scales) if s == chosen_scale]
    return min(chosen, key=lambda c: c[0] * c[1])


def _mllama(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    ch, cw = mllama_canvas(x.height, x.width, p.max_tiles, p.tile_size)
    tiles = (ch // p.tile_size) * (cw // p.tile_size)
    # the tower runs over max_tiles tiles (padded ones included); each tile's positions padded to a multiple of 8
    per_tile = p.patches_per_tile
    padded = per_tile + (-per_tile) % 8
    u = Unit((ch, cw), (padded * p.max_tiles,), 1, tiles=tiles, cross_tokens=per_tile * p.max_tiles)
    return VisionTokens((u,) * x.images, None)


def _by_processor(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    """Any other family: its processor class itself says what a sample's images are (``p.run``, which needs
    transformers, given where the spec was made)."""
    if p.run is None:
        raise SetupError("this model's images are counted by its own processor class, which runs where "
                         "transformers is installed: read the model from its config there")
    run = p.run(p.config, x.images, x.width, x.height, x.frames, p.settings)
    u = Unit((x.height, x.width), (run.patches_per_image,), run.tokens_per_image)
    video = Unit((x.height, x.width), (run.video_patches,), run.video_tokens, tiles=x.frames) if x.frames else None
    return VisionTokens((u,) * x.images, video)


# the kinds whose processor class in transformers takes no video (no video_processor among its attributes; SmolVLM,
# of the idefics3 kind, has one: its specs carry video_frame), with LLaVA-NeXT-Video a model type of its own
_NO_VIDEO = {KIND_LLAVA_NEXT: ("LlavaNextProcessor", " (LLaVA-NeXT-Video is the llava_next_video model type)"),
             KIND_IDEFICS3: ("Idefics3Processor", " (SmolVLM's does)"), KIND_MLLAMA: ("MllamaProcessor", "")}

_BY_KIND = {KIND_QWEN_VL: _qwen, KIND_SIGLIP_FIXED: _fixed, KIND_LLAVA_NEXT: _llava_next, KIND_IDEFICS3: _idefics3,
            KIND_INTERNVL: _internvl, KIND_MLLAMA: _mllama, KIND_PROCESSOR: _by_processor}


def vision_tokens(p: ProcessorSpec, x: VisionInput) -> VisionTokens:
    """The tokens and tower sequences one sample's images and video make under ``p``'s rules."""
    if x.frames and p.kind in _NO_VIDEO and not (p.kind == KIND_IDEFICS3 and p.video_frame):
        name, other = _NO_VIDEO[p.kind]
        raise SetupError(f"this model's own processor ({name}) takes no video{other}: give its frames as images "
                         "instead")
    if x.pan_and_scan and not p.pan_and_scan_max_crops:
        raise SetupError("pan-and-scan is Gemma 3's processor option; this model's processor has no crops")
    if x.max_pixels and p.kind != KIND_QWEN_VL:
        raise SetupError("max pixels is a Qwen-VL processor setting; this model's processor resizes to fixed tiles")
    if p.kind == KIND_QWEN_VL and x.max_pixels and x.max_pixels < p.min_pixels:
        raise SetupError(f"max pixels {x.max_pixels:,} is below the processor's min pixels {p.min_pixels:,}")
    return _BY_KIND[p.kind](p, x)


# ---- the vision tower and projector ----------------------------------------------------------------------------

TUNINGS = ("frozen", "projector", "lora", "full")
# the fields only some families read (a family's rules name those it reads, ``READS``); left out of to_dict
_FAMILY_FIELDS = ("image_size", "feature_layer", "global_depth", "intermediate_layers", "aspect_ratios",
                  "cross_attention_layers", "temporal_patch_size", "spatial_merge_size", "window_size",
                  "fullatt_block_indexes", "mrope_section", "video_token_id", "vision_start_token_id")


@functools.cache
def _rules(model_type: str) -> ModuleType | None:
    """The ``vision`` piece of ``model_type``'s family (``core/families/<family>/vision.py``), or None."""
    return piece(model_type, "vision")


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's vision side, with the numbers of its ``vision_config`` and processor.

    ``model_type`` names the transformers class whose forward the estimate mirrors; ``tower`` gives the
    ViT's sizes, the projector (Qwen's merger) follows from them. Parameters: :meth:`tower_params`,
    :meth:`projector_params`, answered by the family's rules (:attr:`rules`); a traced model (no family
    folder) carries them as transformers' class counts them."""

    model_type: str
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the language model's width
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 0  # Qwen2.5-VL windowed attention (pixels); 0: every block attends over the whole image
    fullatt_block_indexes: tuple[int, ...] = ()
    hidden_act: str = "silu"
    mrope_section: tuple[int, ...] = (16, 24, 24)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    # llava: CLIP's input side (pixels; its position table has (image_size / patch_size)^2 + 1 rows) and the
    # hidden state the projector reads (``vision_feature_layer``: -2, the last layer's input)
    image_size: int = 0
    feature_layer: int = -2
    # mllama (Llama 3.2 Vision): the global encoder's layers after the local ``depth``, the local layers whose
    # outputs are concatenated to the last state (``intermediate_layers_indices``), the count of supported
    # aspect ratios (the tile embeddings' rows, less the padding id), and the language model's layers that are
    # gated cross-attention layers (``text_config.cross_attention_layers``); ``image_size`` is the tile's side
    global_depth: int = 0
    intermediate_layers: tuple[int, ...] = ()
    aspect_ratios: int = 0
    cross_attention_layers: tuple[int, ...] = ()
    processor: ProcessorSpec = field(default_factory=lambda: ProcessorSpec(KIND_QWEN_VL))
    # a traced tower (registry.TRACED_TOWERS): its and the projector's parameters as transformers' class counts them
    counted_tower: int = 0
    counted_projector: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.processor, Mapping):
            object.__setattr__(self, KIND_PROCESSOR, ProcessorSpec.from_dict(self.processor))
        if self.rules is None and not self.traced:
            raise SetupError(f"vision model type {self.model_type!r} is not modelled; modelled: "
                             f"{', '.join(hand_written_towers())}")
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        object.__setattr__(self, "mrope_section", tuple(int(i) for i in self.mrope_section))
        for name in ("intermediate_layers", "cross_attention_layers"):
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
        for name, hi in (("depth", 256), ("hidden_size", 65_536), ("num_heads", 1024),
                         ("intermediate_size", 1_048_576), ("out_hidden_size", 131_072), ("patch_size", 1024),
                         ("temporal_patch_size", 64), ("in_channels", 16), ("spatial_merge_size", 16)):
            check_int(name, getattr(self, name), 1, hi, f"vision {name}")
        if self.hidden_size % self.num_heads:
            raise SetupError(f"vision hidden_size {self.hidden_size} is not a multiple of its {self.num_heads} heads")
        if self.rules is not None:
            self.rules.check(self)
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise SetupError(f"vision fullatt_block_indexes must lie in 0..{self.depth - 1}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VisionSpec:
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - names)
        if unknown:
            raise SetupError(f"vision spec: unknown key(s) {', '.join(unknown)}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """Every field the model type reads (the other families' fields keep their defaults and are left out)."""
        reads = self.rules.READS if self.rules is not None else ()
        unused = {n for n in _FAMILY_FIELDS if n not in reads}
        if not self.traced:
            unused |= {"counted_tower", "counted_projector"}
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            if name in unused:
                continue
            v = getattr(self, name)
            out[name] = v.to_dict() if isinstance(v, ProcessorSpec) else list(v) if isinstance(v, tuple) else v
        return out

    @property
    def rules(self) -> ModuleType | None:
        """The family's vision rules (``core/families/<family>/vision.py``); None for a traced model."""
        return _rules(self.model_type)

    @property
    def traced(self) -> bool:
        """Whether the whole model is traced from transformers' class (no hand-written program of it)."""
        return self.model_type in TRACED_TOWERS or self.processor.kind == KIND_PROCESSOR

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        """Numbers per patch in ``pixel_values`` (channels x frames x pixels)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_size(self) -> int:
        return self.hidden_size * self.spatial_merge_size ** 2

    @property
    def positions(self) -> int:
        """A fixed-size tower's sequence per image (tile): the patches, and the CLS position where the family's
        tower has one (CLIP, Mllama; not SigLIP)."""
        cls = self.rules is not None and self.rules.CLS_POSITION
        return (self.image_size // self.patch_size) ** 2 + cls

    def block_params(self) -> int:
        return self.rules.block_params(self)

    def tower_params(self) -> int:
        return self.counted_tower if self.traced else self.rules.tower_params(self)

    def projector_params(self) -> int:
        return self.counted_projector if self.traced else self.rules.projector_params(self)

    @property
    def param_count(self) -> int:
        return self.tower_params() + self.projector_params()

    def language_extra_params(self, spec: Any) -> int:
        """Parameters the language model has beyond the text spec's layers (mllama: 8 more embedding rows, each
        cross-attention layer's q/k norms and two gates); 0 for the token-merging families."""
        return self.rules.language_extra_params(self, spec) if self.rules is not None else 0

    def freeze_extra_params(self, spec: Any, first: int, embed: bool) -> int:
        """What ``--method freeze`` trains of the language model beyond the text spec's layers, its layers from
        ``first`` on training (and the embedding where ``embed``): the family's ``freeze_extra_params`` where it
        has one (mllama: the trained cross-attention layers' q/k norms and gates, its 8 more embedding rows)."""
        rule = getattr(self.rules, "freeze_extra_params", None)
        return rule(self, spec, first, embed) if rule is not None else 0

    def lora_params_per_rank(self) -> int:
        """The tower's LoRA parameters per rank (``vision_tuning`` lora)."""
        return self.rules.lora_params_per_rank(self)

    def windows(self, grid: tuple[int, int, int]) -> list[int]:
        """Qwen2.5-VL ``get_window_index``: the patch count of every attention window of one (t, h, w) grid,
        in the order the windowed blocks see them."""
        t, h, w = grid
        m = self.spatial_merge_size
        win = self.window_size // m // self.patch_size
        lh, lw = h // m, w // m
        nh, nw = (lh + win - (lh % win)) // win, (lw + win - (lw % win)) // win
        out = []
        for _ in range(t):
            for i in range(nh):
                rows = max(0, min(lh, (i + 1) * win) - i * win)
                for j in range(nw):
                    cols = max(0, min(lw, (j + 1) * win) - j * win)
                    if rows * cols:
                        out.append(rows * cols * m * m)
        return out


def token_counts(spec: Any, setup: Any) -> dict[str, Any] | None:
    """What one sample is to a vision-language model (``spec``: a ModelSpec, ``setup``: a TrainingSetup), or
    None for a text model: tower patches, the language model's vision and text tokens, and the resized image."""
    v = getattr(spec, "vision", None)
    if v is None:
        return None
    tokens = vision_tokens(v.processor, setup.vision_input())
    out: dict[str, Any] = {
        "images": setup.images, "frames": setup.frames, "tower_patches": tokens.patches,
        "vision_tokens": tokens.llm_tokens, "text_tokens": setup.seq_len,
        "sequence": setup.seq_len + tokens.llm_tokens, "vision_tuning": setup.vision_tuning,
    }
    if tokens.units:
        out["resized_image"] = f"{tokens.units[0].resized[1]}x{tokens.units[0].resized[0]}"
    if tokens.cross_tokens:
        out["cross_attention_tokens"] = tokens.cross_tokens
    return out


def describe_tokens(spec: Any, setup: Any) -> str | None:
    """One line for people: the images as the processor makes them and the sequence the language model sees."""
    c = token_counts(spec, setup)
    if c is None:
        return None
    if not c["images"] and not c["frames"]:
        return (f"Vision: no images in the batch (the tower is loaded, {c['vision_tuning']}); "
                f"the language model sees {c['text_tokens']:,} text tokens per sample")
    tokens = vision_tokens(spec.vision.processor, setup.vision_input())
    return (f"Vision: {tokens.describe()}; the language model sees {c['text_tokens']:,} text + "
            f"{c['vision_tokens']:,} vision = {c['sequence']:,} tokens per sample; tower {c['vision_tuning']}")
