"""TRL 1.16.0's fused LM head on the symbolic engine (``add_fused_lm_head`` / ``ChunkedLogProbFunction``): the
estimator's mirror of :mod:`vramlab.core.simulation.trl_head`, line by line. SFT's loss kernel ``trl``
(:meth:`TrlHead.sft_loss`, run by the step driver) and the objectives' log-probabilities
(:class:`vramlab.core.objectives.shared.program.ObjectiveProgram`, a subclass) both run through it.

Sizes are concrete (the selected tokens and the batch), so no polynomial is needed. No torch here.
"""

from __future__ import annotations

from vramlab.core.estimator.engine import Buf, Engine, Storage
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.kinds import Kind
from vramlab.core.objectives.shared.trl import SFT_OUTPUTS, TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE

SIZE = {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "bool": 1}


class TrlHead:
    """The head's ops on ``ops`` / ``engine`` (a step model's), with the small ops of TRL's losses."""

    def __init__(self, ops, engine: Engine) -> None:  # noqa: ANN001 - the step model's Ops
        self.ops, self.engine = ops, engine

    # ---- small ops ----------------------------------------------------------------------------------------
    def scalar_op(self, x: Storage, dtype: str | None = None, through: bool = False) -> Storage:
        """``x op python-scalar``: ``+``/``-`` pass the gradient through, ``*``/``/`` allocate it."""
        out = self.ops.new(x.numel, dtype or x.dtype)
        self.engine.node(out, [(x, 0 if through else self.ops.gbytes(x))])
        return out

    def reduce(self, x: Storage, numel: int, dtype: str | None = None) -> Storage:
        """``x.sum(dim)`` / ``x.mean()``: backward expands the gradient to x's size."""
        out = self.ops.new(numel, dtype or x.dtype)
        self.engine.node(out, [(x, self.ops.gbytes(x))])
        return out

    # ---- the fused LM head ---------------------------------------------------------------------------------
    def head_dtype(self, model: Model, hidden: Storage) -> str:
        return model.cdt if model.amp else hidden.dtype

    def chunked_logprob(self, model: Model, hidden: Storage, targets: Storage, cd: str,
                        outputs: tuple[str, ...]) -> list[Storage | None]:
        ops, engine = self.ops, self.engine
        n = int(hidden.numel) // model.spec.hidden_size
        hid = model.spec.hidden_size
        vocab = model.spec.vocab_size
        weight, bias = model.head.w, model.head.bias
        stats = [ops.new(n, "f32") for _ in range(7)]
        running_max, sum_exp, x_sum_exp, _sq, z_sum, max_before, target_logit = stats
        mm = ops.new(min(n, TOKEN_CHUNK_SIZE) * VOCAB_CHUNK_SIZE, cd)
        last = self._tiles(n, hid, vocab, hidden, weight, bias, cd)
        log = ops.new(n, "f32")
        log_z = ops.new(n, "f32")
        ops.drop(log)
        logprobs = ops.new(n, "f32")
        entropy = mean_logits = is_top1 = None
        if "entropy" in outputs:
            div = ops.new(n, "f32")
            entropy = ops.new(n, "f32")
            ops.drop(div)
        if "mean_logits" in outputs:
            mean_logits = ops.new(n, "f32")
        if "is_top1" in outputs:
            a, b = ops.new(n, "bool"), ops.new(n, "bool")
            is_top1 = ops.new(n, "bool")
            ops.drop(a, b)
        saved = [hidden, targets, log_z] + ([entropy] if entropy is not None else [])

        def backward(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
            gh = engine.alloc(n * hid * 4) if hidden.rg else None
            gw = engine.alloc(vocab * hid * 4) if weight.rg else None
            gb = engine.alloc(vocab * 4) if bias is not None and bias.rg else None
            mm2 = engine.alloc(min(n, TOKEN_CHUNK_SIZE) * VOCAB_CHUNK_SIZE * SIZE[cd])
            last = self._tiles(n, hid, vocab, hidden, weight, bias, cd, backward=True)
            out = []
            for g, x in ((gh, hidden), (gw, weight), (gb, bias)):
                if g is None:
                    out.append(None)
                elif x.dtype == "f32":
                    out.append(g)
                else:
                    out.append(engine.alloc(x.numel * SIZE[x.dtype]))
            for t in (mm2, *last):  # TRL's locals, alive while the gradients are cast
                engine.drop(t)
            for g, o in zip((gh, gw, gb), out):
                if g is not None and o is not g:
                    engine.drop(g)
            engine.release_gradient(buf)
            for t in node.saved:
                engine.drop(t)
            for x, o in zip((hidden, weight, bias), out):
                if o is not None:
                    engine.deliver(x, Buf(o))

        edges = [(hidden, 0), (weight, 0)] + ([(bias, 0)] if bias is not None else [])
        engine.node(logprobs, edges, saved, special=backward)
        if entropy is not None:
            entropy.rg = logprobs.rg  # a differentiable output (its gradient never flows: used detached)
        ops.drop(*stats, mm, log_z, *last)
        return [logprobs, entropy, mean_logits, is_top1]

    def _tiles(self, n: int, hid: int, vocab: int, hidden: Storage, weight: Storage, bias: Storage | None,
               cd: str, backward: bool = False) -> list[Storage]:
        """The tile loop: the token chunk and every vocabulary slice cast to the compute dtype when theirs
        differs (a slice lives until the next one in backward, where it is a named local). Returns the last
        chunks, which live until the function returns."""
        engine = self.engine
        prev_h = prev_w = None
        for token_start in range(0, n, TOKEN_CHUNK_SIZE):
            rows = min(TOKEN_CHUNK_SIZE, n - token_start)
            hc = engine.alloc(rows * hid * SIZE[cd]) if hidden.dtype != cd else None
            if prev_h is not None:
                engine.drop(prev_h)
            prev_h = hc
            for start in range(0, vocab, VOCAB_CHUNK_SIZE):
                cols = min(VOCAB_CHUNK_SIZE, vocab - start)
                wc = engine.alloc(cols * hid * SIZE[cd]) if weight.dtype != cd else None
                if backward:
                    if prev_w is not None:
                        engine.drop(prev_w)
                    prev_w = wc
                elif wc is not None:
                    engine.drop(wc)
                if bias is not None and bias.dtype != cd:
                    engine.drop(engine.alloc(cols * SIZE[cd]))
        return [t for t in (prev_h, prev_w) if t is not None]

    def compact(self, x: Storage, numel: int) -> Storage:
        """``new_zeros(mask.shape).masked_scatter(mask, x)`` (see the builder's Compact)."""
        ops, engine = self.ops, self.engine
        zeros = ops.new(numel, x.dtype)
        out = ops.new(numel, x.dtype)
        prefix = ops.new(numel, "i64")
        ops.drop(prefix, zeros)
        n = int(x.numel)
        if x.dtype == "f32" and x.rg:
            def backward(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
                nz = engine.alloc(n * 2 * 8)
                g = engine.alloc(n * 4)
                engine.drop(nz)
                engine.release_gradient(buf)
                engine.deliver(x, Buf(g))

            engine.node(out, [(x, 0)], special=backward)
        return out

    def fused_head(self, model: Model, h: Storage, d: Dims, n_tokens: int,
                   outputs: tuple[str, ...]) -> tuple[list[Storage | None], Storage]:
        ops, engine = self.ops, self.engine
        engine.region, old = Kind.LOGITS, engine.region
        hid = model.spec.hidden_size
        rows1 = d.b * (d.s - 1)
        hs = engine.view(h, rows1 * hid)
        engine.node(hs, [(h, ops.gbytes(h))])  # h[:, :-1]: slice_backward makes zeros of h's size
        mask = ops.new(rows1, "bool")
        nz = ops.new(n_tokens * 2, "i64")  # the index kernel's nonzero, freed when it returns
        sel = ops.new(n_tokens * hid, hs.dtype)
        ops.drop(nz)
        engine.node(sel, [(hs, rows1 * hid * SIZE[hs.dtype])], [mask])  # IndexBackward: zeros of hs's size
        nz2 = ops.new(n_tokens * 2, "i64")
        targets = ops.new(n_tokens, "i64")
        ops.drop(nz2)
        per_token = self.chunked_logprob(model, sel, targets, self.head_dtype(model, h), outputs)
        ops.drop(sel, targets)
        scattered = [None if x is None else self.compact(x, rows1) for x in per_token]
        ops.drop(*per_token)
        lp = scattered[0]
        s = self.reduce(lp, 1)
        neg = self.scalar_op(s)
        ops.drop(s)
        ms = ops.new(1, "i64")
        cl = ops.new(1, "i64")
        ops.drop(ms)
        loss = ops.new(1, "f32")
        engine.node(loss, [(neg, 4)], [cl])
        ops.drop(neg, cl, hs)
        engine.region = old
        return [*scattered, mask], loss

    def sft_loss(self, model: Model, h: Storage, d: Dims) -> Storage:
        """SFTTrainer.compute_loss through the fused head (``sft_loss`` in core/simulation/trl_head.py): the head's
        per-token outputs for every shifted position, ``-log_probs`` summed, divided by the label count."""
        ops, engine = self.ops, self.engine
        outs, own = self.fused_head(model, h, d, d.b * (d.s - 1), SFT_OUTPUTS)
        engine.region, old = Kind.LOGITS, engine.region
        neg = self.scalar_op(outs[0])  # -log_probs: NegBackward makes -grad
        count = ops.new(1, "i64")  # label_mask.sum()
        total = ops.new(1, "f32")  # .sum(): SumBackward expands the gradient (a view)
        engine.node(total, [(neg, 0)])
        clamped = ops.new(1, "i64")
        loss = ops.new(1, "f32")
        engine.node(loss, [(total, 4)], [clamped])  # DivBackward: grad / other
        engine.region = old
        ops.drop(total, clamped, neg, count, own, *(x for x in outs if x is not None))
        return loss
