"""What the objectives' references share: TRL 1.16.0's fused LM head and the reference model, on the model the
simulation builds; each objective's folder (``core/objectives/<unit>/reference.py``) holds its own step.

What is followed (``trl`` 1.16.0, installed with ``pip install vramlab[trl]``):

* ``trl/trainer/utils.py`` ``add_fused_lm_head``: DPOTrainer, KTOTrainer and GRPOTrainer never materialise the
  (batch x sequence x vocabulary) logits; the head and its CUDA allocations are
  :mod:`vramlab.core.simulation.trl_head` (SFTTrainer's loss runs through it too).
* ``DPOTrainer._compute_loss``: chosen and rejected rows concatenated by the collator (2 x micro batch),
  the policy forward, then the reference forward under ``torch.no_grad()`` with gradient checkpointing
  disabled: a second model (``ref_model``), or the policy inside peft's ``disable_adapter`` (``use_adapter``),
  or nothing (``precompute_ref_log_probs``); per-sequence sums, the sigmoid (DPO) or IPO loss.
* ``GRPOTrainer``: ``_generate_single_turn`` (``unwrap_model_for_generation``: eval mode, no_grad, no
  autocast, checkpointing off) with ``model.generate``, whose ``DynamicCache`` (transformers
  ``cache_utils.DynamicLayer.update``) grows every layer's keys and values by ``torch.cat`` once per token;
  ``_generate_and_score_completions`` (old-policy and reference log-probabilities under no_grad, in chunks
  of the micro batch, ``_get_per_token_logps_and_entropies``); ``_compute_loss`` (policy log-probabilities
  and entropies over the completion tokens only, the clipped ratio loss, the KL term when beta > 0).

The estimator (:mod:`vramlab.core.objectives.shared.program` and each objective's ``program``) replays the same
step; tests hold the two together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from vramlab.core.kinds import Kind, Phase
from vramlab.core.simulation import context, trl_head
from vramlab.core.simulation.model import Decoder, Linear
from vramlab.core.spec.options import Reference
from vramlab.core.spec.training import TrainingSetup


def head_dtype(model: Decoder, hidden: torch.Tensor) -> torch.dtype:
    """ChunkedLogProbFunction's compute dtype: autocast's when it is on (HF Trainer with bf16/fp16), else the
    hidden states' (the builder emulates autocast with explicit casts)."""
    plan = model.plan
    if not hasattr(plan, "autocast"):  # transformers' class (a VLM's): CUDA autocast emulated around it
        return trl_head.compute_dtype(hidden)
    return plan.compute_dtype if plan.autocast else hidden.dtype


def fused_head(model: Decoder, h: torch.Tensor, labels: torch.Tensor, n_tokens: int,
               outputs: tuple[str, ...]) -> tuple[list, torch.Tensor]:
    """``add_fused_lm_head``'s forward after the backbone (:func:`vramlab.core.simulation.trl_head.fused_head`) on
    the builder's LM head."""
    return trl_head.fused_head(h, labels, model.lm_head.weight, model.lm_head.bias, head_dtype(model, h), n_tokens,
                               outputs)


@contextlib.contextmanager
def adapters_disabled(model: Decoder) -> Iterator[None]:
    """peft's ``disable_adapter``: every LoRA layer runs its base layer only."""
    inner = getattr(model, "inner", None)  # transformers' class wrapped by peft (a VLM's): peft's own
    if inner is not None and hasattr(inner, "disable_adapter"):
        with inner.disable_adapter():
            yield
        return
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.lora]
    for m in layers:
        m.lora = False
    try:
        yield
    finally:
        for m in layers:
            m.lora = True


def token_ids(rows: int, cols: int, model: Decoder, device: torch.device) -> torch.Tensor:
    """A batch of token ids: random valid ids on real tensors (a profile embeds them), empty on fake ones."""
    if model.plan.real:
        return torch.randint(0, model.plan.spec.vocab_size, (rows, cols), device=device)
    return torch.empty(rows, cols, dtype=torch.long, device=device)


def masked_labels(ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``input_ids.masked_fill(completion_mask == 0, -100)``."""
    return ids.masked_fill(keep == 0, -100)


def log_probs(model: Decoder, ids: torch.Tensor, labels: torch.Tensor, n_tokens: int, outputs: tuple[str, ...],
              grad: bool, images: dict[str, torch.Tensor] | None = None) -> tuple[list, torch.Tensor]:
    """``model(**inputs, labels=labels, fused_lm_head=True)``: backbone (a vision-language model's over the
    batch's ``images`` too), then the fused head; the backbone's output goes when the forward returns."""
    amp = getattr(model, "autocast_region", None)  # transformers' class: accelerate's autocast around it
    with amp() if amp is not None else contextlib.nullcontext():
        h = model.backbone(ids, checkpointing=None if grad else False, **(images or {}))
        out = fused_head(model, h, labels, n_tokens, outputs)
        del h
        release = getattr(model, "release_outputs", None)
        if release is not None:
            release()
        sh = model.plan.sharder
        if sh is not None and sh.params_sharded and sh.reference:  # a sharded reference copy: resharded after
            sh.reshard(-1)  # its forward
    return out


class ReferenceStep:
    """An objective's micro-steps inside ``simulation.step.run_steps``: :meth:`prepare` once per optimizer step
    (GRPO's generation and scoring), :meth:`batch` and :meth:`loss` per micro-batch. Each objective's folder
    subclasses it (its ``reference.STEP``)."""

    collates = True  # :meth:`batch` is the collator's (HF Trainer holds a step's micro-batches: step.holds_batches)

    def __init__(self, policy: Decoder, ref: Decoder | None, setup: TrainingSetup, device: torch.device) -> None:
        self.policy, self.ref, self.setup, self.device = policy, ref, setup, device
        self.buffer: dict[str, torch.Tensor] | None = None

    def prepare(self, mark: Callable[[Phase], None]) -> None:
        """Work once per optimizer step, before its micro-batches (nothing by default)."""

    def prepares_before(self, i: int) -> bool:
        """Whether :meth:`prepare` runs again before micro-batch ``i`` (GRPO regenerating inside a step)."""
        return i == 0

    def batch(self, i: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``i``: what the trainer's collator gives."""
        raise NotImplementedError

    def loss(self, batch: dict[str, torch.Tensor], mark: Callable[[Phase], None]) -> torch.Tensor:
        """The trainer's loss on ``batch`` (``mark`` moves the tracker to another phase)."""
        raise NotImplementedError


def build_reference(build: Callable[..., Decoder], spec, setup: TrainingSetup, device: torch.device,  # noqa: ANN001
                    real: bool) -> Decoder | None:
    """DPOTrainer / GRPOTrainer's ``ref_model``: the same architecture from the same checkpoint, frozen, in
    its own dtype (``model_init_kwargs`` dtype: the policy's unless set)."""
    if setup.reference_mode is not Reference.COPY:
        return None
    with context.region(Kind.REFERENCE):
        ref = build(spec, setup.reference_setup(), device=device, real=real)
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.eval()
    if ref.plan.sharder is not None and ref.plan.sharder.params_sharded:  # TRL's prepare_fsdp / prepare_deepspeed
        ref.plan.sharder.as_reference()
    return ref
