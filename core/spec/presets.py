"""The precision presets: named bundles of method and precision settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import DType, Method
from vramlab.core.spec.training import TrainingSetup


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

