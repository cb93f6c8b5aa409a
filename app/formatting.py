"""Text for people from core objects: labels, summaries and verdicts. No memory arithmetic happens here;
numbers come from :class:`~vramlab.core.result.MemoryResult` and are only formatted (bytes to a unit)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramlab.core.kinds import Phase, parse_phase_key
from vramlab.core.result import MemLevel, MemoryResult
from vramlab.core.spec import Attention, GpuSpec, Method, ModelSpec, Sharding, TrainingSetup
from vramlab.core.units import Unit, fmt_bytes, fmt_count

UNIT_NOTE = {Unit.GIB: "1 GiB = 2³⁰ bytes", Unit.GB: "1 GB = 10⁹ bytes", Unit.MIB: "1 MiB = 2²⁰ bytes"}


# The core's messages name CLI flags; in the window they name the controls instead.
FLAG_LABELS = {
    "--method": "Method", "--weights": "Weight storage", "--compute": "Compute dtype", "--no-amp": "Autocast Off",
    "--amp": "Autocast On", "--master-weights": "FP32 master weights", "--adapter-dtype": "Adapter dtype",
    "--optimizer": "Optimizer", "--optimizer-impl": "Implementation", "--lora-rank": "LoRA rank",
    "--lora-alpha": "LoRA alpha", "--lora-dropout": "LoRA dropout", "--lora-targets": "LoRA targets",
    "--trainable-layers": "Trainable layers", "--batch": "Micro batch", "--seq": "Sequence length",
    "--grad-accum": "Grad accumulation", "--grad-ckpt": "Gradient checkpointing", "--attention": "Attention",
    "--gpus": "GPU count", "--sharding": "Sharding", "--offload": "CPU offload", "--chunked-loss": "Chunked loss",
    "--loss-chunks": "Loss chunks", "--optimizer-in-backward": "Optimizer step in backward",
}
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def gui_message(text: str) -> str:
    """A core SetupError message with CLI flags replaced by the names of the controls."""
    return _FLAG.sub(lambda m: f"“{FLAG_LABELS[m.group(0)]}”" if m.group(0) in FLAG_LABELS else m.group(0), text)


def phase_label(key: str, multiline: bool = False) -> str:
    """'backward@2' -> 'Backward, step 2'; 'load' -> 'Load'."""
    phase, step = parse_phase_key(key)
    name = "Optimizer" if phase is Phase.OPTIMIZER else phase.label
    if step == 0:
        return name
    return f"{name}\nstep {step}" if multiline else f"{name}, step {step}"


def method_label(setup: TrainingSetup) -> str:
    return {
        Method.FULL: "full fine-tuning",
        Method.FREEZE: f"last {setup.trainable_layers} layers",
        Method.LORA: f"LoRA r{setup.lora_rank}",
        Method.QLORA: f"QLoRA r{setup.lora_rank}",
    }[setup.method]


def optimizer_label(setup: TrainingSetup) -> str:
    if setup.optimizer.has_impl_choice:
        return f"{setup.optimizer.value} ({setup.impl.value})"
    return setup.optimizer.value


def setup_summary(model: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None = None) -> str:
    """One line: model, method, precision, optimizer, batch and the options that change memory."""
    parts = [
        f"{model.name} ({fmt_count(model.param_count)})",
        method_label(setup),
        setup.precision_label(),
        optimizer_label(setup),
        f"batch {setup.micro_batch} × seq {setup.seq_len}, accumulation {setup.grad_accum} "
        f"(effective batch {setup.effective_batch})",
    ]
    extra = []
    if setup.grad_ckpt:
        extra.append("checkpointing")
    if setup.attention is Attention.EAGER:
        extra.append("eager attention")
    if setup.chunked_loss:
        extra.append(f"chunked loss ({setup.loss_chunks})")
    if setup.gpus > 1 or setup.sharding is not Sharding.NONE:
        extra.append(f"{setup.gpus} GPUs, {setup.sharding.value}"
                     + (f", offload {setup.offload.value}" if setup.offload.value != "none" else ""))
    if gpu is not None:
        extra.append(f"on {gpu.name}")
    return " · ".join(parts + extra)


def bytes_text(nbytes: int, unit: Unit, digits: int = 2) -> str:
    return fmt_bytes(nbytes, unit, digits)


@dataclass(frozen=True)
class Verdict:
    """Does the result fit its GPU? ``state`` is 'fits', 'nofit' or 'unknown' (no GPU chosen)."""

    state: str
    text: str


def verdict(result: MemoryResult | None, gpu: GpuSpec | None, unit: Unit,
            level: MemLevel = MemLevel.DEVICE) -> Verdict:
    """The fits / does-not-fit line for one result, judged at ``level`` (the device level by default,
    which is what has to fit: nvidia-smi's number)."""
    if result is None or gpu is None:
        return Verdict("unknown", "Choose a GPU to see whether it fits.")
    fits = result.fits(gpu, level)
    head = result.headroom_bytes(gpu, level)
    assert head is not None
    used = bytes_text(result.bytes_at(level), unit)
    cap = bytes_text(gpu.memory_bytes, unit)
    what = {MemLevel.DEVICE: "device memory (nvidia-smi)", MemLevel.RESERVED: "reserved by the allocator",
            MemLevel.ALLOCATED: "in live tensors"}[level]
    if fits:
        text = f"Fits {gpu.name} ({cap}): {used} {what}, {bytes_text(head, unit)} headroom per GPU"
        mark = "✔"
    else:
        text = f"Does not fit {gpu.name} ({cap}): {used} {what}, short by {bytes_text(-head, unit)} per GPU"
        mark = "✘"
    return Verdict("fits" if fits else "nofit", f"{mark} {text}")


def level_axis_label(level: MemLevel, unit: Unit, html: bool = True) -> str:
    """The y-axis title: which level, which unit (two lines in the chart so it never clips)."""
    return f"{level.label}{'<br>' if html else ', '}{unit.value} per GPU"


def capacity_label(gpu: GpuSpec, unit: Unit) -> str:
    return f"{gpu.name}: {bytes_text(gpu.memory_bytes, unit)}"

