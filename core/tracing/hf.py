"""The real Hugging Face model class as the measured model (optional: ``pip install vramlab[hf]``).

``simulate(..., hf=True)`` / ``vramlab simulate --hf`` builds ``transformers``' own model class from the
spec (or from the user's ``config.json``) with random weights and, for LoRA, wraps it with ``peft``; the
same instrumented step then measures it. This checks our builder against the reference implementation
and measures architectures the builder does not know. Never ``trust_remote_code``: only config and model
classes shipped in ``transformers`` are used.

This module is the build: any model type the installed transformers ships, from its config
(:mod:`.hfconfig`: which class, at which reduced depth, and the full model's exact parameter count), with
LoRA and freezing on the model's own module names (:mod:`.hflora`) and NF4 / int8 weights emulated with
bitsandbytes' storage (:mod:`.hfquant`), each with its own loss; anything else is refused with the reason.

Under fake tensors two things are guarded: transformers' packed-sequence check reads ``position_ids``
values (fake tensors have none) and would otherwise switch to a 4-D mask and another attention path; and
dtypes are set at construction (``Module.to(dtype)`` fails on fake tensors). The options that are not the
model's own apply to it as transformations: a loss kernel (:mod:`vramlab.core.simulation.loss`) and sharding
(:mod:`vramlab.core.simulation.shard`'s ``shard_module``, ZeRO-3 / FSDP applied to the built model as
``fully_shard`` applies it).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramlab.core.checks import SetupError
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.simulation.causal_conv1d import kernelize_conv
from vramlab.core.simulation.fla import kernelize_fla, kernelize_norms
from vramlab.core.simulation.liger import kernelize_hub, patch_model, patch_recorded
from vramlab.core.simulation.loss import apply as loss_kernel
from vramlab.core.simulation.loss import causal_parts, replaces_loss
from vramlab.core.simulation.mamba import bypassed_adapters, kernelize_mamba, runs_fused
from vramlab.core.simulation.moe import cuda_fallback
from vramlab.core.simulation.offload_ckpt import checkpoint_to_host
from vramlab.core.simulation.rope import kernelize_rope
from vramlab.core.simulation.shard import Sharder, shard_module
from vramlab.core.simulation.unsloth import patch_model as patch_unsloth
from vramlab.core.simulation.unsloth_gc import checkpoint_function
from vramlab.core.spec.hub_kernels import HUB_RMS_NORM, MAMBA2_OUT_PROJ, ROPE_GRADIENT, UNMODELLED, hub_norms, hub_rope
from vramlab.core.spec.hub_kernels import default_on as hub_default_on
from vramlab.core.spec.hub_kernels import runs as hub_runs
from vramlab.core.spec.liger import liger_patch, recorded_patch
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention, DType, Method
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import unsloth_patch
from vramlab.core.tracing.hfconfig import (
    CAUSAL,
    MASKED,
    Depth,
    Task,
    available,
    default_device,
    full_param_count,
    hf_config,
    layer_counts,
    layer_stacks,
    plan_depth,
    task_of,
)
from vramlab.core.tracing.hflora import (
    NO_DROPOUT_NOTE,
    apply_lora,
    freeze_all_but_last,
    param_wrapped,
    upcast_trainable,
)
from vramlab.core.tracing.hfquant import load_quantized, quantized_notes
from vramlab.core.versions import installed

DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def check(spec: ModelSpec | None, setup: TrainingSetup) -> None:
    if not available():
        raise SetupError("the HF reference path needs transformers and peft: pip install 'vramlab[hf]'")


@dataclass(frozen=True)
class _Shape:
    """What the step driver reads from a spec when the model comes from a config alone."""

    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class BuildPlan:
    """What the step driver reads from a model (see measure.model.Plan)."""

    spec: Any  # a ModelSpec, or a _Shape for a model built from its config alone
    setup: TrainingSetup
    device: torch.device
    real: bool
    sharder: Any = None  # rank 0 of a sharded run (core/simulation/shard.py), or None


class HFModel(nn.Module):
    """An HF language model (optionally peft-wrapped) with the builder's ``forward(ids, labels) -> loss``.

    ``notes``: what the build chose for the user to know (eager attention where the class has no SDPA path,
    the language model of a multimodal config); ``full_params``: the full-depth model's parameter count when
    the model was built at reduced depth (else None)."""

    def __init__(self, inner: nn.Module, plan: BuildPlan, task: str = CAUSAL, notes: tuple[str, ...] = (),
                 full_params: int | None = None, depth: int | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan
        self.task = task
        self.notes = notes
        self.full_params = full_params
        self.depth = depth
        head = inner.get_output_embeddings()
        # another loss than transformers' own (core/simulation/loss.py): the kernel labels its own regions
        self._kernel = task == CAUSAL and replaces_loss(plan.setup)
        if replaces_loss(plan.setup) and task != CAUSAL:
            raise SetupError(f"a {task} model trains with its own loss: a chunked or 16-bit loss kernel patches a "
                             "causal LM's head (as Liger, Cut Cross Entropy and LitGPT do)")
        self._cm: list[contextlib.AbstractContextManager] = []
        head.register_forward_pre_hook(self._enter_logits)
        head.register_forward_hook(self._head_out)
        self._head_node: Any = None  # the head's autograd node: where the loss's backward labelling stops

    def _enter_logits(self, _mod, _args) -> None:  # noqa: ANN001
        if self._kernel:
            return
        cm = context.region(Kind.LOGITS)
        cm.__enter__()
        self._cm.append(cm)

    def _head_out(self, _mod, _args, out) -> None:  # noqa: ANN001
        if not self._kernel:  # its node, not the output: the forward frees the logits as it goes (a softcap)
            self._head_node = out.grad_fn

    def _run(self, ids: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> Any:
        """The model's forward with labels, or its base model and the setup's loss kernel (:mod:`.loss`)."""
        if not self._kernel:
            return self.inner(input_ids=ids, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=loss_kernel(self.inner, self.plan.setup, ids, labels, **kwargs))

    def _inputs(self) -> dict[str, Any]:
        """What the class gets beside the ids and labels (a subclass adds the batch's images)."""
        return {} if self.task == MASKED else {"use_cache": False}

    # ---- what TRL's trainers run of it (core/objectives/shared/reference.py) ------------------------------------
    @property
    def lm_head(self) -> nn.Module:
        return causal_parts(self.inner)[1]

    def backbone(self, ids: torch.Tensor, checkpointing: bool | None = None) -> torch.Tensor:
        """The base model's last hidden states: what TRL 1.16.0's ``add_fused_lm_head`` runs before its own head
        (``checkpointing`` False: TRL's no-grad reference forward, where checkpointing keeps nothing anyway).
        Sharded, the root unit is gathered first, as the model's own forward hook does (shard_module)."""
        sh = self.plan.sharder
        if sh is not None and sh.params_sharded:
            sh.unshard(-1)
        return causal_parts(self.inner)[0](input_ids=ids, **self._inputs())[0]

    def _amp(self) -> Any:
        """The emulated CUDA autocast of the run (HF Trainer's bf16 / fp16), or None."""
        return AUTOCAST_RUNNING[-1] if self.plan.setup.autocast and AUTOCAST_RUNNING else None

    def autocast_region(self) -> contextlib.AbstractContextManager:
        """accelerate's autocast around the model's (patched) forward, emulated as for :meth:`forward`: TRL's
        backbone and fused head under one region, one weight cache."""
        amp = self._amp()
        return amp.region() if amp is not None else contextlib.nullcontext()

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward without labels, as TRL 1.16.0's ORPO and CPO trainers call it
        (``concatenated_forward``: ``model(input_ids, attention_mask=..., use_cache=False).logits``, the full
        logits); under the trainer's autocast accelerate's ``convert_outputs_to_fp32`` copies them to fp32. The
        rows are full length, so their all-ones mask is one transformers drops on a device (``sdpa_mask``'s
        ``_ignore_causal_mask_sdpa``) but cannot read on fake tensors (it would build a 4-D mask): none is passed,
        as for :meth:`backbone`, whose root unit it gathers too."""
        sh = self.plan.sharder
        if sh is not None and sh.params_sharded:
            sh.unshard(-1)
        amp = self._amp()
        try:
            with amp.region() if amp is not None else contextlib.nullcontext():
                out = self.inner(input_ids=ids, **self._inputs())
            if amp is not None:
                with context.region(Kind.LOGITS):
                    out = _outputs_to_fp32(out)
            return out.logits
        finally:
            while self._cm:
                self._cm.pop().__exit__(None, None, None)
            self._head_node = None

    # ---- GRPO's generation (core/objectives/grpo/reference.py: the loop of GenerationMixin._sample) --------------
    def new_cache(self) -> Any:
        """``generate``'s cache: transformers' ``DynamicCache`` for this config, its growth labelled as the KV
        cache (``DynamicLayer.update``: ``torch.cat`` of the cached and the new keys and values)."""
        return _labelled_cache()(config=self.inner.config)

    def decode(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """One forward of ``generate``'s loop (the prompts' prefill, then one token): the class's own with the
        cache and ``logits_to_keep=1``, outside the trainer's autocast (TRL unwraps the model to generate). The
        rows are unpadded, so no attention mask (as :meth:`logits`); sharded, the root unit gathered."""
        sh = self.plan.sharder
        if sh is not None and sh.params_sharded:
            sh.unshard(-1)
        try:
            return self.inner(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        finally:
            while self._cm:
                self._cm.pop().__exit__(None, None, None)
            self._head_node = None

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        kwargs = self._inputs()
        amp = self._amp()
        try:
            if amp is None:
                out = self._run(ids, labels, kwargs)
            else:
                # HF Trainer's bf16 / fp16: accelerate wraps the forward in autocast and then converts the
                # outputs to fp32 (accelerate ``prepare_model``: ``convert_outputs_to_fp32``): 16-bit logits
                # get an fp32 copy, alive until the Trainer drops the outputs and keeps the loss
                with amp.region():
                    out = self._run(ids, labels, kwargs)
                out = _outputs_to_fp32(out)
            del kwargs  # the inputs go with the step's locals
            loss = out.loss
            if self._head_node is not None:
                context.label_backward(loss, self._head_node, Kind.LOGITS)
        finally:
            while self._cm:
                self._cm.pop().__exit__(None, None, None)
            self._head_node = None
        del out  # HF Trainer keeps only the loss
        return loss


AUTOCAST_RUNNING: list = []  # the CUDA autocast emulation of the run in progress (see guard)


def _outputs_to_fp32(out: Any) -> Any:
    """accelerate's ``convert_to_fp32`` on a model output: every fp16 / bf16 tensor in it as an fp32 copy."""
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            out[key] = value.float()
    return out


@functools.cache
def _labelled_cache() -> type:
    """transformers' ``DynamicCache`` with its growth labelled as the KV cache (a subclass: a wrapped bound method
    would make a reference cycle, the cache freed only by the garbage collector)."""
    from transformers import DynamicCache

    class LabelledCache(DynamicCache):
        def update(self, *args: Any, **kwargs: Any) -> Any:
            with context.region(Kind.KV_CACHE):
                return super().update(*args, **kwargs)

    return LabelledCache


@contextlib.contextmanager
def guard(setup: TrainingSetup) -> Iterator[None]:
    """What the HF path needs around a fake-tensor run: no packed-sequence check, dropout as CUDA dispatches it
    (:mod:`.cuda_dropout`), and CUDA autocast emulated (:mod:`.autocast_cuda`) when the setup trains under
    autocast."""
    from vramlab.core.simulation import (
        autocast_cuda,  # autocast's op lists hold the functions as torch defines them
        cuda_dropout,  # autocast's op lists hold the functions as torch defines them
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(no_packed_sequence_check())
        stack.enter_context(cuda_dropout.emulating())
        stack.enter_context(cuda_fallback())  # an MoE's grouped matmuls in fp32 / fp16 (core/simulation/moe.py)
        sharder = Sharder.for_setup(setup)
        if setup.autocast and not (sharder is not None and sharder.mixed):  # FSDP mixed precision: no autocast
            mode = autocast_cuda.CudaAutocast(DTYPES[setup.compute])
            AUTOCAST_RUNNING.append(stack.enter_context(autocast_cuda.emulating(mode)))
            stack.callback(AUTOCAST_RUNNING.pop)
        yield


@contextlib.contextmanager
def no_packed_sequence_check() -> Iterator[None]:
    """transformers reads position_ids values to detect packed sequences; fake tensors have no values."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


@contextlib.contextmanager
def moves_that_change_nothing_are_skipped() -> Iterator[None]:
    """``Module.to()`` swaps every fake parameter even when the device and dtype already match, and the
    swap fails on fake tensors; peft calls it on freshly created adapters. Skip such no-op moves."""
    original = nn.Module._apply

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        tensors = [t for t in (*self.parameters(recurse=recurse), *self.buffers(recurse=recurse))]
        if tensors and all(_same(t, fn) for t in tensors):
            return self
        return original(self, fn, recurse)

    nn.Module._apply = _apply
    try:
        yield
    finally:
        nn.Module._apply = original


def _same(t: torch.Tensor, fn) -> bool:  # noqa: ANN001
    with torch.no_grad():
        try:
            return fn(t) is t
        except Exception:  # noqa: BLE001
            return False


def build_hf(spec: ModelSpec | None, setup: TrainingSetup, device: torch.device | str = "cpu", real: bool = True,
             config=None, depth: Depth | None = None) -> HFModel:  # noqa: ANN001
    """transformers' own class for ``spec`` (or for ``config``, any model type transformers ships), with the
    recipe applied as users apply it. ``depth`` (from :func:`plan_depth`, computed outside any dispatch
    mode): build the reduced config and count the full model's parameters exactly."""
    check(spec, setup)
    with moves_that_change_nothing_are_skipped():
        return _build_hf(spec, setup, device, real, config, depth)


def _attention(task: Task, setup: TrainingSetup) -> tuple[str, tuple[str, ...]]:
    want = "eager" if setup.attention is Attention.EAGER else "sdpa"
    if want == "sdpa" and not getattr(task.model_class, "_supports_sdpa", False):
        return "eager", (f"{task.model_class.__name__} has no SDPA path in transformers: eager attention "
                         "(materialised scores) is what it runs",)
    return want, ()



def enable_checkpointing(model: Any, reentrant: bool = False, offload: bool = False) -> None:
    """Activation checkpointing as transformers' Trainer turns it on: ``activation_checkpointing_enable`` where the
    model has it (transformers 5.x; ``gradient_checkpointing_enable`` is its deprecated alias, which warns), in the
    setup's mode (transformers 5's default is non-reentrant). ``offload``: the layers' checkpoint function is the
    offloaded one, set as LLaMA-Factory's patched ``gradient_checkpointing_enable`` sets it
    (``_set_gradient_checkpointing(enable=True, gradient_checkpointing_func=...)``)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_to_host)


def checkpoint_layers(model: Any, setup: TrainingSetup) -> None:
    """Checkpointing with the setup's checkpoint function (torch's in its mode, the offloaded one, Unsloth's) on
    every module ``_set_gradient_checkpointing`` reaches: a text model's decoder layers, a vision-language model's
    tower blocks and decoder layers alike (each GradientCheckpointingLayer calls the function it was given)."""
    enable_checkpointing(model, reentrant=setup.ckpt_reentrant, offload=setup.ckpt_offload)
    if (unsloth_fn := checkpoint_function(setup, model)) is not None:  # core/simulation/unsloth_gc.py
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=unsloth_fn)

def _build_hf(spec: ModelSpec | None, setup: TrainingSetup, device: torch.device | str, real: bool, config,  # noqa: ANN001
              depth: Depth | None) -> HFModel:
    if config is None and spec is None and depth is None:
        raise SetupError("the HF path needs a model spec or a transformers config")
    if depth is not None:
        task = task_of(depth.config)
        task = Task(task.kind, task.config, task.model_class, (*depth.notes, *task.notes))
    else:  # the user's config as read (spec.transformers_config: a family only traced), else the spec's own
        if config is None and spec.transformers_config:
            config = json.loads(spec.transformers_config)
        task = task_of(config if config is not None else hf_config(spec, setup.attention))
    attn, notes = _attention(task, setup)
    notes = (*task.notes, *notes)
    sharder = Sharder.for_setup(setup)
    cfg = task.config
    cfg._attn_implementation = attn
    if setup.weight_dtype.is_quantized:
        if real:
            raise SetupError("quantized bases are emulated under fake tensors only on the HF path (bitsandbytes "
                             "needs a GPU): use the built-in model to run one")
        model = load_quantized(task, cfg, setup, device)
        notes = (*notes, *quantized_notes(model, setup))
    else:
        # FSDP mixed precision: the parameters compute in the dtype they are gathered in (shards kept in fp32)
        dtype = DTYPES[setup.compute] if sharder is not None and sharder.mixed else DTYPES[setup.weight_dtype]
        with default_device(device):
            model = task.model_class._from_config(cfg, dtype=dtype)
    if setup.autocast and not real:
        notes = (*notes, f"CUDA autocast ({setup.compute.value}) emulated: its op lists and weight cache, as on "
                         "the GPU (fake tensors on the CPU cannot run it)")
    tracker = context.current()
    if tracker is not None and getattr(model.config, "tie_word_embeddings", False):
        # from_config allocates the output head and only then ties it to the embedding; from_pretrained
        # builds on the meta device and never holds both, so that transient is not part of a real load
        tracker.restart_phase_peak()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    _check_positions(model, setup.seq_len)
    full_params = full_param_count(model, depth) if depth is not None and depth.reduced else None
    layers = depth.depth if depth is not None else None
    if setup.grad_ckpt and not model.supports_gradient_checkpointing:
        raise SetupError(f"{type(model).__name__} does not support gradient checkpointing in transformers")
    if setup.uses_lora:
        model = apply_lora(model, setup, task, device)
        dropless = param_wrapped(model) if setup.lora_dropout else []
        notes = (*notes, NO_DROPOUT_NOTE.format(", ".join(dropless))) if dropless else notes
    elif setup.method is Method.FREEZE:
        freeze_all_but_last(model, int(setup.trainable_layers or 0), setup.freeze_extra)
    if setup.upcasts_trainable and not (sharder is not None and sharder.mixed):  # else fp32 shards (shard_module)
        upcast_trainable(model)
    liger_kernels(model, spec, setup)
    if setup.unsloth_kernels:  # Unsloth's fused LoRA kernels, installed after peft (core/simulation/unsloth.py)
        patch_unsloth(model, unsloth_patch(spec, setup) if spec is not None else _no_unsloth(setup))
    notes = (*notes, *hub_kernels(model, spec, setup, real))
    if setup.grad_ckpt:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        checkpoint_layers(base, setup)
    if (setup.grad_ckpt or setup.input_grads) and not model.get_input_embeddings().weight.requires_grad:
        (model.get_base_model() if hasattr(model, "get_base_model") else model).enable_input_require_grads()
    shape = spec if spec is not None else _Shape(int(cfg.vocab_size), max(layer_counts(cfg).values(), default=0))
    out = HFModel(model, BuildPlan(shape, setup, torch.device(device), real, sharder), task.kind, notes, full_params,
                  layers)
    if sharder is not None and sharder.params_sharded:  # ZeRO-3 / FSDP: the decoder layers are the units
        shard_module(model, sharder, [layer for _name, stack in layer_stacks(model) for layer in stack], out)
    return out


def liger_kernels(model: nn.Module, spec: ModelSpec | None, setup: TrainingSetup) -> None:
    """Liger's kernels patched in as HF Trainer's ``apply_liger_kernel`` does (after peft): for a hand-written
    family's class as :func:`liger_patch` reads its family, for any other class as liger's own patch for its type
    rebinds its modules (:func:`recorded_patch`, read off liger itself)."""
    if not setup.liger_kernels:
        return
    if spec is not None and not spec.transformers_config and spec.vision is None:
        patch_model(model, liger_patch(spec, setup.liger_kernels))
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kernels = setup.liger_kernels
    if spec is not None and spec.vision is not None:  # liger's RoPE is not modelled on a vision-language model
        kernels = tuple(k for k in kernels if k != "rope")
    patch_recorded(model, recorded_patch(str(base.config.model_type), kernels))


def _no_unsloth(setup: TrainingSetup) -> None:
    raise SetupError("Unsloth's fused LoRA kernels are modelled on its Llama, Mistral, Qwen 2 / 3 and Gemma 1 / 2 "
                     "classes, read into a hand-written family: drop --unsloth-kernels")


def hub_kernels(model: nn.Module, spec: ModelSpec | None, setup: TrainingSetup, real: bool) -> tuple[str, ...]:
    """transformers' Hub kernels (on by default since 5.25.0, core/spec/hub_kernels.py) as its ``train()``
    kernelizes the model for CUDA: after peft and liger's patch, as Trainer calls ``model.train()`` when training
    starts. Fake tensors only: a real run here runs what its device runs (on the CPU: the torch forward). A
    hand-written family's spec is built as the class ``hf_config`` picks for it (Gemma 1 as Llama's): its own
    family's rules decide (:func:`hub_norms`, :func:`hub_rope`)."""
    version = installed().get("transformers", "")
    if not hub_runs(setup) or real or not hub_default_on(version):
        return ()
    norms = kernelize_hub(model, HUB_RMS_NORM) if spec is None or hub_norms(spec) else 0
    ropes = kernelize_rope(model) if spec is None or spec.transformers_config or hub_rope(spec) else 0
    said = [f"{norms} RMSNorm modules run kernels-community/liger-kernels' LigerRMSNorm"] if norms else []
    said += [f"{ropes} attention modules' RoPE runs {ROPE_GRADIENT}"] if ropes else []
    # a Mamba-2 mixer calls nothing else in training (no cache): its other kernels are not gaps
    fused, bypassed = kernelize_mamba(model), bypassed_adapters(model)
    said += [f"{fused} Mamba-2 mixers run mamba-ssm's fused mamba_split_conv1d_scan_combined"] if fused else []
    said += [f"{len(bypassed)} of them: {MAMBA2_OUT_PROJ}"] if bypassed else []
    deltas, gated = kernelize_fla(model), kernelize_norms(model)  # kernels-community/fla's: fla's Functions
    said += [f"{deltas} linear-attention modules run fla's chunk_gated_delta_rule"] if deltas else []
    said += [f"{gated} gated norms run fla's FusedRMSNormGated"] if gated else []
    convs = kernelize_conv(model)  # kernels-community/mamba-ssm's causal_conv1d_fn: causal-conv1d's Function
    said += [f"{convs} convolutions run causal-conv1d's causal_conv1d_fn"] if convs else []
    gaps = sorted({name for m in model.modules() if not runs_fused(m)
                   for name, f in (vars(m).get("_kernel_funcs") or {}).items()
                   if name in UNMODELLED and "forward" not in vars(f)}  # a bound wrapper is modelled
                  | {name for m in model.modules()
                     if (name := getattr(type(m), "kernel_layer_name", None)) in UNMODELLED})
    said += [f"its {', '.join(gaps)} kernels are not modelled (their torch path is)"] if gaps else []
    return (f"transformers {version} kernelizes the model for CUDA at train() (use_kernels defaults to True): "
            f"{'; '.join(said)}; --no-hub-kernels turns them off",) if said else ()


def _check_positions(model: nn.Module, seq_len: int) -> None:
    """A model with a learned position table (GPT-2's ``wpe``, BERT's, OPT's and BART's ``embed_positions``)
    has no position beyond it: a longer sequence is refused here instead of failing inside the step."""
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(mod, nn.Embedding) or not ("pos" in leaf or leaf == "wpe"):
            continue
        usable = mod.num_embeddings - int(getattr(mod, "offset", 0) or 0)
        if mod.padding_idx is not None:  # RoBERTa numbers positions from padding_idx + 1
            usable -= mod.padding_idx + 1
        if seq_len > usable:
            raise SetupError(f"{type(model).__name__} has learned positions for {usable} tokens ({name}): a sequence "
                             f"of {seq_len} does not fit; use --seq-len {usable} or less")


# ---- a config measured on its own (the architecture matrix, the trace) ----------------------------------------

@dataclass(frozen=True)
class ConfigRun:
    """One simulated training step of a transformers config (see :func:`measure_config`)."""

    model_type: str
    model_class: str
    depth: int | None  # layers per stack built (None: the config's own depth)
    peak_bytes: int  # tensor peak (512-byte blocks, as the CUDA caching allocator hands them out)
    peak_phase: str
    params: int  # the full model's parameters (per-layer count x layers + the rest)
    own_params: int  # the full model's own count, built at full depth on the meta device
    built_params: int  # parameters of the model actually built (reduced depth)
    trainable_params: int  # of the model actually built
    notes: tuple[str, ...]
    seconds: float


def measure_config(config: Any, setup: TrainingSetup, reduce_depth: bool = True, steps: int = 2) -> ConfigRun:
    """``simulate --hf`` for a config alone: transformers' own class (any type it ships) under fake tensors,
    at reduced depth where its layers repeat, with the recipe applied as users apply it."""
    import time

    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.simulation.step import measure
    from vramlab.core.simulation.tracker import MemoryTracker

    t0 = time.perf_counter()
    setup.validate()
    check(None, setup)
    task = task_of(config)
    depth = plan_depth(task, DTYPES[setup.compute], min_depth=2 if reduce_depth else 10**9)
    tracker = MemoryTracker(record_timeline=False)
    built: list[HFModel] = []

    def builder(spec, setup, device, real):  # noqa: ANN001, ANN202
        model = build_hf(spec, setup, device, real, depth=depth)
        built.append(model)
        return model

    with context.exclusive(), FakeTensorMode(allow_non_fake_inputs=False), guard(setup):
        run = measure(None, setup, torch.device("cpu"), real=False, tracker=tracker, steps=steps,  # type: ignore[arg-type]
                      builder=builder)
    model = built[0]
    return ConfigRun(task.model_type, task.model_class.__name__, depth.depth if depth.reduced else None,
                     tracker.peak.total_bytes, tracker.peak.phase,
                     model.full_params if model.full_params is not None else depth.own_params, depth.own_params,
                     run.total_params, run.trainable_params, model.notes, time.perf_counter() - t0)
