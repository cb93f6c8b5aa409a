"""The whole training step on the symbolic engine: load, forward, loss, backward, optimizer, two steps.

Mirrors ``core/simulation/step.py`` and ``Decoder.forward``; the optimizer step is :mod:`.optimizer`, the
objective's forwards and loss its unit under ``core/objectives/``.
"""

from __future__ import annotations

from vramlab.core.checks import SetupError
from vramlab.core.estimator import liger, unsloth, unsloth_loss
from vramlab.core.estimator.engine import Buf, Engine, Storage
from vramlab.core.estimator.optimizer import OptimizerModel
from vramlab.core.estimator.poly import Poly
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.estimator.trl_head import TrlHead
from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives import piece
from vramlab.core.objectives.shared.program import reference_model
from vramlab.core.spec.options import Attention, LossKernel, Offload, Sharding, liger_chunk_rows
from vramlab.core.spec.training import TrainingSetup


class StepModel:
    def __init__(self, model: Model) -> None:
        self.m = model
        self.engine = model.engine
        self.ops = model.ops
        self.setup: TrainingSetup = model.setup
        self.managed_bytes: dict[int, Poly] = {}  # paged states by layer tag (the tape's multiplicity applies)
        self.leaves: list[Storage] = []  # tensors kept alive by the graph until the loss is deleted

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, ids: Storage, labels: Storage, d: Dims) -> Storage:
        opened = self.m.amp_region_start()  # HF Trainer's autocast region: the forward and the loss
        loss = self._forward(ids, labels, d)
        self.m.amp_region_end(opened)
        return loss

    def _forward(self, ids: Storage, labels: Storage, d: Dims) -> Storage:
        hn = self.backbone(ids, d)
        loss = self.head_loss(hn, labels, d)
        self.ops.drop(hn)
        return loss

    def head_loss(self, hn: Storage, labels: Storage, d: Dims) -> Storage:
        """The setup's loss kernel on the base model's last hidden states (core/simulation/loss.py ``apply``)."""
        engine = self.engine
        if self.setup.chunked_loss:
            return self.chunked_loss(hn, labels, d)
        if self.setup.loss_kernel is LossKernel.TRL:
            return TrlHead(self.ops, self.engine).sft_loss(self.m, hn, d)
        engine.region, old = Kind.LOGITS, engine.region
        if self.setup.loss_kernel is LossKernel.CCE:
            loss = self.cce_loss(hn, d)
        elif self.setup.loss_kernel is LossKernel.LIGER:
            loss = self.liger_loss(hn, d)
        elif self.m.unsloth is not None and self.m.unsloth.fused_loss:  # FastLanguageModel's forward's loss
            loss = unsloth_loss.fused_loss(self, hn, d)
        else:
            loss = self.loss(hn, labels, d.T, d)
        engine.region = old
        return loss

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        """Decoder.backbone: the final norm's output (``checkpointing`` overrides the setup's)."""
        m, ops, engine = self.m, self.ops, self.engine
        spec, setup = m.spec, self.setup
        ckpt = setup.grad_ckpt if checkpointing is None else checkpointing
        hid = spec.hidden_size
        sh = m.sh if m.sh is not None and m.sh.params_sharded else None
        if sh is not None:
            sh.unshard(-1)  # the root unit stays gathered until the end of backward
        positions = ops.new(d.s, "i64")
        h = ops.new(d.T * hid, m.embed.dtype)
        engine.node(h, [(m.embed, ops.gbytes(m.embed))], [ids])
        if spec.scale_embeddings:
            c = ops.new(1, h.dtype)
            h2 = ops.mul(h, c)
            ops.drop(c, h)
            h = h2
        if (ckpt or (setup.input_grads and engine.grad_enabled)) and not h.rg:
            # HF enable_input_require_grads: requires_grad_() by a hook on the embedding's output, before GPT-2's
            # positions and embedding dropout (which then keeps its mask); a leaf whose .grad the graph keeps
            # until the loss is freed
            h.rg = True
            self.leaves.append(ops.ref(h))
        # transformers' ``inputs_embeds`` (and GPT-2's ``position_embeds``): the base model's locals until it returns
        embeds = [ops.ref(h)]
        if m.pos is not None:
            pe = ops.new(d.s * hid, m.pos.dtype)
            engine.node(pe, [(m.pos, ops.gbytes(m.pos))], [positions])
            h2 = ops.add(h, pe, d.T * hid)
            embeds.append(pe)
            ops.drop(h)
            h = h2
        if spec.embed_dropout:
            h2 = m.dropout(h, spec.embed_dropout)
            ops.drop(h)
            h = h2
        cos, sin = (None, None) if spec.learned_positions else self.rope(d, h.dtype)
        if m.unsloth is not None and m.unsloth.rope and engine.grad_enabled:  # Unsloth's RoPE keeps them on its ctx
            self.leaves += [ops.ref(cos), ops.ref(sin)]
        every = spec.full_attention_every
        # Gemma 3: a table pair per layer type present, the full-attention layers' own (global RoPE)
        full_rope = self.rope(d, h.dtype) if every and spec.num_layers >= every else (cos, sin)
        mask, more = None, []
        if spec.attention_run(setup.attention) is Attention.EAGER:  # one additive mask per layer type
            mask = ops.new(d.b * d.s * d.s, h.dtype)
            more = [ops.new(d.b * d.s * d.s, h.dtype) for _ in range(spec.eager_masks - 1)]
        elif d.masked:
            mask = self.sliding_window_mask(d)
        pending: list[Storage] = []  # masks, position ids: last held by a non-reentrant checkpoint frame
        if ckpt and engine.grad_enabled and not spec.learned_positions:
            # transformers' checkpointed layers take the masks by keyword (GPT-2's blocks by position): the
            # reentrant mode's run function, which the graph keeps, holds them to the end of backward; the
            # non-reentrant mode's lives in the layer's checkpoint frame, which goes when the layer's backward is
            # done: a mask goes with the backward of the first layer that takes it
            held = [ops.ref(t) for t in (mask, *more, positions) if t is not None]  # position_ids: every layer
            if engine.ckpt_reentrant:
                self.leaves += held
            else:
                pending = held
        for tag, L in enumerate(m.layers):
            engine.tag = tag
            lm = more[-1] if L["index"] == 0 and more else mask  # Gemma 2 / 3: the first layer slides
            c, si = cos, sin
            if every and not spec.takes_window_mask(L["index"]):
                c, si = full_rope
                if d.masked:
                    lm = None  # Gemma 3's full-attention layers: SDPA's causal path, no mask, no repeated k and v
            if ckpt:
                first = tuple(t for t in pending if t is lm or t is positions)
                for t in first:
                    pending.remove(t)
                h2 = m.unit(tag, h, lambda x, L=L, c=c, si=si, lm=lm, first=first:
                            self.checkpointed(L, x, d, c, si, lm, release=first))
            else:
                h2 = m.unit(tag, h, lambda x, L=L, c=c, si=si, lm=lm: m.layer(L, x, d, c, si, lm))
            ops.drop(h)
            h = h2
        engine.tag = -1
        ops.drop(*pending)  # a mask no layer took
        hn = m.norm(m.final_norm, h, d.T, hid)
        ops.drop(h)
        if full_rope[0] is not cos:
            ops.drop(*full_rope)
        ops.drop(positions, cos, sin, mask, *more, *embeds)  # the base model returns: they go before the head
        return hn

    def rope(self, d: Dims, dtype: str) -> tuple[Storage, Storage]:
        """Decoder._rope: fp32 frequencies, cos/sin cast to the hidden dtype (no gradients)."""
        ops = self.ops
        hd = self.m.spec.rope_dim
        pos = ops.new(d.s, "f32")
        freqs = ops.new(hd // 2 * d.s, "f32")
        emb = ops.new(d.s * hd, "f32")
        c32 = ops.new(d.s * hd, "f32")
        cos = ops.cast(c32, dtype)
        ops.drop(c32)
        s32 = ops.new(d.s * hd, "f32")
        sin = ops.cast(s32, dtype)
        ops.drop(s32, pos, freqs, emb)
        return cos, sin

    def sliding_window_mask(self, d: Dims) -> Storage:
        """model._sliding_window_mask: index tensors, ``ones & (kv > q - w)``, ``& (kv <= q)``; a boolean
        (1, 1, s, s) expanded over the batch (a view)."""
        ops = self.ops
        q_idx, kv_idx, one = ops.new(d.s, "i64"), ops.new(d.s, "i64"), ops.new(1, "bool")
        shifted = ops.new(d.s, "i64")
        gt = ops.new(d.s * d.s, "bool")
        ops.drop(shifted)
        m = ops.new(d.s * d.s, "bool")
        ops.drop(gt, one)
        le = ops.new(d.s * d.s, "bool")
        m2 = ops.new(d.s * d.s, "bool")
        ops.drop(le, m, q_idx, kv_idx)
        return m2

    def checkpointed(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None,
                     release: tuple[Storage, ...] = ()) -> Storage:
        """torch.utils.checkpoint as transformers calls it (reentrant or not: ``Engine.ckpt_reentrant``): forward
        without a graph, the inputs saved; backward runs the layer again with grad enabled (non-reentrant: up to
        its last saved tensor) and back-propagates through it. ``release``: references dropped once that is
        done (the mask and the position ids the layer's checkpoint frame was the last to hold), outside any
        repeated layer's events: the layer stands for several, the mask goes once."""
        m, engine = self.m, self.engine
        ug = engine.unsloth_gc  # Unsloth's function decides before the layer runs (core/estimator/unsloth_gc.py)
        staged = ug.offload(x) if ug is not None else None
        engine.grad_enabled = False
        out = m.layer(L, x, d, cos, sin, mask)
        engine.grad_enabled = True
        # the offloaded checkpoint saves its input's host copy (and holds the rest, as the reentrant one does)
        on_host = engine.ckpt_offload or staged is not None
        saved = [t for t in (None if on_host else x, cos, sin, mask) if t is not None]

        def recompute(xd: Storage) -> Storage:
            opened = m.amp_region_start()  # the recompute's own autocast region
            y = m.layer(L, xd, d, cos, sin, mask)
            m.amp_region_end(opened)
            return y

        def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
            if ug is not None:
                ug.backward()
            gx = engine.checkpoint_backward(x, recompute, buf, node, offloaded=engine.ckpt_offload, staged=staged)
            if release:
                tag, engine.tag = engine.tag, -1
                for t in release:
                    engine.drop(t)
                engine.tag = tag
            if gx is not None:
                engine.deliver(x, gx)

        engine.node(out, [(x, 0)], saved, special=run)
        return out

    def loss(self, h: Storage, labels: Storage, rows: int, d: Dims, contiguous: bool = True) -> Storage:
        """lm_head + ForCausalLMLoss (inside the LOGITS region)."""
        m, ops, engine = self.m, self.ops, self.engine
        spec = m.spec
        V = spec.vocab_size
        logits = m.linear(m.head, h, rows, contiguous)
        old_kind, engine.node_kind = engine.node_kind, Kind.LOGITS  # label_backward: the loss chain after lm_head
        cap = spec.final_logit_softcap
        # UnslothForCausalLMLoss (core/estimator/unsloth.py): core/simulation/unsloth.py's head_loss holds the head's
        # output to the loss's end; transformers' own forward frees it at the softcap's first step
        head_out = logits if m.unsloth is not None and m.unsloth.cross_entropy else None
        if cap:  # each rebinding frees the previous tensor, the head's output first
            l2 = ops.unary(logits)
            if head_out is None:
                ops.drop(logits)
            l3 = ops.unary(l2, save_output=True)
            ops.drop(l2)
            l4 = ops.unary(l3)
            ops.drop(l3)
            logits = l4
        if head_out is not None:
            return unsloth.causal_lm_loss(m, logits, head_out, d, old_kind)
        # the model's forward holds its (capped) logits while ForCausalLMLoss upcasts them
        l32 = ops.cast(logits, "f32" if self.setup.loss_fp32 else logits.dtype)
        padded = ops.new(d.b * (d.s + 1), "i64")  # F.pad(labels, (0, 1))
        # labels[..., 1:].contiguous(): already contiguous (a view) when the batch is 1
        shift = ops.new(rows, "i64") if d.multi else ops.ref(padded)
        if m.liger is not None and m.liger.cross_entropy:  # Liger's in place of torch's (core/estimator/liger.py)
            loss = liger.cross_entropy(m, l32, rows)
            engine.node_kind = old_kind
            ops.drop(l32, logits, padded, shift)
            return loss
        # cross_entropy = log_softmax (saves its output) + nll_loss (saves target and total_weight). Under CUDA
        # autocast log_softmax runs with dtype=float32: fp16 logits straight to fp32 (half_to_float), bf16 ones
        # converted to an fp32 copy first (aten's log_softmax), freed once the output exists
        conv = ops.cast(l32, "f32") if self.m.amp and l32.dtype == "bf16" else ops.ref(l32)
        lsm = ops.new(rows * V, "f32" if self.m.amp else l32.dtype)
        engine.node(lsm, [(conv, ops.gbytes(conv))], [lsm])
        ops.drop(conv)
        loss = ops.new(1, "f32")
        tw = ops.new(1, "f32")
        engine.node(loss, [(lsm, ops.gbytes(lsm))], [shift, tw])
        engine.node_kind = old_kind
        ops.drop(tw, lsm, l32, logits, padded, shift)
        return loss

    def cce_loss(self, h: Storage, d: Dims) -> Storage:
        """Cut Cross Entropy 25.1.1 (``cut_cross_entropy`` and ``CutCrossEntropy`` in core/simulation/loss.py): the
        valid shifted positions (every label of the batch), an fp32 log-sum-exp and negative dot per position, a
        lock array, an fp32 logit average per vocabulary entry; backward sorts the vocabulary and makes the
        hidden states' gradient and the head's (in the hidden states' dtype, then the head's)."""
        m, ops, engine = self.m, self.ops, self.engine
        V, D = m.spec.vocab_size, m.spec.hidden_size
        w = m.head.w
        n = d.b * (d.s - 1)
        mask = ops.new(n, "bool")  # _build_flat_valids: (targets != ignore_index).nonzero().to(int32), sum(1)
        found = ops.new(n * 2, "i64")
        ops.drop(mask)
        rows = ops.new(n * 2, "i32")
        ops.drop(found)
        valids = ops.new(n, "i64")
        ops.drop(rows)
        lse = ops.new(n, "f32")
        locks = ops.new(-(-n // 128), "i32")  # uint32
        avg = ops.new(V, "f32") if h.rg or w.rg else None
        ops.drop(locks)
        neg = ops.new(n, "f32")
        if m.spec.final_logit_softcap:  # softcapping: one compiled kernel's output
            capped = ops.new(n, "f32")
            ops.drop(neg)
            neg = capped
        loss = ops.new(1, "f32")
        saved = [h, w, lse] + ([avg] if avg is not None else [])
        h_dtype, w_dtype = h.dtype, w.dtype

        def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
            vals = ops.new(V, "f32")  # sort_logit_avg: argsort's values and indices, then int32
            idx = ops.new(V, "i64")
            ops.drop(vals)
            order = ops.new(V, "i32")
            ops.drop(idx)
            de = engine.alloc(ops.gbytes(h)) if h.rg else None
            dc = ops.new(V * D, h_dtype) if w.rg else None
            cols = -(-D // 64)
            de_locks = ops.new(-(-n // cols) * cols, "i32")
            dc_locks = ops.new(-(-V // cols) * cols, "i32")
            if dc is not None and w_dtype != h_dtype:
                d2 = ops.new(V * D, w_dtype)
                ops.drop(dc)
                dc = d2
            ops.drop(de_locks, dc_locks, order)
            engine.release_gradient(buf)
            for t in node.saved:
                engine.drop(t)
            if de is not None:
                engine.deliver(h, Buf(de))
            if dc is not None:
                engine.deliver(w, Buf(dc))

        if engine.node(loss, [(h, 0), (w, 0)], saved, special=run):
            self.leaves.append(ops.ref(valids))  # CCEParams rides on the node: freed with the graph
        ops.drop(lse, neg, valids, avg)
        return loss

    def liger_loss(self, h: Storage, d: Dims) -> Storage:
        """Liger Kernel 0.8.5's fused linear cross-entropy (``liger_fused_linear_cross_entropy`` and
        ``LigerFusedLinearCrossEntropy`` in core/simulation/loss.py): the labels padded and shifted; in forward the
        hidden states' gradient and the head's (where both require grad), an fp32 loss per token, the labels' mask,
        one logits tile of ``liger_chunk_rows`` tokens (an fp32 head adds a head-sized product per tile); both
        gradients saved, and handed back by backward as they are."""
        m, ops, engine = self.m, self.ops, self.engine
        V, H = m.spec.vocab_size, m.spec.hidden_size
        w = m.head.w
        amp = m.amp and h.dtype != m.cdt  # under autocast to another dtype: each tile made by autocast's @
        if h.dtype != w.dtype and not amp:
            raise SetupError(f"Liger's fused linear cross-entropy multiplies {h.dtype} hidden states by a {w.dtype} "
                             "head outside autocast, which torch refuses (\"expected mat1 and mat2 to have the same "
                             "dtype\")")
        bt = d.b * d.s
        rows = liger_chunk_rows(bt, V, H)
        padded = ops.new(d.b * (d.s + 1), "i64")  # F.pad(labels, (0, 1)); [..., 1:].contiguous() copies if b > 1
        shift = ops.new(bt, "i64") if d.multi else ops.ref(padded)
        gi = ops.new(bt * H, h.dtype)
        gw = ops.new(V * H, w.dtype) if h.rg and w.rg else None
        loss_1d = ops.new(bt, "f32")
        mask = ops.new(bt, "bool")
        count = ops.new(1, "i64")
        ops.drop(count)
        if amp:  # inside the autograd function's forward: no graph
            engine.grad_enabled, grad = False, engine.grad_enabled
            self._liger_autocast_tiles(h, gw, bt, rows)
            engine.grad_enabled = grad
        tile = ops.new(rows * V, h.dtype) if not amp else None
        if not amp and gw is not None and h.dtype == "f32":  # grad_weight += torch.mm(...).float(), a tile at a time
            for _ in range(-(-bt // rows)):
                ops.drop(ops.new(V * H, "f32"))
        ops.drop(tile)
        loss = ops.new(1, "f32")
        ops.drop(mask, loss_1d)

        def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
            ops.drop(ops.new(1, "f32"))  # torch.equal(grad_output, torch.tensor(1.0))
            engine.release_gradient(buf)
            out = [engine.ref(t) for t in node.saved]
            for t in node.saved:
                engine.drop(t)
            if h.rg:
                engine.deliver(h, Buf(out[0]))
            else:  # a gradient for an input that needs none: autograd lets it go
                engine.drop(out[0])
            if len(out) > 1:
                engine.deliver(w, Buf(out[1]))

        engine.node(loss, [(h, 0), (w, 0)], [gi] + ([gw] if gw is not None else []), special=run)
        ops.drop(gi, gw, padded, shift)
        return loss

    def _liger_autocast_tiles(self, h: Storage, gw: Storage | None, bt: int, rows: int) -> None:
        """_autocast_tiles (core/simulation/loss.py): per tile of tokens, the tile and the transposed head cast for
        the logits, the head cast again (autocast's cache keeps a trainable head's copy) for the hidden states'
        gradient, and the tile cast for an fp32 head gradient's addmm."""
        m, ops = self.m, self.ops
        V, H, cdt = m.spec.vocab_size, m.spec.hidden_size, m.cdt
        w = m.head.w
        for start in range(0, bt, rows):
            n = min(rows, bt - start)
            xc = ops.new(n * H, cdt)  # autocast's casts of x_tile and weight.t() (a view: never cached)
            wt = ops.new(V * H, cdt)
            logits = ops.new(n * V, cdt)
            ops.drop(xc, wt)
            if h.rg:
                wc = m.amp_cast(w, True)
                part = ops.new(n * H, cdt)
                ops.drop(wc, part)
            if gw is not None and gw.dtype == "f32":
                ops.drop(ops.new(n * H, cdt))
            ops.drop(logits)

    def chunked_loss(self, h: Storage, labels: Storage, d: Dims) -> Storage:
        """Decoder._chunked_loss: h.chunk(n) (one split node), lm_head + loss per chunk under reentrant
        checkpointing, the partial sums added."""
        m, ops, engine = self.m, self.ops, self.engine
        n = self.setup.loss_chunks
        sizes = _chunks(d.s, n)
        hid = m.spec.hidden_size
        views = ops.gathering_views(h, [d.b * cs * hid for cs in sizes])  # SplitBackward: one cat
        total = prev_part = None
        for cs, hc in zip(sizes, views):
            rows = d.b * cs
            dd = Dims(d.b, cs, d.multi, d.masked)

            def body(hin: Storage, dd: Dims = dd, rows: int = rows) -> Storage:
                engine.region, old = Kind.LOGITS, engine.region
                # a chunk along the sequence is a non-contiguous view when the batch is larger than 1
                out = self.loss(hin, labels, rows, dd, contiguous=not dd.multi)
                engine.region = old
                return out

            engine.grad_enabled = False
            part = body(hc)
            engine.grad_enabled = True

            def run(engine: Engine, node, buf: Buf, body=body, hc=hc) -> None:  # noqa: ANN001
                def recompute(xd: Storage) -> Storage:
                    opened = self.m.amp_region_start()  # the recompute's own autocast region
                    y = body(xd)
                    self.m.amp_region_end(opened)
                    return y

                gx = engine.checkpoint_backward(hc, recompute, buf, node, reentrant=True)  # the builder's own
                if gx is not None:
                    hc.gbuf = gx  # waits in the split node's buffer

            engine.node(part, [(hc, 0)], [hc], special=run)
            ops.drop(prev_part)  # the previous `part` lives until the name is rebound
            prev_part = part
            if total is None:
                total = ops.ref(part)
            else:
                t2 = ops.add(total, part)
                ops.drop(total)
                total = t2
        ops.drop(*views)
        out = ops.unary(total)
        ops.drop(total, prev_part)
        return out

    # ---- the step --------------------------------------------------------------------------------------------
    def make_inputs(self, d: Dims) -> None:
        """Batch inputs beside ids, labels and mask (a vision-language model's pixel values)."""

    def drop_inputs(self) -> None:
        """Free what :meth:`make_inputs` made, with the rest of the batch."""

    def run(self, d: Dims, steps: int = 2) -> None:
        m, ops, engine = self.m, self.ops, self.engine
        setup = self.setup
        accum = setup.grad_accum
        micro = min(accum, 2)
        engine.set_phase(Phase.LOAD, 0)
        m.load()
        for h in m.adapter_handles():
            engine.tag = h.tag
            engine.reclassify(m.sh.shards[id(h)] if m.sh is not None and m.sh.params_sharded else h, Kind.ADAPTERS)
        engine.tag = -1
        opt = OptimizerModel(self)
        sh = m.sh
        hook = opt.in_backward
        if sh is not None and sh.mode is Sharding.ZERO2:
            hook = sh.zero2
        units = list(range(len(m.layers)))
        # the objective's unit (core/objectives/): a frozen reference copy first where its trainer loads one
        ref = reference_model(setup, m, engine)
        program = piece(setup.objective, "program").PROGRAM(self, type(self)(ref) if ref is not None else None)
        for step in range(1, steps + 1):
            for i in range(micro):
                if program.prepares_before(i):
                    program.prepare(step)
                engine.set_phase(Phase.FORWARD, step)
                if i == 0 and program.collates:  # HF Trainer's get_batch_samples (simulation.step.holds_batches)
                    old, program.held = program.held, [program.collate_held(d) for _ in range(accum)]
                    program.release(old)
                loss, batch = program.loss(step, i, d)
                if accum > 1 and program.divides_loss:
                    l2 = ops.unary(loss)
                    ops.drop(loss)
                    loss = l2
                engine.set_phase(Phase.BACKWARD, step)
                if sh is not None:
                    sh.start_backward()
                engine.backward(loss, 0, hook)
                if sh is not None and sh.params_sharded:
                    sh.finish_backward(units)
                ops.drop(loss)
                for leaf in self.leaves:  # the input leaf's .grad, freed with the graph
                    if leaf.gbuf is not None:
                        engine.release_gradient(leaf.gbuf)
                        leaf.gbuf = None
                    ops.drop(leaf)
                self.leaves = []
                if not program.held:  # else the step's list holds it
                    ops.drop(*batch)
                    self.drop_inputs()
            engine.set_phase(Phase.OPTIMIZER, step)
            if not setup.optimizer_in_backward:
                if sh is None:
                    opt.step()
                    opt.zero_grad()
                else:
                    with_grads = sh.grads_to_partitions()
                    if setup.offload is Offload.NONE:  # ZeRO-Offload steps on the CPU
                        opt.step(with_grads)
                    opt.zero_grad()
                    sh.zero_grad()
        self.managed_bytes = opt.managed  # the last step's micro-batches (program.held) alive to the end


def _chunks(n: int, parts: int) -> list[int]:
    """Sizes of torch.chunk(n, parts): ceil(n/parts) each, the last smaller, fewer chunks if needed."""
    size = -(-n // parts)
    out = []
    left = n
    while left > 0:
        out.append(min(size, left))
        left -= size
    return out


