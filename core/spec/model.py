"""The architecture: :class:`ModelSpec` (the numbers of a HF ``config.json``) and the exact shape of every
parameter tensor it implies (:class:`LinearShape`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vramlab.core import vision as _vision
from vramlab.core.checks import SetupError, check_flag, check_float, check_int, known_fields
from vramlab.core.families.registry import ATTENTION_FREE, MIXTRAL, QWEN2_MOE, QWEN3_MOE
from vramlab.core.spec.options import Attention, DType
from vramlab.core.spec.targets import names_all_linear

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
TAPE_SOURCES = ("auto", "hand-written", "traced")  # where the estimate's tape comes from (ModelSpec.tape)


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
    # What the decoder layer's forward keeps in a Python local until it returns, through the MLP (not rebound
    # as Llama's ``hidden_states`` is): the attention block's output (GPT-2's ``attn_output``, StableLM's
    # ``self_attn_output``) and the first norm's output (StableLM's sequential block's ``hidden_states``)
    keeps_attn_output: bool = False
    keeps_input_norm: bool = False
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
    # StableLM's rope_pass_cat: q's and k's rotated parts both made before either is concatenated, and kept with the
    # pass-through views (so the projections' outputs) until the attention returns (Phi-3 frees each at its cat)
    rope_parts_kept: bool = False
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
                     "parallel_block", "learned_positions", "scale_embeddings", "keeps_attn_output",
                     "keeps_input_norm", "rope_parts_kept"):
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
        if self.rope_parts_kept and not self.rope_pass_cat:
            raise SetupError(f"{where}: rope_parts_kept is a way of rope_pass_cat (StableLM's RoPE)")
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
    def moe_family(self) -> str:
        """The transformers MoE family a hand-written MoE spec is (its features say which; each routes its own
        way): Qwen1.5/2-MoE's gated shared expert, Qwen3-MoE's q / k norms, else Mixtral. "" for a dense one."""
        if not self.is_moe:
            return ""
        return QWEN2_MOE if self.shared_expert_intermediate_size else QWEN3_MOE if self.qk_norm else MIXTRAL

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
    def fused_expert_params(self) -> int:
        """The routed experts' parameters, every layer's: transformers 5's fused ``gate_up_proj`` / ``down_proj``
        3-D tensors (0 for a dense model)."""
        if not self.is_moe:
            return 0
        up = (2 if self.mlp_kind is MlpKind.GATED else 1) * self.expert_intermediate
        return self.num_layers * self.num_experts * self.hidden_size * (up + self.expert_intermediate)

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

    @property
    def has_attention(self) -> bool:
        """Whether the model has attention layers (a pure Mamba-2 has none: its heads are the mixer's)."""
        return self.family not in ATTENTION_FREE

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
        no module for are left out (:meth:`TrainingSetup.validate_for` refuses them).

        ``all-linear`` is what peft's rule picks on the model built: every ``nn.Linear`` and ``Conv1D`` but the
        output head (peft 0.21.2 ``_maybe_include_all_linear_layers``), which for a dense decoder are its layers'
        linear layers whatever they are (GPT-2's four Conv1D, phi's and StarCoder2's plain MLP without a gate);
        a mixture of experts' routed experts are no ``nn.Linear`` in transformers 5 (peft adapts them as
        parameters, which the trace answers: :func:`vramlab.core.traced.adapts_experts`)."""
        if names_all_linear(targets) and not self.is_moe:
            return (*(s.name for s in self.layer_linears()), *(("lm_head",) if "lm_head" in targets else ()))
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
        return cls(**known_fields(cls, data, "model"))


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec) if (f.compare if f.hash is None else f.hash))
