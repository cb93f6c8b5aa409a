"""Supervised fine-tuning, the default objective, on the symbolic engine: HF Trainer's (and TRL SFTTrainer's)
step, ``model(input_ids, labels, attention_mask)`` with next-token cross entropy; the step model's own forward
(:meth:`vramlab.core.estimator.driver.StepModel.forward`, whose loss kernels follow
``core/simulation/loss.py``). Its reference is the simulation's own step (``core/simulation/step.py``)."""

from __future__ import annotations

from vramlab.core.estimator.engine import Storage
from vramlab.core.estimator.program import Dims
from vramlab.core.kinds import Kind
from vramlab.core.objectives.shared.program import ObjectiveProgram


class SftProgram(ObjectiveProgram):
    """The collator's ids, labels and attention mask (and a vision-language model's inputs), the forward."""

    def collate(self, d: Dims) -> list[Storage]:
        ops = self.ops
        ids = ops.new(d.T, "i64", Kind.INPUTS)
        labels = ops.new(d.T, "i64", Kind.INPUTS)
        mask = ops.new(d.T, "i64", Kind.INPUTS)
        self.sm.make_inputs(d)
        return [ids, labels, mask]

    def loss(self, step: int, i: int, d: Dims) -> tuple[Storage, list[Storage]]:
        batch = self.take(i, d)
        return self.sm.forward(batch[0], batch[1], d), batch


PROGRAM = SftProgram
