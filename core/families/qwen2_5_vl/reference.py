"""A vision-language model's real transformers class as the measured model (the reference for the estimate
of :mod:`vramlab.core.families.qwen2_5_vl.program`).

``build_vlm`` builds ``Qwen2_5_VLForConditionalGeneration`` from the spec with random weights (peft for LoRA,
the language model's targets by regex so that the tower's same-named MLP layers are adapted only when the
setup says so), freezes the tower and projector as ``vision_tuning`` says, and makes its own batch: token ids
with the processor's image placeholders, ``pixel_values`` (fp32, patches x channels*frames*pixels) and
``image_grid_thw`` exactly as the image processor shapes them (:mod:`vramlab.core.vision`).

Under fake tensors the model reads a few values: the grid (``tolist``) and, through its placeholder check,
the token ids. :func:`fake_values` makes small integer tensors created from Python data keep their values
(torch's FakeTensorMode constant propagation, whose size limit it raises), and transformers' vision_utils
helpers (position ids, cumulative sequence lengths, window index) run on real tensors whose results enter the
fake run as such constants. Nothing else changes: every tensor of the step is the model's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vramlab.core.checks import SetupError
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.simulation.loss import apply as loss_kernel
from vramlab.core.simulation.shard import Sharder
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention, DType
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.tracing.hf import (
    _AUTOCAST,
    DTYPES,
    HFModel,
    _moves_that_change_nothing_are_skipped,
    _outputs_to_fp32,
    _Plan,
    check,
    enable_checkpointing,
)
from vramlab.core.vision import VisionTokens, vision_tokens

_HELPERS = ("get_vision_attention_seqlens", "get_vision_position_ids", "get_vision_window_index")
_CONSTANT_LIMIT = 1 << 22  # elements: token ids of a long batch, the grid-derived index tensors


def hf_vlm_config(spec: ModelSpec, attention: Attention):  # noqa: ANN201
    """A transformers Qwen2.5-VL config equivalent to ``spec`` (language model and vision tower)."""
    import transformers as tf

    v = spec.vision
    if v is not None and v.model_type == "llava":
        return _llava_config(spec, attention)
    if v is not None and v.model_type == "mllama":
        from vramlab.core.families.mllama.reference import mllama_config

        return mllama_config(spec, attention)
    if v is not None and v.model_type == "gemma3":
        from vramlab.core.families.gemma3.reference import gemma3_config

        return gemma3_config(spec, attention)
    if v is None or v.model_type != "qwen2_5_vl":
        raise SetupError(f"{spec.name}: the vision-language reference covers Qwen2.5-VL, LLaVA-1.5, Gemma 3 and "
                         "Llama 3.2 Vision")
    act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[spec.activation.value]
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": list(v.mrope_section)}
    text = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                hidden_act=act, tie_word_embeddings=spec.tie_embeddings, rope_parameters=rope,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_heads=v.num_heads, out_hidden_size=v.out_hidden_size, patch_size=v.patch_size,
                  temporal_patch_size=v.temporal_patch_size, in_channels=v.in_channels,
                  spatial_merge_size=v.spatial_merge_size, window_size=v.window_size,
                  fullatt_block_indexes=list(v.fullatt_block_indexes), hidden_act=v.hidden_act)
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=v.image_token_id,
                              video_token_id=v.video_token_id, vision_start_token_id=v.vision_start_token_id,
                              tie_word_embeddings=spec.tie_embeddings)
    impl = "eager" if attention is Attention.EAGER else "sdpa"
    cfg._attn_implementation = impl
    cfg.text_config._attn_implementation = impl
    cfg.vision_config._attn_implementation = impl
    return cfg


def _llava_config(spec: ModelSpec, attention: Attention):  # noqa: ANN202
    """A transformers LLaVA config: CLIP vision tower, the two-linear GELU projector, a Llama language model."""
    import transformers as tf

    v = spec.vision
    text = dict(model_type="llama", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_embeddings,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(model_type="clip_vision_model", hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_hidden_layers=v.depth, num_attention_heads=v.num_heads, image_size=v.image_size,
                  patch_size=v.patch_size, num_channels=v.in_channels, hidden_act=v.hidden_act)
    cfg = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=v.image_token_id,
                         projector_hidden_act="gelu", vision_feature_layer=v.feature_layer,
                         vision_feature_select_strategy="default", tie_word_embeddings=spec.tie_embeddings)
    impl = "eager" if attention is Attention.EAGER else "sdpa"
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = impl
    return cfg


def check_vlm(spec: ModelSpec, setup: TrainingSetup) -> None:
    check(spec, setup)
    setup.validate(spec)
    if spec.vision is None:
        raise SetupError(f"{spec.name} has no vision tower")
    if spec.vision.model_type == "llava" and setup.frames:
        raise SetupError(f"{spec.name}: LLaVA-1.5 takes images, not video frames")
    if spec.vision.model_type == "mllama":
        from vramlab.core.families.mllama.reference import check_mllama

        check_mllama(spec, setup)
    if spec.vision.model_type == "gemma3" and setup.frames:
        raise SetupError(f"{spec.name}: Gemma 3 takes images, not video frames")


def _lm_target_regex(spec: ModelSpec, setup: TrainingSetup) -> str:
    names = [n for n in spec.lora_modules(setup.lora_targets) if n != "lm_head"]
    parts = []
    if names:
        parts.append(rf".*language_model\.layers\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(names)})")
    if "lm_head" in setup.lora_targets:
        parts.append(r"lm_head")
    if setup.vision_tuning == "lora" and spec.vision.model_type in ("llava", "gemma3"):  # CLIP's / SigLIP's linears
        parts.append(r".*vision_tower\.(?:vision_model\.)?encoder\.layers\.\d+\."
                     r"(?:self_attn\.q_proj|self_attn\.k_proj|self_attn\.v_proj|self_attn\.out_proj|mlp\.fc1|mlp\.fc2)")
    elif setup.vision_tuning == "lora":
        parts.append(r".*visual\.blocks\.\d+\.(?:attn\.qkv|attn\.proj|mlp\.gate_proj|mlp\.up_proj|mlp\.down_proj)")
    return "^(?:" + "|".join(parts) + ")$"


class VlmHFModel(HFModel):
    """The VLM with the builder's ``forward(ids, labels) -> loss``; ``make_batch`` adds the images."""

    def __init__(self, inner: torch.nn.Module, plan: _Plan, tokens: VisionTokens) -> None:
        super().__init__(inner, plan)
        self.tokens = tokens
        self._images: dict[str, torch.Tensor] = {}
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        base.model.get_image_features = self._image_features(base.model.get_image_features)
        if hasattr(base.model, "get_video_features"):  # Qwen2.5-VL; LLaVA has images only
            base.model.get_video_features = self._image_features(base.model.get_video_features)

    # ---- where the vision side's bytes are filed (core.kinds) -------------------------------------------
    @staticmethod
    def parameter_kind(name: str) -> Kind | None:
        """The tower's and projector's parameters and buffers (LoRA adapters of the tower included)."""
        name = f".{name}"
        if ".multi_modal_projector." in name:
            return Kind.PROJECTOR_WEIGHTS
        if ".visual." not in name and ".vision_tower." not in name:
            return None
        return Kind.PROJECTOR_WEIGHTS if ".merger." in name else Kind.VISION_WEIGHTS

    def gradient_kind(self, name: str) -> Kind:
        return Kind.VISION_TRAINING if self.parameter_kind(name) else Kind.GRADIENTS

    def file_optimizer_states(self, optimizer: Any, tracker: Any) -> None:
        opt = getattr(optimizer, "inner", optimizer)
        state = getattr(getattr(opt, "opt", opt), "state", {})
        names = {id(p): n for n, p in self.named_parameters()}
        for p, st in state.items():
            if self.parameter_kind(names.get(id(p), "")):
                for k, t in st.items():
                    if isinstance(t, torch.Tensor) and k != "step":
                        tracker.reclassify(t, Kind.VISION_TRAINING)

    def _image_features(self, fn: Any) -> Any:
        """``get_image_features`` inside the vision-activations region (the tower's forward allocations)."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with context.region(Kind.VISION_ACTIVATIONS):
                return fn(*args, **kwargs)
        return wrapped

    def make_batch(self, setup: TrainingSetup, device: torch.device, real: bool) -> dict[str, torch.Tensor]:
        """The collator's batch: ids with the processor's image placeholders, labels, mask, pixel values, grid."""
        v = self.plan.spec.vision
        units = list(self.tokens.units)
        video = self.tokens.video
        row = [0] * setup.seq_len
        for u in units:
            row += [v.image_token_id] * u.llm_tokens
        if video is not None:
            row += [v.video_token_id] * video.llm_tokens
        b = setup.micro_batch

        def pixels(n: int) -> torch.Tensor:
            if real:
                return torch.randn(n, v.patch_features, dtype=torch.float32, device=device)
            return torch.empty(n, v.patch_features, dtype=torch.float32, device=device)

        self._images = {}
        with context.region(Kind.INPUTS):
            ids = torch.tensor([row] * b, dtype=torch.long, device=device)
            labels = ids.clone()
            mask = torch.ones(b, len(row), dtype=torch.long, device=device)
            if v.model_type == "gemma3":  # pixel values of every image and crop, token_type_ids
                from vramlab.core.families.gemma3.reference import make_images

                self._images.update(make_images(self, setup, ids, device, real))
            elif units and v.model_type == "llava":  # the processor's (images, channels, side, side), fp32
                shape = (b * len(units), v.in_channels, v.image_size, v.image_size)
                make = torch.randn if real else torch.empty
                self._images["pixel_values"] = make(shape, dtype=torch.float32, device=device)
            elif units:
                self._images["pixel_values"] = pixels(b * sum(u.patches for u in units))
                self._images["image_grid_thw"] = torch.tensor([list(u.grid) for _ in range(b) for u in units],
                                                              dtype=torch.long, device=device)
            if video is not None:
                self._images["pixel_values_videos"] = pixels(b * video.patches)
                self._images["video_grid_thw"] = torch.tensor([list(video.grid)] * b, dtype=torch.long,
                                                              device=device)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, **self._images}  # the batch holds them

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        images, self._images = self._images, {}
        try:
            amp = _AUTOCAST[-1] if self.plan.setup.autocast and _AUTOCAST else None
            with amp.region() if amp is not None else contextlib.nullcontext():  # HF Trainer's bf16 / fp16
                if self._kernel:  # another loss than transformers' own (core/simulation/loss.py)
                    from transformers.modeling_outputs import CausalLMOutput

                    out = CausalLMOutput(loss=loss_kernel(self.inner, self.plan.setup, ids, labels, use_cache=False,
                                                          **images))
                else:
                    out = self.inner(input_ids=ids, labels=labels, use_cache=False, **images)
            if amp is not None:  # accelerate's convert_outputs_to_fp32 (see measure.hf)
                out = _outputs_to_fp32(out)
            del images
            loss = out.loss
            if self._head_out_tensor is not None:
                context.label_backward(loss, self._head_out_tensor, Kind.LOGITS)
        finally:
            while self._cm:
                self._cm.pop().__exit__(None, None, None)
            self._head_out_tensor = None
        del out
        return loss


@contextlib.contextmanager
def autocast(setup: TrainingSetup) -> Iterator[None]:
    """CUDA autocast emulated around the run (:mod:`.autocast_cuda`) when ``setup`` trains under autocast: the
    same emulation as the text models' (``measure.hf.guard``), which :meth:`VlmHFModel.forward` opens."""
    if not setup.autocast:
        yield
        return
    from vramlab.core.simulation import autocast_cuda

    with autocast_cuda.emulating(autocast_cuda.CudaAutocast(DTYPES[setup.compute])) as mode:
        _AUTOCAST.append(mode)
        try:
            yield
        finally:
            _AUTOCAST.pop()


def with_lora(model: Any, setup: TrainingSetup, target_modules: str, device: torch.device | str) -> Any:
    """peft's ``get_peft_model`` over ``target_modules`` (a regex), the adapters made in the setup's adapter
    dtype on ``device`` and left there (peft would move each to its base layer's device, a copy on fake
    tensors that a GPU run does not make)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    lcfg = LoraConfig(r=setup.lora_rank, lora_alpha=setup.alpha, lora_dropout=setup.lora_dropout,
                      target_modules=target_modules, bias="none")
    from vramlab.core.tracing.hfquant import EmulatedQuantLinear, _lora_layer_for_emulated_quant

    if any(isinstance(m, EmulatedQuantLinear) for m in model.modules()):  # QLoRA (measure.hf's emulated base)
        lcfg._register_custom_module({EmulatedQuantLinear: _lora_layer_for_emulated_quant()})
    move = BaseTunerLayer._move_adapter_to_device_of_base_layer
    old_default = torch.get_default_dtype()
    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    torch.set_default_dtype(DTYPES[setup.adapter_dtype])
    try:
        with torch.device(device):
            return get_peft_model(model, lcfg, autocast_adapter_dtype=setup.adapter_dtype is DType.FP32)
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move
        torch.set_default_dtype(old_default)


def build_vlm(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
              config=None) -> VlmHFModel:  # noqa: ANN001
    check_vlm(spec, setup)
    with _moves_that_change_nothing_are_skipped():
        if spec.vision.model_type == "mllama":
            from vramlab.core.families.mllama.reference import build_mllama

            return build_mllama(spec, setup, device, real, config)
        return _build(spec, setup, device, real, config)


def _build(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str, real: bool, config) -> VlmHFModel:  # noqa: ANN001
    from transformers import (
        Gemma3ForConditionalGeneration,
        LlavaForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
    )

    cfg = config if config is not None else hf_vlm_config(spec, setup.attention)
    cls = {"llava": LlavaForConditionalGeneration, "gemma3": Gemma3ForConditionalGeneration}.get(
        spec.vision.model_type, Qwen2_5_VLForConditionalGeneration)
    build = contextlib.nullcontext()
    if spec.vision.model_type == "gemma3":
        from vramlab.core.families.gemma3.reference import construction

        build = construction(real)
    if setup.weight_dtype.is_quantized:  # every linear layer stored as bitsandbytes stores it (measure.hf)
        from vramlab.core.tracing.hfconfig import CAUSAL, Task
        from vramlab.core.tracing.hfquant import _load_quantized

        with build:
            model = _load_quantized(Task(CAUSAL, cfg, cls), cfg, setup, device)
    else:
        with torch.device(device), build:
            model = cls._from_config(cfg, dtype=DTYPES[setup.weight_dtype])
    if not isinstance(build, contextlib.nullcontext):
        model.tie_weights()  # no_init_weights skips init_weights, which ties the head too
    tracker = context.current()
    if tracker is not None and spec.tie_embeddings:
        tracker.restart_phase_peak()  # from_config's untied head before tying (see measure.hf)
    model.config.use_cache = False
    tune = setup.vision_tuning
    if setup.uses_lora:
        model = with_lora(model, setup, _lm_target_regex(spec, setup), device)
    for name, p in model.named_parameters():
        kind = VlmHFModel.parameter_kind(name)
        if kind is None or "lora_" in name:
            continue
        merger = kind is Kind.PROJECTOR_WEIGHTS
        p.requires_grad = (tune == "full") or (merger and tune == "projector")
    if setup.grad_ckpt:  # as measure.hf: reentrant checkpointing of every decoder layer and vision block
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        enable_checkpointing(base, reentrant=setup.ckpt_reentrant)
        if not model.get_input_embeddings().weight.requires_grad:
            base.enable_input_require_grads()  # the text embeddings' and the tower's patch embedding's outputs
        if not setup.vision_ckpt:  # the language model's layers only
            tower = base.model.visual if spec.vision.model_type == "qwen2_5_vl" else base.model.vision_tower
            for module in tower.modules():
                if hasattr(module, "gradient_checkpointing"):
                    module.gradient_checkpointing = False
    tokens = vision_tokens(spec.vision.processor, setup.vision_input())
    return VlmHFModel(model, _Plan(spec, setup, torch.device(device), real, Sharder.for_setup(setup)), tokens)


def realized(fn: Any) -> Any:
    """``fn(grid_thw, ...)`` run on real tensors outside every mode (neither fake nor counted); its results enter
    the step as constants. For transformers' vision helpers that read the grid's values."""
    from torch.utils._python_dispatch import _disable_current_modes

    def wrapper(grid_thw: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("kwargs", None)
        rows = grid_thw.tolist()
        with _disable_current_modes():
            out = fn(torch.tensor(rows), *args, **kwargs)
            values = [(o.tolist(), o.dtype) if isinstance(o, torch.Tensor) else o
                      for o in (out if isinstance(out, tuple) else (out,))]
        made = tuple(torch.tensor(v[0], dtype=v[1]) if isinstance(v, tuple) else v for v in values)
        return made if isinstance(out, tuple) else made[0]
    return wrapper


@contextlib.contextmanager
def fake_values() -> Iterator[None]:
    """Let the model read the few values it needs under FakeTensorMode (see the module's docstring)."""
    import torch._subclasses.fake_tensor as ft
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as mq

    saved = {name: getattr(mq, name) for name in _HELPERS}
    limit = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = _CONSTANT_LIMIT
    for name, fn in saved.items():
        setattr(mq, name, realized(fn))
    try:
        yield
    finally:
        ft.CONSTANT_NUMEL_LIMIT = limit
        for name, fn in saved.items():
            setattr(mq, name, fn)


