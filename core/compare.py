"""The comparison: one setup under several precision presets and objectives, side by side.

The one definition of what "Full / LoRA / QLoRA" and "SFT / DPO / GRPO" mean for a given setup, used by
``vramlab compare`` and by the window's comparison (``app/state.py``), so the same words give the same numbers
in both. "Full" is :data:`COMPARE_PRESETS`' first preset, ``full-amp-bf16``: fp32 weights, gradients and AdamW
states with bf16 matmuls under autocast (what HF Trainer's ``bf16=True`` runs on a model loaded in fp32).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.result import MemoryResult
from vramlab.core.spec.edits import LORA_VARIANTS
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Objective
from vramlab.core.spec.presets import PrecisionPreset, precision_preset
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.traced import Progress

if TYPE_CHECKING:
    from vramlab.core.traced import Progress

# The default comparison: the same run as full fine-tuning, LoRA and QLoRA.
COMPARE_PRESETS = ("full-amp-bf16", "lora-bf16", "qlora-nf4")
# What a precision preset decides; a setup put under a preset has these reset to the defaults before it applies.
PRECISION_FIELDS = ("method", "weights", "compute", "amp", "master_weights", "double_quant", "adapter_dtype",
                    "quant_block")
# The objectives compared by default (``--objectives`` with no list; the window's "Compare objectives")
COMPARE_OBJECTIVES = ("sft", "dpo", "grpo")


def under_preset(fields: TrainingSetup | Mapping[str, Any], preset: PrecisionPreset | str) -> TrainingSetup:
    """The setup (or setup fields) with ``preset``'s precision choices instead of its own: batch, sequence,
    optimizer, objective and every other field stay. Raises SetupError / ValueError / TypeError for fields
    that do not make a setup."""
    if isinstance(preset, str):
        preset = precision_preset(preset)
    current = fields.to_dict() if isinstance(fields, TrainingSetup) else dict(fields)
    defaults = TrainingSetup()
    base = {**current, **{k: getattr(defaults, k) for k in PRECISION_FIELDS}}
    reset = PRECISION_FIELDS
    if not preset.apply(defaults).uses_lora:  # LoRA's variants go with the adapters (refused without them)
        base.update(dict.fromkeys(LORA_VARIANTS, False))
        reset += LORA_VARIANTS
    if isinstance(fields, TrainingSetup):
        return preset.apply(fields.replace(**{k: base[k] for k in reset}))
    return preset.apply(TrainingSetup(**base))


def objective_variants(setup: TrainingSetup,
                       objectives: Sequence[str] = COMPARE_OBJECTIVES) -> list[tuple[str, dict[str, Any]]]:
    """(name, field changes) of the setup trained under each objective, each with TRL's defaults: every column is
    TRL's trainer, so SFT is SFTTrainer's loss through TRL's fused LM head, as DPO / KTO / GRPO score theirs. GRPO
    takes the largest number of generations up to 8 that divides its generation batch (TRL's check), a micro batch
    of 2 where the batch has a single row, and a completion of half a short sequence."""
    sft = {"objective": "sft", "reference": None, "reference_dtype": None, "beta": None,
           "num_generations": 8, "steps_per_generation": None, "num_iterations": 1,
           "generation_backend": "transformers", "vllm_memory_fraction": 0.3, "vllm_sleep": False,
           "loss_kernel": "trl", "chunked_loss": False, "loss_fp32": True}
    rows = setup.micro_batch * (setup.steps_per_generation or setup.grad_accum) * setup.gpus
    gens = max([d for d in range(2, min(rows, 8) + 1) if rows % d == 0] or [2])
    out = []
    for name in objectives:
        obj = Objective(name)
        changes: dict[str, Any] = {**sft, "objective": obj.value}
        if obj is Objective.GRPO:
            changes.update({"num_generations": gens, **({"micro_batch": 2} if rows < 2 else {}),
                            **({"completion_len": setup.seq_len // 2} if setup.completion_len is None
                               and setup.seq_len <= 256 else {})})
        out.append((obj.value.upper() if obj is not Objective.SIMPO else "SimPO", changes))
    return out


@dataclass(frozen=True)
class CompareRow:
    """One column of the comparison: its name, the setup, and the estimate or why there is none."""

    name: str
    setup: TrainingSetup | None
    result: MemoryResult | None
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "setup": self.setup.resolved() if self.setup is not None else None,
                "result": self.result.to_json() if self.result is not None else None,
                "error": self.error or None}


def compare_setups(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None = None,
                   presets: Iterable[str] | None = None, objectives: Iterable[str] | None = None,
                   allocator: bool = True, progress: Progress | None = None) -> list[CompareRow]:
    """The setup under each preset and each objective (every pair). No presets: the setup's own precision
    (unless no objectives are given either: then :data:`COMPARE_PRESETS`); no objectives: the setup's own.
    A pair the libraries cannot run is a row with its reason, not an error."""
    presets = list(presets) if presets is not None else ([] if objectives is not None else list(COMPARE_PRESETS))
    objectives = [o.lower() for o in objectives] if objectives is not None else []
    for pid in presets:
        precision_preset(pid)  # an unknown id is bad input, not a row
    for name in objectives:
        try:
            Objective(name)
        except ValueError:
            raise SetupError(f"unknown objective {name!r}; known: {', '.join(o.value for o in Objective)}") from None
    variants = objective_variants(setup, objectives) if objectives else [("", {})]
    rows: list[CompareRow] = []
    for pid in presets or [None]:
        label = precision_preset(pid).label if pid else ""
        for obj_name, changes in variants:
            name = " · ".join(x for x in (label, obj_name) if x) or "Current setup"
            try:
                s = under_preset(setup, pid) if pid else setup
                s = s.replace(**changes) if changes else s
                s.validate(spec)
                rows.append(CompareRow(name, s, estimate(spec, s, gpu, allocator=allocator, progress=progress)))
            except (SetupError, ValueError, TypeError) as e:
                rows.append(CompareRow(name, None, None, str(e)))
    return rows
