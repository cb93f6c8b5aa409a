"""A Hugging Face ``config.json`` (a dict, read by :mod:`.files`) as a :class:`~vramlab.core.spec.ModelSpec`.

* :func:`spec_from_hf_config` / :func:`hf_config_to_spec` — map a config dict to a ModelSpec (the latter also
  returns the warnings, e.g. "the vision tower is not counted"). Families are mapped key by key; a config
  this module cannot read exactly is refused with the reason, never read as another family's default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources.files import _is_count
from vramlab.core.sources.remote_code import (
    RemoteCodeError,
    remote_code_reason,
    transformers_lm_types,
    transformers_model_types,
)
from vramlab.core.sources.traced_vlm import NotTraceable, traceable_vlm, why_not_traced
from vramlab.core.spec import Activation, DType, MlpKind, ModelSpec, NormKind

# ---- config.json -> ModelSpec ------------------------------------------------------------------------

_MISSING: Any = object()

# Keys that do not change the parameter count: not listed when a nested config leaves them to the defaults.
_UNCOUNTED_KEYS = frozenset({"max_position_embeddings", "final_logit_softcapping", "attn_logit_softcapping",
                             "num_experts_per_tok", "hidden_act", "decoder_sparse_step"})

# The size keys every llama-style config must carry.
_LLAMA_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


class _Inexpressible(SetupError):
    """A config that its family's hand-written program cannot count exactly (the message says what): where the
    installed transformers ships the type, it is traced from transformers' own class instead."""


class _Read(dict):
    """A config dict that notes every key a family's reader looks at (:func:`_unread_shape_keys`)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


class _Reader:
    """Typed access to one config dict. Errors name the file and the key (with its ``text_config.``
    prefix when nested). ``defaults`` are transformers' class defaults for the model type; a nested
    config (``text_config``) is saved as a diff against them, so its missing size keys come from there."""

    def __init__(self, data: Mapping[str, Any], *, source: str, prefix: str, family: str,
                 defaults: Mapping[str, Any], nested: bool) -> None:
        self.data = _Read(data)
        self.source = source
        self.prefix = prefix
        self.family = family
        self.defaults = defaults
        self.nested = nested
        self.defaulted: list[str] = []  # size keys a nested config left to the class defaults
        self.warnings: list[str] = []

    def key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, problem: str) -> SetupError:
        return SetupError(f"{self.source}: {self.key(key)} {problem}")

    def require(self, *keys: str) -> None:
        """All of ``keys`` must be present (or, in a nested config, have a class default)."""
        absent = [k for k in keys if self.data.get(k) is None]
        missing = [k for k in absent if not (self.nested and self.defaults.get(k) is not None)]
        if missing:
            names = ", ".join(self.key(k) for k in missing)
            raise SetupError(f"{self.source}: missing {names} (needed to describe a "
                             f"{self.family or 'Llama-style'} model)")

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key)
        if value is not None:
            return value
        if default is not _MISSING:
            return default
        if key not in self.defaults:
            raise self.fail(key, "is missing")
        if self.nested and key not in _UNCOUNTED_KEYS and key not in self.defaulted:
            self.defaulted.append(key)
        return self.defaults[key]

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be a whole number, got {value!r}")
        return value

    def get_opt_int(self, key: str) -> int | None:
        """An optional whole number: absent or null gives the class default (which may be None)."""
        if self.data.get(key) is None and self.defaults.get(key) is None:
            return None
        return self.get_int(key)

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        value = self.raw(key, default)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        return float(value)

    def get_int_list(self, key: str) -> list[int]:
        value = self.raw(key, [])
        if not isinstance(value, list) or not all(_is_count(v) for v in value):
            raise self.fail(key, f"must be a list of layer indices, got {value!r}")
        return value

    def kv_heads(self, heads: int) -> int:
        """num_key_value_heads: null means "as many as attention heads"; absent means the class default."""
        key = "num_key_value_heads"
        if key in self.data and self.data[key] is None:
            return heads
        if self.data.get(key) is None and self.defaults.get(key) is None:
            return heads
        return self.get_int(key)

    def activation(self, key: str, fallback: str = "silu") -> Activation:
        value = self.raw(key, fallback)
        if not isinstance(value, str):
            raise self.fail(key, f"must be an activation name, got {value!r}")
        try:
            return Activation.parse(value)
        except SetupError:
            self.warnings.append(
                f"{self.key(key)} {value!r} is not an activation VRAM Lab models; estimating with "
                f"{fallback} (activation memory may differ slightly, the parameter count does not)"
            )
            return Activation.parse(fallback)


def _common(r: _Reader) -> dict[str, Any]:
    """The ModelSpec fields every llama-style config spells the same way."""
    r.require(*_LLAMA_KEYS)
    heads = r.get_int("num_attention_heads")
    return {
        "num_layers": r.get_int("num_hidden_layers"),
        "hidden_size": r.get_int("hidden_size"),
        "num_heads": heads,
        "num_kv_heads": r.kv_heads(heads),
        "intermediate_size": r.get_int("intermediate_size"),
        "vocab_size": r.get_int("vocab_size"),
        "head_dim": r.get_opt_int("head_dim") or 0,
        "tie_embeddings": r.get_bool("tie_word_embeddings"),
        "max_position_embeddings": r.get_int("max_position_embeddings"),
    }


def _llama(r: _Reader) -> dict[str, Any]:
    bias = r.get_bool("attention_bias", False)
    return {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": bias, "o_bias": bias,
            "mlp_bias": r.get_bool("mlp_bias", False)}


def _window(r: _Reader) -> int:
    """``sliding_window``: null means none; absent means the class default (MistralConfig's is 4096)."""
    if "sliding_window" in r.data and r.data["sliding_window"] is None:
        return 0
    return r.get_opt_int("sliding_window") or 0


def _mistral(r: _Reader) -> dict[str, Any]:
    return {**_common(r), "activation": r.activation("hidden_act"), "sliding_window": _window(r)}


def _mixtral(r: _Reader) -> dict[str, Any]:
    return {**_mistral(r), "num_experts": r.get_int("num_local_experts"),
            "experts_per_token": r.get_int("num_experts_per_tok")}


def _qwen2(r: _Reader) -> dict[str, Any]:
    # Qwen2 hard-codes bias on q/k/v (not on o_proj).
    _full_attention_only(r)
    return {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": True}


def _full_attention_only(r: _Reader) -> None:
    """Qwen's configs carry a ``sliding_window`` that their layers use only with ``use_sliding_window`` (then in
    the layers from ``max_window_layers`` on): read, the program has every layer attend to the whole sequence."""
    if r.data.get("use_sliding_window"):
        raise _Inexpressible(f"{r.source}: {r.key('use_sliding_window')} is true: the layers from "
                             f"{r.key('max_window_layers')} on attend within a window, which the hand-written "
                             "program (every layer full attention) does not express")
    types = r.data.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types if isinstance(types, list)):
        raise _Inexpressible(f"{r.source}: {r.key('layer_types')} names layers other than full attention, which "
                             "the hand-written program does not express")
    for key in ("sliding_window", "max_window_layers"):
        r.data.get(key)  # not used while use_sliding_window is false


def _moe_layers(r: _Reader, num_layers: int, num_experts: int) -> bool:
    """True when every layer is a sparse MoE block, False when none is; refuses a mixed stack
    (transformers: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    if num_experts <= 0:
        return False
    step = r.get_int("decoder_sparse_step", 1)
    if step < 1:
        raise r.fail("decoder_sparse_step", f"must be at least 1, got {step}")
    dense_only = set(r.get_int_list("mlp_only_layers"))
    moe = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
    if len(moe) == num_layers:
        return True
    if not moe:
        r.warnings.append(f"no layer uses the {num_experts} experts (decoder_sparse_step / mlp_only_layers); "
                          "read as a dense model")
        return False
    dense = [i for i in range(num_layers) if i not in moe]
    shown = ", ".join(map(str, dense[:8])) + (", ..." if len(dense) > 8 else "")
    raise _Inexpressible(
        f"{r.source}: {len(dense)} of {num_layers} layers use a dense MLP instead of the experts "
        f"(layers {shown}; from {r.key('decoder_sparse_step')}={step} and {r.key('mlp_only_layers')}): "
        "ModelSpec gives every layer the same MLP, so mixed dense/MoE stacks are not supported"
    )


def _qwen2_moe(r: _Reader) -> dict[str, Any]:
    _full_attention_only(r)
    kw = {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": r.get_bool("qkv_bias")}
    experts = r.get_int("num_experts")
    if not _moe_layers(r, kw["num_layers"], experts):
        return kw
    shared = r.get_int("shared_expert_intermediate_size")
    if shared <= 0:
        r.warnings.append("shared_expert_intermediate_size is 0: transformers still builds the 1 x hidden "
                          "shared_expert_gate, which is not counted")
    return {**kw, "num_experts": experts, "experts_per_token": r.get_int("num_experts_per_tok"),
            "moe_intermediate_size": r.get_int("moe_intermediate_size"),
            "shared_expert_intermediate_size": max(shared, 0)}


def _qwen3(r: _Reader) -> dict[str, Any]:
    _full_attention_only(r)
    bias = r.get_bool("attention_bias", False)
    return {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": bias, "o_bias": bias,
            "qk_norm": True}


def _qwen3_moe(r: _Reader) -> dict[str, Any]:
    kw = _qwen3(r)
    experts = r.get_int("num_experts")
    if not _moe_layers(r, kw["num_layers"], experts):
        return kw
    return {**kw, "num_experts": experts, "experts_per_token": r.get_int("num_experts_per_tok"),
            "moe_intermediate_size": r.get_int("moe_intermediate_size")}


def _gemma(r: _Reader) -> dict[str, Any]:
    # transformers' Gemma MLP uses hidden_activation, defaulting to the tanh GELU whatever hidden_act says.
    r.data.get("hidden_act")
    bias = r.get_bool("attention_bias", False)
    return {**_common(r), "activation": r.activation("hidden_activation", "gelu_pytorch_tanh"),
            "qkv_bias": bias, "o_bias": bias, "scale_embeddings": True}


def _gemma2(r: _Reader) -> dict[str, Any]:
    if r.family == "gemma2":
        _layer_pattern(r, 2)
    return {**_gemma(r), "norms_per_layer": 4,
            "final_logit_softcap": r.get_float("final_logit_softcapping"),
            "attn_logit_softcap": r.get_float("attn_logit_softcapping")}


def _gemma3_text(r: _Reader) -> dict[str, Any]:
    _layer_pattern(r, 6)
    kw = {**_gemma2(r), "qk_norm": True}
    if not r.nested:  # the text model's sliding window (Gemma 3's VLM program builds both masks itself)
        kw["sliding_window"] = _window(r)
    return kw


def _layer_pattern(r: _Reader, every: int) -> None:
    """Gemma 2 and 3 interleave sliding-window and full-attention layers, a full one every ``every`` (the
    program's pattern; each layer materialises its mask whatever the window's width): another ``layer_types``
    is not expressed."""
    r.data.get("sliding_window")
    types = r.data.get("layer_types")
    if types is None:
        return
    layers = r.get_int("num_hidden_layers")
    want = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if types != want:
        raise _Inexpressible(f"{r.source}: {r.key('layer_types')} is not the program's pattern (a full-attention "
                             f"layer every {every}), which the hand-written program does not express")


def _phi3(r: _Reader) -> dict[str, Any]:
    # Fused qkv_proj / gate_up_proj hold exactly the elements of separate q/k/v and gate/up projections.
    kw = _common(r)
    head_dim = kw["head_dim"] or kw["hidden_size"] // max(kw["num_heads"], 1)
    rope = r.data.get("rope_parameters") if isinstance(r.data.get("rope_parameters"), dict) else {}
    factor = r.data.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise r.fail("partial_rotary_factor", f"must be a number in (0, 1], got {factor!r}")
    return {**kw, "activation": r.activation("hidden_act"), "fused_qkv": True, "fused_gate_up": True,
            "rope_pass_cat": True, "sliding_window": _window(r),
            "rotary_dim": int(head_dim * factor) if factor < 1 else 0}


def _phi(r: _Reader) -> dict[str, Any]:
    kw = _common(r)
    if r.get_bool("qk_layernorm", False):
        raise _Inexpressible(
            f"{r.source}: {r.key('qk_layernorm')} is true: phi's q/k LayerNorms carry a bias, which "
            "ModelSpec's qk_norm (weight only) cannot count exactly, so this config is not supported"
        )
    factor = r.get_float("partial_rotary_factor", 0.5)
    if factor != 1.0:
        raise _Inexpressible(f"{r.source}: {r.key('partial_rotary_factor')} is {factor:g}: phi rotates part of "
                             "each head and concatenates the rest back, which the hand-written phi program does "
                             "not express")
    return {**kw, "activation": r.activation("hidden_act", "gelu_new"), "qkv_bias": True, "o_bias": True,
            "mlp_bias": True, "lm_head_bias": True, "mlp_kind": MlpKind.PLAIN,
            "norm_kind": NormKind.LAYERNORM, "norms_per_layer": 1, "parallel_block": True}


def _stablelm(r: _Reader) -> dict[str, Any]:
    kw = _common(r)
    if r.get_bool("qk_layernorm", False):
        head_dim = kw["head_dim"] or kw["hidden_size"] // max(kw["num_heads"], 1)
        raise _full_qk_norm_error(r, "StableLM's per-head q/k LayerNorms (qk_layernorm)", kw, head_dim)
    parallel = r.get_bool("use_parallel_residual", False)
    return {**kw, "activation": r.activation("hidden_act"), "qkv_bias": r.get_bool("use_qkv_bias", False),
            "norm_kind": NormKind.LAYERNORM, "norms_per_layer": 1 if parallel else 2,
            "parallel_block": parallel}


def _starcoder2(r: _Reader) -> dict[str, Any]:
    bias = r.get_bool("use_bias", True)
    return {**_common(r), "activation": r.activation("hidden_act", "gelu_pytorch_tanh"), "qkv_bias": bias,
            "o_bias": bias, "mlp_bias": bias, "mlp_kind": MlpKind.PLAIN, "norm_kind": NormKind.LAYERNORM,
            "sliding_window": _window(r)}


def _full_qk_norm_error(r: _Reader, what: str, kw: Mapping[str, Any], head_dim: int) -> SetupError:
    q_dim, kv_dim = kw["num_heads"] * head_dim, kw["num_kv_heads"] * head_dim
    short = kw["num_layers"] * (q_dim + kv_dim - 2 * head_dim)
    return _Inexpressible(
        f"{r.source}: {what} have {q_dim} + {kv_dim} norm weights per layer, but ModelSpec's qk_norm "
        f"counts one head_dim ({head_dim}) each, so the import would be {short:,} parameters short: "
        f"model_type {r.family!r} cannot be expressed exactly and is not supported yet"
    )


def _gpt2(r: _Reader) -> dict[str, Any]:
    r.require("n_embd", "n_layer", "n_head", "vocab_size")
    if r.get_bool("add_cross_attention", False):
        raise _Inexpressible(f"{r.source}: {r.key('add_cross_attention')} is true: cross-attention layers are "
                             "not supported")
    hidden, heads = r.get_int("n_embd"), r.get_int("n_head")
    inner = r.get_opt_int("n_inner") or 4 * hidden
    return {"num_layers": r.get_int("n_layer"), "hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": heads, "intermediate_size": inner, "vocab_size": r.get_int("vocab_size"),
            "max_position_embeddings": r.get_int("n_positions"), "learned_positions": True,
            "tie_embeddings": r.get_bool("tie_word_embeddings"),
            "activation": r.activation("activation_function", "gelu_new"),
            "qkv_bias": True, "o_bias": True, "mlp_bias": True, "mlp_kind": MlpKind.PLAIN,
            "norm_kind": NormKind.LAYERNORM, "embed_dropout": r.get_float("embd_pdrop", 0.1),
            "resid_dropout": r.get_float("resid_pdrop", 0.1), "attention_dropout": r.get_float("attn_pdrop", 0.1)}


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
             "kv_lora_rank", "q_lora_rank")


def _generic(r: _Reader) -> dict[str, Any]:
    what = (f"model_type {r.family!r} is not one VRAM Lab maps" if r.family
            else "the config names no model_type")
    present = [k for k in _LLAMA_KEYS if r.data.get(k) is not None]
    if len(present) < len(_LLAMA_KEYS):
        missing = ", ".join(r.key(k) for k in _LLAMA_KEYS if k not in present)
        raise SetupError(
            f"{r.source}: {what}, and it lacks the Llama-style keys needed to read it generically: "
            f"missing {missing}"
        )
    odd = [k for k in _MOE_KEYS if r.data.get(k)]
    if odd:
        raise SetupError(
            f"{r.source}: {what}, and its {', '.join(r.key(k) for k in odd)} (mixture-of-experts / latent "
            "attention) cannot be placed by a generic Llama-style reading"
        )
    if r.data.get("tie_word_embeddings") is None:
        r.warnings.append("tie_word_embeddings is not set: assumed untied (a separate lm_head)")
    r.warnings.append(
        f"{what}: read as a Llama-style decoder (RMSNorm, gated MLP, no biases); check the parameter "
        "count against the checkpoint"
    )
    return _llama(r)


# transformers' class defaults (configuration_<type>.py). Top-level configs carry every size key; nested
# text configs are saved as a diff against these, so a key left out there means "this default".
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "tie_word_embeddings": False,
}
_MISTRAL_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
}
_QWEN2_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
}
_GEMMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
_GEMMA2_DEFAULTS: dict[str, Any] = {
    **_GEMMA_DEFAULTS, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}


# Keys that never change a tensor's shape (token ids, epsilons, initialisation, RoPE's frequencies, routing loss
# weights, outputs asked for, the saving library's bookkeeping): a family's reader may leave them unread. Any other
# key it leaves unread, set to something (not null, false or zero), may change the model's shapes, so the
# config is not what the hand-written program counts (:func:`_unread_shape_keys`).
_NO_SHAPE_KEYS = frozenset({
    "_name_or_path", "architectures", "auto_map", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
    "label2id", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "_commit_hash", "cache_implementation", "_attn_implementation_autoset", "use_bfloat16",
    "tokenizer_class",
    "task_specific_params", "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "image_token_id", "image_token_index", "boi_token_index",
    "eoi_token_index", "initializer_range", "initializer_factor", "rms_norm_eps", "layer_norm_eps",
    "layer_norm_epsilon", "norm_epsilon", "rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq",
    "original_max_position_embeddings", "pretraining_tp", "use_cache", "router_aux_loss_coef",
    "router_jitter_noise", "output_router_logits", "norm_topk_prob", "query_pre_attn_scalar",
    "_sliding_window_pattern", "sliding_window_pattern", "scale_attn_weights", "n_ctx", "summary_activation",
    "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj", "attn_implementation",
    "max_length", "num_beams", "early_stopping", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "min_length", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "keys_to_ignore_at_inference",
})


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {})


def _unread_shape_keys(r: _Reader) -> list[str]:
    """The keys of ``r``'s config that its family's reader did not look at, that may change shapes (not in
    :data:`_NO_SHAPE_KEYS`) and are set: the hand-written program does not express them."""
    return [k for k, v in dict.items(r.data) if k not in r.data.read and k not in _NO_SHAPE_KEYS and not _is_off(v)]


@dataclass(frozen=True)
class _Family:
    build: Callable[[_Reader], dict[str, Any]]
    defaults: Mapping[str, Any]


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(_llama, _LLAMA_DEFAULTS),
    "mistral": _Family(_mistral, _MISTRAL_DEFAULTS),
    "mixtral": _Family(_mixtral, {**_MISTRAL_DEFAULTS, "num_local_experts": 8, "num_experts_per_tok": 2,
                                  "sliding_window": None}),
    "qwen2": _Family(_qwen2, _QWEN2_DEFAULTS),
    "qwen2_moe": _Family(_qwen2_moe, {
        **_QWEN2_DEFAULTS, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "qkv_bias": True,
    }),
    "qwen3": _Family(_qwen3, {**_QWEN2_DEFAULTS, "head_dim": 128}),
    "qwen3_moe": _Family(_qwen3_moe, {
        **_QWEN2_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    }),
    "gemma": _Family(_gemma, _GEMMA_DEFAULTS),
    "gemma2": _Family(_gemma2, _GEMMA2_DEFAULTS),
    "gemma3_text": _Family(_gemma3_text, {
        **_GEMMA2_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 4096,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }),
    "phi3": _Family(_phi3, {
        **_LLAMA_DEFAULTS, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "max_position_embeddings": 4096,
    }),
    "phi": _Family(_phi, {
        **_LLAMA_DEFAULTS, "vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 24, "hidden_act": "gelu_new",
    }),
    "stablelm": _Family(_stablelm, {
        **_LLAMA_DEFAULTS, "vocab_size": 50304, "hidden_size": 2560, "intermediate_size": 6912,
        "num_key_value_heads": 32, "max_position_embeddings": 4096,
    }),
    "starcoder2": _Family(_starcoder2, {
        "vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
        "num_attention_heads": 24, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    }),
    "gpt2": _Family(_gpt2, {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "tie_word_embeddings": True,
    }),
}
_ALIASES = {
    # Qwen2-VL / Qwen2.5-VL language models are Qwen2 decoders; Qwen2.5-VL's tower and merger come from its
    # vision_config (_qwen25_vl_vision), Qwen2-VL's are not counted (a warning says so).
    "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2",
    # Llama 3.2 Vision's text model is a Llama decoder whose cross-attention layers (and tower) come from
    # core/families/mllama/vision.py's reading of the whole config
    "mllama_text_model": "llama",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted((*_FAMILIES, *_ALIASES)))

# Wrappers whose text_config may omit its own model_type.
_WRAPPED_TEXT_TYPE = {
    "gemma3": "gemma3_text", "llava": "llama", "llava_next": "llama", "mistral3": "mistral",
    "paligemma": "gemma", "idefics3": "llama", "mllama": "mllama_text_model",
}

_MLA = ("uses multi-head latent attention (MLA: low-rank compressed q and kv projections), which ModelSpec "
        "cannot describe; MLA models are not supported")
_NOT_MAPPED = ("is not mapped yet: its layer layout (norms, biases, MLP or fused projections) differs from "
               "the Llama-style default, so a generic reading would miscount")
_FULL_QK = "normalises the whole q and k projections, which ModelSpec's per-head qk_norm cannot count"
_NOT_DECODERS = ("t5", "mt5", "umt5", "bart", "mbart", "bert", "roberta", "deberta", "whisper", "encoder-decoder",
                 "vision-encoder-decoder")
# State-space and recurrent models, and hybrids of them with attention: refused from config.json alone, never
# traced (building one in transformers took 6-20 s to end in a refusal; a small Jamba's trace runs past two
# minutes). Granite 4 (granitemoehybrid) and LFM2 are not here: their traces answer in seconds.
_STATE_SPACE = ("mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2", "falcon_h1",
                "nemotron_h", "bamba", "xlstm", "plamo2")
# Keys a state-space layer's config has and an attention layer's does not
_STATE_SPACE_KEYS = ("state_size", "ssm_state_size", "mamba_d_state", "mamba_d_conv", "d_state", "rescale_every")
# Keys that give an attention layer's head count, under the names transformers' configs use
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
              "decoder_attention_heads", "num_attention_heads_per_layer")
# Refused from config.json alone; those the installed transformers ships (all but _NOT_DECODERS) are traced
# instead (see _traceable)
_REFUSED: dict[str, str] = {
    "deepseek_v2": f"DeepSeek-V2 {_MLA}",
    "deepseek_v3": f"DeepSeek-V3 {_MLA}",
    "deepseek_vl_v2": f"DeepSeek-VL2's language model {_MLA}",
    "deepseek": "DeepSeek-MoE (dense first layers, shared and fine-grained experts) is not supported",
    "olmo": "OLMo-1 uses LayerNorms without learnable weights, which ModelSpec cannot count",
    "olmo2": f"OLMo-2 {_FULL_QK}",
    "olmo3": f"OLMo-3 {_FULL_QK}",
    "olmoe": f"OLMoE {_FULL_QK}",
    "llama4": "Llama 4 interleaves dense and MoE layers with a shared expert; not supported",
    "llama4_text": "Llama 4 interleaves dense and MoE layers with a shared expert; not supported",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp) is not supported",
    **{t: f"{t} is a state-space / recurrent model, not a transformer ModelSpec can describe"
       for t in _STATE_SPACE},
    **{t: f"{t} is not a decoder-only language model" for t in _NOT_DECODERS},
    **{t: f"model_type {t!r} {_NOT_MAPPED}"
       for t in ("gpt_neox", "falcon", "bloom", "opt", "mpt", "gptj", "gpt_bigcode", "phimoe", "phi3small",
                 "dbrx", "cohere", "cohere2", "granitemoe", "nemotron")},
}

# Leading class names of `architectures` for configs without model_type.
_ARCH_PREFIX = {
    "Llama": "llama", "MistralFor": "mistral", "Mixtral": "mixtral", "Qwen2Moe": "qwen2_moe",
    "Qwen2For": "qwen2", "Qwen3Moe": "qwen3_moe", "Qwen3For": "qwen3", "Gemma3ForCausal": "gemma3_text",
    "Gemma2": "gemma2", "GemmaFor": "gemma", "Phi3For": "phi3", "PhiFor": "phi", "StableLm": "stablelm",
    "Starcoder2": "starcoder2", "Olmo2": "olmo2", "GPT2": "gpt2", "DeepseekV3": "deepseek_v3",
    "DeepseekV2": "deepseek_v2",
}
_LM_HEAD_ARCH = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")

_TORCH_DTYPES = {
    "float32": DType.FP32, "float": DType.FP32, "fp32": DType.FP32,
    "bfloat16": DType.BF16, "bf16": DType.BF16,
    "float16": DType.FP16, "half": DType.FP16, "fp16": DType.FP16,
}


def _model_type(cfg: Mapping[str, Any], source: str, prefix: str) -> str:
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise SetupError(f"{source}: {prefix}model_type must be a string, got {mt!r}")
    if mt:
        return mt.strip().lower()
    archs = cfg.get("architectures")
    if isinstance(archs, list):
        for arch in archs:
            for head, family in _ARCH_PREFIX.items():
                if isinstance(arch, str) and arch.startswith(head):
                    return family
    return ""


def _config_dtype(cfgs: Iterable[Mapping[str, Any]], warnings: list[str]) -> DType | None:
    """checkpoint dtype from ``dtype`` / ``torch_dtype`` (first config that names one)."""
    for cfg in cfgs:
        for key in ("dtype", "torch_dtype"):
            value = cfg.get(key)
            if value is None:
                continue
            text = str(value).lower().removeprefix("torch.")
            if text in _TORCH_DTYPES:
                return _TORCH_DTYPES[text]
            warnings.append(f"{key} {value!r} is not fp32, bf16 or fp16; checkpoint dtype taken as bf16")
            return DType.BF16
    return None


_NO_DTYPE = "config.json names no torch_dtype: checkpoint dtype taken as bf16"


def hf_config_to_spec(cfg: Mapping[str, Any], *, id: str, name: str, source: str = "config.json",
                      probe: bool = False) -> tuple[ModelSpec, tuple[str, ...]]:
    """Map a Hugging Face config dict to a ModelSpec, with warnings for the user.

    Multimodal wrappers (``text_config``, or a ``vision_config``) give the language model only, with a
    warning that the vision tower is not counted. ``source`` names the file in error messages. Raises
    :class:`SetupError` (naming ``source`` and the key) for missing or wrong-typed keys and for
    architectures ModelSpec cannot express exactly where transformers cannot be traced instead. ``probe``:
    raise :class:`_WouldTrace` instead of tracing (:func:`imports_transformers`).
    """
    warnings: list[str] = []
    top_type = _model_type(cfg, source, "")
    if top_type in _REFUSED:
        if _traceable(top_type):
            return _traced(cfg, top_type, id=id, name=name, source=source, probe=probe)
        raise SetupError(f"{source}: {_REFUSED[top_type]}")
    inner: Mapping[str, Any] = cfg
    prefix = ""
    text_config = cfg.get("text_config")
    if text_config is not None:
        if not isinstance(text_config, dict):
            raise SetupError(f"{source}: text_config must be an object, got {text_config!r}")
        inner, prefix = text_config, "text_config."
    model_type = _model_type(inner, source, prefix)
    if not model_type and prefix:
        model_type = _WRAPPED_TEXT_TYPE.get(top_type, "")
    if model_type in _REFUSED:
        if _traceable(model_type) and not prefix:
            return _traced(cfg, model_type, id=id, name=name, source=source, probe=probe)
        raise SetupError(f"{source}: {_REFUSED[model_type]}")
    multimodal = bool(prefix) or any(k in cfg for k in ("vision_config", "audio_config"))
    untraced = ""
    if traceable_vlm(top_type):  # the whole VLM traced from transformers' class (sources.traced_vlm)
        if probe:
            raise _WouldTrace(None)  # its own cache (sources.traced_vlm): not asked here, as before
        try:
            return _traced_vlm(cfg, id=id, name=name, source=source)
        except NotTraceable as e:  # a family answered by its processor, whose processor or class cannot here
            untraced = f" ({e}), and --images is refused"
    elif multimodal:
        untraced = why_not_traced(top_type)
    vision = _qwen25_vl_vision(cfg, inner, source, warnings) if top_type == "qwen2_5_vl" else None
    if top_type == "llava":
        vision = _llava_vision(cfg, source, warnings)
    if top_type == "mllama":
        from vramlab.core.families.mllama.config import vision_from_config

        vision = vision_from_config(cfg, source, warnings)
    if top_type == "gemma3":
        from vramlab.core.families.gemma3.config import gemma3_vision

        vision = gemma3_vision(cfg, source, warnings)
    if vision is not None:
        multimodal = False  # the tower and projector are counted and estimated (core/vision.py)
    if multimodal:
        what = top_type or "multimodal"
        warnings.append(
            f"{what} is a multimodal model: only its language model ({model_type or 'text_config'}) is "
            f"imported; the vision tower and projector are not counted{untraced}"
        )
    family_key = _ALIASES.get(model_type, model_type)
    family = _FAMILIES.get(family_key)
    if family is None:  # generic: the size keys must be there; the rest as Llama has them
        reason = remote_code_reason(inner, model_type) or (remote_code_reason(cfg, top_type) if prefix else None)
        if reason:
            raise RemoteCodeError(f"{source}: {reason}; a model folder with its *.safetensors is counted "
                                  "exactly from their headers")
        if _traceable(model_type):
            # transformers' own class, traced, rather than a Llama-style guess at it (Granite's embedding,
            # residual and logit multipliers are full-size temporaries a Llama reading lacks; Gemma 4's 512-wide
            # global heads); a multimodal config's language model alone, as the warning above says. The generic
            # reading below stays for the estimator-only build
            return _traced(inner, model_type, id=id, name=name, source=source, probe=probe,
                           dtype_from=(inner, cfg), before=warnings)
        defaults = {k: v for k, v in _LLAMA_DEFAULTS.items() if k not in _LLAMA_KEYS}
        reader = _Reader(inner, source=source, prefix=prefix, family=model_type,
                         defaults=defaults, nested=False)
        kwargs = _generic(reader)
    else:
        reader = _Reader(inner, source=source, prefix=prefix, family=model_type, defaults=family.defaults,
                         nested=bool(prefix))
        try:
            kwargs = family.build(reader)
            unread = _unread_shape_keys(reader)
        except _Inexpressible as e:
            if not (_traceable(model_type) and vision is None):
                raise
            return _traced(inner, model_type, id=id, name=name, source=source, probe=probe, dtype_from=(inner, cfg),
                           before=warnings, reason=str(e).removeprefix(f"{source}: "))
        if unread:
            shown = ", ".join(f"{prefix}{k}" for k in unread)
            why = (f"{shown} may change the model's shapes and the hand-written {family_key} program does not read "
                   f"{'it' if len(unread) == 1 else 'them'}")
            if _traceable(model_type) and vision is None:
                return _traced(inner, model_type, id=id, name=name, source=source, probe=probe,
                               dtype_from=(inner, cfg), before=warnings, reason=why)
            warnings.append(f"{why}: the count and the estimate may be off (with torch, transformers and peft "
                            "installed it is traced from transformers' own class)")
    if reader.defaulted:
        shown = ", ".join(f"{k}={reader.defaults[k]}" for k in reader.defaulted)
        warnings.append(f"{prefix.rstrip('.') or 'config.json'} leaves {len(reader.defaulted)} size key(s) "
                        f"to transformers' {family_key} defaults: {shown}")
    warnings.extend(reader.warnings)
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs) \
            and not any(a.endswith(_LM_HEAD_ARCH) for a in archs):
        warnings.append(f"architectures is {', '.join(archs)}: VRAM Lab counts a language-model head "
                        "(lm_head), which this checkpoint may not have")
    dtype = _config_dtype((inner, cfg) if prefix else (cfg,), warnings)
    if dtype is None:
        warnings.append(_NO_DTYPE)
    if vision is not None and vision.model_type in ("llava", "gemma3") and "hidden_size" in kwargs:
        vision = dataclasses.replace(vision, out_hidden_size=kwargs["hidden_size"])  # the projector's output
    try:
        spec = ModelSpec(id=id, name=name, family=family_key or "generic",
                         checkpoint_dtype=dtype or DType.BF16, source=source, vision=vision, **kwargs)
    except SetupError as e:
        raise SetupError(f"{source}: {e}") from e
    return spec, tuple(warnings)


# encoder-decoders and encoders traced with their own loss (seq2seq LM with decoder labels, masked LM)
_TRACED_NOT_DECODERS = ("t5", "mt5", "umt5", "bert", "roberta")


def _traced_vlm(cfg: Mapping[str, Any], *, id: str, name: str, source: str) -> tuple[ModelSpec, tuple[str, ...]]:
    from vramlab.core.sources.traced_vlm import traced_vlm_spec

    warnings: list[str] = []
    text = cfg.get("text_config")
    dtype = _config_dtype((text, cfg) if isinstance(text, dict) else (cfg,), warnings)
    if dtype is None:
        warnings.append(_NO_DTYPE)
    spec, more = traced_vlm_spec(cfg, id=id, name=name, source=source, dtype=dtype)
    return spec, (*more, *warnings)


def _traceable(model_type: str) -> bool:
    """Whether a type without a hand-written program is estimated from its trace instead: a decoder the
    installed transformers ships (parsed from its sources as data; the estimator-only build has none), or
    one of the encoder-decoders and encoders traced with their own loss."""
    if (model_type in _NOT_DECODERS and model_type not in _TRACED_NOT_DECODERS) or model_type in _STATE_SPACE:
        return False
    known = transformers_model_types()
    return known is not None and model_type in known[1]


class _WouldTrace(Exception):  # noqa: N818 - a signal, not an error
    def __init__(self, cfg: Mapping[str, Any] | None) -> None:
        super().__init__()
        self.cfg = cfg


def imports_transformers(cfg: Mapping[str, Any]) -> bool:
    """Whether reading ``cfg`` builds its model in transformers (a traced type, or a config its hand-written
    program cannot express, whose parameters this installation has not counted before): seconds, the first
    time, which a window runs off its GUI thread."""
    from vramlab.core.sources.traced_config import counted_before

    try:
        hf_config_to_spec(cfg, id="probe", name="probe", probe=True)
    except _WouldTrace as e:
        return e.cfg is not None and not counted_before(e.cfg)
    except (SetupError, TypeError, ValueError):
        return False
    return False


def _check_attention_layers(cfg: Mapping[str, Any], model_type: str, source: str) -> None:
    """Refuse, from the file alone and before transformers is imported, a config that has no attention heads
    or has a state-space layer's keys: the trace would build the model for seconds and end in the same refusal."""
    ssm = [k for k in _STATE_SPACE_KEYS if k in cfg]
    if ssm and not any(isinstance(cfg.get(k), int | list) for k in _HEAD_KEYS):
        raise SetupError(f"{source}: model_type {model_type!r} has state-space layers ({ssm[0]}): not a transformer "
                         "VRAM Lab can model")
    lm_types = transformers_lm_types()
    if lm_types is not None and model_type not in lm_types:
        raise SetupError(f"{source}: model_type {model_type!r} is not a language model that transformers builds "
                         "(a causal, seq2seq or masked LM), so it cannot be traced")
    if not any(isinstance(cfg.get(k), int | list) for k in _HEAD_KEYS):
        raise SetupError(f"{source}: model_type {model_type!r} names no attention head count "
                         f"({', '.join(_HEAD_KEYS[:3])}, ...): not a transformer VRAM Lab can model")


def _traced(cfg: Mapping[str, Any], model_type: str, *, id: str, name: str, source: str, probe: bool = False,
            dtype_from: tuple[Mapping[str, Any], ...] = (), before: Iterable[str] = (), reason: str = ""
            ) -> tuple[ModelSpec, tuple[str, ...]]:
    """``cfg`` traced (:mod:`.traced_config`); ``dtype_from``: the configs that may name the checkpoint dtype
    (``cfg``'s own by default); ``before``: warnings said first; ``reason``: why a type with a hand-written
    program is traced."""
    if probe:
        raise _WouldTrace(cfg)
    from vramlab.core.sources.traced_config import traced_spec

    _check_attention_layers(cfg, model_type, source)
    warnings: list[str] = []
    dtype = _config_dtype(tuple(c for c in dtype_from if isinstance(c, Mapping)) or (cfg,), warnings)
    if dtype is None:
        warnings.append(_NO_DTYPE)
    spec, more = traced_spec(cfg, model_type, id=id, name=name, source=source, dtype=dtype, reason=reason)
    return spec, (*before, *more, *warnings)


# Qwen2.5-VL's vision_config: keys that size the tower must be there; the rest have the released models' values
_QWEN25_VL_VISION_REQUIRED = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
_QWEN25_VL_VISION_DEFAULTS: dict[str, Any] = {
    "patch_size": 14, "temporal_patch_size": 2, "in_channels": 3, "spatial_merge_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
}


def _qwen25_vl_vision(cfg: Mapping[str, Any], text: Mapping[str, Any], source: str, warnings: list[str]) -> Any:
    """Qwen2.5-VL's vision tower and merger from ``vision_config`` (None without one). The processor's pixel
    limits live in preprocessor_config.json, which is not read: the released models' are used, and said so."""
    from vramlab.core.vision import ProcessorSpec, VisionSpec

    vc = cfg.get("vision_config")
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise SetupError(f"{source}: vision_config must be an object, got {vc!r}")
    missing = [k for k in _QWEN25_VL_VISION_REQUIRED if not _is_count(vc.get(k))]
    if missing:
        raise SetupError(f"{source}: vision_config lacks {', '.join('vision_config.' + k for k in missing)}, "
                         "which size Qwen2.5-VL's vision tower")
    values: dict[str, Any] = {k: vc[k] for k in _QWEN25_VL_VISION_REQUIRED}
    for key, default in _QWEN25_VL_VISION_DEFAULTS.items():
        value = vc.get(key, vc.get("in_chans") if key == "in_channels" else None)
        values[key] = default if value is None else value
    if str(values["hidden_act"]).lower() != "silu":
        raise SetupError(f"{source}: vision_config.hidden_act {values['hidden_act']!r}: Qwen2.5-VL's tower is "
                         "modelled with SiLU")
    rope = text.get("rope_scaling") or text.get("rope_parameters") or cfg.get("rope_scaling") or {}
    section = rope.get("mrope_section", [16, 24, 24]) if isinstance(rope, dict) else [16, 24, 24]
    ids = {k: cfg.get(k, text.get(k)) for k in ("image_token_id", "video_token_id", "vision_start_token_id")}
    processor = ProcessorSpec("qwen_vl", patch_size=values["patch_size"], merge_size=values["spatial_merge_size"],
                              temporal_patch_size=values["temporal_patch_size"], min_pixels=3136,
                              max_pixels=12845056)
    warnings.append("the image processor's min_pixels / max_pixels (preprocessor_config.json) are not read: "
                    "Qwen2.5-VL's released 3136 / 12845056 are used; --max-pixels sets yours")
    try:
        return VisionSpec("qwen2_5_vl", mrope_section=tuple(section), processor=processor,
                          **{k: v for k, v in ids.items() if _is_count(v)}, **values)
    except (SetupError, TypeError) as e:
        raise SetupError(f"{source}: vision_config: {e}") from None


# LLaVA-1.5's vision_config (CLIPVisionConfig): the keys that size the tower must be there
_LLAVA_VISION_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "image_size", "patch_size")


def _llava_vision(cfg: Mapping[str, Any], source: str, warnings: list[str]) -> Any:
    """LLaVA-1.5's CLIP tower and projector from ``vision_config`` and the wrapper's keys. None, with a warning
    naming the key, where the tower is not modelled (another tower, several feature layers, the CLS kept,
    another projector) or a size key is absent: the language model alone is imported, as for any multimodal
    config. A size key of the wrong type is refused."""
    from vramlab.core.vision import ProcessorSpec, VisionSpec

    vc = cfg.get("vision_config")
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise SetupError(f"{source}: vision_config must be an object, got {vc!r}")
    bad = [k for k in _LLAVA_VISION_REQUIRED if k in vc and not _is_count(vc[k])]
    if bad:
        raise SetupError(f"{source}: vision_config.{bad[0]} must be a positive whole number, got {vc[bad[0]]!r}")
    tower = vc.get("model_type", "clip_vision_model")
    checks = (("vision_config.model_type", tower, "clip_vision_model", "a CLIP vision tower"),
              ("vision_feature_select_strategy", cfg.get("vision_feature_select_strategy", "default"), "default",
               "the CLS position dropped"),
              ("projector_hidden_act", cfg.get("projector_hidden_act", "gelu"), "gelu", "a GELU projector"),
              ("multimodal_projector_bias", cfg.get("multimodal_projector_bias", True), True, "projector biases"),
              ("vision_config.hidden_act", vc.get("hidden_act", "quick_gelu"), "quick_gelu", "CLIP's quick GELU"))
    reasons = [f"{key} {value!r} (modelled: {what}, {want!r})" for key, value, want, what in checks
               if value != want]
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        reasons.append(f"vision_feature_layer {layer!r} (modelled: one feature layer)")
    missing = [k for k in _LLAVA_VISION_REQUIRED if k not in vc]
    if missing:
        reasons.append(f"vision_config lacks {', '.join('vision_config.' + k for k in missing)}")
    if reasons:
        warnings.append(f"LLaVA's vision tower is not modelled for this config: {'; '.join(reasons)}")
        return None
    size, patch = vc["image_size"], vc["patch_size"]
    try:
        processor = ProcessorSpec("siglip_fixed", patch_size=patch, tile_size=size,
                                  tokens_per_tile=(size // patch) ** 2, cls_token=True)
        return VisionSpec("llava", depth=vc["num_hidden_layers"], hidden_size=vc["hidden_size"],
                          num_heads=vc["num_attention_heads"], intermediate_size=vc["intermediate_size"],
                          out_hidden_size=1, patch_size=patch, in_channels=vc.get("num_channels", 3),
                          hidden_act="quick_gelu", image_size=size, feature_layer=layer,
                          image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),
                          processor=processor)
    except (SetupError, TypeError) as e:
        raise SetupError(f"{source}: vision_config: {e}") from None


def spec_from_hf_config(cfg: Mapping[str, Any], *, id: str, name: str,
                        source: str = "config.json") -> ModelSpec:
    """Map a Hugging Face ``config.json`` dict to a ModelSpec (see :func:`hf_config_to_spec`, which also
    returns the warnings)."""
    return hf_config_to_spec(cfg, id=id, name=name, source=source)[0]


