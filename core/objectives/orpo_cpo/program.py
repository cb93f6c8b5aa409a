"""ORPO, CPO and SimPO on the symbolic engine: TRL 1.16.0's ``trl.experimental`` ORPOTrainer and CPOTrainer
(SimPO is CPOTrainer with loss_type simpo): no reference, the model's full logits. Replayed line by line after
:mod:`vramlab.core.objectives.orpo_cpo.reference`."""

from __future__ import annotations

from vramlab.core.estimator.engine import Storage
from vramlab.core.estimator.program import Dims
from vramlab.core.estimator.trl_head import SIZE
from vramlab.core.kinds import Kind
from vramlab.core.objectives.shared.program import ObjectiveProgram
from vramlab.core.spec.options import Objective


class PairProgram(ObjectiveProgram):
    """Chosen and rejected rows concatenated through the whole LM head, the chosen rows' NLL, the pair loss."""

    def collate(self, d: Dims) -> list[Storage]:
        b, s, p = self.setup.micro_batch, self.setup.seq_len, self.setup.prompt_tokens
        # the collator's prompts, then each side's ids, attention mask and labels
        return [self.ops.new(b * n, "i64", Kind.INPUTS) for n in (p, p, s, s, s, s, s, s)]

    def loss(self, step: int, i: int, d: Dims) -> tuple[Storage, list[Storage]]:
        """The reference's ``pair_loss`` (see its docstring for TRL's functions followed)."""
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        obj = setup.objective
        b, s, V = setup.micro_batch, setup.seq_len, m.spec.vocab_size
        rows = 2 * b
        d = Dims(rows, s, rows > 1)
        batch = self.take(i, d)
        ids, attn, lab = (ops.new(rows * s, "i64", Kind.INPUTS) for _ in range(3))  # concatenated_inputs' cats
        h = self.sm.backbone(ids, d)
        engine.region, old = Kind.LOGITS, engine.region
        logits = m.linear(m.head, h, rows * s)
        if m.spec.final_logit_softcap:  # Gemma 2's softcap in the model's forward: / cap, tanh, * cap
            for save in (False, True, False):
                nxt = ops.unary(logits, save_output=save)
                ops.drop(logits)
                logits = nxt
        ops.drop(h)  # the base model's output goes when the forward returns
        if m.amp and logits.dtype != "f32":  # accelerate's convert_outputs_to_fp32 under the trainer's autocast
            l32 = ops.cast(logits, "f32")
            ops.drop(logits)
            logits = l32
        cd = logits.dtype
        if obj is Objective.ORPO:  # torch.where(attention_mask == 1, ids.clone(), -100)
            cond, clone = ops.new(rows * s, "bool"), ops.new(rows * s, "i64")
            labels = ops.new(rows * s, "i64")
            ops.drop(cond, clone)
        else:
            labels = ops.new(rows * s, "i64")  # concatenated_labels.clone()
        n1 = b * (s - 1)
        # the chosen rows' NLL (ORPO always, CPO / SimPO with cpo_alpha 1.0)
        first = engine.view(logits, b * s * V)
        engine.node(first, [(logits, ops.gbytes(logits))])  # logits[:b]: slice_backward, zeros of logits
        shift = engine.view(first, n1 * V)
        engine.node(shift, [(first, ops.gbytes(first))])  # [..., :-1, :]
        if b > 1:  # .contiguous(): a copy (its backward passes the gradient through) unless one row
            lg = ops.new(n1 * V, cd)
            engine.node(lg, [(shift, 0)])
            ops.drop(shift)
            lb = ops.new(n1, "i64")
        else:
            lg, lb = shift, engine.view(labels, n1)
        lsm = ops.new(n1 * V, lg.dtype)  # log_softmax saves its output
        engine.node(lsm, [(lg, ops.gbytes(lg))], [lsm])
        nll = ops.new(1, "f32")
        tw = ops.new(1, "f32")
        engine.node(nll, [(lsm, ops.gbytes(lsm))], [lb, tw])
        ops.drop(tw, lsm, lg, lb, first)
        ops.drop(labels)
        n = rows * (s - 1)
        shifted = ops.new(n, "i64")  # labels[:, 1:].clone()
        loss_mask = ops.new(n, "bool")
        ops.drop(ops.new(n, "bool"))  # labels == -100, for the in-place fill
        lv = engine.view(logits, n * V)
        engine.node(lv, [(logits, ops.gbytes(logits))])  # logits[:, :-1, :]
        per_token = ops.new(n, "f32")
        entropy, log_z, expected = (ops.new(n, "f32") for _ in range(3))
        engine.node(per_token, [(lv, n * V * SIZE[cd])], [lv, shifted, log_z, expected])
        ops.drop(entropy, log_z, expected, shifted, lv)
        masked = ops.mul(per_token, loss_mask)
        summed = self.reduce(masked, rows)
        ops.drop(masked, per_token)
        if obj is Objective.CPO:
            all_logps = summed
        else:
            count = ops.new(rows, "i64")
            all_logps = ops.new(rows, "f32")
            engine.node(all_logps, [(summed, ops.gbytes(summed))], [count])
            ops.drop(count, summed)
        ops.drop(loss_mask, logits)
        engine.region = old
        chosen, rejected = engine.view(all_logps, b), engine.view(all_logps, b)
        for half in (chosen, rejected):  # all_logps[:b], all_logps[b:]: slice_backward, zeros of all_logps
            engine.node(half, [(all_logps, ops.gbytes(all_logps))])
        ops.drop(all_logps, ids, attn, lab)  # concatenated_forward returns
        if obj is Objective.ORPO:
            diff = self.sub(chosen, rejected)  # the expression's temporaries go as it is evaluated
            lc, lr = self._log1mexp(chosen), self._log1mexp(rejected)
            d2 = self.sub(lc, lr)
            ops.drop(lc, lr)
            log_odds = self.sub(diff, d2)
            ops.drop(diff, d2)
            ratio = self._logsigmoid(log_odds)
            losses = self.scalar_op(ratio)
            ops.drop(ratio)
            mean = self.reduce(losses, 1)
            loss = self.sub(nll, mean)
            ops.drop(log_odds, losses, mean)
        else:
            diff = self.sub(chosen, rejected)
            if obj is Objective.SIMPO:
                d2 = self.scalar_op(diff, through=True)
                ops.drop(diff)
                diff = d2
            terms = []
            for _sign in (1, -1):
                scaled = self.scalar_op(diff)
                ls = self._logsigmoid(scaled)
                ops.drop(scaled)
                t = self.scalar_op(ls)  # -F.logsigmoid(...) (neg) or F.logsigmoid(...) * 0.0
                ops.drop(ls)
                if _sign > 0:
                    t2 = self.scalar_op(t)  # * (1 - label_smoothing)
                    ops.drop(t)
                    t = t2
                terms.append(t)
            losses = self.sub(*terms)
            ops.drop(*terms)
            mean = self.reduce(losses, 1)
            alpha_nll = self.scalar_op(nll)
            loss = ops.add(mean, alpha_nll)
            ops.drop(diff, losses, mean, alpha_nll)
        ops.drop(chosen, rejected, nll)
        return loss, batch

    def _logsigmoid(self, x: Storage) -> Storage:
        """``F.logsigmoid``: saves its input and, on the CPU (the simulation), a buffer of its size."""
        ops = self.ops
        ls = ops.new(x.numel, "f32")
        buffer = ops.new(x.numel, "f32") if self.engine.match_simulation else None
        self.engine.node(ls, [(x, ops.gbytes(x))], [x] + ([buffer] if buffer is not None else []))
        ops.drop(buffer)
        return ls

    def _log1mexp(self, x: Storage) -> Storage:
        """``torch.where(x < -ln 2, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))``."""
        ops = self.ops
        cond = ops.new(x.numel, "bool")
        e = ops.unary(x, save_output=True)
        ne = ops.unary(e)
        lp = ops.unary(ne, save_input=True)
        ops.drop(e, ne)
        em = ops.unary(x, save_output=True)
        nem = ops.unary(em)
        lg = ops.unary(nem, save_input=True)
        ops.drop(em, nem)
        out = ops.new(x.numel, "f32")
        self.engine.node(out, [(lp, ops.gbytes(lp)), (lg, ops.gbytes(lg))], [cond])
        ops.drop(cond, lp, lg)
        return out


PROGRAM = PairProgram
