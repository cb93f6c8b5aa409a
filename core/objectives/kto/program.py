"""KTO on the symbolic engine: TRL 1.16.0's ``KTOTrainer._compute_loss`` (loss_type kto, the KL term estimated
from mismatched completions), replayed line by line after :mod:`vramlab.core.objectives.kto.reference`."""

from __future__ import annotations

from vramlab.core.estimator.engine import FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.program import ObjectiveProgram
from vramlab.core.objectives.shared.trl import KTO_OUTPUTS, REF_OUTPUTS
from vramlab.core.spec.options import Reference


class KtoProgram(ObjectiveProgram):
    """Unpaired completions and their mismatched KL rows, the policy's and the reference's log-probabilities."""

    def _kl_logps(self, model: Model, ids: Storage, d: Dims, n_tokens: int, outputs: tuple[str, ...]) -> Storage:
        ops = self.ops
        labels = self.labels(ids)
        with self.no_grad():
            out, loss = self.log_probs(model, ids, d, n_tokens, outputs, grad=False)
        ops.drop(*out[1:], loss)  # the output object is a temporary: only log_probs is kept
        kl = self.reduce(out[0], d.b)
        ops.drop(out[0], labels)
        return kl

    def _index_select(self, x: Storage, idx: Storage, n: int) -> Storage:
        """``x.index_select(0, idx)``: saves the index; backward makes zeros of x's size and adds into them."""
        out = self.ops.new(n, x.dtype)
        self.engine.node(out, [(x, self.ops.gbytes(x))], [idx])
        return out

    def collate(self, d: Dims) -> list[Storage]:
        ops, b, s = self.ops, self.setup.micro_batch, d.s
        batch = [ops.new(b * s, "i64", Kind.INPUTS) for _ in range(6)] + [ops.new(b, "bool", Kind.INPUTS)]
        self.make_inputs(Dims(b, s, b > 1))  # a VLM's images, which the KL rows share
        # (DataCollatorForVisionUnpairedPreference)
        if getattr(self.sm, "token_types", None) is not None:  # Gemma's token_type_ids: the KL rows get their own
            batch.append(ops.new(b * s, "i64", Kind.INPUTS))
        if self.setup.reference_mode is Reference.PRECOMPUTED:
            batch += [ops.new(b, "f32", Kind.INPUTS), ops.new(b, "f32", Kind.INPUTS)]
        return batch

    def loss(self, step: int, i: int, d: Dims) -> tuple[Storage, list[Storage]]:
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        b, s = setup.micro_batch, d.s  # a vision-language model's prompt holds its image tokens too (d.s)
        batch = self.take(i, d)
        d = Dims(b, s, b > 1)
        ids, kl_ids = batch[0], batch[3]
        mode = setup.reference_mode
        n_tokens = b * setup.completion_tokens
        counts = [ops.new(1, "i64"), ops.new(1, "i64")]  # num_chosen = labels.sum(); num_rejected = b - num_chosen
        kl_logps = self._kl_logps(m, kl_ids, d, n_tokens, KTO_OUTPUTS)
        labels = self.labels(ids)
        outputs, policy_loss = self.log_probs(m, ids, d, n_tokens, KTO_OUTPUTS, grad=True)
        completion = self.reduce(outputs[0], b)
        k = b // 2
        chosen_idx = ops.new(k, "i64")
        flipped = ops.new(b, "bool")
        rejected_idx = ops.new(b - k, "i64")
        ops.drop(flipped)
        chosen = self._index_select(completion, chosen_idx, k)
        rejected = self._index_select(completion, rejected_idx, b - k)
        engine.set_phase(Phase.REFERENCE, step)
        ref_out = ref_loss = ref_completion = None
        if mode is Reference.PRECOMPUTED:
            ref_c = self._index_select(batch[7], chosen_idx, k)
            ref_r = self._index_select(batch[7], rejected_idx, b - k)
            ref_kl = ops.ref(batch[8])
        else:
            with self.no_grad():
                if mode is Reference.ADAPTERS:
                    with self.adapters_off(m):
                        ref_kl = self._kl_logps(m, kl_ids, d, n_tokens, KTO_OUTPUTS)
                        ref_out, ref_loss = self.log_probs(m, ids, d, n_tokens, KTO_OUTPUTS, grad=False)
                else:
                    ref_kl = self._kl_logps(self.ref, kl_ids, d, n_tokens, REF_OUTPUTS)
                    ref_out, ref_loss = self.log_probs(self.ref, ids, d, n_tokens, REF_OUTPUTS, grad=False)
                ref_completion = self.reduce(ref_out[0], b)
                ref_c = self._index_select(ref_completion, chosen_idx, k)
                ref_r = self._index_select(ref_completion, rejected_idx, b - k)
        engine.set_phase(Phase.FORWARD, step)
        diff = ops.new(b, "f32")  # no gradient reaches kl: (KL_logps - ref_KL_logps).mean().detach()
        m1 = ops.new(1, "f32")
        ops.drop(diff)
        m2 = ops.new(1, "f32")
        ops.drop(m1)
        kl = ops.new(1, "f32")
        ops.drop(m2)
        tails = []
        for x, rx, sign in ((chosen, ref_c, 1), (rejected, ref_r, -1)):
            lr = self.sub(x, rx)
            inner = ops.new(lr.numel, "f32")  # (lr - kl) or (kl - lr): the gradient of lr passes or is negated
            engine.node(inner, [(lr, 0 if sign > 0 else ops.gbytes(lr))])
            scaled = self.scalar_op(inner)
            ops.drop(inner)
            sig = ops.unary(scaled, save_output=True)
            ops.drop(scaled)
            loss_part = ops.new(sig.numel, "f32")  # 1 - sigmoid: rsub, the gradient negated
            engine.node(loss_part, [(sig, ops.gbytes(sig))])
            ops.drop(sig)
            tails.append((lr, loss_part))
        weighted = [self.scalar_op(t[1]) for t in tails]
        losses = ops.new(b, "f32")
        engine.node(losses, [(w, 0) for w in weighted])  # cat: backward narrows (views)
        ops.drop(*weighted)
        loss = self._nanmean(losses)
        ops.drop(losses, kl, *[t for pair in tails for t in pair], chosen, rejected, ref_c, ref_r, ref_kl, kl_logps,
                 chosen_idx, rejected_idx, completion, ref_completion, labels, policy_loss, *outputs, *counts)
        if ref_out is not None:
            ops.drop(*ref_out, ref_loss)
        return loss, batch

    def _nanmean(self, x: Storage) -> Storage:
        """``torch.nanmean`` as its decomposition runs: nansum over the count of non-NaN elements."""
        ops, engine = self.ops, self.engine
        isnan = ops.new(x.numel, "bool")
        notnan = ops.new(x.numel, "bool")
        ops.drop(isnan)
        count = ops.new(1, "i64")
        ops.drop(notnan)
        total = ops.new(1, "f32")
        nb = ops.gbytes(x)
        engine.node(total, [(x, nb)], [x], (Temp(0, x.numel), Temp(0, nb), FreeTemp(0), Grad(0), FreeTemp(0)))
        out = ops.new(1, "f32")
        engine.node(out, [(total, 4)], [count])
        ops.drop(total, count)
        return out


PROGRAM = KtoProgram
