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
from vramlab.core.estimator.program import Dims
from vramlab.core.families.paligemma.vision import check_setup
from vramlab.core.families.vlm_base.gemma import GemmaVlmStepModel, load_gemma_layers
from vramlab.core.families.vlm_base.siglip import SiglipModel
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import LinearShape, ModelSpec
from vramlab.core.spec.options import Attention
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import VisionTokens


class PaliGemmaModel(SiglipModel):
    """:class:`SiglipModel`'s tower with PaliGemma's projector and Gemma's language model."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens,
                 rank: int | None = None, plan: list[int] | None = None) -> None:
        if tokens.video is not None:  # as the reference's check (images_only)
            raise SetupError(f"{spec.name}: PaliGemma takes images, not video frames")
        check_setup(spec, setup)
        super().__init__(spec, setup, engine, tokens, rank=rank, plan=plan)

    def load(self) -> None:
        self.load_siglip()
        v = self.v
        self.proj_unit = self.tower_unit()  # PaliGemmaMultiModalProjector is in the model's _no_split_modules
        self.proj = self._vlinear("linear", v.out_hidden_size, v.hidden_size, Kind.PROJECTOR_WEIGHTS,
                                  self.train_projector, False)
        self.root_unit()
        self.load_text()

    def load_text(self) -> None:
        """GemmaModel and the head: :meth:`Model.load`'s parameters with Gemma's buffers (the embedding scale,
        inv_freq and original_inv_freq), built before the head as transformers builds them; the tables'
        construction temporaries are left out (they come before the head, or before the tracker's restart of a
        tied model's load)."""
        spec, ops = self.spec, self.ops
        h = spec.hidden_size
        train_embed = self.setup.trains("embed_tokens")
        load_gemma_layers(self, train_embed)
        self.final_norm = self._norm(self.setup.trains("norm"))
        for _ in range(2):
            ops.param(spec.rope_dim // 2, "f32", Kind.WEIGHTS, False)
        tied = self.embed if spec.tie_embeddings else None
        train_head = train_embed if tied is not None else self.setup.trains("lm_head")
        head = LinearShape("lm_head", spec.vocab_size, h, spec.lm_head_bias)
        self.head = self._linear(head, train_head, "lm_head" in self.targets, tied)

    def project(self, x: Storage, images: int) -> Storage:
        """PaliGemmaMultiModalProjector: one linear over every patch of the last hidden state."""
        return self.unit(self.proj_unit, x, lambda y: self.linear(self.proj, y, images * self.v.positions))


class PaliGemmaStepModel(GemmaVlmStepModel):
    """The step with the image features scattered into the scaled embeddings, the prefix mask from
    ``token_type_ids``, 1-indexed positions and Gemma's decoder layers."""

    def tiles_per_sample(self) -> int:
        return len(self.vm.tokens.units)

    def backbone(self, ids: Storage, d: Dims, checkpointing: bool | None = None) -> Storage:
        """PaliGemmaModel.forward: the scaled embeddings, the positions, the tower and projector, the scatter,
        the mask, the decoder."""
        m, ops = self.vm, self.ops
        emb = self.embeddings(ids, d, m.embed_scale)
        a = ops.new(d.s, "i64")  # arange(s) + 0, then .unsqueeze(0) + 1: positions are 1-indexed
        b = ops.new(d.s, "i64")
        ops.drop(a)
        self.positions = ops.new(d.s, "i64")
        ops.drop(b)
        h, mask = self.scatter_images(emb, d)
        local = [self.positions, *mask]
        # block_sequence_ids = where(token_type_ids == 0, 0, -1), then create_causal_mask's (b, 1, s, s) mask
        block = ops.new(d.T, "i64")
        mdt = m.embed.dtype if self.setup.attention is Attention.EAGER else "bool"
        self.mask = ops.new(d.b * d.s * d.s, mdt)
        return self._decoder(h, d, [*local, block, self.mask])

    def _decoder(self, h: Storage, d: Dims, local: list[Storage]) -> Storage:
        cos, sin = self.rope_tables(d, h.dtype)
        hn = self.decoder(h, d, lambda L, x: self.decoder_layer(L, x, d, cos, sin, self.mask))
        self.ops.drop(cos, sin, *local)  # PaliGemmaModel.forward's locals live until it returns
        return hn


def check_estimate(spec: ModelSpec, setup: TrainingSetup) -> None:
    """What the program does not model, refused before it runs (the language model: Gemma's only)."""
    check_setup(spec, setup)


def step_model(spec: ModelSpec, setup: TrainingSetup, engine: Engine, tokens: VisionTokens, rank, plan: list[int],  # noqa: ANN001
               mult: dict[int, int], reduced: bool) -> tuple[PaliGemmaStepModel, dict[int, int]]:
    """The step to replay and the multiplicity of its replayed layers (the estimator's reduced plan)."""
    return PaliGemmaStepModel(PaliGemmaModel(spec, setup, engine, tokens, rank=rank, plan=plan)), mult
