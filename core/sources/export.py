"""The current setup written out as a training-framework config, so that the run launched is the run planned:
an axolotl YAML, a LLaMA-Factory YAML, a TRL ``SFTConfig`` YAML (for ``trl sft --config``, with the same
settings as a Python ``SFTConfig`` + peft ``LoraConfig`` snippet in its header) and a DeepSpeed JSON.

Reading an exported file back (:func:`vramlab.core.sources.training.read_training_configs`) gives the same
setup: the keys written are the ones the reader maps, and a setting a framework cannot express (an optimizer
it lacks, pure fp16 in LLaMA-Factory, ...) is refused with a :class:`~vramlab.core.checks.SetupError` naming
it, never written approximately. The number of GPUs is the launcher's (``accelerate launch
--num_processes``, ``torchrun --nproc_per_node``), named in a comment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.fileio import write_atomic
from vramlab.core.sources.trl_peft import adapter_dtype as trl_adapter_dtype
from vramlab.core.spec.liger import LIGER_DEFAULT
from vramlab.core.spec.options import DType, Method, Offload, Optimizer, OptimizerImpl, Sharding
from vramlab.core.spec.targets import parse_targets
from vramlab.core.spec.training import TrainingSetup

__all__ = ["EXPORT_FORMATS", "Exported", "export_setup", "model_name_for", "write_exported"]

# format id -> (what it is, file name of the main file)
EXPORT_FORMATS: Mapping[str, tuple[str, str]] = {
    "axolotl": ("axolotl YAML", "axolotl.yaml"),
    "llamafactory": ("LLaMA-Factory YAML", "llamafactory.yaml"),
    "trl": ("TRL SFTConfig + peft LoraConfig", "trl_sft.yaml"),
    "deepspeed": ("DeepSpeed JSON", "deepspeed.json"),
}
DEEPSPEED_FILE = "deepspeed.json"


@dataclass(frozen=True)
class Exported:
    """The files of one export: file name -> text (the main file first; a DeepSpeed JSON beside it when the
    setup uses ZeRO)."""

    format: str
    files: dict[str, str]

    @property
    def main(self) -> str:
        return next(iter(self.files))


def _refuse(fmt: str, what: str) -> SetupError:
    return SetupError(f"{EXPORT_FORMATS[fmt][0]} cannot express {what}; change it or export another format")


# (optimizer, implementation) -> HF TrainingArguments `optim` (the inverse of the reader's table)
_HF_OPTIM = {
    (Optimizer.ADAMW, OptimizerImpl.FOREACH): "adamw_torch",
    (Optimizer.ADAMW, OptimizerImpl.FUSED): "adamw_torch_fused",
    (Optimizer.ADAMW_8BIT, None): "adamw_bnb_8bit", (Optimizer.PAGED_ADAMW_8BIT, None): "paged_adamw_8bit",
    (Optimizer.SGD, OptimizerImpl.FOREACH): "sgd", (Optimizer.ADAFACTOR, OptimizerImpl.SINGLE): "adafactor",
    (Optimizer.LION, OptimizerImpl.SINGLE): "lion_32bit",
    (Optimizer.PAGED_ADAMW_32BIT, None): "paged_adamw_32bit", (Optimizer.TORCHAO_ADAMW_8BIT, None): "adamw_torch_8bit",
    (Optimizer.TORCHAO_ADAMW_4BIT, None): "adamw_torch_4bit",
}


def _optim(fmt: str, s: TrainingSetup) -> str:
    impl = s.impl if s.optimizer.has_impl_choice else None
    name = _HF_OPTIM.get((s.optimizer, impl))
    if name is None:
        what = f"the optimizer {s.optimizer.value}" + (f" ({impl.value})" if impl else "")
        raise _refuse(fmt, what)
    return name


_ADAPTERS = ("TRL 1.16's trainers keep them in bf16 on a quantized base, in the weights' dtype under ZeRO-3, "
             "else fp32", "peft keeps them in fp32")


def _adapter_dtype(fmt: str, s: TrainingSetup) -> DType | None:
    """The LoRA weights' dtype the format's trainer leaves (TRL's: SFTTrainer's rule in core/sources/trl_peft.py,
    the export writing SFT runs only); None where it leaves a mix VRAM Lab does not model."""
    if fmt != "trl":
        return DType.FP32
    dtype = trl_adapter_dtype("trl", quantized=s.weight_dtype.is_quantized, zero3=s.sharding is Sharding.ZERO3,
                              weights=s.weight_dtype.value, dora=s.use_dora)
    return None if dtype is None else DType(dtype)


def _common_refusals(fmt: str, s: TrainingSetup) -> None:
    if s.master_weights:
        raise _refuse(fmt, "a separate fp32 master copy (HF trainers keep none; DeepSpeed's bf16 optimizer does)")
    if s.optimizer_in_backward:
        raise _refuse(fmt, "an optimizer step inside backward")
    if not s.loss_fp32:
        raise _refuse(fmt, "a loss kept in bf16 (HF trainers upcast logits to fp32)")
    if s.loss_kernel.value == "cce" and fmt != "axolotl":
        raise _refuse(fmt, "Cut Cross Entropy (axolotl's cut_cross_entropy plugin)")
    if s.loss_kernel.value == "trl" and fmt != "trl":
        raise _refuse(fmt, "TRL's fused LM head (TRL's SFTTrainer)")
    if s.offloads_activations and fmt != s.offload_activations.value:  # each runs its own
        raise _refuse(fmt, f"activation offloading as {s.offload_activations.value} runs it")
    if s.ckpt_offload and fmt != "llamafactory":  # axolotl's legacy offloading adds TRL's hooks (not modelled)
        raise _refuse(fmt, "offloaded checkpointing alone (LLaMA-Factory's use_unsloth_gc)")
    # axolotl's LigerPlugin sets each Liger kernel; LLaMA-Factory's enable_liger_kernel the whole patch (TRL's
    # use_liger_kernel is read as not modelled)
    whole = fmt == "llamafactory" and s.loss_kernel.value == "liger" and s.liger_kernels == LIGER_DEFAULT
    if (s.loss_kernel.value == "liger" or s.liger_kernels) and fmt != "axolotl" and not whole:
        raise _refuse(fmt, "Liger's kernels one by one (axolotl's LigerPlugin; LLaMA-Factory's enable_liger_kernel "
                      "is its fused linear cross-entropy, RMSNorm, GLU and RoPE kernels together: --loss-kernel liger "
                      "--liger-kernels all)")
    if s.unsloth_kernels or (s.unsloth_gc and s.grad_ckpt):  # use_unsloth is them all at once, its fused loss too
        raise _refuse(fmt, "Unsloth's kernels or checkpointing (LLaMA-Factory's use_unsloth runs them with Unsloth's "
                      "fused loss; axolotl 0.19.0 has no unsloth keys)")
    adapters = _adapter_dtype(fmt, s) if s.uses_lora else None
    if s.uses_lora and adapters is None:
        raise _refuse(fmt, "DoRA on a quantized base (TRL 1.16's trainers cast the LoRA weights to bf16 and keep the "
                      "DoRA magnitude in fp32)")
    if s.uses_lora and s.adapter_dtype is not adapters:
        raise _refuse(fmt, f"LoRA weights in {s.adapter_dtype.value} ({_ADAPTERS[fmt != 'trl']})")
    if (fmt == "trl" and s.uses_lora and s.sharding is Sharding.ZERO3 and s.grad_ckpt
            and not s.ckpt_reentrant):
        raise _refuse(fmt, "non-reentrant checkpointing of a peft model under ZeRO-3 (TRL 1.16 forces reentrant)")
    if s.kbit_upcast:
        raise _refuse(fmt, "prepare_model_for_kbit_training's fp32 upcast")
    if s.quant_block != 64:
        raise _refuse(fmt, f"an nf4 block size of {s.quant_block}")
    if s.trainable_fp32 and fmt != "llamafactory":
        raise _refuse(fmt, "fp32 trainable parameters beside 16-bit frozen ones (LLaMA-Factory's upcast)")
    if s.method is Method.FREEZE and fmt != "llamafactory":
        raise _refuse(fmt, "training only the last layers (freeze)")
    if s.vision_tuning != "frozen" and fmt != "llamafactory":
        raise _refuse(fmt, "a trained or adapted vision tower or projector (LLaMA-Factory's freeze_vision_tower / "
                      "freeze_multi_modal_projector)")
    w = s.weight_dtype
    if w is DType.NF4 and s.method is not Method.QLORA:
        raise _refuse(fmt, "an nf4 base without QLoRA")
    if w is DType.INT8 and s.method is not Method.LORA:
        raise _refuse(fmt, "an int8 base outside LoRA")


_TORCH_DTYPE = {DType.BF16: "bfloat16", DType.FP16: "float16", DType.FP32: "float32"}


def _precision_keys(fmt: str, s: TrainingSetup) -> dict[str, Any]:
    """The precision keys whose reading gives back this setup's weights, compute dtype and autocast."""
    w, c, auto = s.weight_dtype, s.compute, s.autocast
    quant = w.is_quantized
    full = s.method in (Method.FULL, Method.FREEZE)
    if c is DType.BF16 and auto and (quant or w is DType.BF16):
        return {"bf16": True}
    if c is DType.FP16 and auto and (w is DType.FP32 if full else (quant or w is DType.FP16)):
        return {"fp16": True}
    if c is DType.FP32 and (quant or w is DType.FP32):
        # axolotl's schema defaults bf16 to "auto" and TRL's configs to bf16: both must say fp32 outright
        return {"bf16": False, "fp16": False} if fmt in ("trl", "axolotl") else {}
    if not auto and (quant or w is c) and c in (DType.BF16, DType.FP16):
        if fmt == "axolotl":
            return {"bf16": False, "bfloat16" if c is DType.BF16 else "float16": True}
        if fmt == "llamafactory" and c is DType.BF16:
            return {"pure_bf16": True}
        if fmt == "trl":  # the load dtype (also bitsandbytes' compute dtype) without bf16/fp16 autocast
            return {"bf16": False, "fp16": False, "dtype": _TORCH_DTYPE[c]}
    if fmt == "trl" and auto and not quant and w is DType.FP32 and c is DType.BF16:
        return {"bf16": True, "dtype": "float32"}
    raise _refuse(fmt, f"{w.value} weights with {c.value} compute {'under' if auto else 'without'} autocast")


def _deepspeed(s: TrainingSetup, *, beside_trainer: bool = False) -> dict[str, Any]:
    """DeepSpeed's config. Beside a trainer's YAML the values the trainer also sets are ``"auto"`` (HF's
    integration refuses two explicit values that differ), so the trainer's keys decide them."""
    stage = {Sharding.NONE: 0, Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3}.get(s.sharding)
    if stage is None:
        raise _refuse("deepspeed", f"{s.sharding.value} sharding (FSDP is not DeepSpeed)")
    zero: dict[str, Any] = {"stage": stage}
    if s.offload is not Offload.NONE:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if s.offload is Offload.PARAMS:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    out: dict[str, Any] = {"zero_optimization": zero}
    if beside_trainer:
        return out | {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    out["bf16"] = {"enabled": s.compute is DType.BF16}
    out["fp16"] = {"enabled": s.compute is DType.FP16}
    out["train_micro_batch_size_per_gpu"] = s.micro_batch
    out["gradient_accumulation_steps"] = s.grad_accum
    return out


def _targets(s: TrainingSetup) -> list[str]:
    return list(s.lora_targets)


def _axolotl(s: TrainingSetup, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {"base_model": model}
    if s.uses_lora:
        out["adapter"] = s.method.value
        if s.method is Method.QLORA:
            if not s.double_quant:
                raise _refuse("axolotl", "nf4 without double quantization (axolotl always double-quantizes)")
            out["load_in_4bit"] = True
        elif s.weight_dtype is DType.INT8:
            out["load_in_8bit"] = True
        out |= {"lora_r": s.lora_rank, "lora_alpha": s.alpha, "lora_dropout": s.lora_dropout,
                "lora_target_modules": _targets(s)}
        out |= _variants(s, "peft_use_dora", "peft_use_rslora")
    out |= _precision_keys("axolotl", s)
    out |= {"sequence_len": s.seq_len, "micro_batch_size": s.micro_batch,
            "gradient_accumulation_steps": s.grad_accum, "gradient_checkpointing": s.grad_ckpt,
            "optimizer": _optim("axolotl", s)}
    if s.grad_ckpt:  # axolotl's own default is reentrant; say which the setup means
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": s.ckpt_reentrant}
    if s.offloads_activations:  # axolotl's own (checked in _common_refusals)
        out["activation_offloading"] = True
    out["eager_attention" if s.attention.value == "eager" else "sdp_attention"] = True
    if s.chunked_loss:
        if s.loss_chunks != 8:
            raise _refuse("axolotl", f"a loss in {s.loss_chunks} chunks")
        out["chunked_cross_entropy"] = True
    if s.loss_kernel.value == "cce":
        out["plugins"] = ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]
        out["cut_cross_entropy"] = True
    if s.loss_kernel.value == "liger" or s.liger_kernels:  # LigerPlugin: each kernel off unless set
        out["plugins"] = ["axolotl.integrations.liger.LigerPlugin"]
        keys = {"rms_norm": "liger_rms_norm", "glu": "liger_glu_activation", "cross_entropy": "liger_cross_entropy",
                "layer_norm": "liger_layer_norm"}
        out |= {keys[k]: True for k in s.liger_kernels}
        if s.loss_kernel.value == "liger":
            out["liger_fused_linear_cross_entropy"] = True
    if s.hub_kernels:  # axolotl passes use_kernels to from_pretrained only when set (its transformers: off)
        out["use_kernels"] = True
    _sharding(out, s, "axolotl")
    return out


def _variants(s: TrainingSetup, dora: str, rslora: str) -> dict[str, bool]:
    """peft's DoRA / rsLoRA switches under the framework's names, where the setup turns them on."""
    return {k: True for k, on in ((dora, s.use_dora), (rslora, s.use_rslora)) if on}


def _sharding(out: dict[str, Any], s: TrainingSetup, fmt: str) -> None:
    if s.sharding is Sharding.FSDP:
        if fmt == "llamafactory":
            raise _refuse(fmt, "FSDP (launch it with an accelerate FSDP config)")
        out["fsdp"] = ["full_shard", "auto_wrap"] + (["offload"] if s.offload is Offload.PARAMS else [])
        if s.offload is Offload.OPTIMIZER:
            raise _refuse(fmt, "FSDP with only the optimizer offloaded")
    elif s.sharding is not Sharding.NONE:
        out["deepspeed"] = DEEPSPEED_FILE


def _llamafactory(s: TrainingSetup, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model_name_or_path": model, "stage": "sft", "do_train": True,
                           "finetuning_type": "lora" if s.uses_lora else s.method.value}
    if s.method is Method.FREEZE:
        if s.trainable_layers is None:
            raise _refuse("llamafactory", "freeze without a number of trainable layers")
        out["freeze_trainable_layers"] = s.trainable_layers
        if s.freeze_extra:  # the Llama names; LLaMA-Factory checks them against the model's own
            out["freeze_extra_modules"] = ",".join(s.freeze_extra)
    if s.uses_lora:
        out |= {"lora_rank": s.lora_rank, "lora_alpha": s.alpha, "lora_dropout": s.lora_dropout,
                "lora_target": ",".join(_targets(s))}
        out |= _variants(s, "use_dora", "use_rslora")
        if s.method is Method.QLORA:
            out |= {"quantization_bit": 4, "quantization_method": "bitsandbytes",
                    "double_quantization": s.double_quant}
        elif s.weight_dtype is DType.INT8:
            out |= {"quantization_bit": 8, "quantization_method": "bitsandbytes"}
    out |= _llamafactory_vision(s)
    out |= _llamafactory_precision(s)
    if s.chunked_loss:
        raise _refuse("llamafactory", "a chunked loss")
    if s.liger_kernels:  # the family's whole patch (checked in _common_refusals)
        out["enable_liger_kernel"] = True
    out |= {"cutoff_len": s.seq_len, "per_device_train_batch_size": s.micro_batch,
            "gradient_accumulation_steps": s.grad_accum, "disable_gradient_checkpointing": not s.grad_ckpt,
            "flash_attn": "disabled" if s.attention.value == "eager" else "sdpa", "optim": _optim("llamafactory", s)}
    if s.grad_ckpt:
        out["use_reentrant_gc"] = s.ckpt_reentrant
    if s.ckpt_offload:
        out["use_unsloth_gc"] = True
    _sharding(out, s, "llamafactory")
    return out


def _llamafactory_vision(s: TrainingSetup) -> dict[str, Any]:
    """A multimodal model's tower and projector as LLaMA-Factory 0.9.5 frees them (both frozen by default): full
    and freeze train them whole, LoRA adapts every linear layer of the tower with ``lora_target: all``."""
    tune = s.vision_tuning
    if tune == "frozen":
        return {}
    if s.uses_lora:
        if tune != "lora" or s.lora_targets != parse_targets("all-linear"):
            raise _refuse("llamafactory", "a vision tower trained beside LoRA, or LoRA on the tower with named "
                          "targets (LLaMA-Factory's LoRA reaches the tower with lora_target: all)")
        return {"freeze_vision_tower": False, "lora_target": "all"}
    if tune == "lora":
        raise _refuse("llamafactory", "LoRA on the tower beside a trained language model")
    return {"freeze_multi_modal_projector": False} | ({"freeze_vision_tower": False} if tune == "full" else {})


def _llamafactory_precision(s: TrainingSetup) -> dict[str, Any]:
    """The precision keys under LLaMA-Factory 0.9.5's init_adapter, which upcasts the trainable parameters to fp32
    unless pure_bf16 or ZeRO-3 (core/sources/llamafactory.py): 16-bit weights trained under autocast need
    pure_bf16 beside bf16 off ZeRO-3; fp32 weights under bf16 autocast (full) and fp32 trained layers beside
    16-bit frozen ones (freeze, ``trainable_fp32``) are the plain bf16 / fp16 switch."""
    c, auto, zero3 = s.compute, s.autocast, s.sharding is Sharding.ZERO3
    if s.trainable_fp32:
        if s.method is Method.FREEZE and s.weight_dtype is c and c in (DType.BF16, DType.FP16) and not zero3:
            return {"bf16" if c is DType.BF16 else "fp16": True}
        raise _refuse("llamafactory", "--trainable-fp32 but in freeze on a 16-bit model (full fine-tuning upcasts "
                      "every weight: --weights fp32; LoRA's adapters are fp32 either way)")
    if s.method is Method.FULL and not zero3 and auto and s.weight_dtype is DType.FP32 and c is DType.BF16:
        return {"bf16": True}
    keys = _precision_keys("llamafactory", s)
    if s.method not in (Method.FULL, Method.FREEZE):
        return keys  # the adapters are fp32 with or without the upcast
    if keys.get("pure_bf16") and zero3:
        raise _refuse("llamafactory", "pure bf16 under ZeRO-3 (LLaMA-Factory refuses pure_bf16 with DeepSpeed ZeRO-3)")
    if zero3 or not auto:
        return keys
    if keys == {"bf16": True}:
        return keys | {"pure_bf16": True}  # bf16 weights under bf16 autocast: no upcast
    if s.method is Method.FREEZE:
        raise _refuse("llamafactory", "freeze with fp32 frozen layers under fp16 autocast (LLaMA-Factory upcasts "
                      "the trained layers and keeps the frozen ones in the load dtype: --weights fp16 "
                      "--trainable-fp32)")
    return keys


def _trl(s: TrainingSetup, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model_name_or_path": model}
    if s.uses_lora:
        out["use_peft"] = True
        if s.method is Method.QLORA:
            out |= {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": s.double_quant}
        elif s.weight_dtype is DType.INT8:
            out["load_in_8bit"] = True
        out |= {"lora_r": s.lora_rank, "lora_alpha": s.alpha, "lora_dropout": s.lora_dropout,
                "lora_target_modules": _targets(s)}
        out |= _variants(s, "use_dora", "use_rslora")
    # `trl sft` passes its ModelConfig (`dtype`, `attn_implementation`) to SFTConfig.model_init_kwargs; the
    # load dtype is written always (for a 4-bit base it is bitsandbytes' compute dtype)
    out |= _precision_keys("trl", s)
    out.setdefault("dtype", _TORCH_DTYPE[s.compute if s.weight_dtype.is_quantized else s.weight_dtype])
    out["attn_implementation"] = "eager" if s.attention.value == "eager" else "sdpa"
    if s.loss_kernel.value != "trl":  # SFTTrainer.compute_loss: nll / dft through its fused LM head, no logits
        what = "a chunked loss" if s.chunked_loss else f"the loss kernel {s.loss_kernel.value}"
        raise _refuse("trl", f"{what} (TRL 1.16's SFTTrainer computes its loss through its fused LM head: use "
                      "--loss-kernel trl)")
    out |= {"per_device_train_batch_size": s.micro_batch, "gradient_accumulation_steps": s.grad_accum,
            "gradient_checkpointing": s.grad_ckpt, "max_length": s.seq_len, "optim": _optim("trl", s),
            "loss_type": "nll"}
    if s.grad_ckpt and s.ckpt_reentrant:
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": True}
    if not s.hub_kernels:  # from_pretrained's own default is on (transformers >= 5.25)
        out["model_init_kwargs"] = {"use_kernels": False}
    if s.offloads_activations:
        out["activation_offloading"] = True
    _sharding(out, s, "trl")
    return out


def _trl_snippet(d: Mapping[str, Any]) -> str:
    """The same settings as Python, for a training script (a comment block; never executed by us)."""
    lora = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
            "target_modules": "lora_target_modules", **{k: k for k in ("use_dora", "use_rslora") if k in d}}
    sft = [k for k in ("bf16", "fp16", "per_device_train_batch_size", "gradient_accumulation_steps",
                       "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_offloading", "max_length",
                       "optim", "loss_type", "fsdp", "deepspeed") if k in d]
    init = {"dtype": d["dtype"], "attn_implementation": d["attn_implementation"], **d.get("model_init_kwargs", {})}
    lines = ["from trl import SFTConfig", "from peft import LoraConfig", "",
             "args = SFTConfig(", *[f"    {k}={d[k]!r}," for k in sft], f"    model_init_kwargs={init!r},", ")"]
    if d.get("use_peft"):
        lines += ["peft_config = LoraConfig(", *[f"    {k}={d[v]!r}," for k, v in lora.items()],
                  '    task_type="CAUSAL_LM",', ")"]
        if d.get("load_in_4bit"):
            lines += ["# and load the model with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                      f"bnb_4bit_use_double_quant={d.get('use_bnb_nested_quant')!r}, "
                      f"bnb_4bit_compute_dtype=torch.{d['dtype']})"]
    return "\n".join("# " + ln if ln else "#" for ln in lines)


def _yaml(data: Mapping[str, Any], header: str) -> str:
    import yaml

    return header + "\n" + yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False)


def export_setup(setup: TrainingSetup, fmt: str, *, model: str, gpus_note: bool = True) -> Exported:
    """``setup`` as ``fmt`` (a key of :data:`EXPORT_FORMATS`) for the model named ``model`` (a Hub id or a
    path, written as the framework's model key). Raises SetupError for a setting the format cannot express."""
    if fmt not in EXPORT_FORMATS:
        raise SetupError(f"unknown export format {fmt!r}; choose {', '.join(EXPORT_FORMATS)}")
    s = setup
    if s.objective.value != "sft" and fmt != "deepspeed":
        raise _refuse(fmt, f"the {s.objective.value} objective (the exported configs are SFT runs)")
    launch = (f"# launch on {s.gpus} GPUs (e.g. accelerate launch --num_processes {s.gpus}); the world size is "
              "the launcher's, not this file's\n") if gpus_note and s.gpus > 1 else ""
    head = f"# written by VRAM Lab: {EXPORT_FORMATS[fmt][0]}\n{launch}"
    if fmt == "deepspeed":
        return Exported(fmt, {DEEPSPEED_FILE: json.dumps(_deepspeed(s), indent=2) + "\n"})
    _common_refusals(fmt, s)
    if fmt == "llamafactory" and s.hub_kernels:
        head += ("# LLaMA-Factory 0.9.5 installs transformers <= 5.6.0, which loads models without the Hub kernels "
                 "(read back: --no-hub-kernels)\n")
    if fmt == "axolotl" and s.uses_lora and not s.input_grads and not s.grad_ckpt:
        head += ("# axolotl 0.19.0's load_adapter makes the embeddings' output require grad for every adapter "
                 "(read back: --input-grads)\n")
    data = {"axolotl": _axolotl, "llamafactory": _llamafactory, "trl": _trl}[fmt](s, model)
    if fmt == "trl":
        head += "# trl sft --config trl_sft.yaml  (the same settings in Python:)\n" + _trl_snippet(data) + "\n"
    files = {EXPORT_FORMATS[fmt][1]: _yaml(data, head)}
    if "deepspeed" in data:
        files[DEEPSPEED_FILE] = json.dumps(_deepspeed(s, beside_trainer=True), indent=2) + "\n"
    return Exported(fmt, files)


def model_name_for(given: str, *, preset_source: str | None = None) -> str:
    """The model as a framework config names it: for a preset, the Hub id its ``source`` names
    (``org/name config.json; ...``); otherwise what the user gave (a Hub id or a path)."""
    from vramlab.core.catalog import repo_of_source

    return repo_of_source(preset_source) or given


def write_exported(exported: Exported, folder: str | Path) -> list[Path]:
    """Write each file into ``folder`` through a temporary file and a rename (never a half-written config:
    :func:`~vramlab.core.fileio.write_atomic`)."""
    out = Path(folder).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        written = [write_atomic(out / name, text) for name, text in exported.files.items()]
        return written
    except OSError as e:
        raise SetupError(f"{out}: cannot write the exported config ({e.strerror or e})") from e
