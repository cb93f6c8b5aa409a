"""Key readers several dialects share: the optimizer (transformers' ``optim`` names), the precision, LoRA's
targets and variants, and the checkpointing mode."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources.mapping import ABSENT, FRAMEWORKS, SET, ConfigFile
from vramlab.core.spec.liger import LIGER_DEFAULT
from vramlab.core.spec.targets import parse_targets

# HF TrainingArguments `optim` names -> (optimizer, implementation): torch's AdamW and SGD take foreach on
# CUDA unless fused is asked for; transformers' Adafactor and bitsandbytes' 32-bit Lion step one tensor at a time.
HF_OPTIM: Mapping[str, tuple[str, str | None]] = {
    "adamw_torch": ("adamw", "foreach"), "adamw_torch_fused": ("adamw", "fused"),
    "adamw_bnb_8bit": ("adamw8bit", None), "adamw_8bit": ("adamw8bit", None),
    "paged_adamw_8bit": ("paged_adamw8bit", None),
    "sgd": ("sgd", "foreach"), "adafactor": ("adafactor", "single"),
    "lion_32bit": ("lion", "single"),
    # bitsandbytes' PagedAdamW32bit; torchao's AdamW8bit / AdamW4bit (transformers 5.25.0 trainer_optimizer.py), and
    # AdamWFp8 under axolotl 0.19.0's name (core/builders/base.py)
    "paged_adamw_32bit": ("paged_adamw_32bit", None), "adamw_torch_8bit": ("adamw_torch_8bit", None),
    "adamw_torch_4bit": ("adamw_torch_4bit", None), "ao_adamw_fp8": ("adamw_torchao_fp8", None),
}


def read_optimizer(f: ConfigFile, key: str, default: str | None, version: str) -> None:
    name = f.get(key)
    if name is ABSENT:
        if default is not None:
            opt, impl = HF_OPTIM[default]
            f.default(key, "optimizer", opt, note=f"{version}: {default}")
            if impl:
                f.default(key, "optimizer_impl", impl, note=f"{version}: {default}")
        return
    if not isinstance(name, str):
        raise f.fail(key, f"must be an optimizer name, got {name!r}")
    mapped = HF_OPTIM.get(name.strip().lower())
    if mapped is None:
        f.refuse(key, "optimizer", "is not an optimizer VRAM Lab models (adamw_torch, adamw_torch_fused, "
                 "adamw_bnb_8bit, paged_adamw_8bit, paged_adamw_32bit, adamw_torch_8bit, adamw_torch_4bit, "
                 "ao_adamw_fp8, sgd, adafactor, lion_32bit)")
        return
    f.put(key, "optimizer", mapped[0])
    if mapped[1]:
        f.put(key, "optimizer_impl", mapped[1])


DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                "float32": "fp32", "fp32": "fp32", "float": "fp32"}


def read_precision(f: ConfigFile, method: str, quant: str | None, *, pure: Mapping[str, str] | None = None,
               dtype_key: str | None = None, bf16_default: bool = False) -> None:
    """HF Trainer's precision switches as VRAM Lab's weight, compute and autocast facts.

    ``bf16: true`` trains under bf16 autocast on a bf16-loaded model; ``fp16: true`` under fp16 autocast with
    fp32 weights for full fine-tuning (GradScaler refuses fp16 gradients) and fp16 base weights for adapters;
    a "pure" key (axolotl ``bfloat16``/``float16``, LLaMA-Factory ``pure_bf16``) or a load dtype without an
    autocast switch (TRL ``model_init_kwargs.dtype``) trains in that dtype without autocast; nothing at all
    is fp32 training. A quantized base (``quant``) keeps its storage; the compute dtype still applies."""
    auto = f.get("bf16") == "auto"  # axolotl: bf16 when the GPU has it (every GPU since Ampere)
    bf16 = True if auto else f.bool("bf16")
    fp16 = f.bool("fp16")
    pure_on = [(k, dt) for k, dt in (pure or {}).items() if f.bool(k) is True]
    load = None
    if dtype_key and f.has(dtype_key):
        raw = f.get(dtype_key)
        load = DTYPE_NAMES.get(str(raw).lower()) if isinstance(raw, str) else None
        if load is None and raw != "auto":
            raise f.fail(dtype_key, f"must be bfloat16, float16 or float32, got {raw!r}")
    explicit = bf16 is not ABSENT or fp16 is not ABSENT or bool(pure_on) or load is not None
    use_bf16 = bf16 is True or (bf16 is ABSENT and fp16 is not True and not pure_on and bf16_default)
    use_fp16 = fp16 is True and not use_bf16
    note = "auto: bf16 on a GPU that has it" if auto else ""
    if use_bf16:
        key, compute, amp = "bf16", "bf16", True
        weights = load or "bf16"
    elif use_fp16:
        key, compute, amp = "fp16", "fp16", True
        weights = load or ("fp32" if method in ("full", "freeze") else "fp16")
    elif pure_on:
        key, dt = pure_on[0]
        compute, weights, amp = dt, dt, False
    elif load is not None:
        key, compute, weights, amp = dtype_key, load, load, False
    else:
        key, compute, weights, amp = ("bf16" if f.has("bf16") else "fp16"), "fp32", "fp32", False
        note = "no bf16/fp16: fp32 training"
    if load is not None and key != dtype_key and weights == load and quant is None:
        f.put(dtype_key, "weights", weights)
    add = (lambda fld, val: f.put(key, fld, val, note=note)) if explicit else \
        (lambda fld, val: f.default(key, fld, val, note=f"{FRAMEWORKS[f.framework][1]}: bf16"))
    add("compute", compute)
    if quant is None and not (load is not None and key != dtype_key):
        add("weights", weights)
    add("amp", amp)


def read_nf4(f: ConfigFile, key: str, type_key: str, double_key: str, double_default: bool, note: str) -> str:
    """A 4-bit load as bitsandbytes makes it (``key`` asks for it): nf4, the one 4-bit type modelled (``type_key``
    names another: refused), and its double quantization (``double_key``, the framework's default beside it)."""
    if f.get(type_key) not in (ABSENT, "nf4"):
        f.refuse(type_key, "weights", "is a 4-bit type VRAM Lab does not model (nf4)")
    f.put(key, "weights", "nf4")
    f.take(double_key, "double_quant", f.bool(double_key), double_default, note=note)
    return "nf4"


def read_lora_targets(f: ConfigFile, key: str, value: Any) -> tuple[str, ...] | None:
    try:
        if isinstance(value, str):
            return parse_targets(value)
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            return parse_targets(value)
    except SetupError as e:
        f.refuse(key, "lora_targets", f"names modules VRAM Lab does not model ({e})")
        return None
    raise f.fail(key, f"must be a list of module names, got {value!r}")


def read_lora_variants(f: ConfigFile, dora_key: str, rslora_key: str, note: str = "") -> None:
    """peft's ``use_dora`` / ``use_rslora`` under the framework's key (every framework passes them to LoraConfig,
    default False): DoRA is modelled; rsLoRA changes only the scaling, so no tensor."""
    for key, fld in ((dora_key, "use_dora"), (rslora_key, "use_rslora")):
        v = f.bool(key)
        if v is not ABSENT and v is not None:
            f.put(key, fld, v, note=note)


def read_ckpt_mode(f: ConfigFile, key: str, default: bool, note: str) -> None:
    """Which torch.utils.checkpoint the framework asks for (``use_reentrant``), from ``key`` or its default."""
    parent = key.rpartition(".")[0]
    if parent and f.has(parent) and isinstance(f.get(parent), str):  # TrainingArguments takes the dict as JSON
        try:
            parsed = json.loads(f.get(parent))
        except ValueError:
            raise f.fail(parent, "must be a mapping such as {\"use_reentrant\": false}") from None
        if isinstance(parsed, Mapping) and isinstance(parsed.get("use_reentrant"), bool):
            f.row(key, parsed["use_reentrant"], "ckpt_reentrant", parsed["use_reentrant"], SET)
            return
    f.take(key, "ckpt_reentrant", f.bool(key), default, note=note)


def read_liger(f: ConfigFile, key: str, fused: bool, note: str, kernels: tuple[str, ...] = LIGER_DEFAULT,
               unmodelled_ce: bool = False) -> None:
    """A switch that turns Liger Kernel on (liger-kernel 0.8.5's patch for the model's family): with ``fused`` (the
    framework asks for its fused linear cross-entropy) that is ``--loss-kernel liger``; ``kernels``, the other
    kernels the patch swaps in that are modelled (its RMSNorm, its SwiGLU / GeGLU MLP, its plain cross-entropy, its
    RoPE), are ``--liger-kernels``. With ``unmodelled_ce``, a cross-entropy outside transformers' own loss is not
    modelled: the note says so."""
    if f.bool(key) is not True:
        return
    left = "its cross-entropy is not modelled (the stage's loss is not transformers' own)" if unmodelled_ce else ""
    if fused:
        f.put(key, "loss_kernel", "liger", note=f"{note}: its fused linear cross-entropy where liger patches the "
              "model's family (Llama, Mistral, Qwen, Gemma, Phi-3 and more; Granite and families it does not patch "
              "keep transformers' loss: give --loss-kernel hf)" + (f"; {left}" if left else ""))
    if kernels:
        f.put(key, "liger_kernels", list(kernels), note=f"{note}: {liger_kernels_note(kernels)}"
              + ("" if fused else "; no fused linear cross-entropy" + (f"; {left}" if left else "")))
    elif not fused:
        f.not_modelled(key, note=f"{note}: no fused linear cross-entropy" + (f"; {left}" if left else ""))


def liger_kernels_note(kernels: tuple[str, ...]) -> str:
    names = {"rms_norm": "RMSNorm", "glu": "SwiGLU / GeGLU MLP", "cross_entropy": "cross-entropy",
             "layer_norm": "LayerNorm", "rope": "RoPE"}
    return (f"Liger's {' and '.join(names[k] for k in kernels)} where liger-kernel 0.8.5 patches the model's "
            "family (nothing where it does not)")
