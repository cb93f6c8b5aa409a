"""The command line's setup flags (shared by every subcommand) and the setup they make: parsed values checked
with one clear line each (:class:`UsageError`), flags over a training config's fields, and the flags a setup
ignores."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, NoReturn

from vramlab.core.checks import SetupError
from vramlab.core.spec.edits import follow_changes
from vramlab.core.spec.options import (
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
)
from vramlab.core.spec.presets import PRECISION_PRESETS, precision_preset
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth_loss import fused_loss_runs


class UsageError(Exception):
    """A bad flag or value: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def enum_values(enum: type) -> list[str]:
    return [e.value for e in enum]


def _whole(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{n} must be at least {least}" if least else f"{n} must be 0 or more")
    return n


def _positive(text: str) -> int:
    return _whole(text, 1)


def _count(text: str) -> int:
    return _whole(text, 0)


MAX_STEPS = 100  # optimizer steps of a simulation or profile: the peak is reached in step 2


def steps_count(text: str) -> int:
    n = _positive(text)
    if n > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{n:,} steps: give 1 to {MAX_STEPS} (the peak is reached in step 2)")
    return n


MAX_TIMEOUT_S = 7 * 24 * 3600.0


def seconds(text: str) -> float:
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
    g.add_argument("--method", choices=enum_values(Method))
    g.add_argument("--weights", choices=enum_values(DType), help="weight storage [bf16; nf4 for qlora]")
    g.add_argument("--compute", choices=["fp32", "bf16", "fp16"], help="compute dtype [bf16]")
    g.add_argument("--amp", dest="amp", action="store_true", default=None,
                   help="run under autocast (HF Trainer bf16=True); implied by fp32 weights with 16-bit compute")
    g.add_argument("--no-amp", dest="amp", action="store_false")
    g.add_argument("--master-weights", action="store_true", default=None,
                   help="fp32 master copy of 16-bit trainable weights in the optimizer")
    g.add_argument("--trainable-fp32", dest="trainable_fp32", action="store_true", default=None,
                   help="the trainable parameters upcast to fp32, the frozen ones left in --weights, under autocast "
                        "(LLaMA-Factory's default unless pure_bf16 or ZeRO-3)")
    g.add_argument("--no-double-quant", dest="double_quant", action="store_false", default=None)
    g.add_argument("--kbit-prepare", dest="kbit_upcast", action="store_true", default=None,
                   help="peft prepare_model_for_kbit_training: embeddings, norms, lm_head upcast to fp32")
    g.add_argument("--adapter-dtype", choices=["fp32", "bf16", "fp16"], help="LoRA weight dtype [fp32]")
    g.add_argument("--optimizer", choices=enum_values(Optimizer))
    g.add_argument("--optimizer-impl", choices=enum_values(OptimizerImpl),
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
    g.add_argument("--grad-ckpt-offload", dest="ckpt_offload", action="store_true", default=None,
                   help="with --grad-ckpt, each checkpointed layer's input kept in host memory (LLaMA-Factory's "
                        "use_unsloth_gc, axolotl's CPU-offloaded checkpointer) and copied back for its backward")
    g.add_argument("--unsloth-gc", dest="unsloth_gc", action="store_true", default=None,
                   help="with --grad-ckpt, Unsloth's own checkpointing (use_gradient_checkpointing=\"unsloth\", "
                        "unsloth_zoo 2026.10.9): layer inputs over 2 MiB kept in host memory, the last layer's on "
                        "the GPU, copied back through its staging buffers")
    g.add_argument("--input-grads", dest="input_grads", action="store_true", default=None,
                   help="the input embeddings' output requires grad without checkpointing too "
                        "(enable_input_require_grads, which axolotl calls for every adapter)")
    g.add_argument("--offload-activations", dest="offload_activations", nargs="?", const="trl",
                   choices=["trl", "axolotl", "none"], default=None,
                   help="activation offloading: saved tensors of 1 KiB and more go to host memory in forward and "
                        "come back in backward; the output head's and the last few of the forward stay on the GPU. "
                        "trl (the default): TRL 1.16.0's activation_offloading (its OffloadActivations, CUDA "
                        "streams); axolotl: axolotl 0.19.0's on a LoRA run (TRL's hooks with its patches: the "
                        "weights' transposes offloaded too) [none]")
    g.add_argument("--attention", type=str.lower, choices=["sdpa", "eager", "flash", "flash_attention_2", "fa2"],
                   help="sdpa (flash, flash_attention_2 and fa2 name the same kernels) or eager [sdpa]")
    g.add_argument("--gpus", type=int)
    g.add_argument("--sharding", choices=enum_values(Sharding))
    g.add_argument("--offload", choices=enum_values(Offload))
    g.add_argument("--chunked-loss", action="store_true", default=None, help="lm_head + loss in chunks")
    g.add_argument("--loss-bf16", dest="loss_fp32", action="store_false", default=None,
                   help="cross entropy on the compute-dtype logits (LitGPT, torchtune) instead of an fp32 upcast")
    g.add_argument("--loss-chunks", type=int)
    g.add_argument("--loss-kernel", choices=enum_values(LossKernel),
                   help="the loss kernel: hf (lm_head + transformers' loss), cce (Cut Cross Entropy, axolotl's "
                        "cut_cross_entropy: no logits), trl (TRL's fused LM head, as SFTTrainer computes its loss) "
                        "or liger (Liger Kernel's fused linear cross-entropy: the logits a tile of tokens at a time) "
                        "[hf]")
    g.add_argument("--liger-kernels", metavar="LIST",
                   help="Liger Kernel's other kernels the framework patches in (use_liger_kernel, axolotl's "
                        "liger_rms_norm / liger_glu_activation / liger_cross_entropy / liger_layer_norm): some of "
                        "rms_norm,glu,cross_entropy,layer_norm, or all (rms_norm,glu,layer_norm: the patch's "
                        "defaults) / none; each applies where liger-kernel 0.8.5's patch for the model's type swaps "
                        "it in [none]")
    g.add_argument("--unsloth-kernels", metavar="LIST",
                   help="Unsloth's kernels, from unsloth 2026.10.9's source: some of lora_mlp,lora_qkv,lora_o "
                        "(its fused LoRA kernels, each where FastLanguageModel.get_peft_model installs it: Llama, "
                        "Mistral, Qwen 2 / 3, Gemma 1 / 2 with LoRA on all its projections), rms_norm (its "
                        "RMSNorm), rope (its attention forward's RoPE kernel), attention (xformers', k and v "
                        "repeated to every query head), fused_loss (its forward's loss, "
                        "unsloth_zoo 2026.10.9: no logits, chunks sized "
                        "by the --gpu's memory), cross_entropy (its loss on bf16 logits: UNSLOTH_RETURN_LOGITS=1), "
                        "or all (the LoRA kernels, rms_norm, rope, attention and fused_loss: what FastLanguageModel "
                        "and LLaMA-Factory's use_unsloth run; all,cross_entropy with UNSLOTH_RETURN_LOGITS=1) / none "
                        "[none]")
    g.add_argument("--unsloth-free-memory", metavar="GIB", type=float, default=None,
                   help="the GPU's free memory when Unsloth's fused loss first runs (torch.cuda.mem_get_info; it "
                        "sizes its chunks from half of it, capped at 2 GiB) [at least 4 GiB]")
    g.add_argument("--no-hub-kernels", dest="hub_kernels", action="store_false", default=None,
                   help="transformers' torch forward where transformers >= 5.25 swaps its Hub kernels in on CUDA by "
                        "default (use_kernels=False, USE_HUB_KERNELS=NO)")
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
    "kbit_upcast": "kbit_upcast", "trainable_fp32": "trainable_fp32",
    "optimizer": "optimizer", "optimizer_impl": "optimizer_impl", "lora_rank": "lora_rank",
    "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "lora_targets": "lora_targets",
    "use_dora": "use_dora", "use_rslora": "use_rslora", "lora_fa": "lora_fa",
    "trainable_layers": "trainable_layers", "freeze_extra": "freeze_extra", "batch": "micro_batch", "seq": "seq_len",
    "grad_accum": "grad_accum", "grad_ckpt": "grad_ckpt", "ckpt_reentrant": "ckpt_reentrant", "attention": "attention",
    "ckpt_offload": "ckpt_offload", "unsloth_gc": "unsloth_gc", "input_grads": "input_grads",
    "gpus": "gpus",
    "loss_fp32": "loss_fp32",
    "sharding": "sharding", "offload": "offload", "chunked_loss": "chunked_loss", "loss_chunks": "loss_chunks",
    "loss_kernel": "loss_kernel", "liger_kernels": "liger_kernels", "unsloth_kernels": "unsloth_kernels",
    "hub_kernels": "hub_kernels",
    "optimizer_in_backward": "optimizer_in_backward", "offload_activations": "offload_activations",
    "images": "images", "frames": "frames", "max_pixels": "max_pixels", "vision_tuning": "vision_tuning",
    "vision_ckpt": "vision_ckpt", "pan_and_scan": "pan_and_scan",
}


def _image_size(text: str) -> tuple[int, int]:
    """'1280x720' -> (1280, 720): width x height in pixels."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*[x×X*]\s*(\d{1,6})\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not WIDTHxHEIGHT in pixels, e.g. 1280x720")
    return int(m.group(1)), int(m.group(2))


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
    g.add_argument("--objective", choices=enum_values(Objective), help="what the step optimises [sft]")
    g.add_argument("--reference", choices=enum_values(Reference),
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
    g.add_argument("--generation-backend", choices=enum_values(GenerationBackend),
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
    """The setup of the flags, on top of ``source`` (a :class:`~vramlab.core.sources.mapping.SetupSource`
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


def flagged_fields(args: argparse.Namespace) -> dict[str, str]:
    """TrainingSetup field -> the flag that set it (a precision preset sets several)."""
    out = {fld: "--" + flag.replace("_", "-") for flag, fld in _FLAG_FIELDS.items()
           if getattr(args, flag, None) is not None}
    for fld in objective_changes(args):  # --prompt-len (with --completion-len) sets the sequence
        out.setdefault(fld, "--prompt-len" if fld == "seq_len" else "--" + fld.replace("_", "-"))
    if getattr(args, "preset", None):
        preset = precision_preset(args.preset)
        base = TrainingSetup()
        for fld, value in preset.apply(base).to_dict().items():
            if value != base.to_dict()[fld]:
                out.setdefault(fld, f"--preset {args.preset}")
    return out


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """TrainingSetup field -> the value the flags give it (the precision preset's, then each flag's), for the
    training configs' own rules (:func:`vramlab.core.sources.training.with_flags`)."""
    out: dict[str, Any] = {}
    if getattr(args, "preset", None):
        base = TrainingSetup().to_dict()
        out.update({fld: v for fld, v in precision_preset(args.preset).apply(TrainingSetup()).to_dict().items()
                    if v != base[fld]})
    out.update({fld: v for flag, fld in _FLAG_FIELDS.items() if (v := getattr(args, flag, None)) is not None})
    return out


def ignored_flags(args: argparse.Namespace, setup: TrainingSetup) -> list[str]:
    """Flags given that this setup does not use: named in the result's warnings, never silently dropped."""
    unused: list[str] = []
    if not setup.uses_lora:
        unused += [f for f in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "adapter_dtype")
                   if getattr(args, f, None) is not None]
    if setup.method is not Method.FREEZE:
        unused += [f for f in ("trainable_layers", "freeze_extra") if getattr(args, f, None) is not None]
    if not setup.grad_ckpt:
        unused += [f for f in ("ckpt_reentrant", "ckpt_offload", "unsloth_gc") if getattr(args, f, None) is not None]
    if not setup.chunked_loss and getattr(args, "loss_chunks", None) is not None:
        unused.append("loss_chunks")
    if setup.weight_dtype is not DType.NF4 and getattr(args, "double_quant", None) is not None:
        unused.append("double_quant")
    if not fused_loss_runs(setup) and getattr(args, "unsloth_free_memory", None) is not None:
        unused.append("unsloth_free_memory")
    method = {Method.FULL: "full fine-tuning", Method.FREEZE: "freeze", Method.LORA: "LoRA",
              Method.QLORA: "QLoRA"}[setup.method]
    flag = {"double_quant": "no-double-quant", "ckpt_reentrant": "grad-ckpt-reentrant",
            "ckpt_offload": "grad-ckpt-offload"}
    return [f"--{flag.get(f, f).replace('_', '-')} does not apply to {method} with these settings; it was ignored"
            for f in unused]


def add_source_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=["auto", "hand-written", "traced"], default=None,
                   help="where the estimate's step comes from: the hand-written program, or a trace of "
                        "transformers' own classes (seconds the first time, then cached); auto: hand-written "
                        "where the family is written by hand (an MoE with LoRA on its MLP: traced where "
                        "transformers is installed), else traced [auto]")


def names_list(text: str) -> list[str]:
    """'a,b, c' -> ['a', 'b', 'c']; an empty list is bad input."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} names nothing: give a comma-separated list")
    return out
