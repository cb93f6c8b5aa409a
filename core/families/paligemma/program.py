"""PaliGemma's training step on the symbolic engine: the SigLIP tower, the linear projector, the image features
scattered into the scaled text embeddings, and the Gemma language model under the prefix mask.

Mirrors transformers' ``PaliGemmaForConditionalGeneration`` as :mod:`vramlab.core.families.paligemma.reference`
runs it:

* ``SiglipVisionModel`` over the batch's images (``B`` of them, (image_size / patch_size)² patches each, no
  CLS): the pixel values cast to the tower's dtype, a Conv2d patch embedding with bias, the position table
  added, ``depth`` encoder layers (LayerNorm, q/k/v/out linears with biases, attention over the image's
  patches, LayerNorm, fc1, tanh GELU, fc2), ``post_layernorm``; no pooling head;
* ``PaliGemmaMultiModalProjector``: one linear (with bias) from the last hidden state to the text width;
* ``masked_scatter`` of the features over the ``<image>`` tokens; 1-indexed positions (``arange + 1``); from
  ``token_type_ids`` the block ids (``where(tti == 0, 0, -1)``) and one materialised (b, 1, s, s) mask,
  bidirectional over the prefix and causal over the suffix (boolean for SDPA, additive in the model's dtype
  for eager), which SDPA turns into an additive mask every layer's attention saves, k and v repeated to all
  heads (transformers uses ``enable_gqa`` only without a mask);
* the Gemma decoder of :class:`~vramlab.core.estimator.program.Model` (Gemma's RMSNorm, the tanh-GELU gated
  MLP), its scaled embedding and one RoPE table pair;
* the tower's output and the projected features ride in the model's output until the step keeps the loss.
"""

from __future__ import annotations

from vramlab.core.checks import SetupError
from vramlab.core.estimator.engine import Engine, Storage
from vramlab.core.estimator.program import Dims, _region
from vramlab.core.families.paligemma.vision import check_setup
from vramlab.core.families.vlm_base.program import VlmModel, VlmStepModel
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import LinearShape, ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import VisionTokens


class PaliGemmaModel(VlmModel):
    """:class:`VlmModel`'s plumbing with SigLIP's layers, PaliGemma's projector and Gemma's language model."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens,
                 rank: int | None = None, plan: list[int] | None = None) -> None:
        if tokens.video is not None:  # as the reference's check (images_only)
            raise SetupError(f"{spec.name}: PaliGemma takes images, not video frames")
        check_setup(spec, setup)
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
        self.proj = self._vlinear("linear", v.out_hidden_size, d, Kind.PROJECTOR_WEIGHTS, self.train_projector,
                                  False)
        self.load_text()

    def load_text(self) -> None:
        """GemmaModel and the head: :meth:`Model.load`'s parameters with Gemma's buffers (the embedding scale,
        inv_freq and original_inv_freq), built before the head as transformers builds them; the tables'
        construction temporaries are left out (they come before the head, or before the tracker's restart of a
        tied model's load)."""
        spec, ops = self.spec, self.ops
        h = spec.hidden_size
        train_embed = self.setup.trains("embed_tokens")
        self.embed = self._p(spec.vocab_size * h, self.pdt, train_embed, spec.vocab_size, h)
        self.embed_scale = ops.param(1, self.pdt, Kind.WEIGHTS, False)
        self.pos = None
        self.layers = []
        for tag, i in enumerate(self.plan):
            self.engine.tag = tag
            self.layers.append(self._layer(i))
        self.engine.tag = -1
        self.final_norm = self._norm(self.setup.trains("norm"))
        for _ in range(2):
            ops.param(spec.rope_dim // 2, "f32", Kind.WEIGHTS, False)
        tied = self.embed if spec.tie_embeddings else None
        train_head = train_embed if tied is not None else self.setup.trains("lm_head")
        head = LinearShape("lm_head", spec.vocab_size, h, spec.lm_head_bias)
        self.head = self._linear(head, train_head, "lm_head" in self.targets, tied)

    # ---- the tower ----------------------------------------------------------------------------------------
    def siglip_tower(self, pix: Storage, images: int, leaves: list[Storage]) -> tuple[Storage, Storage]:
        """``get_image_features``: the tower's last hidden state and the projected features of every image."""
        ops, engine, v = self.ops, self.engine, self.v
        d, P = v.hidden_size, v.positions
        n = images * P
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
                h2 = self._checkpointed(lambda x, blk=blk: self.vit_layer(blk, x, images, self.siglip_mlp), h, [])
            else:
                h2 = self.vit_layer(blk, h, images, self.siglip_mlp)
            ops.drop(h)
            h = h2
        last = self.layernorm(self.post_ln, h, n, d)
        ops.drop(h)
        return last, self.linear(self.proj, last, n)  # PaliGemmaMultiModalProjector

    def siglip_mlp(self, blk: dict, h: Storage, n: int) -> Storage:
        """SiglipMLP: fc1, tanh GELU, fc2; the caller's name holds the normed input until the MLP returns."""
        ops = self.ops
        u = self.linear(blk["fc1"], h, n)
        g = ops.unary(u, save_input=True)  # gelu_pytorch_tanh
        ops.drop(u)
        m = self.linear(blk["fc2"], g, n)
        ops.drop(g, h)
        return m


class PaliGemmaStepModel(VlmStepModel):
    """The step with the image features scattered into the scaled embeddings, the prefix mask from
    ``token_type_ids``, 1-indexed positions and Gemma's decoder layers."""

    def make_inputs(self, d: Dims) -> None:
        v, ops = self.vm.v, self.ops
        self.images = d.b * len(self.vm.tokens.units)
        self.pixels = None
        if self.images:
            self.pixels = ops.new(self.images * v.in_channels * v.image_size ** 2, "f32", Kind.INPUTS)
        self.token_types = ops.new(d.T, "i64", Kind.INPUTS)

    def drop_inputs(self) -> None:
        self.ops.drop(self.pixels, self.token_types)

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        """PaliGemmaModel.forward: the scaled embeddings, the positions, the tower and projector, the scatter,
        the mask, the decoder."""
        m, ops, engine = self.vm, self.ops, self.engine
        hid = m.spec.hidden_size
        e = ops.new(d.T * hid, m.embed.dtype)
        engine.node(e, [(m.embed, ops.gbytes(m.embed))], [ids])
        emb = ops.mul(e, m.embed_scale)  # * embed_scale.to(weight.dtype): the buffer has that dtype already
        ops.drop(e)
        if self.setup.grad_ckpt and not emb.rg:
            emb.rg = True
            self.leaves.append(ops.ref(emb))
        a = ops.new(d.s, "i64")  # arange(s) + 0, then .unsqueeze(0) + 1: positions are 1-indexed
        b = ops.new(d.s, "i64")
        ops.drop(a)
        self.positions = ops.new(d.s, "i64")
        ops.drop(b)
        self.kept = []
        self.dead_nodes = (0, 0)
        local = [self.positions]
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
        # block_sequence_ids = where(token_type_ids == 0, 0, -1), then create_causal_mask's (b, 1, s, s) mask
        block = ops.new(d.T, "i64")
        mdt = m.pdt if self.setup.attention is Attention.EAGER else "bool"
        self.mask = ops.new(d.b * d.s * d.s, mdt)
        return self._decoder(h, d, [*local, block, self.mask])

    def _decoder(self, h: Storage, d: Dims, local: list[Storage]) -> Storage:
        m, ops, engine, setup = self.vm, self.ops, self.engine, self.setup
        cos, sin = self.rope_tables(d, h.dtype)
        for tag, L in enumerate(m.layers):
            engine.tag = tag
            if setup.grad_ckpt:
                h2 = self.checkpointed(L, h, d, cos, sin, self.mask)
            else:
                h2 = m.layer(L, h, d, cos, sin, self.mask)
            ops.drop(h)
            h = h2
        engine.tag = -1
        hn = m.norm(m.final_norm, h, d.T, m.spec.hidden_size)
        ops.drop(h)
        ops.drop(cos, sin, *local)  # PaliGemmaModel.forward's locals live until it returns
        return hn

    def checkpointed(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        """:meth:`StepModel.checkpointed`; GradientCheckpointingLayer binds the layer's keyword arguments (the
        RoPE pair, the mask, ``position_ids``) into the function the reentrant checkpoint keeps on its context,
        which lives with the graph until the loss is freed; non-reentrant, the function lives with the layer's
        saved-tensor hooks, so they go when the layer's backward is done."""
        out = super().checkpointed(L, x, d, cos, sin, mask)
        nodes = self.engine.nodes
        if nodes and nodes[-1].out is out:  # no graph, no checkpoint context
            if self.engine.ckpt_reentrant:
                self.leaves += [self.ops.ref(t) for t in (cos, sin, mask, self.positions)]
            else:
                nodes[-1].saved.append(self.ops.ref(self.positions))
        return out

    def rope_tables(self, d: Dims, dtype: str) -> tuple[Storage, Storage]:
        """GemmaRotaryEmbedding.forward: fp32 angles (1, s, hd), cos and sin times the attention scaling, cast."""
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


def check_estimate(spec: ModelSpec, setup: TrainingSetup) -> None:
    """What the program does not model, refused before it runs (the language model: Gemma's only)."""
    check_setup(spec, setup)


def step_model(spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens, rank, plan: list[int],  # noqa: ANN001
               mult: dict[int, int], reduced: bool) -> tuple[PaliGemmaStepModel, dict[int, int]]:
    """The step to replay and the multiplicity of its replayed layers (the estimator's reduced plan)."""
    return PaliGemmaStepModel(PaliGemmaModel(spec, setup, engine, tokens, rank=rank, plan=plan)), mult
