"""LLaMA-Factory's YAML config (its argument classes' defaults: :mod:`.defaults`), freeze tuning included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources import defaults as D
from vramlab.core.sources import hub_kernels
from vramlab.core.sources.keys import read_liger, read_lora_targets, read_lora_variants, read_nf4, read_precision
from vramlab.core.sources.launchers import follow_deepspeed
from vramlab.core.sources.mapping import (
    ABSENT,
    DEFAULT,
    FRAMEWORKS,
    NOT_MODELLED,
    SET,
    ConfigFile,
    Mapped,
    replace_row,
)
from vramlab.core.sources.trainer import read_trainer_common
from vramlab.core.spec.targets import parse_targets
from vramlab.core.spec.unsloth import UNSLOTH_DEFAULT


def read_llamafactory(f: ConfigFile) -> None:
    v = FRAMEWORKS["llamafactory"][1]
    m = f.get("model_name_or_path")
    if isinstance(m, str):
        f.model = m
    ft = f.get("finetuning_type")
    qbit = f.int("quantization_bit")
    if ft is ABSENT:
        ft = D.LLAMAFACTORY_FINETUNING["finetuning_type"]
        method_status = DEFAULT
    else:
        method_status = SET
    if ft not in ("lora", "full", "freeze"):
        f.refuse("finetuning_type", "method", "is not a method VRAM Lab models (lora, full, freeze)")
        ft = "full"
    method = "qlora" if ft == "lora" and qbit == 4 else ft
    f.row("finetuning_type", None if method_status == DEFAULT else f.get("finetuning_type"), "method", method,
          method_status, note=f"{v}: lora" if method_status == DEFAULT else "")
    quant = None
    if qbit is not ABSENT:
        qm = f.get("quantization_method")
        if qm not in (ABSENT, "bitsandbytes", "bnb"):
            f.refuse("quantization_method", "weights", "is a quantization VRAM Lab does not model (bitsandbytes)")
        elif qbit == 4:
            quant = read_nf4(f, "quantization_bit", "quantization_type", "double_quantization",
                             D.LLAMAFACTORY_MODEL["double_quantization"], note=v)
        elif qbit == 8:
            quant = "int8"
            f.put("quantization_bit", "weights", "int8")
        else:
            f.refuse("quantization_bit", "weights", "is a bit width VRAM Lab does not model (4, 8)")
    read_precision(f, method, quant, pure={"pure_bf16": "bf16"})
    _upcast_trainable(f, method, quantized=qbit is not ABSENT)
    if method in ("lora", "qlora"):
        r = f.int("lora_rank")
        f.take("lora_rank", "lora_rank", r, D.LLAMAFACTORY_FINETUNING["lora_rank"], note=v)
        a = f.float("lora_alpha")
        if a is not ABSENT:
            f.put("lora_alpha", "lora_alpha", a)
        else:  # FinetuningArguments.__post_init__: lora_alpha = lora_alpha or lora_rank * 2
            rank = D.LLAMAFACTORY_FINETUNING["lora_rank"] if r is ABSENT else r
            f.default("lora_alpha", "lora_alpha", float(rank * 2), note=f"{v}: lora_rank x 2")
        d = f.float("lora_dropout")
        f.take("lora_dropout", "lora_dropout", d, D.LLAMAFACTORY_FINETUNING["lora_dropout"])
        read_lora_variants(f, "use_dora", "use_rslora")
        t = f.get("lora_target")
        if t is ABSENT:
            assert D.LLAMAFACTORY_FINETUNING["lora_target"] == "all"
            f.default("lora_target", "lora_targets", parse_targets("all-linear"), note=f"{v}: all")
        else:
            targets = read_lora_targets(f, "lora_target", t)
            if targets is not None:
                f.put("lora_target", "lora_targets", targets)
        f.not_modelled("additional_target", note="extra fully-trained modules")
        f.not_modelled("use_dora", "use_rslora", "pissa_init", "loraplus_lr_ratio", note="LoRA variants")
    elif method == "freeze":
        _llamafactory_freeze(f, v)
    _vision(f, method, lora_all=f.get("lora_target") in (ABSENT, "all"))
    read_trainer_common(f, v, ckpt_default=True)
    hub_kernels.read_llamafactory(f)
    cl = f.int("cutoff_len")
    f.take("cutoff_len", "seq_len", cl, D.LLAMAFACTORY_DATA["cutoff_len"], note=v)
    fa = f.get("flash_attn")
    if fa is not ABSENT:
        f.put("flash_attn", "attention", "eager" if str(fa).lower() == "disabled" else "sdpa")
    f.not_modelled("packing", "neat_packing", note="packing")
    f.not_modelled("use_galore", "use_apollo", "use_badam", "use_adam_mini", "use_muon", note="optimizer variant")
    # apply_liger_kernel (0.9.5): the family's patch with its defaults (RMSNorm, SwiGLU / GeGLU, RoPE on); the fused
    # linear cross-entropy only where the stage needs no logits (pt, sft), else liger's cross-entropy
    stage = f.get("stage")
    logits = stage not in (ABSENT, "pt", "sft")
    read_liger(f, "enable_liger_kernel", not logits, note=f"{v}, stage {stage or 'sft'}", unmodelled_ce=logits)
    if f.bool("use_unsloth") is True:  # model_utils/unsloth.py: FastLanguageModel.get_peft_model, fused LoRA kernels
        f.put("use_unsloth", "unsloth_kernels", list(UNSLOTH_DEFAULT),
              note="Unsloth's fused LoRA kernels, RMSNorm, RoPE, attention (xformers', k and v repeated to every "
                   "query head) and its forward's fused loss (chunks sized by the GPU's free memory)")
        # _get_unsloth_kwargs: use_gradient_checkpointing "unsloth"; LLaMA-Factory's own gradient_checkpointing_enable
        # then wraps torch's checkpoint, which unsloth has replaced (use_unsloth_gc puts its own function instead)
        if f.bool("disable_gradient_checkpointing") is not True and f.bool("use_unsloth_gc") is not True:
            f.put("use_unsloth", "unsloth_gc", True, note="Unsloth's checkpointing (use_gradient_checkpointing "
                  "\"unsloth\"): layer inputs over 2 MiB in host memory")
    f.not_modelled("upcast_layernorm", "upcast_lmhead_output")
    if f.get("stage") not in (ABSENT, "sft", "pt"):
        f.not_modelled("stage", note="a stage with a reference or reward model; the policy step is modelled")
    follow_deepspeed(f, "deepspeed")


def _vision(f: ConfigFile, method: str, lora_all: bool) -> None:
    """A multimodal model's tower and projector (LLaMA-Factory 0.9.5, ``get_forbidden_modules``,
    ``find_all_linear_modules``, ``patch_target_modules``): full and freeze train the tower unless
    ``freeze_vision_tower`` and the projector unless ``freeze_multi_modal_projector`` (both true by default); LoRA
    reaches the tower's linear layers when it is not frozen (``lora_target: all``: every one), never the projector
    (``find_all_linear_modules`` leaves it out). Read where a key is given; a text model ignores it."""
    F = D.LLAMAFACTORY_FINETUNING
    keys = ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model")
    if not any(f.has(k) for k in keys):
        return
    tower, projector = (F[k] if f.bool(k) is ABSENT else f.bool(k) for k in keys[:2])
    if f.bool("freeze_language_model") is True:
        f.refuse("freeze_language_model", "method", "(a frozen language model beside a trained tower) is not "
                 "modelled")
        return
    if method in ("full", "freeze"):
        if not tower and projector:
            f.refuse("freeze_vision_tower", "vision_tuning", "(the tower trained, its projector frozen) is not "
                     "modelled: VRAM Lab trains the projector with the tower")
        elif not tower:
            f.put("freeze_vision_tower", "vision_tuning", "full")
        elif not projector:
            f.put("freeze_multi_modal_projector", "vision_tuning", "projector")
        else:
            f.default("freeze_vision_tower", "vision_tuning", "frozen", note="LLaMA-Factory: tower and projector "
                      "frozen")
    elif not tower:
        if lora_all:
            f.put("freeze_vision_tower", "vision_tuning", "lora", note="LoRA on every linear layer of the tower")
        else:
            f.refuse("freeze_vision_tower", "vision_tuning", "with named lora_target modules adapts the tower's "
                     "modules of those names only, which is not modelled: use lora_target: all")
    if method not in ("full", "freeze") and not projector:
        f.row("freeze_multi_modal_projector", False, None, None, NOT_MODELLED, note="LoRA never reaches the "
              "projector (find_all_linear_modules leaves it out): it stays frozen")


# LLaMA-Factory's freeze_extra_modules name modules outside the layers by the model's own names; the roles
# VRAM Lab models (spec.FREEZE_EXTRAS) by the names transformers' decoders give them
_FREEZE_EXTRA_NAMES = {"embed_tokens": "embed_tokens", "wte": "embed_tokens", "word_embeddings": "embed_tokens",
                       "embed_in": "embed_tokens", "norm": "norm", "ln_f": "norm", "final_layernorm": "norm",
                       "norm_f": "norm", "lm_head": "lm_head", "embed_out": "lm_head"}


def _names(f: ConfigFile, key: str) -> list[str]:
    """A comma-separated string or a list of names (LLaMA-Factory's ``split_arg``)."""
    raw = f.get(key)
    if isinstance(raw, str):
        return [x.strip() for x in raw.split(",") if x.strip()]
    if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        return [x.strip() for x in raw]
    raise f.fail(key, f"must be module names separated by commas, got {raw!r}")


def _llamafactory_freeze(f: ConfigFile, v: str) -> None:
    """``_setup_freeze_tuning`` (LLaMA-Factory 0.9.5, model/adapter.py): the last ``freeze_trainable_layers``
    layers train (negative: the first ones), only their ``freeze_trainable_modules`` ("all"), and nothing
    outside the layers unless ``freeze_extra_modules`` names it."""
    raw = f.get("freeze_trainable_layers")
    if isinstance(raw, int) and not isinstance(raw, bool) and raw < 0:
        f.refuse("freeze_trainable_layers", "trainable_layers",
                 "trains the first layers (a negative count): VRAM Lab models the last N")
    else:
        f.take("freeze_trainable_layers", "trainable_layers", f.int("freeze_trainable_layers"),
               D.LLAMAFACTORY_FINETUNING["freeze_trainable_layers"], note=v)
    if f.has("freeze_trainable_modules") and _names(f, "freeze_trainable_modules") != ["all"]:
        f.not_modelled("freeze_trainable_modules", note="only some modules of the trained layers: modelled as all "
                       "of them (an overestimate)")
    if f.bool("use_llama_pro") is True:
        f.not_modelled("use_llama_pro", note="LLaMA Pro's expanded layers spread over the model: modelled as the "
                       "last N")
    if not f.has("freeze_extra_modules"):
        f.default("freeze_extra_modules", "freeze_extra", (),
                  note=f"{v}: none (embedding, final norm and head frozen)")
        return
    names = _names(f, "freeze_extra_modules")
    known = tuple(dict.fromkeys(_FREEZE_EXTRA_NAMES[n] for n in names if n in _FREEZE_EXTRA_NAMES))
    unknown = [n for n in names if n not in _FREEZE_EXTRA_NAMES]
    note = "LLaMA-Factory matches names as substrings: 'norm' also trains every layer's norms (not modelled)" \
        if "norm" in names else ""
    f.put("freeze_extra_modules", "freeze_extra", known, note=note)
    if unknown:
        f.row("freeze_extra_modules", unknown, None, None, NOT_MODELLED,
              note="modules VRAM Lab does not know by these names (it models the embedding, final norm and head)")


# ---- the trainable parameters' dtype ------------------------------------------------------------------------
# LLaMA-Factory 0.9.5 model/adapter.py, init_adapter: "cast trainable parameters to float32 if: 1. is_trainable and
# not pure_bf16 and not badam and quantization_bit is not None (qlora) 2. is_trainable and not pure_bf16 and not
# badam and not zero3 (zero3 already in fp32)", i.e. cast_trainable_params_to_fp32 unless finetuning_args.pure_bf16
# or finetuning_args.use_badam, or model_args.quantization_bit is None and is_deepspeed_zero3_enabled() (DeepSpeed's
# ZeRO-3 optimizer keeps its own fp32 master partitions). _setup_full_tuning then casts every parameter that is
# not forbidden (param.data.to(torch.float32)), _setup_freeze_tuning only the trainable layers' (the frozen ones
# keep the load dtype: model/loader.py load_model passes torch_dtype="auto", the checkpoint's dtype), and
# _setup_lora_tuning the parameters that require grad (the adapters, which peft's get_peft_model already keeps in
# fp32: autocast_adapter_dtype=True). The trainer runs HF's bf16 / fp16 autocast over it (training_args.bf16).
UPCAST = "LLaMA-Factory 0.9.5 init_adapter: trainable parameters upcast to fp32 (no pure_bf16, use_badam or ZeRO-3)"
ZERO3 = ("LLaMA-Factory 0.9.5 init_adapter: no fp32 upcast under DeepSpeed ZeRO-3 without quantization (DeepSpeed "
         "keeps the fp32 master copy)")
FROZEN = "LLaMA-Factory 0.9.5: the frozen layers keep the load dtype (init_adapter upcasts only the trainable ones)"


def _last(f: ConfigFile, fld: str) -> Any:
    """What this file's rows so far set ``fld`` to (``None`` if none)."""
    return next((r.setting for r in reversed(f.rows) if r.field == fld and r.status in (SET, DEFAULT)), None)


def _upcast_trainable(f: ConfigFile, method: str, *, quantized: bool) -> None:
    """init_adapter's fp32 upcast of the trainable parameters (see the rule above) on what read_precision read:
    full fine-tuning trains fp32 weights under the 16-bit autocast, freeze its trained layers in fp32 beside frozen
    16-bit ones (``trainable_fp32``); adapters are fp32 already. Under ZeRO-3 (known once the DeepSpeed JSON is
    read) without quantization the upcast is undone (:func:`_zero3_settle`)."""
    pure = f.bool("pure_bf16") is True
    if pure:
        f.settle.append(_pure_bf16_settle(f.path))
    if pure or f.bool("use_badam") is True:
        return
    weights, compute = _last(f, "weights"), _last(f, "compute")
    start = len(f.rows)
    if method == "full" and weights in ("bf16", "fp16"):
        f.put("finetuning_type", "weights", "fp32", note=UPCAST)
    elif method == "freeze" and _last(f, "amp") is True and compute in ("bf16", "fp16"):
        if weights != compute:  # fp16: HF Trainer's fp32 weights for full training; the frozen ones stay 16-bit
            f.put(compute, "weights", compute, note=FROZEN)
        f.put("finetuning_type", "trainable_fp32", True, note=UPCAST)
    added = f.rows[start:]
    if added and not quantized:
        f.settle.append(_zero3_settle(added))


def _zero3_settle(added: list[Mapped]):  # noqa: ANN202 - a ConfigFile.settle rule
    def settle(rows: list[Mapped], merged: Mapping[str, Any]) -> list[Mapped]:
        if merged.get("sharding") != "zero3":
            return rows
        ids = {id(r) for r in added}
        return [replace_row(r, field=None, setting=None, note=ZERO3) if id(r) in ids else r for r in rows]
    return settle


def _pure_bf16_settle(path: str):  # noqa: ANN202 - a ConfigFile.settle rule
    def settle(rows: list[Mapped], merged: Mapping[str, Any]) -> list[Mapped]:
        if merged.get("sharding") == "zero3":  # LLaMA-Factory 0.9.5 hparams/parser.py, get_train_args
            raise SetupError(f"{path}: pure_bf16: LLaMA-Factory 0.9.5 refuses it under DeepSpeed ZeRO-3 "
                             "(\"`pure_bf16` is incompatible with DeepSpeed ZeRO-3.\"): drop pure_bf16 or use ZeRO-2")
        return rows
    return settle
