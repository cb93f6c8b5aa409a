"""CUDA autocast, emulated for fake tensors on a CPU build (the transformers reference path).

Fake tensors live on the CPU here, and CPU autocast applies the CPU op lists, not CUDA's; ``torch.autocast
("cuda")`` does nothing to CPU tensors. So the casts CUDA autocast makes are made here by a
``TorchFunctionMode``, above autograd as the Autocast dispatch key is (each cast is recorded by autograd and
its result saved for backward exactly as on the GPU), following CUDA's lists in torch 2.13.0
(``ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``; ``autocast_mode.cpp`` registers them for
``AutocastCUDA``):

* lower-precision ops (linear, matmul, bmm, baddbmm, addmm, einsum, convolutions, SDPA, ...): every floating
  argument that is not float64 and not already the autocast dtype is cast to it;
* fp32 ops (pow, rsqrt, exp, log, layer_norm, rms_norm, the losses, ...): floating arguments cast to fp32;
* "set opt dtype" ops (softmax, log_softmax, sum, prod, cumsum, cumprod, vector / matrix norms): run with
  ``dtype=float32`` when no dtype is given (an fp32 output, no copy of the input);
* promote ops (addcmul, addcdiv, index_put, scatter_add, ...): arguments cast to the widest floating dtype;
* the weight cache (``cached_cast``): an fp32 leaf tensor that requires grad (a parameter) is cast once per
  autocast region and the copy held until the outermost region exits; the copies are labelled AMP copies.

``torch.autocast`` regions that the model code itself opens (transformers' rotary embedding disables
autocast for its fp32 frequencies; ``torch.utils.checkpoint`` re-enters the forward's autocast state when it
recomputes in backward, where the autograd engine has not carried the mode along, so the region puts it
back) switch the emulation on and off instead of CPU autocast, and
``torch.is_autocast_enabled`` / ``torch.get_autocast_dtype`` answer as they would on the GPU.

Python-level functions stand for the aten ops they dispatch to; a composite like ``F.cross_entropy`` is
followed into its parts (``log_softmax`` with an fp32 dtype, then ``nll_loss``), as the dispatcher does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context

T = torch.Tensor

# CUDA's lists (torch 2.13.0 ATen/autocast_mode.h) by the Python functions that dispatch to those ops
LOWER = {
    F.linear, torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm, torch.baddbmm,
    T.baddbmm, torch.addmm, T.addmm, torch.addbmm, T.addbmm, torch.addmv, T.addmv, torch.addr, T.addr,
    torch.mv, T.mv, torch.einsum, torch.chain_matmul, torch.linalg.multi_dot, torch.linalg.vecdot,
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, torch.conv_tbc,
    torch.convolution, F.prelu, torch.prelu, F.scaled_dot_product_attention,
    torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell,
}
FP32 = {
    torch.acos, T.acos, torch.asin, T.asin, torch.cosh, T.cosh, torch.erfinv, T.erfinv, torch.exp, T.exp,
    torch.expm1, T.expm1, torch.log, T.log, torch.log10, T.log10, torch.log2, T.log2, torch.log1p, T.log1p,
    torch.reciprocal, T.reciprocal, torch.rsqrt, T.rsqrt, torch.sinh, T.sinh, torch.tan, T.tan,
    torch.pow, T.pow, T.__pow__, T.__rpow__, F.softplus, F.layer_norm, torch.layer_norm, torch.native_layer_norm,
    F.rms_norm, torch.rms_norm, F.group_norm, torch.group_norm, torch.nuclear_norm, F.cosine_similarity,
    torch.cosine_similarity, F.poisson_nll_loss, F.cosine_embedding_loss, F.nll_loss, F.hinge_embedding_loss,
    F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.mse_loss, F.margin_ranking_loss,
    F.multilabel_margin_loss, F.soft_margin_loss, F.triplet_margin_loss, F.multi_margin_loss,
    F.binary_cross_entropy_with_logits, torch.dist, T.dist, F.pdist, torch.cdist, torch.renorm, T.renorm,
    torch.logsumexp, T.logsumexp,
}
SET_OPT_DTYPE = {
    torch.prod, T.prod, F.softmax, torch.softmax, T.softmax, F.log_softmax, torch.log_softmax, T.log_softmax,
    torch.cumprod, T.cumprod, torch.cumsum, T.cumsum, torch.linalg.vector_norm, torch.linalg.matrix_norm,
    torch.sum, T.sum,
}
PROMOTE = {
    torch.addcdiv, T.addcdiv, torch.addcmul, T.addcmul, torch.atan2, T.atan2, F.bilinear, torch.cross,
    T.cross, torch.dot, T.dot, torch.vdot, T.vdot, F.grid_sample, torch.index_put, T.index_put, T.index_put_,
    torch.tensordot, torch.scatter_add, T.scatter_add,
}


def _function_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


class CudaAutocast(TorchFunctionMode):
    """The casts of ``torch.autocast("cuda", dtype)``; on only inside :meth:`region` (and the regions model
    code opens with ``torch.autocast``, see :func:`emulating`)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._enabled: list[bool] = [False]
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def enabled(self) -> bool:
        return self._enabled[-1]

    @contextlib.contextmanager
    def region(self, enabled: bool = True) -> Iterator[None]:
        self._enabled.append(enabled)
        try:
            yield
        finally:
            self._enabled.pop()
            if not any(self._enabled):
                self._cache.clear()  # autocast clears its weight cache when the outermost region exits

    def _cast(self, t: Any, dtype: torch.dtype) -> Any:
        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = (dtype == self.dtype and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view())
        if cacheable:
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            with context.region(Kind.AMP_COPIES):
                out = t.to(dtype)
            self._cache[id(t)] = (t, out)
            return out
        return t.to(dtype)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._enabled[-1]:
            return func(*args, **kwargs)
        if func in LOWER:
            cast = self.dtype
        elif func in FP32:
            cast = torch.float32
        elif func in SET_OPT_DTYPE:
            first = args[0] if args else kwargs.get("input")
            if kwargs.get("dtype") is None and _eligible(first) and first.dtype != torch.float32:
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        elif func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        elif func in PROMOTE:
            floats = [t.dtype for t in (*args, *kwargs.values()) if _eligible(t)]
            if not floats:
                return func(*args, **kwargs)
            cast = floats[0]
            for d in floats[1:]:
                cast = torch.promote_types(cast, d)
        else:
            return func(*args, **kwargs)
        args, kwargs = tree_map(lambda t: self._cast(t, cast), (args, kwargs))
        return func(*args, **kwargs)


def _cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,  # noqa: A002
                   size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                   reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """aten's cross_entropy_loss decomposes below the Autocast key: log_softmax (fp32 dtype), nll_loss (fp32)."""
    if label_smoothing or input.dim() > 2 and target.dim() == input.dim():
        return F.cross_entropy(input.float(), target, weight, size_average, ignore_index, reduce, reduction,
                               label_smoothing)
    logp = torch.log_softmax(input, 1, dtype=torch.float32 if input.dtype != torch.float32 else None)
    return F.nll_loss(logp, target, None if weight is None else weight.float(), size_average, ignore_index, reduce,
                      reduction)


@contextlib.contextmanager
def emulating(mode: CudaAutocast) -> Iterator[CudaAutocast]:
    """Enter ``mode`` (off until a region turns it on) and route ``torch.autocast`` and its queries to it."""
    autocast = torch.autocast
    saved = (autocast.__init__, autocast.__enter__, autocast.__exit__, torch.is_autocast_enabled,
             torch.get_autocast_dtype)
    regions: dict[int, contextlib.AbstractContextManager] = {}
    init = autocast.__init__

    def init_(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,  # noqa: ANN001
              cache_enabled: bool | None = None) -> None:
        # torch.autocast("cuda") turns itself off where CUDA is not available: on the GPU a region asked for (an
        # autograd Function's custom_bwd, fla's, re-entering its forward's state) is on
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        if device_type == "cuda":
            self._enabled = bool(enabled)

    def enter(self):  # noqa: ANN001, ANN202
        stack = contextlib.ExitStack()
        # the autograd engine does not carry torch-function modes into backward: a checkpoint's recompute
        # (which re-enters the forward's autocast state) puts the mode back for its duration
        if mode not in _function_modes():
            stack.enter_context(mode)
        stack.enter_context(mode.region(bool(self._enabled)))
        regions[id(self)] = stack
        return self

    def exit_(self, *exc):  # noqa: ANN001, ANN002, ANN202
        stack = regions.pop(id(self), None)
        if stack is not None:
            stack.__exit__(*exc)
        return False

    autocast.__init__, autocast.__enter__, autocast.__exit__ = init_, enter, exit_
    torch.is_autocast_enabled = lambda *a, **k: mode.enabled
    torch.get_autocast_dtype = lambda *a, **k: mode.dtype
    try:
        with mode:
            yield mode
    finally:
        (autocast.__init__, autocast.__enter__, autocast.__exit__, torch.is_autocast_enabled,
         torch.get_autocast_dtype) = saved
