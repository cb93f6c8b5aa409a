"""Text for people, from core objects: labels, setup summaries, verdicts, the terminal's tables and the
CSV / Markdown of every export. The CLI, the window and the exports all use this one module, so the same
thing is worded the same way everywhere.

No memory arithmetic happens here: numbers come from :class:`~vramlab.core.result.MemoryResult` and the
outcome objects, and are only formatted (bytes to a unit at the edge).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vramlab.core.kinds import KIND_ORDER, Kind, Phase, parse_phase_key
from vramlab.core.result import MemLevel, MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention, Method, Objective, Reference, Sharding
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import Unit, fmt_bytes, fmt_count
from vramlab.core.versions import LIBRARIES
from vramlab.core.vision import describe_tokens

if TYPE_CHECKING:
    from vramlab.core.advisor import FitAnswer, Saving
    from vramlab.core.compare import CompareRow
    from vramlab.core.profiling.outcomes import DistributedOutcome, ProfileOutcome

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
    "--objective": "Objective", "--reference": "Reference", "--reference-dtype": "Reference dtype",
    "--completion-len": "Completion", "--prompt-len": "Sequence length",  # the window's prompt = sequence − completion
    "--num-generations": "Generations", "--generation-backend": "Generation", "--vllm-memory-fraction": "vLLM memory",
    "--beta": "Beta", "--num-iterations": "Iterations", "--images": "Images per sample", "--frames": "Video frames",
    "--vision-tuning": "Vision tower",
    "--loss-kernel": "Loss kernel", "--loss-bf16": "Loss logits: compute dtype", "--dora": "DoRA", "--rslora": "rsLoRA",
    "--lora-fa": "LoRA-FA", "--trainable-fp32": "FP32 trainable parameters", "--liger-kernels": "Liger kernels",
    "--unsloth-kernels": "Unsloth kernels", "--unsloth-free-memory": "Unsloth free memory",
    "--no-hub-kernels": "Hub kernels (transformers ≥ 5.25)",
    "--no-vision-ckpt": "Tower checkpointing",
    "--offload-activations": "Offload activations",
    "--grad-ckpt-offload": "Checkpoints in host memory",
    "--unsloth-gc": "Unsloth checkpointing",
    # the window has no control of its own for GRPO's generation batches: they follow the accumulation there
    "--steps-per-generation": "Grad accumulation",
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


_REFERENCE_TEXT = {Reference.COPY: "a reference copy", Reference.ADAPTERS: "reference: adapters disabled",
                   Reference.PRECOMPUTED: "precomputed reference", Reference.NONE: "no reference"}


def objective_label(setup: TrainingSetup) -> str:
    """What the step optimises, in a few words: 'SFT', 'DPO, a reference copy', 'GRPO, 8 completions of 256
    tokens, no reference'."""
    obj = setup.objective
    if obj is Objective.SFT:
        return "SFT"
    name = "SimPO" if obj is Objective.SIMPO else obj.value.upper()
    if obj is Objective.GRPO:
        return (f"{name}, {setup.num_generations} completions of {setup.completion_tokens:,} tokens per prompt, "
                f"{_REFERENCE_TEXT[setup.reference_mode]}")
    return f"{name}, {_REFERENCE_TEXT[setup.reference_mode]}"


def setup_summary(model: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None = None) -> str:
    """One line: model, objective, method, precision, optimizer, batch and the options that change memory."""
    parts = [
        f"{model.name} ({fmt_count(model.param_count)})",
        objective_label(setup),
        method_label(setup),
        setup.precision_label(),
        optimizer_label(setup),
        f"batch {setup.micro_batch} × seq {setup.seq_len}, accumulation {setup.grad_accum} "
        f"(effective batch {setup.effective_batch})",
    ]
    extra = []
    if setup.grad_ckpt:
        extra.append("checkpointing" + (" (inputs in host memory)" if setup.ckpt_offload else "")
                     + (" (Unsloth's, inputs in host memory)" if setup.unsloth_gc else ""))
    if setup.attention is Attention.EAGER:
        extra.append("eager attention")
    if setup.chunked_loss:
        extra.append(f"chunked loss ({setup.loss_chunks})")
    if setup.loss_kernel.value == "cce":
        extra.append("Cut Cross Entropy")
    if setup.loss_kernel.value == "trl":
        extra.append("TRL's fused LM head")
    if setup.loss_kernel.value == "liger":
        extra.append("Liger fused linear cross-entropy")
    if setup.liger_kernels:
        names = {"rms_norm": "RMSNorm", "glu": "GLU", "cross_entropy": "cross-entropy", "layer_norm": "LayerNorm"}
        extra.append("Liger " + " and ".join(names[k] for k in setup.liger_kernels))
    if setup.unsloth_kernels:
        extra.append("Unsloth " + ", ".join(setup.unsloth_kernels))
    if setup.offloads_activations:
        extra.append(f"activations offloaded ({'TRL' if setup.offload_activations.value == 'trl' else 'axolotl'})")
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


# ---- the terminal ------------------------------------------------------------------------------------------

def versions_text(result: MemoryResult) -> str:
    """Which library versions' behaviour the result models and, where the installed ones differ, what that
    means (transformers' kernels and defaults move between releases)."""
    v = result.models_versions()
    named = ", ".join([f"{k} {v[k]}" for k in LIBRARIES if v.get(k)]
                      + [f"{k} {x}" for k, x in {**v.get("loss_kernel", {}), **v.get("liger_kernels", {}),
                                                            **v.get("unsloth_kernels", {}),
                                                            **v.get("unsloth_gc", {}),
                                                            **v.get("hub_kernels", {}),
                                                            **v.get("activation_offloading", {})}.items()])
    text = f"models the behaviour of {named} ({v['by']})"
    other = v.get("installed")
    if other:
        here = ", ".join(f"{k} {x or 'not installed'}" for k, x in other.items())
        text += (f"; installed here: {here}, whose behaviour may differ (Falcon's attention, for one, ran through "
                 "another kernel in transformers 5.24 than in 5.25)")
        if "transformers" in other and other["transformers"]:
            text += "; --source traced follows the installed transformers"
    return text


def render_table(result: MemoryResult, unit: str = "GiB", host: bool = False) -> str:
    """The result for the terminal. ``host``: measured on the CPU, where torch has no caching allocator and there
    is no GPU: the reserved and device rows (and a GPU verdict) do not exist; the process's resident memory does."""
    u = Unit(unit)
    if u is Unit.GIB and result.device_used_bytes < 2**30:
        u = Unit.MIB  # small models: MiB keeps the digits readable

    def b(x: int) -> str:
        return fmt_bytes(x, u).rjust(12)

    lines = [f"VRAM Lab {result.level.value} — {setup_summary(result.model, result.setup)}", ""]
    lines.insert(1, versions_text(result))
    if result.source:
        lines.insert(1, f"source of the step: {result.source}")
    lines.append(f"{MemLevel.ALLOCATED.label:<46}{b(result.peak_allocated_bytes)}   peak in "
                 f"{phase_label(result.peak_phase).lower()}")
    total = result.peak_allocated_bytes or 1
    for kind in KIND_ORDER:
        v = result.components.get(kind, 0)
        if v:
            lines.append(f"    {Kind(kind).label:<42}{b(v)}   {100 * v / total:5.1f} %")
    if host:
        for o in result.overheads:
            lines.append(f"{'Host memory: ' + o.name:<46}{b(o.bytes)}   (no GPU: no reserved or device level)")
    else:
        lines.append(f"{MemLevel.RESERVED.label:<46}{b(result.peak_reserved_bytes)}")
        lines.append(f"{MemLevel.DEVICE.label:<46}{b(result.device_used_bytes)}")
        for o in result.overheads:
            lines.append(f"    + {o.name:<40}{b(o.bytes)}   ({o.level.short})")
    if result.calibration:
        lines.append(f"    ({result.calibration})")
    if result.gpu is not None and not host:
        head = result.headroom_bytes()
        verdict = "fits" if result.fits() else "DOES NOT FIT"
        lines.append("")
        lines.append(f"{result.gpu.name} ({fmt_bytes(result.gpu.memory_bytes, u)}): {verdict}, "
                     f"{'headroom' if head >= 0 else 'short by'} {fmt_bytes(abs(head), u)} at the device level")
    lines.append("")
    lines.append("Phase peaks (tensor level):")
    width = max([20] + [len(phase_label(p.key)) + 2 for p in result.phases])  # "Reference forward, step 2"
    for p in result.phases:
        lines.append(f"    {phase_label(p.key):<{width}}{b(p.bytes)}")
    lines.append("")
    lines.append(f"Parameters: {result.total_params:,} total, {result.trainable_params:,} trainable")
    vision = describe_tokens(result.model, result.setup)
    if vision:
        lines.append(vision)
    for w in result.warnings:
        lines.append(f"Warning: {w}")
    for n in result.notes:
        lines.append(f"  - {n}")
    return "\n".join(lines)


def profile_text(outcome: ProfileOutcome, unit: str = "GiB") -> str:
    """A profile run for the terminal: its result's table and what only a profile measures, or the failure."""
    from vramlab.core.profiling.outcomes import DistributedOutcome

    if isinstance(outcome, DistributedOutcome):
        return distributed_text(outcome, unit)
    u = Unit(unit)
    if not outcome.ok:
        where = f" in {outcome.failed_phase}" if outcome.failed_phase else ""
        mem = f" with {fmt_bytes(outcome.memory_at_failure, u)} allocated" if outcome.memory_at_failure else ""
        return f"profile on {outcome.device}: {outcome.kind}{where}{mem}: {outcome.message}"
    lines = [render_table(outcome.result, unit, host=outcome.device != "cuda")]
    if outcome.requested_peak_bytes is not None:  # the tensor level's own counter, beside max_memory_allocated
        lines.append(f"Tensor peak requested (requested_bytes.all.peak): {fmt_bytes(outcome.requested_peak_bytes, u)}; "
                     f"max_memory_allocated {fmt_bytes(outcome.result.peak_allocated_bytes, u)}")
    if outcome.context_bytes is not None:
        via = " (whole-GPU delta: NVML matched no PID)" if outcome.context_source == "whole-GPU delta" else ""
        lines.append(f"Measured CUDA context: {fmt_bytes(outcome.context_bytes, u)}{via}")
    if outcome.device_used_peak_bytes is not None:
        lines.append(f"NVML device used at peak: {fmt_bytes(outcome.device_used_peak_bytes, u)}")
    if outcome.device_delta_peak_bytes is not None:
        lines.append(f"NVML whole-GPU used since before the run, at peak: "
                     f"{fmt_bytes(outcome.device_delta_peak_bytes, u)}")
    if outcome.tokens_per_s:
        lines.append(f"Step time {outcome.step_time_s:.3f} s, {outcome.tokens_per_s:,.0f} tokens/s")
    return "\n".join(lines)


def distributed_text(outcome: DistributedOutcome, unit: str = "GiB") -> str:
    """A sharded run for the terminal: each rank's levels and phase peaks, then the highest rank's table."""
    u = Unit(unit)
    head = f"profile on {outcome.device}, {outcome.world_size} ranks ({outcome.backend or 'torch.distributed'})"
    if not outcome.ok:
        where = f" in {outcome.failed_phase}" if outcome.failed_phase else ""
        who = f" on rank {outcome.failed_rank}" if outcome.failed_rank is not None else ""
        mem = f" with {fmt_bytes(outcome.memory_at_failure, u)} allocated" if outcome.memory_at_failure else ""
        return f"{head}: {outcome.kind}{who}{where}{mem}: {outcome.message}"
    results = [o.result for o in outcome.ranks]
    small = all(r is not None and r.peak_allocated_bytes < 2**30 for r in results)
    v = Unit.MIB if (u is Unit.GIB and small) else u
    cpu = outcome.device != "cuda"  # no device level on the CPU: the rank's resident memory instead
    lines = [head, "", f"{'rank':<6}{'tensor peak':>14}{'reserved':>14}{'host RSS' if cpu else 'device':>14}"
                       "   peak in"]
    for rank, r in enumerate(results):
        outer = r.device_used_bytes
        if cpu:
            outer = next((o.bytes for o in r.overheads if "RSS" in o.name), outer)
        lines.append(f"{rank:<6}{fmt_bytes(r.peak_allocated_bytes, v):>14}{fmt_bytes(r.peak_reserved_bytes, v):>14}"
                     f"{fmt_bytes(outer, v):>14}   {r.peak_phase}")
    keys = [p.key for p in results[0].phases]
    lines.append("")
    lines.append("Phase peaks per rank (tensor level):")
    lines.append(f"    {'phase':<14}" + "".join(f"{'rank ' + str(i):>14}" for i in range(len(results))))
    for k in keys:
        row = [next((p.bytes for p in r.phases if p.key == k), 0) for r in results]
        lines.append(f"    {k:<14}" + "".join(f"{fmt_bytes(b, v):>14}" for b in row))
    worst = max(range(len(results)), key=lambda i: results[i].peak_allocated_bytes)
    lines += ["", f"Rank {worst} (highest peak):", render_table(outcome.result, unit, host=cpu)]
    if outcome.tokens_per_s:
        lines.append(f"Step time {outcome.step_time_s:.3f} s, {outcome.tokens_per_s:,.0f} tokens/s per rank")
    return "\n".join(lines)


def fit_text(answer: FitAnswer, unit: str = "GiB", with_savings: bool = True) -> str:
    """The fit search's answer for the terminal (``with_savings=False``: without the ranked changes, which the
    advice lists before it; the combination that fits, when one is needed, stays)."""
    u = Unit(unit)
    lines = [f"{answer.gpu.name}: {fmt_bytes(answer.gpu.memory_bytes, u)}, keeping {answer.margin:.0%} free -> "
             f"budget {fmt_bytes(answer.budget_bytes, u)} (device used)"]
    lines.append(f"current setup: {fmt_bytes(answer.device_used_now, u)} "
                 f"({'fits' if answer.fits_now else 'does not fit'})")
    lines.append(f"largest micro batch at sequence {answer.seq_len:,}: "
                 f"{answer.max_micro_batch or 'none fits, not even 1'}")
    seq = f"{answer.max_seq_len:,}" if answer.max_seq_len else "none fits"
    if answer.seq_capped:
        seq += " (the model's maximum positions; memory allows more)"
    lines.append(f"longest sequence at micro batch {answer.micro_batch}: {seq}")
    if answer.target_batch:
        if answer.suggestion is None:
            lines.append(f"to reach effective batch {answer.target_batch}: n/a (no micro batch fits)")
        else:
            s = answer.suggestion
            gpus = f" x {s.gpus} GPUs" if s.gpus > 1 else ""
            lines.append(f"to reach effective batch {answer.target_batch}: micro batch {s.micro_batch} x "
                         f"accumulation {s.grad_accum}{gpus} = {answer.effective_batch}")
    if answer.savings:
        alone = answer.single_change_fits
        if with_savings:
            lines.append("changes that save memory:" if alone else
                         "changes that save memory (none is enough alone):")
            lines += savings_lines(answer.savings, u)
        elif not alone:
            lines.append("no single change fits the budget")
        if not alone:
            lines += combination_lines(answer, u)
    return "\n".join(lines)


def combination_lines(answer: FitAnswer, u: Unit) -> list[str]:
    """The fewest changes that fit together, or that none of up to the searched number does."""
    c = answer.combination
    if c is None:
        return [f"no combination of up to {answer.combination_depth} of these changes fits the budget: a GPU with more "
                "memory, or several (--gpus N with --sharding zero3), is needed"]
    lines = [f"smallest combination that fits: {len(c.steps)} changes together -> "
             f"{fmt_bytes(c.device_used_bytes, u)} (device used)"]
    lines += [f"  {i}. {title}  ({cost})" for i, (_key, title, cost) in enumerate(c.steps, 1)]
    return lines


def comparison_table(rows: Sequence[CompareRow], gpu: GpuSpec | None, unit: str = "GiB") -> tuple[list[str],
                                                                                                list[list[str]]]:
    """(headers, rows) of a comparison: each setup's levels, peak phase, trainable parameters and verdict."""
    u = Unit(unit)
    headers = ["Setup", "Method, precision", "Tensor peak", "Reserved", "Device used", "Peak in", "Trainable"]
    if gpu is not None:
        headers.append(f"Fits {gpu.name}")
    out = []
    for row in rows:
        r = row.result
        if r is None:
            out.append([row.name, "not run (the reason is below)"] + [""] * (len(headers) - 2))
            continue
        cells = [row.name, f"{method_label(r.setup)}, {r.setup.precision_label()}",
                 fmt_bytes(r.peak_allocated_bytes, u), fmt_bytes(r.peak_reserved_bytes, u),
                 fmt_bytes(r.device_used_bytes, u), phase_label(r.peak_phase).lower(), fmt_count(r.trainable_params)]
        if gpu is not None:
            head = r.headroom_bytes(gpu)
            assert head is not None
            cells.append(("yes, " if head >= 0 else "no, short by ") + fmt_bytes(abs(head), u))
        out.append(cells)
    return headers, out


def comparison_title(model: ModelSpec, rows: Sequence[CompareRow]) -> str:
    """The comparison's title: the model and what every setup shares (the objective when all have one)."""
    objectives = {objective_label(r.setup) for r in rows if r.setup is not None}
    names = list(dict.fromkeys(objective_label(r.setup).split(",")[0] for r in rows if r.setup is not None))
    shared = f" · {objectives.pop()}" if len(objectives) == 1 else f" · {' / '.join(names)} side by side"
    return f"VRAM Lab comparison — {model.name} ({fmt_count(model.param_count)}){shared}"


def comparison_text(model: ModelSpec, rows: Sequence[CompareRow], gpu: GpuSpec | None, unit: str = "GiB",
                    markdown: bool = False) -> str:
    """The comparison for the terminal (aligned columns) or as Markdown, with the setups' own lines below."""
    headers, cells = comparison_table(rows, gpu, unit)
    numeric = [h in ("Tensor peak", "Reserved", "Device used", "Trainable") for h in headers]
    lines = [("# " if markdown else "") + comparison_title(model, rows), ""]
    if markdown:
        lines.append(to_markdown(headers, cells, numeric).rstrip("\n"))
    else:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        for line in (headers, *cells):
            lines.append("  ".join(c.rjust(w) if num else c.ljust(w)
                                   for c, w, num in zip(line, widths, numeric, strict=True)).rstrip())
    lines.append("")
    bullet = "- " if markdown else "  "
    for row in rows:
        if row.setup is not None:
            lines.append(f"{bullet}{row.name}: {setup_summary(model, row.setup)}")
        else:
            lines.append(f"{bullet}{row.name}: not run: {row.error}")
    lines.append(f"{bullet}Levels: {MemLevel.ALLOCATED.label}; {MemLevel.RESERVED.label}; {MemLevel.DEVICE.label}")
    return "\n".join(lines)


def savings_lines(saves: Sequence[Saving], u: Unit) -> list[str]:
    lines = []
    for s in saves:
        verdict = "" if s.fits is None else ("  -> fits" if s.fits else "")
        lines.append(f"  - {s.title}: saves {fmt_bytes(s.saves_bytes, u)}{verdict}  ({s.cost})")
    return lines


def advice_text(result: MemoryResult, saves: Sequence[Saving], fit: FitAnswer | None, allocator_tips: Sequence[str],
                checks: Sequence[tuple[str, str]], unit: str = "GiB") -> str:
    """The Advisor for the terminal: where the setup stands, what each change saves, the fit search, the
    allocator's settings and the checks before a long run."""
    u = Unit(unit)
    lines = [f"VRAM Lab advice — {setup_summary(result.model, result.setup)}", ""]
    lines.append(f"{MemLevel.DEVICE.label}: {fmt_bytes(result.device_used_bytes, u)}"
                 f" (peak in {phase_label(result.peak_phase).lower()})")
    if result.gpu is not None:
        lines.append(verdict(result, result.gpu, u).text)
    else:
        lines.append("Give --gpu to see whether it fits and to search the largest micro batch and sequence.")
    lines.append("")
    if saves:
        lines.append("Changes that save memory, largest first:")
        lines += savings_lines(saves, u)
    else:
        lines.append("No single change saves memory for this setup.")
    if fit is not None:
        lines += ["", "Fit search:", fit_text(fit, unit, with_savings=False)]
    if allocator_tips:
        lines += ["", "The allocator:"] + [f"  - {t}" for t in allocator_tips]
    lines += ["", "Before you train:"] + [f"  - {item}: {why}" for item, why in checks]
    return "\n".join(lines)


# ---- tables for exports ------------------------------------------------------------------------------------

def to_csv(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(headers)
    writer.writerows(rows)
    return buf.getvalue()


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool] | None = None) -> str:
    numeric = list(numeric) if numeric is not None else [False] * len(headers)
    lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
