"""DPO and IPO on the symbolic engine: TRL 1.16.0's ``DPOTrainer._compute_loss`` (loss_type sigmoid or ipo),
replayed line by line after this unit's reference (:mod:`vramlab.core.objectives.dpo.reference`)."""

from __future__ import annotations

from vramlab.core.estimator.engine import FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.program import Dims
from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.program import ObjectiveProgram
from vramlab.core.objectives.shared.trl import DPO_OUTPUTS, REF_OUTPUTS
from vramlab.core.spec.options import Objective, Reference


class DpoProgram(ObjectiveProgram):
    """Chosen and rejected rows concatenated, the policy's log-probabilities, the reference's, the loss."""

    def collate(self, d: Dims) -> list[Storage]:
        ops, rows, s = self.ops, 2 * self.setup.micro_batch, d.s
        batch = [ops.new(rows * s, "i64", Kind.INPUTS) for _ in range(3)]  # ids, attention and completion masks
        self.make_inputs(Dims(rows, s, rows > 1))  # the collator repeats every prompt's images for its rejected row
        return batch

    def loss(self, step: int, i: int, d: Dims) -> tuple[Storage, list[Storage]]:
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        b = setup.micro_batch
        rows, s = 2 * b, d.s  # a vision-language model's prompt holds its image tokens too (d.s)
        ids, attn, cmask = batch = self.take(i, d)
        d = Dims(rows, s, rows > 1)
        n_tokens = rows * setup.completion_tokens
        labels = self.labels(ids)
        outputs, policy_loss = self.log_probs(m, ids, d, n_tokens, DPO_OUTPUTS, grad=True)
        logps = self.reduce(outputs[0], rows)
        chosen, rejected = m.chunk2(logps)
        ops.drop(logps)
        mode = setup.reference_mode
        engine.set_phase(Phase.REFERENCE, step)
        ref_out = ref_loss = ref_logps = None
        if mode is Reference.PRECOMPUTED:
            ref_c, ref_r = ops.new(b, "f32", Kind.INPUTS), ops.new(b, "f32", Kind.INPUTS)
        else:
            with self.no_grad():
                if mode is Reference.ADAPTERS:
                    with self.adapters_off(m):
                        ref_out, ref_loss = self.log_probs(m, ids, d, n_tokens, DPO_OUTPUTS, grad=False)
                else:
                    ref_out, ref_loss = self.log_probs(self.ref, ids, d, n_tokens, REF_OUTPUTS, grad=False)
                ref_logps = ops.new(rows, "f32")
                ref_c, ref_r = engine.view(ref_logps, b), engine.view(ref_logps, b)
        engine.set_phase(Phase.FORWARD, step)
        c = self.sub(chosen, ref_c)
        r = self.sub(rejected, ref_r)
        delta = self.sub(c, r)
        if setup.objective is Objective.IPO:
            cm, rm = engine.view(cmask, b * s), engine.view(cmask, b * s)
            avgs = []
            for x, _mk in ((c, cm), (r, rm)):
                sm_ = ops.new(b, "i64")
                cl = ops.new(b, "f32")
                ops.drop(sm_)
                avg = ops.new(b, "f32")
                engine.node(avg, [(x, ops.gbytes(x))], [cl])
                ops.drop(cl)
                avgs.append(avg)
            ipo = self.sub(avgs[0], avgs[1])
            shifted = self.scalar_op(ipo, through=True)
            per_seq = ops.new(b, "f32")
            nb = b * 4
            engine.node(per_seq, [(shifted, nb)], [shifted],
                        (Temp(0, nb), Temp(0, nb), FreeTemp(0), Grad(0), FreeTemp(0)))
            ops.drop(ipo, shifted, *avgs, cm, rm)
        else:
            scaled = self.scalar_op(delta)
            ls = ops.new(b, "f32")
            buffer = ops.new(b, "f32") if engine.match_simulation else None  # log_sigmoid's CPU buffer
            engine.node(ls, [(scaled, ops.gbytes(scaled))], [scaled] + ([buffer] if buffer is not None else []))
            per_seq = self.scalar_op(ls)
            ops.drop(scaled, ls, buffer)
        mean = self.reduce(per_seq, 1)
        weighted = self.scalar_op(mean)
        loss = self.scalar_op(weighted, through=True)
        ops.drop(mean, weighted, per_seq, c, r, delta, chosen, rejected, ref_c, ref_r, ref_logps)
        ops.drop(*outputs, policy_loss, labels)
        if ref_out is not None:
            ops.drop(*ref_out, ref_loss)
        return loss, batch


PROGRAM = DpoProgram
