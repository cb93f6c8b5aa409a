"""Any image-text-to-text model transformers ships, built whole from its config (vision tower, projector and
language model) for the trace and for ``simulate --hf`` (issue 16).

The hand-written vision-language models (Qwen2.5-VL, LLaVA-1.5: :mod:`.vlm`) mirror their class; this builder
mirrors nothing. It builds ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]`` with random weights, applies
the recipe (peft LoRA on the language model's own linear layers and, with ``vision_tuning`` lora, on every
linear layer of the tower's repeated blocks; the tower and projector frozen, trained or LoRA-adapted as
``vision_tuning`` says; checkpointing of the language model and, unless ``vision_ckpt`` is off, the tower),
and feeds it the batch the model's processor makes of the user's images (:mod:`vramlab.core.vision`): token
ids with the image placeholders in the text, and the pixel inputs in the processor's shapes:

* ``qwen_vl`` (Qwen2-VL, Qwen3-VL): ``pixel_values`` (patches, channels x frames x pixels) and the
  ``image_grid_thw`` rows (and the video's);
* ``idefics3`` (SmolVLM, Idefics3): ``pixel_values`` (batch, tiles, 3, side, side) and the pixel mask;
* ``internvl``: ``pixel_values`` (tiles, 3, side, side);
* ``llava_next``: ``pixel_values`` (images, tiles, 3, side, side) and ``image_sizes``.

What the forward reads of these values it reads as constants (FakeTensorMode's constant propagation, its
size limit raised, as :func:`.vlm.constants` does): the grids, the image sizes and, where the model checks
for padding images by their pixels (Idefics3), the pixels themselves, which are then ones, as a real image
is not all zero. Those few ops run on real tensors; every tensor of the step is still counted.

Where the bytes go: the module paths of the model decide (:func:`vision_parts`): the language model
(``language_model``, ``lm_head``) is the language model's; the tower (``visual``, ``vision_tower``,
``vision_model``) is the vision tower's except its mergers; everything else of the multimodal model (the
projector, connector, mergers, ``image_newline``) is the projector's.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import KIND_IDEFICS3, KIND_INTERNVL, KIND_LLAVA_NEXT
from vramlab.core.families.vlm_base.reference import construction
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.simulation.shard import Sharder, shard_module
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Method
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.tracing.hf import (
    DTYPES,
    BuildPlan,
    check,
    checkpoint_layers,
    hub_kernels,
    liger_kernels,
    moves_that_change_nothing_are_skipped,
)
from vramlab.core.tracing.hfconfig import CAUSAL, Task, layer_stacks, wrapped_units
from vramlab.core.tracing.hflora import linear_modules
from vramlab.core.tracing.hfquant import load_quantized, quantized_notes
from vramlab.core.tracing.vlm import VisionHFModel, freeze_language_model, realized, with_lora
from vramlab.core.tracing.vlm_processor import attached, run_processor
from vramlab.core.vision import ProcessorSpec, Unit, VisionTokens, vision_tokens

_TOWER_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder")
_LM_NAMES = ("language_model", "text_model")
_MERGER_PARTS = ("merger", "deepstack_merger")
_CONSTANT_LIMIT = 1 << 27  # elements: Idefics3's pixel values are read by its padding-image check
# depth keys of the vision configs (the tower's repeated blocks)
_VISION_DEPTH_KEYS = ("num_hidden_layers", "depth")


def transformers_class(cfg: Any) -> type:
    """transformers' image-text-to-text class of ``cfg`` (refused when it has none)."""
    from transformers.models.auto import modeling_auto as ma

    try:
        return ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(cfg)]
    except KeyError:
        raise SetupError(f"transformers has no image-text-to-text class for {cfg.model_type}") from None


def config_from_json(config_json: str, text_depth: int | None = None, vision_depth: int | None = None) -> Any:
    """The transformers config of ``config_json`` (a whole VLM's canonical JSON), its language model cut to
    ``text_depth`` layers and its tower to ``vision_depth`` blocks where given."""
    from vramlab.core.sources.traced_config import config_from_dict

    data = json.loads(config_json)
    if text_depth is not None:
        text = dict(data["text_config"])
        text["num_hidden_layers"] = text_depth
        types = text.get("layer_types")
        if isinstance(types, list) and len(types) > text_depth:
            text["layer_types"] = types[:text_depth]
        data["text_config"] = text
    if vision_depth is not None:
        vision = dict(data["vision_config"])
        for key in _VISION_DEPTH_KEYS:
            if key in vision:
                vision[key] = vision_depth
        data["vision_config"] = vision
    return config_from_dict(data)


def vision_parts(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The module paths of the tower and of the projector, as name fragments (``.model.visual.``) that a
    parameter's full name contains (peft's prefixes and the HFModel wrapper's included)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    if inner is None or not any(hasattr(inner, n) for n in _LM_NAMES):
        raise SetupError(f"{type(base).__name__} has no model.language_model: its vision parts cannot be told apart")
    tower, projector = [], []
    for name, child in inner.named_children():
        if name in _LM_NAMES or not any(True for _ in child.parameters()):
            continue
        (tower if name in _TOWER_NAMES else projector).append(f".model.{name}.")
    for name, _p in inner.named_parameters(recurse=False):  # LLaVA-NeXT's image_newline
        projector.append(f".model.{name}")
    if not tower:
        names = ", ".join(n for n, _ in inner.named_children())
        raise SetupError(f"{type(base).__name__}: no vision tower among {names}")
    return tuple(tower), tuple(projector)


def kind_of(name: str, tower: tuple[str, ...], projector: tuple[str, ...]) -> Kind | None:
    """The vision kind of a parameter or buffer by its full name (None: the language model's)."""
    name = f".{name}"
    if any(p in name if p.endswith(".") else name.endswith(p) or f"{p}." in name for p in projector):
        return Kind.PROJECTOR_WEIGHTS
    if any(p in name for p in tower):
        return Kind.PROJECTOR_WEIGHTS if any(f".{m}" in name for m in _MERGER_PARTS) else Kind.VISION_WEIGHTS
    return None


def image_placeholders(p: ProcessorSpec, unit: Unit) -> int:
    """How many of a unit's language tokens are the image token (the rest are the processor's markers:
    Idefics3's row/column and global-image tokens, InternVL's ``<img>`` and ``</img>``)."""
    if p.kind in (KIND_IDEFICS3, KIND_INTERNVL):
        return unit.tiles * p.tokens_per_tile
    return unit.llm_tokens


class TracedVlmModel(VisionHFModel):
    """The VLM with the builder's ``forward(ids, labels) -> loss``; ``make_batch`` adds the images."""

    def __init__(self, inner: nn.Module, plan: BuildPlan, tokens: VisionTokens, processor: ProcessorSpec,
                 ids: dict[str, int], parts: tuple[tuple[str, ...], tuple[str, ...]],
                 notes: tuple[str, ...] = ()) -> None:
        super().__init__(inner, plan, notes=notes)
        self.image_size = (plan.setup.image_width, plan.setup.image_height)  # LLaVA-NeXT's image_sizes
        self.tokens = tokens
        self.processor = processor
        self.ids = ids
        self.parts = parts
        self._images: dict[str, torch.Tensor] = {}
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        for name in ("get_image_features", "get_video_features"):
            fn = getattr(base.model, name, None)
            if fn is not None:
                setattr(base.model, name, self._in_vision_region(fn))
        if hasattr(base.model, "get_rope_index"):  # Qwen2-VL / Qwen3-VL's M-RoPE positions, read from the ids
            base.model.get_rope_index = _on_real_values(base.model.get_rope_index)

    def parameter_kind(self, name: str) -> Kind | None:
        return kind_of(name, *self.parts)

    @staticmethod
    def _in_vision_region(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with _ConstantArange(), context.region(Kind.VISION_ACTIVATIONS):
                return fn(*args, **kwargs)
        return wrapped

    def _rows(self, text: int) -> tuple[list[int], list[int]]:
        """One sample's ids (the text, then each image's placeholders: the image token, and the processor's
        markers as other tokens) and the Qwen processors' mm_token_type_ids (1 image, 2 video)."""
        p = self.processor
        row, types = [0] * text, [0] * text
        units, video = self._units()
        for u in units:
            n = image_placeholders(p, u)
            row += [self.ids["image"]] * n + [0] * (u.llm_tokens - n)
            types += [1] * n + [0] * (u.llm_tokens - n)
        if video is not None:
            row += [self.ids["video"]] * video.llm_tokens
            types += [2] * video.llm_tokens
        return row, types

    def _units(self) -> tuple[list[Unit], Unit | None]:
        """The images, and the video where the model takes it apart from them (SmolVLM's and InternVL's frames are
        images to their model: their processor writes them with the image token, and in pixel_values)."""
        units, video = list(self.tokens.units), self.tokens.video
        if video is not None and self.processor.kind in (KIND_IDEFICS3, KIND_INTERNVL):
            return [*units, video], None
        return units, video

    def _row(self, text: int, images: bool = True) -> list[int]:
        if not images:
            return [0] * text
        if self.processor.kind == "processor":
            x = self.plan.setup.vision_input()
            run = run_processor(self.processor.config, x.images, x.width, x.height, x.frames, self.processor.settings)
            return [0] * text + list(run.row)
        return self._rows(text)[0]

    def make_batch(self, setup: TrainingSetup, device: torch.device, real: bool,
                   labels: bool = True) -> dict[str, torch.Tensor]:
        """The collator's batch: :meth:`_rows`, labels (unless ``labels`` is false: a trainer's batch without
        them), mask, and the pixel inputs in the processor's shapes."""
        p = self.processor
        if p.kind == "processor":
            return self._processor_batch(setup, device, real, labels)
        units, video = self._units()
        row, types = self._rows(setup.seq_len)
        b = setup.micro_batch
        images: dict[str, torch.Tensor] = {}
        with context.region(Kind.INPUTS):
            ids = torch.tensor([row] * b, dtype=torch.long, device=device)
            labels = ids.clone() if labels else None
            mask = torch.ones(b, len(row), dtype=torch.long, device=device)
            if p.kind == "qwen_vl":
                images["mm_token_type_ids"] = torch.tensor([types] * b, dtype=torch.int, device=device)
            if units:
                images.update(self._pixels(units, b, device, real))
            if video is not None:
                images["pixel_values_videos"] = _empty((b * video.patches, self._patch_features()), device, real)
                images["video_grid_thw"] = torch.tensor([list(video.grid)] * b, dtype=torch.long, device=device)
        self._images = images
        return _batch(ids, labels, mask, images)  # the batch holds them

    def _processor_batch(self, setup: TrainingSetup, device: torch.device, real: bool,
                         labels: bool = True) -> dict[str, torch.Tensor]:
        """The batch of a family whose processor class ran on the images (:mod:`.vlm_processor`): the text,
        then the processor's row of placeholders; its pixels as tensors of their shapes and its integer
        outputs as the constants the model reads, one sample's repeated along the first axis for each sample
        (a per-token output, such as mm_token_type_ids, is 0 over the text)."""
        x = setup.vision_input()
        run = run_processor(self.processor.config, x.images, x.width, x.height, x.frames, self.processor.settings)
        b = setup.micro_batch
        row = [0] * setup.seq_len + list(run.row)
        base = self.inner.get_base_model() if hasattr(self.inner, "get_base_model") else self.inner
        accepted = inspect.signature(base.forward).parameters
        images: dict[str, torch.Tensor] = {}
        with context.region(Kind.INPUTS):
            ids = torch.tensor([row] * b, dtype=torch.long, device=device)
            labels = ids.clone() if labels else None
            mask = torch.ones(b, len(row), dtype=torch.long, device=device)
            for name, kind, shape, values, dtype in run.inputs if x.images or x.frames else ():
                if name not in accepted:
                    continue
                if kind == "pixels":
                    images[name] = _empty((b * shape[0], *shape[1:]), device, real)
                    continue
                per_token = len(shape) == 2 and shape == (1, len(run.row))
                rows = [[0] * setup.seq_len + values[0]] if per_token else values
                images[name] = _constant(rows * b, torch.bool if dtype == "bool" else torch.long, device)
        self._images = images
        return _batch(ids, labels, mask, images)

    def _patch_features(self) -> int:
        v = self.inner.config.vision_config if not hasattr(self.inner, "get_base_model") \
            else self.inner.get_base_model().config.vision_config
        return v.in_channels * v.temporal_patch_size * v.patch_size ** 2

    def _pixels(self, units: list[Unit], b: int, device: torch.device, real: bool) -> dict[str, torch.Tensor]:
        p = self.processor
        t = p.tile_size
        if p.kind == "qwen_vl":
            return {"pixel_values": _empty((b * sum(u.patches for u in units), self._patch_features()), device, real),
                    "image_grid_thw": torch.tensor([list(u.grid) for _ in range(b) for u in units],
                                                   dtype=torch.long, device=device)}
        if p.kind == KIND_IDEFICS3:  # every tile (and global image) is one "image" of the sample; read for padding
            n = sum(u.tiles for u in units)
            return {"pixel_values": _constant_ones((b, n, 3, t, t), torch.float32, device),
                    "pixel_attention_mask": _constant_ones((b, n, t, t), torch.bool, device)}
        if p.kind == KIND_INTERNVL:
            return {"pixel_values": _empty((b * sum(u.tiles for u in units), 3, t, t), device, real)}
        if p.kind == KIND_LLAVA_NEXT:
            tiles = units[0].tiles
            sizes = [[self.image_size[1], self.image_size[0]]] * (b * len(units))
            return {"pixel_values": _empty((b * len(units), tiles, 3, t, t), device, real),
                    "image_sizes": torch.tensor(sizes, dtype=torch.long, device=device)}
        raise SetupError(f"the {p.kind} processor's inputs are not built by the traced path")



def _batch(ids: torch.Tensor, labels: torch.Tensor | None, mask: torch.Tensor, images: dict) -> dict:
    out = {"input_ids": ids} if labels is None else {"input_ids": ids, "labels": labels}
    return {**out, "attention_mask": mask, **images}


def _on_real_values(fn: Any) -> Any:
    """``fn`` run on real copies of its tensor arguments (their values: the ids, grids and token types are
    constants; the attention mask is the batch's, all ones), its tensor results entering the step as
    constants, as the processor's inputs do."""
    from torch.utils._python_dispatch import _disable_current_modes

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        def values(name: str, t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if name == "attention_mask":
                return ("ones", tuple(t.shape), t.dtype)
            return (t.tolist(), t.dtype)

        def real(v: Any) -> Any:
            if isinstance(v, tuple) and v and v[0] == "ones":
                return torch.ones(v[1], dtype=v[2])
            return torch.tensor(v[0], dtype=v[1]) if isinstance(v, tuple) else v

        a = [values("", t) for t in args]
        k = {n: values(n, t) for n, t in kwargs.items()}
        with _disable_current_modes():
            out = fn(*[real(v) for v in a], **{n: real(v) for n, v in k.items()})
            flat = [(o.tolist(), o.dtype) if isinstance(o, torch.Tensor) else o
                    for o in (out if isinstance(out, tuple) else (out,))]
        made = tuple(torch.tensor(v[0], dtype=v[1]) if isinstance(v, tuple) else v for v in flat)
        return made if isinstance(out, tuple) else made[0]
    return wrapped


def _constant_one_hot(one_hot: Any) -> Any:
    """``one_hot`` of a constant (patch positions: Gemma 4's pooler builds its mask from them) kept a constant:
    FakeTensorMode has no constant rule for it, and the mask's nonzero would have no size."""
    from torch.utils._python_dispatch import _disable_current_modes

    def wrapped(t: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
        value = getattr(t, "constant", None)
        if value is None:
            return one_hot(t, num_classes)
        with _disable_current_modes():
            real = one_hot(value.clone(), num_classes)
        return torch.ops.aten.lift_fresh_copy.default(real).to(t.device)
    return wrapped


class _ConstantArange(TorchFunctionMode):
    """``torch.arange`` of integers kept a constant under FakeTensorMode (it has no tensor argument, so no
    constant rule): the positions an image's features are gathered by, set against the processor's grids (also
    constants), make a mask whose values, and so whose ``nonzero``, are known (LFM2-VL's ``is_token``: each image's
    tokens among the slots padded to the largest image). The allocation is the arange's own. A torch function mode
    (its stack is the thread's own): what another thread traces meanwhile, or after, keeps torch's arange."""

    def __init__(self, func: Any = torch.arange, floats: bool = False) -> None:
        super().__init__()
        self.func, self.floats = func, floats

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not self.func or not isinstance(out, FakeTensor) or out.dtype.is_floating_point and not self.floats \
                or out.numel() > _CONSTANT_LIMIT or any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            return out
        with _disable_current_modes():
            real = func(*args, **{**kwargs, "device": "cpu"})
        return torch.ops.aten.lift_fresh_copy.default(real).to(out.device)


def _empty(shape: tuple[int, ...], device: torch.device, real: bool) -> torch.Tensor:
    return torch.randn(shape, device=device) if real else torch.empty(shape, device=device)


def _constant(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The processor's integer output (grids, position ids), a constant the model may read."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        real = torch.tensor(values, dtype=dtype)
    return torch.ops.aten.lift_fresh_copy.default(real).to(device)


def _constant_ones(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Ones the model may read (under FakeTensorMode a constant: torch.tensor's lift of a real tensor)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        real = torch.ones(shape, dtype=dtype)
    return torch.ops.aten.lift_fresh_copy.default(real).to(device)


def token_ids(cfg: Any) -> dict[str, int]:
    """The image and video placeholder ids of the config."""
    out = {}
    for key, names in (("image", ("image_token_id", "image_token_index")),
                       ("video", ("video_token_id", "video_token_index"))):
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int):
                out[key] = v
                break
    if "image" not in out:
        raise SetupError(f"{cfg.model_type}: the config names no image token id")
    out.setdefault("video", out["image"])
    return out


def check_traced_vlm(spec: ModelSpec, setup: TrainingSetup) -> None:
    check(spec, setup)
    setup.validate(spec)
    if spec.vision is None or not spec.vision.traced or not spec.transformers_config:
        raise SetupError(f"{spec.name}: not a vision-language model traced from its transformers config")


def build(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
          config: Any = None) -> TracedVlmModel:
    """transformers' own class of ``spec`` (``config``: the config to build, e.g. at reduced depth; default:
    the spec's own), with the recipe applied and the processor's batch."""
    spec = attached(spec)
    check_traced_vlm(spec, setup)
    with moves_that_change_nothing_are_skipped():
        return _build(spec, setup, torch.device(device), real,
                      config if config is not None else config_from_json(spec.transformers_config))


def _build(spec: ModelSpec, setup: TrainingSetup, device: torch.device, real: bool, cfg: Any) -> TracedVlmModel:
    cls = transformers_class(cfg)
    want = "eager" if setup.attention.value == "eager" else "sdpa"
    notes: tuple[str, ...] = ()
    if want == "sdpa" and not getattr(cls, "_supports_sdpa", False):
        want = "eager"
        notes = (f"{cls.__name__} has no SDPA path in transformers: eager attention is what it runs",)
    cfg._attn_implementation = want
    for sub in ("text_config", "vision_config"):
        c = getattr(cfg, sub, None)
        if c is not None:
            c._attn_implementation = want
    if setup.weight_dtype.is_quantized:  # every nn.Linear of tower, projector and language model but what
        # transformers' bitsandbytes quantizer keeps (the head, tied and _keep_in_fp32_modules), as tracing.hf does
        if real:
            raise SetupError("quantized bases are emulated under fake tensors only (bitsandbytes needs a GPU)")
        model = load_quantized(Task(CAUSAL, cfg, cls), cfg, setup, device)
        notes = (*notes, *quantized_notes(model, setup))
    else:  # FSDP mixed precision: the parameters compute in the dtype they are gathered in (shards kept in fp32)
        dtype = DTYPES[setup.compute if setup.sharded_mixed_precision else setup.weight_dtype]
        # a fake build skips the initialisers, which allocate nothing (and whose trunc_normal_ reads values: a
        # SigLIP 2 tower, LFM2-VL's); init_weights would tie the head too
        # a linspace the class reads while built (Qianfan-OCR's tower: its drop-path rates, each ``.item()``) kept
        # a constant, as the arange the features read
        with torch.device(device), construction(real), _ConstantArange(torch.linspace, floats=True):
            model = cls._from_config(cfg, dtype=dtype)
        if not real:
            model.tie_weights()
    tracker = context.current()
    if tracker is not None and getattr(model.config, "tie_word_embeddings", False):
        tracker.restart_phase_peak()  # from_config's untied head before tying (see measure.hf)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    parts = vision_parts(model)
    tune = setup.vision_tuning
    if setup.uses_lora:
        model = _with_lora(model, setup, device)
    elif setup.method is Method.FREEZE:
        freeze_language_model(model, setup)
    for name, p in model.named_parameters():
        kind = kind_of(name, *parts)
        if kind is None or "lora_" in name:
            continue
        p.requires_grad = tune == "full" or (kind is Kind.PROJECTOR_WEIGHTS and tune == "projector")
    liger_kernels(model, spec, setup)  # liger's patch after peft, as HF Trainer applies it
    notes = (*notes, *hub_kernels(model, spec, setup, real))  # then train()'s kernelize: every decorated module
    if setup.grad_ckpt:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not base.supports_gradient_checkpointing:
            raise SetupError(f"{type(base).__name__} does not support gradient checkpointing in transformers")
        checkpoint_layers(base, setup)
        if not model.get_input_embeddings().weight.requires_grad:
            base.enable_input_require_grads()
        if not setup.vision_ckpt:
            for name, module in base.model.named_children():
                if name in _TOWER_NAMES:
                    for m in module.modules():
                        if hasattr(m, "gradient_checkpointing"):
                            m.gradient_checkpointing = False
    tokens = vision_tokens(spec.vision.processor, setup.vision_input())
    if spec.vision.processor.kind == "processor" and (setup.images or setup.frames):  # what its run says of itself
        x = setup.vision_input()
        notes = (*notes, *run_processor(spec.vision.processor.config, x.images, x.width, x.height, x.frames,
                                         spec.vision.processor.settings).notes)
    sharder = Sharder.for_setup(setup)
    plan = BuildPlan(spec, setup, device, real, sharder)
    out = TracedVlmModel(model, plan, tokens, spec.vision.processor, token_ids(cfg), parts, notes)
    if sharder is not None and sharder.params_sharded:  # ZeRO-3 / FSDP: the tower's blocks and the decoder layers
        shard_module(model, sharder, wrapped_units(model), out)
    return out


def _lora_targets(model: nn.Module, setup: TrainingSetup) -> list[str]:
    """The language model's own linear layers of the roles asked (``all-linear``: every one in its layer
    stack), the output head if asked, and with a LoRA tower every linear layer of the tower's blocks."""
    from vramlab.core.spec.targets import names_all_linear
    from vramlab.core.tracing.hflora import lora_target_modules

    inner = model.model
    lm_name = next(n for n in _LM_NAMES if hasattr(inner, n))
    lm = getattr(inner, lm_name)
    if names_all_linear(setup.lora_targets):
        names = linear_modules(lm)
    else:
        names = lora_target_modules(lm, tuple(t for t in setup.lora_targets if t != "lm_head"))
    out = [f"model.{lm_name}.{n}" for n in names]
    if "lm_head" in setup.lora_targets:
        out.append("lm_head")
    if setup.vision_tuning == "lora":
        for name, child in inner.named_children():
            if name in _TOWER_NAMES:  # the tower's blocks (a merger stack, Qwen3-VL's deepstack, is the projector)
                found = [f"model.{name}.{n}" for n in linear_modules(child)
                         if not any(m in n for m in _MERGER_PARTS)]
                if not found:
                    raise SetupError(f"{type(model).__name__}'s vision tower has no linear layers in repeated "
                                     "blocks for LoRA")
                out.extend(found)
    return out


def _with_lora(model: nn.Module, setup: TrainingSetup, device: torch.device) -> nn.Module:
    targets = _lora_targets(model, setup)
    regex = "^(?:" + "|".join(t.replace(".", r"\.") for t in targets) + ")$"
    return with_lora(model, setup, regex, device)


@contextlib.contextmanager
def guard(setup: TrainingSetup, spec: ModelSpec | None = None) -> Iterator[None]:
    """What the fake-tensor run of a traced VLM needs: the HF path's guard (no packed-sequence check) and
    the values the model reads kept as constants: FakeTensorMode's constant limit raised, and transformers'
    vision_utils helpers (position ids, sequence lengths, window index from the grid) run on real tensors
    in every modeling module that imported them, their results entering the step as constants."""
    import torch._subclasses.fake_tensor as ft
    import transformers.vision_utils as vu

    from vramlab.core.tracing.hf import guard as hf_guard

    if spec is not None:  # the model's modeling module imported, so that its helpers are found
        transformers_class(config_from_json(spec.transformers_config))
    helpers = {name: fn for name, fn in vars(vu).items() if name.startswith("get_vision_") and callable(fn)
               and next(iter(inspect.signature(fn).parameters), "") == "grid_thw"}
    patched: list[tuple[Any, str, Any]] = []
    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("transformers.models.")
                and ".modeling_" in name and m is not None]:
        for name, fn in helpers.items():
            if vars(mod).get(name) is fn:
                patched.append((mod, name, fn))
    limit = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = _CONSTANT_LIMIT
    for mod, name, fn in patched:
        setattr(mod, name, realized(fn))
    one_hot = torch.nn.functional.one_hot
    torch.nn.functional.one_hot = _constant_one_hot(one_hot)
    try:
        with hf_guard(setup):
            yield
    finally:
        torch.nn.functional.one_hot = one_hot
        ft.CONSTANT_NUMEL_LIMIT = limit
        for mod, name, fn in patched:
            setattr(mod, name, fn)


def tower_depth(cfg: Any) -> int:
    vc = cfg.vision_config
    for key in _VISION_DEPTH_KEYS:
        v = getattr(vc, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0


__all__ = ["TracedVlmModel", "build", "config_from_json", "guard", "layer_stacks", "transformers_class",
           "vision_parts"]


# ---- the tower at reduced depth too ------------------------------------------------------------------------
_BLOCK_INDEX_KEYS = ("fullatt_block_indexes", "deepstack_visual_indexes")


def tower_kept_whole(cfg: Any) -> str | None:
    """Why the tower is traced at its full depth (None: its blocks repeat and it is cut like the language
    model): too few blocks, or the config names blocks by index (Qwen2.5-VL's full-attention blocks,
    Qwen3-VL's deepstack taps, a non-negative feature layer), which a shorter tower would not have."""
    n = tower_depth(cfg)
    if n <= 3:
        return f"the tower has {n} blocks"
    vc = cfg.vision_config.to_dict()
    for key in _BLOCK_INDEX_KEYS:
        if vc.get(key):
            return f"vision_config.{key} names blocks by index"
    layer = getattr(cfg, "vision_feature_layer", -1)
    if not isinstance(layer, int) or layer >= 0:
        return f"vision_feature_layer {layer!r} names blocks by index"
    return None
