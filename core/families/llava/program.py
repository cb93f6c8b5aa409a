"""LLaVA-1.5's training step on the symbolic engine: the CLIP vision tower, the projector, the image features
scattered into the text embeddings, and the Llama language model.

Mirrors transformers' ``LlavaForConditionalGeneration`` as
:mod:`vramlab.core.families.llava.reference` runs it:

* ``CLIPVisionModel`` over the batch's images (``B`` of them, ``S`` = patches + 1 positions each): the pixel
  values cast to the tower's dtype, a Conv2d patch embedding, the CLS embedding concatenated in front, the
  position table added, ``pre_layrnorm``, then ``depth`` encoder layers (LayerNorm, q/k/v/out linears with
  biases, attention over the image's ``S`` positions, LayerNorm, fc1, quick GELU, fc2) and ``post_layernorm``
  on the CLS state;
* every layer runs, the last one too, but ``vision_feature_layer = -2`` keeps the last layer's input: the last
  layer's and the pooled CLS state's graph is not on the loss's path, and what it saved lives in the model's
  output until the training step keeps only the loss (it is not back-propagated);
* the kept hidden state without its CLS position (``[:, 1:]``) goes through ``linear_1``, GELU, ``linear_2``;
  the features (``cat`` of the per-image outputs) replace the ``<image>`` placeholders (``masked_scatter``);
* the language model is the Llama decoder of :mod:`vramlab.core.estimator.program`.
"""

from __future__ import annotations

from vramlab.core.checks import SetupError
from vramlab.core.estimator.engine import Engine, Storage
from vramlab.core.estimator.program import Dims, Model, activation_region
from vramlab.core.families.vlm_base.program import VlmModel, VlmStepModel
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import VisionTokens


class LlavaModel(VlmModel):
    """:class:`VlmModel`'s parameter and LoRA plumbing with CLIP's tower and LLaVA's projector."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens,
                 rank: int | None = None, plan: list[int] | None = None) -> None:
        if tokens.video is not None:  # as the reference's check (images_only)
            raise SetupError(f"{spec.name}: LLaVA-1.5 takes images, not video frames")
        super().__init__(spec, setup, engine, tokens, rank=rank, plan=plan)

    def load(self) -> None:
        v = self.v
        d, i = v.hidden_size, v.intermediate_size
        kind, train, lora = Kind.VISION_WEIGHTS, self.train_tower, self.lora_tower
        # CLIPVisionEmbeddings: class_embedding, patch_embedding (Conv2d, no bias), position_embedding and its
        # position_ids buffer; an FSDP unit, as each CLIPEncoderLayer (the model's _no_split_modules name both)
        self.embed_unit = self.tower_unit()
        self.cls = self._vp(d, kind, train)
        pf = v.in_channels * v.patch_size ** 2
        self.patch_w = self._vp(d * pf, kind, train, d, pf)
        self.pos_w = self._vp(v.positions * d, kind, train, v.positions, d)
        self.pos_ids = self.ops.param(v.positions, "i64", kind, False)
        self.root_unit()
        self.pre_ln = [self._vp(d, kind, train), self._vp(d, kind, train)]
        self.vblocks = []
        for _ in range(v.depth):
            unit = self.tower_unit()
            blk = {"unit": unit,
                   "attn": {n: self._vlinear(n, d, d, kind, train, lora) for n in ("k_proj", "v_proj", "q_proj",
                                                                                  "out_proj")},
                   "ln1": [self._vp(d, kind, train), self._vp(d, kind, train)],
                   "fc1": self._vlinear("fc1", i, d, kind, train, lora),
                   "fc2": self._vlinear("fc2", d, i, kind, train, lora),
                   "ln2": [self._vp(d, kind, train), self._vp(d, kind, train)]}
            self.vblocks.append(blk)
        self.root_unit()
        self.post_ln = [self._vp(d, kind, train), self._vp(d, kind, train)]
        pk, pt, o = Kind.PROJECTOR_WEIGHTS, self.train_projector, v.out_hidden_size
        self.linear_1 = self._vlinear("linear_1", o, d, pk, pt, False)
        self.linear_2 = self._vlinear("linear_2", o, o, pk, pt, False)
        Model.load(self)  # with the rotary module's inv_freq and original_inv_freq

    # ---- the tower ----------------------------------------------------------------------------------------
    def clip_tower(self, pix: Storage, images: int, leaves: list[Storage]) -> tuple[Storage, list, tuple[int, int]]:
        """``get_image_features``: the projected features of every image and the graph of the layer whose output
        is not used (returned to be dropped with the model's output)."""
        ops, engine, v = self.ops, self.engine, self.v
        d, S = v.hidden_size, v.positions
        n = images * S
        x = self.unit(self.embed_unit, pix, lambda p: self.clip_embeddings(p, images, leaves))
        h = self.layernorm(self.pre_ln, x, n, d)
        ops.drop(x)
        kept = None
        start = 0
        for i, blk in enumerate(self.vblocks):
            last = i == v.depth - 1
            if last:  # the last layer's graph (its unit's boundaries too) leaves the loss's path
                start = len(engine.nodes)

            def run(x: Storage, blk: dict = blk) -> Storage:
                if self.setup.grad_ckpt and self.setup.vision_ckpt:
                    return self._checkpointed(lambda y: self.vit_layer(blk, y, images, self.clip_mlp), x, [])
                return self.vit_layer(blk, x, images, self.clip_mlp)

            h2 = self.unit(blk["unit"], h, run)  # an FSDP unit under ZeRO-3 / FSDP
            if last:
                kept = h  # hidden_states[-2], the last layer's input, captured in the tower's output
            else:
                ops.drop(h)
            h = h2
        # pooled_output = post_layernorm(last_hidden_state[:, 0, :]): LayerNorm copies the strided CLS rows;
        # get_image_features overwrites pooler_output with the features, and the pooled state and its graph go
        mid = len(engine.nodes)
        cls = engine.view(h, images * d)
        engine.node(cls, [(h, ops.gbytes(h))])
        cc = ops.new(images * d, h.dtype)
        engine.node(cc, [(cls, 0)])
        pooled = self.layernorm(self.post_ln, cc, images, d)
        ops.drop(cc, cls)
        self._forget_nodes(mid, len(engine.nodes))
        ops.drop(pooled)
        dead = (start, mid)
        # get_image_features: hidden_states[-2][:, 1:] (slice_backward allocates zeros of the full size)
        sel = engine.view(kept, images * (S - 1) * d)
        engine.node(sel, [(kept, ops.gbytes(kept))])
        rows = images * (S - 1)
        a = self.linear(self.linear_1, sel, rows, contiguous=images == 1)
        g = ops.unary(a, save_input=True)  # GELU
        ops.drop(a)
        feats = self.linear(self.linear_2, g, rows)
        ops.drop(g, sel)
        return feats, [kept, h], dead

    def clip_embeddings(self, pix: Storage, images: int, leaves: list[Storage]) -> Storage:
        """CLIPVisionEmbeddings: the patch convolution, the class embedding before the patches, the positions."""
        ops, engine, v = self.ops, self.engine, self.v
        d, S = v.hidden_size, v.positions
        wdt = self.patch_w.dtype  # the gathered weights' under FSDP mixed precision
        pixc = ops.cast(pix, wdt)  # pixel_values.to(patch_embedding.weight.dtype)
        conv = ops.new(images * (S - 1) * d, wdt)
        engine.node(conv, [(pixc, ops.gbytes(pixc)), (self.patch_w, ops.gbytes(self.patch_w))],
                    [pixc] if self.patch_w.rg else [])
        ops.drop(pixc)
        if self.setup.grad_ckpt and not conv.rg:
            conv.rg = True  # enable_input_require_grads hooks the patch embedding's output too
            leaves.append(ops.ref(conv))
        # flatten(2).transpose(1, 2): a view whose backward reshapes a transposed gradient (a copy)
        pt = engine.view(conv)
        engine.node(pt, [(conv, ops.gbytes(conv))])
        ops.drop(conv)
        emb = ops.new(images * S * d, wdt)  # cat([class_embedding.expand(B, 1, d), patches], dim=1)
        engine.node(emb, [(self.cls, ops.gbytes(self.cls)), (pt, 0)])
        ops.drop(pt)
        pe = ops.new(S * d, wdt)  # position_embedding(position_ids)
        engine.node(pe, [(self.pos_w, ops.gbytes(self.pos_w))], [self.pos_ids])
        x = ops.add(emb, pe, images * S * d)
        ops.drop(emb, pe)
        return x

    def clip_mlp(self, blk: dict, h: Storage, n: int) -> Storage:
        """CLIPMLP: fc1, quick GELU (``input * sigmoid(1.702 * input)``), fc2; the normed input goes after fc1."""
        ops = self.ops
        u = self.linear(blk["fc1"], h, n)
        ops.drop(h)
        t = ops.unary(u)
        s = ops.unary(t, save_output=True)
        ops.drop(t)
        gl = ops.mul(u, s)
        ops.drop(u, s)
        m = self.linear(blk["fc2"], gl, n)
        ops.drop(gl)
        return m


class LlavaStepModel(VlmStepModel):
    """The step of :class:`StepModel` with the image features scattered into the input embeddings."""

    def make_inputs(self, d: Dims) -> None:
        v, ops = self.vm.v, self.ops
        self.images = d.b * len(self.vm.tokens.units)
        self.pixels = None
        if self.images:
            self.pixels = ops.new(self.images * v.in_channels * v.image_size ** 2, "f32", Kind.INPUTS)

    def drop_inputs(self) -> None:
        self.ops.drop(self.pixels)

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        """LlavaModel.forward: the embeddings, the tower and projector, the scatter, then the decoder (the
        language model's own embedding step is skipped: it gets ``inputs_embeds``)."""
        m, ops, engine = self.vm, self.ops, self.engine
        hid = m.spec.hidden_size
        emb = self.embeddings(ids, d)
        self.dead = []
        if not self.images:
            return self._decoder(emb, d, [])
        with activation_region(engine, Kind.VISION_ACTIVATIONS):
            feats, self.kept, self.dead_nodes = m.clip_tower(self.pixels, self.images, self.leaves)
        # torch.cat(pooler_output) (list(features): views that the tower's output keeps), .to(inputs_embeds.dtype)
        cat = ops.new(feats.numel, feats.dtype)
        engine.node(cat, [(feats, 0)])
        self.kept.append(feats)
        f = ops.cast(cat, emb.dtype)
        ops.drop(cat)
        # get_placeholder_mask: ids == image_token_id, its sum, the size check
        mask = ops.new(d.T, "bool")
        counts = [ops.new(1, "i64"), ops.new(1, "i64"), ops.new(1, "bool")]
        ops.drop(*counts)
        h = ops.new(d.T * hid, emb.dtype)  # inputs_embeds.masked_scatter(mask, features)
        engine.node(h, [(emb, ops.gbytes(emb)), (f, ops.gbytes(f))], [mask])
        ops.drop(emb)
        return self._decoder(h, d, [mask, f])  # LlavaModel.forward's locals live until it returns

    def _decoder(self, h: Storage, d: Dims, local: list[Storage]) -> Storage:
        ops, setup = self.ops, self.setup
        positions = ops.new(d.s, "i64")
        cos, sin = self.rope(d, h.dtype)
        mask = ops.new(d.b * d.s * d.s, h.dtype) if setup.attention is Attention.EAGER else None
        hn = self.decoder(h, d, lambda L, x: self.decoder_layer(L, x, d, cos, sin, mask))
        ops.drop(positions, cos, sin, mask, *local)
        return hn


def step_model(spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens, rank, plan: list[int],  # noqa: ANN001
               mult: dict[int, int], reduced: bool) -> tuple[LlavaStepModel, dict[int, int]]:
    """The step to replay and the multiplicity of its replayed layers (the estimator's reduced plan)."""
    return LlavaStepModel(LlavaModel(spec, setup, engine, tokens, rank=rank, plan=plan)), mult
