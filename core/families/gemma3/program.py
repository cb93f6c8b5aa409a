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
from vramlab.core.estimator.program import Dims, scalar_constant
from vramlab.core.families.vlm_base.gemma import GemmaVlmStepModel, load_gemma_layers
from vramlab.core.families.vlm_base.siglip import SiglipModel
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


class Gemma3Model(SiglipModel):
    """:class:`SiglipModel`'s tower (LayerNorm, SigLIP's attention is CLIP's without the CLS) with Gemma 3's
    projector and Gemma's RMSNorm."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens,
                 rank: int | None = None, plan: list[int] | None = None) -> None:
        if tokens.video is not None:  # as the reference's check (images_only)
            raise SetupError(f"{spec.name}: Gemma 3 takes images, not video frames")
        super().__init__(spec, setup, engine, tokens, rank=rank, plan=plan)

    def load(self) -> None:
        self.load_siglip()
        v = self.v
        d = v.hidden_size
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
        train_embed = self.setup.trains("embed_tokens")
        load_gemma_layers(self, train_embed)
        self.final_norm = self._norm(self.setup.trains("norm"))
        for _ in range(2 * len(layer_types(spec.num_layers))):
            ops.param(spec.rope_dim // 2, "f32", Kind.WEIGHTS, False)
        tied = self.embed if spec.tie_embeddings else None
        head = LinearShape("lm_head", spec.vocab_size, h, spec.lm_head_bias)
        train_head = train_embed if tied is not None else self.setup.trains("lm_head")  # a tied head is the table
        self.head = self._linear(head, train_head, "lm_head" in self.targets, tied)

    # ---- Gemma's RMSNorm ------------------------------------------------------------------------------------
    def norm(self, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
        """Gemma3RMSNorm: ``x.float()`` normalised, times ``1 + weight.float()`` in fp32, back to x's dtype (Liger's
        where its patch swaps it in: the decoder's)."""
        if self.liger is not None and self.liger.rms_norm:
            return super().norm(ws, x, rows, dim)
        ops = self.ops
        dtype = x.dtype
        h = ops.cast(x, "f32")
        p = ops.new(h.numel, "f32")
        hb = ops.gbytes(h)
        self.engine.node(p, [(h, hb)], [h], (Temp(0, hb), Temp(0, hb), Grad(0), FreeTemp(0), FreeTemp(0)))
        var = ops.new(rows, "f32")
        self.engine.node(var, [(p, ops.gbytes(p))])
        ops.drop(p)
        a = ops.add(var, scalar_constant(ops))
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

    # ---- the projector --------------------------------------------------------------------------------------
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


class Gemma3StepModel(GemmaVlmStepModel):
    """The step with the image features scattered into the scaled embeddings, Gemma 3's masks, tables and
    decoder layers."""

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        """Gemma3Model.forward: the scaled embeddings, the tower and projector, the scatter, the masks, the
        decoder."""
        h, local = self.scatter_images(self.embeddings(ids, d, self.vm.embed_scale), d)
        masks = self.masks(d, h.dtype)
        return self._decoder(h, d, local + masks, masks)

    def masks(self, d: Dims, dtype: str) -> list[Storage]:
        """create_masks_for_vision_model from token_type_ids: the block ids (small), then the full-attention and
        the sliding-window masks, each (b, 1, s, s) boolean (float in the model's dtype for eager attention)."""
        ops = self.ops
        ss = d.b * d.s * d.s
        mdt = self.vm.embed.dtype if self.setup.attention is Attention.EAGER else "bool"
        block = ops.new(d.T, "i64")
        full = ops.new(ss, mdt)
        sliding = ops.new(ss, mdt)
        return [block, full, sliding]

    def _decoder(self, h: Storage, d: Dims, local: list[Storage], masks: list[Storage] = ()) -> Storage:
        m, ops = self.vm, self.ops
        full, sliding = masks[1], masks[2]
        # Gemma3TextModel.forward: arange(s) + 0, then a table pair per layer type present
        a = ops.new(d.s, "i64")
        positions = ops.new(d.s, "i64")
        ops.drop(a)
        tables = {t: self.rope_tables(d, h.dtype) for t in sorted(layer_types(m.spec.num_layers))}
        self.positions = positions

        def layer(L: dict, x: Storage) -> Storage:
            kind = "full" if (L["index"] + 1) % SLIDING_PATTERN == 0 else "sliding"
            return self.decoder_layer(L, x, d, *tables[kind], full if kind == "full" else sliding)

        hn = self.decoder(h, d, layer)
        ops.drop(positions, *[t for pair in tables.values() for t in pair], *local)
        return hn


def step_model(spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens, rank, plan: list[int],  # noqa: ANN001
               mult: dict[int, int], reduced: bool) -> tuple[Gemma3StepModel, dict[int, int]]:
    """The step to replay and the multiplicity of its replayed layers: the reduced plan keeps the first global
    layer apart (:func:`layer_plan`)."""
    if reduced:
        plan, mult = layer_plan(spec.num_layers)
    return Gemma3StepModel(Gemma3Model(spec, setup, engine, tokens, rank=rank, plan=plan)), mult
