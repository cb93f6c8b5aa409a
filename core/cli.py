"""The headless command line: ``vramlab estimate|simulate|profile|fit|advise|compare|export|gpus`` (no Qt is
imported).

Bad flags, impossible setups and broken files exit with code 2 and one clear line on stderr; a run that
does not fit the GPU is a result, not an error (exit 0; ``--fail-if-oom`` makes it 3 for scripts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from vramlab.core import __version__
from vramlab.core.allocator import AllocatorConfig
from vramlab.core.checks import SetupError
from vramlab.core.report import fit_text, profile_text, render_table
from vramlab.core.result import MemoryResult
from vramlab.core.spec import (
    PRECISION_PRESETS,
    DType,
    GenerationBackend,
    LossKernel,
    Method,
    Objective,
    Offload,
    Optimizer,
    OptimizerImpl,
    Reference,
    Sharding,
    TrainingSetup,
    follow_changes,
    precision_preset,
)
from vramlab.core.units import fmt_bytes, fmt_count

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


class UsageError(Exception):
    """A bad flag or value: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _choices(enum: type) -> list[str]:
    return [e.value for e in enum]


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


MAX_STEPS = 100  # optimizer steps of a simulation or profile: the peak is reached in step 2


def _steps(text: str) -> int:
    n = _positive(text)
    if n > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{n:,} steps: give 1 to {MAX_STEPS} (the peak is reached in step 2)")
    return n


MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
    if not 0 < x <= MAX_TIMEOUT_S:  # also false for NaN
        raise argparse.ArgumentTypeError(f"{text[:40]} must be more than 0 and at most {MAX_TIMEOUT_S:.0f} seconds")
    return x


def add_setup_flags(p: argparse.ArgumentParser, gpu_required: bool = False) -> None:
    g = p.add_argument_group("setup")
    g.add_argument("--model", "-m", help="preset id, HF config.json, local model folder, or Hub id org/name[@rev] "
                   "(may come from --config)")
    g.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="a training config (axolotl, LLaMA-Factory, TRL / TrainingArguments, peft, DeepSpeed, "
                        "accelerate); repeatable; flags override it")
    g.add_argument("--preset", help=f"precision preset: {', '.join(x.id for x in PRECISION_PRESETS)}")
    g.add_argument("--method", choices=_choices(Method))
    g.add_argument("--weights", choices=_choices(DType), help="weight storage [bf16; nf4 for qlora]")
    g.add_argument("--compute", choices=["fp32", "bf16", "fp16"], help="compute dtype [bf16]")
    g.add_argument("--amp", dest="amp", action="store_true", default=None,
                   help="run under autocast (HF Trainer bf16=True); implied by fp32 weights with 16-bit compute")
    g.add_argument("--no-amp", dest="amp", action="store_false")
    g.add_argument("--master-weights", action="store_true", default=None,
                   help="fp32 master copy of 16-bit trainable weights in the optimizer")
    g.add_argument("--no-double-quant", dest="double_quant", action="store_false", default=None)
    g.add_argument("--kbit-prepare", dest="kbit_upcast", action="store_true", default=None,
                   help="peft prepare_model_for_kbit_training: embeddings, norms, lm_head upcast to fp32")
    g.add_argument("--adapter-dtype", choices=["fp32", "bf16", "fp16"], help="LoRA weight dtype [fp32]")
    g.add_argument("--optimizer", choices=_choices(Optimizer))
    g.add_argument("--optimizer-impl", choices=_choices(OptimizerImpl),
                   help="torch's implementation (default: what torch picks on CUDA, foreach)")
    g.add_argument("--lora-rank", type=int)
    g.add_argument("--lora-alpha", type=float)
    g.add_argument("--lora-dropout", type=float)
    g.add_argument("--lora-targets", help="q_proj,v_proj,... or all-linear")
    g.add_argument("--dora", dest="use_dora", action="store_true", default=None,
                   help="peft's DoRA (use_dora): a magnitude vector per adapted layer and its weight norm each step")
    g.add_argument("--rslora", dest="use_rslora", action="store_true", default=None,
                   help="peft's rsLoRA (use_rslora): scaling alpha / sqrt(rank); no memory of its own")
    g.add_argument("--lora-fa", dest="lora_fa", action="store_true", default=None,
                   help="LoRA-FA (peft's create_lorafa_optimizer): A frozen, B stepped by peft's LoraFAOptimizer")
    g.add_argument("--trainable-layers", type=int, help="freeze: train the last N layers")
    g.add_argument("--freeze-extra", metavar="MODULES",
                   help="freeze: also train some of embed_tokens,norm,lm_head (LLaMA-Factory's freeze_extra_modules) "
                        "[none]")
    g.add_argument("--batch", type=int, help="micro batch [1]")
    g.add_argument("--seq", type=int, help="sequence length [512]")
    g.add_argument("--grad-accum", type=int)
    g.add_argument("--grad-ckpt", action="store_true", default=None)
    g.add_argument("--grad-ckpt-reentrant", dest="ckpt_reentrant", action="store_true", default=None,
                   help="with --grad-ckpt, torch's reentrant checkpoint (transformers 5's default is non-reentrant)")
    g.add_argument("--attention", type=str.lower, choices=["sdpa", "eager", "flash", "flash_attention_2", "fa2"],
                   help="sdpa (flash, flash_attention_2 and fa2 name the same kernels) or eager [sdpa]")
    g.add_argument("--gpus", type=int)
    g.add_argument("--sharding", choices=_choices(Sharding))
    g.add_argument("--offload", choices=_choices(Offload))
    g.add_argument("--chunked-loss", action="store_true", default=None, help="lm_head + loss in chunks")
    g.add_argument("--loss-bf16", dest="loss_fp32", action="store_false", default=None,
                   help="cross entropy on the compute-dtype logits (LitGPT, torchtune) instead of an fp32 upcast")
    g.add_argument("--loss-chunks", type=int)
    g.add_argument("--loss-kernel", choices=_choices(LossKernel),
                   help="the loss kernel: hf (lm_head + transformers' loss) or cce (Cut Cross Entropy, axolotl's "
                        "cut_cross_entropy: no logits) [hf]")
    g.add_argument("--optimizer-in-backward", action="store_true", default=None)
    add_vision_flags(g)
    add_objective_flags(p)
    what = ("a GPU as named by its id, nvidia-smi or people (rtx-4090, 4090, 'NVIDIA H100 80GB HBM3'), or a size: "
            "a whole number of GB is that card (24GB: a 24 GB card, 24 GiB), anything else as written (22.5GiB, "
            "24000MB)")
    if gpu_required:
        g.add_argument("--gpu", required=True, help=f"{what}: the GPU to fit")
    else:
        g.add_argument("--gpu", help=f"{what}: for the fits verdict")
    g.add_argument("--unit", choices=["GiB", "GB"], default="GiB")


_FLAG_FIELDS = {
    "method": "method", "weights": "weights", "compute": "compute", "amp": "amp",
    "master_weights": "master_weights", "double_quant": "double_quant", "adapter_dtype": "adapter_dtype",
    "kbit_upcast": "kbit_upcast",
    "optimizer": "optimizer", "optimizer_impl": "optimizer_impl", "lora_rank": "lora_rank",
    "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "lora_targets": "lora_targets",
    "use_dora": "use_dora", "use_rslora": "use_rslora", "lora_fa": "lora_fa",
    "trainable_layers": "trainable_layers", "freeze_extra": "freeze_extra", "batch": "micro_batch", "seq": "seq_len",
    "grad_accum": "grad_accum", "grad_ckpt": "grad_ckpt", "ckpt_reentrant": "ckpt_reentrant", "attention": "attention",
    "gpus": "gpus",
    "loss_fp32": "loss_fp32",
    "sharding": "sharding", "offload": "offload", "chunked_loss": "chunked_loss", "loss_chunks": "loss_chunks",
    "loss_kernel": "loss_kernel",
    "optimizer_in_backward": "optimizer_in_backward",
    "images": "images", "frames": "frames", "max_pixels": "max_pixels", "vision_tuning": "vision_tuning",
    "vision_ckpt": "vision_ckpt", "pan_and_scan": "pan_and_scan",
}


def _image_size(text: str) -> tuple[int, int]:
    """'1280x720' -> (1280, 720): width x height in pixels."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*[x×X*]\s*(\d{1,6})\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not WIDTHxHEIGHT in pixels, e.g. 1280x720")
    return int(m.group(1)), int(m.group(2))


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} must be 0 or more")
    return n


def add_vision_flags(g: Any) -> None:
    """A vision-language model's inputs: images per sample, their size, video frames, the processor's cap."""
    g.add_argument("--images", type=_count, help="images per sample (vision-language models) [0]")
    g.add_argument("--image-size", type=_image_size, metavar="WxH", help="image width x height in pixels [448x448]")
    g.add_argument("--frames", type=_count, help="video frames per sample (vision-language models) [0]")
    g.add_argument("--max-pixels", type=_count, help="the Qwen-VL processor's max_pixels [its own]")
    g.add_argument("--vision-tuning", choices=["frozen", "projector", "lora", "full"],
                   help="how the vision tower and projector train [frozen]")
    g.add_argument("--no-vision-ckpt", dest="vision_ckpt", action="store_false", default=None,
                   help="with --grad-ckpt, checkpoint the language model's layers only, not the vision tower's")
    g.add_argument("--pan-and-scan", action="store_true", default=None,
                   help="Gemma 3's processor option: crops of a wide or tall image beside it")
def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (got {text})")
    return v


def add_objective_flags(p: argparse.ArgumentParser) -> None:
    """The objective and its settings, named as TRL's DPOConfig / GRPOConfig name them (issue 15)."""
    g = p.add_argument_group("objective (TRL 1.16.0's DPOTrainer / GRPOTrainer)")
    g.add_argument("--objective", choices=_choices(Objective), help="what the step optimises [sft]")
    g.add_argument("--reference", choices=_choices(Reference),
                   help="reference model: a second copy, the policy with its LoRA adapters disabled, precomputed "
                        "log-probabilities, or none [TRL's default: adapters with LoRA, else copy; ORPO / SimPO / CPO "
                        "have none]")
    g.add_argument("--reference-dtype", choices=["fp32", "bf16", "fp16"],
                   help="a reference copy's weights [the policy's]")
    g.add_argument("--prompt-len", type=_positive, help="prompt tokens (with --completion-len: the sequence)")
    g.add_argument("--completion-len", type=_positive,
                   help="completion tokens (TRL's max_completion_length) [GRPO 256; DPO half the sequence]")
    g.add_argument("--num-generations", type=_positive, help="GRPO: completions per prompt [8]")
    g.add_argument("--steps-per-generation", type=_positive, help="GRPO: micro-batches generated at once "
                   "[gradient accumulation]")
    g.add_argument("--generation-backend", choices=_choices(GenerationBackend),
                   help="GRPO: transformers.generate on this GPU, vLLM colocated, or a vLLM server [transformers]")
    g.add_argument("--vllm-memory-fraction", type=_fraction,
                   help="GRPO vllm-colocate: vLLM's gpu_memory_utilization [0.3]")
    g.add_argument("--vllm-sleep", action="store_true", default=None,
                   help="GRPO vllm-colocate: vllm_enable_sleep_mode")
    g.add_argument("--beta", type=float, help="KL coefficient [DPO 0.1; GRPO 0: no reference model; ORPO's lambda, "
                   "CPO / SimPO's beta: 0.1]")
    g.add_argument("--num-iterations", type=_positive, help="GRPO: passes over each generated batch [1]")


_OBJECTIVE_FLAGS = ("objective", "reference", "reference_dtype", "completion_len", "num_generations",
                    "steps_per_generation", "generation_backend", "vllm_memory_fraction", "vllm_sleep", "beta",
                    "num_iterations")


def objective_changes(args: argparse.Namespace) -> dict[str, Any]:
    """Setup fields of the objective flags; ``--prompt-len`` with ``--completion-len`` sets the sequence."""
    out = {f: getattr(args, f) for f in _OBJECTIVE_FLAGS if getattr(args, f, None) is not None}
    prompt = getattr(args, "prompt_len", None)
    if prompt is not None:
        completion = getattr(args, "completion_len", None)
        if completion is None:
            raise UsageError("--prompt-len needs --completion-len (the sequence is prompt + completion)")
        seq = getattr(args, "seq", None)
        if seq is not None and seq != prompt + completion:
            raise UsageError(f"--seq {seq} is not --prompt-len + --completion-len ({prompt + completion}): "
                             "give one or the other")
        out["seq_len"] = prompt + completion
    return out


def setup_from_args(args: argparse.Namespace, source: Any = None) -> TrainingSetup:
    """The setup of the flags, on top of ``source`` (a :class:`~vramlab.core.sources.training.SetupSource`
    read from ``--config`` files) when given: config first, then the precision preset, then each flag."""
    base = TrainingSetup()
    if source is not None:
        try:
            base = base.replace(**source.changes)
        except ValueError as e:  # enum conversion of a bad value
            raise SetupError(f"{', '.join(source.files)}: {e}") from e
    if args.preset:
        base = precision_preset(args.preset).apply(base)
    changes: dict[str, Any] = {}
    for flag, fld in _FLAG_FIELDS.items():
        v = getattr(args, flag, None)
        if v is not None:
            changes[fld] = v
    if getattr(args, "image_size", None) is not None:
        changes["image_width"], changes["image_height"] = args.image_size
    changes.update(objective_changes(args))
    try:
        current = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return base.replace(**changes, **follow_changes(current, changes))
    except ValueError as e:  # enum conversion of a bad value
        raise SetupError(str(e)) from e


def _flagged_fields(args: argparse.Namespace) -> dict[str, str]:
    """TrainingSetup field -> the flag that set it (a precision preset sets several)."""
    out = {fld: "--" + flag.replace("_", "-") for flag, fld in _FLAG_FIELDS.items()
           if getattr(args, flag, None) is not None}
    if getattr(args, "preset", None):
        preset = precision_preset(args.preset)
        base = TrainingSetup()
        for fld, value in preset.apply(base).to_dict().items():
            if value != base.to_dict()[fld]:
                out.setdefault(fld, f"--preset {args.preset}")
    return out


def ignored_flags(args: argparse.Namespace, setup: TrainingSetup) -> list[str]:
    """Flags given that this setup does not use: named in the result's warnings, never silently dropped."""
    unused: list[str] = []
    if not setup.uses_lora:
        unused += [f for f in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "adapter_dtype")
                   if getattr(args, f, None) is not None]
    if setup.method is not Method.FREEZE:
        unused += [f for f in ("trainable_layers", "freeze_extra") if getattr(args, f, None) is not None]
    if not setup.grad_ckpt and getattr(args, "ckpt_reentrant", None) is not None:
        unused.append("ckpt_reentrant")
    if not setup.chunked_loss and getattr(args, "loss_chunks", None) is not None:
        unused.append("loss_chunks")
    if setup.weight_dtype is not DType.NF4 and getattr(args, "double_quant", None) is not None:
        unused.append("double_quant")
    method = {Method.FULL: "full fine-tuning", Method.FREEZE: "freeze", Method.LORA: "LoRA",
              Method.QLORA: "QLoRA"}[setup.method]
    flag = {"double_quant": "no-double-quant"}
    return [f"--{flag.get(f, f).replace('_', '-')} does not apply to {method} with these settings; it was ignored"
            for f in unused]


def add_source_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=["auto", "hand-written", "traced"], default=None,
                   help="where the estimate's step comes from: the hand-written program, or a trace of "
                        "transformers' own classes (seconds the first time, then cached); auto: hand-written "
                        "where the family is written by hand (an MoE with LoRA on its MLP: traced where "
                        "transformers is installed), else traced [auto]")


def _with_tape_source(args: argparse.Namespace, entry):  # noqa: ANN001, ANN202
    """``--source`` applied to the model, and where a first trace reports its progress (stderr; None where the
    estimate is not traced): (entry, progress)."""
    from vramlab.core import traced
    from vramlab.core.tracing.requirements import check_available, installed

    choice = getattr(args, "source", None)
    if choice:
        entry = dataclasses.replace(entry, spec=dataclasses.replace(entry.spec, tape=choice))
    forced = traced.uses_trace(entry.spec)
    if forced:
        check_available()
    if forced or (entry.spec.is_moe and installed()):  # auto may trace an MoE recipe (adapts_experts)

        def progress(text: str, fraction: float) -> None:
            print(f"trace of {entry.spec.name}: {text} ({fraction:.0%})", file=sys.stderr, flush=True)

        return entry, progress
    return entry, None


def resolve(args: argparse.Namespace):  # noqa: ANN201
    """Model, setup and GPU of the command line. With ``--config``, the mapping read from the files is left in
    ``args.setup_source`` (shown before the answer); a Hub model's origin in ``args.model_origin``."""
    from vramlab.core.catalog import find_gpu, resolve_model

    paths = list(getattr(args, "config", None) or [])
    source = None
    if paths:
        from vramlab.core.sources.training import read_training_configs

        source = read_training_configs(paths)
    model = args.model or (source.model if source is not None else None)
    if not model:
        raise UsageError("--model is required (or a --config that names the model: base_model, "
                         "model_name_or_path)")
    entry = resolve_model(model)
    if entry.adapter is not None:  # a Hub adapter repo: its adapter_config.json is the first training config
        from vramlab.core.sources.training import read_training_configs

        source = read_training_configs(paths, adapter=entry.adapter, adapter_source=f"{model}/adapter_config.json")
    if source is not None:
        source = source.with_flags(_flagged_fields(args))
        source.check()
    setup = setup_from_args(args, source)
    setup.validate(entry.spec)
    gpu = find_gpu(args.gpu) if getattr(args, "gpu", None) is not None else None
    if gpu is not None and gpu.id.startswith(("card-", "custom-")):  # which reading of a size was taken
        print(f"note: --gpu {gpu.notes}", file=sys.stderr)
    args.setup_source = source
    args.model_origin = entry.origin
    unused = ignored_flags(args, setup)
    if unused:
        entry = dataclasses.replace(entry, warnings=(*entry.warnings, *unused))
    return entry, setup, gpu


# ---- commands -----------------------------------------------------------------------------------------------

def cmd_estimate(args: argparse.Namespace) -> int:
    from vramlab.core.catalog import gpus, models

    if args.list_models:
        if args.json:
            print(json.dumps([{**m.to_dict(), "param_count": m.param_count} for m in models()], indent=2))
            return 0
        for m in models():
            print(f"{m.id:<32}{m.name:<34}{fmt_count(m.param_count):>8}  {m.summary()}")
        return 0
    if args.list_gpus:
        if args.json:
            print(json.dumps([dataclasses.asdict(g) for g in gpus()], indent=2))
            return 0
        for g in gpus():
            print(f"{g.id:<26}{g.name:<40}{fmt_bytes(g.memory_bytes):>12}  {g.bf16_tflops:>7.1f} TFLOP/s")
        return 0
    if not args.model and not args.config:
        raise UsageError("vramlab estimate: --model is required (or --config, --list-models, --list-gpus)")
    from vramlab.core.estimate import estimate

    entry, setup, gpu = resolve(args)
    conf = _alloc_conf(args.alloc_conf)
    entry, progress = _with_tape_source(args, entry)
    result = estimate(entry.spec, setup, gpu, allocator=not args.fast, alloc_conf=conf, progress=progress)
    result = _with_import_warnings(result, entry.warnings)
    return _emit(args, result)


def _alloc_conf(flag: str | None) -> AllocatorConfig | None:
    """--alloc-conf as given (a bad value is exit 2), else PYTORCH_CUDA_ALLOC_CONF from the environment: a
    value we cannot read there is a warning and the default allocator is modelled (it is not our input)."""
    if flag is not None:
        return AllocatorConfig.parse(flag) if flag else None
    env = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if not env:
        return None
    try:
        return AllocatorConfig.parse(env)
    except SetupError as e:
        print(f"warning: PYTORCH_CUDA_ALLOC_CONF ignored: {e}", file=sys.stderr)
        return None


def _with_import_warnings(result: MemoryResult, warnings: Sequence[str]) -> MemoryResult:
    if not warnings:
        return result
    import dataclasses

    return dataclasses.replace(result, warnings=(*warnings, *result.warnings))


def _with_sources(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """``--json``: where the model and the setup came from (a Hub model, training configs), when they did."""
    source = getattr(args, "setup_source", None)
    if source is not None:
        out["setup_source"] = source.to_json()
    if getattr(args, "model_origin", ""):
        out["model_origin"] = args.model_origin
    return out


def _print_sources(args: argparse.Namespace) -> None:
    """The text answer is preceded by the model's origin and the training-config mapping, when there are."""
    source = getattr(args, "setup_source", None)
    origin = getattr(args, "model_origin", "")
    if origin:
        print(f"Model: {origin}")
    if source is not None:
        print(source.table())
    if origin or source is not None:
        print()


def _emit(args: argparse.Namespace, result: MemoryResult) -> int:
    if args.json:
        print(json.dumps(_with_sources(args, result.to_json()), indent=2))
    else:
        _print_sources(args)
        print(render_table(result, args.unit))
    if getattr(args, "fail_if_oom", False) and result.gpu is not None and not result.fits():
        return EXIT_DOES_NOT_FIT
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from vramlab.core.simulation.simulate import simulate

    entry, setup, gpu = resolve(args)
    hf_config = None
    if args.hf and entry.source != "preset":
        hf_config = _hf_config_of(entry.source)
    result = simulate(entry.spec, setup, gpu, steps=args.steps, hf=args.hf, hf_config=hf_config)
    return _emit(args, _with_import_warnings(result, entry.warnings))


def _hf_config_of(source: str):  # noqa: ANN202
    """The user's config.json as a transformers config (parsed as data; no remote code)."""
    from pathlib import Path

    path = Path(source)  # the file named (transformers reads a file path as that file), else the folder's
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except ImportError as e:
        raise SetupError("--hf needs transformers and peft: pip install 'vramlab[hf]'") from e
    except (OSError, ValueError, KeyError) as e:
        raise SetupError(f"{path}: transformers cannot read this config ({e})") from e


def cmd_profile(args: argparse.Namespace) -> int:
    from vramlab.core.profiling.outcomes import OutcomeKind
    from vramlab.core.profiling.profile import profile

    entry, setup, gpu = resolve(args)
    if args.device == "auto":
        from vramlab.core.monitor import cuda_available_without_context

        try:
            args.device = "cuda" if cuda_available_without_context() else "cpu"
        except Exception:  # NVML trouble of any kind: there is no usable GPU to profile on
            args.device = "cpu"
        if args.device == "cpu":
            print("note: no NVIDIA GPU found; profiling on the CPU (the tensor level and the process's "
                  "memory; no reserved or device level)", file=sys.stderr)
    launcher = args.launcher
    if setup.gpus > 1 and launcher != "emulate":
        from vramlab.core.profiling.distributed import check_supported, launch_refusal

        if launcher == "torchrun":
            check_supported(entry.spec, setup, args.device)  # a refusal is exit 2 with its reason
        else:
            reason = launch_refusal(entry.spec, setup, args.device)
            if reason is not None:
                print(f"note: not run under torchrun ({reason}); measuring rank 0 emulated in one process",
                      file=sys.stderr)
    from vramlab.core.profiling.processes import stop_signals_raise

    with stop_signals_raise():  # SIGTERM / SIGHUP end the run's processes and temporary folders, as Ctrl-C does
        outcome = profile(entry.spec, setup, device=args.device, gpu=gpu, steps=args.steps,
                          snapshot=args.snapshot, isolate=not args.in_process, timeout_s=args.timeout,
                          launcher=launcher)
    if args.calibrate:
        from vramlab.core.calibration import from_outcome, save

        cal = from_outcome(entry.spec, setup, gpu, outcome)
        if cal is not None:
            print(f"saved {cal.label} to {save(cal)}", file=sys.stderr)
    if outcome.kind is OutcomeKind.NO_GPU:  # nothing was measured: bad input for this machine, not a result
        raise UsageError(f"{outcome.message}: use --device cpu (or --device auto) on a machine without a CUDA GPU")
    if args.json:
        print(json.dumps(_with_sources(args, outcome.to_json()), indent=2))
    else:
        _print_sources(args)
        print(profile_text(outcome, args.unit))
    return 0 if outcome.ok or outcome.kind is OutcomeKind.OOM else 1


def cmd_gpus(args: argparse.Namespace) -> int:
    from vramlab.core.monitor import describe_gpus

    listing = describe_gpus()
    if args.json:
        print(json.dumps(listing.as_dict(), indent=2))
    else:
        print(listing.text)
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from vramlab.core.advisor import fit_search

    entry, setup, gpu = resolve(args)
    if gpu is None:
        raise UsageError("vramlab fit: --gpu is required")
    entry, progress = _with_tape_source(args, entry)
    answer = fit_search(entry.spec, setup, gpu, margin=args.margin, target_batch=args.target_batch,
                        allocator=not args.fast, progress=progress)
    if args.json:
        print(json.dumps(_with_sources(args, answer.to_json()), indent=2))
    else:
        _print_sources(args)
        print(fit_text(answer, args.unit))
    return 0


def _names(text: str) -> list[str]:
    """'a,b, c' -> ['a', 'b', 'c']; an empty list is bad input."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} names nothing: give a comma-separated list")
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    from vramlab.core.compare import compare_setups
    from vramlab.core.report import comparison_text

    entry, setup, gpu = resolve(args)
    entry, progress = _with_tape_source(args, entry)
    rows = compare_setups(entry.spec, setup, gpu, presets=args.presets, objectives=args.objectives,
                          allocator=not args.fast, progress=progress)
    if args.json:
        from vramlab.core.report import comparison_title

        out = {"title": comparison_title(entry.spec, rows), "model": entry.spec.id,
               "gpu": dataclasses.asdict(gpu) if gpu is not None else None, "rows": [r.to_json() for r in rows],
               "warnings": list(entry.warnings)}
        print(json.dumps(_with_sources(args, out), indent=2))
        return 0
    _print_sources(args)
    for w in entry.warnings:
        print(f"Warning: {w}")
    print(comparison_text(entry.spec, rows, gpu, args.unit, markdown=args.markdown))
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from vramlab.core.advisor import allocator_advice, checklist, fit_search, savings
    from vramlab.core.estimate import estimate
    from vramlab.core.report import advice_text, objective_label

    entry, setup, gpu = resolve(args)
    entry, progress = _with_tape_source(args, entry)
    exact = not args.fast
    result = _with_import_warnings(estimate(entry.spec, setup, gpu, allocator=exact, progress=progress),
                                   entry.warnings)
    saves = savings(entry.spec, setup, gpu, allocator=exact, progress=progress)
    fit = (fit_search(entry.spec, setup, gpu, margin=args.margin, target_batch=args.target_batch, allocator=exact,
                      progress=progress) if gpu is not None else None)
    tips = allocator_advice(result)
    checks = checklist(entry.spec, setup, result)
    if args.json:
        out = {"objective": objective_label(setup), "result": result.to_json(),
               "savings": [s.to_json() for s in saves], "fit": fit.to_json() if fit is not None else None,
               "allocator_advice": tips, "checklist": [{"item": i, "why": w} for i, w in checks]}
        print(json.dumps(_with_sources(args, out), indent=2))
        return 0
    _print_sources(args)
    print(advice_text(result, saves, fit, tips, checks, args.unit))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from vramlab.core.sources.export import export_setup, model_name_for, write_exported

    entry, setup, _ = resolve(args)
    given = args.model or (args.setup_source.model if args.setup_source is not None else "")
    name = model_name_for(given, preset_source=entry.spec.source if entry.source == "preset" else None)
    exported = export_setup(setup, args.format, model=name)
    if args.out:
        for path in write_exported(exported, args.out):
            print(f"wrote {path}")
        return 0
    if len(exported.files) > 1:
        raise UsageError(f"this setup needs {len(exported.files)} files ({', '.join(exported.files)}): "
                         "give --out DIR")
    print(exported.files[exported.main], end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vramlab", description="GPU memory of LLM fine-tuning: estimate, simulate, measure.")
    p.add_argument("--version", action="version", version=f"vramlab {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    e = sub.add_parser("estimate", help="analytical estimate (< 1 ms)")
    add_setup_flags(e)
    e._option_string_actions["--model"].required = False  # --list-models needs no model
    e.add_argument("--list-models", action="store_true")
    e.add_argument("--list-gpus", action="store_true")
    e.add_argument("--json", action="store_true")
    e.add_argument("--fail-if-oom", action="store_true", help="exit 3 when it does not fit --gpu")
    e.add_argument("--fast", action="store_true",
                   help="model the allocator's slack instead of replaying the step through it (< 1 ms)")
    e.add_argument("--alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF to model, e.g. expandable_segments:True [the environment's]")
    add_source_flag(e)
    e.set_defaults(func=cmd_estimate)

    s = sub.add_parser("simulate", help="run the real architecture on fake tensors (seconds, no GPU)")
    add_setup_flags(s)
    s.add_argument("--steps", type=_steps, default=2, help="optimizer steps to run [2]")
    s.add_argument("--hf", action="store_true",
                   help="measure transformers' own model class (and peft) instead of the built-in decoder")
    s.add_argument("--json", action="store_true")
    s.add_argument("--fail-if-oom", action="store_true")
    s.set_defaults(func=cmd_simulate)

    r = sub.add_parser("profile", help="run real training steps on this machine's GPU (or CPU)")
    add_setup_flags(r)
    r.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: the CUDA GPU when NVML finds one, else the CPU [auto]")
    r.add_argument("--steps", type=_steps, default=2, help="optimizer steps to run [2]")
    r.add_argument("--snapshot", help="write a torch.cuda.memory snapshot (pickle for memory_viz) here")
    r.add_argument("--in-process", action="store_true", help="do not isolate the run in a child process")
    r.add_argument("--timeout", type=_seconds, default=1800.0, help="seconds before a hung run is ended")
    r.add_argument("--launcher", choices=["auto", "torchrun", "emulate"], default="auto",
                   help="with --gpus N > 1: one process per GPU under torchrun (FSDP2), or rank 0 emulated in "
                        "one process; auto: torchrun when the setup can run so [auto]")
    r.add_argument("--calibrate", action="store_true",
                   help="save the measured CUDA context and allocator slack for later estimates on this GPU")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_profile)

    f = sub.add_parser("fit", help="largest micro batch and sequence that fit a GPU")
    add_setup_flags(f, gpu_required=True)
    f.add_argument("--margin", type=float, default=0.1, help="fraction of GPU memory kept free [0.1]")
    f.add_argument("--target-batch", type=int,
                   help="effective batch (samples per optimizer step, all GPUs) to reach with accumulation")
    f.add_argument("--fast", action="store_true",
                   help="judge with the allocator's slack model instead of replaying each step through it")
    add_source_flag(f)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_fit)

    a = sub.add_parser("advise", help="what to change to fit: each change's saving, the fit search with --gpu, "
                                      "allocator settings and checks before a long run")
    add_setup_flags(a)
    a.add_argument("--margin", type=float, default=0.1, help="fit search: fraction of GPU memory kept free [0.1]")
    a.add_argument("--target-batch", type=int, help="fit search: effective batch to reach with accumulation")
    a.add_argument("--fast", action="store_true", help="judge with the allocator's slack model (< 1 ms each)")
    add_source_flag(a)
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_advise)

    c = sub.add_parser("compare", help="the setup side by side under several precision presets and objectives "
                                       "[Full / LoRA / QLoRA]")
    add_setup_flags(c)
    c.add_argument("--presets", type=_names, metavar="ID,...",
                   help=f"precision presets, one column each: {', '.join(x.id for x in PRECISION_PRESETS)} "
                        "[full-amp-bf16,lora-bf16,qlora-nf4, unless --objectives is given: then the setup's own]")
    c.add_argument("--objectives", type=_names, nargs="?", const=["sft", "dpo", "grpo"], metavar="OBJ,...",
                   help="objectives, one column each (with each preset), TRL's defaults for each "
                        f"({', '.join(_choices(Objective))}) [the setup's own; with no list: sft,dpo,grpo]")
    c.add_argument("--fast", action="store_true", help="model the allocator's slack instead of replaying each step")
    add_source_flag(c)
    out = c.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--markdown", action="store_true", help="a Markdown table (for a report or an issue)")
    c.set_defaults(func=cmd_compare)

    x = sub.add_parser("export", help="write the setup as a training config: axolotl, llamafactory, trl, "
                                      "deepspeed (importing it with --config gives the same setup)")
    x.add_argument("format", choices=["axolotl", "llamafactory", "trl", "deepspeed"])
    add_setup_flags(x)
    x.add_argument("--out", "-o", metavar="DIR", help="write the file(s) into DIR [print the one file]")
    x.set_defaults(func=cmd_export)

    g = sub.add_parser("gpus", help="detected NVIDIA GPUs (NVML)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gpus)
    return p


def one_line(text: object) -> str:
    """A message as one line: a path with a newline in it is shown with ``\\n``, not split."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def _describe_os_error(e: OSError) -> str:
    """'<file>: <reason>' without Python's '[Errno N]' (a file name of any length kept on one line)."""
    reason = e.strerror or str(e)
    name = e.filename if e.filename is not None else ""
    name = str(name) if len(str(name)) <= 120 else str(name)[:60] + "..." + str(name)[-40:]
    return f"{name}: {reason}" if name else reason


def _stdout_gone() -> None:
    """stdout cannot be written (a full device, a closed pipe): point it at the null device, so that Python's
    flush at exit does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


# Libraries' notices of their own API changes (transformers' FutureWarning for a renamed method) speak to whoever
# calls that API, here VRAM Lab, not to the user reading an answer: kept out of the command line's output.
_LIBRARIES = r"(transformers|peft|trl|torch|huggingface_hub|accelerate)(\.|$)"


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_LIBRARIES)
    if sys.stdout is None:  # `vramlab ... >&-`: Python starts without sys.stdout, and print() drops text silently
        print("error: standard output is closed: the answer cannot be written (redirect it to a file or to "
              "/dev/null instead of closing it)", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        if not getattr(args, "command", None):
            parser.print_help()
            return 0
        code = args.func(args)
        sys.stdout.flush()  # a full device or a closed pipe shows here, where it can be reported
        return code
    except (UsageError, SetupError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP during a profile (measure.processes.Terminated)
        signum = getattr(e, "signum", 2)
        print("terminated" if signum != 2 else "interrupted", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `vramlab ... | head`: the reader has what it wanted
        _stdout_gone()
        return 0
    except OSError as e:  # a path the system refuses (a name too long), or output to a full device
        if e.filename is None:  # writing the answer failed: no second error from the flush at exit
            _stdout_gone()
        what = _describe_os_error(e) if e.filename is not None else f"writing the output failed: {e.strerror or e}"
        print(f"error: {one_line(what)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
