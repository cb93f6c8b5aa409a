"""Gemma 3's training step on the symbolic engine: the SigLIP tower, the average-pooling projector, the image
features scattered into the text embeddings, and the Gemma 3 language model with its bidirectional image masks.

Mirrors transformers' ``Gemma3ForConditionalGeneration`` as :mod:`vramlab.core.families.gemma3.reference` runs it:

* ``SiglipVisionModel`` over every image and pan-and-scan crop (``B`` tiles, ``P`` = (896 / 14)² = 4,096
  patches each, no CLS): the pixel values cast to the tower's dtype, a Conv2d patch embedding with bias, the
  position table added, ``depth`` encoder layers (LayerNorm, q/k/v/out linears with biases, attention over the
  tile's patches, LayerNorm, fc1, tanh GELU, fc2), ``post_layernorm``; no pooling head;
* ``Gemma3MultiModalProjector``: the (B, P, d) output transposed and reshaped to a (B, d, 64, 64) grid (a copy),
  ``AvgPool2d`` to 16 x 16 (which saves its input), flattened back, Gemma's RMSNorm (``(1 + w)`` in fp32) and a
  matmul with the (d, text width) projection weight (its 2-D fold copies the transposed rows);
* ``masked_scatter`` of the features over the image tokens; from ``token_type_ids`` the block ids of each
  image and two materialised (b, 1, s, s) boolean masks (full and sliding-window layers: causal, and
  bidirectional within an image), which SDPA turns into an additive mask that every layer's attention saves,
  with k and v repeated to all heads (``enable_gqa`` is used only without a mask);
* the Gemma 3 decoder: the scaled embedding, one RoPE table pair per layer type present (five sliding-window
  layers to one global), Gemma's RMSNorm everywhere (q and k norms, four per layer), the tanh-GELU gated MLP;
* the tower's output and the projected features ride in the model's output until the step keeps the loss.
"""

from __future__ import annotations

from vramlab.core.checks import SetupError
from vramlab.core.estimator.engine import Engine, FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.program import Dims, _const, _region
from vramlab.core.families.vlm_base.program import VlmModel, VlmStepModel
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import LinearShape, ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import VisionTokens

SLIDING_PATTERN = 6  # Gemma3TextConfig's sliding_window_pattern


def layer_types(num_layers: int) -> set[str]:
    return {"sliding" if (i + 1) % SLIDING_PATTERN else "full" for i in range(num_layers)}


def layer_plan(num_layers: int) -> tuple[list[int], dict[int, int]]:
    """The layers to replay and how many each stands for (as :func:`vramlab.core.estimator.layer_plan`): the
    first, one sliding-window layer for those before the first global one, that global layer itself (its
    RoPE pair and mask are saved by its graph, and go only when its backward runs), one layer for the rest,
    the last. Every layer holds the same bytes; the global one decides how long the global tables live."""
    f = SLIDING_PATTERN - 1
    if num_layers < f + 3:
        return list(range(num_layers)), {}
    return [0, 1, f, f + 1, num_layers - 1], {1: f - 1, 3: num_layers - f - 2}


class Gemma3Model(VlmModel):
    """:class:`VlmModel`'s plumbing (LayerNorm, SigLIP's attention is CLIP's without the CLS) with SigLIP's
    layers, Gemma 3's projector and Gemma's RMSNorm."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens,
                 rank: int | None = None, plan: list[int] | None = None) -> None:
        if tokens.video is not None:  # as the reference's check (images_only)
            raise SetupError(f"{spec.name}: Gemma 3 takes images, not video frames")
        super().__init__(spec, setup, engine, tokens, rank=rank, plan=plan)

    def load(self) -> None:
        v, ops = self.v, self.ops
        d, i = v.hidden_size, v.intermediate_size
        kind, train, lora = Kind.VISION_WEIGHTS, self.train_tower, self.lora_tower
        # SiglipVisionEmbeddings: patch_embedding (Conv2d with bias), position_embedding, position_ids buffer
        pf = v.in_channels * v.patch_size ** 2
        self.patch_w = self._vp(d * pf, kind, train, d, pf)
        self.patch_b = self._vp(d, kind, train)
        self.pos_w = self._vp(v.positions * d, kind, train, v.positions, d)
        self.pos_ids = ops.param(v.positions, "i64", kind, False)
        self.vblocks = []
        for _ in range(v.depth):
            blk = {"ln1": [self._vp(d, kind, train), self._vp(d, kind, train)],
                   "attn": {n: self._vlinear(n, d, d, kind, train, lora) for n in ("k_proj", "v_proj", "q_proj",
                                                                                  "out_proj")},
                   "ln2": [self._vp(d, kind, train), self._vp(d, kind, train)],
                   "fc1": self._vlinear("fc1", i, d, kind, train, lora),
                   "fc2": self._vlinear("fc2", d, i, kind, train, lora)}
            self.vblocks.append(blk)
        self.post_ln = [self._vp(d, kind, train), self._vp(d, kind, train)]
        pk, pt, o = Kind.PROJECTOR_WEIGHTS, self.train_projector, v.out_hidden_size
        self.proj_w = self._vp(d * o, pk, pt, d, o)  # mm_input_projection_weight (d, o)
        self.proj_norm = [self._vp(d, pk, pt)]
        self.load_text()

    def load_text(self) -> None:
        """Gemma3TextModel and the head: :meth:`Model.load`'s parameters with Gemma 3's buffers (the embedding
        scale; inv_freq and original_inv_freq per layer type). The tables' construction temporaries are left
        out: they come before the head is allocated, or before the tracker's restart of a tied model's load."""
        spec, ops = self.spec, self.ops
        h = spec.hidden_size
        train_embed = self.train_base
        self.embed = self._p(spec.vocab_size * h, self.pdt, train_embed, spec.vocab_size, h)
        self.embed_scale = ops.param(1, self.pdt, Kind.WEIGHTS, False)
        self.pos = None
        self.layers = []
        for tag, i in enumerate(self.plan):
            self.engine.tag = tag
            self.layers.append(self._layer(i))
        self.engine.tag = -1
        self.final_norm = self._norm(self.train_base)
        for _ in range(2 * len(layer_types(spec.num_layers))):
            ops.param(spec.rope_dim // 2, "f32", Kind.WEIGHTS, False)
        tied = self.embed if spec.tie_embeddings else None
        head = LinearShape("lm_head", spec.vocab_size, h, spec.lm_head_bias)
        self.head = self._linear(head, self.train_base and tied is None, "lm_head" in self.targets, tied)

    # ---- Gemma's RMSNorm ------------------------------------------------------------------------------------
    def norm(self, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
        """Gemma3RMSNorm: ``x.float()`` normalised, times ``1 + weight.float()`` in fp32, back to x's dtype."""
        ops = self.ops
        dtype = x.dtype
        h = ops.cast(x, "f32")
        p = ops.new(h.numel, "f32")
        hb = ops.gbytes(h)
        self.engine.node(p, [(h, hb)], [h], (Temp(0, hb), Temp(0, hb), Grad(0), FreeTemp(0), FreeTemp(0)))
        var = ops.new(rows, "f32")
        self.engine.node(var, [(p, ops.gbytes(p))])
        ops.drop(p)
        a = ops.add(var, _const(ops))
        ops.drop(var)
        rs = ops.new(rows, "f32")
        rb = ops.gbytes(rs)
        self.engine.node(rs, [(a, rb)], [rs], (Temp(0, rb), Temp(0, rb), Grad(0), FreeTemp(0), FreeTemp(0)))
        ops.drop(a)
        n = ops.mul(h, rs)
        ops.drop(rs, h)
        wf = ops.cast(ws[0], "f32")
        w1 = ops.unary(wf)  # 1.0 + w
        ops.drop(wf)
        o = ops.mul(n, w1)
        ops.drop(n, w1)
        out = ops.cast(o, dtype)
        ops.drop(o)
        return out

    # ---- the tower ----------------------------------------------------------------------------------------
    def siglip_tower(self, pix: Storage, tiles: int, leaves: list[Storage]) -> tuple[Storage, Storage]:
        """``get_image_features``: the tower's last hidden state and the projected features of every tile."""
        ops, engine, v = self.ops, self.engine, self.v
        d, P = v.hidden_size, v.positions
        n = tiles * P
        pixc = ops.cast(pix, self.pdt)  # pixel_values.to(patch_embedding.weight.dtype)
        conv = ops.new(n * d, self.pdt)
        engine.node(conv, [(pixc, ops.gbytes(pixc)), (self.patch_w, ops.gbytes(self.patch_w)),
                           (self.patch_b, ops.gbytes(self.patch_b))], [pixc] if self.patch_w.rg else [])
        ops.drop(pixc)
        if self.setup.grad_ckpt and not conv.rg:
            conv.rg = True  # enable_input_require_grads hooks the patch embedding's output
            leaves.append(ops.ref(conv))
        # flatten(2).transpose(1, 2): a view; + position_embedding(position_ids)
        pt = engine.view(conv)
        engine.node(pt, [(conv, ops.gbytes(conv))])
        ops.drop(conv)
        pe = ops.new(P * d, self.pdt)
        engine.node(pe, [(self.pos_w, ops.gbytes(self.pos_w))], [self.pos_ids])
        h = ops.add(pt, pe, n * d)
        ops.drop(pt, pe)
        for blk in self.vblocks:
            if self.setup.grad_ckpt and self.setup.vision_ckpt:
                h2 = self._checkpointed(lambda x, blk=blk: self.vit_layer(blk, x, tiles, self.siglip_mlp), h, [])
            else:
                h2 = self.vit_layer(blk, h, tiles, self.siglip_mlp)
            ops.drop(h)
            h = h2
        last = self.layernorm(self.post_ln, h, n, d)
        ops.drop(h)
        return last, self.project(last, tiles)

    def siglip_mlp(self, blk: dict, h: Storage, n: int) -> Storage:
        """SiglipMLP: fc1, tanh GELU, fc2; the caller's name holds the normed input until the MLP returns."""
        ops = self.ops
        u = self.linear(blk["fc1"], h, n)
        g = ops.unary(u, save_input=True)  # gelu_pytorch_tanh
        ops.drop(u)
        m = self.linear(blk["fc2"], g, n)
        ops.drop(g, h)
        return m

    def project(self, x: Storage, tiles: int) -> Storage:
        """Gemma3MultiModalProjector.forward."""
        ops, engine, v = self.ops, self.engine, self.v
        d, o = v.hidden_size, v.out_hidden_size
        T = v.processor.tokens_per_tile
        grid = ops.new(x.numel, x.dtype)  # transpose(1, 2).reshape(B, d, 64, 64): a copy
        engine.node(grid, [(x, 0)])
        pooled = ops.new(tiles * T * d, x.dtype)  # AvgPool2d saves its input
        engine.node(pooled, [(grid, ops.gbytes(grid))], [grid])
        ops.drop(grid)
        normed = self.norm(self.proj_norm, pooled, tiles * T, d)  # on the flattened, transposed view
        ops.drop(pooled)
        folded = ops.new(normed.numel, normed.dtype)  # matmul folds the transposed (B, T, d) rows: a copy
        engine.node(folded, [(normed, 0)])
        out = ops.linear(folded, self.proj_w, None, tiles * T, o, d)
        ops.drop(folded, normed)
        return out


class Gemma3StepModel(VlmStepModel):
    """The step with the image features scattered into the scaled embeddings, Gemma 3's masks, tables and
    decoder layers."""

    def make_inputs(self, d: Dims) -> None:
        v, ops, tokens = self.vm.v, self.ops, self.vm.tokens
        self.images = d.b * sum(u.tiles for u in tokens.units)
        self.pixels = None
        if self.images:
            self.pixels = ops.new(self.images * v.in_channels * v.image_size ** 2, "f32", Kind.INPUTS)
        self.token_types = ops.new(d.T, "i64", Kind.INPUTS)

    def drop_inputs(self) -> None:
        self.ops.drop(self.pixels, self.token_types)

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        """Gemma3Model.forward: the scaled embeddings, the tower and projector, the scatter, the masks, the
        decoder."""
        m, ops, engine = self.vm, self.ops, self.engine
        hid = m.spec.hidden_size
        e = ops.new(d.T * hid, m.embed.dtype)
        engine.node(e, [(m.embed, ops.gbytes(m.embed))], [ids])
        emb = ops.mul(e, m.embed_scale)  # * embed_scale.to(weight.dtype): the buffer has that dtype already
        ops.drop(e)
        if self.setup.grad_ckpt and not emb.rg:
            emb.rg = True
            self.leaves.append(ops.ref(emb))
        self.kept = []
        self.dead_nodes = (0, 0)
        local = []
        h = emb
        if self.images:
            with _region(engine, Kind.VISION_ACTIVATIONS):
                last, feats = m.siglip_tower(self.pixels, self.images, self.leaves)
            self.kept = [last, feats]
            # get_placeholder_mask: ids == image_token_id, its sum, the size check
            mask = ops.new(d.T, "bool")
            counts = [ops.new(1, "i64"), ops.new(1, "i64"), ops.new(1, "bool")]
            ops.drop(*counts)
            h = ops.new(d.T * hid, emb.dtype)  # inputs_embeds.masked_scatter(mask, features)
            engine.node(h, [(emb, ops.gbytes(emb)), (feats, ops.gbytes(feats))], [mask])
            ops.drop(emb)
            local.append(mask)
        masks = self.masks(d, h.dtype)
        return self._decoder(h, d, local + masks, masks)

    def masks(self, d: Dims, dtype: str) -> list[Storage]:
        """create_masks_for_vision_model from token_type_ids: the block ids (small), then the full-attention and
        the sliding-window masks, each (b, 1, s, s) boolean (float in the model's dtype for eager attention)."""
        ops = self.ops
        ss = d.b * d.s * d.s
        mdt = self.vm.pdt if self.setup.attention is Attention.EAGER else "bool"
        block = ops.new(d.T, "i64")
        full = ops.new(ss, mdt)
        sliding = ops.new(ss, mdt)
        return [block, full, sliding]

    def _decoder(self, h: Storage, d: Dims, local: list[Storage], masks: list[Storage] = ()) -> Storage:
        m, ops, engine, setup = self.vm, self.ops, self.engine, self.setup
        full, sliding = masks[1], masks[2]
        # Gemma3TextModel.forward: arange(s) + 0, then a table pair per layer type present
        a = ops.new(d.s, "i64")
        positions = ops.new(d.s, "i64")
        ops.drop(a)
        tables = {t: self.rope_tables(d, h.dtype) for t in sorted(layer_types(m.spec.num_layers))}
        self.positions = positions
        for tag, L in enumerate(m.layers):
            engine.tag = tag
            kind = "full" if (L["index"] + 1) % SLIDING_PATTERN == 0 else "sliding"
            cos, sin = tables[kind]
            mask = full if kind == "full" else sliding
            if setup.grad_ckpt:
                h2 = self.checkpointed(L, h, d, cos, sin, mask)
            else:
                h2 = m.layer(L, h, d, cos, sin, mask)
            ops.drop(h)
            h = h2
        engine.tag = -1
        hn = m.norm(m.final_norm, h, d.T, m.spec.hidden_size)
        ops.drop(h)
        ops.drop(positions, *[t for pair in tables.values() for t in pair], *local)
        return hn

    def checkpointed(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        """:meth:`StepModel.checkpointed`; GradientCheckpointingLayer binds the layer's keyword arguments (the
        RoPE pair, the mask, ``position_ids``) into the function the reentrant checkpoint keeps on its context,
        which lives with the graph until the loss is freed, after backward (only the tensors it saves go when
        its backward runs). Non-reentrant, the function lives with the layer's saved-tensor hooks, so they go
        when the layer's backward is done."""
        out = super().checkpointed(L, x, d, cos, sin, mask)
        nodes = self.engine.nodes
        if nodes and nodes[-1].out is out:  # no graph, no checkpoint context
            if self.engine.ckpt_reentrant:
                self.leaves += [self.ops.ref(t) for t in (cos, sin, mask, self.positions)]
            else:
                nodes[-1].saved.append(self.ops.ref(self.positions))
        return out

    def rope_tables(self, d: Dims, dtype: str) -> tuple[Storage, Storage]:
        """Gemma3RotaryEmbedding.forward: fp32 angles (1, s, hd), cos and sin times the attention scaling, cast."""
        ops = self.ops
        hd = self.vm.spec.rope_dim
        pos = ops.new(d.s, "f32")
        freqs = ops.new(hd // 2 * d.s, "f32")
        ops.drop(pos)
        emb = ops.new(d.s * hd, "f32")
        ops.drop(freqs)
        out = []
        for _ in range(2):
            t = ops.new(d.s * hd, "f32")
            t2 = ops.new(d.s * hd, "f32")  # * attention_scaling
            ops.drop(t)
            out.append(t2)
        ops.drop(emb)
        cos, sin = (ops.cast(t, dtype) for t in out)
        ops.drop(*out)
        return cos, sin


def step_model(spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens, rank, plan: list[int],  # noqa: ANN001
               mult: dict[int, int], reduced: bool) -> tuple[Gemma3StepModel, dict[int, int]]:
    """The step to replay and the multiplicity of its replayed layers: the reduced plan keeps the first global
    layer apart (:func:`layer_plan`)."""
    if reduced:
        plan, mult = layer_plan(spec.num_layers)
    return Gemma3StepModel(Gemma3Model(spec, setup, engine, tokens, rank=rank, plan=plan)), mult
