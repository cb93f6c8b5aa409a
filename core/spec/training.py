"""How the model is trained: :class:`TrainingSetup`, its derived precision facts, its validation (what the
libraries can run, and with which options) and its warnings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vramlab.core import vision as _vision
from vramlab.core.checks import SetupError, check_flag, check_float, check_int, field_label, short_repr
from vramlab.core.spec.act_offload import validate_offloading
from vramlab.core.spec.liger import liger_patch, parse_liger_kernels
from vramlab.core.spec.loss_kernels import validate_loss_kernel
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import (
    FLOAT_DTYPES,
    NO_REFERENCE_OBJECTIVES,
    OBJECTIVE_BOUNDS,
    UNMODELLED_OBJECTIVES,
    ActivationOffload,
    Attention,
    DType,
    GenerationBackend,
    LossKernel,
    Method,
    Objective,
    Offload,
    Optimizer,
    OptimizerImpl,
    Reference,
    Sharding,
)
from vramlab.core.spec.setup_warnings import setup_warnings
from vramlab.core.spec.sharded_precision import (
    deepspeed_masters,
    fsdp_upcasts,
    validate_sharded_precision,
    validate_vlm_precision,
)
from vramlab.core.spec.targets import FUSED_TARGETS, names_all_linear, parse_targets
from vramlab.core.spec.unsloth import parse_unsloth_kernels, unsloth_patch
from vramlab.core.spec.unsloth_loss import parse_unsloth_gpu
from vramlab.core.spec.vlm_objectives import vlm_objective

# ---- bounds (far above every real run, as the model's: core/spec/model.py) -------------------------------------
SETUP_BOUNDS: dict[str, tuple[int, int]] = {
    "micro_batch": (1, 1_048_576),
    "seq_len": (1, 2**27),
    "grad_accum": (1, 1_048_576),
    "gpus": (1, 65_536),
    "lora_rank": (1, 65_536),
    "trainable_layers": (1, 1024),
    "loss_chunks": (2, 64),
    "quant_block": (16, 4096),
}
SETUP_FLAGS = ("master_weights", "double_quant", "kbit_upcast", "grad_ckpt", "ckpt_reentrant", "chunked_loss",
               "loss_fp32", "optimizer_in_backward", "vision_ckpt", "pan_and_scan", "use_dora", "use_rslora",
               "lora_fa", "trainable_fp32", "hub_kernels", "ckpt_offload", "unsloth_gc", "input_grads")
# what freeze trains besides the last layers, by the role of the module (LLaMA-Factory's freeze_extra_modules
# names them by the model's own names: embed_tokens / wte, norm / ln_f, lm_head)
FREEZE_EXTRAS = ("embed_tokens", "norm", "lm_head")
MAX_LORA_ALPHA = 1e6


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained. Fields left at ``None`` take the documented default in
    :meth:`resolved` (which is what ``--json`` prints as ``setup``)."""

    method: Method = Method.FULL
    weights: DType | None = None  # storage of the base weights [bf16; nf4 for qlora]
    compute: DType = DType.BF16  # matmul dtype
    # Autocast on/off. None: on exactly when float weights are wider than the compute dtype (torch AMP).
    # True with 16-bit weights is HF Trainer's bf16=True on a bf16 model: fp32 LoRA adapters then run in
    # bf16 and save bf16 inputs instead of fp32 ones.
    amp: bool | None = None
    master_weights: bool = False  # optimizer keeps an fp32 master copy of 16-bit trainable weights
    # the trainable parameters upcast to fp32 on a 16-bit model, the frozen ones left in the load dtype, trained
    # under autocast (LLaMA-Factory 0.9.5 init_adapter's cast_trainable_params_to_fp32; full fine-tuning then
    # trains fp32 weights throughout, freeze fp32 layers beside frozen 16-bit ones; adapters are fp32 anyway)
    trainable_fp32: bool = False
    double_quant: bool = True  # nf4: quantize the block scales too (QLoRA default)
    # peft's prepare_model_for_kbit_training: the parameters left unquantized (embeddings, norms, lm_head)
    # are upcast to fp32, which makes the residual stream fp32 too
    kbit_upcast: bool = False
    quant_block: int = 64  # nf4 block size
    adapter_dtype: DType = DType.FP32  # peft keeps LoRA weights in fp32 by default
    optimizer: Optimizer = Optimizer.ADAMW
    optimizer_impl: OptimizerImpl | None = None  # None: what torch picks on CUDA (foreach)
    lora_rank: int = 8
    lora_alpha: float | None = None  # None: 2 x rank
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    # peft 0.21.2 LoraConfig(use_dora=True): a trainable magnitude vector per adapted layer and, each forward, the
    # adapter's full weight (B @ A through an identity), the base weight's norm with it, and the base output scaled
    use_dora: bool = False
    # peft's use_rslora: scaling alpha / sqrt(rank) instead of alpha / rank; no tensor changes size
    use_rslora: bool = False
    # LoRA-FA (peft 0.21.2 optimizers/lorafa.py, create_lorafa_optimizer): every lora_A frozen, and peft's
    # LoraFAOptimizer steps each B with its gradient projected through (A A^T)^-1
    lora_fa: bool = False
    trainable_layers: int | None = None  # freeze: train the last N layers (nothing else unless freeze_extra)
    # freeze: also train these (FREEZE_EXTRAS); LLaMA-Factory's freeze step and a plain requires_grad freeze
    # of all but the last N layers leave the embedding, the final norm and the output head frozen
    freeze_extra: tuple[str, ...] = ()
    micro_batch: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    grad_ckpt: bool = False
    # torch.utils.checkpoint's reentrant variant; transformers 5's gradient_checkpointing_enable() and
    # TrainingArguments(gradient_checkpointing=True) pass use_reentrant=False unless gradient_checkpointing_kwargs
    # say otherwise
    ckpt_reentrant: bool = False
    # the checkpointed layers' inputs in host memory (LLaMA-Factory's use_unsloth_gc: core/simulation/offload_ckpt.py)
    ckpt_offload: bool = False
    # Unsloth's own checkpointing (use_gradient_checkpointing="unsloth": core/simulation/unsloth_gc.py)
    unsloth_gc: bool = False
    # the input embeddings' output requires grad without checkpointing too (enable_input_require_grads: axolotl
    # 0.19.0's load_adapter calls it for every adapter)
    input_grads: bool = False
    attention: Attention = Attention.SDPA
    gpus: int = 1
    sharding: Sharding = Sharding.NONE
    offload: Offload = Offload.NONE
    chunked_loss: bool = False  # compute lm_head + loss in chunks, recomputed in backward
    loss_fp32: bool = True  # HF upcasts logits to fp32 for the loss; LitGPT / torchtune keep bf16
    loss_chunks: int = 8
    loss_kernel: LossKernel = LossKernel.HF  # the loss kernel the framework patches in (axolotl, Liger)
    liger_kernels: tuple[str, ...] = ()  # Liger's RMSNorm / GLU kernels the framework patches in (core/spec/liger.py)
    unsloth_kernels: tuple[str, ...] = ()  # Unsloth's fused LoRA kernels (core/spec/unsloth.py)
    # what Unsloth's fused loss reads of the GPU (core/spec/unsloth_loss.py): (capability major, minor, memory bytes,
    # free bytes at the loss or 0); (): the estimate's and the simulation's GPU (the H100 where none is named)
    unsloth_gpu: tuple[int, ...] = ()
    hub_kernels: bool = True  # transformers >= 5.25's Hub kernels, on CUDA by default (core/spec/hub_kernels.py)
    optimizer_in_backward: bool = False  # step each parameter as soon as its gradient is ready
    # TRL's (or axolotl's) activation_offloading: saved tensors moved to the host in forward, back in backward
    # (core/simulation/act_offload.py; what is modelled: core/spec/act_offload.py); True reads as TRL's
    offload_activations: ActivationOffload = ActivationOffload.NONE
    # Vision-language models (core/vision.py): images per sample and their size, video frames per sample, the
    # Qwen processors' max pixels (0: the processor's own), and how the vision tower and projector train.
    # seq_len stays the text's length; the processor's vision tokens come on top of it.
    images: int = 0
    image_width: int = 448
    image_height: int = 448
    frames: int = 0
    max_pixels: int = 0
    vision_tuning: str = "frozen"  # frozen | projector | lora | full
    pan_and_scan: bool = False  # Gemma 3's processor option: crops of a wide or tall image beside it
    # under grad_ckpt, checkpoint the vision tower's blocks too (transformers' gradient_checkpointing_enable
    # does); False: the language model's layers only
    vision_ckpt: bool = True
    # ---- objective (TRL 1.16.0's trainers); every field below is inert for SFT --------------------------------
    objective: Objective = Objective.SFT
    reference: Reference | None = None  # None: TRL's default (adapters with LoRA, else a copy; none: GRPO beta 0)
    reference_dtype: DType | None = None  # a reference copy's weights (None: the policy's float dtype)
    completion_len: int | None = None  # tokens of each completion; the prompt is seq_len - completion_len
    num_generations: int = 8  # GRPO: completions per prompt
    steps_per_generation: int | None = None  # GRPO: micro-batches generated at once (None: grad_accum)
    generation_backend: GenerationBackend = GenerationBackend.TRANSFORMERS
    vllm_memory_fraction: float = 0.3  # GRPO vllm-colocate: TRL's vllm_gpu_memory_utilization
    vllm_sleep: bool = False  # GRPO vllm-colocate: vllm_enable_sleep_mode (weights and cache offloaded between)
    beta: float | None = None  # None: 0.1 (DPO / KTO), 0.0 (GRPO: no reference model)
    num_iterations: int = 1  # GRPO: optimisation passes per generated batch

    def __post_init__(self) -> None:
        conv = {
            "method": Method, "compute": DType, "adapter_dtype": DType, "optimizer": Optimizer,
            "sharding": Sharding, "offload": Offload, "loss_kernel": LossKernel,
            "offload_activations": ActivationOffload,
        }
        if isinstance(self.offload_activations, bool):  # the switch: TRL's, or none
            object.__setattr__(self, "offload_activations", "trl" if self.offload_activations else "none")
        conv.update({"weights": DType, "optimizer_impl": OptimizerImpl, "attention": Attention})
        conv.update({"objective": Objective, "reference": Reference, "reference_dtype": DType,
                     "generation_backend": GenerationBackend})
        for name, enum in conv.items():
            value = getattr(self, name)
            if value is None and name in ("weights", "optimizer_impl", "reference", "reference_dtype"):
                continue
            try:
                value = enum.parse(value) if enum is Attention else enum(value)
            except (ValueError, TypeError, AttributeError):
                shown = short_repr(value)
                raise SetupError(f"{field_label(name)} must be one of {', '.join(e.value for e in enum)} "
                                 f"(got {shown})") from None
            object.__setattr__(self, name, value)
        targets = self.lora_targets
        if not isinstance(targets, str) and not (isinstance(targets, (list, tuple))
                                                 and all(isinstance(t, str) for t in targets)):
            raise SetupError(f"LoRA targets must be module names such as q_proj,v_proj (got {short_repr(targets)})")
        object.__setattr__(self, "lora_targets", parse_targets(targets))
        extra = self.freeze_extra
        if isinstance(extra, str):
            extra = tuple(x.strip() for x in extra.split(",") if x.strip())
        if not isinstance(extra, (list, tuple)) or not all(isinstance(x, str) and x in FREEZE_EXTRAS for x in extra):
            raise SetupError(f"freeze extras must be some of {', '.join(FREEZE_EXTRAS)} (got {short_repr(extra)})")
        object.__setattr__(self, "freeze_extra", tuple(x for x in FREEZE_EXTRAS if x in extra))
        object.__setattr__(self, "liger_kernels", parse_liger_kernels(self.liger_kernels))
        object.__setattr__(self, "unsloth_kernels", parse_unsloth_kernels(self.unsloth_kernels))
        object.__setattr__(self, "unsloth_gpu", parse_unsloth_gpu(self.unsloth_gpu))

    # ---- derived facts -------------------------------------------------------------------------------
    @property
    def weight_dtype(self) -> DType:
        w = self.load_dtype
        if self.method is Method.FULL and fsdp_upcasts(self, w):
            return DType.FP32  # accelerate's FSDP upcast: fp32 shards gathered in the compute dtype
        return w

    @property
    def load_dtype(self) -> DType:
        """The dtype the base weights are loaded in (``weights``, or its default)."""
        if self.weights is not None:
            return self.weights
        return DType.NF4 if self.method is Method.QLORA else DType.BF16

    @property
    def offloads_activations(self) -> bool:
        return self.offload_activations is not ActivationOffload.NONE

    @property
    def uses_lora(self) -> bool:
        return self.method in (Method.LORA, Method.QLORA)

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank

    def trains(self, extra: str) -> bool:
        """Whether a module outside the repeated layers trains: ``embed_tokens``, ``norm`` (the final norm) or
        ``lm_head`` (full fine-tuning trains all three; freeze those in ``freeze_extra``; adapters none)."""
        return self.method is Method.FULL or (self.method is Method.FREEZE and extra in self.freeze_extra)

    @property
    def impl(self) -> OptimizerImpl:
        return self.optimizer_impl or OptimizerImpl.FOREACH

    @property
    def autocast(self) -> bool:
        """Matmuls run under autocast in the compute dtype (torch AMP)."""
        w = self.weight_dtype
        if w.is_float and w.itemsize > self.compute.itemsize:
            return True
        if self.compute is DType.FP32:
            return False
        if self._upcasts_base:  # fp32 trained parameters in a 16-bit compute: torch AMP, as for fp32 weights
            return True
        return bool(self.amp)

    @property
    def upcasts_trainable(self) -> bool:
        """The trainable parameters are made fp32, the frozen ones left as loaded: LLaMA-Factory's upcast
        (``trainable_fp32``) or accelerate's under FSDP with mixed precision (core/spec/sharded_precision.py)."""
        return self.trainable_fp32 or fsdp_upcasts(self, self.load_dtype)

    @property
    def _upcasts_base(self) -> bool:
        """fp32 trainable parameters on a 16-bit model whose own weights train (full, freeze)."""
        return self.upcasts_trainable and not self.uses_lora and self.weight_dtype in (DType.BF16, DType.FP16)

    @property
    def trainable_dtype(self) -> DType:
        """dtype of the trainable tensors (and so of their gradients)."""
        if self.upcasts_trainable:
            return DType.FP32
        if self.uses_lora:
            return self.adapter_dtype
        return self.weight_dtype

    @property
    def has_master_copy(self) -> bool:
        """An fp32 master copy beside 16-bit trainable weights (DeepSpeed / Megatron style)."""
        return (self.master_weights or deepspeed_masters(self)) and self.trainable_dtype is not DType.FP32

    @property
    def grad_dtype(self) -> DType:
        return self.trainable_dtype

    @property
    def state_dtype(self) -> str:
        """What the optimizer keeps per trainable element, for people."""
        if self.optimizer in (Optimizer.SGD,):
            return "none"
        if self.optimizer.is_8bit or self.optimizer is Optimizer.TORCHAO_ADAMW_8BIT:
            return "uint8 + fp32 block scales"
        if self.optimizer is Optimizer.TORCHAO_ADAMW_4BIT:
            return "4-bit codes + fp32 block scales"
        if self.optimizer is Optimizer.TORCHAO_ADAMW_FP8:
            return "float8 e4m3 + fp32 block scales"
        if self.optimizer is Optimizer.PAGED_ADAMW_32BIT:
            return "fp32 (paged)"
        return "fp32" if self.has_master_copy else self.trainable_dtype.value

    @property
    def effective_batch(self) -> int:
        """Sequences per optimizer step across all data-parallel ranks."""
        return self.micro_batch * self.grad_accum * self.gpus

    def precision_label(self) -> str:
        w = self.weight_dtype
        if w.is_quantized:
            return f"{w.value} base, {self.compute.value} compute"
        if self.autocast and w is DType.FP32:
            return f"AMP {self.compute.value} (fp32 weights)"
        if self._upcasts_base:
            return f"AMP {self.compute.value} (fp32 trainable, {w.value} frozen)"
        master = " + fp32 master" if self.has_master_copy else ""
        if self.autocast:
            return f"{w.value} + autocast{master}"
        label = f"pure {w.value}{master}"
        if self.uses_lora and self.adapter_dtype is not w:
            label += f", {self.adapter_dtype.value} adapters"
        return label

    # ---- validation -------------------------------------------------------------------------------
    def check_fields(self) -> None:
        """Each field on its own: switches are true or false, numbers whole (or finite) and within
        :data:`SETUP_BOUNDS`. The combination is :meth:`validate`'s business."""
        for name in SETUP_FLAGS:
            check_flag(name, getattr(self, name))
        check_flag("amp", self.amp, allow_none=True)
        for name, (lo, hi) in SETUP_BOUNDS.items():
            value = getattr(self, name)
            if value is None and name == "trainable_layers":
                continue
            check_int(name, value, lo, hi)
        if self.lora_alpha is not None:
            check_float("lora_alpha", self.lora_alpha, 0.0, MAX_LORA_ALPHA)
        check_float("lora_dropout", self.lora_dropout, 0.0, 1.0, hi_open=True)
        self.vision_input()
        if self.vision_tuning not in _vision.TUNINGS:
            raise SetupError(f"vision tuning must be one of {', '.join(_vision.TUNINGS)} "
                             f"(got {short_repr(self.vision_tuning)})")
        self._check_objective_fields()

    def vision_input(self):  # noqa: ANN201 - a core.vision.VisionInput
        """The images and video of one sample as :class:`~vramlab.core.vision.VisionInput` (bounds checked)."""
        return _vision.VisionInput(images=self.images, width=self.image_width, height=self.image_height,
                           frames=self.frames, max_pixels=self.max_pixels, pan_and_scan=self.pan_and_scan)

    def _validate_vision(self, model: ModelSpec) -> None:
        vi = self.vision_input()
        if model.vision is None:
            if vi.active:
                raise SetupError(f"{model.name} is a text model: --images and --frames need a vision-language model")
            return
        _vision.vision_tokens(model.vision.processor, vi)
        validate_vlm_precision(self, model)
        if self._upcasts_base:
            raise SetupError(f"{model.name} (a vision-language model): fp32 trainable parameters beside 16-bit frozen "
                             "ones are modelled for text models: drop --trainable-fp32")
        rules = model.vision.rules  # the family's own (None for a traced tower)
        if rules is not None:
            rules.check_setup(model, self)  # what transformers cannot train of this family
        if self.vision_tuning == "lora" and not self.uses_lora:
            raise SetupError("--vision-tuning lora adapts the vision tower with LoRA: use --method lora")
        # ZeRO-1 / 2 partition the optimizer's states and the gradients, whatever the model is (the rank's
        # sharder applies to any step: core/simulation/shard.py, core/estimator/shard.py), and a loss kernel
        # (chunked, 16-bit logits) replaces the loss of any causal LM's head (core/simulation/loss.py); ZeRO-3 / FSDP
        # gather the units of the model's _no_split_modules: a family's program where it says so (SHARDED;
        # tests/test_vlm_sharding.py), transformers' own class of a traced VLM as the text trace's
        # (tests/test_vlm_traced_sharding.py)
        unsharded = not (model.vision.traced or getattr(rules, "SHARDED", False))
        if self.sharding.shards_params and unsharded:
            raise SetupError(f"{model.name} (a vision-language model): parameter sharding (ZeRO-3, FSDP) is not "
                             "modelled for this family yet: use --sharding zero1 / zero2")
        if self.optimizer_in_backward:
            raise SetupError(f"{model.name} (a vision-language model) is modelled without optimizer-in-backward: "
                             "drop --optimizer-in-backward")
        if self.objective is not Objective.SFT:
            vlm_objective(model, self)  # TRL's trainers on a VLM (core/spec/vlm_objectives.py)
        if self.weight_dtype.is_quantized:
            # a family whose quantized load (every nn.Linear of tower, projector and language model in
            # bitsandbytes' storage but the head) is emulated says so (QUANTIZED; tests/test_vlm_sharding.py);
            # a traced tower is transformers' own class, loaded quantized as the text trace loads one
            if not model.vision.traced and (rules is None or not rules.QUANTIZED):
                raise SetupError(f"{model.name}: a quantized base of this vision-language class is not emulated yet: "
                                 "use --method lora")
            if self.vision_tuning in ("full", "projector"):
                raise SetupError("bitsandbytes' quantized linear layers cannot be trained, and the tower's and the "
                                 "projector's are quantized with the rest: --vision-tuning frozen or lora")
        # a family whose step under CUDA autocast is held to transformers' class says so (AUTOCAST; with a quantized
        # base too unless QUANTIZED_AUTOCAST says otherwise)
        q = self.weight_dtype.is_quantized
        if self.autocast and not model.vision.traced and (rules is None or not rules.AUTOCAST
                                                          or q and not getattr(rules, "QUANTIZED_AUTOCAST", True)):
            raise SetupError(f"{model.name}: its {'quantized ' if q else ''}step under autocast is not modelled yet "
                             "(off transformers' own under CUDA autocast): train it without --amp")

    def _generation_fixes(self, batch: int) -> str:
        """The nearest settings that make GRPO's generation batch divisible by its completions per prompt."""

        g = self.num_generations
        per = self.generation_steps * self.gpus  # prompts' rows per micro-batch row
        mb = g // math.gcd(g, per)  # the smallest micro batch that divides: a multiple of this
        mb = mb * -(-self.micro_batch // mb)
        other = self.micro_batch * self.gpus
        steps = g // math.gcd(g, other)
        steps = steps * -(-self.generation_steps // steps)
        gens = max((d for d in range(2, min(g, batch) + 1) if batch % d == 0), default=None)
        fixes = [f"--batch {mb}", f"--steps-per-generation {steps}" + (
            " (it follows --grad-accum unless set)" if self.steps_per_generation is None else "")]
        if gens is not None:
            fixes.append(f"--num-generations {gens}")
        return "use " + ", ".join(fixes[:-1]) + " or " + fixes[-1]

    # ---- objective (issue 15) --------------------------------------------------------------------------
    def _check_objective_fields(self) -> None:
        for name, (lo, hi) in OBJECTIVE_BOUNDS.items():
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, lo, hi)
        check_flag("vllm_sleep", self.vllm_sleep)
        check_float("vllm_memory_fraction", self.vllm_memory_fraction, 0.0, 1.0, "vLLM memory fraction")
        if self.beta is not None:
            check_float("beta", self.beta, 0.0, 1e6)

    @property
    def completion_tokens(self) -> int:
        """Tokens of each completion (TRL's max_completion_length for GRPO; for the DPO family the completion
        part of max_length): given, else 256 for GRPO and half the sequence for the others."""
        if self.completion_len is not None:
            return self.completion_len
        return 256 if self.objective is Objective.GRPO else max(1, self.seq_len // 2)

    @property
    def prompt_tokens(self) -> int:
        return self.seq_len - self.completion_tokens

    @property
    def beta_value(self) -> float:
        if self.beta is not None:
            return float(self.beta)
        return 0.0 if self.objective is Objective.GRPO else 0.1

    @property
    def reference_mode(self) -> Reference:
        """The reference as TRL 1.16.0 sets it up: DPOTrainer / KTOTrainer use the policy with its adapters
        disabled when the model is a peft model and no ref_model is given, else load a second copy;
        GRPOTrainer loads a reference only when beta != 0."""
        if self.objective in (Objective.SFT, *UNMODELLED_OBJECTIVES, *NO_REFERENCE_OBJECTIVES):
            return Reference.NONE
        if self.objective is Objective.GRPO and self.beta_value == 0.0:
            return Reference.NONE
        if self.reference is not None:
            return self.reference
        return Reference.ADAPTERS if self.uses_lora else Reference.COPY

    @property
    def generation_steps(self) -> int:
        return self.steps_per_generation or self.grad_accum

    @property
    def sharded_mixed_precision(self) -> bool:
        """FSDP / ZeRO-3 mixed precision: fp32 parameter shards gathered in the 16-bit compute dtype (no autocast,
        gradients reduced in fp32)."""
        return self.sharding.shards_params and self.compute is not DType.FP32 and (
            self.weight_dtype is DType.FP32 or fsdp_upcasts(self, self.load_dtype))

    @property
    def hidden_dtype(self) -> DType:
        """dtype of the decoder's hidden states (what a loss kernel gets): the float parameters' (the compute dtype
        beside quantized weights, and where FSDP / ZeRO-3 gather fp32 parameters in the compute dtype)."""
        w = self.weight_dtype
        if w.is_quantized or self.sharded_mixed_precision:
            return self.compute
        if self._upcasts_base and (self.trains("norm") or self.trains("embed_tokens")):
            return DType.FP32  # the final norm's fp32 weight (or an fp32 embedding's stream) makes them fp32
        return w

    def _validate_objective(self) -> None:
        obj = self.objective
        if obj is Objective.SFT:
            return
        if obj is Objective.KTO and self.micro_batch < 2:
            raise SetupError("KTO estimates its KL term from mismatched completions within the batch: --batch must be "
                             "at least 2 (TRL's check)")
        if obj in UNMODELLED_OBJECTIVES:
            raise SetupError(
                f"--objective {obj.value} is not modelled yet: TRL 1.16.0 runs it in trl.experimental "
                "(concatenated_forward with the full batch x sequence x vocabulary logits), a step VRAM Lab does not "
                "replay; use dpo, ipo, kto or grpo"
            )
        # every TRL trainer computes its own loss (--loss-kernel trl names that: the objective's trainer as TRL runs
        # it); a chunked SFT loss or Cut Cross Entropy's patch of the model's forward never runs under it (warnings)
        if self.optimizer_in_backward:
            raise SetupError(f"--objective {obj.value} is modelled without optimizer-in-backward")
        if self.loss_kernel is LossKernel.LIGER and obj not in NO_REFERENCE_OBJECTIVES:
            raise SetupError(  # DPOTrainer / KTOTrainer / GRPOTrainer.__init__, TRL 1.16.0
                f"TRL 1.16.0's {obj.value.upper()} trainer refuses Liger's fused linear cross-entropy "
                "(\"liger_kernel_config={'fused_linear_cross_entropy': True} is not supported: it replaces the model's "
                "forward, which this trainer patches with a fused LM head\"): use --loss-kernel trl")
        if self.completion_tokens >= self.seq_len:
            given = "" if self.completion_len is not None else ", the default"
            raise SetupError(
                f"the completion ({self.completion_tokens} tokens{given}) must be shorter than the sequence "
                f"({self.seq_len}): give --prompt-len and --completion-len"
            )
        ref = self.reference
        if obj in NO_REFERENCE_OBJECTIVES:
            if ref is not None or self.reference_dtype is not None:
                raise SetupError(f"--objective {obj.value} has no reference model (TRL's ORPOTrainer / CPOTrainer): "
                                 "drop --reference and --reference-dtype")
            ref = Reference.NONE
        elif self.uses_lora and "lm_head" in self.lora_targets:
            raise SetupError("TRL's fused LM head projects with lm_head.weight alone (an adapter on lm_head is "
                             "bypassed): leave lm_head out of --lora-targets")
        if ref is Reference.ADAPTERS and not self.uses_lora:
            raise SetupError("--reference adapters needs LoRA or QLoRA (the reference is the policy with its "
                             "adapters disabled): use --reference copy or precomputed")
        if ref is Reference.COPY and self.weight_dtype.is_quantized:
            raise SetupError("a separate reference copy of a quantized base is not modelled: use --reference "
                             "adapters (TRL's default with peft) or precomputed")
        if self.reference_dtype is not None and not self.reference_dtype.is_float:
            raise SetupError("--reference-dtype must be fp32, bf16 or fp16")
        if self.reference_dtype is not None and self.reference_mode is not Reference.COPY:
            raise SetupError("--reference-dtype applies to a reference copy (--reference copy)")
        if obj is Objective.GRPO:
            if ref is Reference.PRECOMPUTED:
                raise SetupError("GRPO scores fresh completions every step: its reference cannot be precomputed")
            if ref is Reference.NONE and self.beta_value > 0:
                raise SetupError(f"beta {self.beta_value:g} needs a reference model: use --beta 0 or a reference")
            if self.attention is Attention.EAGER:
                raise SetupError("GRPO's generation is modelled with SDPA attention: use --attention sdpa")
            if self.num_generations < 2:
                raise SetupError("GRPO compares completions of one prompt: --num-generations must be at least 2")
            batch = self.micro_batch * self.generation_steps * self.gpus
            if batch % self.num_generations:
                raise SetupError(
                    f"the generation batch ({self.micro_batch} per GPU x {self.generation_steps} steps per "
                    f"generation x {self.gpus} GPUs = {batch}) must be divisible by --num-generations "
                    f"{self.num_generations} (TRL's check): {self._generation_fixes(batch)}"
                )
        else:
            defaults = TrainingSetup()
            for name, flag in (("num_generations", "--num-generations"), ("steps_per_generation", None),
                               ("generation_backend", "--generation-backend"), ("num_iterations", None),
                               ("vllm_memory_fraction", "--vllm-memory-fraction"), ("vllm_sleep", None)):
                if getattr(self, name) != getattr(defaults, name):
                    raise SetupError(f"{flag or name.replace('_', ' ')} applies to --objective grpo only")
            if ref is Reference.NONE and obj not in NO_REFERENCE_OBJECTIVES:
                raise SetupError(f"{obj.value} needs a reference: use --reference copy, adapters or precomputed")
        if obj is not Objective.GRPO and self.generation_backend is not GenerationBackend.TRANSFORMERS:
            raise SetupError("--generation-backend applies to --objective grpo only")
        self._validate_objective_sharding()
        if self.generation_backend is GenerationBackend.VLLM_COLOCATE and not 0 < self.vllm_memory_fraction < 1:
            raise SetupError("--vllm-memory-fraction must be between 0 and 1 (TRL's default is 0.3)")

    def _validate_objective_sharding(self) -> None:
        """ZeRO-1 / 2 keep every parameter whole on each GPU, and TRL 1.16.0's ``prepare_deepspeed`` runs a
        reference copy at stage 0 (whole) below stage 3: the one-GPU step with the optimizer state and gradients
        partitioned. Under parameter sharding a reference copy is sharded as TRL prepares it and GRPO generates
        with every parameter gathered (ZeRO-3) or unit by unit (FSDP); vLLM's generation is modelled on one GPU."""
        sh = self.sharding
        if sh is Sharding.NONE:
            return
        obj = self.objective
        if obj is Objective.GRPO and self.generation_backend is not GenerationBackend.TRANSFORMERS:
            raise SetupError("GRPO's vLLM generation is modelled on one GPU: use --generation-backend transformers "
                             "with sharding")
        if not sh.shards_params:
            return

    def reference_setup(self) -> TrainingSetup:
        """The reference copy as DPOTrainer / GRPOTrainer load it: the same architecture, frozen (built as full
        fine-tuning, its parameters then set not to train), its weights in ``reference_dtype`` or the policy's
        float dtype, an SFT setup of its own (no LoRA dropout, no checkpointing: it only runs under no_grad)."""
        weights = self.reference_dtype or (self.weight_dtype if self.weight_dtype.is_float else DType.BF16)
        default = TrainingSetup()
        objective_fields = ("objective", "reference", "reference_dtype", "completion_len", "num_generations",
                            "steps_per_generation", "generation_backend", "vllm_memory_fraction", "vllm_sleep",
                            "beta", "num_iterations")
        return self.replace(method=Method.FULL, weights=weights, master_weights=False, grad_ckpt=False,
                            lora_dropout=0.0, vision_tuning="frozen",  # no adapters on a VLM's tower either
                            **{f: getattr(default, f) for f in objective_fields})

    def objective_for(self, model: ModelSpec) -> None:
        if self.objective is Objective.GRPO and model.sdpa_mask(self.seq_len):
            raise SetupError(f"{model.name}'s sliding window ({model.sliding_window}) is shorter than the "
                             f"sequence ({self.seq_len}): generation with that mask is not modelled")

    def validate(self, model: ModelSpec | None = None) -> None:
        self.check_fields()
        w = self.weight_dtype
        if self.compute not in FLOAT_DTYPES:
            raise SetupError(f"--compute must be fp32, bf16 or fp16 (got {self.compute.value})")
        if self.method is Method.QLORA and not w.is_quantized:
            raise SetupError(
                f"QLoRA quantizes the base weights, so --weights {w.value} does not apply: "
                "use --weights nf4 (or int8), or choose --method lora"
            )
        if self.method in (Method.FULL, Method.FREEZE) and w.is_quantized:
            raise SetupError(
                f"{w.value} weights cannot be trained directly: use --method qlora to train LoRA adapters "
                "on a quantized base, or --weights bf16"
            )
        if self.method is Method.LORA and w.is_quantized:
            raise SetupError(f"LoRA on a {w.value} base is QLoRA: use --method qlora")
        if w.is_float and w.itemsize < self.compute.itemsize:
            raise SetupError(
                f"compute in {self.compute.value} with {w.value} weights would upcast every weight: "
                f"use --compute {w.value}, or --weights fp32 for fp32 training"
            )
        if w is DType.FP16 and self.compute is DType.BF16 or w is DType.BF16 and self.compute is DType.FP16:
            raise SetupError(f"{w.value} weights with {self.compute.value} compute: use the same 16-bit dtype")
        if self.amp is False and w.is_float and w.itemsize > self.compute.itemsize:
            raise SetupError(
                f"{w.value} weights with {self.compute.value} compute need autocast: drop --no-amp, or use "
                f"--weights {self.compute.value} for pure {self.compute.value}"
            )
        if self.trainable_fp32 and self.amp is False and self._upcasts_base:
            raise SetupError(f"fp32 trainable parameters in a {w.value} model need autocast: drop --no-amp")
        if self.trainable_fp32 and self.uses_lora and self.adapter_dtype is not DType.FP32:
            raise SetupError("fp32 trainable parameters are fp32 LoRA adapters (peft's default): drop --adapter-dtype "
                             "or --trainable-fp32")
        validate_sharded_precision(self)
        if self.kbit_upcast and not w.is_quantized:
            raise SetupError("--kbit-prepare applies to quantized bases (nf4 / int8): drop it or use --method qlora")
        if self.adapter_dtype not in FLOAT_DTYPES:
            raise SetupError("LoRA adapters must be fp32, bf16 or fp16")
        if (self.use_dora or self.use_rslora) and not self.uses_lora:
            named = " and ".join(n for n, on in (("--dora", self.use_dora), ("--rslora", self.use_rslora)) if on)
            raise SetupError(f"{named} changes LoRA adapters: use --method lora or qlora, or drop it")
        if self.lora_fa:
            if not self.uses_lora:
                raise SetupError("--lora-fa freezes LoRA's A matrices: use --method lora or qlora, or drop it")
            if self.use_dora:
                raise SetupError("peft's LoRA-FA optimizer pairs each module's lora_A and lora_B and would pair DoRA's "
                                 "magnitude vector with the next module's A: drop --dora or --lora-fa")
            if (self.optimizer is not Optimizer.ADAMW or self.optimizer_impl is not None or self.master_weights
                    or self.optimizer_in_backward or self.sharding is not Sharding.NONE):
                raise SetupError("--lora-fa is peft's own optimizer (LoraFAOptimizer, one GPU): drop --optimizer, "
                                 "--optimizer-impl, --master-weights, optimizer-in-backward and sharding")
        if self.use_dora and (w.is_quantized or self.sharding is not Sharding.NONE or self.vision_tuning == "lora"):
            raise SetupError("DoRA is modelled on a float base on one GPU, not yet on a quantized base, under "
                             "sharding or on a vision tower's adapters: drop --dora")
        if self.method is Method.FREEZE:
            if self.trainable_layers is None or self.trainable_layers < 1:
                raise SetupError("--method freeze needs --trainable-layers N (train the last N layers)")
        if self.offload is not Offload.NONE and self.sharding is Sharding.NONE:
            raise SetupError(
                "CPU offload is a ZeRO / FSDP feature: choose --sharding zero2, zero3 or fsdp, or --offload none"
            )
        if self.offload is Offload.PARAMS and not self.sharding.shards_params:
            raise SetupError("parameter offload needs sharded parameters: use --sharding zero3 or fsdp")
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise SetupError(
                "an optimizer step in backward frees each gradient at once, so gradients cannot be "
                "accumulated: use --grad-accum 1 or turn off optimizer-in-backward"
            )
        if self.optimizer_in_backward and self.sharding is not Sharding.NONE:
            raise SetupError("optimizer-in-backward is modelled for a single GPU without sharding")
        if self.chunked_loss and not 1 < self.loss_chunks <= 64:
            raise SetupError("loss chunks must be between 2 and 64")
        validate_loss_kernel(self)
        validate_offloading(self, model)
        if self.optimizer_impl is OptimizerImpl.FUSED and self.optimizer not in (Optimizer.ADAMW, Optimizer.SGD,
                                                                                  Optimizer.SGD_MOMENTUM):
            raise SetupError(f"torch has no fused {self.optimizer.value}: use foreach or single")
        self._validate_objective()
        if model is not None:
            self.validate_for(model)

    def validate_for(self, model: ModelSpec) -> None:
        self._validate_vision(model)
        self.objective_for(model)
        liger_patch(model, self.liger_kernels)  # what liger patches but VRAM Lab does not model is refused
        unsloth_patch(model, self)  # likewise unsloth's
        if self.method is Method.FREEZE and self.trainable_layers and self.trainable_layers > model.num_layers:
            raise SetupError(
                f"{model.name} has {model.num_layers} layers, so --trainable-layers "
                f"{self.trainable_layers} is too many: choose 1-{model.num_layers}"
            )
        if self.uses_lora:
            # a traced model's names are its class's own, resolved (or refused) by the trace's build (core/tracing/
            # hflora.py lora_target_modules); all-linear is every linear layer the model has (peft's rule)
            missing = [] if model.transformers_config or names_all_linear(self.lora_targets) else [
                t for t in self.lora_targets if not model.lora_modules((t,))]
            if missing:
                fused = [t for t in missing if t in FUSED_TARGETS]
                hint = (f" (VRAM Lab models {model.name} with separate q, k, v and gate, up projections: "
                        "name those)" if fused else "")
                raise SetupError(
                    f"{model.name} has no {', '.join(missing)} module: its linear layers are "
                    f"{', '.join(s.name for s in (*model.attn_linears(), *model.mlp_linears()))}, lm_head{hint}"
                )
            if self.lora_rank > model.hidden_size:
                raise SetupError(f"LoRA rank {self.lora_rank} exceeds the hidden size {model.hidden_size}")
        if self.sharding is not Sharding.NONE and self.gpus < 2:
            pass  # legal (DeepSpeed allows it); the estimate carries a warning instead

    def warnings(self, model: ModelSpec) -> list[str]:
        return setup_warnings(self, model)  # core/spec/setup_warnings.py

    # ---- reporting -------------------------------------------------------------------------------------
    def resolved(self) -> dict[str, Any]:
        """Every setting with defaults filled in, plus the derived precision facts."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, StrEnum):
                v = v.value
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        out["weights"] = self.weight_dtype.value
        out["optimizer_impl"] = self.impl.value if self.optimizer.has_impl_choice else self.optimizer.library
        if self.lora_fa and self.uses_lora:
            out["optimizer_impl"] = "peft LoRA-FA"
        out["lora_alpha"] = self.alpha
        if not self.uses_lora:
            for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "adapter_dtype", "use_dora",
                      "use_rslora", "lora_fa"):
                out[k] = None
        if not self.weight_dtype.is_quantized:
            out["kbit_upcast"] = None
        if self.method is not Method.FREEZE:
            out["trainable_layers"] = None
            out["freeze_extra"] = None
        if not self.grad_ckpt:
            out["ckpt_reentrant"] = out["ckpt_offload"] = out["unsloth_gc"] = None
        if self.grad_ckpt or self.method is Method.FULL:  # checkpointing does it too; a trained embedding has grad
            out["input_grads"] = None
        out["effective_batch"] = self.effective_batch
        out["amp"] = self.autocast
        out["grad_dtype"] = self.grad_dtype.value
        out["optimizer_state_dtype"] = self.state_dtype
        out["fp32_master_copy"] = self.has_master_copy
        out["precision"] = self.precision_label()
        if self.objective is Objective.SFT:
            for k in ("reference", "reference_dtype", "completion_len", "num_generations", "steps_per_generation",
                      "generation_backend", "vllm_memory_fraction", "vllm_sleep", "beta", "num_iterations"):
                out[k] = None
        else:
            out["reference"] = self.reference_mode.value
            out["completion_len"] = self.completion_tokens
            out["prompt_len"] = self.prompt_tokens
            out["beta"] = self.beta_value
            if self.objective is not Objective.GRPO:
                for k in ("num_generations", "steps_per_generation", "generation_backend", "vllm_memory_fraction",
                          "vllm_sleep", "num_iterations"):
                    out[k] = None
            else:
                out["steps_per_generation"] = self.generation_steps
        return out

    def replace(self, **changes: Any) -> TrainingSetup:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Exactly the fields as set (``None`` kept: "use the default"), JSON-ready; ``from_dict``
        gives back an equal setup. :meth:`resolved` is for display: defaults filled in, derived keys."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, StrEnum) else list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingSetup:
        """Inverse of :meth:`to_dict`; also reads :meth:`resolved` output (derived keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names and v is not None}
        if kwargs.get("optimizer_impl") in ("bitsandbytes", "torchao", "peft LoRA-FA"):
            kwargs.pop("optimizer_impl")
        return cls(**kwargs)
