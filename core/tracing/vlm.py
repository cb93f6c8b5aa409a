"""What transformers' vision-language classes share when they run as the measured model, whether a family
builds them (``core/families/<family>/reference.py``) or the trace does (:mod:`.vlm_traced`): the forward
that hands the batch's images to the class with the ids (:class:`VisionHFModel`), peft's LoRA made where the
run makes it (:func:`with_lora`), CUDA autocast emulated (:func:`autocast`), and the few values the class
reads under fake tensors kept real (:func:`constants`, :func:`realized`, :func:`realized_helpers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.simulation.loss import causal_parts
from vramlab.core.spec.options import DType
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.tracing.hf import AUTOCAST_RUNNING, DTYPES, HFModel, checkpoint_layers

_CONSTANT_LIMIT = 1 << 22  # elements: token ids of a long batch, the grid-derived index tensors


class VisionHFModel(HFModel):
    """An HF model whose ``make_batch`` leaves its image inputs in ``_images``: :meth:`forward` hands them to
    the class with the ids (and lets them go with the step's locals)."""

    _images: dict[str, torch.Tensor]
    _backbone_out: Any = None

    def gradient_kind(self, name: str) -> Kind:
        return Kind.VISION_TRAINING if self.parameter_kind(name) else Kind.GRADIENTS

    def file_optimizer_states(self, optimizer: Any, tracker: Any) -> None:
        opt = getattr(optimizer, "inner", optimizer)
        state = getattr(getattr(opt, "opt", opt), "state", {})  # an attribute, not a model type
        names = {id(p): n for n, p in self.named_parameters()}
        for p, st in state.items():
            if self.parameter_kind(names.get(id(p), "")):
                for k, t in st.items():
                    if isinstance(t, torch.Tensor) and k != "step":
                        tracker.reclassify(t, Kind.VISION_TRAINING)

    def _inputs(self) -> dict[str, Any]:
        images, self._images = self._images, {}
        return {"use_cache": False, **images}

    # ---- TRL's trainers (core/objectives/: DPO's and KTO's forward, GRPO's prompts, generation and scoring) ------
    def _row(self, text: int, images: bool = True) -> list[int]:
        """One sample's token ids: ``text`` text tokens, then (``images``) the processor's placeholders."""
        raise NotImplementedError

    def token_rows(self, rows: int, text: int, images: bool = True) -> torch.Tensor:
        """``rows`` samples of :meth:`_row` as TRL pads them from the processor's token lists (in the inputs
        region): a tensor made from Python data, whose values (the placeholders) the class reads."""
        with context.region(Kind.INPUTS):
            return torch.tensor([self._row(text, images)] * rows, dtype=torch.long, device=self.plan.device)

    def prompt_batch(self, setup: TrainingSetup, rows: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """GRPOTrainer's processor over ``rows`` prompts with their images (``_tokenize_prompts``, and again in
        ``_generate_and_score_completions``), moved to the device: the ids with the placeholders, the attention
        mask and the family's pixel inputs."""
        batch = self.make_batch(setup.replace(micro_batch=rows, seq_len=setup.prompt_tokens), self.plan.device,
                                self.plan.real, labels=False)
        self._images = {}  # the caller holds them
        ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
        return ids, mask, batch

    def decode(self, ids: torch.Tensor, cache: Any, **images: torch.Tensor) -> torch.Tensor:
        """:meth:`HFModel.decode` with the prompts' ``images`` (the prefill's); the output (the tower's with it)
        is held until :meth:`release_outputs` (``GenerationMixin._sample``'s ``del outputs``). Sharded, the units
        are gathered by their hooks, as for :meth:`backbone`."""
        try:
            self._backbone_out = self.inner(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                                            **images)
            return self._backbone_out.logits
        finally:
            while self._cm:
                self._cm.pop().__exit__(None, None, None)
            self._head_node = None

    def backbone(self, ids: torch.Tensor, checkpointing: bool | None = None, **images: torch.Tensor) -> torch.Tensor:
        """``add_fused_lm_head``'s forward up to the head: the class's base model (``base_model_prefix``) over the
        ids and the batch's ``images``; its output (the image features with it) is held until
        :meth:`release_outputs`, as the patched forward's local."""
        backbone, _head, _post = causal_parts(self.inner)
        setup = self.plan.setup
        if checkpointing is False and setup.grad_ckpt:
            # TRL's disable_gradient_checkpointing around the reference forward (then enabled again: every module)
            base = self.inner.get_base_model() if hasattr(self.inner, "get_base_model") else self.inner
            base.activation_checkpointing_disable()
            try:
                self._backbone_out = backbone(input_ids=ids, use_cache=False, **images)
            finally:
                checkpoint_layers(base, setup)
        else:
            self._backbone_out = backbone(input_ids=ids, use_cache=False, **images)
        return self._backbone_out[0]

    def release_outputs(self) -> None:
        self._backbone_out = None



@contextlib.contextmanager
def autocast(setup: TrainingSetup) -> Iterator[None]:
    """CUDA autocast emulated around the run (:mod:`.autocast_cuda`) when ``setup`` trains under autocast: the
    same emulation as the text models' (``tracing.hf.guard``), which :meth:`VisionHFModel.forward` opens; none under
    FSDP mixed precision (fp32 shards gathered in the compute dtype), as there."""
    if not setup.autocast or setup.sharded_mixed_precision:
        yield
        return
    from vramlab.core.simulation import autocast_cuda

    with autocast_cuda.emulating(autocast_cuda.CudaAutocast(DTYPES[setup.compute])) as mode:
        AUTOCAST_RUNNING.append(mode)
        try:
            yield
        finally:
            AUTOCAST_RUNNING.pop()


def with_lora(model: Any, setup: TrainingSetup, target_modules: str, device: torch.device | str) -> Any:
    """peft's ``get_peft_model`` over ``target_modules`` (a regex), the adapters made in the setup's adapter
    dtype on ``device`` and left there (peft would move each to its base layer's device, a copy on fake
    tensors that a GPU run does not make)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    lcfg = LoraConfig(r=setup.lora_rank, lora_alpha=setup.alpha, lora_dropout=setup.lora_dropout,
                      target_modules=target_modules, bias="none")
    from vramlab.core.tracing.hfquant import EmulatedQuantLinear, lora_layer_for_emulated_quant

    if any(isinstance(m, EmulatedQuantLinear) for m in model.modules()):  # QLoRA (tracing.hf's emulated base)
        lcfg._register_custom_module({EmulatedQuantLinear: lora_layer_for_emulated_quant()})
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


def freeze_language_model(model: Any, setup: TrainingSetup) -> None:
    """``--method freeze`` on a vision-language model, as LLaMA-Factory 0.9.5's ``_setup_freeze_tuning`` runs it on
    a composite model: the last ``trainable_layers`` of the language model's layers train (``text_config``'s
    ``num_hidden_layers`` count them) and the ``freeze_extra`` modules, nothing else; the caller then sets the
    tower and the projector as ``vision_tuning`` says (LLaMA-Factory's ``freeze_vision_tower`` and
    ``freeze_multi_modal_projector``, both true by default: ``vision_tuning`` frozen)."""
    from vramlab.core.tracing.hflora import freeze_all_but_last

    inner = model.model
    name = next(n for n in ("language_model", "text_model") if hasattr(inner, n))
    # the decoder's own list of layers (Mllama's mixes self- and cross-attention layers: one list, two classes)
    stack = getattr(inner, name).layers
    freeze_all_but_last(model, int(setup.trainable_layers or 0), setup.freeze_extra, (f"model.{name}.layers", stack))


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
def constants() -> Iterator[None]:
    """Small integer tensors made from Python data keep their values under FakeTensorMode (torch's constant
    propagation, whose size limit is raised to hold the token ids of a long batch)."""
    import torch._subclasses.fake_tensor as ft

    limit = ft.CONSTANT_NUMEL_LIMIT
    ft.CONSTANT_NUMEL_LIMIT = _CONSTANT_LIMIT
    try:
        yield
    finally:
        ft.CONSTANT_NUMEL_LIMIT = limit


@contextlib.contextmanager
def realized_helpers(module: Any, names: tuple[str, ...]) -> Iterator[None]:
    """``module``'s helpers ``names`` run on real values (:func:`realized`) while the context is open."""
    saved = {name: getattr(module, name) for name in names}
    for name, fn in saved.items():
        setattr(module, name, realized(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
