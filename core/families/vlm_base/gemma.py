"""A Gemma language model under a SigLIP tower's image tokens on the symbolic engine (no torch), as Gemma 3 and
PaliGemma run it: the image tiles and ``token_type_ids`` as inputs, the scaled text embeddings, the image
features ``masked_scatter``-ed over the image tokens, Gemma's RoPE table pair, and the checkpointed layer
that keeps ``position_ids`` with the checkpoint's function.
"""

from __future__ import annotations

from vramlab.core.estimator.engine import Storage
from vramlab.core.estimator.program import Dims, activation_region
from vramlab.core.families.vlm_base.program import VlmModel, VlmStepModel
from vramlab.core.kinds import Kind


def load_gemma_layers(m: VlmModel, train_embed: bool) -> None:
    """Gemma's text embedding (the table, then its ``embed_scale`` buffer) and the decoder layers of the plan,
    loaded on ``m`` in transformers' order (the family then loads the final norm, its RoPE buffers, the head)."""
    spec, ops = m.spec, m.ops
    h = spec.hidden_size
    m.embed = m._p(spec.vocab_size * h, m.pdt, train_embed, spec.vocab_size, h)
    m.embed_scale = ops.param(1, m.embed.dtype, Kind.WEIGHTS, False)  # the model's dtype (gathered under FSDP)
    m.pos = None
    m.layers = []
    for tag, i in enumerate(m.plan):
        m.engine.tag = tag
        m.layers.append(m._layer(i))
    m.engine.tag = -1
    m.root_unit()


class GemmaVlmStepModel(VlmStepModel):
    """:class:`VlmStepModel` with a SigLIP tower's tiles scattered into Gemma's scaled embeddings; the family
    gives the masks, positions and decoder of its ``backbone``."""

    per_token_inputs = ("token_types",)  # the processor's token_type_ids, one per token (GRPO extends them)

    def tiles_per_sample(self) -> int:
        """The tower's tiles in one sample (every image and its crops)."""
        return sum(u.tiles for u in self.vm.tokens.units)

    def make_inputs(self, d: Dims) -> None:
        v, ops = self.vm.v, self.ops
        self.images = d.b * self.tiles_per_sample()
        self.pixels = None
        if self.images:
            self.pixels = ops.new(self.images * v.in_channels * v.image_size ** 2, "f32", Kind.INPUTS)
        self.token_types = ops.new(d.T, "i64", Kind.INPUTS)

    def drop_inputs(self) -> None:
        self.ops.drop(self.pixels, self.token_types)

    def scatter_images(self, emb: Storage, d: Dims) -> tuple[Storage, list[Storage]]:
        """The tower and projector over the batch's tiles, their features scattered over the image tokens: the
        embeddings that go on and the forward's locals it leaves (the placeholder mask). The tower's outputs
        are kept with the model's output."""
        m, ops, engine = self.vm, self.ops, self.engine
        self.kept = []
        self.dead_nodes = (0, 0)
        if not self.images:
            return emb, []
        with activation_region(engine, Kind.VISION_ACTIVATIONS):
            last, feats = m.siglip_tower(self.pixels, self.images, self.leaves)
        self.kept = [last, feats]
        # get_placeholder_mask: ids == image_token_id, its sum, the size check
        mask = ops.new(d.T, "bool")
        counts = [ops.new(1, "i64"), ops.new(1, "i64"), ops.new(1, "bool")]
        ops.drop(*counts)
        h = ops.new(d.T * m.spec.hidden_size, emb.dtype)  # inputs_embeds.masked_scatter(mask, features)
        engine.node(h, [(emb, ops.gbytes(emb)), (feats, ops.gbytes(feats))], [mask])
        ops.drop(emb)
        return h, [mask]

    def checkpointed(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        """:meth:`StepModel.checkpointed`; GradientCheckpointingLayer binds the layer's keyword arguments (the
        RoPE pair, the mask, ``position_ids``: :attr:`positions`) into the function the reentrant checkpoint
        keeps on its context, which lives with the graph until the loss is freed, after backward (only the
        tensors it saves go when its backward runs). Non-reentrant, the function lives with the layer's
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
        """Gemma's rotary embedding forward: fp32 angles (1, s, hd), cos and sin times the attention scaling,
        cast."""
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
