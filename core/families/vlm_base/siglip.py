"""SigLIP's vision tower on the symbolic engine (no torch), as transformers' ``SiglipVisionModel`` without its
pooling head runs it for the families that use it (Gemma 3, PaliGemma):

the pixel values cast to the tower's dtype, a Conv2d patch embedding with bias, the position table added (no
CLS), ``depth`` encoder layers (LayerNorm, q/k/v/out linears with biases, attention over the tile's patches,
LayerNorm, fc1, tanh GELU, fc2), ``post_layernorm``; then the family's projector (:meth:`SiglipModel.project`).
"""

from __future__ import annotations

from vramlab.core.estimator.engine import Storage
from vramlab.core.families.vlm_base.program import VlmModel
from vramlab.core.kinds import Kind


class SiglipModel(VlmModel):
    """:class:`VlmModel` with SigLIP's tower; a family gives its projector's parameters and :meth:`project`."""

    def load_siglip(self) -> None:
        """SiglipVisionModel's parameters and buffers, in transformers' order."""
        v, ops = self.v, self.ops
        d, i = v.hidden_size, v.intermediate_size
        kind, train, lora = Kind.VISION_WEIGHTS, self.train_tower, self.lora_tower
        # SiglipVisionEmbeddings: patch_embedding (Conv2d with bias), position_embedding, position_ids buffer; an
        # FSDP unit, as each SiglipEncoderLayer (the model's _no_split_modules name both)
        self.embed_unit = self.tower_unit()
        pf = v.in_channels * v.patch_size ** 2
        self.patch_w = self._vp(d * pf, kind, train, d, pf)
        self.patch_b = self._vp(d, kind, train)
        self.pos_w = self._vp(v.positions * d, kind, train, v.positions, d)
        self.pos_ids = ops.param(v.positions, "i64", kind, False)
        self.vblocks = []
        for _ in range(v.depth):
            blk = {"unit": self.tower_unit(), "ln1": [self._vp(d, kind, train), self._vp(d, kind, train)],
                   "attn": {n: self._vlinear(n, d, d, kind, train, lora) for n in ("k_proj", "v_proj", "q_proj",
                                                                                  "out_proj")},
                   "ln2": [self._vp(d, kind, train), self._vp(d, kind, train)],
                   "fc1": self._vlinear("fc1", i, d, kind, train, lora),
                   "fc2": self._vlinear("fc2", d, i, kind, train, lora)}
            self.vblocks.append(blk)
        self.root_unit()
        self.post_ln = [self._vp(d, kind, train), self._vp(d, kind, train)]

    def siglip_tower(self, pix: Storage, tiles: int, leaves: list[Storage]) -> tuple[Storage, Storage]:
        """``get_image_features``: the tower's last hidden state and the projected features of every tile."""
        ops, v = self.ops, self.v
        d, P = v.hidden_size, v.positions
        n = tiles * P
        h = self.unit(self.embed_unit, pix, lambda p: self.siglip_embeddings(p, tiles, leaves))
        for blk in self.vblocks:
            def run(x: Storage, blk: dict = blk) -> Storage:
                if self.setup.grad_ckpt and self.setup.vision_ckpt:
                    return self._checkpointed(lambda y: self.vit_layer(blk, y, tiles, self.siglip_mlp), x, [])
                return self.vit_layer(blk, x, tiles, self.siglip_mlp)

            h2 = self.unit(blk["unit"], h, run)  # an FSDP unit under ZeRO-3 / FSDP
            ops.drop(h)
            h = h2
        last = self.layernorm(self.post_ln, h, n, d)
        ops.drop(h)
        return last, self.project(last, tiles)

    def siglip_embeddings(self, pix: Storage, tiles: int, leaves: list[Storage]) -> Storage:
        """SiglipVisionEmbeddings: the patch convolution (in the weights' dtype: the gathered one under FSDP mixed
        precision) and the position table added."""
        ops, engine, v = self.ops, self.engine, self.v
        d, P = v.hidden_size, v.positions
        wdt = self.patch_w.dtype
        pixc = ops.cast(pix, wdt)  # pixel_values.to(patch_embedding.weight.dtype)
        conv = self.patch_conv(pixc, self.patch_w, self.patch_b, tiles * P * d)
        ops.drop(pixc)
        if self.setup.grad_ckpt and not conv.rg:
            conv.rg = True  # enable_input_require_grads hooks the patch embedding's output
            leaves.append(ops.ref(conv))
        # flatten(2).transpose(1, 2): a view; + position_embedding(position_ids)
        pt = engine.view(conv)
        engine.node(pt, [(conv, ops.gbytes(conv))])
        ops.drop(conv)
        pe = ops.new(P * d, wdt)
        engine.node(pe, [(self.pos_w, ops.gbytes(self.pos_w))], [self.pos_ids])
        h = ops.add(pt, pe, tiles * P * d)
        ops.drop(pt, pe)
        return h

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
        """The family's multi-modal projector over the tower's last hidden state of ``tiles`` tiles."""
        raise NotImplementedError
