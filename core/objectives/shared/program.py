"""What the objectives' estimator programs share: the program interface the step driver runs, the small ops of
TRL's losses, TRL's fused LM head (``add_fused_lm_head`` / ``ChunkedLogProbFunction``), peft's
``disable_adapter`` and the reference copy. Mirrors :mod:`vramlab.core.objectives.shared.reference` line by
line (which follows TRL 1.16.0; see its docstring for the functions followed and what CUDA allocates).

Sizes are concrete in the objectives' programs (the prompt and completion lengths and the batch), so no
polynomial is needed. No torch here: the estimator-only build runs these.
"""

from __future__ import annotations

from vramlab.core.estimator.engine import Buf, Engine, Storage
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.kinds import Kind
from vramlab.core.objectives.shared.trl import TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE
from vramlab.core.spec.options import Reference
from vramlab.core.spec.training import TrainingSetup

SIZE = {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "bool": 1}


class ObjectiveProgram:
    """An objective's step on the symbolic engine, run by :meth:`vramlab.core.estimator.driver.StepModel.run`:
    :meth:`prepare` once per optimizer step, :meth:`loss` per micro-batch. ``sm`` is the policy's step model;
    ``ref_sm`` the reference copy's (a step model over :func:`reference_model`'s model), or None."""

    divides_loss = True  # HF Trainer divides the loss by the accumulation steps (a scalar op in the graph)

    def __init__(self, sm, ref_sm=None) -> None:  # noqa: ANN001 - StepModels (the driver, above, runs this)
        self.sm, self.m = sm, sm.m
        self.ref_sm = ref_sm
        self.ref: Model | None = ref_sm.m if ref_sm is not None else None
        self.ops, self.engine = sm.ops, sm.engine
        self.setup: TrainingSetup = sm.setup
        self.buffer: dict[str, Storage] | None = None

    def prepare(self, step: int) -> None:
        """Work once per optimizer step, before its micro-batches (GRPO's generation and scoring)."""

    def loss(self, step: int, i: int, d: Dims) -> tuple[Storage, list[Storage]]:
        """Micro-batch ``i`` of optimizer step ``step`` (``d``: the setup's batch and sequence): its loss and the
        batch tensors, freed after backward."""
        raise NotImplementedError

    # ---- small ops ----------------------------------------------------------------------------------------
    def sub(self, a: Storage, b: Storage) -> Storage:
        """``a - b`` (same shape): a's gradient passes through, b's is ``-grad`` (allocated)."""
        out = self.ops.new(max(a.numel, b.numel), a.dtype)
        self.engine.node(out, [(a, 0 if a.numel == out.numel else self.ops.gbytes(a)), (b, self.ops.gbytes(b))])
        return out

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

    def log_probs(self, model: Model, ids: Storage, d: Dims, n_tokens: int, outputs: tuple[str, ...],
                  grad: bool) -> tuple[list[Storage | None], Storage]:
        sm = self.sm if model is self.m else self.ref_sm
        h = sm.backbone(ids, d, checkpointing=None if grad else False)
        out = self.fused_head(model, h, d, n_tokens, outputs)
        self.ops.drop(h)
        return out

    def labels(self, ids: Storage) -> Storage:
        """``ids.masked_fill(mask == 0, -100)``."""
        b = self.ops.new(ids.numel, "bool")
        out = self.ops.new(ids.numel, "i64")
        self.ops.drop(b)
        return out

    def no_grad(self):  # noqa: ANN202
        engine = self.engine

        class _Ctx:
            def __enter__(self) -> None:
                self.old = engine.grad_enabled
                engine.grad_enabled = False

            def __exit__(self, *a: object) -> None:
                engine.grad_enabled = self.old

        return _Ctx()

    def adapters_off(self, model: Model):  # noqa: ANN202
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

