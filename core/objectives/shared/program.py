"""DPO / IPO and GRPO steps on the symbolic engine, mirroring :mod:`vramlab.core.simulation.objective` line by
line (which follows TRL 1.16.0; see its docstring for the functions followed and what CUDA allocates).

Sizes are concrete here (the prompt and completion lengths and the batch), so no polynomial is needed. The
one shortcut: ``transformers.generate`` makes a forward per completion token whose allocations grow
monotonically with the cache, so the replay runs the prefill, then sets every layer's cache, the ids and the
attention mask to their size before the last token, and runs the last decode step exactly: the peak of
generation is in that step (or in the prefill), and the simulation, which runs every token, checks it.
"""

from __future__ import annotations

from vramlab.core.estimator.engine import Buf, Engine, FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.kinds import Kind, Phase
from vramlab.core.spec import GenerationBackend, Objective, Reference, TrainingSetup

TOKEN_CHUNK_SIZE = 4096  # trl/kernels/chunked_logprob.py
VOCAB_CHUNK_SIZE = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
GRPO_OUTPUTS = ("log_probs", "entropy")
REF_OUTPUTS = ("log_probs",)
KTO_OUTPUTS = ("log_probs", "entropy", "mean_logits")
SIZE = {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "bool": 1}


class ObjectiveProgram:
    """The objective's forwards and loss for a :class:`~vramlab.core.estimator.driver.StepModel`."""

    def __init__(self, sm, ref: Model | None) -> None:  # noqa: ANN001 - a StepModel (the driver imports this)
        self.sm, self.m, self.ref = sm, sm.m, ref
        self.ops, self.engine = sm.ops, sm.engine
        self.setup: TrainingSetup = sm.setup
        self.buffer: dict[str, Storage] | None = None

    # ---- small ops ----------------------------------------------------------------------------------------
    def _sub(self, a: Storage, b: Storage) -> Storage:
        """``a - b`` (same shape): a's gradient passes through, b's is ``-grad`` (allocated)."""
        out = self.ops.new(max(a.numel, b.numel), a.dtype)
        self.engine.node(out, [(a, 0 if a.numel == out.numel else self.ops.gbytes(a)), (b, self.ops.gbytes(b))])
        return out

    def _scalar_op(self, x: Storage, dtype: str | None = None, through: bool = False) -> Storage:
        """``x op python-scalar``: ``+``/``-`` pass the gradient through, ``*``/``/`` allocate it."""
        out = self.ops.new(x.numel, dtype or x.dtype)
        self.engine.node(out, [(x, 0 if through else self.ops.gbytes(x))])
        return out

    def _reduce(self, x: Storage, numel: int, dtype: str | None = None) -> Storage:
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
        nz = ops.new(n_tokens * 2, "i64")
        sel = ops.new(n_tokens * hid, hs.dtype)
        engine.node(sel, [(hs, rows1 * hid * SIZE[hs.dtype])], [nz])  # IndexBackward: zeros of hs's size
        ops.drop(nz)
        nz2 = ops.new(n_tokens * 2, "i64")
        targets = ops.new(n_tokens, "i64")
        ops.drop(nz2)
        per_token = self.chunked_logprob(model, sel, targets, self.head_dtype(model, h), outputs)
        ops.drop(sel, targets)
        scattered = [None if x is None else self.compact(x, rows1) for x in per_token]
        ops.drop(*per_token)
        lp = scattered[0]
        s = self._reduce(lp, 1)
        neg = self._scalar_op(s)
        ops.drop(s)
        ms = ops.new(1, "i64")
        cl = ops.new(1, "i64")
        ops.drop(ms)
        loss = ops.new(1, "f32")
        engine.node(loss, [(neg, 4)], [cl])
        ops.drop(neg, cl, hs)
        engine.region = old
        return [*scattered, mask], loss

    def log_probs(self, model: Model, ids: Storage, d: Dims, n_tokens: int, outputs: tuple[str, ...],
                  grad: bool) -> tuple[list[Storage | None], Storage]:
        sm = self.sm if model is self.m else self.ref_sm
        h = sm.backbone(ids, d, checkpointing=None if grad else False)
        out = self.fused_head(model, h, d, n_tokens, outputs)
        self.ops.drop(h)
        return out

    def _labels(self, ids: Storage) -> Storage:
        """``ids.masked_fill(mask == 0, -100)``."""
        b = self.ops.new(ids.numel, "bool")
        out = self.ops.new(ids.numel, "i64")
        self.ops.drop(b)
        return out

    def _no_grad(self):  # noqa: ANN202
        engine = self.engine

        class _Ctx:
            def __enter__(self) -> None:
                self.old = engine.grad_enabled
                engine.grad_enabled = False

            def __exit__(self, *a: object) -> None:
                engine.grad_enabled = self.old

        return _Ctx()

    def _adapters_off(self, model: Model):  # noqa: ANN202
        lins = [lin for L in model.layers for group in ("attn", "mlp") for lin in L.get(group, {}).values()
                if lin.lora]
        lins += [lin for L in model.layers for ex in L.get("experts", []) for lin in ex.values() if lin.lora]

        class _Ctx:
            def __enter__(self) -> None:
                for lin in lins:
                    lin.lora = False

            def __exit__(self, *a: object) -> None:
                for lin in lins:
                    lin.lora = True

        return _Ctx()

    # ---- DPO / IPO -------------------------------------------------------------------------------------------
    def dpo(self, step: int) -> tuple[Storage, list[Storage]]:
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        b = setup.micro_batch
        rows, s = 2 * b, setup.seq_len
        d = Dims(rows, s, rows > 1)
        ids = ops.new(rows * s, "i64", Kind.INPUTS)
        attn = ops.new(rows * s, "i64", Kind.INPUTS)
        cmask = ops.new(rows * s, "i64", Kind.INPUTS)
        n_tokens = rows * setup.completion_tokens
        labels = self._labels(ids)
        outputs, policy_loss = self.log_probs(m, ids, d, n_tokens, DPO_OUTPUTS, grad=True)
        logps = self._reduce(outputs[0], rows)
        chosen, rejected = m.chunk2(logps)
        ops.drop(logps)
        mode = setup.reference_mode
        engine.set_phase(Phase.REFERENCE, step)
        ref_out = ref_loss = ref_logps = None
        if mode is Reference.PRECOMPUTED:
            ref_c, ref_r = ops.new(b, "f32", Kind.INPUTS), ops.new(b, "f32", Kind.INPUTS)
        else:
            with self._no_grad():
                if mode is Reference.ADAPTERS:
                    with self._adapters_off(m):
                        ref_out, ref_loss = self.log_probs(m, ids, d, n_tokens, DPO_OUTPUTS, grad=False)
                else:
                    ref_out, ref_loss = self.log_probs(self.ref, ids, d, n_tokens, REF_OUTPUTS, grad=False)
                ref_logps = ops.new(rows, "f32")
                ref_c, ref_r = engine.view(ref_logps, b), engine.view(ref_logps, b)
        engine.set_phase(Phase.FORWARD, step)
        c = self._sub(chosen, ref_c)
        r = self._sub(rejected, ref_r)
        delta = self._sub(c, r)
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
            ipo = self._sub(avgs[0], avgs[1])
            shifted = self._scalar_op(ipo, through=True)
            per_seq = ops.new(b, "f32")
            nb = b * 4
            engine.node(per_seq, [(shifted, nb)], [shifted],
                        (Temp(0, nb), Temp(0, nb), FreeTemp(0), Grad(0), FreeTemp(0)))
            ops.drop(ipo, shifted, *avgs, cm, rm)
        else:
            scaled = self._scalar_op(delta)
            ls = ops.new(b, "f32")
            buffer = ops.new(b, "f32") if engine.match_simulation else None  # log_sigmoid's CPU buffer
            engine.node(ls, [(scaled, ops.gbytes(scaled))], [scaled] + ([buffer] if buffer is not None else []))
            per_seq = self._scalar_op(ls)
            ops.drop(scaled, ls, buffer)
        mean = self._reduce(per_seq, 1)
        weighted = self._scalar_op(mean)
        loss = self._scalar_op(weighted, through=True)
        ops.drop(mean, weighted, per_seq, c, r, delta, chosen, rejected, ref_c, ref_r, ref_logps)
        ops.drop(*outputs, policy_loss, labels)
        if ref_out is not None:
            ops.drop(*ref_out, ref_loss)
        return loss, [ids, attn, cmask]


    # ---- ORPO / CPO / SimPO (trl.experimental ORPOTrainer / CPOTrainer: full logits, no reference) ----------
    def pair(self) -> tuple[Storage, list[Storage]]:
        """The builder's ``pair_loss`` (see its docstring for TRL's functions followed)."""
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        obj = setup.objective
        b, s, V = setup.micro_batch, setup.seq_len, m.spec.vocab_size
        rows = 2 * b
        d = Dims(rows, s, rows > 1)
        ids = ops.new(rows * s, "i64", Kind.INPUTS)
        attn = ops.new(rows * s, "i64", Kind.INPUTS)
        lab = ops.new(rows * s, "i64", Kind.INPUTS)
        h = self.sm.backbone(ids, d)
        engine.region, old = Kind.LOGITS, engine.region
        logits = m.linear(m.head, h, rows * s)
        ops.drop(h)
        if m.spec.final_logit_softcap:  # Gemma 2's softcap in the model's forward: / cap, tanh, * cap
            for save in (False, True, False):
                nxt = ops.unary(logits, save_output=save)
                ops.drop(logits)
                logits = nxt
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
        if m.amp:  # cross_entropy is on autocast's fp32 list: the bf16 copy goes with the rebinding
            lg32 = ops.cast(lg, "f32")
            ops.drop(lg)
            lg = lg32
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
        summed = self._reduce(masked, rows)
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
        ops.drop(all_logps)
        if obj is Objective.ORPO:
            diff = self._sub(chosen, rejected)  # the expression's temporaries go as it is evaluated
            lc, lr = self._log1mexp(chosen), self._log1mexp(rejected)
            d2 = self._sub(lc, lr)
            ops.drop(lc, lr)
            log_odds = self._sub(diff, d2)
            ops.drop(diff, d2)
            ratio = self._logsigmoid(log_odds)
            losses = self._scalar_op(ratio)
            ops.drop(ratio)
            mean = self._reduce(losses, 1)
            loss = self._sub(nll, mean)
            ops.drop(log_odds, losses, mean)
        else:
            diff = self._sub(chosen, rejected)
            if obj is Objective.SIMPO:
                d2 = self._scalar_op(diff, through=True)
                ops.drop(diff)
                diff = d2
            terms = []
            for _sign in (1, -1):
                scaled = self._scalar_op(diff)
                ls = self._logsigmoid(scaled)
                ops.drop(scaled)
                t = self._scalar_op(ls)  # -F.logsigmoid(...) (neg) or F.logsigmoid(...) * 0.0
                ops.drop(ls)
                if _sign > 0:
                    t2 = self._scalar_op(t)  # * (1 - label_smoothing)
                    ops.drop(t)
                    t = t2
                terms.append(t)
            losses = self._sub(*terms)
            ops.drop(*terms)
            mean = self._reduce(losses, 1)
            alpha_nll = self._scalar_op(nll)
            loss = ops.add(mean, alpha_nll)
            ops.drop(diff, losses, mean, alpha_nll)
        ops.drop(chosen, rejected, nll)
        return loss, [ids, attn, lab]

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

    # ---- KTO -------------------------------------------------------------------------------------------------
    def _kl_logps(self, model: Model, ids: Storage, d: Dims, n_tokens: int, outputs: tuple[str, ...]) -> Storage:
        ops = self.ops
        labels = self._labels(ids)
        with self._no_grad():
            out, loss = self.log_probs(model, ids, d, n_tokens, outputs, grad=False)
        ops.drop(*out[1:], loss)  # the output object is a temporary: only log_probs is kept
        kl = self._reduce(out[0], d.b)
        ops.drop(out[0], labels)
        return kl

    def _index_select(self, x: Storage, idx: Storage, n: int) -> Storage:
        """``x.index_select(0, idx)``: saves the index; backward makes zeros of x's size and adds into them."""
        out = self.ops.new(n, x.dtype)
        self.engine.node(out, [(x, self.ops.gbytes(x))], [idx])
        return out

    def kto(self, step: int) -> tuple[Storage, list[Storage]]:
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        b, s = setup.micro_batch, setup.seq_len
        d = Dims(b, s, b > 1)
        batch = [ops.new(b * s, "i64", Kind.INPUTS) for _ in range(6)] + [ops.new(b, "bool", Kind.INPUTS)]
        ids, kl_ids = batch[0], batch[3]
        mode = setup.reference_mode
        if mode is Reference.PRECOMPUTED:
            batch += [ops.new(b, "f32", Kind.INPUTS), ops.new(b, "f32", Kind.INPUTS)]
        n_tokens = b * setup.completion_tokens
        kl_logps = self._kl_logps(m, kl_ids, d, n_tokens, KTO_OUTPUTS)
        labels = self._labels(ids)
        outputs, policy_loss = self.log_probs(m, ids, d, n_tokens, KTO_OUTPUTS, grad=True)
        completion = self._reduce(outputs[0], b)
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
            with self._no_grad():
                if mode is Reference.ADAPTERS:
                    with self._adapters_off(m):
                        ref_kl = self._kl_logps(m, kl_ids, d, n_tokens, KTO_OUTPUTS)
                        ref_out, ref_loss = self.log_probs(m, ids, d, n_tokens, KTO_OUTPUTS, grad=False)
                else:
                    ref_kl = self._kl_logps(self.ref, kl_ids, d, n_tokens, REF_OUTPUTS)
                    ref_out, ref_loss = self.log_probs(self.ref, ids, d, n_tokens, REF_OUTPUTS, grad=False)
                ref_completion = self._reduce(ref_out[0], b)
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
            lr = self._sub(x, rx)
            inner = ops.new(lr.numel, "f32")  # (lr - kl) or (kl - lr): the gradient of lr passes or is negated
            engine.node(inner, [(lr, 0 if sign > 0 else ops.gbytes(lr))])
            scaled = self._scalar_op(inner)
            ops.drop(inner)
            sig = ops.unary(scaled, save_output=True)
            ops.drop(scaled)
            loss_part = ops.new(sig.numel, "f32")  # 1 - sigmoid: rsub, the gradient negated
            engine.node(loss_part, [(sig, ops.gbytes(sig))])
            ops.drop(sig)
            tails.append((lr, loss_part))
        weighted = [self._scalar_op(t[1]) for t in tails]
        losses = ops.new(b, "f32")
        engine.node(losses, [(w, 0) for w in weighted])  # cat: backward narrows (views)
        ops.drop(*weighted)
        loss = self._nanmean(losses)
        ops.drop(losses, kl, *[t for pair in tails for t in pair], chosen, rejected, ref_c, ref_r, ref_kl, kl_logps,
                 chosen_idx, rejected_idx, completion, ref_completion, labels, policy_loss, *outputs)
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

    # ---- GRPO ------------------------------------------------------------------------------------------------
    def prepare(self, step: int) -> None:
        setup, ops, engine = self.setup, self.ops, self.engine
        if setup.objective is not Objective.GRPO:
            return
        rows = setup.micro_batch * setup.generation_steps
        old_buffer = self.buffer
        if setup.generation_backend is GenerationBackend.TRANSFORMERS:
            engine.set_phase(Phase.GENERATE, step)
            gen = self.generate(rows)
        else:
            p, c = setup.prompt_tokens, setup.completion_tokens
            gen = {"prompt_ids": ops.new(rows * p, "i64", Kind.INPUTS),
                   "prompt_mask": ops.new(rows * p, "i64", Kind.INPUTS),
                   "completion_ids": ops.new(rows * c, "i64", Kind.INPUTS),
                   "completion_mask": ops.new(rows * c, "i64", Kind.INPUTS),
                   "advantages": ops.new(rows, "f32", Kind.INPUTS)}
        mode = setup.reference_mode
        old = needs_old_logps(setup)
        if old or mode is not Reference.NONE:
            engine.set_phase(Phase.REFERENCE, step)
        with self._no_grad():
            if old:
                gen["old"] = self.score(self.m, gen, GRPO_OUTPUTS)
            if mode is Reference.ADAPTERS:
                with self._adapters_off(self.m):
                    gen["ref"] = self.score(self.m, gen, GRPO_OUTPUTS)
            elif mode is Reference.COPY:
                gen["ref"] = self.score(self.ref, gen, REF_OUTPUTS)
        self.buffer = gen
        if old_buffer is not None:
            ops.drop(*old_buffer.values())

    def _kv_hook(self, caches: dict):  # noqa: ANN202
        ops, engine = self.ops, self.engine

        def update(L: dict, k: Storage, v: Storage) -> tuple[Storage, Storage]:
            old_k, old_v = caches.get(id(L), (None, None))
            engine.region, prev = Kind.KV_CACHE, engine.region
            nk = ops.new((old_k.numel if old_k is not None else 0) + k.numel, k.dtype)
            ops.drop(old_k)
            nv = ops.new((old_v.numel if old_v is not None else 0) + v.numel, v.dtype)
            ops.drop(old_v)
            engine.region = prev
            caches[id(L)] = (nk, nv)
            ops.drop(k, v)
            return ops.ref(nk), ops.ref(nv)

        return update

    def generate(self, rows: int) -> dict[str, Storage]:
        ops, engine, setup, m, sm = self.ops, self.engine, self.setup, self.m, self.sm
        p, c = setup.prompt_tokens, setup.completion_tokens
        V, hid = m.spec.vocab_size, m.spec.hidden_size
        ids = ops.new(rows * p, "i64", Kind.INPUTS)
        attn = ops.new(rows * p, "i64", Kind.INPUTS)
        caches: dict[int, tuple[Storage, Storage]] = {}
        m.kv = self._kv_hook(caches)
        m.training, amp = False, m.amp
        m.amp = False
        old_grad, engine.grad_enabled = engine.grad_enabled, False
        step_ids = ops.ref(ids)
        next_logits = probs = None
        length = p  # tokens in ids
        iterations = list(range(c))
        if c >= 3:
            iterations = [0, c - 1]
        for i in iterations:
            if i == c - 1 and c >= 3:  # the cache, ids and mask as they are before the last token
                length = p + c - 1
                for tag, L in enumerate(m.layers):
                    engine.tag = tag
                    ok, ov = caches[id(L)]
                    per_tok_k, per_tok_v = int(ok.numel) // p, int(ov.numel) // p
                    engine.region, prev = Kind.KV_CACHE, engine.region
                    nk = ops.new(per_tok_k * (p + c - 2), ok.dtype)
                    ops.drop(ok)
                    nv = ops.new(per_tok_v * (p + c - 2), ov.dtype)
                    ops.drop(ov)
                    engine.region = prev
                    caches[id(L)] = (nk, nv)
                engine.tag = -1
                new_ids = ops.new(rows * length, "i64", Kind.INPUTS)
                ops.drop(ids)
                ids = new_ids
                new_attn = ops.new(rows * length, "i64", Kind.INPUTS)
                ops.drop(attn)
                attn = new_attn
                ops.drop(step_ids)
                step_ids = engine.view(ids, rows)
            s = p if i == 0 else 1
            d = Dims(rows, s, rows > 1)
            h = sm.backbone(step_ids, d, checkpointing=False)
            last = engine.view(h, rows * hid)
            logits = m.linear(m.head, last, rows)
            ops.drop(last, h)
            ones = ops.new(rows, "i64", Kind.INPUTS)
            new_attn = ops.new(rows * (length + 1), "i64", Kind.INPUTS)
            ops.drop(ones, attn)
            attn = new_attn
            nl = ops.new(rows * V, "f32")
            ops.drop(next_logits)
            next_logits = nl
            pr = ops.new(rows * V, "f32")
            ops.drop(probs)
            probs = pr
            tokens = ops.new(rows, "i64")
            new_ids = ops.new(rows * (length + 1), "i64", Kind.INPUTS)
            ids_old, ids = ids, new_ids
            ops.drop(tokens, logits)
            length += 1
            ops.drop(step_ids)  # the view of the previous ids: they go now
            ops.drop(ids_old)
            step_ids = engine.view(ids, rows)
        ops.drop(next_logits, probs, step_ids)
        engine.grad_enabled = old_grad
        m.kv = None
        m.training, m.amp = True, amp
        for tag, L in enumerate(m.layers):
            engine.tag = tag
            ops.drop(*caches.pop(id(L)))
        engine.tag = -1
        out = {"completion_ids": ops.new(rows * c, "i64", Kind.INPUTS),
               "prompt_ids": ops.new(rows * p, "i64", Kind.INPUTS)}
        out["prompt_mask"] = ops.new(rows * p, "i64", Kind.INPUTS)
        out["completion_mask"] = ops.new(rows * c, "i64", Kind.INPUTS)
        out["advantages"] = ops.new(rows, "f32", Kind.INPUTS)
        ops.drop(ids, attn)
        return out

    def score(self, model: Model, gen: dict[str, Storage], outputs: tuple[str, ...]) -> Storage:
        ops, setup = self.ops, self.setup
        rows_all = setup.micro_batch * setup.generation_steps
        s, c, b = setup.seq_len, setup.completion_tokens, setup.micro_batch
        ids = ops.new(rows_all * s, "i64")
        attn = ops.new(rows_all * s, "i64")
        kept = []
        out = loss = None
        for _start in range(0, rows_all, b):
            idb = self.engine.view(ids, b * s)
            labels = self._labels(idb)
            new_out, new_loss = self.log_probs(model, idb, Dims(b, s, b > 1), b * c, outputs, grad=False)
            if out is not None:
                ops.drop(*out, loss)
            out, loss = new_out, new_loss
            kept.append(self.engine.view(out[0], b * c))
            ops.drop(labels, idb)
        ops.drop(*out)
        result = ops.new(rows_all * c, "f32", Kind.INPUTS)
        ops.drop(*kept, ids, attn, loss)
        return result

    def grpo(self, i: int) -> tuple[Storage, list[Storage]]:
        ops, engine, setup, m = self.ops, self.engine, self.setup, self.m
        b, s, c = setup.micro_batch, setup.seq_len, setup.completion_tokens
        buf = self.buffer
        views = {k: engine.view(v, b * (c if k != "advantages" else 1)) for k, v in buf.items()}
        ids = ops.new(b * s, "i64")
        attn = ops.new(b * s, "i64")
        labels = self._labels(ids)
        d = Dims(b, s, b > 1)
        out, head_loss = self.log_probs(m, ids, d, b * c, GRPO_OUTPUTS, grad=True)
        cats = []
        for x in out[:2]:
            v = engine.view(x, b * c)
            engine.node(v, [(x, ops.gbytes(x))])  # [:, -c:]: slice_backward makes zeros of x's size
            y = ops.new(b * c, "f32")
            engine.node(y, [(v, 0)])  # torch.cat of one tensor: a copy, backward a view
            ops.drop(v)
            cats.append(y)
        per, ent = cats
        ops.drop(*out, head_loss, labels)
        old = views.get("old")
        if old is None:
            old = engine.view(per, rg=False)  # per_token_logps.detach()
        log_ratio = self._sub(per, old)
        coef_1 = ops.unary(log_ratio, save_output=True)
        ops.drop(log_ratio)
        beta = setup.beta_value
        kl = None
        if beta != 0.0:
            ref = views["ref"]
            d1 = self._sub(ref, per)
            e = ops.unary(d1, save_output=True)
            ops.drop(d1)
            d2 = self._sub(ref, per)
            t = self._sub(e, d2)
            ops.drop(e, d2)
            kl = self._scalar_op(t, through=True)
            ops.drop(t)
        nb = b * c * 4
        coef_2 = ops.new(b * c, "f32")
        engine.node(coef_2, [(coef_1, nb)], [coef_1])
        adv = views["advantages"]
        l1 = ops.mul(coef_1, adv)
        l2 = ops.mul(coef_2, adv)
        mn = ops.new(b * c, "f32")
        engine.node(mn, [(l1, nb), (l2, nb)], [l1, l2])
        ptl = self._scalar_op(mn)
        ops.drop(mn, l1, l2)
        if kl is not None:
            bk = self._scalar_op(kl)
            p2 = ops.add(ptl, bk)
            ops.drop(ptl, bk)
            ptl = p2
        msum = ops.new(1, "i64")
        norm = ops.new(1, "f32")
        ops.drop(msum)
        mask = views["completion_mask"]
        prod = ops.mul(ptl, mask)
        sm_ = self._reduce(prod, 1)
        loss = ops.new(1, "f32")
        engine.node(loss, [(sm_, 4)], [norm])
        ops.drop(sm_, prod, norm, ptl, coef_1, coef_2, kl, old, per, ent)
        ops.drop(ids, attn)
        return loss, list(views.values())

    @property
    def ref_sm(self):  # noqa: ANN201
        from vramlab.core.estimator.driver import StepModel

        if not hasattr(self, "_ref_sm"):
            self._ref_sm = StepModel(self.ref)
        return self._ref_sm


def needs_old_logps(setup: TrainingSetup) -> bool:
    every = setup.generation_steps * setup.num_iterations
    return setup.grad_accum % every != 0 or setup.generation_backend is not GenerationBackend.TRANSFORMERS


def reference_model(setup: TrainingSetup, spec, engine: Engine, plan: list[int]) -> Model | None:  # noqa: ANN001
    """The reference copy: the same layers (and layer plan, so its repeated layers repeat too), frozen, its
    weights in their own dtype; loaded after the policy."""
    if setup.reference_mode is not Reference.COPY:
        return None
    ref = Model(spec, setup.reference_setup(), engine, plan=plan)
    ref.training = False
    engine.region, old = Kind.REFERENCE, engine.region
    ref.load()
    engine.region = old
    for h in ref.params:
        h.rg = False
    ref.params = []
    return ref


__all__ = ["ObjectiveProgram", "reference_model"]
