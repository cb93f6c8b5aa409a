"""The setup model: what is being trained, how, and on what.

Three frozen dataclasses describe a run completely:

* :class:`ModelSpec` — the architecture (the numbers of a HF ``config.json``) and, derived from it, the
  exact shape of every parameter tensor (:meth:`ModelSpec.layer_params` and friends). The estimator,
  the model builder and the catalog all read shapes from here, so there is one definition of the model.
* :class:`TrainingSetup` — method, precisions, optimizer, LoRA, batch, sequence, checkpointing,
  attention kernel, sharding. Precision is not one switch: weight storage, compute dtype, fp32 master
  weights, gradient dtype and optimizer-state dtype are separate facts (the last two are derived and
  reported in :meth:`TrainingSetup.resolved`).
* :class:`GpuSpec` — a device: name, memory, bf16 peak TFLOP/s.

Invalid combinations raise :class:`SetupError` whose message says what to change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from vramlab.core import vision as _vision
from vramlab.core.checks import (
    SetupError,
    check_flag,
    check_float,
    check_int,
    field_label,
    short_repr,
)
from vramlab.core.families.registry import GEMMA3, LLAVA, QWEN2_5_VL

# ---- bounds ---------------------------------------------------------------------------------------------------
# Every number a user or a file can give has a range, chosen far above every real model and run (the largest
# in 2026: 126-layer dense models, 512 experts, 25k hidden, 262k vocabularies, 10M-token contexts), so that a
# typo or a hostile file is refused with the bound instead of overflowing int64, recursing or running for
# minutes. The messages say the bound.
MODEL_BOUNDS: dict[str, tuple[int, int]] = {
    "num_layers": (1, 1024),
    "hidden_size": (1, 131_072),
    "num_heads": (1, 4096),
    "num_kv_heads": (1, 4096),
    "head_dim": (1, 8192),
    "intermediate_size": (0, 1_048_576),
    "moe_intermediate_size": (0, 1_048_576),
    "shared_expert_intermediate_size": (0, 1_048_576),
    "vocab_size": (1, 4_194_304),
    "num_experts": (0, 1024),
    "experts_per_token": (0, 1024),
    "max_position_embeddings": (1, 2**27),
    "norms_per_layer": (1, 4),
}
MAX_LAYER_EXPERTS = 65_536  # layers x experts: the estimate replays every expert of every layer
MAX_PARAMS = 2**44  # ~17.6 trillion parameters
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
# vision towers whose step under CUDA autocast the estimate models (held to transformers' classes under the
# emulated autocast within 0.2 %: tests/test_vlm_sharding.py)
AUTOCAST_TOWERS = (LLAVA, GEMMA3)
# vision-language classes whose quantized load (every nn.Linear of the tower, projector and language model in
# bitsandbytes' storage but the output head) is emulated and estimated (tests/test_vlm_sharding.py)
QUANTIZED_TOWERS = (QWEN2_5_VL, LLAVA, GEMMA3)
SETUP_FLAGS = ("master_weights", "double_quant", "kbit_upcast", "grad_ckpt", "ckpt_reentrant", "chunked_loss",
               "loss_fp32", "optimizer_in_backward", "vision_ckpt", "pan_and_scan", "use_dora", "use_rslora",
               "lora_fa")
# what freeze trains besides the last layers, by the role of the module (LLaMA-Factory's freeze_extra_modules
# names them by the model's own names: embed_tokens / wte, norm / ln_f, lm_head)
FREEZE_EXTRAS = ("embed_tokens", "norm", "lm_head")
MAX_LORA_ALPHA = 1e6
TAPE_SOURCES = ("auto", "hand-written", "traced")  # where the estimate's tape comes from (ModelSpec.tape)
# A GPU's memory: at least a small laptop GPU, at most far above any single device made.
MIN_GPU_BYTES = 256 * 2**20
MAX_GPU_BYTES = 64 * 2**40



class Method(StrEnum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"
    FREEZE = "freeze"


class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    NF4 = "nf4"

    @property
    def is_float(self) -> bool:
        return self in (DType.FP32, DType.BF16, DType.FP16)

    @property
    def is_quantized(self) -> bool:
        return self in (DType.INT8, DType.NF4)

    @property
    def itemsize(self) -> int:
        """Bytes per element for float dtypes (quantized storage is computed by the estimator)."""
        return _ITEMSIZE.get(self._value_, 0)


_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # DType.itemsize by value (a dict of members hashed each)
FLOAT_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


class Optimizer(StrEnum):
    ADAMW = "adamw"
    ADAMW_8BIT = "adamw8bit"
    PAGED_ADAMW_8BIT = "paged_adamw8bit"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAFACTOR = "adafactor"
    LION = "lion"
    # bitsandbytes 0.50.2 PagedAdamW32bit (transformers' paged_adamw_32bit): fp32 states, paged from 100k elements
    PAGED_ADAMW_32BIT = "paged_adamw_32bit"
    # torchao 0.18.0 torchao.optim AdamW8bit / AdamW4bit (transformers' adamw_torch_8bit / adamw_torch_4bit) and
    # AdamWFp8: block-wise quantized states for tensors of at least 4096 elements, a step compiled by torch.compile
    TORCHAO_ADAMW_8BIT = "adamw_torch_8bit"
    TORCHAO_ADAMW_4BIT = "adamw_torch_4bit"
    TORCHAO_ADAMW_FP8 = "adamw_torchao_fp8"

    @property
    def is_8bit(self) -> bool:
        return self in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)

    @property
    def is_torchao(self) -> bool:
        return self in (Optimizer.TORCHAO_ADAMW_8BIT, Optimizer.TORCHAO_ADAMW_4BIT, Optimizer.TORCHAO_ADAMW_FP8)

    @property
    def library(self) -> str:
        """Whose kernels step it: torch, bitsandbytes or torchao."""
        if self.is_torchao:
            return "torchao"
        return "bitsandbytes" if self.is_8bit or self is Optimizer.PAGED_ADAMW_32BIT else "torch"

    @property
    def has_impl_choice(self) -> bool:
        """torch's foreach / fused / single-tensor choice applies (bitsandbytes and torchao have their own)."""
        return self.library == "torch"

    @property
    def size_dependent_state(self) -> bool:
        """The state's layout depends on each tensor's size (quantized or paged from a threshold)."""
        return not self.has_impl_choice

    @property
    def is_bitsandbytes(self) -> bool:
        """One of bitsandbytes' optimizers (its own kernels, per-tensor state rules)."""
        return self.library == "bitsandbytes"

    @property
    def is_paged(self) -> bool:
        """Large states in CUDA managed memory (outside torch's allocator)."""
        return self in (Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT)


class OptimizerImpl(StrEnum):
    FOREACH = "foreach"
    FUSED = "fused"
    SINGLE = "single"


class Attention(StrEnum):
    SDPA = "sdpa"  # torch scaled_dot_product_attention: flash / memory-efficient kernels
    EAGER = "eager"  # HF eager attention: materialised b x heads x s x s scores

    @classmethod
    def parse(cls, text: str) -> Attention:
        if isinstance(text, Attention):
            return text
        aliases = {"flash": "sdpa", "flash_attention_2": "sdpa", "fa2": "sdpa", "math": "eager"}
        return cls(aliases.get(text.lower(), text.lower()))


class Sharding(StrEnum):
    NONE = "none"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP = "fsdp"

    @property
    def shards_params(self) -> bool:
        return self in (Sharding.ZERO3, Sharding.FSDP)


class LossKernel(StrEnum):
    """The kernel that turns the last hidden states into the loss (core/simulation/loss.py)."""

    HF = "hf"  # lm_head + transformers' ForCausalLMLoss (or its chunked form: chunked_loss)
    CCE = "cce"  # Cut Cross Entropy 25.1.1 (axolotl's cut_cross_entropy): no logits, an fp32 log-sum-exp per token


class Offload(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params"  # parameters and optimizer (ZeRO-3 / FSDP CPU offload)


class Objective(StrEnum):
    """What the step optimises, as TRL 1.16.0 runs it (see docs/levels.md, "Objectives")."""

    SFT = "sft"  # next-token cross entropy (HF Trainer / TRL SFTTrainer)
    DPO = "dpo"  # DPOTrainer, loss_type sigmoid: policy + reference over chosen and rejected, concatenated
    IPO = "ipo"  # DPOTrainer with loss_type ipo: the same step, another loss on per-sequence log-probs
    KTO = "kto"  # KTOTrainer: unpaired completions plus mismatched KL completions
    ORPO = "orpo"  # trl.experimental.orpo: no reference, full logits
    SIMPO = "simpo"  # trl.experimental.cpo with loss_type simpo: no reference, full logits
    CPO = "cpo"  # trl.experimental.cpo: no reference, full logits
    GRPO = "grpo"  # GRPOTrainer: generation, then the policy step over prompt + completion

    @property
    def preference(self) -> bool:
        return self in (Objective.DPO, Objective.IPO, Objective.KTO)

    @property
    def no_reference(self) -> bool:
        """ORPO / SimPO / CPO: TRL's trl.experimental trainers with no reference model (NO_REFERENCE_OBJECTIVES)."""
        return self in NO_REFERENCE_OBJECTIVES


class Reference(StrEnum):
    """Where the reference log-probabilities come from."""

    COPY = "copy"  # a second, frozen model (TRL's default for full fine-tuning)
    ADAPTERS = "adapters"  # the policy with its LoRA adapters disabled (TRL's default with peft): no second copy
    PRECOMPUTED = "precomputed"  # precompute_ref_log_probs=True: nothing during training
    NONE = "none"  # GRPO with beta = 0: no reference at all


class GenerationBackend(StrEnum):
    TRANSFORMERS = "transformers"  # model.generate with a DynamicCache on the training GPU
    VLLM_COLOCATE = "vllm-colocate"  # vLLM in the training process: a share of the device
    VLLM_SERVER = "vllm-server"  # vLLM on other GPUs: nothing on the training GPU


# Objectives not modelled (refused with a reason): none left since ORPO / SimPO / CPO are.
UNMODELLED_OBJECTIVES: tuple[Objective, ...] = ()
# TRL 1.16.0's trl.experimental ORPOTrainer / CPOTrainer (SimPO is CPOTrainer with loss_type "simpo"): no reference
# model, ``concatenated_forward`` with the full (2 x micro batch x sequence x vocabulary) logits.
NO_REFERENCE_OBJECTIVES = (Objective.ORPO, Objective.SIMPO, Objective.CPO)
OBJECTIVE_BOUNDS: dict[str, tuple[int, int]] = {
    "completion_len": (1, 2**20),
    "num_generations": (1, 4096),
    "steps_per_generation": (1, 1_048_576),
    "num_iterations": (1, 1024),
}


class MlpKind(StrEnum):
    GATED = "gated"  # SwiGLU / GeGLU: down(act(gate(x)) * up(x))
    PLAIN = "plain"  # down(act(up(x)))


class NormKind(StrEnum):
    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"


class Activation(StrEnum):
    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    GELU_NEW = "gelu_new"  # transformers' NewGELUActivation (GPT-2, phi): the tanh GELU in eight Python ops
    RELU = "relu"

    @classmethod
    def parse(cls, text: str) -> Activation:
        t = text.lower()
        if t in ("silu", "swish", "swiglu"):
            return cls.SILU
        if t == "gelu_new":
            return cls.GELU_NEW
        if t in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_fast", "geglu_tanh"):
            return cls.GELU_TANH
        if t.startswith("gelu") or t == "geglu":
            return cls.GELU
        if t == "relu":
            return cls.RELU
        raise SetupError(f"unsupported activation {text!r}; supported: silu, gelu, gelu_pytorch_tanh, gelu_new, relu")


# HF module names; the plain (non-gated) MLP uses up_proj/down_proj (fc1/fc2 are accepted as aliases).
# Fused projections (one matrix for q, k and v; one for gate and up) keep their own names: a model has
# either the fused module or the separate ones, and peft adapts the module it is given.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "gate_up_proj")
ALL_TARGETS = (*ATTN_TARGETS, *MLP_TARGETS, *FUSED_TARGETS, "lm_head")
_TARGET_ALIASES: dict[str, str | tuple[str, ...]] = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
    "fc1": "up_proj", "fc2": "down_proj", "dense": "o_proj", "output": "lm_head",
    # other families' names for the same roles: GPT-NeoX / Falcon / BLOOM, GPT-2 (Conv1D), GPT-J, MPT, ...
    "qkv": "qkv_proj", "query_key_value": "qkv_proj", "c_attn": "qkv_proj", "wqkv": "qkv_proj",
    "gate_up": "gate_up_proj", "c_fc": "up_proj", "fc_in": "up_proj", "dense_h_to_4h": "up_proj",
    "fc_out": "down_proj", "dense_4h_to_h": "down_proj",
    "out_proj": "o_proj", "c_proj": ("o_proj", "down_proj"),  # GPT-2's c_proj is both
}


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """Parse 'q_proj,v_proj' / 'q,v' / 'all-linear' into canonical HF module names (ordered, unique). Any other
    module name (DeepSeek-V2's ``kv_a_proj_with_mqa``) is kept as given, after the canonical ones: peft adapts
    every linear module whose name is it or ends in ``.`` + it, and the model decides whether it has one (a
    hand-written family refuses it in :meth:`TrainingSetup.validate_for`, the built model in its LoRA step)."""
    items = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else [str(t) for t in targets]
    items = [t for t in items if t]
    out: list[str] = []
    for t in items:
        key = t.lower()
        if key in ("all-linear", "all_linear", "all"):
            names = [*ATTN_TARGETS, *MLP_TARGETS]
        elif key in _TARGET_ALIASES or key in ALL_TARGETS:
            alias = _TARGET_ALIASES.get(key, key)
            names = list(alias) if isinstance(alias, tuple) else [alias]
        elif _MODULE_NAME.fullmatch(t):
            names = [t]
        else:
            raise SetupError(f"LoRA target {t!r} is not a module name; use the model's module names (e.g. "
                             f"{', '.join(ALL_TARGETS)}) or all-linear")
        for n in names:
            if n not in out:
                out.append(n)
    if not out:
        raise SetupError("LoRA needs at least one target module, e.g. --lora-targets q_proj,v_proj")
    known = sorted((n for n in out if n in ALL_TARGETS), key=ALL_TARGETS.index)
    return (*known, *(n for n in out if n not in ALL_TARGETS))


def _by_targets(method):  # noqa: ANN001, ANN202
    """``method(spec, targets)`` kept per (spec, targets): a spec is frozen, and a warm estimate asks for
    its LoRA modules several times (validation, warnings, notes), each building the layer's shapes."""
    kept = functools.lru_cache(maxsize=1024)(method)

    @functools.wraps(method)
    def wrapper(self, targets: Iterable[str]) -> Any:  # noqa: ANN001
        targets = tuple(targets)
        try:
            return kept(self, targets)
        except TypeError:  # a spec built with an unhashable value (a list from a file): not kept
            return method(self, targets)

    return wrapper


@dataclass(frozen=True)
class LinearShape:
    """One weight matrix of a layer: HF name, out_features x in_features, bias, and how many copies
    (experts) the layer holds."""

    name: str
    out_features: int
    in_features: int
    bias: bool = False
    copies: int = 1

    @property
    def weight_numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def numel(self) -> int:
        return self.copies * (self.weight_numel + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, with the numbers of its HF ``config.json``.

    ``published_params`` is the total the model's publisher reports (from the safetensors index or model
    card), kept beside the architecture so a test can check that the shapes below reproduce it exactly.
    """

    id: str
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    family: str = ""
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    lm_head_bias: bool = False
    mlp_kind: MlpKind = MlpKind.GATED
    activation: Activation = Activation.SILU
    norm_kind: NormKind = NormKind.RMSNORM
    norms_per_layer: int = 2  # Gemma-2 has 4 (sandwich norms); parallel blocks have 1
    qk_norm: bool = False  # Qwen3 / OLMo-2 style RMSNorm on q and k (per head_dim)
    parallel_block: bool = False  # attention and MLP read the same normed input (GPT-J, phi-1.5)
    num_experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # 0: intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen-MoE style shared expert (0: none)
    max_position_embeddings: int = 4096
    learned_positions: bool = False  # GPT-2 style absolute position embedding table
    # Dropout in training (GPT-2's embd_pdrop, resid_pdrop, attn_pdrop; 0: none): after the embeddings, after each
    # block's output projection, and on eager attention's probabilities (SDPA's fused kernels keep no mask)
    embed_dropout: float = 0.0
    resid_dropout: float = 0.0
    attention_dropout: float = 0.0
    scale_embeddings: bool = False  # Gemma multiplies embeddings by sqrt(hidden)
    final_logit_softcap: float = 0.0  # Gemma-2: logits = cap * tanh(logits / cap)
    attn_logit_softcap: float = 0.0  # Gemma-2 (eager attention only)
    fused_qkv: bool = False  # one qkv_proj computes q, k and v (Phi-3); sliced into the three
    fused_gate_up: bool = False  # one gate_up_proj computes gate and up (Phi-3); chunked into the two
    rope_pass_cat: bool = False  # RoPE splits rotary / pass-through dims and concatenates them (Phi-3)
    rotary_dim: int = 0  # dims of each head RoPE rotates (partial_rotary_factor x head_dim); 0: all
    # Sliding-window attention (Mistral-7B-v0.1, Phi-3): from seq >= window on, transformers passes SDPA an
    # explicit (b, 1, s, s) mask and repeats k and v for grouped-query attention; 0: none
    sliding_window: int = 0
    checkpoint_dtype: DType = DType.BF16  # dtype the weights ship in
    published_params: int | None = None
    source: str = ""  # where the numbers come from (repo/config, model card)
    notes: str = ""
    # An architecture only traced (issue 12): transformers' config of it as canonical JSON (sorted keys), and
    # its parameters counted from the model transformers builds; the fields above are what the config fills
    # in (for display and the outer levels), not a description of its layers
    transformers_config: str = ""
    counted_params: int = 0
    # which tape the estimate replays: "auto" (the hand-written program where the family is written by
    # hand, else the trace), "hand-written" or "traced" (transformers' own classes, see core/traced.py)
    tape: str = "auto"
    # A vision-language model: its vision tower and projector (core/vision.py); None for a text model
    vision: Any = None

    def __hash__(self) -> int:
        """The hash dataclass would make (of every field, in order), made once per spec: a warm estimate looks
        its spec up about ten times (its LoRA modules and counts are kept per spec), and hashing 46 fields each
        time was a tenth of it. A spec is frozen, and ``__post_init__`` sets its fields before anything can hash
        it; ``dataclasses.replace`` makes a new spec, with a hash of its own."""
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash(tuple(getattr(self, name) for name in _SPEC_FIELDS))
            object.__setattr__(self, "_hash", value)
            return value

    def __getstate__(self) -> dict[str, Any]:  # a copy or a pickle carries the fields, not this process's hash
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self) -> None:
        if isinstance(self.vision, Mapping):  # a preset's or a saved spec's dict
            object.__setattr__(self, "vision", _vision.VisionSpec.from_dict(self.vision))
        # Accept plain strings for the enum fields (JSON presets, CLI).
        for f, enum in (("mlp_kind", MlpKind), ("norm_kind", NormKind), ("checkpoint_dtype", DType)):
            object.__setattr__(self, f, enum(getattr(self, f)))
        object.__setattr__(self, "activation", Activation.parse(str(self.activation)))
        for name, (lo, hi) in MODEL_BOUNDS.items():  # whole numbers in range before any arithmetic on them
            try:
                check_int(name, getattr(self, name), 0 if name == "head_dim" else lo, hi, name)
            except SetupError as e:
                raise SetupError(f"model {self.id!r}: {e}") from None
        if self.head_dim == 0 and self.num_heads > 0:
            if self.hidden_size % self.num_heads:
                raise SetupError(f"model {self.id!r}: hidden_size ({self.hidden_size}) is not a multiple of "
                                 f"num_attention_heads ({self.num_heads}) and no head_dim is given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        self.validate()

    # ---- validation -------------------------------------------------------------------------------
    def validate(self) -> None:
        where = f"model {self.id!r}"
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
                raise SetupError(f"{where}: {name} must be a positive integer (got {v})")
        for name, (lo, hi) in MODEL_BOUNDS.items():
            try:
                check_int(name, getattr(self, name), lo, hi, name)
            except SetupError as e:
                raise SetupError(f"{where}: {e}") from None
        for name in ("final_logit_softcap", "attn_logit_softcap"):
            try:
                check_float(name, getattr(self, name), 0.0, 1e6, name)
            except SetupError as e:
                raise SetupError(f"{where}: {e}") from None
        for name in ("embed_dropout", "resid_dropout", "attention_dropout"):
            try:
                check_float(name, getattr(self, name), 0.0, 1.0, name, hi_open=True)
            except SetupError as e:
                raise SetupError(f"{where}: {e}") from None
        for name in ("tie_embeddings", "qkv_bias", "o_bias", "mlp_bias", "lm_head_bias", "qk_norm",
                     "parallel_block", "learned_positions", "scale_embeddings"):
            check_flag(name, getattr(self, name))
        if self.num_layers * max(self.num_experts, 1) > MAX_LAYER_EXPERTS:
            raise SetupError(f"{where}: {self.num_layers} layers x {self.num_experts} experts is more than "
                             f"{MAX_LAYER_EXPERTS:,} expert layers")
        if self.intermediate_size <= 0 and not self.is_moe:
            raise SetupError(f"{where}: intermediate_size must be positive")
        if self.num_heads % self.num_kv_heads:
            raise SetupError(
                f"{where}: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise SetupError(f"{where}: experts per token must be between 1 and {self.num_experts}")
        if self.rotary_dim and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise SetupError(f"{where}: rotary_dim must be an even number of dims up to head_dim ({self.head_dim})")
        if self.rotary_dim and self.rotary_dim < self.head_dim and not self.rope_pass_cat:
            raise SetupError(f"{where}: a partial rotary_dim is modelled with rope_pass_cat (Phi-3's RoPE)")
        if self.sliding_window < 0:
            raise SetupError(f"{where}: sliding_window must be 0 (none) or a number of tokens")
        if self.norms_per_layer not in (1, 2, 4):
            raise SetupError(f"{where}: norms_per_layer must be 1, 2 or 4")
        if self.tape not in TAPE_SOURCES:
            raise SetupError(f"{where}: the tape source must be one of {', '.join(TAPE_SOURCES)} (got {self.tape!r})")
        if self.transformers_config and self.tape == "hand-written":
            raise SetupError(f"{where}: {self.family or 'this architecture'} has no hand-written program: only its "
                             "trace (transformers' own classes) estimates it; use the tape source auto or traced")
        if self.param_count > MAX_PARAMS:
            raise SetupError(f"{where}: {self.param_count:.3g} parameters is more than the {MAX_PARAMS:.3g} "
                             "this estimator counts")

    # ---- derived shapes ------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dims of each head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def expert_intermediate(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def norm_params(self) -> int:
        """Parameters of one norm over hidden_size (LayerNorm has a bias)."""
        return self.hidden_size * (2 if self.norm_kind is NormKind.LAYERNORM else 1)

    def attn_linears(self) -> tuple[LinearShape, ...]:
        h = self.hidden_size
        if self.fused_qkv:
            return (LinearShape("qkv_proj", self.q_dim + 2 * self.kv_dim, h, self.qkv_bias),
                    LinearShape("o_proj", h, self.q_dim, self.o_bias))
        return (
            LinearShape("q_proj", self.q_dim, h, self.qkv_bias),
            LinearShape("k_proj", self.kv_dim, h, self.qkv_bias),
            LinearShape("v_proj", self.kv_dim, h, self.qkv_bias),
            LinearShape("o_proj", h, self.q_dim, self.o_bias),
        )

    def mlp_linears(self) -> tuple[LinearShape, ...]:
        """The MLP's weight matrices; for MoE each shape has ``copies = num_experts``."""
        h = self.hidden_size
        inter = self.expert_intermediate
        copies = self.num_experts or 1
        if self.mlp_kind is MlpKind.GATED and self.fused_gate_up:
            return (
                LinearShape("gate_up_proj", 2 * inter, h, self.mlp_bias, copies),
                LinearShape("down_proj", h, inter, self.mlp_bias, copies),
            )
        if self.mlp_kind is MlpKind.GATED:
            return (
                LinearShape("gate_proj", inter, h, self.mlp_bias, copies),
                LinearShape("up_proj", inter, h, self.mlp_bias, copies),
                LinearShape("down_proj", h, inter, self.mlp_bias, copies),
            )
        return (
            LinearShape("up_proj", inter, h, self.mlp_bias, copies),
            LinearShape("down_proj", h, inter, self.mlp_bias, copies),
        )

    def shared_expert_linears(self) -> tuple[LinearShape, ...]:
        if not self.shared_expert_intermediate_size:
            return ()
        h, inter = self.hidden_size, self.shared_expert_intermediate_size
        return (
            LinearShape("shared_gate_proj", inter, h),
            LinearShape("shared_up_proj", inter, h),
            LinearShape("shared_down_proj", h, inter),
            LinearShape("shared_expert_gate", 1, h),
        )

    def router_linear(self) -> LinearShape | None:
        return LinearShape("router", self.num_experts, self.hidden_size) if self.is_moe else None

    def layer_linears(self) -> tuple[LinearShape, ...]:
        router = self.router_linear()
        return (*self.attn_linears(), *self.mlp_linears(), *self.shared_expert_linears(),
                *((router,) if router else ()))

    def attention_run(self, asked: Attention) -> Attention:
        """The attention transformers runs when ``asked`` is requested: eager where SDPA cannot compute this
        model's scores (attention-logit softcapping: Gemma 2's class has no SDPA path), else ``asked``."""
        return Attention.EAGER if self.attn_logit_softcap else asked

    @property
    def gemma_norm(self) -> bool:
        """RMSNorm as transformers' Gemma classes compute it: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``
        in fp32, then cast back (Llama's casts back before the weight). The Gemma families are the ones that
        scale their embeddings."""
        return self.scale_embeddings and self.norm_kind is NormKind.RMSNORM

    @property
    def eager_masks(self) -> int:
        """Additive masks transformers' eager attention builds, one per layer type: Gemma 2 and 3 (the
        sandwich-norm families) interleave sliding-window and full layers, two masks at any length."""
        return 2 if self.norms_per_layer == 4 else 1

    @property
    def full_attention_every(self) -> int:
        """Gemma 3's text model attends to the whole sequence in one layer of six (layer_types' default
        pattern, which the config reader holds) and within the sliding window in the others: only those take
        the window's mask (0: every layer takes it)."""
        return 6 if self.gemma_norm and self.qk_norm and self.norms_per_layer == 4 else 0

    def takes_window_mask(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within the sliding window (see :attr:`full_attention_every`)."""
        every = self.full_attention_every
        return not every or (layer + 1) % every != 0

    def sdpa_mask(self, seq_len: int) -> bool:
        """Whether transformers builds an explicit attention mask for SDPA at this length (sliding window:
        its causal-mask skip needs ``seq_len < sliding_window``)."""
        return 0 < self.sliding_window <= seq_len

    @_by_targets
    def lora_modules(self, targets: Iterable[str]) -> tuple[str, ...]:
        """The model's own modules that LoRA ``targets`` adapt. Separate q/k/v (gate/up) names given for a
        model that fuses them adapt the fused module, as peft's default targets and ``all-linear`` do
        (:meth:`TrainingSetup.warnings` says so when only some of them were named); names the model has
        no module for are left out (:meth:`TrainingSetup.validate_for` refuses them)."""
        own = {s.name for s in self.layer_linears()} | {"lm_head"}
        out: list[str] = []
        for t in targets:
            name = t
            if t not in own and self.fused_qkv and t in ("q_proj", "k_proj", "v_proj"):
                name = "qkv_proj"
            elif t not in own and self.fused_gate_up and t in ("gate_proj", "up_proj"):
                name = "gate_up_proj"
            if name in own and name not in out:
                out.append(name)
        return tuple(out)

    def layer_norm_params(self) -> int:
        """Parameters of one layer's norms (layer norms and q/k norms)."""
        return self.norms_per_layer * self.norm_params + (2 * self.head_dim if self.qk_norm else 0)

    def layer_params(self) -> int:
        return sum(s.numel for s in self.layer_linears()) + self.layer_norm_params()

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + (
            self.max_position_embeddings * self.hidden_size if self.learned_positions else 0
        )

    def lm_head_params(self) -> int:
        """Untied output head (0 when tied to the input embedding) plus its bias."""
        weight = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return weight + (self.vocab_size if self.lm_head_bias else 0)

    @property
    def param_count(self) -> int:
        """Total parameters, counting a tied embedding once (as the publishers do); a vision-language model's
        vision tower and projector included."""
        if self.counted_params:
            return self.counted_params
        return (
            self.embedding_params()
            + self.num_layers * self.layer_params()
            + self.norm_params  # final norm
            + self.lm_head_params()
            + (self.vision.param_count + self.vision.language_extra_params(self) if self.vision is not None else 0)
        )

    @property
    def active_param_count(self) -> int:
        """Parameters used per token (MoE: only the routed experts)."""
        if not self.is_moe:
            return self.param_count
        per_expert = sum(s.numel // s.copies for s in self.mlp_linears())
        inactive = (self.num_experts - self.experts_per_token) * per_expert * self.num_layers
        return self.param_count - inactive

    def summary(self) -> str:
        attn = f"{self.num_heads} heads" + (
            f"/{self.num_kv_heads} kv" if self.num_kv_heads != self.num_heads else ""
        )
        mlp = f"{self.num_experts}x{self.expert_intermediate} experts (top-{self.experts_per_token})" \
            if self.is_moe else f"{self.intermediate_size} ffn"
        return (f"{self.num_layers}L/{self.hidden_size}h/{attn}/{mlp}/{self.vocab_size} vocab"
                + (" (tied)" if self.tie_embeddings else ""))

    # ---- (de)serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, StrEnum) else v
        if self.vision is not None:
            out["vision"] = self.vision.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SetupError(f"unknown model fields: {', '.join(sorted(unknown))}")
        return cls(**dict(data))


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec) if (f.compare if f.hash is None else f.hash))


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: memory as the driver reports it (bytes) and dense bf16 peak TFLOP/s."""

    id: str
    name: str
    memory_bytes: int
    bf16_tflops: float = 0.0
    vendor: str = "nvidia"
    arch: str = ""  # e.g. ampere, ada, hopper, blackwell, cdna3
    compute_capability: str = ""
    memory_bandwidth_gbps: float = 0.0
    tier: str = ""  # consumer, workstation, datacenter
    notes: str = ""

    def __post_init__(self) -> None:
        where = f"GPU {str(self.name)[:40]!r}"
        try:
            check_int("memory_bytes", self.memory_bytes, MIN_GPU_BYTES, MAX_GPU_BYTES, "memory (bytes)")
            check_float("bf16_tflops", self.bf16_tflops, 0.0, 1e7, "bf16 TFLOP/s")
            check_float("memory_bandwidth_gbps", self.memory_bandwidth_gbps, 0.0, 1e9, "memory bandwidth")
        except SetupError as e:
            raise SetupError(f"{where}: {e}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SetupError(f"unknown GPU fields: {', '.join(sorted(unknown))}")
        return cls(**dict(data))


# ---- the training setup ------------------------------------------------------------------------------

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
    attention: Attention = Attention.SDPA
    gpus: int = 1
    sharding: Sharding = Sharding.NONE
    offload: Offload = Offload.NONE
    chunked_loss: bool = False  # compute lm_head + loss in chunks, recomputed in backward
    loss_fp32: bool = True  # HF upcasts logits to fp32 for the loss; LitGPT / torchtune keep bf16
    loss_chunks: int = 8
    loss_kernel: LossKernel = LossKernel.HF  # the loss kernel the framework patches in (axolotl, Liger)
    optimizer_in_backward: bool = False  # step each parameter as soon as its gradient is ready
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
        }
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

    # ---- derived facts -------------------------------------------------------------------------------
    @property
    def weight_dtype(self) -> DType:
        if self.weights is not None:
            return self.weights
        return DType.NF4 if self.method is Method.QLORA else DType.BF16

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
        return bool(self.amp)

    @property
    def trainable_dtype(self) -> DType:
        """dtype of the trainable tensors (and so of their gradients)."""
        if self.uses_lora:
            return self.adapter_dtype
        return self.weight_dtype

    @property
    def has_master_copy(self) -> bool:
        """An fp32 master copy beside 16-bit trainable weights (DeepSpeed / Megatron style)."""
        return self.master_weights and self.trainable_dtype is not DType.FP32

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
        if self.autocast:
            return f"{w.value} + autocast"
        label = f"pure {w.value}" + (" + fp32 master" if self.has_master_copy else "")
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
        if model.vision.model_type == "mllama":
            from vramlab.core.families.mllama.vision import check_mllama_setup

            check_mllama_setup(model, self)
        if self.vision_tuning == "lora" and not self.uses_lora:
            raise SetupError("--vision-tuning lora adapts the vision tower with LoRA: use --method lora")
        # ZeRO-1 / 2 partition the optimizer's states and the gradients, whatever the model is (the rank's
        # sharder applies to any step: core/simulation/shard.py, core/estimator/shard.py), and a loss kernel
        # (chunked, 16-bit logits) replaces the loss of any causal LM's head (core/simulation/loss.py)
        if (self.sharding.shards_params or self.optimizer_in_backward
                or self.method is Method.FREEZE or self.objective is not Objective.SFT):
            raise SetupError(f"{model.name} (a vision-language model) is modelled for full, LoRA or QLoRA SFT, on "
                             "one GPU or with ZeRO-1 / 2, without parameter sharding, optimizer-in-backward or a "
                             "preference / RL objective: drop those options")
        if self.weight_dtype.is_quantized:
            if model.vision.traced or model.vision.model_type not in QUANTIZED_TOWERS:
                raise SetupError(f"{model.name}: a quantized base of this vision-language class is not emulated yet: "
                                 "use --method lora")
            if self.vision_tuning in ("full", "projector"):
                raise SetupError("bitsandbytes' quantized linear layers cannot be trained, and the tower's and the "
                                 "projector's are quantized with the rest: --vision-tuning frozen or lora")
        if self.autocast and not model.vision.traced and model.vision.model_type not in AUTOCAST_TOWERS:
            raise SetupError(f"{model.name}: its step under autocast is not modelled yet (0.8-4.6 % off "
                             "transformers' own under CUDA autocast): train it in pure bf16 (--weights bf16)")

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
    def hidden_dtype(self) -> DType:
        """dtype of the decoder's hidden states (what a loss kernel gets): the float parameters' (the compute dtype
        beside quantized weights, and where FSDP / ZeRO-3 gather fp32 parameters in the compute dtype)."""
        w = self.weight_dtype
        if w.is_quantized:
            return self.compute
        if w is DType.FP32 and self.sharding.shards_params and self.compute is not DType.FP32:
            return self.compute
        return w

    def _validate_loss_kernel(self) -> None:
        if self.loss_kernel is LossKernel.HF:
            return
        if self.chunked_loss:
            raise SetupError("Cut Cross Entropy replaces lm_head and the whole loss (it never makes the logits): "
                             "drop --chunked-loss")
        if not self.loss_fp32:
            raise SetupError("Cut Cross Entropy never makes the logits (its log-sum-exp is fp32): drop --loss-bf16")
        if self.sharding.shards_params:
            raise SetupError(f"Cut Cross Entropy with {self.sharding.value} is not modelled yet: it reads "
                             "lm_head.weight outside lm_head's forward, where ZeRO-3 and FSDP gather a module's "
                             "parameters; use --sharding zero1 or zero2")
        if self.hidden_dtype not in (DType.BF16, DType.FP16):
            # cut_cross_entropy.cce_backward.cce_backward_kernel's assertion, on the hidden states ("embeddings")
            raise SetupError(f"Cut Cross Entropy cannot train on {self.hidden_dtype.value} hidden states (its "
                             "backward: \"Backwards requires embeddings to be bf16 or fp16\"): use --weights bf16")

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
        if self.optimizer_in_backward or self.chunked_loss or self.loss_kernel is not LossKernel.HF:
            raise SetupError(
                f"--objective {obj.value} is modelled without optimizer-in-backward, a chunked loss or a fused loss "
                "kernel (TRL computes the log-probabilities with its own chunked LM head)"
            )
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
        partitioned. Parameter sharding is modelled where the policy is the only model (LoRA's disabled adapters,
        no reference, precomputed log-probabilities) and nothing is generated."""
        sh = self.sharding
        if sh is Sharding.NONE:
            return
        obj = self.objective
        if obj is Objective.GRPO and self.generation_backend is not GenerationBackend.TRANSFORMERS:
            raise SetupError("GRPO's vLLM generation is modelled on one GPU: use --generation-backend transformers "
                             "with sharding")
        if not sh.shards_params:
            return
        if obj is Objective.GRPO:
            raise SetupError(f"GRPO with {sh.value} is not modelled yet: TRL gathers every parameter for generation "
                             "(GRPOConfig.ds3_gather_for_generation) and shards its reference with the policy; use "
                             "--sharding zero1 or zero2")
        if self.reference_mode is Reference.COPY:
            raise SetupError(f"--objective {obj.value} with a reference copy under {sh.value} is not modelled yet: TRL "
                             "shards the reference model too (prepare_deepspeed at stage 3, prepare_fsdp); use LoRA "
                             "(--reference adapters), --reference precomputed or --sharding zero1 / zero2")

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
                            lora_dropout=0.0, **{f: getattr(default, f) for f in objective_fields})

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
        self._validate_loss_kernel()
        if self.optimizer_impl is OptimizerImpl.FUSED and self.optimizer not in (Optimizer.ADAMW, Optimizer.SGD,
                                                                                  Optimizer.SGD_MOMENTUM):
            raise SetupError(f"torch has no fused {self.optimizer.value}: use foreach or single")
        self._validate_objective()
        if model is not None:
            self.validate_for(model)

    def validate_for(self, model: ModelSpec) -> None:
        self._validate_vision(model)
        self.objective_for(model)
        if self.method is Method.FREEZE and self.trainable_layers and self.trainable_layers > model.num_layers:
            raise SetupError(
                f"{model.name} has {model.num_layers} layers, so --trainable-layers "
                f"{self.trainable_layers} is too many: choose 1-{model.num_layers}"
            )
        if self.uses_lora:
            # a traced model's module names are its transformers class's own: the trace's build resolves
            # them there (core/tracing/hf.py lora_target_modules) and refuses a name the model lacks
            missing = [] if model.transformers_config else [t for t in self.lora_targets
                                                             if not model.lora_modules((t,))]
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
        out = []
        if self.uses_lora:
            groups = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
            for fused, parts in groups:
                named = [p for p in parts if p in self.lora_targets]
                if named and len(named) < len(parts) and fused in model.lora_modules(named):
                    out.append(f"{model.name} fuses {', '.join(parts)} into {fused}: LoRA on {', '.join(named)} "
                               f"adapts the whole {fused} (peft needs the name {fused})")
        if (self.objective is not Objective.SFT and self.autocast and self.grad_ckpt
                and self.weight_dtype.is_float and self.weight_dtype.itemsize > self.compute.itemsize):
            out.append(f"--objective {self.objective.value} under autocast with checkpointing: autocast's weight "
                       "cache over the objective's forwards is not modelled (CUDA holds each checkpointed layer's "
                       f"{self.compute.value} copy of its trainable {self.weight_dtype.value} weights to the end of "
                       "each forward: 1.94 GB for TinyLlama's SFT, modelled there); this estimate leaves them out")
        if (self.uses_lora and model.is_moe and model.tape != "traced" and not model.transformers_config
                and any(t in MLP_TARGETS for t in self.lora_targets)):
            out.append(f"{model.name} is a mixture of experts: with MLP modules targeted, peft adapts its experts' "
                       "fused weight tensors (Mixtral, Qwen3-MoE) or none of them (Qwen1.5/2-MoE), which the "
                       "hand-written program does not model (47 % low for Mixtral with LoRA on all linear layers, "
                       "benchmarks/results/architectures_traced.json); with torch, transformers and peft installed "
                       "(pip install 'vramlab[hf]') an SFT recipe without sharding is estimated from a trace of "
                       "transformers' and peft's own step instead")
        if self.seq_len > model.max_position_embeddings:
            out.append(
                f"sequence {self.seq_len} is longer than {model.name}'s {model.max_position_embeddings} "
                "positions (needs RoPE scaling)"
            )
        if self.sharding is not Sharding.NONE and self.gpus < 2:
            out.append(f"{self.sharding.value} over 1 GPU divides nothing; set --gpus")
        if self.gpus > 1 and self.sharding is Sharding.NONE:
            out.append(f"{self.gpus} GPUs without sharding: data parallel, every GPU holds a full replica")
        if self.compute is DType.FP16 and not self.autocast and not self.weight_dtype.is_quantized \
                and self.method in (Method.FULL, Method.FREEZE):
            out.append("pure fp16 training without master weights is numerically fragile")
        if model.vision is not None and model.vision.model_type == "qwen2_5_vl" and self.vision_tuning != "frozen" \
                and self.attention is Attention.SDPA:
            out.append("the vision tower's attention is modelled as transformers' SDPA path (one call per window, "
                       "the outputs concatenated); flash_attention_2's varlen kernel keeps one patches x width "
                       "activation per block fewer")
        if self.objective is Objective.GRPO and self.generation_backend is GenerationBackend.VLLM_COLOCATE:
            out.append(f"vLLM colocated takes {self.vllm_memory_fraction:g} of the GPU's memory on the device "
                       "level (included when a GPU is given); its generation is not on the tensor level")
        if model.attention_run(self.attention) is not self.attention:
            out.append(f"{model.name} softcaps its attention logits, which SDPA cannot: transformers runs eager "
                       "attention for it (heads x seq x seq scores per layer), and so does this estimate")
        if self.attention is Attention.EAGER and model.attn_logit_softcap == 0 and self.seq_len >= 4096:
            out.append("eager attention materialises heads x seq x seq scores per layer; sdpa saves them")
        return out

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
            out["ckpt_reentrant"] = None
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


def follow_changes(current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """What follows from an edit of setup fields (``TrainingSetup`` keyword arguments): the one rule the CLI
    and the window both apply. A method change brings the weight storage it needs, unless the same edit
    names the storage too: QLoRA a quantized base (nf4), every other method a float one (bf16). A change to
    an 8-bit optimizer drops the torch implementation choice (it has none), unless the edit names one.
    Returns only the consequences; the caller applies ``{**current, **changes, **consequences}``."""
    new = {**current, **changes}
    out: dict[str, Any] = {}
    if "method" in changes and "weights" not in changes:
        method = Method(new["method"])
        weights = DType(new["weights"]) if new.get("weights") is not None else None
        if method is Method.QLORA and (weights is None or not weights.is_quantized):
            out["weights"] = DType.NF4
        elif method is not Method.QLORA and weights is not None and weights.is_quantized:
            out["weights"] = DType.BF16
    if "optimizer" in changes and "optimizer_impl" not in changes and new.get("optimizer") is not None \
            and not Optimizer(new["optimizer"]).has_impl_choice:
        out["optimizer_impl"] = None
    return out


def repair_setup_fields(data: Any, base: TrainingSetup | None = None, model: ModelSpec | None = None,
                        where: str = "setup") -> tuple[dict[str, Any], list[str]]:
    """Setup fields read back from a file we wrote earlier (the window's settings), checked value by value
    with the rules the CLI applies: a bad value is left out (so ``base``'s, the default, stays) and reported.
    If the values are each fine but do not go together, none is kept. Returns (fields, problems): the
    fields build a setup that validates, and every problem is one line for people.

    Files the user opens (scenarios) are refused whole instead, with the first problem: see
    :meth:`TrainingSetup.from_dict` and :meth:`validate`."""
    base = base or TrainingSetup()
    if not isinstance(data, Mapping):
        return {}, [f"{where}: expected an object of settings, found {type(data).__name__}; using the defaults"]
    names = {f.name for f in dataclasses.fields(TrainingSetup)}
    good: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        if key not in names or value is None:
            continue
        try:
            good[key] = getattr(base.replace(**{key: value}), key)
        except (SetupError, TypeError, ValueError) as e:
            problems.append(f"{where}: {_first_line(e)}; using {_shown_default(getattr(base, key))}")
            continue
        try:
            base.replace(**{key: value}).check_fields()
        except SetupError as e:
            good.pop(key)
            problems.append(f"{where}: {_first_line(e)}; using {_shown_default(getattr(base, key))}")
    try:
        base.replace(**good).validate(model)
    except SetupError as e:
        problems.append(f"{where}: {_first_line(e)}; using the defaults")
        good = {}
    return good, problems


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _shown_default(value: Any) -> str:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return ",".join(value)
    return "the default" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# ---- precision presets -------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrecisionPreset:
    """A named bundle of method and precision settings; the settings stay visible and editable."""

    id: str
    label: str
    description: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, setup: TrainingSetup) -> TrainingSetup:
        return setup.replace(**dict(self.fields))


PRECISION_PRESETS: tuple[PrecisionPreset, ...] = (
    PrecisionPreset(
        "full-amp-bf16", "Full - AMP BF16",
        "fp32 weights, gradients and AdamW states; matmuls in bf16 under autocast, which keeps a bf16 "
        "copy of each weight for backward. 16 bytes per parameter before activations.",
        {"method": Method.FULL, "weights": DType.FP32, "compute": DType.BF16, "master_weights": False},
    ),
    PrecisionPreset(
        "full-bf16-master", "Full - BF16 + fp32 master",
        "bf16 weights and gradients, fp32 master copy and fp32 AdamW states in the optimizer "
        "(DeepSpeed / Megatron mixed precision): 2 + 2 + 4 + 8 = 16 bytes per parameter.",
        {"method": Method.FULL, "weights": DType.BF16, "compute": DType.BF16, "master_weights": True},
    ),
    PrecisionPreset(
        "full-pure-bf16", "Full - pure BF16",
        "bf16 weights, gradients and AdamW states (torch keeps states in the parameter dtype): "
        "8 bytes per parameter before activations.",
        {"method": Method.FULL, "weights": DType.BF16, "compute": DType.BF16, "master_weights": False},
    ),
    PrecisionPreset(
        "full-fp32", "Full - FP32",
        "Everything in fp32: 16 bytes per parameter and fp32 activations.",
        {"method": Method.FULL, "weights": DType.FP32, "compute": DType.FP32, "master_weights": False},
    ),
    PrecisionPreset(
        "lora-bf16", "LoRA - BF16",
        "Frozen bf16 base; LoRA adapters, their gradients and AdamW states in fp32 (peft's default).",
        {"method": Method.LORA, "weights": DType.BF16, "compute": DType.BF16, "adapter_dtype": DType.FP32},
    ),
    PrecisionPreset(
        "qlora-nf4", "QLoRA - NF4",
        "Frozen base in 4-bit NF4 with double-quantized block scales, dequantized to bf16 per matmul; "
        "fp32 LoRA adapters.",
        {"method": Method.QLORA, "weights": DType.NF4, "compute": DType.BF16, "double_quant": True,
         "adapter_dtype": DType.FP32},
    ),
    PrecisionPreset(
        "qlora-nf4-hf", "QLoRA - NF4 (HF Trainer recipe)",
        "As peft's QLoRA recipe runs: prepare_model_for_kbit_training upcasts embeddings, norms and lm_head "
        "to fp32 and Trainer(bf16=True) adds autocast; more activation memory than a pure bf16 QLoRA.",
        {"method": Method.QLORA, "weights": DType.NF4, "compute": DType.BF16, "double_quant": True,
         "adapter_dtype": DType.FP32, "kbit_upcast": True, "amp": True},
    ),
    PrecisionPreset(
        "lora-int8", "LoRA - INT8 base",
        "Frozen base in 8-bit (LLM.int8 storage with per-row scales), fp32 LoRA adapters.",
        {"method": Method.QLORA, "weights": DType.INT8, "compute": DType.BF16, "adapter_dtype": DType.FP32},
    ),
)


def precision_preset(preset_id: str) -> PrecisionPreset:
    for p in PRECISION_PRESETS:
        if preset_id in (p.id, p.label):
            return p
    raise SetupError(f"unknown preset {preset_id!r}; known: {', '.join(p.id for p in PRECISION_PRESETS)}")


def matching_preset(setup: TrainingSetup) -> PrecisionPreset | None:
    """The most specific preset whose fields all equal the setup's (None when the user edited them)."""
    default = TrainingSetup()
    best: PrecisionPreset | None = None
    for p in PRECISION_PRESETS:
        if not all(getattr(setup, k) == v for k, v in p.fields.items()):
            continue
        # fields another preset sets must be at their defaults unless this preset sets them too
        others = {k for q in PRECISION_PRESETS for k in q.fields} - set(p.fields)
        if any(getattr(setup, k) != getattr(default, k) for k in others if k not in ("weights",)):
            continue
        if best is None or len(p.fields) > len(best.fields):
            best = p
    return best

