"""What the objectives' references share: TRL 1.16.0's fused LM head and the reference model, on the model the
simulation builds; each objective's folder (``core/objectives/<unit>/reference.py``) holds its own step.

What is followed (``trl`` 1.16.0, installed with ``pip install vramlab[trl]``):

* ``trl/trainer/utils.py`` ``add_fused_lm_head``: DPOTrainer and GRPOTrainer never materialise the
  (batch x sequence x vocabulary) logits. The backbone's last hidden states are shifted by one, the
  positions whose label is not -100 selected (``hidden_states[mask]``: only completion tokens), and
  ``ChunkedLogProbFunction`` (``trl/kernels/chunked_logprob.py``) projects them through the LM head in tiles
  of 4096 tokens x 32768 vocabulary entries (``mm_buf``, in the autocast dtype), folding each tile into fp32
  running statistics (a Triton kernel on CUDA, in place). Backward recomputes each tile and accumulates the
  hidden-state and LM-head gradients in fp32 (``torch.addmm(..., out_dtype=float32, out=acc)`` on CUDA with
  torch >= 2.8: in place), then casts them to the inputs' dtypes. The per-token outputs are scattered back
  to (batch, sequence - 1) with ``new_zeros(...).masked_scatter(mask, x)``.
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

CUDA, not the CPU, is modelled where the two allocate differently: the Triton kernels allocate nothing
(the CPU fallback ``_forward_tile`` makes tile-sized temporaries), ``masked_scatter`` allocates its prefix
sums (``maskPrefixSum``), ``masked_select`` and boolean indexing their ``nonzero`` indices. Data-dependent
shapes (the number of completion tokens) cannot run under fake tensors, so those ops are written here as
autograd functions that allocate what CUDA allocates, with every row full (no padding). The estimator
(:mod:`vramlab.core.objectives.shared.program` and each objective's ``program``) replays the same step; tests
hold the two together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.trl import TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE
from vramlab.core.simulation import context
from vramlab.core.simulation.model import Decoder, Linear
from vramlab.core.spec.options import Reference
from vramlab.core.spec.training import TrainingSetup


def _tile(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) tile inside ``buf``. TRL slices ``mm_buf[:rows, :cols]``, a strided view that cuBLAS
    writes in place (its leading dimension is the buffer's); the CPU's ``mm(out=)`` would copy a strided
    output, so the simulation takes a contiguous view of the same storage instead: the same bytes."""
    return buf.view(-1)[: rows * cols].view(rows, cols)


class ChunkedLogProb(torch.autograd.Function):
    """``trl.kernels.ChunkedLogProbFunction`` with the allocations of its CUDA path (see the module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype, outputs):  # noqa: ANN001, ANN205
        ctx.set_materialize_grads(False)
        dev, f32 = hidden.device, torch.float32
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        running_max = torch.full((n_tok,), float("-inf"), device=dev, dtype=f32)
        sum_exp = torch.zeros((n_tok,), device=dev, dtype=f32)
        x_sum_exp = torch.zeros((n_tok,), device=dev, dtype=f32)
        sq_sum_exp = torch.zeros((n_tok,), device=dev, dtype=f32)  # noqa: F841 - TRL's statistic, alive as long
        z_sum = torch.zeros((n_tok,), device=dev, dtype=f32)
        max_before_target = torch.full((n_tok,), float("-inf"), device=dev, dtype=f32)
        target_logit = torch.zeros((n_tok,), device=dev, dtype=f32)
        mm_buf = torch.empty((min(n_tok, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), device=dev, dtype=compute_dtype)
        for token_start in range(0, n_tok, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, n_tok)
            hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
            for start in range(0, vocab, VOCAB_CHUNK_SIZE):
                end = min(start + VOCAB_CHUNK_SIZE, vocab)
                tile = _tile(mm_buf, token_end - token_start, end - start)
                torch.mm(hidden_chunk, weight[start:end].to(compute_dtype).t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(compute_dtype))
                # _forward_kernel (Triton) folds the tile into the statistics in place: nothing allocated
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
        mean_logits = z_sum / vocab if "mean_logits" in outputs else None
        is_top1 = (target_logit >= running_max) & (target_logit > max_before_target) if "is_top1" in outputs else None
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z if entropy is None else entropy)
        ctx.compute_dtype = compute_dtype
        ctx.mark_non_differentiable(*(x for x in (mean_logits, is_top1) if x is not None))
        return logprobs, entropy, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):  # noqa: ANN001, ANN205
        hidden, weight, bias, _targets, _log_z, _entropy = ctx.saved_tensors
        cd = ctx.compute_dtype
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        f32 = torch.float32
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=f32) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=f32) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=f32) if needs_bias else None
        mm_buf = torch.empty((min(n_tok, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), device=hidden.device, dtype=cd)
        for token_start in range(0, n_tok, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, n_tok)
            hidden_chunk = hidden[token_start:token_end].to(cd)
            for start in range(0, vocab, VOCAB_CHUNK_SIZE):
                end = min(start + VOCAB_CHUNK_SIZE, vocab)
                w_chunk = weight[start:end].to(cd)
                tile = _tile(mm_buf, token_end - token_start, end - start)
                torch.mm(hidden_chunk, w_chunk.t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(cd))
                # _backward_kernel writes the logits' gradient into the tile; _addmm_fp32 accumulates into
                # grad_hidden / grad_weight with torch.addmm(out_dtype=float32, out=acc): nothing allocated
        # mm_buf and the last chunks are TRL's locals: alive while the gradients are cast
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None)


class SelectRows(torch.autograd.Function):
    """``hidden_states[mask]`` with ``n`` true positions: ``nonzero`` (n x 2 int64, kept as the saved
    indices) and the (n, hidden) rows; backward makes zeros of the input's shape and puts the rows in."""

    @staticmethod
    def forward(ctx, x, n):  # noqa: ANN001, ANN205
        nz = torch.empty((n, x.dim() - 1), dtype=torch.long, device=x.device)
        out = torch.empty((n, x.shape[-1]), dtype=x.dtype, device=x.device)
        ctx.save_for_backward(nz)
        ctx.shape = x.shape
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g.new_zeros(ctx.shape), None


class Compact(torch.autograd.Function):
    """``x.new_zeros(mask.shape).masked_scatter(mask, x)`` on CUDA: the zeros, their clone, the int64 prefix
    sums of the mask; backward is ``masked_select`` (``nonzero`` indices, then the selected gradient)."""

    @staticmethod
    def forward(ctx, x, shape):  # noqa: ANN001, ANN205
        zeros = x.new_zeros(shape)
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        prefix = torch.empty(shape, dtype=torch.long, device=x.device)
        del prefix, zeros
        ctx.n = x.shape[0]
        ctx.ndim = len(shape)
        if not x.dtype.is_floating_point:
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        nz = torch.empty((ctx.n, ctx.ndim), dtype=torch.long, device=g.device)
        out = torch.empty((ctx.n,), dtype=g.dtype, device=g.device)
        del nz
        return out, None


def head_dtype(model: Decoder, hidden: torch.Tensor) -> torch.dtype:
    """ChunkedLogProbFunction's compute dtype: autocast's when it is on (HF Trainer with bf16/fp16), else the
    hidden states' (the builder emulates autocast with explicit casts)."""
    plan = model.plan
    return plan.compute_dtype if plan.autocast else hidden.dtype


def fused_head(model: Decoder, h: torch.Tensor, labels: torch.Tensor, n_tokens: int,
               outputs: tuple[str, ...]) -> tuple[list, torch.Tensor]:
    """``add_fused_lm_head``'s forward after the backbone: (per-token outputs (batch, seq - 1), loss)."""
    with context.region(Kind.LOGITS):
        hs = h[:, :-1]
        lab = labels[:, 1:]
        mask = lab != -100
        sel = SelectRows.apply(hs, n_tokens)
        nz = torch.empty((n_tokens, 2), dtype=torch.long, device=h.device)  # labels[mask]
        targets = torch.empty((n_tokens,), dtype=torch.long, device=h.device)
        del nz
        head = model.lm_head.weight
        bias = model.lm_head.bias
        per_token = ChunkedLogProb.apply(sel, head, bias, targets, head_dtype(model, h), outputs)
        del sel, targets
        shape = tuple(mask.shape)
        scattered = [None if x is None else Compact.apply(x, shape) for x in per_token]
        del per_token
        log_probs = scattered[0]
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        return [*scattered, mask], loss


@contextlib.contextmanager
def adapters_disabled(model: Decoder) -> Iterator[None]:
    """peft's ``disable_adapter``: every LoRA layer runs its base layer only."""
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
              grad: bool) -> tuple[list, torch.Tensor]:
    """``model(**inputs, labels=labels, fused_lm_head=True)``: backbone, then the fused head."""
    h = model.backbone(ids, checkpointing=None if grad else False)
    out = fused_head(model, h, labels, n_tokens, outputs)
    del h
    return out


class ReferenceStep:
    """An objective's micro-steps inside ``simulation.step.run_steps``: :meth:`prepare` once per optimizer step
    (GRPO's generation and scoring), :meth:`batch` and :meth:`loss` per micro-batch. Each objective's folder
    subclasses it (its ``reference.STEP``)."""

    def __init__(self, policy: Decoder, ref: Decoder | None, setup: TrainingSetup, device: torch.device) -> None:
        self.policy, self.ref, self.setup, self.device = policy, ref, setup, device
        self.buffer: dict[str, torch.Tensor] | None = None

    def prepare(self, mark: Callable[[Phase], None]) -> None:
        """Work once per optimizer step, before its micro-batches (nothing by default)."""

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
    return ref
