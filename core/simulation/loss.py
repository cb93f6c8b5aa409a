"""The loss as a transformation of the step: the kernel that turns a causal LM's hidden states into its loss.

transformers' causal LMs compute ``lm_head`` on the base model's last hidden states, apply their own logit
post-processing (Gemma 2 / 3's final soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``),
and call ``ForCausalLMLoss`` (logits upcast to fp32, labels shifted by padding, cross entropy). A loss kernel
replaces that last part, the way the fine-tuning stacks patch it: they keep the base model's forward and hand
its hidden states and the head to their own loss (Liger's ``lce_forward``, Cut Cross Entropy's ``cce_patch``,
LitGPT's chunked cross entropy). :func:`apply` does the same for any model transformers builds as a causal
LM, hand-written families and traced ones alike, so that every option of the loss applies to every family:

* ``--loss-bf16``: the cross entropy on the logits in their own dtype (no fp32 upcast);
* ``--chunked-loss``: ``lm_head`` and the loss per chunk of the sequence under reentrant checkpointing (the
  built-in decoder's ``_chunked_loss``): only one chunk's logits exist at a time, recomputed in backward;
* ``--loss-kernel trl``: TRL 1.16.0's fused LM head, as SFTTrainer computes its loss
  (:mod:`vramlab.core.simulation.trl_head`): no logits, 4096 x 32768 tiles, fp32 statistics and gradients;
* ``--loss-kernel cce``: Cut Cross Entropy 25.1.1 (axolotl's ``cut_cross_entropy: true``), which never makes the
  logits: :class:`CutCrossEntropy` allocates what its ``LinearCrossEntropyFunction`` allocates around its Triton
  kernels (which run on CUDA only), tensor for tensor;
* ``--loss-kernel liger``: Liger Kernel 0.8.5's fused linear cross-entropy (``use_liger_kernel``, axolotl's
  ``liger_fused_linear_cross_entropy``), which makes the logits one tile of tokens at a time and the gradients
  during the forward: :class:`LigerFusedLinearCrossEntropy` allocates what its
  ``LigerFusedLinearCrossEntropyFunction`` allocates around its Triton kernels on CUDA, tensor for tensor.

With neither, the function computes what ``ForCausalLMLoss`` computes, tensor for tensor (a test holds the
two equal under fake tensors), so a kernel only changes what it changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vramlab.core.checks import SetupError
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context, liger, trl_head, unsloth, unsloth_loss
from vramlab.core.spec.options import LossKernel, liger_chunk_rows
from vramlab.core.spec.training import TrainingSetup


def replaces_loss(setup: TrainingSetup) -> bool:
    """Whether ``setup`` asks for another loss than transformers' own (``ForCausalLMLoss``)."""
    return (setup.chunked_loss or not setup.loss_fp32 or setup.loss_kernel is not LossKernel.HF
            or "cross_entropy" in setup.liger_kernels  # liger's patch puts its cross_entropy in torch's place
            or "cross_entropy" in setup.unsloth_kernels  # unsloth's patch_loss_functions its loss in transformers'
            or "fused_loss" in setup.unsloth_kernels)  # FastLanguageModel's forward its own


def causal_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The base model, the output head and the logit post-processing of a transformers causal LM (peft-wrapped
    or not): what a loss kernel patch keeps of the model's own forward."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(causal, getattr(causal, "base_model_prefix", ""), None)
    head = causal.get_output_embeddings() if hasattr(causal, "get_output_embeddings") else None
    if not isinstance(backbone, nn.Module) or backbone is causal or head is None:
        raise SetupError(f"{type(causal).__name__} has no base model and output head to hand a loss kernel")
    return backbone, head, logit_post(causal.config)


def logit_post(config: object) -> Callable[[torch.Tensor], torch.Tensor]:
    """The causal LM's own operations on its logits between ``lm_head`` and the loss, op by op as transformers
    writes them (each a logits-sized tensor)."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    div = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    capped = unsloth.softcap(cap)  # Gemma 2's final softcap, written once (Unsloth's loss applies it too)

    def post(logits: torch.Tensor) -> torch.Tensor:
        if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1:
            logits = logits * scale
        if isinstance(div, (int, float)) and not isinstance(div, bool) and div != 1:
            logits = logits / div
        return capped(logits)

    return post


def head_loss(h: torch.Tensor, head: nn.Module, labels: torch.Tensor, vocab: int, fp32: bool,
              post: Callable[[torch.Tensor], torch.Tensor], mean: bool = True,
              ce: Callable = F.cross_entropy) -> torch.Tensor:
    """``lm_head`` + ``ForCausalLMLoss`` (transformers 5): logits (post-processed), upcast to fp32 when
    ``fp32``, labels padded by one and shifted, cross entropy over every token (``ce``: torch's, or the one
    Liger's patch puts in its place)."""
    logits = head(h)
    stop = logits.grad_fn  # the head's output goes with post's first rebinding, as in the model's forward
    logits = post(logits)
    upcast = logits.float() if fp32 else logits
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    if ce is F.cross_entropy:
        loss = F.cross_entropy(upcast.view(-1, vocab), shift.view(-1), ignore_index=-100,
                               reduction="mean" if mean else "sum")
    else:
        loss = ce(upcast.view(-1, vocab), shift.view(-1))
    context.label_backward(loss, stop, Kind.LOGITS)
    return loss


def chunked_loss(h: torch.Tensor, head: nn.Module, labels: torch.Tensor, vocab: int, fp32: bool,
                 post: Callable[[torch.Tensor], torch.Tensor], chunks: int) -> torch.Tensor:
    """:func:`head_loss` per chunk of the sequence (``torch.chunk`` into ``chunks``), each under reentrant
    checkpointing (its logits recomputed in backward), the partial sums added and divided by the tokens."""
    total = None
    tokens = labels.numel()

    def chunk_loss(hc: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
        with context.region(Kind.LOGITS):
            return head_loss(hc, head, lc, vocab, fp32, post, mean=False)

    for hc, lc in zip(h.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
        part = checkpoint(chunk_loss, hc, lc, use_reentrant=True, preserve_rng_state=False)
        total = part if total is None else total + part
    return total / tokens


class CutCrossEntropy(torch.autograd.Function):
    """cut_cross_entropy 25.1.1's ``LinearCrossEntropyFunction`` (``cce.py``) with ``shift=True``,
    ``reduction="mean"`` and ``filter_eps="high"`` (``linear_cross_entropy``'s defaults, as axolotl's patch calls
    it): every tensor its Python code allocates around the Triton kernels, which write into them (so their values
    here are not the loss; the bytes are).

    Forward (``cce_lse_forward_kernel``, ``indexed_neg_dot_forward_kernel``): an fp32 log-sum-exp per valid token,
    a uint32 lock per 128 of them (freed when the kernel returns), an fp32 running logit average per vocabulary
    entry (kept for backward's ordering), an fp32 negative dot per token (softcapped by one compiled kernel where
    the model caps its logits), the loss its mean; the valid positions ride on the node (``ctx.params``) until
    the graph goes. Backward (``cce_backward_kernel``): the vocabulary's
    ordering (``argsort``: fp32 values and int64 indices, cast to int32), the hidden states' gradient
    (``zeros_like(e)``), the head's in the hidden states' dtype then ``.to`` the head's, and two int32 lock
    arrays of ``ceil(D / 64)`` columns."""

    @staticmethod
    def forward(ctx, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,  # noqa: ANN001
                valids: torch.Tensor, softcap: float | None) -> torch.Tensor:
        n, vocab = valids.numel(), c.shape[0]
        lse = e.new_full((n,), -float("inf"), dtype=torch.float32)
        locks = e.new_full((-(-n // 128),), 0, dtype=torch.uint32)
        logit_avg = e.new_full((vocab,), 0.0, dtype=torch.float32) if e.requires_grad or c.requires_grad else None
        del locks  # cce_lse_forward_kernel returns
        neg_dot = e.new_zeros((n,), dtype=torch.float32)
        if softcap is not None:  # utils.softcapping, one compiled kernel: tanh(x / cap) * cap
            neg_dot = torch.empty_like(neg_dot)
        nll = neg_dot.add_(lse)
        loss = nll.mean()
        ctx.save_for_backward(e, c, lse, logit_avg)
        ctx.params = (targets, valids)  # CCEParams: on the node, freed with the graph (after backward)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:  # noqa: ANN001
        e, c, lse, logit_avg = ctx.saved_tensors
        values, indices = torch.sort(logit_avg)  # sort_logit_avg: argsort (values and indices), then int32
        del values
        ordering = indices.to(torch.int32)
        del indices
        de = torch.zeros_like(e)
        dc = torch.zeros_like(c, dtype=e.dtype) if ctx.needs_input_grad[1] else None
        columns = -(-c.shape[1] // 64)
        de_locks = e.new_zeros((-(-lse.numel() // columns), columns), dtype=torch.int32)
        dc_locks = c.new_zeros((-(-c.shape[0] // columns), columns), dtype=torch.int32)
        dc = dc.to(c.dtype) if dc is not None else None
        del de_locks, dc_locks, ordering
        return de, dc, None, None, None


def cut_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      softcap: float | None = None) -> torch.Tensor:
    """``cce_linear_cross_entropy(h, weight, labels, shift=True)``: the valid positions of the shifted labels
    (``_build_flat_valids``: ``nonzero`` as int64, cast to int32, each row's offset summed to int64; every label
    of the simulated batch is valid, so the count is the batch times the sequence less one), then
    :class:`CutCrossEntropy` on the flattened hidden states. Refused where its backward cannot run."""
    if h.dtype not in (torch.float16, torch.bfloat16):
        raise SetupError("Cut Cross Entropy cannot train on fp32 hidden states (its backward: \"Backwards requires "
                         "embeddings to be bf16 or fp16\")")
    e = h.contiguous()
    targets = labels.contiguous()
    shifted = targets[..., 1:]
    n = math.prod(shifted.shape)
    mask = shifted != -100
    found = torch.empty((n, shifted.ndim), dtype=torch.int64, device=h.device)  # mask.nonzero()
    del mask
    rows = found.to(torch.int32)
    del found
    valids = rows.sum(1)
    del rows
    return CutCrossEntropy.apply(e.flatten(0, -2), weight, targets.flatten(), valids, softcap)


class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """liger-kernel 0.8.5's ``LigerFusedLinearCrossEntropyFunction`` (``ops/fused_linear_cross_entropy.py``) as
    its ``lce_forward`` calls it (``reduction="mean"``, no bias, ``accum_dtype`` None), on CUDA with compute
    capability 8.0 or later: every tensor its Python code allocates around its Triton kernels, which write into
    them (so their values here are not the loss; the bytes are). The softcap is an argument of the kernel: it
    allocates nothing.

    Forward (``fused_linear_cross_entropy_forward``) computes the gradients: the hidden states'
    (``zeros_like``, in their dtype) and, where the hidden states and the head both require grad, the head's
    (``zeros_like(weight)``, in the head's dtype); an fp32 loss per token; the labels' mask and its count; one
    logits tile of :func:`liger_chunk_rows` tokens x vocabulary in the hidden states' dtype (``torch.mm(...,
    out=)``), which the cross-entropy kernel overwrites with its gradient and which ``mm`` / ``addmm`` then project
    into the two gradients, tile by tile, with no other tensor; an fp32 head (whose logits are fp32 too) takes the
    library's other path, a head-sized fp32 product per tile added into its gradient. Under autocast on fp32 hidden
    states (``matmul``: the step's autocast matmul) the library makes each tile by ``@`` instead, which autocast
    casts: the tile of tokens and the transposed head (a view: never cached) to the compute dtype for the logits,
    the head again for the hidden states' gradient (a trainable head's copy held by autocast's cache until its
    region ends), whose compute-dtype product is copied into the fp32 gradient; the head's gradient accumulates by
    ``addmm(out_dtype=fp32)`` on the tile of tokens cast to the compute dtype. Both gradients are saved for
    backward, which compares the incoming gradient with a new scalar 1.0, scales them in place where it differs
    (``element_mul_kernel``) and returns them: the head's becomes its ``.grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,  # noqa: ANN001
                matmul: Callable | None) -> torch.Tensor:
        loss, grad_input, grad_weight = _liger_forward(x, weight, target, matmul)
        ctx.save_for_backward(grad_input, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:  # noqa: ANN001
        grad_input, grad_weight = ctx.saved_tensors
        # torch.equal(grad_output, torch.tensor(1.0, device=...)): a scalar on the device (made by torch.full, which
        # fake tensors count, where torch.tensor's constant is lifted without an allocation of its own)
        one = torch.full((), 1.0, device=grad_out.device)
        del one
        return grad_input, grad_weight, None, None


def _liger_forward(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                   matmul: Callable | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``fused_linear_cross_entropy_forward``'s allocations, its locals in the order the library makes them
    (a function's locals are freed in that order when it returns)."""
    bt, hidden = x.shape
    vocab = weight.shape[0]
    rows = liger_chunk_rows(bt, vocab, hidden)
    grad_input = torch.zeros_like(x)
    grad_weight = torch.zeros_like(weight) if x.requires_grad and weight.requires_grad else None
    loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)
    target_mask = target != -100
    count = target_mask.sum()  # .item()
    del count
    if matmul is not None:  # autocast to another dtype: _can_use_mm_out is False, each tile made by @
        _autocast_tiles(x, weight, grad_weight, rows, matmul)
    logits_storage = torch.empty((rows, vocab), dtype=x.dtype, device=x.device) if matmul is None else None
    if matmul is None and grad_weight is not None and x.dtype == torch.float32:  # grad_weight += mm(...).float()
        for _ in range(-(-bt // rows)):
            product = torch.empty_like(grad_weight)
            del product
    del logits_storage
    loss = torch.sum(loss_1d)
    del target_mask  # freed before loss_1d, which its last tile's view (a later local of the library's) keeps
    return loss, grad_input, grad_weight


def _autocast_tiles(x: torch.Tensor, weight: torch.Tensor, grad_weight: torch.Tensor | None, rows: int,
                    matmul: Callable) -> None:
    """The library's tiles under autocast: ``logits = x_tile @ weight.t()``, ``grad_input[tile] = logits @ weight``
    and, for an fp32 head gradient, ``addmm(..., x_tile.to(logits.dtype), out_dtype=fp32, out=)``."""
    for start in range(0, x.shape[0], rows):
        tile = x[start:start + rows]
        logits = matmul(tile, weight.t(), False)
        if x.requires_grad:
            part = matmul(logits, weight, True)
            del part
        if grad_weight is not None and grad_weight.dtype == torch.float32 and logits.dtype != torch.float32:
            cast = tile.to(logits.dtype)
            del cast
        del logits, tile


def liger_fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                     matmul: Callable | None = None) -> torch.Tensor:
    """``LigerForCausalLMLoss`` (liger-kernel 0.8.5's ``lce_forward`` in training): the labels padded by one and
    shifted (as transformers' loss), the hidden states flattened, then :class:`LigerFusedLinearCrossEntropy`.
    Refused where its matmul cannot run: hidden states and a head of different dtypes outside autocast."""
    if h.dtype != weight.dtype and matmul is None:
        raise SetupError(f"Liger's fused linear cross-entropy multiplies {str(h.dtype)[6:]} hidden states by a "
                         f"{str(weight.dtype)[6:]} head outside autocast, which torch refuses (\"expected mat1 and "
                         "mat2 to have the same dtype\")")
    padded = F.pad(labels, (0, 1), value=-100)
    shift = padded[..., 1:].contiguous()
    return LigerFusedLinearCrossEntropy.apply(h.view(-1, h.shape[-1]), weight, shift.view(-1), matmul)


def _refuse_logit_scale(config: object) -> None:
    """Liger's fused linear cross-entropy takes a softcap, no logit scale (Cohere's ``logit_scale``, Granite's
    ``logits_scaling``): liger-kernel 0.8.5 patches no Cohere model and refuses Granite's."""
    for key in ("logit_scale", "logits_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1:
            raise SetupError(f"Liger's fused linear cross-entropy cannot scale the logits ({key} {value:g}): it takes "
                             "a softcap only, and liger-kernel 0.8.5 refuses it for such a model (\"LigerFusedLinear"
                             "CrossEntropy is not available for Granite models\"): use --loss-kernel hf")


def _softcap(config: object) -> float | None:
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def apply(model: nn.Module, setup: TrainingSetup, ids: torch.Tensor, labels: torch.Tensor,
          **kwargs: object) -> torch.Tensor:
    """The loss of ``setup``'s kernel on transformers causal LM ``model``: its base model's forward (as the
    model's own forward calls it), then :func:`head_loss` or :func:`chunked_loss` on the last hidden states.
    The base model's output (a vision-language model's holds its image features too) lives until the loss is
    made, as in the patched forwards (a local of the model's forward to its end)."""
    backbone, head, post = causal_parts(model)
    out = backbone(input_ids=ids, **kwargs)
    h = out[0]
    vocab = int(getattr(head, "out_features", 0) or model.config.vocab_size)
    if setup.loss_kernel is LossKernel.CCE:
        for key in ("logit_scale", "logits_scaling"):  # Cohere, Granite: CCE's patch takes a softcap only
            value = getattr(model.config, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1:
                raise SetupError(f"Cut Cross Entropy on a model that scales its logits ({key} {value:g}) is not "
                                 "modelled yet: use --loss-kernel hf")
        with context.region(Kind.LOGITS):
            return cut_cross_entropy(h, head.weight, labels, _softcap(model.config))
    if setup.loss_kernel is LossKernel.TRL:  # its Triton kernels scale and cap the logits in place
        return trl_head.sft_loss(h, labels, head.weight, getattr(head, "bias", None), trl_head.compute_dtype(h))
    if setup.loss_kernel is LossKernel.LIGER:
        _refuse_logit_scale(model.config)
        # under CUDA autocast (emulated on this path) to another dtype than the hidden states', @ is autocast's
        amp = torch.is_autocast_enabled() and h.dtype != torch.get_autocast_dtype("cuda")
        with context.region(Kind.LOGITS):
            return liger_fused_linear_cross_entropy(h, head.weight, labels, (lambda a, b, _w: a @ b) if amp else None)
    if "cross_entropy" in setup.unsloth_kernels:  # UnslothForCausalLMLoss (core/simulation/unsloth.py)
        return unsloth.head_loss(h, head, labels, post)
    if "fused_loss" in setup.unsloth_kernels:  # FastLanguageModel's forward's (core/simulation/unsloth_loss.py)
        amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else None
        return unsloth_loss.fused_loss(h, head.weight, labels, setup, amp)
    if setup.chunked_loss:
        return chunked_loss(h, head, labels, vocab, setup.loss_fp32, post, setup.loss_chunks)
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    ce = liger.cross_entropy if getattr(causal, "liger_cross_entropy", False) else F.cross_entropy
    with context.region(Kind.LOGITS):
        return head_loss(h, head, labels, vocab, setup.loss_fp32, post, ce=ce)


__all__ = ["CutCrossEntropy", "LigerFusedLinearCrossEntropy", "apply", "causal_parts", "chunked_loss",
           "cut_cross_entropy", "head_loss", "liger_fused_linear_cross_entropy", "logit_post", "replaces_loss"]
