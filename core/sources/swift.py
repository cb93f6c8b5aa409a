"""ms-swift's training arguments in: its YAML / JSON (``swift sft config.yaml``: the keys are the command line's
argument names) or the command line itself in a shell script (``NPROC_PER_NODE=2 swift sft --model ...
--tuner_type lora ...``), read as data (``yaml.safe_load``, ``shlex``; nothing is run).

Defaults are ms-swift 4.6.0's argument dataclasses (``SftArguments``: ``TunerArguments``, ``TrainArgumentsMixin``,
``ModelArguments``, ``QuantizeArguments``, ``TemplateArguments``; ``RLHFArguments`` for ``swift rlhf``), kept in
:data:`.defaults.SWIFT` and held to those classes' source by tests/test_framework_defaults.py (ms-swift itself does
not import beside transformers 5.25 and TRL 1.x: it pins transformers < 5.20 and trl < 1.0).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources import defaults as D
from vramlab.core.sources import hub_kernels
from vramlab.core.sources.keys import read_ckpt_mode, read_lora_targets, read_lora_variants, read_nf4, read_optimizer
from vramlab.core.sources.launchers import follow_deepspeed
from vramlab.core.sources.mapping import ABSENT, DEFAULT, NOT_MODELLED, SET, ConfigFile
from vramlab.core.spec.targets import parse_targets

COMMANDS = ("sft", "rlhf", "pt")
# keys only ms-swift's arguments have (LLaMA-Factory shares `template`, TRL `padding_free`)
KEYS = {"tuner_type", "train_type", "rlhf_type", "quant_bits", "freeze_vit", "freeze_llm", "freeze_aligner",
        "attn_impl", "vit_gradient_checkpointing", "packing_length", "ENV", "target_modules_regex"}
# `swift rlhf --rlhf_type X` -> VRAM Lab's objective
OBJECTIVES = {"dpo": "dpo", "kto": "kto", "grpo": "grpo", "cpo": "cpo", "simpo": "simpo"}


def is_command(text: str) -> bool:
    """A shell script (or a line) that runs ``swift sft|rlhf|pt``."""
    try:
        tokens = shlex.split(_joined(text), comments=True)
    except ValueError:
        return False
    return any(t == "swift" and i + 1 < len(tokens) and tokens[i + 1] in COMMANDS for i, t in enumerate(tokens))


def _joined(text: str) -> str:
    """Lines continued with a backslash as one line (what the shell does before it splits words)."""
    return text.replace("\\\r\n", " ").replace("\\\n", " ")


def parse_command(text: str, path: str) -> dict[str, Any]:
    """``[ENV=...] swift sft|rlhf --key value [value ...] ...`` as the dict ms-swift's ``parse_args`` makes of it:
    ``--key`` with several values is a list, with none ``true``; ``ENV`` holds the environment given before it; the
    command is kept under ``_command``. Lines joined by a backslash are one command; the first swift command is read."""
    try:
        tokens = shlex.split(_joined(text), comments=True)
    except ValueError as e:
        raise SetupError(f"{path}: not a shell command line ms-swift's would be ({e})") from e
    at = next(i for i, t in enumerate(tokens) if t == "swift" and i + 1 < len(tokens) and tokens[i + 1] in COMMANDS)
    env = {}
    for t in reversed(tokens[:at]):
        if "=" not in t or t.startswith("-"):
            break
        k, _, v = t.partition("=")
        env[k] = v
    out: dict[str, Any] = {"_command": tokens[at + 1]}
    if env:
        out["ENV"] = env
    key = None
    for t in tokens[at + 2:]:
        if t in ("&&", ";", "|", "||", "&"):
            break
        if t.startswith("--"):
            key = t[2:].replace("-", "_") if t[2:].startswith("-") else t[2:]
            out[key] = True
            continue
        if key is None:
            continue  # a positional argument (a YAML given to the command is read with --config)
        value = _scalar(t)
        prev = out[key]
        out[key] = value if prev is True else (prev + [value] if isinstance(prev, list) else [prev, value])
    return out


def _scalar(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def read(f: ConfigFile) -> None:
    v = f"ms-swift {D.VERSIONS['ms-swift']}"
    S = D.SWIFT
    model = f.get("model")
    if isinstance(model, str):
        f.model = model
    env = f.get("ENV")
    env = env if isinstance(env, Mapping) else {}
    gpus = _gpus(f, env)
    # the method: tuner_type (train_type before ms-swift 4)
    key = "tuner_type" if f.has("tuner_type") or not f.has("train_type") else "train_type"
    tuner = f.get(key)
    tuner = S["tuner_type"] if tuner is ABSENT else str(tuner)
    qbits, qmethod = f.get("quant_bits"), f.get("quant_method")
    quant = None
    if qbits is not ABSENT and qmethod is ABSENT:
        f.row("quant_bits", qbits, None, None, NOT_MODELLED, note="without quant_method ms-swift loads the model "
              "unquantized (quant_method bnb quantizes)")
    elif qbits is not ABSENT:
        if qmethod not in ("bnb", "bitsandbytes"):
            f.refuse("quant_method", "weights", "is a quantization VRAM Lab does not model (bnb)")
        elif qbits == 4:
            quant = read_nf4(f, "quant_bits", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                             S["bnb_4bit_use_double_quant"], note=v)
        elif qbits == 8:
            quant = "int8"
            f.put("quant_bits", "weights", "int8")
        else:
            f.refuse("quant_bits", "weights", "is a bit width VRAM Lab does not model (4, 8)")
    if tuner not in ("lora", "full"):
        f.refuse(key, "method", "is a tuner VRAM Lab does not model (lora, full)")
        tuner = "full"
    method = "qlora" if tuner == "lora" and quant == "nf4" else tuner
    f.row(key, f.get(key) if f.has(key) else None, "method", method, SET if f.has(key) else DEFAULT,
          note="" if f.has(key) else f"{v}: {S['tuner_type']}")
    _precision(f, method, quant, v)
    if method in ("lora", "qlora"):
        f.take("lora_rank", "lora_rank", f.int("lora_rank"), S["lora_rank"], note=v)
        f.take("lora_alpha", "lora_alpha", f.float("lora_alpha"), float(S["lora_alpha"]), note=v)
        f.take("lora_dropout", "lora_dropout", f.float("lora_dropout"), S["lora_dropout"], note=v)
        t = f.get("target_modules")
        if t is ABSENT:
            f.default("target_modules", "lora_targets", parse_targets(",".join(S["target_modules"])), note=v)
        else:
            names = [t] if isinstance(t, str) else t
            special = [n for n in names if isinstance(n, str) and n.startswith("all-") and n != "all-linear"]
            if special:
                f.row("target_modules", special, None, None, NOT_MODELLED, note="ms-swift's all-embedding / "
                      "all-router targets")
                names = [n for n in names if n not in special] or ["all-linear"]
            targets = read_lora_targets(f, "target_modules", names)
            if targets is not None:
                f.put("target_modules", "lora_targets", targets)
        read_lora_variants(f, "use_dora", "use_rslora", note=v)
        f.not_modelled("lora_bias", note="LoRA variants")
        f.not_modelled("modules_to_save", "target_modules_regex", note="modules by pattern or fully trained")
    _vision(f, method, v)
    mb = f.int("per_device_train_batch_size")
    f.take("per_device_train_batch_size", "micro_batch", mb, S["per_device_train_batch_size"], note=v)
    mb = S["per_device_train_batch_size"] if mb is ABSENT else mb
    ga = f.int("gradient_accumulation_steps")
    if ga is ABSENT:  # TrainArgumentsMixin.__post_init__: 16 sequences per step across the processes
        f.default("gradient_accumulation_steps", "grad_accum", max(1, math.ceil(16 / mb / gpus)),
                  note=f"{v}: ceil(16 / batch / processes)")
    else:
        f.put("gradient_accumulation_steps", "grad_accum", ga)
    ml = f.int("max_length")
    if ml is ABSENT:
        f.refuse("max_length", "seq_len", "(absent): ms-swift then takes the model's max_model_len, which is "
                 "rarely the length trained; set max_length or give --seq")
    elif _rlhf_type(f) == "grpo":  # the prompt's length; the completion comes on top
        c = f.int("max_completion_length")
        f.put("max_length", "seq_len", ml + (D.SWIFT_RLHF["max_completion_length"] if c is ABSENT else c),
              note="prompt + completion")
    else:
        f.put("max_length", "seq_len", ml)
    gc = f.bool("gradient_checkpointing")
    f.take("gradient_checkpointing", "grad_ckpt", gc, S["gradient_checkpointing"], note=v)
    vgc = f.bool("vit_gradient_checkpointing")
    if vgc is not ABSENT:
        f.put("vit_gradient_checkpointing", "vision_ckpt", vgc)
    # SwiftMixin._fix_gradient_checkpointing: reentrant unless the kwargs say, or DDP without DeepSpeed / FSDP
    ddp = gpus > 1 and not f.has("deepspeed") and not f.has("fsdp")
    read_ckpt_mode(f, "gradient_checkpointing_kwargs.use_reentrant", not ddp,
               f"{v}: {'non-reentrant under DDP' if ddp else 'reentrant'}")
    read_optimizer(f, "optim", S["optim"], v)
    attn = f.get("attn_impl")
    if attn is not ABSENT:
        f.put("attn_impl", "attention", "eager" if str(attn).lower() == "eager" else "sdpa")
    _deepspeed(f)
    if gpus > 1:
        f.row("ENV.NPROC_PER_NODE", env.get("NPROC_PER_NODE"), "gpus", gpus, SET)
    _objective(f, v)
    f.not_modelled("packing", "padding_free", note="packing / padding-free batches")
    hub_kernels.read_swift(f)
    f.not_modelled("use_liger_kernel", "freeze_parameters", "freeze_parameters_ratio", "trainable_parameters",
                   "use_galore", "lisa_activated_layers", "sequence_parallel_size", "fsdp")


def _rlhf_type(f: ConfigFile) -> str | None:
    """The RLHF type of ``swift rlhf`` (or of a config with an ``rlhf_type``), None for sft / pt."""
    if f.get("_command") != "rlhf" and not f.has("rlhf_type"):
        return None
    return str(f.get("rlhf_type")) if f.has("rlhf_type") else D.SWIFT_RLHF["rlhf_type"]


def _gpus(f: ConfigFile, env: Mapping[str, Any]) -> int:
    n = env.get("NPROC_PER_NODE")
    try:
        return max(1, int(n)) if n is not None else 1
    except (TypeError, ValueError):
        raise f.fail("ENV.NPROC_PER_NODE", f"must be a whole number, got {n!r}") from None


_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}


def _precision(f: ConfigFile, method: str, quant: str | None, v: str) -> None:
    """``torch_dtype`` (absent: the model's config dtype, bfloat16 assumed) and ModelArguments
    ``_init_mixed_precision``: bf16 autocast on a bfloat16 model, fp16 autocast on a float16 or float32 one, each
    only where its switch (``bf16`` / ``fp16``) is left unset; both off trains in the load dtype."""
    raw = f.get("torch_dtype")
    if raw is ABSENT:
        dtype = "bf16"
        if quant is None:
            f.default("torch_dtype", "weights", dtype, note=f"{v}: the model's config.json dtype (bfloat16 assumed)")
    else:
        dtype = _DTYPES.get(str(raw).lower())
        if dtype is None:
            raise f.fail("torch_dtype", f"must be bfloat16, float16 or float32, got {raw!r}")
        if quant is None:
            f.put("torch_dtype", "weights", dtype)
    bf16, fp16 = f.bool("bf16"), f.bool("fp16")
    # only a switch left unset takes the dtype's autocast: bf16: false on a float32 model still gets fp16's
    if bf16 is True or (bf16 is ABSENT and dtype == "bf16"):
        compute, key, amp = "bf16", "bf16" if bf16 is True else "torch_dtype", True
    elif fp16 is True or (fp16 is ABSENT and dtype != "bf16"):
        compute, key, amp = "fp16", "fp16" if fp16 is True else "torch_dtype", True
    else:  # both off: training in the load dtype
        compute, key, amp = dtype, "fp16" if f.has("fp16") else "bf16", False
    put = f.put if f.has(key) else (lambda k, fld, val: f.default(k, fld, val, note=f"{v}: autocast in the "
                                                                   "model's dtype"))
    put(key, "compute", compute)
    put(key, "amp", amp)


def _vision(f: ConfigFile, method: str, v: str) -> None:
    """freeze_vit / freeze_aligner / freeze_llm (TunerArguments): the tower and projector of a VLM."""
    S = D.SWIFT
    vit = f.bool("freeze_vit")
    aligner = f.bool("freeze_aligner")
    vit = S["freeze_vit"] if vit is ABSENT else vit
    aligner = S["freeze_aligner"] if aligner is ABSENT else aligner
    if f.bool("freeze_llm") is True:
        f.row("freeze_llm", True, None, None, NOT_MODELLED, note="a frozen language model")
    if not vit:
        f.put("freeze_vit", "vision_tuning", "full" if method == "full" else "lora")
    elif not aligner:
        if method == "full":
            f.put("freeze_aligner", "vision_tuning", "projector")
        else:
            f.row("freeze_aligner", False, None, None, NOT_MODELLED, note="LoRA on the aligner")
    else:
        f.default("freeze_vit", "vision_tuning", "frozen", note=f"{v}: tower and aligner frozen")


_ZERO = {"zero0": ("none", "none"), "zero1": ("zero1", "none"), "zero2": ("zero2", "none"),
         "zero3": ("zero3", "none"), "zero2_offload": ("zero2", "optimizer"), "zero3_offload": ("zero3", "params")}


def _deepspeed(f: ConfigFile) -> None:
    """``--deepspeed zero2`` etc. name ms-swift's own configs (swift/config/*.json); a path is read as DeepSpeed."""
    ds = f.get("deepspeed")
    if ds is ABSENT:
        return
    if isinstance(ds, str) and ds in _ZERO:
        sharding, offload = _ZERO[ds]
        f.put("deepspeed", "sharding", sharding, note="ms-swift's own config (swift/config)")
        f.put("deepspeed", "offload", offload)
        # its bf16 "auto" optimizer keeps fp32 masters: ZeRO's at every stage (TrainingSetup.has_master_copy
        # counts them), BF16_Optimizer's at stage 0
        f.put("deepspeed", "master_weights", True, note="DeepSpeed 0.19 keeps fp32 master weights of 16-bit "
              "trainable ones (ZeRO's partitions, or BF16_Optimizer at stage 0)")
        return
    follow_deepspeed(f, "deepspeed")


def _objective(f: ConfigFile, v: str) -> None:
    """``swift rlhf`` (or an ``rlhf_type`` key): RLHFArguments' objective and its settings."""
    S = D.SWIFT_RLHF
    kind = _rlhf_type(f)
    if kind is None:
        return
    objective = OBJECTIVES.get(kind)
    if objective is None:
        f.refuse("rlhf_type", "objective", f"is an RLHF type VRAM Lab does not model ({', '.join(OBJECTIVES)})")
        return
    if f.has("rlhf_type"):
        f.put("rlhf_type", "objective", objective)
    else:
        f.default("rlhf_type", "objective", objective, note=f"{v}: {S['rlhf_type']}")
    beta = f.float("beta")
    if beta is not ABSENT:
        f.put("beta", "beta", beta)
    elif objective == "grpo":  # RLHFArguments._init_grpo: 0.04 when unset
        f.default("beta", "beta", 0.04, note=f"{v}: GRPO 0.04")
    if objective == "grpo":
        c = f.int("max_completion_length")
        f.take("max_completion_length", "completion_len", c, S["max_completion_length"], note=v)
        f.take("num_generations", "num_generations", f.int("num_generations"), S["num_generations"], note=v)
        if f.bool("use_vllm") is True:
            mode = f.get("vllm_mode")
            f.put("vllm_mode" if mode is not ABSENT else "use_vllm", "generation_backend",
                  "vllm-server" if mode == "server" else "vllm-colocate")
    elif f.int("max_completion_length") is not ABSENT:
        f.not_modelled("max_completion_length", note="padding: every row is full length")
