"""axolotl's YAML config (its schema's defaults: :mod:`.defaults`)."""

from __future__ import annotations

from collections.abc import Mapping

from vramlab.core.sources import defaults as D
from vramlab.core.sources import hub_kernels
from vramlab.core.sources.keys import (
    liger_kernels_note,
    read_ckpt_mode,
    read_liger,
    read_lora_targets,
    read_lora_variants,
    read_optimizer,
    read_precision,
)
from vramlab.core.sources.launchers import follow_deepspeed
from vramlab.core.sources.mapping import ABSENT, DEFAULT, FRAMEWORKS, SET, ConfigFile
from vramlab.core.sources.trainer import read_trainer_fsdp
from vramlab.core.spec.liger import LIGER_KERNELS
from vramlab.core.spec.targets import parse_targets


def read_axolotl(f: ConfigFile) -> None:
    v = FRAMEWORKS["axolotl"][1]
    base = f.get("base_model")
    if isinstance(base, str):
        f.model = base
    adapter = f.get("adapter")
    q4, q8 = f.bool("load_in_4bit"), f.bool("load_in_8bit")
    if adapter is ABSENT or adapter == "":
        method = "full"
        f.default("adapter", "method", "full", note=f"{v}: no adapter is full fine-tuning")
    elif adapter in ("lora", "qlora"):
        method = "qlora" if adapter == "qlora" or q4 is True else "lora"
        f.put("adapter", "method", method)
    else:
        method = "full"
        f.refuse("adapter", "method", "is an adapter VRAM Lab does not model (lora, qlora)")
    quant = None
    if method == "qlora":
        quant = "nf4"
        f.row("load_in_4bit", f.get("load_in_4bit"), "weights", "nf4", SET if q4 is True else DEFAULT)
    elif q8 is True:
        quant = "int8"
        f.put("load_in_8bit", "weights", "int8")
    # bf16 "auto" (the schema's default): bf16 on a GPU that has it
    read_precision(f, method, quant, pure={"bfloat16": "bf16", "float16": "fp16"},
               bf16_default=D.AXOLOTL["bf16"] == "auto")
    if method in ("lora", "qlora"):
        f.default("adapter", "input_grads", True, note=f"{v} load_adapter: enable_input_require_grads, every adapter")
        r = f.int("lora_r")
        if r is ABSENT:  # axolotl passes None on to peft's LoraConfig
            f.default("lora_r", "lora_rank", D.PEFT_LORA["r"], note=f"{v}: none; peft's LoraConfig r")
        else:
            f.put("lora_r", "lora_rank", r)
        a = f.float("lora_alpha")
        if a is not ABSENT:
            f.put("lora_alpha", "lora_alpha", a)
        d = f.float("lora_dropout")
        f.take("lora_dropout", "lora_dropout", d, D.AXOLOTL["lora_dropout"])
        read_lora_variants(f, "peft_use_dora", "peft_use_rslora")
        if f.bool("lora_target_linear") is True:
            f.put("lora_target_linear", "lora_targets", parse_targets("all-linear"))
        elif f.has("lora_target_modules"):
            t = read_lora_targets(f, "lora_target_modules", f.get("lora_target_modules"))
            if t is not None:
                f.put("lora_target_modules", "lora_targets", t)
        f.not_modelled("lora_modules_to_save", note="extra fully-trained modules")
        f.not_modelled("peft_use_dora", "peft_use_rslora", note="DoRA / rsLoRA variants")
    f.take("micro_batch_size", "micro_batch", f.int("micro_batch_size"), D.AXOLOTL["micro_batch_size"])
    f.take("gradient_accumulation_steps", "grad_accum", f.int("gradient_accumulation_steps"),
           D.AXOLOTL["gradient_accumulation_steps"])
    sl = f.int("sequence_len")
    f.take("sequence_len", "seq_len", sl, D.AXOLOTL["sequence_len"], note=v)
    gc = f.get("gradient_checkpointing")
    if _read_offloading(f, v):
        pass  # transformers' checkpointing is off under axolotl's activation offloading on an adapter run
    elif gc is ABSENT:
        f.default("gradient_checkpointing", "grad_ckpt", bool(D.AXOLOTL["gradient_checkpointing"]),
                  note=f"{v}: off unless set")
    elif gc in ("offload", "offload_disk"):
        f.put("gradient_checkpointing", "grad_ckpt", True, note="checkpoints kept on the GPU in the model "
              f"(the {gc} variant, activation_offloading {'true' if gc == 'offload' else 'disk'} in {v}, off the "
              "GPU: not modelled" + (" for a full fine-tune)" if gc == "offload" else ")"))
    else:
        f.put("gradient_checkpointing", "grad_ckpt", f.bool("gradient_checkpointing"))
    # normalize_config (axolotl 0.19.0 utils/config): reentrant unless the kwargs say, parameters are unfrozen
    # by name or an RL trainer runs (whose builder passes use_reentrant False)
    plain = not f.has("unfrozen_parameters") and not f.has("rl")
    read_ckpt_mode(f, "gradient_checkpointing_kwargs.use_reentrant", plain,
               f"{v}: {'reentrant' if plain else 'non-reentrant with rl or unfrozen_parameters'}")
    if f.bool("eager_attention") is True:
        f.put("eager_attention", "attention", "eager")
    else:
        for key in ("flash_attention", "sdp_attention", "xformers_attention", "flex_attention"):
            if f.bool(key) is True:
                f.put(key, "attention", "sdpa", note="saves the output and the log-sum-exp, as SDPA")
                break
    read_optimizer(f, "optimizer", D.AXOLOTL["optimizer"], v)
    if f.bool("chunked_cross_entropy") is True:
        f.put("chunked_cross_entropy", "chunked_loss", True)
    f.not_modelled("sample_packing", "pad_to_sequence_len", note="packing / padding to full length")
    f.not_modelled("unfrozen_parameters", note="selective freezing by name")
    if f.bool("cut_cross_entropy") is True:  # axolotl's CutCrossEntropyPlugin: cce_patch on the model's forward
        f.put("cut_cross_entropy", "loss_kernel", "cce", note="lm_head and the loss without logits")
    # axolotl's LigerPlugin: apply_liger_kernel_to_<family>(fused_linear_cross_entropy=..., rms_norm=..., ...)
    read_liger(f, "liger_fused_linear_cross_entropy", True, note="axolotl's LigerPlugin", kernels=())
    _read_liger_kernels(f)
    hub_kernels.read_axolotl(f)
    f.not_modelled("liger_layer_norm", "liger_use_token_scaling", note="Liger's other kernels")
    f.not_modelled("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", note="fused LoRA kernels")
    for key in _UNSLOTH_KEYS:  # axolotl 0.19.0's check_deprecated_unsloth_fields refuses the config
        if f.bool(key) is True:
            f.refuse(key, "unsloth_kernels", "has been removed from axolotl (0.19.0 refuses the config): use "
                     "lora_mlp_kernel, lora_qkv_kernel, lora_o_kernel")
    f.not_modelled("torch_compile", "tensor_parallel_size", "context_parallel_size",
                   "sequence_parallel_degree")
    follow_deepspeed(f, "deepspeed")
    fsdp = f.get("fsdp")
    fsdp_config = f.get("fsdp_config")
    if fsdp is not ABSENT or (isinstance(fsdp_config, Mapping) and fsdp_config):
        read_trainer_fsdp(f, fsdp, "fsdp")


# removed from axolotl's schema (utils/schemas/validation.py check_deprecated_unsloth_fields)
_UNSLOTH_KEYS = ("unsloth_cross_entropy_loss", "unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o",
                 "unsloth_rms_norm", "unsloth_rope")

# axolotl's LigerPlugin: each kernel off unless its key is true (liger_swiglu: the older name of the GLU switch)
_LIGER_KEYS = (("liger_rms_norm", "rms_norm"), ("liger_glu_activation", "glu"), ("liger_swiglu", "glu"),
               ("liger_cross_entropy", "cross_entropy"), ("liger_layer_norm", "layer_norm"), ("liger_rope", "rope"))


def _read_offloading(f: ConfigFile, v: str) -> bool:
    """axolotl's ``activation_offloading: true`` (``gradient_checkpointing: offload`` is its deprecated alias in
    0.19.0's config validation) on an adapter run: TRL's hooks with axolotl's patches, transformers' checkpointing
    off (``_configure_gradient_checkpointing``). Its full fine-tune (torch's checkpoint_wrapper around the layers) and
    the ``legacy`` (no CUDA streams), ``disk`` and ``hidden_states`` modes are not modelled. Returns whether it
    was read as on."""
    ao = f.get("activation_offloading")
    key = "activation_offloading"
    if ao is ABSENT and f.get("gradient_checkpointing") == "offload":
        ao, key = True, "gradient_checkpointing"
    if ao in (ABSENT, None, False):
        return False
    if ao is not True:
        f.not_modelled("activation_offloading", note=f"the {ao} mode")
        return False
    if f.get("adapter") in (ABSENT, None):
        f.not_modelled(key, note="activation offloading on a full fine-tune (torch's checkpoint_wrapper around the "
                       "layers beside TRL's hooks)")
        return False
    f.put(key, "offload_activations", "axolotl", note=f"{v}: TRL 1.16.0's hooks with axolotl's patches")
    gc_key = "gradient_checkpointing" if f.has("gradient_checkpointing") else key
    f.put(gc_key, "grad_ckpt", False, note=f"{v} turns transformers' checkpointing off: TRL's hooks replace the "
          "recompute")
    return True


def _read_liger_kernels(f: ConfigFile) -> None:
    on = [(key, kernel) for key, kernel in _LIGER_KEYS if f.bool(key) is True]
    kernels = tuple(k for k in LIGER_KERNELS if k in {kernel for _, kernel in on})
    for key, _ in on:
        f.put(key, "liger_kernels", list(kernels), note=f"axolotl's LigerPlugin: {liger_kernels_note(kernels)}")
