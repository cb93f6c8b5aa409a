"""Unsloth's fused loss (``fused_loss`` in ``--unsloth-kernels``: FastLanguageModel's forward's loss, unsloth_zoo
2026.10.9 ``fused_losses``) on fake tensors, with the allocations of its CUDA path: what core/spec/unsloth_loss.py
describes, its functions transcribed line for line with the Triton kernels (which write into tensors already made)
left out, and ``nonzero`` (a data-dependent shape) made as the int64 index it returns with every label of the
step valid but each row's last. The estimator's mirror is core/estimator/unsloth_loss.py;
tests/test_unsloth_loss.py holds this one to unsloth_zoo's own functions.

Local names follow the library's: a function's locals are freed in the order of their first binding when it
returns, and a rebinding frees the old tensor after the new one exists, so the same names give the same
timeline.
"""

from __future__ import annotations

import torch

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.spec.unsloth_loss import LossPlan, UnslothDevice, loss_plan

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_HALF = (torch.float16, torch.bfloat16)


def _keep_index(targets: torch.Tensor, vocab_size: int, ignore_index: int, n_keep: int) -> torch.Tensor:
    """``_keep_index``: the labelled rows' index (``keep.nonzero().squeeze(-1)``, n_keep of them)."""
    keep = (targets >= 0) & (targets < vocab_size)
    keep &= targets != ignore_index
    idx = torch.zeros((n_keep, 1), device=targets.device, dtype=torch.long).squeeze(-1)  # keep.nonzero()
    return idx


def _row_forward(x: torch.Tensor, dz_out: torch.Tensor, coef: torch.Tensor, plan: LossPlan,
                 outs: dict) -> tuple[dict, torch.Tensor]:
    """``_row_forward`` on its Triton path, statistics only (``want`` all off), ``write_grad`` on: an fp32
    log-sum-exp per row, the split kernels' partials (more than two 16,384-column splits), then ``_row_backward``
    writing the logits' gradient into ``dz_out`` (``-coef.reshape(())`` its argument)."""
    n = x.shape[0]
    f32 = dict(device=x.device, dtype=torch.float32)
    logp = outs.get("logp")
    lse = torch.empty(n, **f32)
    splits = plan.splits

    def run_split() -> None:
        part = torch.empty((7, splits, n), **f32)
        del part

    if splits > 1:
        run_split()
    out = {"logp": logp, "lse": lse, "lpt": logp}
    dz = _row_backward(dz_out, -coef.reshape(()))
    return out, dz


def _row_backward(dz_out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``_row_backward`` on its Triton path: the kernel writes the logits' gradient into ``dz_out``."""
    return dz_out


def _tiled_forward(hidden: torch.Tensor, idx: torch.Tensor, n_keep: int, w: torch.Tensor,
                   targets: torch.Tensor, compute_dtype: torch.dtype, outs: dict, plan: LossPlan,
                   u: torch.Tensor | None, g: torch.Tensor | None) -> None:
    """``_tiled_forward`` (the "flash" path, a frozen head): a (rows x tile) fp32 buffer, an fp32 (rows x hidden)
    accumulator and a running maximum; per row chunk its rows and targets gathered and the kernels' partials;
    the hidden states' gradient written into ``u`` by the kernels (``_dz_w_acc`` adds in place)."""
    N, H = hidden.shape
    f32 = dict(device=hidden.device, dtype=torch.float32)
    R = plan.rows
    splits = plan.splits
    buf = torch.empty((R, plan.cols), **f32)  # noqa: F841 - _Buffers(R, tile, ...): the kernels' tiles
    if u is not None:
        acc = torch.empty((R, H), **f32)
        m_run = torch.empty(R, **f32)
    for a in range(0, n_keep, R):
        b = min(a + R, n_keep)
        n = b - a
        h = _rows_of(hidden, idx, a, b, n_keep, N).to(compute_dtype)  # noqa: F841 - the library's locals,
        t = targets[a:b] if n_keep == N else targets.index_select(0, idx[a:b])  # noqa: F841 - alive to the next
        part = torch.empty((8, splits, n), **f32)  # noqa: F841 - chunk's
        if u is not None:  # the kernels' tiles write into buf, acc, m_run and part in place
            acc[:n].zero_()
            m_run[:n].fill_(-float("inf"))


def _rows_of(x: torch.Tensor, idx: torch.Tensor, a: int, b: int, n_keep: int, n_all: int) -> torch.Tensor:
    if n_keep == n_all:
        return x[a:b]
    return x.index_select(0, idx[a:b])


def _dz_w(dz: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dz @ w`` with an fp32 result (``torch.mm(..., out_dtype=float32)``): an (n, hidden) fp32 tensor (a
    vocabulary not a multiple of 8 adds its last columns in place)."""
    return torch.empty((dz.shape[0], w.shape[1]), device=dz.device, dtype=torch.float32)


def ce_impl(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor: torch.Tensor,
            scaling: torch.Tensor, compute_dtype: torch.dtype, need_h: bool, need_w: bool, n_keep: int,
            dev: UnslothDevice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_ce_impl`` (no bias, no label smoothing, no fp32 head gradient, ``rows`` 0) with its CUDA path's
    allocations; ``n_keep`` the labelled rows."""
    device = weight.device
    N, H = hidden.shape
    V = weight.shape[0]
    targets = targets.contiguous()
    idx = _keep_index(targets, V, -100, n_keep)
    f32 = dict(device=device, dtype=torch.float32)
    grad_h = torch.zeros((N, H), device=device, dtype=hidden.dtype) if need_h else hidden.new_empty(0)
    acc_w = None
    if need_w:
        acc_w = torch.zeros(weight.shape, device=device, dtype=weight.dtype)
    loss = torch.zeros((), **f32)
    if n_keep > 0:
        grad = need_h or need_w
        plan = loss_plan(n_keep, H, V, _DTYPES[compute_dtype], need_w, dev)
        R = plan.rows
        w = weight.to(compute_dtype)
        coef = (scaling.to(**f32) / divisor.to(**f32)).reshape(())
        lp_all = torch.empty(n_keep, **f32)
        if plan.flash:
            _tiled_forward(hidden, idx, n_keep, w, targets, compute_dtype, {"logp": lp_all,
                           "lse": torch.empty(n_keep, **f32)}, plan, grad_h if need_h else None,
                           -coef if need_h else None)
            n_chunked = 0
        else:
            n_chunked = n_keep
            buf = torch.empty((R, plan.cols), device=device,  # _Buffers(R, V, ...)
                              dtype=torch.float32 if plan.fp32_logits else compute_dtype)
        ratio = None
        if n_chunked and grad and compute_dtype in _HALF and (not need_w or acc_w.dtype == torch.float32):
            pow2 = torch.exp2(torch.round(torch.log2(coef)))
            ratio, coef = coef / pow2, pow2
        for a in range(0, n_chunked, R):
            b = min(a + R, n_keep)
            n = b - a
            h = _rows_of(hidden, idx, a, b, n_keep, N).to(compute_dtype)  # noqa: F841 - the library's locals,
            t = targets[a:b] if n_keep == N else targets.index_select(0, idx[a:b])  # noqa: F841 - to the next chunk's
            x = buf[:n]
            dz_out = buf[:n] if grad else None
            outs = {"logp": lp_all[a:b]}
            st, dz = _row_forward(x, dz_out, coef, plan, outs)
            if grad:
                if need_h:
                    gh = _dz_w(dz, w)
                    if ratio is not None:
                        gh.mul_(ratio)
                    if n_keep == N:
                        grad_h[a:b].copy_(gh)
                    else:
                        grad_h.index_copy_(0, idx[a:b], gh.to(grad_h.dtype))
        acc = torch.float64
        nll = -lp_all.to(acc)
        loss = (nll.sum() / divisor.to(acc)).float()
    grad_w = acc_w.to(weight.dtype) if need_w else hidden.new_empty(0)
    grad_b = hidden.new_empty(0)
    return loss, grad_h, grad_w, grad_b


def _ce_checked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *args: object) -> tuple:
    """``_ce_checked``: the targets out of the vocabulary found on the device (a mask, its ``any`` negated for a
    device-side assert, both alive while the op runs), then ``_ce_impl``."""
    V = weight.shape[0]
    bad = (targets != -100) & ((targets < 0) | (targets >= V))
    ok = torch.logical_not(bad.any())  # noqa: F841 - torch._assert_async(ok, ...)
    return ce_impl(hidden, weight, targets, *args)


class FusedLinearCE(torch.autograd.Function):
    """The op ``unsloth_zoo::fused_linear_ce_v2`` with its autograd (``_ce_setup``, ``_ce_backward``): the
    gradients made in forward saved with the scale; backward scales each into a new tensor
    (``fused_linear_scale_rows``: the factor as a (1, 1) fp32 tensor, the output in the gradient's dtype)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, scaling, compute_dtype, need_h, need_w, n_keep,  # noqa: ANN001, ANN205
                dev):
        loss, grad_h, grad_w, grad_b = _ce_checked(hidden, weight, targets, divisor, scaling, compute_dtype, need_h,
                                                   need_w, n_keep, dev)
        ctx.need = (need_h, need_w)
        ctx.save_for_backward(grad_h, grad_w, grad_b, scaling)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: ANN001, ANN205
        grad_h, grad_w, grad_b, scaling = ctx.saved_tensors
        acc = torch.float64
        s = grad_loss.to(acc) / scaling.to(acc)
        need_h, need_w = ctx.need

        def scale(x: torch.Tensor) -> torch.Tensor:  # _scale_rows_impl on its Triton path
            g = s.reshape(-1, 1).to(device=x.device, dtype=torch.float32)
            out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            del g
            return out

        out_h = scale(grad_h) if need_h else None
        out_w = scale(grad_w) if need_w else None
        return out_h, out_w, None, None, None, None, None, None, None, None


def fused_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, setup: object,
               amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``unsloth_chunked_ce_loss`` (the labels shifted by a ``cat`` with a -100 column, the divisor the count of
    labelled rows) and ``fused_linear_cross_entropy`` (the divisor kept off zero, a scale of one) as
    ``unsloth_fused_ce_loss`` calls them from FastLanguageModel's forward, inside the loss's region; its compute
    dtype ``_compute_dtype``'s: autocast's (``amp_dtype``), else the head's."""
    dev = UnslothDevice.of(getattr(setup, "unsloth_gpu", ()))
    compute = amp_dtype or (weight.dtype if weight.dtype.is_floating_point else h.dtype)
    with context.region(Kind.LOGITS):
        return _chunked_ce_loss(h, weight, labels, compute, dev)


def _chunked_ce_loss(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                     compute_dtype: torch.dtype, dev: UnslothDevice) -> torch.Tensor:
    targets = _ce_targets(labels, -100)
    divisor = _ce_divisor(targets, -100)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    n_keep = labels.shape[0] * max(labels.shape[-1] - 1, 0)  # every label valid but each row's last (shifted)
    return _fused_linear_cross_entropy(hidden, lm_head_weight, targets, divisor, compute_dtype, n_keep, dev)


def _ce_targets(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    pad = torch.full_like(labels[..., :1], ignore_index)
    labels = torch.cat((labels[..., 1:], pad), dim=-1)
    return labels.reshape(-1)


def _ce_divisor(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    divisor = (targets != ignore_index).sum()
    divisor = divisor.to(device=targets.device, dtype=torch.float32).reshape(())
    return torch.where(divisor == 0, torch.ones_like(divisor), divisor)


def _fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                divisor: torch.Tensor, compute_dtype: torch.dtype, n_keep: int,
                                dev: UnslothDevice) -> torch.Tensor:
    device = weight.device
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    targets2 = targets.reshape(-1)
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and weight.requires_grad
    f32 = dict(device=device, dtype=torch.float32)
    divisor = divisor.reshape(-1)[:1].reshape(())
    divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    scaling = torch.ones((), **f32)
    loss = FusedLinearCE.apply(hidden2, weight, targets2, divisor, scaling, compute_dtype, need_h, need_w, n_keep,
                               dev)
    return loss


__all__ = ["FusedLinearCE", "ce_impl", "fused_loss"]
