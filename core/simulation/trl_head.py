"""TRL 1.16.0's fused LM head (``trl/trainer/utils.py`` ``add_fused_lm_head``, ``trl/kernels/chunked_logprob.py``
``ChunkedLogProbFunction``) on fake tensors, with the allocations of its CUDA path. Every TRL 1.16 trainer scores
tokens through it: SFTTrainer's loss (``--loss-kernel trl``, :func:`sft_loss`), DPO / KTO / GRPO's
log-probabilities (``core/objectives/``).

* The backbone's last hidden states are shifted by one, the positions whose label is not -100 selected
  (``hidden_states[mask]``), and ``ChunkedLogProbFunction`` projects them through the LM head in tiles of 4096
  tokens x 32768 vocabulary entries (``mm_buf``, in the autocast dtype, 32768 wide whatever the vocabulary),
  folding each tile into fp32 running statistics (a Triton kernel on CUDA, in place). Backward recomputes each
  tile and accumulates the hidden-state and LM-head gradients in fp32 (``torch.addmm(..., out_dtype=float32,
  out=acc)`` on CUDA with torch >= 2.8: in place), then casts them to the inputs' dtypes. The per-token outputs
  are scattered back to (batch, sequence - 1) with ``new_zeros(...).masked_scatter(mask, x)``.
* CUDA, not the CPU, is modelled where the two allocate differently: the Triton kernels allocate nothing (the CPU
  fallback ``_forward_tile`` makes tile-sized temporaries), only the valid positions are scored on a Triton
  device (``compact``; the CPU scores every position), ``masked_scatter`` allocates its prefix sums
  (``maskPrefixSum``), ``masked_select`` and boolean indexing their ``nonzero`` indices (temporaries of the
  kernel: autograd keeps the boolean mask for the index's backward). Data-dependent shapes
  cannot run under fake tensors, so those ops are autograd functions that allocate what CUDA allocates, with
  every label valid (no padding).

The estimator's mirror is :class:`vramlab.core.objectives.shared.program.ObjectiveProgram` (``fused_head``);
tests hold the two together and this one to TRL's own function.
"""

from __future__ import annotations

import torch

from vramlab.core.kinds import Kind
from vramlab.core.objectives.shared.trl import SFT_OUTPUTS, TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE
from vramlab.core.simulation import context


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
    """``hidden_states[mask]`` with ``n`` true positions: the index kernel's ``nonzero`` (n x 2 int64, freed when
    the kernel returns) and the (n, hidden) rows; autograd's ``IndexBackward0`` saves the indices it was given,
    the boolean mask, not the kernel's int64 ones. Backward makes zeros of the input's shape and puts the rows in."""

    @staticmethod
    def forward(ctx, x, mask, n):  # noqa: ANN001, ANN205
        nz = torch.empty((n, x.dim() - 1), dtype=torch.long, device=x.device)
        out = torch.empty((n, x.shape[-1]), dtype=x.dtype, device=x.device)
        del nz
        ctx.save_for_backward(mask)
        ctx.shape = x.shape
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g.new_zeros(ctx.shape), None, None


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


def fused_head(h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               compute_dtype: torch.dtype, n_tokens: int, outputs: tuple[str, ...]) -> tuple[list, torch.Tensor]:
    """``add_fused_lm_head``'s forward after the backbone, on a Triton device: (the per-token outputs scattered to
    (batch, seq - 1) and the label mask, the head's own loss)."""
    with context.region(Kind.LOGITS):
        hs = h[:, :-1]
        lab = labels[:, 1:]
        mask = lab != -100
        sel = SelectRows.apply(hs, mask, n_tokens)
        nz = torch.empty((n_tokens, 2), dtype=torch.long, device=h.device)  # labels[mask]
        targets = torch.empty((n_tokens,), dtype=torch.long, device=h.device)
        del nz
        per_token = ChunkedLogProb.apply(sel, weight, bias, targets, compute_dtype, outputs)
        del sel, targets
        shape = tuple(mask.shape)
        scattered = [None if x is None else Compact.apply(x, shape) for x in per_token]
        del per_token
        log_probs = scattered[0]
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        return [*scattered, mask], loss


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """``ChunkedLogProbFunction``'s compute dtype: autocast's when it is on (CUDA autocast, emulated on the
    transformers path), else the hidden states'."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else hidden.dtype


def sft_loss(h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             dtype: torch.dtype) -> torch.Tensor:
    """SFTTrainer.compute_loss with ``loss_type="nll"`` (TRL 1.16.0's default): ``model(**inputs,
    fused_lm_head=True)`` with the outputs it asks for (log-probabilities, entropy and top-1 hits, for its
    metrics), then ``-log_probs`` summed over the batch and divided by the label count. Every label of the
    simulated batch is valid: b x (s - 1) scored tokens."""
    n_tokens = labels.shape[0] * (labels.shape[1] - 1)
    outputs, _own = fused_head(h, labels, weight, bias, dtype, n_tokens, SFT_OUTPUTS)
    with context.region(Kind.LOGITS):
        per_token = -outputs[0]
        num_tokens = outputs[-1].sum()
        loss = per_token.sum() / num_tokens.clamp(min=1)
    del outputs, _own, per_token, num_tokens  # SFTTrainer's locals: gone when compute_loss returns
    return loss


__all__ = ["ChunkedLogProb", "Compact", "SelectRows", "compute_dtype", "fused_head", "sft_loss"]
