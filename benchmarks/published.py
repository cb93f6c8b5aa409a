"""Estimate vs published measurements (benchmarks/data/published_measurements.csv: what each column means is in
benchmarks/README.md).

Every row is mapped to a setup as its source ran it (the framework's conventions: adapter dtype, loss
upcast, autocast, peft's k-bit preparation, sharding) and compared with the estimate at the level the
source measured. Rows the model cannot represent are listed with the reason. Beside ours, the common
rules of thumb. No per-row constants: a row's mapping only restates its published settings.

Run: .venv/bin/python benchmarks/published.py [--csv PATH]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from vramlab.core.catalog import find_model  # noqa: E402
from vramlab.core.estimate import estimate  # noqa: E402
from vramlab.core.kinds import Kind  # noqa: E402
from vramlab.core.result import MemoryResult  # noqa: E402
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.units import GiB  # noqa: E402

DEFAULT_CSV = Path(__file__).resolve().parent / "data" / "published_measurements.csv"

# Models of the table that are not presets (numbers from their public configs).
EXTRA = {
    "falcon-7b": ModelSpec(id="falcon-7b", name="Falcon-7B", num_layers=32, hidden_size=4544, num_heads=71,
                           num_kv_heads=1, head_dim=64, intermediate_size=18176, vocab_size=65024,
                           tie_embeddings=True, mlp_kind="plain", activation="gelu", norm_kind="layernorm",
                           norms_per_layer=1, parallel_block=True, max_position_embeddings=2048),
    # Qwen (v1): fused c_attn with bias, SwiGLU w1/w2 of half the config's intermediate_size
    "qwen-1.8b": ModelSpec(id="qwen-1.8b", name="Qwen-1.8B", num_layers=24, hidden_size=2048, num_heads=16,
                           num_kv_heads=16, intermediate_size=5504, vocab_size=151936, qkv_bias=True,
                           max_position_embeddings=8192),
    "qwen-7b": ModelSpec(id="qwen-7b", name="Qwen-7B", num_layers=32, hidden_size=4096, num_heads=32,
                         num_kv_heads=32, intermediate_size=11008, vocab_size=151936, qkv_bias=True,
                         max_position_embeddings=8192),
    "qwen-14b": ModelSpec(id="qwen-14b", name="Qwen-14B", num_layers=40, hidden_size=5120, num_heads=40,
                          num_kv_heads=40, intermediate_size=13696, vocab_size=152064, qkv_bias=True,
                          max_position_embeddings=8192),
    "qwen-72b": ModelSpec(id="qwen-72b", name="Qwen-72B", num_layers=80, hidden_size=8192, num_heads=64,
                          num_kv_heads=64, intermediate_size=24576, vocab_size=152064, qkv_bias=True,
                          max_position_embeddings=32768),
}

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QV = ("q_proj", "v_proj")
QKV = ("q_proj", "k_proj", "v_proj")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class Mapping:
    model: str
    setup: dict[str, Any] = field(default_factory=dict)
    level: str = "allocated"  # allocated | reserved | device | reserved_over_load
    divide: int = 1  # the published value covers this many GPUs
    note: str = ""
    excluded: str = ""

    def __post_init__(self) -> None:
        # every measurement here predates transformers 5.25 or does not load its model through it (torchtune, LitGPT):
        # the Hub kernels its from_pretrained turns on by default did not run
        self.setup = {"hub_kernels": False, **self.setup}


# Conventions per source (from their code at the cited commits):
#  torchtune: LoRA weights in the model dtype (bf16), cross entropy without HF's fp32 upcast
#  LitGPT: bf16-true, LoRA in bf16, lora_dropout 0.05, bf16 chunked cross entropy
#  HF Trainer + peft: fp32 adapters; bf16=True autocast; QLoRA via prepare_model_for_kbit_training
#  Answer.AI fsdp_qlora: pure bf16 model and adapters, HF model (fp32 logits), reentrant checkpointing
TT = {"adapter_dtype": "bf16", "loss_fp32": False}
LIT = {"adapter_dtype": "bf16", "loss_fp32": False, "lora_dropout": 0.05}
HFQ = {"method": "qlora", "weights": "nf4", "kbit_upcast": True, "amp": True}
AAI = {"adapter_dtype": "bf16"}

MAP: dict[str, Mapping] = {
    "M003": Mapping("llama-2-7b", {**TT, "method": "lora", "lora_rank": 8, "lora_targets": QV, "micro_batch": 4,
                                   "seq_len": 2048, "gpus": 2, "sharding": "fsdp", "grad_ckpt": True},
                    note="checkpointing on: the row says off, but torchtune's distributed LoRA configs enable it "
                         "and without it the activations alone (~38 GiB) exceed the 24 GB GPU"),
    "M006": Mapping("llama-2-70b", {**TT, "method": "lora", "lora_rank": 16, "lora_targets": QKV, "micro_batch": 4,
                                    "seq_len": 4096, "grad_ckpt": True, "gpus": 8, "sharding": "fsdp"}),
    "M009": Mapping("llama-3.1-8b", {**TT, "micro_batch": 2, "seq_len": 2048, "grad_ckpt": True,
                                     "optimizer": "paged_adamw8bit", "optimizer_in_backward": True},
                    note="recipe defaults assumed: paged 8-bit AdamW in backward, checkpointing; torch.compile"),
    "M012": Mapping("llama-3.1-8b", {**TT, "method": "qlora", "lora_rank": 8, "lora_targets": ALL_LINEAR,
                                     "micro_batch": 2, "seq_len": 2048, "grad_ckpt": True, "optimizer_impl": "fused"},
                    note="torchao NF4; torch.compile not modelled"),
    "M015": Mapping("llama-3.1-405b", {**TT, "method": "qlora", "lora_rank": 16, "lora_targets": ALL_LINEAR,
                                       "micro_batch": 2, "seq_len": 2048, "grad_ckpt": True, "gpus": 8,
                                       "sharding": "fsdp", "optimizer_impl": "fused"}),
    "M018": Mapping("llama-3.2-3b", {**TT, "micro_batch": 2, "seq_len": 4096, "optimizer_impl": "fused"},
                    note="active bytes ~ allocated; torch.compile not modelled"),
    "M021": Mapping("llama-3.2-3b", {**TT, "micro_batch": 2, "seq_len": 4096, "grad_ckpt": True,
                                     "optimizer_in_backward": True, "optimizer_impl": "fused"}),
    "M024": Mapping("llama-3.2-3b", {**TT, "method": "lora", "lora_rank": 64,
                                     "lora_targets": ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"), "micro_batch": 2, "seq_len": 4096,
                                     "grad_ckpt": True, "optimizer_impl": "fused"},
                    note="activation offloading not modelled (our estimate keeps checkpoints on the GPU)"),
    "M027": Mapping("llama-2-7b", excluded="sequence length not stated (padded to the longest sample)"),
    "M030": Mapping("llama-2-7b", excluded="sequence length not stated (padded to the longest sample)"),
    "M033": Mapping("phi-1.5", {**LIT, "method": "lora", "lora_rank": 8, "lora_targets": QV, "micro_batch": 4,
                                "seq_len": 1044}),
    "M036": Mapping("stablelm-base-alpha-3b", {**LIT, "method": "qlora", "lora_rank": 8, "lora_targets": QV,
                                               "micro_batch": 1, "seq_len": 1034, "optimizer": "paged_adamw8bit"},
                    note="paged 32-bit AdamW modelled as paged 8-bit: both keep large states outside torch"),
    "M039": Mapping("llama-2-7b", {**LIT, "method": "qlora", "lora_rank": 8, "lora_targets": QV, "micro_batch": 1,
                                   "seq_len": 1304, "optimizer": "paged_adamw8bit"}),
    "M042": Mapping("llama-2-13b", {**LIT, "method": "qlora", "lora_rank": 8, "lora_targets": QV,
                                    "micro_batch": 1, "seq_len": 1304, "optimizer": "paged_adamw8bit"}),
    "M045": Mapping("llama-2-13b", {**LIT, "method": "lora", "lora_rank": 8, "lora_targets": QV,
                                    "micro_batch": 1, "seq_len": 1304, "grad_ckpt": True, "gpus": 4,
                                    "sharding": "fsdp"}),
    "M048": Mapping("falcon-7b", {**LIT, "method": "lora", "lora_rank": 8, "lora_targets": QKV,
                                  "micro_batch": 1, "seq_len": 256},
                    note="fused query_key_value adapted as q,k,v"),
    "M051": Mapping("llama-3.2-1b", {**LIT, "method": "qlora", "lora_rank": 32, "lora_targets": QV,
                                     "micro_batch": 2, "seq_len": 512, "optimizer": "paged_adamw8bit"}),
    "M054": Mapping("llama-2-7b", {**LIT, "method": "lora", "lora_rank": 32, "lora_targets": QV, "micro_batch": 2,
                                   "seq_len": 512}),
    "M057": Mapping("llama-3-8b", {**LIT, "method": "qlora", "lora_rank": 32, "lora_targets": QV, "micro_batch": 2,
                                   "seq_len": 512, "optimizer": "paged_adamw8bit"}),
    "M060": Mapping("gemma-2b", {**LIT, "method": "lora", "lora_rank": 16, "lora_targets": (*ALL_LINEAR, "lm_head"),
                                 "micro_batch": 2, "seq_len": 512}),
    "M063": Mapping("", excluded="T0 is an encoder-decoder model (not modelled)"),
    "M066": Mapping("", excluded="BLOOM uses ALiBi and fused QKV (not modelled)"),
    "M069": Mapping("llama-2-70b", {**HFQ, "kbit_upcast": False, "lora_rank": 8, "lora_targets": ALL_LINEAR,
                                    "micro_batch": 2, "seq_len": 2048, "grad_ckpt": True, "gpus": 2,
                                    "sharding": "zero3"}, level="reserved",
                    note="measured statistic not stated; compared at the reserved level"),
    "M072": Mapping("llama-2-70b", {**HFQ, "kbit_upcast": False, "lora_rank": 8, "lora_targets": ALL_LINEAR,
                                    "micro_batch": 2, "seq_len": 2048, "grad_ckpt": True, "gpus": 2,
                                    "sharding": "fsdp"}, level="reserved",
                    note="measured statistic not stated; compared at the reserved level"),
    "M075": Mapping("llama-3.2-3b", {"method": "lora", "lora_rank": 64, "lora_targets": QV, "micro_batch": 4,
                                     "seq_len": 768}, level="reserved_over_load",
                    note="max_memory_reserved minus the level after loading; sequence = the bucket's maximum"),
    "M078": Mapping("", excluded="BERT is an encoder (not modelled)"),
    "M081": Mapping("", excluded="BERT is an encoder (not modelled)"),
    "M084": Mapping("", excluded="BERT is an encoder (not modelled)"),
    "M087": Mapping("qwen-1.8b", {"method": "lora", "lora_rank": 64, "lora_targets": ALL_LINEAR, "micro_batch": 1,
                                  "seq_len": 2048, "grad_ckpt": True, "amp": True, "loss_fp32": False},
                    level="reserved", note="fused c_attn adapted as q,k,v; statistic not stated"),
    "M090": Mapping("", excluded="GPTQ int4 kernels (not NF4) are not modelled"),
    "M093": Mapping("qwen-7b", {"method": "lora", "lora_rank": 64, "lora_targets": ALL_LINEAR, "micro_batch": 1,
                                "seq_len": 256, "grad_ckpt": True, "amp": True, "loss_fp32": False},
                    level="reserved", note="fused c_attn adapted as q,k,v; statistic not stated"),
    "M096": Mapping("", excluded="GPTQ int4 kernels (not NF4) are not modelled"),
    "M099": Mapping("qwen-14b", {"method": "lora", "lora_rank": 64, "lora_targets": ALL_LINEAR, "micro_batch": 1,
                                 "seq_len": 256, "grad_ckpt": True, "amp": True, "loss_fp32": False},
                    level="reserved", note="fused c_attn adapted as q,k,v; statistic not stated"),
    "M102": Mapping("qwen-72b", excluded="12.5 GiB per GPU is below the 36 GiB of bf16 weight shards ZeRO-3 needs "
                                         "on 4 GPUs without offload: the row's settings are incomplete"),
    "M105": Mapping("qwen-7b", {"method": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_targets": QKV,
                                "lora_dropout": 0.05, "micro_batch": 1, "seq_len": 512, "grad_ckpt": True,
                                "amp": True, "loss_fp32": False}, level="reserved",
                    note="fused c_attn adapted as q,k,v"),
    "M108": Mapping("qwen-7b", {"method": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_targets": QKV,
                                "lora_dropout": 0.05, "micro_batch": 1, "seq_len": 8192, "grad_ckpt": True,
                                "amp": True, "loss_fp32": False}, level="reserved",
                    note="fused c_attn adapted as q,k,v"),
    "M111": Mapping("qwen-1.8b", {"micro_batch": 1, "seq_len": 512, "grad_ckpt": True, "loss_fp32": False},
                    level="reserved"),
    "M114": Mapping("qwen-7b", {"method": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_targets": QKV,
                                "lora_dropout": 0.05, "micro_batch": 4, "seq_len": 2048, "grad_ckpt": True,
                                "amp": True, "loss_fp32": False}, level="reserved",
                    note="fused c_attn adapted as q,k,v"),
    "M117": Mapping("qwen-7b", {"method": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_targets": QKV,
                                "lora_dropout": 0.05, "micro_batch": 1, "seq_len": 2048, "grad_ckpt": True,
                                "amp": True, "loss_fp32": False, "attention": "eager"}, level="reserved",
                    note="fused c_attn adapted as q,k,v"),
    "M120": Mapping("qwen-7b", {**HFQ, "lora_rank": 8, "lora_alpha": 32, "lora_targets": QKV, "lora_dropout": 0.05,
                                "micro_batch": 1, "seq_len": 2048, "grad_ckpt": True, "loss_fp32": False},
                    level="reserved", note="fused c_attn adapted as q,k,v"),
    "M123": Mapping("yi-34b", {"method": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_targets": QKV,
                               "lora_dropout": 0.05, "micro_batch": 1, "seq_len": 2048, "grad_ckpt": True,
                               "amp": True}, level="reserved"),
    "M126": Mapping("mistral-7b-v0.1", {"micro_batch": 4, "seq_len": 4096, "grad_ckpt": True}),
    "M129": Mapping("mistral-7b-v0.1", {"method": "lora", "lora_rank": 16, "lora_alpha": 16, "lora_targets": QKVO,
                                        "micro_batch": 4, "seq_len": 4096, "grad_ckpt": True}),
    "M132": Mapping("mistral-7b-v0.1", {**HFQ, "lora_rank": 16, "lora_alpha": 16, "lora_targets": QKVO,
                                        "micro_batch": 4, "seq_len": 4096, "grad_ckpt": True}),
    # measured under transformers 4, whose Mixtral experts were nn.Linear modules that bitsandbytes quantized;
    # transformers 5 fuses them into 3-D parameters its quantizer leaves in 16 bits and peft's k-bit preparation
    # upcasts to fp32 (209 GiB for this setup under 5.25, the run the estimate models)
    "M135": Mapping("mixtral-8x7b", excluded="measured under transformers 4 (NF4 per-expert nn.Linear experts); "
                    "transformers 5 keeps Mixtral's fused experts unquantized"),
    "M138": Mapping("", excluded="GPTQ int4 kernels (not NF4) are not modelled"),
    "M141": Mapping("llama-2-7b", {**AAI, "method": "lora", "lora_rank": 64, "lora_alpha": 16,
                                   "lora_targets": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
                                   "micro_batch": 1, "seq_len": 512, "grad_ckpt": True, "gpus": 2,
                                   "sharding": "fsdp"}, level="reserved"),
    "M144": Mapping("llama-2-7b", {**AAI, "method": "qlora", "lora_rank": 64, "lora_alpha": 16,
                                   "lora_targets": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
                                   "micro_batch": 10, "seq_len": 2048, "grad_ckpt": True, "gpus": 2,
                                   "sharding": "fsdp"}, level="reserved"),
    "M147": Mapping("llama-2-7b", {**AAI, "method": "qlora", "lora_rank": 64, "lora_alpha": 16,
                                   "lora_targets": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
                                   "micro_batch": 8, "seq_len": 2048, "grad_ckpt": True, "gpus": 2},
                    level="reserved"),
    "M150": Mapping("yi-34b", {**AAI, "method": "qlora", "lora_rank": 64, "lora_alpha": 16,
                               "lora_targets": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
                               "micro_batch": 4, "seq_len": 2048, "grad_ckpt": True, "gpus": 2, "sharding": "fsdp",
                               "offload": "params"}, level="reserved"),
    "M153": Mapping("llama-3.1-8b", {"weights": "fp32", "compute": "bf16", "micro_batch": 2, "seq_len": 8192,
                                     "gpus": 8, "sharding": "fsdp", "grad_ckpt": True, "optimizer_impl": "fused"},
                    level="reserved", note="selective (op-level) checkpointing modelled as full; reserved near "
                                           "capacity is an upper bound"),
    "M156": Mapping("llama-2-7b", {"method": "lora", "lora_rank": 8, "lora_targets": QV, "micro_batch": 4,
                                   "seq_len": 1024, "grad_ckpt": True, "amp": True}, level="device",
                    note="statistic, precision and sequence unknown: upper bound of the sequence"),
    "M159": Mapping("", excluded="a capacity bound (the longest sequence that fit 24 GB), not a measurement"),
    "M162": Mapping("", excluded="aggregate over an unknown GPU cluster"),
}

LEVELS = {"allocated": "peak_allocated_bytes", "reserved": "peak_reserved_bytes", "device": "device_used_bytes"}


# ---- vision-language models (not in the shared CSV): published figures with their source and trust --------
@dataclass
class VlmRow:
    id: str
    source: str  # repository, file and commit, or page
    trust: str  # high: a measurement with its settings; medium: a table of a framework; low: a comment or a post
    published_gib: float  # per GPU, as published
    mapping: Mapping


SWIFT = "modelscope/ms-swift"
# ms-swift's conventions (swift/llm/argument): gradient checkpointing on by default, and for the vision tower
# too (vit_gradient_checkpointing follows it), reentrant unless DDP runs without DeepSpeed
# (SwiftMixin._fix_gradient_checkpointing); --torch_dtype bfloat16 trains a bf16 model and sets bf16=True
# (ModelArguments._init_mixed_precision), so its HF Trainer runs bf16 autocast (--amp); --deepspeed zero2 is
# DeepSpeed's ZeRO-2 with its fp32 master partitions; truncation_strategy 'delete' drops samples over max_length.
# COCO images are about 640x480, under MAX_PIXELS=1003520; a COCO caption sample is about 64 tokens of text with
# the chat template. The figures are comments at the top of example scripts: nvidia-smi.
SWIFT_QWEN2_VL_LORA = {"method": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_targets": ALL_LINEAR,
                       "vision_tuning": "frozen", "images": 1, "image_width": 640, "image_height": 480,
                       "max_pixels": 1003520, "grad_ckpt": True, "ckpt_reentrant": True, "amp": True,
                       "grad_accum": 16}
# custom_tuner/lora_llm_full_vit.sh and lora_llm_full_vit/sft.sh: Qwen2.5-VL-7B, LoRA r16 / alpha 32 on the language
# model's linear layers (get_multimodal_target_regex), ViT and merger fully trained (the plugin's requires_grad_),
# batch 1, COCO, MAX_PIXELS=1003520, bf16 autocast
SWIFT_LORA_LLM_FULL_VIT = {"method": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_targets": ALL_LINEAR,
                           "vision_tuning": "full", "images": 1, "image_width": 640, "image_height": 480,
                           "max_pixels": 1003520, "seq_len": 64, "grad_ckpt": True, "ckpt_reentrant": True,
                           "amp": True}
# Qwen/Qwen2-VL-7B-Instruct's config.json (its keys that size the model; 8,291,375,616 parameters as
# transformers' Qwen2VLForConditionalGeneration counts them, the published 8.29B)
VLM_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2-vl-7b": {
        "model_type": "qwen2_vl", "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "text_config": {"model_type": "qwen2_vl_text", "vocab_size": 152064, "hidden_size": 3584,
                        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                        "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 151643,
                        "eos_token_id": 151645, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                                    "mrope_section": [16, 24, 24]}},
        "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16,
                          "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "hidden_act": "quick_gelu"},
    },
}

VLM_ROWS: list[VlmRow] = [
    VlmRow("V1", f"{SWIFT} examples/train/multimodal/custom_tuner/lora_llm_full_vit.sh @e6ff2cb (# 25GiB)", "low",
           25.0, Mapping("qwen2.5-vl-7b", {**SWIFT_LORA_LLM_FULL_VIT, "grad_accum": 16}, level="device",
                         note="LoRA r16 on the language model + ViT and merger trained, 1 GPU, batch 1, COCO, "
                              "checkpointing, bf16 autocast")),
    # Qwen2-VL-7B is traced whole from transformers' class (core/tracing/vlm_traced.py): swift's defaults are
    # LoRA on all-linear of the language model and a frozen ViT (--freeze_vit true); batch 1, accumulation 16.
    # nvidia-smi over a run also holds what the allocator cached for the largest sample (COCO images up to
    # 640x640, longer answers) and the evaluation passes, which one steady step does not
    VlmRow("V2", f"{SWIFT} examples/train/multimodal/vqa.sh @6488cba (# 22GiB)", "low", 22.0,
           Mapping("qwen2-vl-7b", {**SWIFT_QWEN2_VL_LORA, "seq_len": 64}, level="device",
                   note="LoRA r8 all-linear (swift's default), ViT frozen, batch 1, OK-VQA (COCO images), traced")),
    VlmRow("V3", f"{SWIFT} examples/train/multimodal/grounding.sh @7208336 (# 20GiB)", "low", 20.0,
           Mapping("qwen2-vl-7b", {**SWIFT_QWEN2_VL_LORA, "seq_len": 64}, level="device",
                   note="LoRA r8 all-linear, ViT frozen, batch 1, COCO grounding (text length assumed), traced")),
    VlmRow("V10", f"{SWIFT} examples/train/multimodal/caption.sh @13e86a0 (# 22GiB)", "low", 22.0,
           Mapping("qwen2-vl-7b", {**SWIFT_QWEN2_VL_LORA, "seq_len": 64}, level="device",
                   note="LoRA r8 all-linear, ViT frozen, batch 1, COCO caption, traced")),
    VlmRow("V11", f"{SWIFT} examples/train/multimodal/ocr.sh @3d5aafd (# 20GB)", "low", 20.0,
           Mapping("", excluded="LaTeX_OCR handwriting images: their resolution (hence the vision tokens) and the "
                                "formulas' token lengths are not stated")),
    VlmRow("V12", "huggingface.co/posts/merve/125006191991546 (SmolVLM on an L4, batch 4, 16.4 GB; notebook "
                  "huggingface/smollm finetuning/Smol_VLM_FT.ipynb)", "low", 16.4 * 1e9 / GiB,
           Mapping("", excluded="peft's name match puts the notebook's r8 adapters on the language model's linear "
                                "layers and on the SigLIP tower's q/k/v only (its printed 10,536,960 trainable "
                                "parameters: 24 x 376,832 + 27 x 55,296); a LoRA tower here adapts every linear "
                                "layer of the tower's blocks, a frozen one none")),
    # video.sh: LoRA r8 all-linear, ViT frozen, batch 1, ZeRO-2 over 2 GPUs, accumulation 16 / 2, one VideoChatGPT
    # video a sample: FPS_MAX_FRAMES=12 (its ActivityNet videos run minutes, so 12 frames at qwen_vl_utils' 2 fps),
    # VIDEO_MAX_PIXELS=50176 per frame (binding for any frame over 224x224: 168x280 at 16:9 gives 360 vision
    # tokens, 168x252 at 4:3 gives 324); the answers' lengths are not stated, so the text is bounded by
    # max_length 2048 less the video's 360 tokens (swift drops longer samples): an upper bound, as nvidia-smi over
    # a run holds the allocator's cache of its longest sample
    VlmRow("V4", f"{SWIFT} examples/train/multimodal/video.sh @24159da (# 2*24GB)", "low", 24.0,
           Mapping("qwen2.5-vl-7b", {
               "method": "lora", "lora_rank": 8, "lora_alpha": 32, "lora_targets": ALL_LINEAR,
               "vision_tuning": "frozen", "frames": 12, "image_width": 640, "image_height": 360, "max_pixels": 50176,
               "seq_len": 2048 - 360, "grad_ckpt": True, "ckpt_reentrant": True, "amp": True, "gpus": 2,
               "sharding": "zero2",
               "grad_accum": 8}, level="device",
               note="LoRA r8 all-linear, ViT frozen, batch 1, ZeRO-2 x2, 12 frames at 50176 px (16:9 assumed), "
                    "text bounded by max_length: upper bound")),
    VlmRow("V5", f"{SWIFT} examples/train/multimodal/vit_gradient_checkpointing.sh @5f19114 (56 / 77 GiB)", "low",
           56.0, Mapping("", excluded="--padding_free packs the batch of 4 into one row, which is not modelled; "
                                      "checkpointing the tower alone (--gradient_checkpointing false, "
                                      "--vit_gradient_checkpointing true) is not expressible (vision_ckpt applies "
                                      "under grad_ckpt); VideoChatGPT's answer lengths are not stated (the language "
                                      "model runs without checkpointing, so its activations follow the text)")),
    VlmRow("V6", f"{SWIFT} examples/train/multimodal/lora_llm_full_vit/sft.sh @11a3053 (# 4 * 22GiB)", "low", 22.0,
           Mapping("qwen2.5-vl-7b", {**SWIFT_LORA_LLM_FULL_VIT, "gpus": 4, "sharding": "zero2", "grad_accum": 4},
                   level="device", note="V1's run under DeepSpeed ZeRO-2 over 4 GPUs (fp32 master partitions), "
                                        "accumulation 4")),
    VlmRow("V7", f"{SWIFT} examples/train/multimodal/rlhf/dpo/lora.sh @20ec461 (# 4 * 50GiB)", "low", 50.0,
           Mapping("", excluded="RLAIF-V's image sizes and chosen / rejected lengths are not stated (MAX_PIXELS "
                                "allows up to 1,280 vision tokens an image, max_length 4096); --rpo_alpha 0.1 adds "
                                "TRL's NLL term on the chosen logits, which is not modelled; the comment's 4 GPUs "
                                "disagree with the script's 2")),
    VlmRow("V8", "blog.gitcode.com 'Qwen2.5-VL ... 显存优化实践' (LoRA about 26 GB, full about 80 GB)", "low", 26.0,
           Mapping("", excluded="no batch, resolution, sequence or framework given")),
    VlmRow("V9", "kaitchup.substack.com 'Fine-Tune Llama 3.2 Vision, Pixtral, and Qwen2-VL ... with Unsloth' "
                 "(12 GB minimum)", "low", 12.0,
           Mapping("", excluded="a minimum GPU requirement ('The minimum GPU requirement is 12 GB'), not a "
                                "measurement: the post's text gives no model, batch, images or sequence for it")),
]


def run_vlm() -> dict[str, Any]:
    out = []
    for row in VLM_ROWS:
        m = row.mapping
        if m.excluded:
            out.append({"id": row.id, "source": row.source, "trust": row.trust, "excluded": m.excluded})
            continue
        value, r = ours(m)
        published = row.published_gib * GiB
        out.append({"id": row.id, "source": row.source, "trust": row.trust, "model": m.model, "level": m.level,
                    "published_gib": row.published_gib, "ours_gib": value / GiB,
                    "error": (value - published) / published, "note": m.note, "setup": r.setup.resolved()})
    used = [r for r in out if "error" in r]
    return {"rows": out, "compared": len(used), "excluded": len(out) - len(used),
            "median_abs": statistics.median(abs(r["error"]) for r in used) if used else None}


def spec_of(mid: str) -> ModelSpec:
    if mid in VLM_CONFIGS:  # a vision-language model traced whole from its config
        from vramlab.core.sources.hf_config import hf_config_to_spec

        return hf_config_to_spec(VLM_CONFIGS[mid], id=mid, name=mid)[0]
    return EXTRA.get(mid) or find_model(mid)


def ours(m: Mapping) -> tuple[int, MemoryResult]:
    spec = spec_of(m.model)
    setup = TrainingSetup(**m.setup)
    r = estimate(spec, setup, allocator=True)
    if m.level == "reserved_over_load":
        load = next(p.bytes for p in r.phases if p.key == "load")
        return r.peak_reserved_bytes - load, r
    return getattr(r, LEVELS[m.level]), r


def rules(m: Mapping, r: MemoryResult) -> dict[str, float]:
    """The common rules of thumb, in bytes per GPU (no sharding, no checkpointing subtleties)."""
    spec, s = r.model, r.setup
    p, trainable = r.total_params, r.trainable_params
    weights = r.components.get(Kind.WEIGHTS, 0)
    frozen = p - (trainable if s.method.value in ("full", "freeze") else 0)
    base = weights if s.method.value != "full" else 0
    h, L, a = spec.hidden_size, spec.num_layers, spec.num_heads
    b, seq = s.micro_batch, s.seq_len
    if s.grad_ckpt:
        act = L * 2 * seq * b * h
    else:  # Korthikanti et al. 2022, 16-bit, per layer: s*b*h*(34 + 5*a*s/h)
        act = L * seq * b * h * (34 + (5 * a * seq / h if s.attention.value == "eager" else 0))
    n = 18 * trainable + act + (base if s.method.value != "full" else 0) + 2 * (frozen if s.method.value == "freeze"
                                                                               else 0)
    return {
        "18B_per_param_plus_activations": n / m.divide if m.divide == 1 else n,
        "accelerate_model_size_x4": 4 * (weights or 2 * p),
        "flat_16B_per_param": 16 * p,
    }


def run(csv_path: Path) -> dict[str, Any]:
    rows = list(csv.DictReader(csv_path.open()))
    out = []
    for row in rows:
        m = MAP.get(row["id"])
        published = float(row["value_GiB_per_gpu"]) * GiB / (MAP[row["id"]].divide if m else 1)
        if m is None or m.excluded:
            out.append({"id": row["id"], "source": row["source_group"], "trust": row["trust"],
                        "excluded": m.excluded if m else "no mapping"})
            continue
        value, r = ours(m)
        rule = rules(m, r)
        out.append({
            "id": row["id"], "source": row["source_group"], "trust": row["trust"], "model": m.model,
            "level": m.level, "published_gib": published / GiB, "ours_gib": value / GiB,
            "error": (value - published) / published, "note": m.note,
            "rules_error": {k: (v - published) / published for k, v in rule.items()},
            "setup": r.setup.resolved(),
        })
    return {"rows": out, "summary": summarize(out)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    used = [r for r in rows if "error" in r]

    def stats(xs: list[float]) -> dict[str, float]:
        return {"n": len(xs), "median_abs": statistics.median(abs(x) for x in xs) if xs else 0.0,
                "worst_abs": max((abs(x) for x in xs), default=0.0)}

    by_trust = {t: stats([r["error"] for r in used if r["trust"] == t]) for t in ("high", "medium", "low")}
    by_source = {}
    for src in sorted({r["source"] for r in used}):
        by_source[src] = stats([r["error"] for r in used if r["source"] == src])
    rules_by_trust = {}
    for name in ("18B_per_param_plus_activations", "accelerate_model_size_x4", "flat_16B_per_param"):
        rules_by_trust[name] = {t: stats([r["rules_error"][name] for r in used if r["trust"] == t])
                                for t in ("high", "medium", "low")}
    return {"ours_by_trust": by_trust, "ours_by_source": by_source, "rules_by_trust": rules_by_trust,
            "excluded": len(rows) - len(used), "compared": len(used)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    args = ap.parse_args()
    data = run(args.csv)
    for r in data["rows"]:
        if "excluded" in r:
            print(f"{r['id']:5s} excluded: {r['excluded']}")
            continue
        rule = " ".join(f"{v:+6.0%}" for v in r["rules_error"].values())
        print(f"{r['id']:5s} {r['trust']:6s} {r['model']:22s} {r['level']:18s} published {r['published_gib']:7.2f} "
              f"ours {r['ours_gib']:7.2f} GiB  {r['error']:+7.1%}   rules {rule}  {r['note'][:50]}")
    s = data["summary"]
    print()
    for t, v in s["ours_by_trust"].items():
        rr = "  ".join(f"{k.split('_')[0]} {s['rules_by_trust'][k][t]['median_abs']:.1%}" for k in s["rules_by_trust"])
        print(f"{t:6s} n={v['n']:2d}  ours median {v['median_abs']:.1%} worst {v['worst_abs']:.1%}   rules: {rr}")
    for src, v in s["ours_by_source"].items():
        print(f"  {src[:55]:55s} n={v['n']:2d} median {v['median_abs']:.1%} worst {v['worst_abs']:.1%}")
    data["vlm"] = run_vlm()
    print("\nVision-language models:")
    for r in data["vlm"]["rows"]:
        if "excluded" in r:
            print(f"{r['id']:5s} excluded: {r['excluded']}")
        else:
            print(f"{r['id']:5s} {r['trust']:6s} {r['model']:22s} {r['level']:18s} published {r['published_gib']:7.2f} "
                  f"ours {r['ours_gib']:7.2f} GiB  {r['error']:+7.1%}  {r['note'][:60]}")
    print(record("published", data))


if __name__ == "__main__":
    main()
