"""A vision-language model's training step on the symbolic engine: the vision tower and projector, the image
features scattered into the text sequence, and the language model (Qwen2.5-VL).

Mirrors transformers' ``Qwen2_5_VLForConditionalGeneration`` as
:mod:`vramlab.core.families.qwen2_5_vl.reference` runs it:

* the tower runs over every image's patches (``N`` of them for the micro-batch): a Conv3d patch embedding,
  the patches reordered into attention windows, a 2-D rotary table in fp32, then ``depth`` blocks (RMSNorm,
  fused qkv, RoPE in fp32, attention per window or per image, RMSNorm, gated MLP); attention runs once per
  window (or per image in the full-attention blocks) as transformers' SDPA path splits it, each call saving
  its output and an fp32 log-sum-exp like a fused CUDA kernel;
* the merger (RMSNorm, 2x2 patches concatenated, two linears with GELU) gives ``N / 4`` tokens in the language
  model's width; they replace the image placeholder tokens of the text embeddings (``masked_scatter``);
* the language model is the Qwen2 decoder of :mod:`vramlab.core.estimator.program` with multimodal RoPE (3 x b x s
  frequencies recomposed into one table).
Sizes are concrete (the number of windows depends on the image size), so the tape is recorded per setup.
"""

from __future__ import annotations

from vramlab.core.estimator.engine import Engine, FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.program import Dims, activation_region
from vramlab.core.families.vlm_base.program import VlmModel, VlmStepModel
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import VisionTokens

VISION_LORA_TARGETS = ("qkv", "proj", "gate_proj", "up_proj", "down_proj")


class Qwen2_5VLModel(VlmModel):
    """:class:`VlmModel` with Qwen2.5-VL's windowed tower and merger, and the Qwen2 language model."""

    # ---- load ---------------------------------------------------------------------------------------------
    def load(self) -> None:
        v = self.v
        d, i = v.hidden_size, v.intermediate_size
        kind, train, lora = Kind.VISION_WEIGHTS, self.train_tower, self.lora_tower
        self.patch_w = self._vp(d * v.patch_features, kind, train, d, v.patch_features)
        self.vblocks = []
        for _ in range(v.depth):
            unit = self.tower_unit()  # Qwen2_5_VLVisionBlock is in the model's _no_split_modules
            blk = {"unit": unit, "norm1": [self._vp(d, kind, train)], "norm2": [self._vp(d, kind, train)],
                   "qkv": self._vlinear("qkv", 3 * d, d, kind, train, lora),
                   "proj": self._vlinear("proj", d, d, kind, train, lora),
                   "mlp": {n: self._vlinear(n, o, k, kind, train, lora)
                           for n, o, k in (("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i))}}
            self.vblocks.append(blk)
        self.root_unit()
        pk, pt, m = Kind.PROJECTOR_WEIGHTS, self.train_projector, v.merged_size
        self.merger_norm = [self._vp(d, pk, pt)]
        self.merger_fc1 = self._vlinear("fc1", m, m, pk, pt, False)
        self.merger_fc2 = self._vlinear("fc2", v.out_hidden_size, m, pk, pt, False)
        for _ in range(2):  # the tower's rotary inv_freq and original_inv_freq buffers
            self.ops.param(v.head_dim // 4, "f32", kind, False)
        super().load()  # with the mRoPE module's inv_freq and original_inv_freq

    # ---- the tower ----------------------------------------------------------------------------------------
    def tower(self, pix: Storage, b: int, leaves: list[Storage], video: bool = False) -> tuple[Storage, list[Storage]]:
        """``model.visual(pixel_values.type(dtype), grid_thw)`` and the scatter's source: returns the image
        features ``cat(pooler_output)`` and what stays referenced until the base model returns."""
        ops, engine, v = self.ops, self.engine, self.v
        one = (self.tokens.video,) if video else self.tokens.units  # get_video_features / get_image_features
        units = [u for _ in range(b) for u in one]
        grids = [u.grid for u in units]
        n = sum(t * h * w for t, h, w in grids)
        d, hd = v.hidden_size, v.head_dim
        mu = v.spatial_merge_size ** 2
        pixc = ops.cast(pix, self.patch_w.dtype)  # pixel_values.type(self.visual.dtype) (gathered, under FSDP)
        # grid-derived index tensors (transformers' vision_utils helpers): position ids, cu_seqlens, window index
        segments = [h * w for t, h, w in grids for _ in range(t)]
        windows = [s for g in grids for s in v.windows(g)]
        pos_ids = ops.new(n * 2, "i64")
        cu = ops.new(len(segments) + 1, "i32")
        win_index = ops.new(n // mu, "i64")
        cu_win = ops.new(len(windows) + 1, "i32")
        # patch_embed: view, Conv3d (no bias), view
        x = self.patch_conv(pixc, self.patch_w, None, n * d)
        if self.setup.grad_ckpt and not x.rg:
            # enable_input_require_grads hooks every input embedding, the tower's patch embedding too: a leaf
            # whose .grad the graph keeps, and the frozen tower is back-propagated through
            x.rg = True
            leaves.append(ops.ref(x))
        # permute_input_for_window_attn: hidden[window_index]; backward: new_zeros + index_put
        h = self._index(x, win_index)
        ops.drop(x)
        # rotary_pos_emb: fp32 (N, 2, hd/4) angles, cos and sin recomposed to (N, hd), then windowed
        q4 = hd // 4
        pf = ops.new(n * 2, "f32")
        freqs = ops.new(n * 2 * q4, "f32")
        ops.drop(pf)
        tables = []
        for _ in range(2):
            t = ops.new(n * 2 * q4, "f32")
            s = ops.new(n * 2 * q4, "f32")
            ops.drop(t)
            tables.append(s)
        rec = []
        for t in tables:  # cos = recomposition(cos): the (N, 2, hd/4) table goes when its name is rebound
            half = ops.new(n * 2 * q4, "f32")
            full = ops.new(n * hd, "f32")
            ops.drop(half, t)
            rec.append(full)
        ops.drop(freqs)
        cos_sin = [self._index(t, win_index) for t in rec]
        ops.drop(*rec)
        cos, sin = cos_sin
        for i, blk in enumerate(self.vblocks):
            full_att = i in v.fullatt_block_indexes
            lengths = segments if full_att else windows
            def run(x: Storage, blk: dict = blk, lengths: list[int] = lengths, full_att: bool = full_att) -> Storage:
                if self.setup.grad_ckpt and self.setup.vision_ckpt:  # kwargs the closure holds
                    return self._checkpointed(lambda y: self.vblock(blk, y, n, lengths, cos, sin), x,
                                              [cos, sin, cu if full_att else cu_win])
                return self.vblock(blk, x, n, lengths, cos, sin)

            h2 = self.unit(blk["unit"], h, run)  # an FSDP unit under ZeRO-3 / FSDP
            ops.drop(h)
            h = h2
        # reverse_indices = argsort(window_index): sort's values and indices
        vals = ops.new(n // mu, "i64")
        rev = ops.new(n // mu, "i64")
        ops.drop(vals)
        # merger: RMSNorm, view (N/4, 4d), Linear, GELU, Linear
        nm = self.norm(self.merger_norm, h, n, d)
        a = self.linear(self.merger_fc1, nm, n // mu)
        g = ops.unary(a, save_input=True)
        ops.drop(a)
        merged = self.linear(self.merger_fc2, g, n // mu)
        ops.drop(g, nm)  # nn.Sequential's argument (the normed input) lives until the sequence returns
        out = self._index(merged, rev)
        ops.drop(merged, rev, cos, sin, pos_ids, cu, win_index, cu_win)  # the tower's forward returns
        # get_image_features: (grid.prod(-1) // 4).tolist(), torch.split -> views; it returns (and the pixel
        # values cast to the tower's dtype go); then the model cats the features
        small = [ops.new(len(grids), "i64"), ops.new(len(grids), "i64")]
        ops.drop(*small, pixc)
        feats = ops.new(out.numel, out.dtype)
        engine.node(feats, [(out, 0)])
        return feats, [h, out]

    def _index(self, x: Storage, index: Storage) -> Storage:
        """``x[index]`` along the first dim (a full permutation): saves the index; backward is new_zeros + index_put."""
        y = self.ops.new(x.numel, x.dtype)
        g = self.ops.gbytes(x)
        self.engine.node(y, [(x, g)], [index], (Temp(0, g), Grad(0), FreeTemp(0)))
        return y

    def vblock(self, blk: dict, x: Storage, n: int, lengths: list[int], cos: Storage, sin: Storage) -> Storage:
        ops, d = self.ops, self.v.hidden_size
        h = self.norm(blk["norm1"], x, n, d)
        a = self.vattention(blk, h, n, lengths, cos, sin)
        ops.drop(h)
        x1 = ops.add(x, a)
        ops.drop(a)
        h = self.norm(blk["norm2"], x1, n, d)
        m = self.mlp(blk["mlp"], h, n)
        ops.drop(h)
        out = ops.add(x1, m)
        ops.drop(x1, m)
        return out

    def vattention(self, blk: dict, x: Storage, n: int, lengths: list[int], cos: Storage, sin: Storage) -> Storage:
        ops, engine, v = self.ops, self.engine, self.v
        d, heads = v.hidden_size, v.num_heads
        qkv = self.linear(blk["qkv"], x, n)
        q, k, val = self._unbind3(qkv, n * d)
        ops.drop(qkv)
        # apply_rotary_pos_emb_vision: q, k to fp32, rotated, back to the compute dtype
        q32 = ops.cast(q, "f32")
        k32 = ops.cast(k, "f32")
        qe = self.rope(q32, cos, sin)
        ke = self.rope(k32, cos, sin)
        qb = ops.cast(qe, q.dtype)
        ops.drop(qe)
        kb = ops.cast(ke, k.dtype)
        ops.drop(ke, q32, k32, q, k)
        # one SDPA call per window / image (transformers' non-flash path splits q, k and v along the sequence)
        outs = []
        seqlens = ops.new(len(lengths), "i32")  # lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        qs, ks, vs = (self._split(t, [s * d for s in lengths]) for t in (qb, kb, val))
        for qc, kc, vc in zip(qs, ks, vs):
            if self.setup.attention is Attention.EAGER:
                outs.append(self._veager(qc, kc, vc, qc.numel // d))
                continue
            o = ops.new(qc.numel, qc.dtype)
            lse = ops.new(heads * (qc.numel // d), "f32")
            engine.node(o, [(qc, ops.gbytes(qc)), (kc, ops.gbytes(kc)), (vc, ops.gbytes(vc))], [qc, kc, vc, o, lse])
            ops.drop(lse)
            outs.append(o)  # transpose(1, 2).contiguous(): the kernel's (b, s, h, d) layout makes it a view
        cat = ops.new(n * d, qb.dtype)  # torch.cat(attn_outputs, dim=1); its backward hands out views
        engine.node(cat, [(o, 0) for o in outs])
        y = self.linear(blk["proj"], cat, n)
        # the forward's locals (the split views, each window's output, q, k, v) live until it returns
        ops.drop(cat, seqlens, *outs, *qs, *ks, *vs, qb, kb, val)
        return y

    def _unbind3(self, x: Storage, numel: int) -> tuple[Storage, Storage, Storage]:
        """``x.reshape(n, 3, heads, hd).permute(1, 0, 2, 3).unbind(0)``: three views; backward stacks the three
        gradients (zeros for a missing one) and the reshape copies the permuted stack back."""
        q, k, v = self.ops.gathering_views(x, [numel] * 3, copy=True)
        return q, k, v

    def _split(self, x: Storage, numels: list[int]) -> list[Storage]:
        """``torch.split(x, sizes, dim)``: views (one part too: split_with_sizes' backward cats); backward cats
        the gradients into one of ``x``'s size."""
        return self.ops.gathering_views(x, numels)


class Qwen2_5VLStepModel(VlmStepModel):
    """The step of :class:`StepModel` with the image features in the input embeddings and multimodal RoPE."""

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        """Qwen2_5_VLModel.forward: the embeddings, the tower's runs scattered in, the language model; the final
        norm's output. The tower's outputs ride in the model's output (:attr:`kept`) until
        :meth:`release_outputs`."""
        m, ops, engine = self.vm, self.ops, self.engine
        spec = m.spec
        hid = spec.hidden_size
        b = d.b
        emb = self.embeddings(ids, d)  # under checkpointing a leaf whose .grad the graph keeps until the loss is freed
        if not m.tokens.all_units:  # a text-only batch: the tower is loaded but does not run
            return self._language_model(emb, d, [])
        # the images' features, then the video's (each its own run of the tower), then each scattered in turn
        runs = []
        with activation_region(engine, Kind.VISION_ACTIVATIONS):
            if m.tokens.units:
                runs.append(m.tower(self.pixels, b, self.leaves))
            if m.tokens.video is not None:
                runs.append(m.tower(self.video_pixels, b, self.leaves, video=True))
        h = emb
        local, keep = [], []
        for i, (feats, kept) in enumerate(runs):
            # get_placeholder_mask: input_ids == image_token_id and == video_token_id, counts, the size check
            masks = [ops.new(d.T, "bool"), ops.new(d.T, "bool")]
            counts = [ops.new(1, "i64"), ops.new(1, "i64"), ops.new(1, "bool"), ops.new(1, "bool")]
            ops.drop(*counts)
            cnt = ops.new(1, "i64")
            mine = masks[1] if (i or not m.tokens.units) else masks[0]
            ops.drop(cnt, *[x for x in masks if x is not mine])
            # inputs_embeds.masked_scatter(mask, features): backward masked_fill for the text, and
            # masked_scatter_backward for the features
            h2 = ops.new(d.T * hid, emb.dtype)
            engine.node(h2, [(h, ops.gbytes(h)), (feats, ops.gbytes(feats))], [mine])
            ops.drop(h, mine)
            h = h2
            local.append(feats)
            keep += kept
        return self._language_model(h, d, local, keep)

    def _language_model(self, h: Storage, d: Dims, local: list[Storage], keep: list[Storage] = ()) -> Storage:
        ops = self.ops
        # the language model: positions arange(s) + 0, expanded to (3, b, s); mRoPE tables
        pos = ops.new(d.s, "i64")
        positions = ops.new(d.s, "i64")
        ops.drop(pos)
        cos, sin = self.mrope(d, h.dtype)
        hn = self.decoder(h, d, lambda L, x: self.decoder_layer(L, x, d, cos, sin, None))
        ops.drop(positions, cos, sin, *local)  # the base model returns: its locals go
        # the tower's outputs (last hidden state, pooled features) ride in the model's output object until the
        # training step keeps only the loss
        self.kept = list(keep)
        return hn

    def mrope(self, d: Dims, dtype: str) -> tuple[Storage, Storage]:
        """Qwen2_5_VLRotaryEmbedding: (3, b, s) positions to fp32 angles; cos and sin recomposed from the
        three position sections, then cast to the hidden dtype."""
        ops = self.ops
        hd = self.m.spec.rope_dim
        n3 = 3 * d.T
        pf = ops.new(n3, "f32")
        freqs = ops.new(n3 * hd // 2, "f32")
        ops.drop(pf)
        tables = []
        for _ in range(2):
            t = ops.new(n3 * hd // 2, "f32")
            s = ops.new(n3 * hd // 2, "f32")
            ops.drop(t)
            tables.append(s)
        rec = []
        for t in reversed(tables):  # sin is recomposed first; each table goes when its name is rebound
            half = ops.new(d.T * hd // 2, "f32")
            full = ops.new(d.T * hd, "f32")
            ops.drop(half, t)
            rec.append(full)
        sin32, cos32 = rec
        cos = ops.cast(cos32, dtype)
        sin = ops.cast(sin32, dtype)
        ops.drop(cos32, sin32, freqs)  # the forward returns
        return cos, sin

    def make_inputs(self, d: Dims) -> None:
        """The batch's pixel values (fp32, as the processor gives them) and grid, beside the token ids."""
        ops, tokens, f = self.ops, self.vm.tokens, self.vm.v.patch_features
        self.pixels = self.grid = self.video_pixels = self.video_grid = None
        if tokens.units:
            n = d.b * sum(u.patches for u in tokens.units)
            self.pixels = ops.new(n * f, "f32", Kind.INPUTS)
            self.grid = ops.new(3 * d.b * len(tokens.units), "i64", Kind.INPUTS)
        if tokens.video is not None:
            self.video_pixels = ops.new(d.b * tokens.video.patches * f, "f32", Kind.INPUTS)
            self.video_grid = ops.new(3 * d.b, "i64", Kind.INPUTS)

    def drop_inputs(self) -> None:
        self.ops.drop(self.pixels, self.grid, self.video_pixels, self.video_grid)


def step_model(spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens, rank, plan: list[int],  # noqa: ANN001
               mult: dict[int, int], reduced: bool) -> tuple[Qwen2_5VLStepModel, dict[int, int]]:
    """The step to replay and the multiplicity of its replayed layers (the estimator's reduced plan)."""
    return Qwen2_5VLStepModel(Qwen2_5VLModel(spec, setup, engine, tokens, rank=rank, plan=plan)), mult
