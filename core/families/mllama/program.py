"""Llama 3.2 Vision's training step on the symbolic engine: the tiled vision tower, the projector, and a
language model whose cross-attention layers attend to the projected vision states.

Mirrors transformers' ``MllamaForConditionalGeneration`` as :mod:`vramlab.core.families.mllama.reference` runs it:

* ``MllamaVisionModel`` over ``N`` = batch x images, each padded by the processor to ``T`` = max_tiles tiles:
  pixel values cast to the tower's dtype, a Conv2d patch embedding (its output lives until the tower
  returns), the gated pre-tile aspect-ratio embedding, the CLS position, the gated position embedding and its
  tile table (an ``N x T x positions x width`` lookup), ``layernorm_pre``, each tile padded to a multiple of 8
  positions (``Pp``), the additive aspect-ratio mask built as a ``(N, T*Pp, 1) @ (N, 1, T*Pp)`` product
  (``N x (T*Pp)²`` in the model's dtype, saved by every attention of a trained tower); the local encoder
  (LayerNorm, q/k/v/o without bias, SDPA over all ``T*Pp`` positions with the mask, LayerNorm, fc1, GELU, fc2)
  whose every layer output stays referenced by the encoder's ``hidden_states`` until the tower returns;
  ``layernorm_post``, the gated post-tile embedding, the global encoder (the same layers, tanh-gated), and
  the last state concatenated with the stacked intermediate states (``hidden_size x (1 + k)`` features);
* ``multi_modal_projector`` (one Linear to the text width) gives the cross-attention states; the tower's
  output (the concatenation) rides in the model's output until the training step keeps only the loss;
* the ``cross_attention_mask`` is expanded to every vision position (int64), inverted in fp32, cast, and
  masked; the language model runs Llama self-attention layers and, at ``cross_attention_layers``, gated
  cross-attention layers: q from the text (RMSNorm per head), k and v from the vision states (k RMSNormed),
  both repeated to every head (transformers passes SDPA a mask, so no ``enable_gqa``), the attention output
  and the MLP output each scaled by ``tanh(gate)``, the MLP output also by the full-text-row mask.

The sizes are concrete (the tower's sequence follows the tiles), so the tape is recorded per setup.
"""

from __future__ import annotations

from vramlab.core.checks import SetupError
from vramlab.core.estimator.engine import Engine, Storage
from vramlab.core.estimator.linear import Lin
from vramlab.core.estimator.program import Dims, activation_region
from vramlab.core.families.mllama.vision import check_mllama_model, check_mllama_setup, feature_dim, tile_positions
from vramlab.core.families.vlm_base.program import VlmModel, VlmStepModel
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import LinearShape, ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import VisionTokens


def check(spec: ModelSpec, setup: TrainingSetup, tokens: VisionTokens) -> None:
    check_mllama_model(spec)
    check_mllama_setup(spec, setup)
    if tokens.video is not None:  # as the reference's check_mllama
        raise SetupError(f"{spec.name}: Llama 3.2 Vision takes images, not video frames")


class MllamaModel(VlmModel):
    """Parameters in transformers' module order: the tower, the language model (its cross-attention layers
    with q/k norms and gates), the projector, the head."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens,
                 rank: int | None = None) -> None:
        check(spec, setup, tokens)
        super().__init__(spec, setup, engine, tokens, rank=rank, plan=list(range(spec.num_layers)))
        self.cross = set(self.v.cross_attention_layers)

    def copy_for(self, setup: TrainingSetup) -> MllamaModel:
        return type(self)(self.spec, setup, self.engine, self.tokens)

    # ---- load ---------------------------------------------------------------------------------------------
    def _vlayer(self, gated: bool) -> dict:
        v = self.v
        d, i = v.hidden_size, v.intermediate_size
        kind, train, lora = Kind.VISION_WEIGHTS, self.train_tower, self.lora_tower

        def lin(name: str, o: int, k: int, bias: bool) -> Lin:
            return self._vlinear(name, o, k, kind, train, lora, bias)

        unit = self.tower_unit()
        blk = {"unit": unit, "attn": {n: lin(n, d, d, False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
               "fc1": lin("fc1", i, d, True), "fc2": lin("fc2", d, i, True),
               "ln1": [self._vp(d, kind, train), self._vp(d, kind, train)],
               "ln2": [self._vp(d, kind, train), self._vp(d, kind, train)]}
        if gated:
            blk["gate_attn"] = self._vp(1, kind, train)
            blk["gate_ffn"] = self._vp(1, kind, train)
        return blk

    def load(self) -> None:
        v, spec, ops = self.v, self.spec, self.ops
        d, tiles, rows = v.hidden_size, v.processor.max_tiles, v.aspect_ratios + 1
        n, _ = tile_positions(v)
        kind, train = Kind.VISION_WEIGHTS, self.train_tower
        pf = v.in_channels * v.patch_size ** 2
        self.patch_w = self._vp(d * pf, kind, train, d, pf)
        self.cls = self._vp(d, kind, train)
        self.pos_gate = self._vp(1, kind, train)
        self.pos_w = self._vp(n * d, kind, train, n, d)
        self.tile_pos = self._vp(rows * tiles * n * d, kind, train, rows, tiles * n * d)
        self.pre_tile = [self._vp(rows * tiles * d, kind, train, rows, tiles * d), self._vp(1, kind, train)]
        self.post_tile = [self._vp(rows * tiles * d, kind, train, rows, tiles * d), self._vp(1, kind, train)]
        self.ln_pre = [self._vp(d, kind, train), self._vp(d, kind, train)]
        self.ln_post = [self._vp(d, kind, train), self._vp(d, kind, train)]
        # MllamaVisionEncoderLayer, the local encoder's and the global one's, is in the model's _no_split_modules
        self.local = [self._vlayer(False) for _ in range(v.depth)]
        self.glob = [self._vlayer(True) for _ in range(v.global_depth)]
        self.root_unit()
        # the language model: embed_tokens has 8 rows more than the vocabulary
        h = spec.hidden_size
        train_embed = self.setup.trains("embed_tokens")
        self.embed = self._p((spec.vocab_size + 8) * h, self.pdt, train_embed, spec.vocab_size + 8, h)
        self.pos = None
        self.layers = []
        for tag, i in enumerate(self.plan):
            self.engine.tag = tag
            L = self._layer(i)
            if i in self.cross:
                L["cross"] = True
                L["q_norm"] = self._norm(L["trainable"], spec.head_dim)
                L["k_norm"] = self._norm(L["trainable"], spec.head_dim)
                L["gate_attn"] = self._p(1, self.pdt, L["trainable"])
                L["gate_mlp"] = self._p(1, self.pdt, L["trainable"])
            self.layers.append(L)
        self.engine.tag = -1
        self.root_unit()
        self.final_norm = self._norm(self.setup.trains("norm"))
        half = spec.rope_dim // 2  # the rotary module's inv_freq and original_inv_freq buffers
        self.inv_freq = ops.param(half, "f32", Kind.WEIGHTS, False)
        ops.param(half, "f32", Kind.WEIGHTS, False)
        pk, pt = Kind.PROJECTOR_WEIGHTS, self.train_projector
        self.projector = self._vlinear("multi_modal_projector", h, feature_dim(v), pk, pt, False)
        head = LinearShape("lm_head", spec.vocab_size, h, spec.lm_head_bias)
        self.head = self._linear(head, self.setup.trains("lm_head"), "lm_head" in self.targets)

    # ---- the tower ----------------------------------------------------------------------------------------
    def _gate(self, gate: Storage, x: Storage) -> Storage:
        """``gate.tanh() * x``: tanh saves its output (for the gate's gradient), mul saves both operands."""
        t = self.ops.unary(gate, save_output=True)
        y = self.ops.mul(t, x)
        self.ops.drop(t)
        return y

    def tower(self, pix: Storage, media: int) -> Storage:
        """``MllamaVisionModel.forward`` over ``media`` images: the concatenated last and intermediate states
        (what the model's output keeps referenced until the step keeps only the loss)."""
        ops, engine, v = self.ops, self.engine, self.v
        d, tiles = v.hidden_size, v.processor.max_tiles
        P = (v.image_size // v.patch_size) ** 2
        n, npad = tile_positions(v)
        nt = media * tiles
        L = tiles * npad  # one image's sequence in both encoders
        pixc = ops.cast(pix, self.vdt)
        conv = self.patch_conv(pixc, self.patch_w, None, nt * P * d)
        ops.drop(pixc)
        pt = engine.view(conv)  # flatten(2).transpose(1, 2), reshape: views
        engine.node(pt, [(conv, 0)])
        h = self._tile_embedding(self.pre_tile, pt, media, nt * P * d)
        ops.drop(pt)
        emb = ops.new(nt * n * d, self.vdt)  # cat([class_embedding.expand, h], dim=1)
        engine.node(emb, [(self.cls, ops.gbytes(self.cls)), (h, 0)])
        ops.drop(h)
        # gated_positional_embedding: (1 - gate.tanh()) * embedding, added; the tile table's rows, gated, added
        t = ops.unary(self.pos_gate, save_output=True)
        one_minus = ops.unary(t)
        ops.drop(t)
        gp = ops.mul(one_minus, self.pos_w)
        ops.drop(one_minus)
        x = ops.add(emb, gp, nt * n * d)
        tile = ops.new(nt * n * d, self.vdt)
        engine.node(tile, [(self.tile_pos, ops.gbytes(self.tile_pos))], [])
        gt = self._gate(self.pos_gate, tile)
        x2 = ops.add(x, gt)
        ops.drop(x, gp, tile, gt, emb)
        hn = self.layernorm(self.ln_pre, x2, nt * n, d)
        ops.drop(x2)
        # F.pad to a multiple of 8 positions per tile (constant_pad_nd; backward slices the gradient)
        hp = ops.new(nt * npad * d, self.vdt)
        engine.node(hp, [(hn, ops.gbytes(hn))])
        ops.drop(hn)
        mask = self._aspect_mask(media, tiles, npad)
        outs = []
        h = hp
        for blk in self.local:  # each an FSDP unit under ZeRO-3 / FSDP
            h = self.unit(blk["unit"], h, lambda x, blk=blk: self.vlayer(blk, x, media, L, mask, False))
            outs.append(h)  # encoder_states: every layer's output, referenced until the tower returns
        ops.drop(hp)
        last = outs[-1]
        hn = self.layernorm(self.ln_post, last, media * L, d)
        h = self._tile_embedding(self.post_tile, hn, media, media * L * d)
        ops.drop(hn)
        gouts = []
        x = h
        for blk in self.glob:
            x = self.unit(blk["unit"], x, lambda y, blk=blk: self.vlayer(blk, y, media, L, mask, True))
            gouts.append(x)
        ops.drop(h)
        # the global output without padding ([:, :, :n], a view), the intermediate states stacked and sliced,
        # concatenated along the features
        k = len(v.intermediate_layers)
        picked = [outs[i] for i in v.intermediate_layers]
        st = ops.new(media * L * d * k, self.vdt)
        engine.node(st, [(p, ops.gbytes(p)) for p in picked])
        sl1 = engine.view(gouts[-1] if gouts else last, nt * n * d)
        engine.node(sl1, [(gouts[-1] if gouts else last, ops.gbytes(gouts[-1] if gouts else last))])
        sl2 = engine.view(st, nt * n * d * k)
        engine.node(sl2, [(st, ops.gbytes(st))])
        cat = ops.new(nt * n * feature_dim(v), self.vdt)
        engine.node(cat, [(sl1, 0), (sl2, 0)])
        ops.drop(sl1, sl2)
        # the tower returns: its locals go (the conv output, the mask, both encoders' states, the stack)
        ops.drop(conv, mask, *outs, *gouts, st)
        return cat

    def _tile_embedding(self, ws: list[Storage], x: Storage, media: int, numel: int) -> Storage:
        """MllamaPrecomputedAspectRatioEmbedding: the embedding row per image, gated, added to every patch."""
        ops, engine = self.ops, self.engine
        d, tiles = self.v.hidden_size, self.v.processor.max_tiles
        e = ops.new(media * tiles * d, self.vdt)
        engine.node(e, [(ws[0], ops.gbytes(ws[0]))], [])
        g = self._gate(ws[1], e)
        ops.drop(e)
        out = ops.add(x, g, numel)
        ops.drop(g)
        return out

    def _aspect_mask(self, media: int, tiles: int, npad: int) -> Storage:
        """_prepare_aspect_ratio_attention_mask: (N, T) to the dtype, repeated over the positions, the padding
        zeroed in place, inverted, the outer product over all T*Pp positions scaled by the dtype's minimum."""
        ops = self.ops
        L = tiles * npad
        a = ops.new(media * tiles, self.vdt)
        r = ops.new(media * L, self.vdt)
        ops.drop(a)
        c = ops.new(1, self.vdt)  # the scalar 1 made a tensor, then rsub
        ops.drop(c)
        inv = ops.new(media * L, self.vdt)
        ops.drop(r)
        # mask @ mask.transpose(-1, -2): under autocast a lower-precision matmul (both operands cast), so the mask
        # the tower's attention takes is in the compute dtype
        casts = [self.amp_cast(inv) if self.amp else ops.ref(inv) for _ in range(2)]
        mm = ops.new(media * L * L, casts[0].dtype)
        ops.drop(*casts)
        out = ops.new(media * L * L, mm.dtype)
        ops.drop(mm, inv)
        return out

    def vlayer(self, blk: dict, x: Storage, media: int, L: int, mask: Storage, gated: bool) -> Storage:
        """MllamaVisionEncoderLayer: attention over the image's ``L`` positions with the additive mask, MLP."""
        ops, d = self.ops, self.v.hidden_size
        rows = media * L
        h = self.layernorm(blk["ln1"], x, rows, d)
        a = self.vattn(blk["attn"], h, media, L, mask)
        ops.drop(h)
        if gated:
            g = self._gate(blk["gate_attn"], a)
            ops.drop(a)
            a = g
        x1 = ops.add(x, a)
        ops.drop(a)
        h = self.layernorm(blk["ln2"], x1, rows, d)
        u = self.linear(blk["fc1"], h, rows)
        ops.drop(h)
        g = ops.unary(u, save_input=True)  # GELU
        ops.drop(u)
        m = self.linear(blk["fc2"], g, rows)
        ops.drop(g)
        if gated:
            g2 = self._gate(blk["gate_ffn"], m)
            ops.drop(m)
            m = g2
        out = ops.add(x1, m)
        ops.drop(x1, m)
        return out

    def vattn(self, A: dict, x: Storage, media: int, L: int, mask: Storage) -> Storage:
        ops, v = self.ops, self.v
        rows = media * L
        eager = self.setup.attention is Attention.EAGER
        q, k, val = self.qkv(A, x, rows, eager)
        if eager:
            out = self.eager_attention(q, k, val, media * v.num_heads * L * L, mask, prog=None)
        else:
            out = self._sdpa_masked(q, k, val, mask, media, L, L)
        y = self.linear(A["o_proj"], out, rows)
        ops.drop(out, q, k, val)
        return y

    def _sdpa_masked(self, q: Storage, k: Storage, v: Storage, mask: Storage, batch: int, sq: int, sk: int,
                     heads: int = 0) -> Storage:
        """SDPA with an additive (batch, 1, sq, sk) mask, which saves q, k, v, the mask, its output and an fp32
        log-sum-exp. The simulation's CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) takes the mask
        as it is and keeps ``batch x heads x sq`` log-sum-exps. CUDA's flash kernel takes no mask, so the
        memory-efficient kernel runs: SDPA's ``preprocess_mask`` pads a mask whose strides are not multiples of 8
        elements (``pad_bias``: a padded copy, sliced back, that the kernel saves), and the log-sum-exp rows are
        padded to a multiple of 32 (``kAlignLSE``)."""
        ops, engine = self.ops, self.engine
        heads = heads or self.v.num_heads
        cuda = not engine.match_simulation
        # under autocast a lower-precision op: q, k, v and the additive mask cast to the compute dtype first
        q, k, v, mask = (self.amp_cast(t) if self.amp else ops.ref(t) for t in (q, k, v, mask))
        saved_mask = mask
        if cuda and sk % 8:
            saved_mask = ops.new(batch * sq * (sk + (-sk) % 8), mask.dtype)
        out = ops.new(q.numel, q.dtype)
        lse = ops.new(batch * heads * (sq + (-sq) % 32 if cuda else sq), "f32")
        engine.node(out, [(q, ops.gbytes(q)), (k, ops.gbytes(k)), (v, ops.gbytes(v))], [q, k, v, saved_mask, out, lse])
        ops.drop(lse)
        if saved_mask is not mask:
            ops.drop(saved_mask)
        ops.drop(q, k, v, mask)
        return out

    def cross_layer(self, L: dict, x: Storage, d: Dims, cross: tuple) -> Storage:
        """MllamaCrossAttentionDecoderLayer: ``x + tanh(g_attn) * attn(norm(x))``, then
        ``+ tanh(g_mlp) * row_mask * mlp(norm(.))``."""
        ops = self.ops
        states, xmask, rowmask, X = cross
        hid = self.spec.hidden_size
        h = self.norm(L["in_norm"], x, d.T, hid)
        a = self.cross_attention(L, h, d, states, xmask, X)
        ops.drop(h)
        g = self._gate(L["gate_attn"], a)
        x1 = ops.add(x, g)
        ops.drop(g, a)
        n = self.norm(L["post_norm"], x1, d.T, hid)
        m = self._ffn(L, n, d)
        ops.drop(n)
        mm = ops.mul(rowmask, m)
        ops.drop(m)
        g = self._gate(L["gate_mlp"], mm)
        out = ops.add(x1, g)
        ops.drop(g, mm, x1)
        return out

    def torch_norm(self, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
        """The cross-attention's q / k RMSNorms: liger's patch leaves them as transformers builds them."""
        patch, self.liger = self.liger, None
        try:
            return self.norm(ws, x, rows, dim)
        finally:
            self.liger = patch

    def cross_attention(self, L: dict, x: Storage, d: Dims, states: Storage, xmask: Storage, X: int) -> Storage:
        spec, ops = self.spec, self.ops
        T = d.T
        A = L["attn"]
        eager = self.setup.attention is Attention.EAGER
        q = self.head_view(self.linear(A["q_proj"], x, T), eager)
        q2 = self.torch_norm(L["q_norm"], q, T * spec.num_heads, spec.head_dim)
        ops.drop(q)
        q = q2
        rows = X  # the vision positions of the batch (b x images x tiles x positions)
        k = self.head_view(self.linear(A["k_proj"], states, rows), eager)
        v = self.head_view(self.linear(A["v_proj"], states, rows), eager)
        k2 = self.torch_norm(L["k_norm"], k, rows * spec.num_kv_heads, spec.head_dim)
        ops.drop(k)
        k = k2
        b = d.b
        kx = X // b
        if self.setup.attention is Attention.SDPA:
            k, v = self.repeat_kv(k), self.repeat_kv(v)
            out = self._sdpa_masked(q, k, v, xmask, b, d.s, kx, spec.num_heads)
        else:
            k, v = self.repeat_kv(k), self.repeat_kv(v)
            out = self.eager_attention(q, k, v, b * spec.num_heads * d.s * kx, xmask, prog=None)
        y = self.linear(A["o_proj"], out, T)
        ops.drop(out, q, k, v)
        return y


class MllamaStepModel(VlmStepModel):
    """The step of :class:`StepModel` with the tower, the projector and the cross-attention mask before the
    language model."""

    def make_inputs(self, d: Dims) -> None:
        v, ops, vm = self.vm.v, self.ops, self.vm
        self.images = len(vm.tokens.units)
        self.pixels = self.ids = self.armask = self.xmask = None
        if self.images:
            tiles = v.processor.max_tiles
            n = d.b * self.images
            self.pixels = ops.new(n * tiles * v.in_channels * v.image_size ** 2, "f32", Kind.INPUTS)
            self.ids = ops.new(n, "i64", Kind.INPUTS)
            self.armask = ops.new(n * tiles, "i64", Kind.INPUTS)
            self.xmask = ops.new(d.T * self.images * tiles, "i64", Kind.INPUTS)

    def drop_inputs(self) -> None:
        self.ops.drop(self.pixels, self.ids, self.armask, self.xmask)

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        m, ops, engine, setup = self.vm, self.ops, self.engine, self.setup
        v = m.v
        self.kept = []
        cross = None
        if self.images:
            media = d.b * self.images
            n, _ = tile_positions(v)
            X = media * v.processor.max_tiles * n
            with activation_region(engine, Kind.VISION_ACTIVATIONS):
                cat = m.tower(self.pixels, media)
                states = m.linear(m.projector, cat, X)
            self.kept.append(cat)  # vision_outputs rides in the model's output
            # _prepare_cross_attention_mask: repeat_interleave (int64), 1.0 - mask (fp32), to the dtype,
            # masked_fill through a bool copy, the full-text-row mask (any over the vision positions)
            xn = d.T * self.images * v.processor.max_tiles * n
            rep = ops.new(xn, "i64")
            f32 = ops.new(xn, "f32")
            inv = ops.cast(f32, m.vdt)
            ops.drop(f32)
            bmask = ops.new(xn, "bool")
            xmask = ops.new(xn, m.vdt)
            ops.drop(bmask, rep)
            ne = ops.new(xn, "bool")
            anyr = ops.new(d.T, "bool")
            ops.drop(ne)
            rowmask = ops.new(d.T, m.vdt)
            ops.drop(anyr, inv)
            cross = (states, xmask, rowmask, X)
        emb = self.embeddings(ids, d)  # its checkpointing leaf: a text-only batch (check_mllama_setup)
        pos = ops.new(d.s, "i64")
        positions = ops.new(d.s, "i64")
        ops.drop(pos)
        cos, sin = self.rope(d, emb.dtype)
        mask = ops.new(d.b * d.s * d.s, emb.dtype) if setup.attention is Attention.EAGER else None

        def layer(L: dict, x: Storage) -> Storage:
            if not L.get("cross"):
                return self.decoder_layer(L, x, d, cos, sin, mask)
            return m.cross_layer(L, x, d, cross)

        # a text-only batch skips the cross-attention layers
        hn = self.decoder(emb, d, layer, lambda L: bool(L.get("cross")) and cross is None)
        ops.drop(positions, cos, sin, mask)
        if cross is not None:  # MllamaModel.forward's locals
            ops.drop(*cross[:3])
        return hn


def check_estimate(spec: ModelSpec, setup: TrainingSetup) -> None:
    """What the program does not model (``vramlab simulate`` runs transformers' own classes and answers)."""
    if setup.grad_ckpt and setup.images:
        raise SetupError(f"{spec.name}: the estimate does not model Llama 3.2 Vision's non-reentrant checkpointing "
                         "with images (the tower and the checkpointed cross-attention layers); `vramlab simulate` "
                         "runs transformers' own classes and answers")


def step_model(spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens, rank, plan: list[int],  # noqa: ANN001
               mult: dict[int, int], reduced: bool) -> tuple[MllamaStepModel, dict[int, int]]:
    """The step to replay: every layer (the cross-attention layers interleave), none standing for others."""
    return MllamaStepModel(MllamaModel(spec, setup, engine, tokens, rank=rank)), {}


__all__ = ["MllamaModel", "MllamaStepModel", "check_estimate", "step_model"]
