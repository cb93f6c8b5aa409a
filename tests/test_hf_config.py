"""Importing a local Hugging Face model (config.json + safetensors headers) into a ModelSpec.

The configs below are the published config.json files of each model (trimmed of keys that do not matter),
and the expected totals are the publishers' exact parameter counts. Safetensors files are written by hand:
an 8-byte little-endian header length, the JSON header, then zero bytes for the data.
"""

from __future__ import annotations

import builtins
import io
import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.sources import hf_config
from vramlab.core.sources.files import TensorInfo, load_config_json, read_safetensors_header, read_safetensors_index
from vramlab.core.sources.folder import ImportedModel, load_model_source
from vramlab.core.sources.hf_config import hf_config_to_spec, spec_from_hf_config
from vramlab.core.spec.model import Activation, MlpKind, ModelSpec, NormKind
from vramlab.core.spec.options import DType

# ---- published configs -------------------------------------------------------------------------------

LLAMA2_7B: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
}
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000,
}
GEMMA2_2B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
    "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
    "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000,
}
PHI3_MINI: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False,
    "auto_map": {"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},  # remote code: never run
    "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 4096,
    "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32064,
}
QWEN3_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936,
}
PHI_15: dict[str, Any] = {
    "_name_or_path": "microsoft/phi-1_5", "architectures": ["PhiForCausalLM"], "hidden_act": "gelu_new",
    "hidden_size": 2048, "intermediate_size": 8192, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
    "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 24, "num_key_value_heads": None,
    "partial_rotary_factor": 0.5, "qk_layernorm": False, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float16", "vocab_size": 51200,
}
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
QWEN15_MOE_A27B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
GEMMA_2B: dict[str, Any] = {
    "architectures": ["GemmaForCausalLM"], "head_dim": 256, "hidden_act": "gelu", "hidden_size": 2048,
    "intermediate_size": 16384, "max_position_embeddings": 8192, "model_type": "gemma",
    "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16", "vocab_size": 256000,
}
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "torch_dtype": "bfloat16", "vocab_size": 262144,
}
# gemma-3-4b-it: the multimodal wrapper; transformers saves text_config as a diff against its defaults.
GEMMA3_4B_IT: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
STARCODER2_3B: dict[str, Any] = {
    "architectures": ["Starcoder2ForCausalLM"], "hidden_act": "gelu_pytorch_tanh", "hidden_size": 3072,
    "intermediate_size": 12288, "max_position_embeddings": 16384, "model_type": "starcoder2",
    "norm_epsilon": 1e-05, "num_attention_heads": 24, "num_hidden_layers": 30, "num_key_value_heads": 2,
    "sliding_window": 4096, "torch_dtype": "bfloat16", "use_bias": True, "vocab_size": 49152,
}
STABLELM2_16B: dict[str, Any] = {
    "architectures": ["StableLmForCausalLM"], "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "layer_norm_eps": 1e-05, "max_position_embeddings": 4096,
    "model_type": "stablelm", "num_attention_heads": 32, "num_hidden_layers": 24, "num_key_value_heads": 32,
    "partial_rotary_factor": 0.25, "qk_layernorm": False, "tie_word_embeddings": False,
    "torch_dtype": "float16", "use_parallel_residual": False, "use_qkv_bias": True, "vocab_size": 100352,
}
GPT2: dict[str, Any] = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "vocab_size": 50257,
}
OLMO2_7B: dict[str, Any] = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "olmo2",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": 100352,
}
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_attention_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536,
    "vocab_size": 129280,
}


def spec_of(cfg: dict[str, Any]) -> ModelSpec:
    return spec_from_hf_config(cfg, id="m", name="M")


# ---- config.json -> ModelSpec: published totals ------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        pytest.param(LLAMA2_7B, 6_738_415_616, id="llama-2-7b"),
        pytest.param(QWEN25_05B, 494_032_768, id="qwen2.5-0.5b"),
        pytest.param(MIXTRAL_8X7B, 46_702_792_704, id="mixtral-8x7b"),
        pytest.param(GEMMA2_2B, 2_614_341_888, id="gemma-2-2b"),
        pytest.param(PHI3_MINI, 3_821_079_552, id="phi-3-mini"),
        pytest.param(QWEN3_06B, 596_049_920, id="qwen3-0.6b"),
        pytest.param(PHI_15, 1_418_270_720, id="phi-1.5"),
        pytest.param(QWEN3_30B_A3B, 30_532_122_624, id="qwen3-30b-a3b"),
        pytest.param(QWEN15_MOE_A27B, 14_315_784_192, id="qwen1.5-moe-a2.7b"),
        pytest.param(GEMMA_2B, 2_506_172_416, id="gemma-2b"),
        pytest.param(GEMMA3_1B, 999_885_952, id="gemma-3-1b"),
        pytest.param(STARCODER2_3B, 3_030_371_328, id="starcoder2-3b"),
        pytest.param(STABLELM2_16B, 1_644_515_328, id="stablelm-2-1.6b"),
        pytest.param(GPT2, 124_439_808, id="gpt2"),
    ],
)
def test_published_parameter_counts(cfg: dict[str, Any], expected: int) -> None:
    assert spec_of(cfg).param_count == expected


def test_llama_fields() -> None:
    s = spec_of(LLAMA2_7B)
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (32, 4096, 32, 32, 128)
    assert (s.intermediate_size, s.vocab_size, s.max_position_embeddings) == (11008, 32000, 4096)
    assert not s.tie_embeddings and not s.qkv_bias and s.mlp_kind is MlpKind.GATED
    assert s.checkpoint_dtype is DType.FP16 and s.family == "llama" and (s.id, s.name) == ("m", "M")


def test_llama_attention_and_mlp_bias() -> None:
    s = spec_of({**LLAMA2_7B, "attention_bias": True, "mlp_bias": True})
    assert s.qkv_bias and s.o_bias and s.mlp_bias
    assert s.param_count == 6_738_415_616 + 32 * (4 * 4096 + 2 * 11008 + 4096)


def test_qwen2_tied_with_qkv_bias() -> None:
    s = spec_of(QWEN25_05B)
    assert s.tie_embeddings and s.qkv_bias and not s.o_bias
    assert (s.num_kv_heads, s.head_dim, s.checkpoint_dtype) == (2, 64, DType.BF16)


def test_mixtral_experts() -> None:
    s = spec_of(MIXTRAL_8X7B)
    assert (s.num_experts, s.experts_per_token, s.expert_intermediate) == (8, 2, 14336)
    assert not s.qkv_bias and s.num_kv_heads == 8


def test_gemma2_fields() -> None:
    s = spec_of(GEMMA2_2B)
    assert s.norms_per_layer == 4 and s.tie_embeddings and s.scale_embeddings and s.head_dim == 256
    assert (s.final_logit_softcap, s.attn_logit_softcap) == (30.0, 50.0)
    assert s.activation is Activation.GELU_TANH and s.checkpoint_dtype is DType.FP32


def test_gemma_uses_tanh_gelu_and_is_tied_by_default() -> None:
    s = spec_of(GEMMA_2B)  # hidden_act "gelu", no tie_word_embeddings key
    assert s.activation is Activation.GELU_TANH and s.tie_embeddings and s.scale_embeddings


def test_qwen3_qk_norm_and_explicit_head_dim() -> None:
    s = spec_of(QWEN3_06B)
    assert s.qk_norm and s.head_dim == 128 and s.q_dim == 2048 and s.tie_embeddings


def test_qwen3_moe() -> None:
    s = spec_of(QWEN3_30B_A3B)
    assert s.qk_norm and (s.num_experts, s.experts_per_token, s.moe_intermediate_size) == (128, 8, 768)
    assert s.shared_expert_intermediate_size == 0


def test_qwen2_moe_shared_expert() -> None:
    s = spec_of(QWEN15_MOE_A27B)
    assert (s.num_experts, s.experts_per_token, s.moe_intermediate_size) == (60, 4, 1408)
    assert s.shared_expert_intermediate_size == 5632 and s.qkv_bias


@pytest.fixture
def no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator-only build: no transformers to trace a config the hand-written program cannot express."""
    from vramlab.core.sources import hf_config

    monkeypatch.setattr(hf_config, "transformers_model_types", lambda: None)


@pytest.mark.parametrize("change", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [0, 5]}])
def test_qwen_moe_with_dense_layers_is_refused(change: dict[str, Any], no_transformers: None) -> None:
    with pytest.raises(SetupError, match="dense MLP") as e:
        spec_from_hf_config({**QWEN15_MOE_A27B, **change}, id="m", name="M", source="/x/config.json")
    assert "/x/config.json" in str(e.value)


def test_phi3_keeps_its_fused_projections() -> None:
    s = spec_of(PHI3_MINI)
    assert [ln.name for ln in s.attn_linears()] == ["qkv_proj", "o_proj"]
    assert [ln.name for ln in s.mlp_linears()] == ["gate_up_proj", "down_proj"]
    assert s.fused_qkv and s.fused_gate_up and s.rope_pass_cat
    assert not s.tie_embeddings and not s.qkv_bias


def test_phi_parallel_block() -> None:
    s = spec_of(PHI_15)
    assert s.parallel_block and s.norms_per_layer == 1 and s.norm_kind is NormKind.LAYERNORM
    # PhiAttention rotates half of each head (StableLM's RoPE): the hand-written program's, not the trace's
    assert s.rope_pass_cat and s.rope_parts_kept and s.rotary_dim == 32 and not s.transformers_config
    assert s.mlp_kind is MlpKind.PLAIN and s.qkv_bias and s.o_bias and s.mlp_bias and s.lm_head_bias
    # gelu_new is transformers' NewGELUActivation, eight ops that keep four tensors (not the fused tanh GELU)
    assert s.num_kv_heads == 32 and s.activation is Activation.GELU_NEW


def test_phi_qk_layernorm_is_refused(no_transformers: None) -> None:
    with pytest.raises(SetupError, match="qk_layernorm"):
        spec_of({**PHI_15, "qk_layernorm": True, "partial_rotary_factor": 1.0})


def test_stablelm_parallel_residual_and_qk_layernorm(no_transformers: None) -> None:
    s = spec_of({**STABLELM2_16B, "use_parallel_residual": True})
    assert s.parallel_block and s.norms_per_layer == 1
    with pytest.raises(SetupError, match="cannot be expressed exactly"):
        spec_of({**STABLELM2_16B, "qk_layernorm": True})


def test_stablelm_rotates_a_quarter_of_each_head_where_its_config_is_silent(no_transformers: None) -> None:
    # StableLmConfig's default partial_rotary_factor is 0.25 (transformers 5 may write it into rope_parameters): a
    # config without the key was read as rotating every dim, and one with it was traced (the key unread)
    silent = {k: v for k, v in STABLELM2_16B.items() if k != "partial_rotary_factor"}
    for cfg in (STABLELM2_16B, silent,
                {**silent, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}):
        s = spec_of(cfg)
        assert s.rope_pass_cat and s.rotary_dim == 16 and s.head_dim == 64 and not s.transformers_config
    assert spec_of({**silent, "partial_rotary_factor": 1.0}).rotary_dim == 0
    with pytest.raises(SetupError, match="partial_rotary_factor"):
        spec_of({**silent, "partial_rotary_factor": 0})


def test_starcoder2_and_gpt2_layouts(no_transformers: None) -> None:
    s = spec_of(STARCODER2_3B)
    assert s.sliding_window == 4096 and s.tie_embeddings
    assert s.mlp_kind is MlpKind.PLAIN and s.norm_kind is NormKind.LAYERNORM
    assert s.qkv_bias and s.o_bias and s.mlp_bias and s.num_kv_heads == 2
    g = spec_of(GPT2)
    assert g.learned_positions and g.max_position_embeddings == 1024 and g.intermediate_size == 3072
    assert g.tie_embeddings and not g.lm_head_bias
    with pytest.raises(SetupError, match="add_cross_attention"):
        spec_of({**GPT2, "add_cross_attention": True})


def test_olmo2_without_transformers_explains_why_it_cannot_be_read(no_transformers: None) -> None:
    with pytest.raises(SetupError, match="OLMo-2 normalises the whole q and k") as e:
        spec_from_hf_config(OLMO2_7B, id="m", name="M", source="/models/olmo/config.json")
    assert "/models/olmo/config.json" in str(e.value)


@pytest.mark.parametrize(("cfg", "why"), [
    pytest.param(OLMO2_7B, "olmo2 has no hand-written program", id="olmo2"),  # its q/k norms span q and k
    pytest.param({**PHI_15, "qk_layernorm": True}, "qk_layernorm", id="phi-qk-layernorm"),
    pytest.param({**STABLELM2_16B, "qk_layernorm": True}, "qk_layernorm", id="stablelm-qk-layernorm"),
    pytest.param({**QWEN15_MOE_A27B, "mlp_only_layers": [0, 5]}, "dense MLP", id="qwen-moe-mixed"),
    pytest.param({**GPT2, "add_cross_attention": True}, "add_cross_attention", id="gpt2-cross-attention"),
    pytest.param({**QWEN25_05B, "use_sliding_window": True}, "use_sliding_window", id="qwen2-sliding"),
    # a key the reader does not look at is not assumed harmless: the trace counts what transformers builds
    pytest.param({**LLAMA2_7B, "head_dim_per_layer": [128] * 32}, "head_dim_per_layer", id="unread-key"),
])
def test_a_config_the_program_cannot_express_is_traced_and_says_why(cfg: dict[str, Any], why: str) -> None:
    pytest.importorskip("transformers")
    spec, warnings = hf_config_to_spec(cfg, id="m", name="M", source="config.json")
    assert spec.transformers_config and spec.counted_params == spec.param_count
    assert why in warnings[0] and "traced" in warnings[0]


def _gemma4(**text: Any) -> dict[str, Any]:
    """A small Gemma 4 config as transformers writes it (its own classes' defaults, small sizes): five
    sliding-window layers of head_dim 32, then a global one whose heads are 64 wide."""
    from transformers import AutoConfig

    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, global_head_dim=64, vocab_size_per_layer_input=512,
                 hidden_size_per_layer_input=16, **text)
    cfg = AutoConfig.for_model("gemma4", text_config=small, vision_config={"hidden_size": 32,
                                                                           "intermediate_size": 64,
                                                                           "num_hidden_layers": 1,
                                                                           "num_attention_heads": 2})
    return json.loads(cfg.to_json_string(use_diff=False))


@pytest.mark.parametrize("whole", [True, False], ids=["gemma4", "gemma4_text"])
def test_gemma4_text_is_counted_by_transformers_not_a_llama_reading(whole: bool) -> None:
    """Gemma 4's global layers have wider heads (global_head_dim) and every layer a per-layer input embedding:
    a Llama-style reading miscounted it (30.15B for a model of 30.70B), with only a warning to check the count.
    Now its language model is traced from transformers' own class, and counted by it."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _gemma4()
    text = cfg["text_config"]
    spec, warnings = hf_config_to_spec(cfg if whole else text, id="m", name="M", source="config.json")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**text))
    language = sum(p.numel() for p in model.parameters())
    assert spec.transformers_config and any("traced" in w for w in warnings)
    if whole:  # the multimodal config is traced whole, its tower and projector counted by transformers too
        from transformers import AutoModelForImageTextToText

        with torch.device("meta"):
            vlm = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**cfg))
        assert spec.param_count == sum(p.numel() for p in vlm.parameters()) > language
    else:
        assert spec.param_count == language


def test_deepseek_v3_is_refused_naming_mla(monkeypatch) -> None:
    """Without transformers; with it, MLA models are traced (tests/test_trace.py)."""
    from vramlab.core.sources import hf_config

    monkeypatch.setattr(hf_config, "transformers_model_types", lambda: None)
    with pytest.raises(SetupError, match="MLA") as e:
        spec_from_hf_config(DEEPSEEK_V3, id="m", name="M", source="/models/dsv3/config.json")
    assert "/models/dsv3/config.json" in str(e.value)
    with pytest.raises(SetupError, match="MLA"):
        spec_of({**DEEPSEEK_V3, "model_type": "deepseek_v2"})


@pytest.mark.parametrize(("key", "value"), [("dtype", "bfloat16"), ("torch_dtype", "float32"),
                                            ("torch_dtype", "float16"), ("torch_dtype", "torch.bfloat16")])
def test_checkpoint_dtype(key: str, value: str) -> None:
    cfg = {k: v for k, v in LLAMA2_7B.items() if k != "torch_dtype"} | {key: value}
    expected = {"bfloat16": DType.BF16, "float32": DType.FP32, "float16": DType.FP16}
    assert spec_of(cfg).checkpoint_dtype is expected[value.removeprefix("torch.")]


def test_multimodal_wrapper_uses_text_config_and_defaults() -> None:
    spec, warnings = hf_config_to_spec(GEMMA3_4B_IT, id="g", name="G")
    assert spec.family == "gemma3_text" and spec.qk_norm and spec.norms_per_layer == 4
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (8, 4, 256, 262208)
    assert spec.tie_embeddings and spec.checkpoint_dtype is DType.BF16
    # the language model of gemma-3-4b; its SigLIP tower and projector come with it (tests/test_vlm_gemma3.py)
    assert spec.param_count - spec.vision.param_count == 3_880_263_168
    text = " ".join(warnings)
    assert "not counted" not in text
    assert "num_attention_heads=8" in text and "vocab_size=262208" in text


def test_llava_text_config_without_model_type() -> None:
    cfg = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
           "text_config": {"vocab_size": 32064, "torch_dtype": "float16"}, "vision_config": {}}
    spec, warnings = hf_config_to_spec(cfg, id="l", name="L")
    assert spec.family == "llama" and spec.hidden_size == 4096 and spec.vocab_size == 32064
    assert spec.checkpoint_dtype is DType.FP16 and any("vision tower" in w for w in warnings)


def test_top_level_missing_key_is_not_defaulted() -> None:
    cfg = {k: v for k, v in LLAMA2_7B.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(SetupError) as e:
        spec_from_hf_config(cfg, id="m", name="M", source="/m/config.json")
    assert "/m/config.json" in str(e.value) and "hidden_size" in str(e.value) and "vocab_size" in str(e.value)


@pytest.mark.parametrize(("key", "value"), [("hidden_size", "4096"), ("num_hidden_layers", 32.0),
                                            ("tie_word_embeddings", "false"), ("num_attention_heads", True)])
def test_wrong_typed_key(key: str, value: Any) -> None:
    with pytest.raises(SetupError) as e:
        spec_from_hf_config({**LLAMA2_7B, key: value}, id="m", name="M", source="/m/config.json")
    assert "/m/config.json" in str(e.value) and key in str(e.value)


def test_inconsistent_heads_name_the_file() -> None:
    with pytest.raises(SetupError, match="num_key_value_heads") as e:
        spec_from_hf_config({**LLAMA2_7B, "num_key_value_heads": 5}, id="m", name="M",
                            source="/m/config.json")
    assert "/m/config.json" in str(e.value)


def test_heads_that_do_not_divide_the_hidden_size_name_the_file() -> None:
    cfg = {**LLAMA2_7B, "num_attention_heads": 30, "num_key_value_heads": 30}  # 4096 / 30 is not whole
    with pytest.raises(SetupError, match="not a multiple of num_attention_heads") as e:
        spec_from_hf_config(cfg, id="m", name="M", source="/m/config.json")
    assert "/m/config.json" in str(e.value)
    spec = spec_from_hf_config({**cfg, "head_dim": 128}, id="m", name="M", source="/m/config.json")
    assert spec.head_dim == 128  # an explicit head_dim (Gemma-style) is fine


def test_unmapped_model_type_read_generically_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # a type transformers ships (or, without transformers, one with no auto_map) that VRAM Lab does not map
    monkeypatch.setattr(hf_config, "remote_code_reason", lambda cfg, model_type: None)
    spec, warnings = hf_config_to_spec({**LLAMA2_7B, "model_type": "yi_like"}, id="m", name="M")
    assert spec.param_count == 6_738_415_616
    assert any("not one VRAM Lab maps" in w for w in warnings)


def test_unknown_model_type_without_llama_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_config, "remote_code_reason", lambda cfg, model_type: None)
    cfg = {"model_type": "mystery", "d_model": 512, "n_layers": 6, "vocab_size": 1000}
    with pytest.raises(SetupError) as e:
        spec_from_hf_config(cfg, id="m", name="M", source="/m/config.json")
    msg = str(e.value)
    assert "/m/config.json" in msg and "mystery" in msg
    assert "hidden_size" in msg and "num_hidden_layers" in msg and "intermediate_size" in msg


def test_known_but_unmapped_types_are_refused_without_transformers(monkeypatch) -> None:
    """Without transformers (the estimator-only build) a type with no hand-written program is refused;
    with it, the type is traced (tests/test_trace.py)."""
    from vramlab.core.sources import hf_config

    monkeypatch.setattr(hf_config, "transformers_model_types", lambda: None)
    cfg = {**LLAMA2_7B, "model_type": "gpt_neox"}
    with pytest.raises(SetupError, match="not mapped"):
        spec_of(cfg)


def test_non_causal_lm_architecture_warns() -> None:
    _, warnings = hf_config_to_spec({**LLAMA2_7B, "architectures": ["LlamaForSequenceClassification"]},
                                    id="m", name="M")
    assert any("lm_head" in w for w in warnings)


# ---- config.json files -------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_load_config_json(tmp_path: Path) -> None:
    path = write_json(tmp_path / "config.json", LLAMA2_7B)
    assert load_config_json(path) == LLAMA2_7B


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2, 3]", b"\xff\xfe{}", b""])
def test_config_json_that_is_not_a_json_object(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(SetupError) as e:
        load_config_json(path)
    assert str(path) in str(e.value)
    with pytest.raises(SetupError) as e:
        load_model_source(tmp_path)
    assert str(path) in str(e.value)


def test_config_json_missing_hidden_size(tmp_path: Path) -> None:
    path = write_json(tmp_path / "llama" / "config.json",
                      {k: v for k, v in LLAMA2_7B.items() if k != "hidden_size"})
    with pytest.raises(SetupError) as e:
        load_model_source(path)
    assert str(path) in str(e.value) and "hidden_size" in str(e.value)


def test_deepseek_v3_folder(tmp_path: Path, monkeypatch) -> None:
    from vramlab.core.sources import hf_config

    monkeypatch.setattr(hf_config, "transformers_model_types", lambda: None)  # with it: traced
    path = write_json(tmp_path / "DeepSeek-V3" / "config.json", DEEPSEEK_V3)
    with pytest.raises(SetupError, match="MLA") as e:
        load_model_source(path.parent)
    assert str(path) in str(e.value)


def test_config_file_alone(tmp_path: Path) -> None:
    path = write_json(tmp_path / "Llama-2-7b-hf" / "config.json", LLAMA2_7B)
    m = load_model_source(path)
    assert m.spec.name == "Llama-2-7b-hf" and m.spec.id == "llama-2-7b-hf"
    assert m.spec.param_count == 6_738_415_616 and m.spec.published_params is None
    assert m.tensor_params is None and m.tensor_bytes is None and m.dtype_counts == {}
    assert m.source_path == str(path) and m.warnings == ()


def test_missing_path_and_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="no such file"):
        load_model_source(tmp_path / "nope")
    bare = tiny_folder(tmp_path, name="config-only")
    m = load_model_source(bare)
    assert m.source_path == str(bare) and m.tensor_params is None and m.spec.param_count == 6_736
    write_json(tmp_path / "adapter" / "adapter_config.json", {"base_model_name_or_path": "x"})
    with pytest.raises(SetupError, match="PEFT adapter"):
        load_model_source(tmp_path / "adapter")


# ---- safetensors -------------------------------------------------------------------------------------

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1, "I64": 8}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]],
                      metadata: dict[str, str] | None = None) -> Path:
    """A valid safetensors file: tensors in order, zero data, header padded to 8 bytes with spaces."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


def write_raw(path: Path, header: Any, data_len: int, declared: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + bytes(data_len))
    return path


TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32, "vocab_size": 64,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "max_position_embeddings": 128,
}


def llama_tensors(spec: ModelSpec, dtype: str = "BF16") -> dict[str, tuple[str, tuple[int, ...]]]:
    """The HF tensor names and shapes of a llama-style ModelSpec."""
    h = spec.hidden_size
    out: dict[str, tuple[str, tuple[int, ...]]] = {"model.embed_tokens.weight": (dtype, (spec.vocab_size, h))}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for lin in spec.attn_linears():
            out[f"{p}self_attn.{lin.name}.weight"] = (dtype, (lin.out_features, lin.in_features))
        for lin in spec.mlp_linears():
            out[f"{p}mlp.{lin.name}.weight"] = (dtype, (lin.out_features, lin.in_features))
        out[f"{p}input_layernorm.weight"] = (dtype, (h,))
        out[f"{p}post_attention_layernorm.weight"] = (dtype, (h,))
    out["model.norm.weight"] = (dtype, (h,))
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (dtype, (spec.vocab_size, h))
    return out


def tiny_folder(tmp_path: Path, cfg: dict[str, Any] | None = None, name: str = "tiny-llama") -> Path:
    folder = tmp_path / name
    write_json(folder / "config.json", cfg or TINY)
    return folder


def test_header_of_a_hand_written_file(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "t.safetensors", {"a": ("BF16", (3, 4)), "b": ("F32", (5,)),
                                                           "c": ("I64", ())})
    header = read_safetensors_header(path)
    assert header == {"a": TensorInfo("BF16", (3, 4), 24), "b": TensorInfo("F32", (5,), 20),
                      "c": TensorInfo("I64", (), 8)}
    assert header["a"].numel == 12 and header["c"].numel == 1


def test_header_agrees_with_the_safetensors_library(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "lib.safetensors"
    st.save_file({"w": np.zeros((7, 3), np.float16), "b": np.zeros((3,), np.float32),
                  "q": np.zeros((2, 5), np.int8)}, str(path), metadata={"format": "np"})
    assert read_safetensors_header(path) == {"w": TensorInfo("F16", (7, 3), 42),
                                             "b": TensorInfo("F32", (3,), 12),
                                             "q": TensorInfo("I8", (2, 5), 10)}
    safe_open = pytest.importorskip("safetensors").safe_open
    mine = write_safetensors(tmp_path / "mine.safetensors", {"x": ("F16", (4, 2)), "y": ("I32", (3,))})
    with safe_open(str(mine), "numpy") as f:  # the library accepts the hand-written files
        assert sorted(f.keys()) == ["x", "y"] and f.get_slice("x").get_shape() == [4, 2]


def test_header_never_reads_tensor_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_safetensors(tmp_path / "big.safetensors", {"w": ("F32", (1024, 256))})
    reads: list[int] = []
    real_open = io.open

    class Spy(io.BufferedReader):
        def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
            reads.append(-1 if size is None else size)
            return super().read(size)

    def spy_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(file) == str(path) and "b" in mode:
            return Spy(io.FileIO(file, "rb"))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", spy_open)
    monkeypatch.setattr(builtins, "open", spy_open)
    read_safetensors_header(path)
    assert reads and all(0 <= n < 4096 for n in reads)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("truncated", "too short"),
        ("length_past_end", "runs past the end"),
        ("huge_length", "100 MB"),
        ("not_json", "not valid JSON"),
        ("not_utf8", "UTF-8"),
        ("json_list", "JSON object"),
        ("unknown_dtype", "unknown dtype"),
        ("offsets_past_end", "past the end of the data"),
        ("wrong_span", "needs"),
        ("gap", "gap"),
        ("overlap", "overlaps"),
        ("trailing_data", "cover"),
        ("bad_shape", "shape"),
        ("bad_offsets", "data_offsets"),
        ("bad_metadata", "__metadata__"),
    ],
)
def test_malformed_safetensors(tmp_path: Path, case: str, match: str) -> None:
    path = tmp_path / f"{case}.safetensors"
    good = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    if case == "truncated":
        path.write_bytes(b"\x10\x00\x00")
    elif case == "length_past_end":
        write_raw(path, good, 16, declared=10_000)
    elif case == "huge_length":
        write_raw(path, good, 16, declared=2**40)
    elif case == "not_json":
        write_raw(path, b"{this is not json}", 16)
    elif case == "not_utf8":
        write_raw(path, b'{"\xff": 1}', 16)
    elif case == "json_list":
        write_raw(path, [1, 2], 16)
    elif case == "unknown_dtype":
        write_raw(path, {"a": {**good["a"], "dtype": "F128"}}, 16)
    elif case == "offsets_past_end":
        write_raw(path, good, 8)
    elif case == "wrong_span":
        write_raw(path, {"a": {**good["a"], "shape": [2, 3]}}, 16)
    elif case == "gap":
        write_raw(path, {"a": {**good["a"], "data_offsets": [8, 24]}}, 24)
    elif case == "overlap":
        write_raw(path, {**good, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16)
    elif case == "trailing_data":
        write_raw(path, good, 32)
    elif case == "bad_shape":
        write_raw(path, {"a": {**good["a"], "shape": [2, -2]}}, 16)
    elif case == "bad_offsets":
        write_raw(path, {"a": {**good["a"], "data_offsets": [0]}}, 16)
    elif case == "bad_metadata":
        write_raw(path, {"__metadata__": {"format": 1}, **good}, 16)
    with pytest.raises(SetupError, match=match) as e:
        read_safetensors_header(path)
    assert str(path) in str(e.value)


def test_malformed_shard_fails_the_import(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    header = {"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}
    bad = write_raw(folder / "model.safetensors", header, 4)
    with pytest.raises(SetupError, match="unknown dtype") as e:
        load_model_source(folder)
    assert str(bad) in str(e.value)


def test_single_file_exact_counts(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    spec = spec_of(TINY)
    write_safetensors(folder / "model.safetensors", llama_tensors(spec))
    m = load_model_source(folder)
    assert isinstance(m, ImportedModel)
    assert m.spec.param_count == spec.param_count == 6_736
    assert m.tensor_params == spec.param_count and m.tensor_bytes == 2 * spec.param_count
    assert m.dtype_counts == {"BF16": spec.param_count}
    assert m.spec.published_params == spec.param_count
    assert m.quantized is None and m.warnings == ()
    assert (m.spec.id, m.spec.name, m.source_path) == ("tiny-llama", "tiny-llama", str(folder))


def test_sharded_with_index(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    spec = spec_of(TINY)
    tensors = llama_tensors(spec)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for shard, part in shards.items():
        write_safetensors(folder / shard, {n: tensors[n] for n in part})
    write_safetensors(folder / "consolidated.safetensors", tensors)  # a copy outside the index: ignored
    index = {"metadata": {"total_size": 2 * spec.param_count},
             "weight_map": {n: s for s, part in shards.items() for n in part}}
    write_json(folder / "model.safetensors.index.json", index)
    idx = read_safetensors_index(folder / "model.safetensors.index.json")
    assert idx.total_size == 2 * spec.param_count and idx.shards == tuple(sorted(shards))
    m = load_model_source(folder)
    assert m.tensor_params == spec.param_count and m.spec.published_params == spec.param_count
    assert m.warnings == ()


def test_index_with_missing_shard_falls_back_to_config(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    tensors = llama_tensors(spec_of(TINY))
    write_safetensors(folder / "model-00001-of-00002.safetensors", tensors)
    write_json(folder / "model.safetensors.index.json", {"weight_map": {
        n: ("model-00001-of-00002.safetensors" if i else "model-00002-of-00002.safetensors")
        for i, n in enumerate(tensors)}})
    m = load_model_source(folder)
    assert m.tensor_params is None and m.spec.published_params is None
    assert any("model-00002-of-00002.safetensors" in w and "incomplete" in w for w in m.warnings)


@pytest.mark.parametrize("weight_map", [{"a": "../outside.safetensors"}, {"a": 3}, {}])
def test_index_must_name_plain_shard_files(tmp_path: Path, weight_map: dict[str, Any]) -> None:
    path = write_json(tmp_path / "model.safetensors.index.json", {"weight_map": weight_map})
    with pytest.raises(SetupError) as e:
        read_safetensors_index(path)
    assert str(path) in str(e.value)


def test_count_mismatch_is_an_error(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    spec = spec_of(TINY)
    tensors = llama_tensors(spec)
    del tensors["model.norm.weight"]
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(SetupError, match=f"the safetensors hold {spec.param_count - 16:,} parameters, but "
                       f"config.json read as llama model implies {spec.param_count:,}") as e:
        load_model_source(folder)
    assert str(folder / "config.json") in str(e.value)


def test_wrong_tie_flag_is_pointed_out(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path, {**TINY, "tie_word_embeddings": True})
    write_safetensors(folder / "model.safetensors", llama_tensors(spec_of(TINY)))  # has lm_head.weight
    m = load_model_source(folder)
    assert any("counted once" in w for w in m.warnings)  # a tied checkpoint that stores the head anyway
    assert m.spec.published_params == m.spec.param_count


def test_untied_config_with_tied_checkpoint(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    tensors = llama_tensors(spec_of(TINY))
    del tensors["lm_head.weight"]
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(SetupError, match="exactly one vocab x hidden matrix: check tie_word_embeddings"):
        load_model_source(folder)


def test_buffers_are_not_parameters(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    tensors = llama_tensors(spec_of(TINY))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = ("F32", (2,))
    write_safetensors(folder / "model.safetensors", tensors)
    m = load_model_source(folder)
    assert m.spec.published_params == m.spec.param_count and m.tensor_params == m.spec.param_count + 2
    assert m.dtype_counts == {"BF16": m.spec.param_count, "F32": 2}
    assert any("buffer" in w for w in m.warnings)


def test_dtype_taken_from_the_tensors(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path, {**TINY, "torch_dtype": "float32"})
    write_safetensors(folder / "model.safetensors", llama_tensors(spec_of(TINY)))
    m = load_model_source(folder)
    assert m.spec.checkpoint_dtype is DType.BF16 and any("mostly bf16" in w for w in m.warnings)
    folder = tiny_folder(tmp_path, {k: v for k, v in TINY.items() if k != "torch_dtype"}, name="nodtype")
    write_safetensors(folder / "model.safetensors", llama_tensors(spec_of(TINY), "F16"))
    m = load_model_source(folder)
    assert m.spec.checkpoint_dtype is DType.FP16
    assert any("taken from the safetensors (fp16)" in w for w in m.warnings)


def test_bnb_quantized_checkpoint(tmp_path: Path) -> None:
    cfg = {**TINY, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                           "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}}
    folder = tiny_folder(tmp_path, cfg)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in llama_tensors(spec_of(TINY)).items():
        if ".layers." in name and name.endswith("proj.weight"):
            tensors[name] = ("U8", (math.prod(shape) // 2, 1))
            tensors[name + ".absmax"] = ("F32", (math.prod(shape) // 64,))
            tensors[name + ".quant_state.bitsandbytes__nf4"] = ("U8", (64,))
        else:
            tensors[name] = (dtype, shape)
    write_safetensors(folder / "model.safetensors", tensors)
    m = load_model_source(folder)
    assert m.quantized == "bnb-nf4" and m.spec.published_params is None
    assert m.tensor_params == sum(math.prod(s) for _, s in tensors.values())
    assert "U8" in m.dtype_counts and any("packed" in w for w in m.warnings)
    assert m.spec.param_count == spec_of(TINY).param_count


def test_gptq_detected_from_tensor_names(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    write_safetensors(folder / "model.safetensors", {
        "model.layers.0.self_attn.q_proj.qweight": ("I32", (2, 16)),
        "model.layers.0.self_attn.q_proj.qzeros": ("I32", (1, 2)),
        "model.layers.0.self_attn.q_proj.scales": ("F16", (1, 16)),
        "model.layers.0.self_attn.q_proj.g_idx": ("I32", (16,)),
    })
    m = load_model_source(folder)
    assert m.quantized == "gptq" and m.spec.published_params is None
    assert any("packed" in w for w in m.warnings)


def test_pickle_weights_are_never_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_folder(tmp_path)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    (folder / "training_args.bin").write_bytes(b"\x80\x04")
    write_json(folder / "pytorch_model.bin.index.json", {"metadata": {"total_size": 45728},
                                                         "weight_map": {"x": "pytorch_model.bin"}})
    opened: list[str] = []
    real_open = io.open

    def spy_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", spy_open)
    monkeypatch.setattr(builtins, "open", spy_open)
    m = load_model_source(folder)
    assert not any(p.endswith((".bin", ".pt")) for p in opened)
    assert m.tensor_params is None and m.spec.published_params is None
    warning = next(w for w in m.warnings if "pickle" in w)
    assert "pytorch_model.bin" in warning and "training_args" not in warning and "45,728 bytes" in warning
    assert "config.json only" in warning


def test_multimodal_folder_counts_the_language_model(tmp_path: Path) -> None:
    text = {k: v for k, v in TINY.items() if k not in ("architectures", "torch_dtype")}
    cfg = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": text,
           "vision_config": {"hidden_size": 8}, "torch_dtype": "bfloat16"}
    folder = tiny_folder(tmp_path, cfg, name="tiny-llava")
    tensors = {f"language_model.{k}": v for k, v in llama_tensors(spec_of(TINY)).items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = ("BF16", (8, 3, 2, 2))
    tensors["multi_modal_projector.linear_1.weight"] = ("BF16", (16, 8))
    write_safetensors(folder / "model.safetensors", tensors)
    m = load_model_source(folder)
    assert m.spec.published_params == m.spec.param_count == spec_of(TINY).param_count
    assert m.tensor_params == m.spec.param_count + 96 + 128
    assert any("vision tower" in w for w in m.warnings) and any("224 vision" in w for w in m.warnings)


def test_imported_spec_round_trips(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    write_safetensors(folder / "model.safetensors", llama_tensors(spec_of(TINY)))
    spec = load_model_source(folder).spec
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_config_without_model_type(tmp_path: Path) -> None:
    cfg = {k: v for k, v in LLAMA2_7B.items() if k != "model_type"}
    assert spec_of(cfg).family == "llama"  # from architectures
    bare = {k: v for k, v in cfg.items() if k != "architectures"}
    spec, warnings = hf_config_to_spec(bare, id="m", name="M")
    assert spec.param_count == 6_738_415_616 and any("names no model_type" in w for w in warnings)


def test_hub_cache_layout(tmp_path: Path) -> None:
    repo = tmp_path / "models--acme--Tiny-Llama-v1"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    write_json(snapshot / "config.json", TINY)
    write_safetensors(snapshot / "model.safetensors", llama_tensors(spec_of(TINY)))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for path in (repo, snapshot):
        m = load_model_source(path)
        assert m.spec.name == "acme/Tiny-Llama-v1" and m.spec.id == "acme-tiny-llama-v1"
        assert m.spec.published_params == m.spec.param_count


def test_importer_stays_light() -> None:
    """core/ never imports Qt; reading a model's files never needs transformers or the safetensors library."""
    banned = ("PySide6", "pyqtgraph", "transformers", "safetensors")
    code = ("import sys, vramlab.core.sources.folder; "
            f"bad = [m for m in sys.modules if m.split('.')[0] in {banned!r}]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("model_type, cls", [("phi", "PhiConfig"), ("phi3", "Phi3Config"),
                                             ("stablelm", "StableLmConfig")])
def test_the_rotated_part_of_each_head_is_read_where_transformers_5_writes_it(model_type, cls):
    """transformers 5 saves partial_rotary_factor inside rope_parameters only; each reader takes it from there as the
    attention does (Phi's read the class default, 0.5, for a saved 0.375)."""
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, cls)(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                     intermediate_size=512, num_hidden_layers=1, vocab_size=1000,
                                     partial_rotary_factor=0.375).to_dict()
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.375
    cfg.pop("partial_rotary_factor", None)  # Phi's and StableLM's saved form (Phi-3 writes it beside, too)
    spec, _warnings = hf_config_to_spec(cfg, id="x", name="x")
    assert spec.rotary_dim == int(256 // 4 * 0.375)  # PhiAttention's rotary_ndims: int(head_dim * factor)
