"""What the vision-language programs share (no torch): :class:`VlmModel`, the language model of
:class:`~vramlab.core.estimator.program.Model` with a vision tower's parameters and ops before it, and
:class:`VlmStepModel`, the step whose model output keeps the tower's states until the loss is all that is left.

A family's program (``core/families/<family>/program.py``) subclasses them with its tower, projector and
language-model forward, and gives :func:`step_model`'s signature as its own ``step_model`` (the estimator asks
the family for it through :func:`vramlab.core.families.piece`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from vramlab.core.estimator import liger
from vramlab.core.estimator.driver import StepModel
from vramlab.core.estimator.engine import Buf, Engine, Grad, Storage
from vramlab.core.estimator.linear import Lin
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import LinearShape, ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import VisionSpec, VisionTokens

TOWER_UNITS = -(1 << 20)  # a vision tower's FSDP units are numbered from here up (VlmModel.tower_unit)


class VlmModel(Model):
    """The language model of :class:`Model` with the vision tower and projector loaded before it (transformers
    builds the tower first, so its parameters come first in the optimizer too), and the ops the towers share."""

    amp_at_matmul = True  # transformers' eager_attention_forward: autocast casts the repeated key at the matmul

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens,
                 rank: int | None = None, plan: list[int] | None = None) -> None:
        super().__init__(spec, setup, engine, rank=rank, plan=plan)
        self.v: VisionSpec = spec.vision
        self.tokens = tokens
        tune = setup.vision_tuning
        self.train_tower = tune == "full"
        self.train_projector = tune in ("full", "projector")
        self.lora_tower = tune == "lora"
        self.tower_units = 0  # FSDP units the tower has opened (tower_unit)
        # the dtype of the model's float tensors: the gathered parameters' under FSDP mixed precision
        self.vdt = self.cdt if self.sh is not None and self.sh.params_sharded and self.sh.mixed else self.pdt

    def copy_for(self, setup: TrainingSetup) -> VlmModel:
        """The same model under ``setup`` (a preference objective's reference copy: tower, projector and language
        model loaded again from the checkpoint)."""
        return type(self)(self.spec, setup, self.engine, self.tokens, plan=self.plan)

    def tower_adapters(self) -> list[Lin]:
        """The tower's and projector's LoRA-adapted linears (``vision_tuning`` lora), which peft's
        ``disable_adapter`` turns off with the language model's."""
        out: list[Lin] = []

        def walk(x: object) -> None:
            if isinstance(x, Lin):
                if x.lora:
                    out.append(x)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        for name, value in vars(self).items():
            if name not in ("layers", "head"):
                walk(value)
        return out

    # ---- load ---------------------------------------------------------------------------------------------
    def _vp(self, numel: int, kind: Kind, trainable: bool, rows: int = 0, cols: int = 0,
            dtype: str | None = None) -> Storage:
        """A tower's or projector's parameter (``dtype``: default the float parameters'), kept as its 1/N shard
        under ZeRO-3 / FSDP (in the unit :meth:`tower_unit` opened last; the root before the first)."""
        dtype = dtype or self.pdt
        if self.sh is not None and self.sh.params_sharded:
            h = self.sh.param(numel, dtype, trainable)
            self._file(h, kind)
        else:
            h = self.ops.param(numel, dtype, kind, trainable)
        if trainable:
            self.params.append(h)
        self.shapes[id(h)] = (rows or numel, cols)
        return h

    def _file(self, h: Storage, kind: Kind) -> None:
        """File a tower's or projector's parameter (and, sharded, its shard) under ``kind``."""
        self.engine.reclassify(h, kind)
        if self.sh is not None and self.sh.params_sharded:
            self.engine.reclassify(self.sh.shards[id(h)], kind)

    def tower_unit(self) -> int | None:
        """Open the tower's next FSDP unit (a module whose class is in the model's ``_no_split_modules``, which
        accelerate's FSDP and DeepSpeed's ZeRO-3 wrap, as the reference's ``shard_module`` does): the parameters
        made until the next call belong to it. Returns its number (None: not sharded), for :meth:`VlmStepModel.unit`.
        Tower units number from far below the root's -1 in module order, so that the end of backward, which takes
        units from the highest down, reaches them after the language model's layers, the last first."""
        if self.sh is None or not self.sh.params_sharded:
            return None
        self.tower_units += 1
        self.sh.unit_index = TOWER_UNITS + self.tower_units
        return self.sh.unit_index

    def root_unit(self) -> None:
        """What is made from here on belongs to the root unit again (the tower's norms, the projector, what the
        language model has beside its layers)."""
        if self.sh is not None:
            self.sh.unit_index = -1

    def _vlinear(self, name: str, out_f: int, in_f: int, kind: Kind, trainable: bool, lora: bool,
                 bias: bool = True) -> Lin:
        """A tower's or projector's linear layer (quantized as the loader quantizes every nn.Linear), its bias
        where it has one, and LoRA's A and B where the tower is adapted."""
        lin = Lin(LinearShape(name, out_f, in_f, bias))
        if self.quant:  # transformers' bitsandbytes loader quantizes every nn.Linear but the output head
            lin.q = self._quantize(out_f * in_f, out_f)
            for h in lin.q:
                self._file(h, kind)
        else:
            lin.w = self._vp(out_f * in_f, kind, trainable, out_f, in_f)
        if bias:
            lin.bias = self._vp(out_f, kind, trainable)
        if lora:
            lin.lora = True
            lin.A = self._vp(self.r * in_f, kind, True, self.r, in_f, self.adt)
            lin.B = self._vp(out_f * self.r, kind, True, out_f, self.r, self.adt)
        return lin


    def amp_cast(self, x: Storage, weight: bool = False) -> Storage:
        """:meth:`Model.amp_cast` filed as CUDA autocast files it in the reference: only the weight cache's copies
        (an fp32 parameter that trains) are AMP copies; a frozen weight's cast is the op's own (an activation
        where its matmul saves it, a temporary in backward)."""
        return super().amp_cast(x, weight and x.dtype == "f32" and x.rg and x.param)

    # ---- shared tower ops ---------------------------------------------------------------------------------
    def patch_conv(self, pix: Storage, w: Storage, b: Storage | None, numel: int) -> Storage:
        """The patch embedding's Conv2d over ``pix`` (cast to the weight's dtype by the caller): under autocast a
        lower-precision op, its input, weight and bias cast to the compute dtype first (a trainable weight's
        copy from autocast's cache), its output in the compute dtype. Where the weight trains its node saves
        the input and the weight (convolution_backward's one formula for all three)."""
        ops = self.ops
        if self.amp:
            xc, wc = self.amp_cast(pix), self.amp_cast(w, True)
            bc = self.amp_cast(b, True) if b is not None else None
        else:
            xc, wc, bc = ops.ref(pix), ops.ref(w), b
        out = ops.new(numel, xc.dtype)
        edges = [(xc, ops.gbytes(xc)), (wc, ops.gbytes(wc))] + ([(bc, ops.gbytes(bc))] if bc is not None else [])
        self.engine.node(out, edges, [xc, wc] if wc.rg else [])
        ops.drop(xc, wc)
        if self.amp:
            ops.drop(bc)
        return out

    def _checkpointed(self, fn, x: Storage, kept: list[Storage]) -> Storage:  # noqa: ANN001
        """torch.utils.checkpoint (either mode: ``Engine.ckpt_reentrant``) around ``fn``: forward without a graph,
        ``x`` saved (and what the layer's keyword arguments hold); backward runs ``fn`` again with grad enabled
        and back-propagates it (as :meth:`StepModel.checkpointed` for a decoder layer, with the same checkpoint
        function: the offloaded one keeps ``x`` in host memory, Unsloth's decides on ``x``'s own size)."""
        engine = self.engine
        ug = engine.unsloth_gc  # core/estimator/unsloth_gc.py: counted in forward order, the tower's blocks first
        staged = ug.offload(x) if ug is not None else None
        engine.grad_enabled = False
        out = fn(x)
        engine.grad_enabled = True

        def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
            if ug is not None:
                ug.backward()
            gx = engine.checkpoint_backward(x, fn, buf, node, offloaded=engine.ckpt_offload, staged=staged)
            if gx is not None:
                engine.deliver(x, gx)

        on_host = engine.ckpt_offload or staged is not None
        engine.node(out, [(x, 0)], [*([] if on_host else [x]), *kept], special=run)
        return out

    def _veager(self, q: Storage, k: Storage, v: Storage, n: int, batch: int = 1) -> Storage:
        """:meth:`eager_attention` over ``batch`` windows of ``n`` of the tower's positions, all its heads."""
        return self.eager_attention(q, k, v, batch * self.v.num_heads * n * n)

    def eager_attention(self, q: Storage, k: Storage, v: Storage, scores: int, mask: Storage | None = None,
                        prog: tuple | None = (Grad(1), Grad(0))) -> Storage:
        """eager_attention_forward: ``scores`` (batch x heads x queries x keys) scores, scaled, the additive
        ``mask`` added where there is one, softmax in fp32 (its output saved) and back to the compute dtype
        (saved by the second matmul); the output transposed by a copy. ``prog``: the two matmuls' backward
        (the order their input gradients are made in)."""
        ops, engine = self.ops, self.engine
        qdt = q.dtype
        if self.amp:  # the matmuls are lower-precision ops under autocast: their operands cast at the call
            q, k = self.amp_cast(q), self.amp_cast(k)
        else:
            q, k = ops.ref(q), ops.ref(k)
        sc = ops.new(scores, q.dtype)
        engine.node(sc, [(q, ops.gbytes(q)), (k, ops.gbytes(k))], ([k] if q.rg else []) + ([q] if k.rg else []),
                    prog)
        ops.drop(q, k)
        w = ops.unary(sc, numel=scores)  # * scaling
        ops.drop(sc)
        if mask is not None:
            masked = ops.add(w, mask, scores)
            ops.drop(w)
            w = masked
        sm = ops.softmax(w)
        pb = ops.cast(sm, qdt)  # .to(query.dtype)
        ops.drop(sm, w)
        pc, vc = (self.amp_cast(pb), self.amp_cast(v)) if self.amp else (ops.ref(pb), ops.ref(v))
        out = ops.new(q.numel, pc.dtype)
        engine.node(out, [(pc, ops.gbytes(pc)), (vc, ops.gbytes(vc))],
                    ([vc] if pc.rg else []) + ([pc] if vc.rg else []), prog)
        ops.drop(pc, vc, pb)
        c = ops.new(out.numel, out.dtype)  # transpose(1, 2).contiguous()
        engine.node(c, [(out, 0)])
        ops.drop(out)
        return c

    def layernorm(self, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
        """nn.LayerNorm (autocast runs it in fp32: its input, weight and bias cast, as 16-bit parameters are under
        QLoRA): saves its input, weight, bias, mean and rstd (fp32 on CUDA, the input's dtype in the CPU kernels
        that the simulation dispatches to). Liger's LayerNorm where its patch swaps it into the tower."""
        if self.liger is not None and self.liger.layer_norm:
            return liger.layer_norm(self, ws, x, rows, dim)
        ops = self.ops
        xin = ops.cast(x, "f32") if self.amp and x.dtype != "f32" else ops.ref(x)
        wc = [ops.cast(w, "f32") if self.amp else ops.ref(w) for w in ws]
        out = ops.new(rows * dim, xin.dtype)
        stat = xin.dtype if self.engine.match_simulation else "f32"
        mean = ops.new(rows, stat)
        rstd = ops.new(rows, stat)
        edges = [(xin, ops.gbytes(xin)), (wc[0], ops.gbytes(wc[0])), (wc[1], ops.gbytes(wc[1]))]
        self.engine.node(out, edges, [xin, *wc, mean, rstd])
        ops.drop(mean, rstd, xin, *wc)
        return out

    def _forget_nodes(self, start: int, end: int) -> None:
        """Nodes whose outputs left the loss's path: freeing the outputs frees the graph and what it saved."""
        dead = self.engine.nodes[start:end]
        del self.engine.nodes[start:end]
        for node in dead:
            self.ops.drop(*node.saved)

    def vit_layer(self, blk: dict, x: Storage, images: int, mlp) -> Storage:  # noqa: ANN001
        """A CLIP / SigLIP encoder layer over ``images`` sequences of :attr:`VisionSpec.positions`: LayerNorm,
        attention, residual, LayerNorm, ``mlp(blk, h, rows)`` (which lets the normed input go), residual."""
        ops, d = self.ops, self.v.hidden_size
        n = images * self.v.positions
        h = self.layernorm(blk["ln1"], x, n, d)
        a = self.clip_attention(blk["attn"], h, images)
        ops.drop(h)
        x1 = ops.add(x, a)
        ops.drop(a)
        h = self.layernorm(blk["ln2"], x1, n, d)
        m = mlp(blk, h, n)
        out = ops.add(x1, m)
        ops.drop(x1, m)
        return out

    def qkv(self, A: dict, x: Storage, rows: int, eager: bool) -> tuple[Storage, Storage, Storage]:
        """The q, k and v projections of ``rows`` rows of ``x``, in that order, each viewed as heads."""
        return tuple(self.head_view(self.linear(A[n], x, rows), eager) for n in ("q_proj", "k_proj", "v_proj"))

    def clip_attention(self, A: dict, x: Storage, images: int) -> Storage:
        ops, engine, v = self.ops, self.engine, self.v
        S, heads = v.positions, v.num_heads
        n = images * S
        eager = self.setup.attention is Attention.EAGER
        q, k, val = self.qkv(A, x, n, eager)
        if eager:
            out = self._veager(q, k, val, S, images)
        else:
            if self.amp:
                q2, k2, v2 = self.amp_cast(q), self.amp_cast(k), self.amp_cast(val)
                ops.drop(q, k, val)
                q, k, val = q2, k2, v2
            out = ops.new(q.numel, q.dtype)
            lse = ops.new(images * heads * S, "f32")
            engine.node(out, [(q, ops.gbytes(q)), (k, ops.gbytes(k)), (val, ops.gbytes(val))], [q, k, val, out, lse])
            ops.drop(lse)
        y = self.linear(A["out_proj"], out, n)
        ops.drop(out, q, k, val)
        return y


class VlmStepModel(StepModel):
    """The step of :class:`StepModel` whose model output holds what the tower returned (``kept``) and the graph
    of what left the loss's path (``dead_nodes``) until the training step keeps only the loss."""

    autocast_forward = True  # an objective's forward runs in one autocast region (accelerate's, around the class)

    def __init__(self, model: VlmModel) -> None:
        super().__init__(model)
        self.vm = model
        self.kept: list[Storage] = []
        self.dead_nodes = (0, 0)

    def embeddings(self, ids: Storage, d: Dims, scale: Storage | None = None) -> Storage:
        """The text embeddings of ``ids`` (times Gemma's ``scale`` where given), a leaf that requires grad under
        checkpointing when the table is frozen (``enable_input_require_grads``)."""
        m, ops = self.vm, self.ops
        emb = ops.new(d.T * m.spec.hidden_size, m.embed.dtype)
        self.engine.node(emb, [(m.embed, ops.gbytes(m.embed))], [ids])
        if scale is not None:
            e = emb
            emb = ops.mul(e, scale)  # * embed_scale.to(weight.dtype): the buffer has that dtype already
            ops.drop(e)
        if self.setup.grad_ckpt and not emb.rg:
            emb.rg = True
            self.leaves.append(ops.ref(emb))
        return emb

    def decoder_layer(self, L: dict, h: Storage, d: Dims, cos: Storage, sin: Storage,
                      mask: Storage | None) -> Storage:
        """A decoder layer, checkpointed where the setup checkpoints."""
        if self.setup.grad_ckpt:
            return self.checkpointed(L, h, d, cos, sin, mask)
        return self.vm.layer(L, h, d, cos, sin, mask)

    def decoder(self, h: Storage, d: Dims, layer: Callable[[dict, Storage], Storage],
                skipped: Callable[[dict], bool] | None = None) -> Storage:
        """The language model's layers in turn over ``h`` (``layer(L, h)``: the layer's output; those where
        ``skipped(L)`` not called), then the final norm."""
        m, ops, engine = self.vm, self.ops, self.engine
        embeds = ops.ref(h)  # the language model's ``inputs_embeds``: its forward's local until it returns
        for tag, L in enumerate(m.layers):
            engine.tag = tag
            if skipped is not None and skipped(L):
                continue
            h2 = m.unit(tag, h, lambda x, L=L: layer(L, x))  # an FSDP unit under ZeRO-3 / FSDP
            ops.drop(h)
            h = h2
        engine.tag = -1
        hn = m.norm(m.final_norm, h, d.T, m.spec.hidden_size)
        ops.drop(h, embeds)
        return hn

    def forward(self, ids: Storage, labels: Storage, d: Dims) -> Storage:
        sh = self.vm.sh
        if sh is not None and sh.params_sharded:
            sh.unshard(-1)  # the root unit (embeddings, head, the tower's and projector's rest) until backward ends
        return super().forward(ids, labels, d)

    def _forward(self, ids: Storage, labels: Storage, d) -> Storage:  # noqa: ANN001
        loss = super()._forward(ids, labels, d)
        self.release_outputs()
        return loss

    def release_outputs(self) -> None:
        """The model's output goes: the tower's outputs with it, and the graph only they held."""
        self.vm._forget_nodes(*self.dead_nodes)
        self.dead_nodes = (0, 0)
        self.ops.drop(*self.kept)
        self.kept = []

    @contextlib.contextmanager
    def checkpointing_off(self) -> Iterator[None]:
        """TRL's ``disable_gradient_checkpointing`` around a forward under no_grad (the reference's): every
        checkpointed module of the model (tower and language model) runs plain, and the embeddings' output is
        no leaf kept for a backward."""
        setups = self.setup, self.vm.setup
        plain = self.setup.replace(grad_ckpt=False)
        self.setup = self.vm.setup = plain
        try:
            yield
        finally:
            self.setup, self.vm.setup = setups

    def share_inputs(self, d: Dims, other: VlmStepModel) -> None:
        """:meth:`make_inputs` for ``d``, the same tensors handed to ``other`` (a reference copy's forward runs on
        the policy's batch)."""
        before = dict(vars(self))
        self.make_inputs(d)
        for name, value in vars(self).items():
            if before.get(name, _UNSET) is not value:
                setattr(other, name, value)


_UNSET = object()
