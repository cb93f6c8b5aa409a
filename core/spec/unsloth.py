"""Unsloth's fused LoRA kernels (``TrainingSetup.unsloth_kernels``): what unsloth 2026.10.9's
``FastLlamaModel.patch_peft_model`` (``unsloth/models/llama.py``) swaps in after peft's ``get_peft_model``, as
``FastLanguageModel.get_peft_model`` and LLaMA-Factory's ``use_unsloth`` run it.

* ``lora_mlp``: ``LoRA_MLP`` (``unsloth/kernels/fast_lora.py``) in place of the MLP's forward, where gate_proj,
  up_proj and down_proj all carry an adapter: the gate and up projections' outputs and the input are saved, the
  activation's output is not (backward recomputes it); SwiGLU for Llama / Mistral / Qwen 2 / Qwen 3, GeGLU (tanh)
  for Gemma 1 / 2, the same tensors;
* ``lora_qkv``: ``LoRA_QKV`` in place of the q, k and v projections, where all three carry an adapter and none a
  bias (Qwen 2's q / k / v have one: peft's own layers run there): the input saved once for the three;
* ``lora_o``: ``LoRA_W`` in place of o_proj.

Each saves the adapters' weights and its input, never peft's fp32 copy of the input nor the low-rank
intermediates; its backward casts the adapters to the input's dtype and writes the input's gradient into the
saved input (``LoRA_MLP`` / ``LoRA_QKV``: ``inplace`` True). An NF4 base weight is dequantized into one scratch
buffer in forward (``use_global_buffer``) and into a fresh tensor in backward.

The families: ``FastLanguageModel.from_pretrained`` dispatches Llama, Mistral, Gemma 1 / 2, Qwen 2 and Qwen 3 to
its ``Fast*Model`` classes; every other type goes to ``FastModel``, which compiles transformers' own code and puts
none of these kernels in (refused here, with that reason). Not modelled, refused where they would run: lora_dropout
above 0 (the kernels' own dropout path, ``UNSLOTH_FUSED_LORA_DROPOUT``), an int8 base, LoRA-FA. Unsloth falls back
to peft's own layers (the option changes nothing) with DoRA, a float32 base, or FSDP (``fsdp_will_wrap``).
Unsloth's own attention forward, RMSNorm, RoPE and cross-entropy kernels that ``FastLanguageModel`` patches in
besides are not modelled (docs/levels.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError, short_repr
from vramlab.core.spec.model import ModelSpec, NormKind

UNSLOTH_KERNELS = ("lora_mlp", "lora_qkv", "lora_o")
UNSLOTH_VERSION = "2026.10.9"


@dataclass(frozen=True)
class UnslothPatch:
    """The kernels unsloth's ``patch_peft_model`` installs on one model (each layer alike)."""

    mlp: bool  # LoRA_MLP on every layer's MLP
    qkv: bool  # LoRA_QKV on every layer's q / k / v
    o: bool  # LoRA_W on every layer's o_proj


def parse_unsloth_kernels(value: Any) -> tuple[str, ...]:
    """``unsloth_kernels`` as a setup holds it: some of :data:`UNSLOTH_KERNELS` in that order (a comma-separated
    string or a list; "all" for every one, "none" for none)."""
    if isinstance(value, str):
        text = value.strip().lower()
        value = () if text in ("", "none") else [x.strip() for x in text.split(",") if x.strip()]
    if isinstance(value, (list, tuple)) and "all" in value:
        value = UNSLOTH_KERNELS
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and x in UNSLOTH_KERNELS for x in value):
        raise SetupError(f"Unsloth kernels must be some of {', '.join(UNSLOTH_KERNELS)} (or all / none; got "
                         f"{short_repr(value)})")
    return tuple(k for k in UNSLOTH_KERNELS if k in value)


def _fast_family(spec: ModelSpec) -> bool:
    """Llama, Mistral, Qwen 2 / 3 and Gemma 1 / 2, told apart by their features (Gemma 3: q / k norms under the
    sandwich norms; Phi-3: fused projections; MoE; LayerNorm or parallel blocks; learned positions)."""
    if spec.is_moe or spec.fused_qkv or spec.fused_gate_up or spec.parallel_block or spec.learned_positions:
        return False
    if spec.norm_kind is NormKind.LAYERNORM or spec.shared_expert_intermediate_size:
        return False
    return not (spec.gemma_norm and spec.qk_norm)


def unsloth_patch(spec: ModelSpec, setup: Any) -> UnslothPatch | None:
    """What unsloth 2026.10.9 installs for ``setup`` on ``spec`` of the kernels asked for; None where it installs
    none (no LoRA, DoRA, a float32 base: peft's own layers run). Refuses what it runs that is not modelled."""
    kernels = setup.unsloth_kernels
    if not kernels:
        return None
    if spec.vision is not None or spec.transformers_config or not _fast_family(spec):
        raise SetupError(f"Unsloth's fused LoRA kernels come with its Llama, Mistral, Qwen 2 / 3 and Gemma 1 / 2 "
                         f"classes; unsloth {UNSLOTH_VERSION} loads {spec.name} through FastModel (transformers' "
                         "own code, compiled), which is not modelled: drop --unsloth-kernels")
    if not setup.uses_lora or setup.use_dora:
        return None
    w = setup.weight_dtype
    if w.value == "fp32":  # patch_peft_model's float32_base: "the fused kernels assume 16-bit base weights"
        return None
    if w.value == "int8":
        raise SetupError("Unsloth's fused LoRA kernels over an int8 base are not modelled: drop --unsloth-kernels")
    if setup.sharding.value != "none":
        raise SetupError("Unsloth's fused LoRA kernels under sharding are not modelled (unsloth declines them under "
                         "FSDP1, keeps them under FSDP2): drop --unsloth-kernels")
    if setup.lora_dropout > 0:
        raise SetupError("Unsloth's fused LoRA kernels with lora_dropout > 0 (their own dropout masks) are not "
                         "modelled: set --lora-dropout 0 or drop --unsloth-kernels")
    if setup.lora_fa:
        raise SetupError("Unsloth's fused LoRA kernels with LoRA-FA are not modelled: drop --unsloth-kernels")
    targets = set(spec.lora_modules(setup.lora_targets))
    mlp = "lora_mlp" in kernels and {"gate_proj", "up_proj", "down_proj"} <= targets and not spec.mlp_bias
    qkv = "lora_qkv" in kernels and {"q_proj", "k_proj", "v_proj"} <= targets and not spec.qkv_bias
    o = "lora_o" in kernels and "o_proj" in targets and not spec.o_bias
    if not (mlp or qkv or o):
        return None
    return UnslothPatch(mlp=mlp, qkv=qkv, o=o)


def unsloth_note(spec: ModelSpec, setup: Any) -> str | None:
    """A warning where ``--unsloth-kernels`` changes nothing (unsloth falls back to peft's own layers)."""
    if not setup.unsloth_kernels or unsloth_patch(spec, setup) is not None:
        return None
    return (f"unsloth {UNSLOTH_VERSION} installs none of its fused LoRA kernels here (they need LoRA on all of "
            "q / k / v, on o_proj or on all of gate / up / down, without DoRA, a bias or a float32 base): "
            "--unsloth-kernels changes nothing, as peft's own layers run")
