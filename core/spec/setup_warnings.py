"""What an estimate says of a setup beside its numbers (``TrainingSetup.warnings``): the combinations whose step
the estimate models with a stated difference from the user's run, or that change nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.spec.liger import liger_patch, vision_rope_note
from vramlab.core.spec.options import (
    NO_REFERENCE_OBJECTIVES,
    Attention,
    DType,
    GenerationBackend,
    LossKernel,
    Method,
    Objective,
    Sharding,
)
from vramlab.core.spec.targets import MLP_TARGETS
from vramlab.core.spec.unsloth import unsloth_note
from vramlab.core.spec.unsloth_gc import unsloth_gc_note

if TYPE_CHECKING:
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup


def setup_warnings(setup: TrainingSetup, model: ModelSpec) -> list[str]:
    out = []
    if setup.uses_lora:
        groups = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
        for fused, parts in groups:
            named = [p for p in parts if p in setup.lora_targets]
            if named and len(named) < len(parts) and fused in model.lora_modules(named):
                name = "c_attn" if model.learned_positions and fused == "qkv_proj" else fused  # GPT-2's Conv1D
                out.append(f"{model.name} fuses {', '.join(parts)} into {fused}: LoRA on {', '.join(named)} "
                           f"adapts the whole {fused} (peft needs the name {name})")
    if (setup.objective is not Objective.SFT and setup.autocast and setup.grad_ckpt
            and setup.weight_dtype.is_float and setup.weight_dtype.itemsize > setup.compute.itemsize):
        out.append(f"--objective {setup.objective.value} under autocast with checkpointing: autocast's weight "
                   "cache over the objective's forwards is not modelled (CUDA holds each checkpointed layer's "
                   f"{setup.compute.value} copy of its trainable {setup.weight_dtype.value} weights to the end of "
                   "each forward: 1.94 GB for TinyLlama's SFT, modelled there); this estimate leaves them out")
    if (setup.uses_lora and model.is_moe and model.tape != "traced" and not model.transformers_config
            and any(t in MLP_TARGETS for t in setup.lora_targets)):
        out.append(f"{model.name} is a mixture of experts: with MLP modules targeted, peft adapts its experts' "
                   "fused weight tensors (Mixtral, Qwen3-MoE) or none of them (Qwen1.5/2-MoE), which the "
                   "hand-written program does not model (47 % low for Mixtral with LoRA on all linear layers, "
                   "benchmarks/results/architectures_traced.json); with torch, transformers and peft installed "
                   "(pip install 'vramlab[hf]') an SFT recipe without sharding is estimated from a trace of "
                   "transformers' and peft's own step instead")
    liger_unused = setup.loss_kernel is LossKernel.LIGER and setup.objective in NO_REFERENCE_OBJECTIVES
    if setup.objective is not Objective.SFT and (setup.loss_kernel is LossKernel.CCE or setup.chunked_loss
                                                or liger_unused):
        what = ("Cut Cross Entropy's patch of the model's forward never computes a loss"
                if setup.loss_kernel is LossKernel.CCE else "Liger's patched forward computes the logits (its "
                "fused loss runs only with labels)" if liger_unused else "a chunked SFT loss (--chunked-loss) "
                "has no place")
        out.append(f"--objective {setup.objective.value}: TRL 1.16.0 scores the tokens through its own fused LM "
                   "head, in tiles (DPO, KTO, GRPO: add_fused_lm_head runs the backbone, then its head) or asks "
                   f"the model for logits without labels (ORPO, CPO), so {what}: this estimate is the "
                   "objective's step without it")
    if setup.liger_kernels and liger_patch(model, setup.liger_kernels) is None:
        out.append(f"liger-kernel 0.8.5 patches no {model.family or model.name} model: --liger-kernels changes "
                   "nothing here, as liger leaves such a model as transformers builds it")
    if setup.liger_kernels and (note := vision_rope_note(model, setup.liger_kernels)) is not None:
        out.append(note)
    if (note := unsloth_note(model, setup)) is not None:
        out.append(note)
    if (note := unsloth_gc_note(setup)) is not None:
        out.append(note)
    if setup.seq_len > model.max_position_embeddings:
        out.append(
            f"sequence {setup.seq_len} is longer than {model.name}'s {model.max_position_embeddings} "
            "positions (needs RoPE scaling)"
        )
    if setup.sharding is not Sharding.NONE and setup.gpus < 2:
        out.append(f"{setup.sharding.value} over 1 GPU divides nothing; set --gpus")
    if setup.gpus > 1 and setup.sharding is Sharding.NONE:
        out.append(f"{setup.gpus} GPUs without sharding: data parallel, every GPU holds a full replica")
    if setup.compute is DType.FP16 and not setup.autocast and not setup.weight_dtype.is_quantized \
            and setup.method in (Method.FULL, Method.FREEZE):
        out.append("pure fp16 training without master weights is numerically fragile")
    if model.vision is not None and model.vision.rules is not None:
        out += model.vision.rules.setup_notes(model, setup)  # what the estimate says of the family
    if setup.objective is Objective.GRPO and setup.generation_backend is GenerationBackend.VLLM_COLOCATE:
        out.append(f"vLLM colocated takes {setup.vllm_memory_fraction:g} of the GPU's memory on the device "
                   "level (included when a GPU is given); its generation is not on the tensor level")
    if model.attention_run(setup.attention) is not setup.attention:
        out.append(f"{model.name} softcaps its attention logits, which SDPA cannot: transformers runs eager "
                   "attention for it (heads x seq x seq scores per layer), and so does this estimate")
    if setup.attention is Attention.EAGER and model.attn_logit_softcap == 0 and setup.seq_len >= 4096:
        out.append("eager attention materialises heads x seq x seq scores per layer; sdpa saves them")
    return out
