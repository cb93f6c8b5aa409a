"""The one place that names a transformers ``model_type``: which family answers it, and with which pieces.

A family is a folder under ``core/families/`` (``core/families/gemma3/``) holding what is particular to it:
``config`` (reading its ``config.json``), ``vision`` (its processor and tower rules, pure Python), ``program``
(its estimator program, no torch) and ``reference`` (transformers' own class built under fake tensors, torch).
The rest of the core never compares a ``model_type`` with a string: it asks :func:`vramlab.core.families.family`
for the family of a type, or :func:`vramlab.core.families.piece` for one of its modules, and uses the
constants below where it must name one. ``tests/test_families.py`` holds this: no module outside this one
names a model type.

The readers' tables of model types are data here too (:mod:`vramlab.core.sources.hf_config` routes by them): the
hand-written text families with transformers' class defaults (:data:`TEXT_DEFAULTS`, one reader each in
:mod:`vramlab.core.sources.text_readers`), the types read as one of them (:data:`TEXT_ALIASES`,
:data:`WRAPPED_TEXT_TYPE`, :data:`ARCH_PREFIX`), and the types refused from config.json alone with their reasons
(:data:`REFUSED`; traced instead where the installed transformers ships them, but for :data:`STATE_SPACE` and the
:data:`NOT_DECODERS` outside :data:`TRACED_NOT_DECODERS`).

Adding a family: its folder, one :class:`Family` line in :data:`FAMILIES`, and its tests (ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PIECES = ("config", "vision", "program", "reference")


@dataclass(frozen=True)
class Family:
    """A family folder and the ``model_type`` values it answers.

    ``pieces`` names the modules its folder has (of :data:`PIECES`); a piece it lacks is answered by the shared
    code (the decoder, the generic processor path, the trace)."""

    name: str
    model_types: tuple[str, ...]
    pieces: tuple[str, ...] = ()
    vision: bool = False


# model types other modules must name (always through these constants)
QWEN2_5_VL = "qwen2_5_vl"
LLAVA = "llava"
GEMMA3 = "gemma3"
MLLAMA = "mllama"
PALIGEMMA = "paligemma"

# folders under core/families/ that are not a family: the code several families share (their program's and
# reference's base classes, the ViT layer's parameter counts)
SHARED_FOLDERS = ("vlm_base",)

FAMILIES: tuple[Family, ...] = (
    Family("qwen2_5_vl", (QWEN2_5_VL,), ("config", "vision", "program", "reference"), vision=True),
    Family("llava", (LLAVA,), ("config", "vision", "program", "reference"), vision=True),
    Family("mllama", (MLLAMA,), ("config", "vision", "program", "reference"), vision=True),
    Family("gemma3", (GEMMA3,), ("config", "vision", "program", "reference"), vision=True),
    Family("paligemma", (PALIGEMMA,), ("config", "vision", "program", "reference"), vision=True),
)

# ---- model types named by the readers (core/sources) ----------------------------------------------------

# the hand-written text families: each has a reader (core/sources/text_readers.py, keyed by these constants)
LLAMA = "llama"
MISTRAL = "mistral"
MIXTRAL = "mixtral"
QWEN2 = "qwen2"
QWEN2_MOE = "qwen2_moe"
QWEN3 = "qwen3"
QWEN3_MOE = "qwen3_moe"
GEMMA = "gemma"
GEMMA2 = "gemma2"
GEMMA3_TEXT = "gemma3_text"
PHI3 = "phi3"
PHI = "phi"
STABLELM = "stablelm"
STARCODER2 = "starcoder2"
GPT2 = "gpt2"

# traced vision-language types a reader names singly (their processor's rules; core/sources/traced_vlm.py)
QWEN3_VL = "qwen3_vl"
IDEFICS3 = "idefics3"
SMOLVLM = "smolvlm"
INTERNVL = "internvl"
LLAVA_NEXT = "llava_next"

# Processor kinds (``ProcessorSpec.kind``): whose processor rules make a family's images (core/vision.py). Four are
# spelled like the model type whose processor they follow; saved specs carry them, so they keep that spelling.
KIND_QWEN_VL = "qwen_vl"
KIND_SIGLIP_FIXED = "siglip_fixed"
KIND_LLAVA_NEXT = LLAVA_NEXT
KIND_IDEFICS3 = IDEFICS3
KIND_INTERNVL = INTERNVL
KIND_MLLAMA = MLLAMA
KIND_PROCESSOR = "processor"  # any other family: its own processor class run (core/tracing/vlm_processor.py)
PROCESSOR_KINDS = (KIND_QWEN_VL, KIND_SIGLIP_FIXED, KIND_LLAVA_NEXT, KIND_IDEFICS3, KIND_INTERNVL, KIND_MLLAMA,
                   KIND_PROCESSOR)

# Vision-language models without a family folder whose whole step is traced from transformers' own class
# (core/tracing/vlm_traced.py), by model type, with the processor kind that makes their images
TRACED_TOWERS = {IDEFICS3: KIND_IDEFICS3, SMOLVLM: KIND_IDEFICS3, INTERNVL: KIND_INTERNVL, "qwen2_vl": KIND_QWEN_VL,
                 QWEN3_VL: KIND_QWEN_VL, LLAVA_NEXT: KIND_LLAVA_NEXT}

# vision towers a family's config reading expects in its vision_config
CLIP_VISION = "clip_vision_model"
SIGLIP_VISION = "siglip_vision_model"

# transformers' class defaults (configuration_<type>.py). Top-level configs carry every size key; nested text
# configs are saved as a diff against these, so a key left out there means "this default".
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

TEXT_DEFAULTS: dict[str, Mapping[str, Any]] = {
    LLAMA: _LLAMA_DEFAULTS,
    MISTRAL: _MISTRAL_DEFAULTS,
    MIXTRAL: {**_MISTRAL_DEFAULTS, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    QWEN2: _QWEN2_DEFAULTS,
    QWEN2_MOE: {
        **_QWEN2_DEFAULTS, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "qkv_bias": True,
    },
    QWEN3: {**_QWEN2_DEFAULTS, "head_dim": 128},
    QWEN3_MOE: {
        **_QWEN2_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    },
    GEMMA: _GEMMA_DEFAULTS,
    GEMMA2: _GEMMA2_DEFAULTS,
    GEMMA3_TEXT: {
        **_GEMMA2_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 4096,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    },
    PHI3: {
        **_LLAMA_DEFAULTS, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "max_position_embeddings": 4096,
    },
    PHI: {
        **_LLAMA_DEFAULTS, "vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 24, "hidden_act": "gelu_new",
    },
    STABLELM: {
        **_LLAMA_DEFAULTS, "vocab_size": 50304, "hidden_size": 2560, "intermediate_size": 6912,
        "num_key_value_heads": 32, "max_position_embeddings": 4096,
    },
    STARCODER2: {
        "vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
        "num_attention_heads": 24, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    GPT2: {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "tie_word_embeddings": True,
    },
}
"""The hand-written text families, each with transformers' class defaults for its config."""

TEXT_ALIASES: dict[str, str] = {
    # Qwen2-VL / Qwen2.5-VL language models are Qwen2 decoders; Qwen2.5-VL's tower and merger come from its
    # vision_config (core/families/qwen2_5_vl/config.py), Qwen2-VL's are not counted (a warning says so).
    "qwen2_vl": QWEN2, QWEN2_5_VL: QWEN2, "qwen2_vl_text": QWEN2, "qwen2_5_vl_text": QWEN2,
    # Llama 3.2 Vision's text model is a Llama decoder whose cross-attention layers (and tower) come from
    # core/families/mllama's reading of the whole config
    "mllama_text_model": LLAMA,
}
"""Types whose language model one of :data:`TEXT_DEFAULTS`' readers reads."""

TEXT_MODEL_TYPES: tuple[str, ...] = tuple(sorted((*TEXT_DEFAULTS, *TEXT_ALIASES)))

WRAPPED_TEXT_TYPE: dict[str, str] = {
    GEMMA3: GEMMA3_TEXT, LLAVA: LLAMA, LLAVA_NEXT: LLAMA, "mistral3": MISTRAL, PALIGEMMA: GEMMA,
    IDEFICS3: LLAMA, MLLAMA: "mllama_text_model",
}
"""Wrappers whose text_config may omit its own model_type: the type it then has."""

ARCH_PREFIX: dict[str, str] = {
    "Llama": LLAMA, "MistralFor": MISTRAL, "Mixtral": MIXTRAL, "Qwen2Moe": QWEN2_MOE,
    "Qwen2For": QWEN2, "Qwen3Moe": QWEN3_MOE, "Qwen3For": QWEN3, "Gemma3ForCausal": GEMMA3_TEXT,
    "Gemma2": GEMMA2, "GemmaFor": GEMMA, "Phi3For": PHI3, "PhiFor": PHI, "StableLm": STABLELM,
    "Starcoder2": STARCODER2, "Olmo2": "olmo2", "GPT2": GPT2, "DeepseekV3": "deepseek_v3",
    "DeepseekV2": "deepseek_v2",
}
"""Leading class names of ``architectures``: the model type of a config without one."""

NOT_DECODERS = ("t5", "mt5", "umt5", "bart", "mbart", "bert", "roberta", "deberta", "whisper", "encoder-decoder",
                "vision-encoder-decoder")
# encoder-decoders and encoders traced with their own loss (seq2seq LM with decoder labels, masked LM)
TRACED_NOT_DECODERS = ("t5", "mt5", "umt5", "bert", "roberta")
# State-space and recurrent models, and hybrids of them with attention, refused from config.json alone, never
# traced (building one in transformers took 6-20 s to end in a refusal; a small Jamba's trace ran past two
# minutes). The Mamba-2 ones whose CUDA run VRAM Lab models (mamba-ssm's fused mamba_split_conv1d_scan_combined,
# causal-conv1d's conv) are traced like Granite 4 (granitemoehybrid) and LFM2, in seconds: Mamba-2, Bamba,
# Nemotron-H and Falcon-H1 (tests/test_traced_ssm.py holds each to simulate --hf).
STATE_SPACE = ("mamba", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2", "xlstm", "plamo2")
_MAMBA1 = (" is a state-space model whose Mamba-1 mixer runs mamba-ssm's selective_scan_fn / mamba_inner_fn on "
           "CUDA, which VRAM Lab does not model (their torch path would be a wrong answer)")
_STATE_SPACE_WHY = {
    **{t: f"{t} is a state-space / recurrent model, not a transformer ModelSpec can describe" for t in STATE_SPACE},
    **{t: f"{t}{_MAMBA1}" for t in ("mamba", "falcon_mamba", "jamba", "zamba")},
    "zamba2": ("zamba2 is a state-space hybrid whose layer stack mixes two classes (Zamba2MambaDecoderLayer, "
               "Zamba2HybridLayer) and whose hybrid layers share one transformer block (tied every num_mem_blocks): "
               "the trace finds no stack of repeated layers, so neither its LoRA targets nor a fit over its depth "
               "can be read"),
}
# the types whose Mamba-2 mixers call mamba-ssm's fused mamba_split_conv1d_scan_combined in training on CUDA
# (core/spec/hub_kernels.py names what that means for the estimate)
MAMBA2_FAMILIES = frozenset({"mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2"})
# traced types without attention layers: their num_heads are the Mamba-2 mixer's heads, and no attention kernel runs
ATTENTION_FREE = ("mamba2",)
# types whose layer layout differs from the Llama-style default (traced where transformers ships them)
NOT_MAPPED = ("gpt_neox", "falcon", "bloom", "opt", "mpt", "gptj", "gpt_bigcode", "phimoe", "phi3small", "dbrx",
              "cohere", "cohere2", "granitemoe", "nemotron")

_MLA = ("uses multi-head latent attention (MLA: low-rank compressed q and kv projections), which ModelSpec "
        "cannot describe; MLA models are not supported")
_NOT_MAPPED = ("is not mapped yet: its layer layout (norms, biases, MLP or fused projections) differs from "
               "the Llama-style default, so a generic reading would miscount")
_FULL_QK = "normalises the whole q and k projections, which ModelSpec's per-head qk_norm cannot count"
_LLAMA4 = "Llama 4 interleaves dense and MoE layers with a shared expert; not supported"

REFUSED: dict[str, str] = {
    "deepseek_v2": f"DeepSeek-V2 {_MLA}",
    "deepseek_v3": f"DeepSeek-V3 {_MLA}",
    "deepseek_vl_v2": f"DeepSeek-VL2's language model {_MLA}",
    "deepseek": "DeepSeek-MoE (dense first layers, shared and fine-grained experts) is not supported",
    "olmo": "OLMo-1 uses LayerNorms without learnable weights, which ModelSpec cannot count",
    "olmo2": f"OLMo-2 {_FULL_QK}",
    "olmo3": f"OLMo-3 {_FULL_QK}",
    "olmoe": f"OLMoE {_FULL_QK}",
    "llama4": _LLAMA4,
    "llama4_text": _LLAMA4,
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp) is not supported",
    **_STATE_SPACE_WHY,
    **{t: f"{t} is not a decoder-only language model" for t in NOT_DECODERS},
    **{t: f"model_type {t!r} {_NOT_MAPPED}" for t in NOT_MAPPED},
}
"""Types no hand-written reader reads, with the reason: refused from config.json alone, or traced instead where
the installed transformers ships them (all but the non-decoders outside :data:`TRACED_NOT_DECODERS` and the
state-space ones)."""

VISION_FAMILY_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES if f.vision for t in f.model_types)
"""Vision-language types with a family folder (a hand-written program of their tower): never traced whole."""


def named_model_types() -> frozenset[str]:
    """Every model type this module names (``tests/test_families.py`` holds the rest of the core to none)."""
    return frozenset({
        *(t for f in FAMILIES for t in f.model_types), QWEN3_VL, IDEFICS3, INTERNVL, LLAVA_NEXT, CLIP_VISION,
        SIGLIP_VISION, *TEXT_DEFAULTS, *TEXT_ALIASES, *TEXT_ALIASES.values(), *WRAPPED_TEXT_TYPE,
        *WRAPPED_TEXT_TYPE.values(), *ARCH_PREFIX.values(), *REFUSED, *TRACED_NOT_DECODERS, *TRACED_TOWERS,
    })
