"""What the vision-language references share: a family's real transformers class as the measured model (the
reference for the estimate of its ``core/families/<family>/program.py``).

A family's ``reference`` piece gives ``hf_config(spec, attention)``, ``check(spec, setup)``,
``build(spec, setup, device, real, config)`` and ``guard(setup)``; most build with :func:`build_model`:
transformers' class from the spec with random weights (peft for LoRA, the language model's targets by regex so
that the tower's same-named layers are adapted only when the setup says so), the tower and projector frozen as
``vision_tuning`` says, wrapped in a :class:`VlmHFModel` subclass that makes the processor's batch.

Under fake tensors the model reads a few values: through its placeholder check, the token ids (and Qwen's
grid). :func:`constants` makes small integer tensors created from Python data keep their values (torch's
FakeTensorMode constant propagation, whose size limit it raises), and :func:`realized_helpers` runs a
family's helpers that read them on real tensors whose results enter the fake run as such constants. Nothing
else changes: every tensor of the step is the model's own.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from vramlab.core.checks import SetupError
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.simulation.shard import Sharder, shard_module
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention, Method
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
from vramlab.core.tracing.hfconfig import wrapped_units
from vramlab.core.tracing.vlm import VisionHFModel, autocast, constants, freeze_language_model, with_lora
from vramlab.core.vision import VisionTokens, vision_tokens


def check_vlm(spec: ModelSpec, setup: TrainingSetup) -> None:
    """What every vision-language reference checks first (a family's ``check`` adds its own)."""
    check(spec, setup)
    setup.validate(spec)
    if spec.vision is None:
        raise SetupError(f"{spec.name} has no vision tower")


def with_attention(cfg: Any, attention: Attention) -> Any:
    """``cfg`` with the setup's attention implementation on it and on its text and vision configs."""
    impl = "eager" if attention is Attention.EAGER else "sdpa"
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = impl
    return cfg


def build_family(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str, real: bool, config: Any,
                 family: tuple[Any, Any], cls_name: str, wrapper: type[VlmHFModel], tower: str, tower_lora: str,
                 construction: Any = None) -> VlmHFModel:
    """A family reference's ``build``: its ``check``, then transformers' ``cls_name`` from ``config`` (default:
    the family's ``hf_config`` of the spec) by :func:`build_model`. ``family``: its (check, hf_config)."""
    import transformers

    check, hf_config = family
    check(spec, setup)
    with moves_that_change_nothing_are_skipped():
        cfg = config if config is not None else hf_config(spec, setup.attention)
        return build_model(spec, setup, device, real, cfg, getattr(transformers, cls_name), wrapper, tower,
                           tower_lora, construction)


def vit_vision_config(v: Any, model_type: str | None = None, **more: Any) -> dict[str, Any]:
    """A CLIP or SigLIP tower's ``vision_config`` from the spec's :class:`~vramlab.core.vision.VisionSpec`
    (``model_type`` where the parent config's default is not the tower's; ``more``: the family's own keys)."""
    typed = {"model_type": model_type} if model_type is not None else {}
    return dict(**typed, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=v.depth,
                num_attention_heads=v.num_heads, image_size=v.image_size, patch_size=v.patch_size,
                num_channels=v.in_channels, hidden_act=v.hidden_act, **more)


def construction(real: bool) -> Any:
    """What a SigLIP family's class is built in: SigLIP's ``_init_weights`` draws truncated normals
    (``trunc_normal_`` reads values, which fake tensors have not); torch's in-place initialisers allocate
    nothing, so a fake build skips them (transformers' ``no_init_weights``, after which :func:`build_model`
    ties the head as ``init_weights`` would) and a real one keeps them."""
    if real:
        return contextlib.nullcontext()
    from transformers.initialization import no_init_weights

    return no_init_weights()


def images_only(spec: ModelSpec, setup: TrainingSetup, family: str) -> None:
    """A family whose processor takes images, not video frames."""
    if setup.frames:
        raise SetupError(f"{spec.name}: {family} takes images, not video frames")


# the tower's linears that ``vision_tuning`` lora adapts, as a regex: CLIP's and SigLIP's encoder layers
VIT_LORA = (r".*vision_tower\.(?:vision_model\.)?encoder\.layers\.\d+\."
            r"(?:self_attn\.q_proj|self_attn\.k_proj|self_attn\.v_proj|self_attn\.out_proj|mlp\.fc1|mlp\.fc2)")


def lm_target_regex(spec: ModelSpec, setup: TrainingSetup, tower: str, layers: str = "self_attn|mlp") -> str:
    """peft's targets: the language model's ``layers`` modules named by the setup (so that the tower's
    same-named linears are adapted only when the setup says so), the head, and the ``tower`` regex under
    ``vision_tuning`` lora."""
    names = [n for n in spec.lora_modules(setup.lora_targets) if n != "lm_head"]
    parts = []
    if names:
        parts.append(rf".*language_model\.layers\.\d+\.(?:{layers})\.(?:{'|'.join(names)})")
    if "lm_head" in setup.lora_targets:
        parts.append(r"lm_head")
    if setup.vision_tuning == "lora":
        parts.append(tower)
    return "^(?:" + "|".join(parts) + ")$"


class VlmHFModel(VisionHFModel):
    """The VLM with the builder's ``forward(ids, labels) -> loss``; ``make_batch`` adds the images."""

    def __init__(self, inner: torch.nn.Module, plan: BuildPlan, tokens: VisionTokens) -> None:
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

    def _image_features(self, fn: Any) -> Any:
        """``get_image_features`` inside the vision-activations region (the tower's forward allocations)."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with context.region(Kind.VISION_ACTIVATIONS):
                return fn(*args, **kwargs)
        return wrapped

    def make_batch(self, setup: TrainingSetup, device: torch.device, real: bool,
                   labels: bool = True) -> dict[str, torch.Tensor]:
        """The collator's batch: ids with the processor's image placeholders, labels (unless ``labels`` is
        false: a preference collator's batch has none), mask, and the family's pixel inputs
        (:meth:`pixel_inputs`)."""
        row = self._row(setup.seq_len)
        b = setup.micro_batch
        self._images = {}
        with context.region(Kind.INPUTS):
            ids = torch.tensor([row] * b, dtype=torch.long, device=device)
            out = {"input_ids": ids, "labels": ids.clone()} if labels else {"input_ids": ids}
            out["attention_mask"] = torch.ones(b, len(row), dtype=torch.long, device=device)
            self._images = self.pixel_inputs(setup, ids, device, real)
        return {**out, **self._images}  # the batch holds them

    def _row(self, text: int, images: bool = True) -> list[int]:
        """One sample's token ids: ``text`` text tokens, then (``images``) every image's and the video's
        placeholders."""
        v = self.plan.spec.vision
        row = [0] * text
        if not images:
            return row
        for u in self.tokens.units:
            row += [v.image_token_id] * u.llm_tokens
        if self.tokens.video is not None:
            row += [v.video_token_id] * self.tokens.video.llm_tokens
        return row

    # ---- a preference objective's step (core/objectives/dpo/reference.py) ----------------------------------
    def preference_batch(self, setup: TrainingSetup, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
        """TRL 1.16.0's ``DataCollatorForVisionPreference``: ``rows`` (chosen then rejected) rows of ids with the
        image placeholders in the prompt, every prompt's images repeated for its rejected row (the processor
        makes the pixel inputs of ``rows`` samples), the attention and completion masks; no labels."""
        batch = self.make_batch(setup.replace(micro_batch=rows), device, self.plan.real, labels=False)
        self._images = {}  # the batch holds them; the forwards get them from it
        with context.region(Kind.INPUTS):
            batch["completion_mask"] = torch.empty_like(batch["input_ids"])
        return batch

    def pixel_inputs(self, setup: TrainingSetup, ids: torch.Tensor, device: torch.device,
                     real: bool) -> dict[str, torch.Tensor]:
        """The processor's image inputs beside the ids (in the inputs region): the family's own."""
        raise NotImplementedError

    def tiles_and_token_types(self, tiles: int, ids: torch.Tensor, device: torch.device, real: bool,
                              on_images: int) -> dict[str, torch.Tensor]:
        """A SigLIP and Gemma processor's ``pixel_values`` (``tiles`` square tiles) and ``token_type_ids``:
        ``on_images`` on the image tokens, the other of 0 and 1 on the text."""
        v = self.plan.spec.vision
        out: dict[str, torch.Tensor] = {}
        if tiles:
            out["pixel_values"] = self.square_pixels(tiles, device, real)
        with context.region(Kind.INPUTS):
            images = ids == v.image_token_id if on_images else ids != v.image_token_id
            out["token_type_ids"] = images.long()
        return out

    def square_pixels(self, tiles: int, device: torch.device, real: bool) -> torch.Tensor:
        """A fixed-size tower's ``pixel_values``: ``tiles`` (channels, side, side) tiles in fp32."""
        v = self.plan.spec.vision
        make = torch.randn if real else torch.empty
        return make((tiles, v.in_channels, v.image_size, v.image_size), dtype=torch.float32, device=device)

def build_model(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str, real: bool, cfg: Any, cls: type,
                wrapper: type[VlmHFModel], tower: str, tower_lora: str, construction: Any = None) -> VlmHFModel:
    """transformers' ``cls`` from ``cfg`` (quantized as bitsandbytes stores it where the setup says), peft's
    LoRA, the tower and projector frozen as ``vision_tuning`` says, checkpointing (the tower, ``model.<tower>``,
    too under ``vision_ckpt``), wrapped with the batch of ``wrapper``. ``construction``: a context the class
    is built in (None: torch's own initialisers run)."""
    build = construction if construction is not None else contextlib.nullcontext()
    if setup.weight_dtype.is_quantized:  # every linear layer stored as bitsandbytes stores it (tracing.hf)
        from vramlab.core.tracing.hfconfig import CAUSAL, Task
        from vramlab.core.tracing.hfquant import load_quantized

        with build:
            model = load_quantized(Task(CAUSAL, cfg, cls), cfg, setup, device)
    else:
        with torch.device(device), build:
            model = cls._from_config(cfg, dtype=built_dtype(setup))
    if not isinstance(build, contextlib.nullcontext):
        model.tie_weights()  # no_init_weights skips init_weights, which ties the head too
    tracker = context.current()
    if tracker is not None and spec.tie_embeddings:
        tracker.restart_phase_peak()  # from_config's untied head before tying (see tracing.hf)
    model.config.use_cache = False
    tune = setup.vision_tuning
    if setup.uses_lora:
        model = with_lora(model, setup, lm_target_regex(spec, setup, tower_lora), device)
    elif setup.method is Method.FREEZE:
        freeze_language_model(model, setup)
    for name, p in model.named_parameters():
        kind = wrapper.parameter_kind(name)
        if kind is None or "lora_" in name:
            continue
        merger = kind is Kind.PROJECTOR_WEIGHTS
        p.requires_grad = (tune == "full") or (merger and tune == "projector")
    if setup.grad_ckpt:  # as tracing.hf: every decoder layer and vision block checkpointed
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        checkpoint_layers(base, setup)  # in the setup's mode, with its checkpoint function
        if not model.get_input_embeddings().weight.requires_grad:
            base.enable_input_require_grads()  # the text embeddings' and the tower's patch embedding's outputs
        if not setup.vision_ckpt:  # the language model's layers only
            for module in getattr(base.model, tower).modules():
                if hasattr(module, "gradient_checkpointing"):
                    module.gradient_checkpointing = False
    return wrapped(model, spec, setup, device, real, wrapper)


def built_dtype(setup: TrainingSetup) -> torch.dtype:
    """The dtype the class is built in: the weights'; the compute dtype under FSDP mixed precision, whose shards
    are fp32 (as tracing.hf builds a text model)."""
    return DTYPES[setup.compute] if setup.sharded_mixed_precision else DTYPES[setup.weight_dtype]


def wrapped(model: torch.nn.Module, spec: ModelSpec, setup: TrainingSetup, device: torch.device | str, real: bool,
            wrapper: type[VlmHFModel]) -> VlmHFModel:
    """``model`` wrapped with the batch of ``wrapper``; under ZeRO-3 / FSDP sharded over the units accelerate's FSDP
    makes (``wrapped_units``, core/tracing/hfconfig.py), the rest the root unit."""
    liger_kernels(model, spec, setup)  # liger's patch after peft, as HF Trainer applies it (core/tracing/hf.py)
    notes = hub_kernels(model, spec, setup, real)  # then train()'s kernelize, the tower's decorated norms too
    tokens = vision_tokens(spec.vision.processor, setup.vision_input())
    sharder = Sharder.for_setup(setup)
    out = wrapper(model, BuildPlan(spec, setup, torch.device(device), real, sharder), tokens)
    out.notes = (*out.notes, *notes)
    if sharder is not None and sharder.params_sharded:
        shard_module(model, sharder, wrapped_units(model), out)
    return out


def running(setup: TrainingSetup, *more: Any) -> contextlib.ExitStack:
    """What a vision-language reference's step runs under: :func:`constants`, transformers' packed-sequence
    check skipped, CUDA autocast emulated where the setup trains under it, and the family's ``more``."""
    from vramlab.core.tracing.hf import no_packed_sequence_check

    stack = contextlib.ExitStack()
    for cm in (constants(), no_packed_sequence_check(), autocast(setup), *more):
        stack.enter_context(cm)
    return stack
