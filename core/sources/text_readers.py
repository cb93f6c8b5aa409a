"""The hand-written text families' readers: a config dict's keys, typed and checked, as ModelSpec fields.

:class:`Reader` gives typed access to one config dict (errors name the file and the key); one reader a family
(:data:`READERS`, keyed by the model types of :data:`vramlab.core.families.registry.TEXT_DEFAULTS`, whose class
defaults fill a nested config's missing keys) turns it into ModelSpec keyword arguments, or raises
:class:`Inexpressible` where the hand-written program cannot count that config exactly. :func:`generic` reads an
unmapped type the Llama way. The routing (which reader, the trace, the refusals) is :mod:`.hf_config`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import (
    GEMMA,
    GEMMA2,
    GEMMA3_TEXT,
    GPT2,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    PHI,
    PHI3,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    STABLELM,
    STARCODER2,
)
from vramlab.core.sources.files import is_count
from vramlab.core.spec.model import Activation, MlpKind, NormKind

_MISSING: Any = object()

# Keys that do not change the parameter count: not listed when a nested config leaves them to the defaults.
_UNCOUNTED_KEYS = frozenset({"max_position_embeddings", "final_logit_softcapping", "attn_logit_softcapping",
                             "num_experts_per_tok", "hidden_act", "decoder_sparse_step"})

# The size keys every llama-style config must carry.
LLAMA_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


class Inexpressible(SetupError):
    """A config that its family's hand-written program cannot count exactly (the message says what): where the
    installed transformers ships the type, it is traced from transformers' own class instead."""


class _Read(dict):
    """A config dict that notes every key a family's reader looks at (:func:`unread_shape_keys`)."""

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


class Reader:
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
        if not isinstance(value, list) or not all(is_count(v) for v in value):
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


def common(r: Reader) -> dict[str, Any]:
    """The ModelSpec fields every llama-style config spells the same way."""
    r.require(*LLAMA_KEYS)
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


def _llama(r: Reader) -> dict[str, Any]:
    bias = r.get_bool("attention_bias", False)
    return {**common(r), "activation": r.activation("hidden_act"), "qkv_bias": bias, "o_bias": bias,
            "mlp_bias": r.get_bool("mlp_bias", False)}


def _window(r: Reader) -> int:
    """``sliding_window``: null means none; absent means the class default (MistralConfig's is 4096)."""
    if "sliding_window" in r.data and r.data["sliding_window"] is None:
        return 0
    return r.get_opt_int("sliding_window") or 0


def _mistral(r: Reader) -> dict[str, Any]:
    return {**common(r), "activation": r.activation("hidden_act"), "sliding_window": _window(r)}


def _mixtral(r: Reader) -> dict[str, Any]:
    return {**_mistral(r), "num_experts": r.get_int("num_local_experts"),
            "experts_per_token": r.get_int("num_experts_per_tok")}


def _qwen2(r: Reader) -> dict[str, Any]:
    # Qwen2 hard-codes bias on q/k/v (not on o_proj).
    _full_attention_only(r)
    return {**common(r), "activation": r.activation("hidden_act"), "qkv_bias": True}


def _full_attention_only(r: Reader) -> None:
    """Qwen's configs carry a ``sliding_window`` that their layers use only with ``use_sliding_window`` (then in
    the layers from ``max_window_layers`` on): read, the program has every layer attend to the whole sequence."""
    if r.data.get("use_sliding_window"):
        raise Inexpressible(f"{r.source}: {r.key('use_sliding_window')} is true: the layers from "
                             f"{r.key('max_window_layers')} on attend within a window, which the hand-written "
                             "program (every layer full attention) does not express")
    types = r.data.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types if isinstance(types, list)):
        raise Inexpressible(f"{r.source}: {r.key('layer_types')} names layers other than full attention, which "
                             "the hand-written program does not express")
    for key in ("sliding_window", "max_window_layers"):
        r.data.get(key)  # not used while use_sliding_window is false


def _moe_layers(r: Reader, num_layers: int, num_experts: int) -> bool:
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
    raise Inexpressible(
        f"{r.source}: {len(dense)} of {num_layers} layers use a dense MLP instead of the experts "
        f"(layers {shown}; from {r.key('decoder_sparse_step')}={step} and {r.key('mlp_only_layers')}): "
        "ModelSpec gives every layer the same MLP, so mixed dense/MoE stacks are not supported"
    )


def _qwen2_moe(r: Reader) -> dict[str, Any]:
    _full_attention_only(r)
    kw = {**common(r), "activation": r.activation("hidden_act"), "qkv_bias": r.get_bool("qkv_bias")}
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


def _qwen3(r: Reader) -> dict[str, Any]:
    _full_attention_only(r)
    bias = r.get_bool("attention_bias", False)
    return {**common(r), "activation": r.activation("hidden_act"), "qkv_bias": bias, "o_bias": bias,
            "qk_norm": True}


def _qwen3_moe(r: Reader) -> dict[str, Any]:
    kw = _qwen3(r)
    experts = r.get_int("num_experts")
    if not _moe_layers(r, kw["num_layers"], experts):
        return kw
    return {**kw, "num_experts": experts, "experts_per_token": r.get_int("num_experts_per_tok"),
            "moe_intermediate_size": r.get_int("moe_intermediate_size")}


def _gemma(r: Reader) -> dict[str, Any]:
    # transformers' Gemma MLP uses hidden_activation, defaulting to the tanh GELU whatever hidden_act says.
    r.data.get("hidden_act")
    bias = r.get_bool("attention_bias", False)
    return {**common(r), "activation": r.activation("hidden_activation", "gelu_pytorch_tanh"),
            "qkv_bias": bias, "o_bias": bias, "scale_embeddings": True}


def _gemma2(r: Reader) -> dict[str, Any]:
    if r.family == GEMMA2:
        _layer_pattern(r, 2)
    return {**_gemma(r), "norms_per_layer": 4,
            "final_logit_softcap": r.get_float("final_logit_softcapping"),
            "attn_logit_softcap": r.get_float("attn_logit_softcapping")}


def _gemma3_text(r: Reader) -> dict[str, Any]:
    _layer_pattern(r, 6)
    kw = {**_gemma2(r), "qk_norm": True}
    if not r.nested:  # the text model's sliding window (Gemma 3's VLM program builds both masks itself)
        kw["sliding_window"] = _window(r)
    return kw


def _layer_pattern(r: Reader, every: int) -> None:
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
        raise Inexpressible(f"{r.source}: {r.key('layer_types')} is not the program's pattern (a full-attention "
                             f"layer every {every}), which the hand-written program does not express")


def _phi3(r: Reader) -> dict[str, Any]:
    # Fused qkv_proj / gate_up_proj hold exactly the elements of separate q/k/v and gate/up projections.
    kw = common(r)
    return {**kw, "activation": r.activation("hidden_act"), "fused_qkv": True, "fused_gate_up": True,
            "rope_pass_cat": True, "sliding_window": _window(r), "rotary_dim": _rotary_dim(r, kw, 1.0)}


def _rotary_dim(r: Reader, kw: dict[str, Any], default: float) -> int:
    """The rotated part of each head (0: all of it), from ``partial_rotary_factor``: the config's, else the one
    transformers 5 writes into ``rope_parameters`` (Phi's, Phi-3's and StableLM's configs do), else ``default``,
    the config class's."""
    head_dim = kw["head_dim"] or kw["hidden_size"] // max(kw["num_heads"], 1)
    rope = r.data.get("rope_parameters") if isinstance(r.data.get("rope_parameters"), dict) else {}
    factor = r.get_float("partial_rotary_factor", rope.get("partial_rotary_factor", default))
    if not 0 < factor <= 1:
        raise r.fail("partial_rotary_factor", f"must be a number in (0, 1], got {factor!r}")
    return int(head_dim * factor) if factor < 1 else 0


def _phi(r: Reader) -> dict[str, Any]:
    kw = common(r)
    if r.get_bool("qk_layernorm", False):
        raise Inexpressible(
            f"{r.source}: {r.key('qk_layernorm')} is true: phi's q/k LayerNorms carry a bias, which "
            "ModelSpec's qk_norm (weight only) cannot count exactly, so this config is not supported"
        )
    # PhiAttention rotates the first partial_rotary_factor of each head as StableLmAttention does (rope_pass_cat,
    # rope_parts_kept)
    return {**kw, "rope_pass_cat": True, "rope_parts_kept": True, "rotary_dim": _rotary_dim(r, kw, 0.5),
            "activation": r.activation("hidden_act", "gelu_new"), "qkv_bias": True, "o_bias": True,
            "mlp_bias": True, "lm_head_bias": True, "mlp_kind": MlpKind.PLAIN,
            "norm_kind": NormKind.LAYERNORM, "norms_per_layer": 1, "parallel_block": True}


def _stablelm(r: Reader) -> dict[str, Any]:
    kw = common(r)
    head_dim = kw["head_dim"] or kw["hidden_size"] // max(kw["num_heads"], 1)
    if r.get_bool("qk_layernorm", False):
        raise _full_qk_norm_error(r, "StableLM's per-head q/k LayerNorms (qk_layernorm)", kw, head_dim)
    # StableLmAttention rotates the first partial_rotary_factor of each head and concatenates the rest back (as
    # Phi-3 does: rope_pass_cat); StableLmConfig sets the factor to 0.25 where the config leaves it out
    parallel = r.get_bool("use_parallel_residual", False)
    return {**kw, "activation": r.activation("hidden_act"), "qkv_bias": r.get_bool("use_qkv_bias", False),
            "rope_pass_cat": True, "rope_parts_kept": True, "rotary_dim": _rotary_dim(r, kw, 0.25),
            "norm_kind": NormKind.LAYERNORM, "norms_per_layer": 1 if parallel else 2,
            "parallel_block": parallel, "keeps_attn_output": not parallel, "keeps_input_norm": not parallel}


def _starcoder2(r: Reader) -> dict[str, Any]:
    bias = r.get_bool("use_bias", True)
    return {**common(r), "activation": r.activation("hidden_act", "gelu_pytorch_tanh"), "qkv_bias": bias,
            "o_bias": bias, "mlp_bias": bias, "mlp_kind": MlpKind.PLAIN, "norm_kind": NormKind.LAYERNORM,
            "sliding_window": _window(r)}


def _full_qk_norm_error(r: Reader, what: str, kw: Mapping[str, Any], head_dim: int) -> SetupError:
    q_dim, kv_dim = kw["num_heads"] * head_dim, kw["num_kv_heads"] * head_dim
    short = kw["num_layers"] * (q_dim + kv_dim - 2 * head_dim)
    return Inexpressible(
        f"{r.source}: {what} have {q_dim} + {kv_dim} norm weights per layer, but ModelSpec's qk_norm "
        f"counts one head_dim ({head_dim}) each, so the import would be {short:,} parameters short: "
        f"model_type {r.family!r} cannot be expressed exactly and is not supported yet"
    )


def _gpt2(r: Reader) -> dict[str, Any]:
    r.require("n_embd", "n_layer", "n_head", "vocab_size")
    if r.get_bool("add_cross_attention", False):
        raise Inexpressible(f"{r.source}: {r.key('add_cross_attention')} is true: cross-attention layers are "
                             "not supported")
    hidden, heads = r.get_int("n_embd"), r.get_int("n_head")
    inner = r.get_opt_int("n_inner") or 4 * hidden
    return {"num_layers": r.get_int("n_layer"), "hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": heads, "intermediate_size": inner, "vocab_size": r.get_int("vocab_size"),
            "max_position_embeddings": r.get_int("n_positions"), "learned_positions": True, "keeps_attn_output": True,
            "fused_qkv": True,
            "tie_embeddings": r.get_bool("tie_word_embeddings"),
            "activation": r.activation("activation_function", "gelu_new"),
            "qkv_bias": True, "o_bias": True, "mlp_bias": True, "mlp_kind": MlpKind.PLAIN,
            "norm_kind": NormKind.LAYERNORM, "embed_dropout": r.get_float("embd_pdrop", 0.1),
            "resid_dropout": r.get_float("resid_pdrop", 0.1), "attention_dropout": r.get_float("attn_pdrop", 0.1)}


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
             "kv_lora_rank", "q_lora_rank")


def generic(r: Reader) -> dict[str, Any]:
    what = (f"model_type {r.family!r} is not one VRAM Lab maps" if r.family
            else "the config names no model_type")
    present = [k for k in LLAMA_KEYS if r.data.get(k) is not None]
    if len(present) < len(LLAMA_KEYS):
        missing = ", ".join(r.key(k) for k in LLAMA_KEYS if k not in present)
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


# Keys that never change a tensor's shape (token ids, epsilons, initialisation, RoPE's frequencies, routing loss
# weights, outputs asked for, the saving library's bookkeeping): a family's reader may leave them unread. Any other
# key it leaves unread, set to something (not null, false or zero), may change the model's shapes, so the
# config is not what the hand-written program counts (:func:`unread_shape_keys`).
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


def unread_shape_keys(r: Reader) -> list[str]:
    """The keys of ``r``'s config that its family's reader did not look at, that may change shapes (not in
    :data:`_NO_SHAPE_KEYS`) and are set: the hand-written program does not express them."""
    return [k for k, v in dict.items(r.data) if k not in r.data.read and k not in _NO_SHAPE_KEYS and not _is_off(v)]


READERS: dict[str, Callable[[Reader], dict[str, Any]]] = {
    LLAMA: _llama, MISTRAL: _mistral, MIXTRAL: _mixtral, QWEN2: _qwen2, QWEN2_MOE: _qwen2_moe, QWEN3: _qwen3,
    QWEN3_MOE: _qwen3_moe, GEMMA: _gemma, GEMMA2: _gemma2, GEMMA3_TEXT: _gemma3_text, PHI3: _phi3, PHI: _phi,
    STABLELM: _stablelm, STARCODER2: _starcoder2, GPT2: _gpt2,
}
"""The reader of each hand-written text family (the registry's TEXT_DEFAULTS names the same types)."""
