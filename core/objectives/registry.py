"""The one table of the objectives: which folder under ``core/objectives/`` answers each
:class:`~vramlab.core.spec.Objective`, and with which pieces.

An objective unit is a folder (``core/objectives/dpo/``) holding ``program`` (its step on the estimator's
symbolic engine: a :class:`~vramlab.core.objectives.shared.program.ObjectiveProgram` as ``PROGRAM``, no torch)
and ``reference`` (the same step as its trainer runs it, on the simulation's model under fake tensors: a
:class:`~vramlab.core.objectives.shared.reference.ReferenceStep` as ``STEP``, torch); what several share is in
``shared/``. SFT, the default, has a program only: its reference is the simulation's own step.

Adding an objective: its :class:`~vramlab.core.spec.Objective` value, its folder, one :class:`Unit` line here,
its tests (tests/test_objectives.py holds the program to the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramlab.core.spec.options import Objective

PIECES = ("program", "reference")


@dataclass(frozen=True)
class Unit:
    """An objective folder, the objectives it answers and the trainer whose step it follows."""

    name: str
    objectives: tuple[Objective, ...]
    follows: str
    pieces: tuple[str, ...] = PIECES
    # its step's sizes follow the completion's tokens, half the sequence rounded down unless --completion-len is
    # given (TrainingSetup.completion_tokens): a fit in the length holds over lengths of one parity only
    half_sequence: bool = False
    # rows per micro batch that one call of TRL's fused LM head scores (completion tokens each): its tile is
    # min(tokens, 4096) rows, which has no polynomial form across 4096 tokens
    head_rows: int = 0
    # its step splits the micro batch in two (b // 2 rows one way): a fit in the batch holds over one parity only,
    # so the step is fitted for the batch asked
    half_batch: bool = False


UNITS: tuple[Unit, ...] = (
    Unit("sft", (Objective.SFT,), "transformers Trainer / TRL SFTTrainer", ("program",)),
    Unit("dpo", (Objective.DPO, Objective.IPO), "TRL DPOTrainer (loss_type sigmoid, ipo)", half_sequence=True,
         head_rows=2),
    Unit("kto", (Objective.KTO,), "TRL KTOTrainer", half_sequence=True, head_rows=1, half_batch=True),
    Unit("orpo_cpo", (Objective.ORPO, Objective.CPO, Objective.SIMPO),
         "TRL trl.experimental ORPOTrainer, CPOTrainer (loss_type sigmoid, simpo)"),
    Unit("grpo", (Objective.GRPO,), "TRL GRPOTrainer", head_rows=1),
)
