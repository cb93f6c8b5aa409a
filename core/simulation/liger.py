"""Liger Kernel's RMSNorm, SwiGLU / GeGLU, RoPE and cross-entropy kernels (liger-kernel 0.8.5), as its CUDA path
allocates around its Triton kernels: the reference of ``--liger-kernels`` (``TrainingSetup.liger_kernels``; which
kernels a family gets is :func:`vramlab.core.spec.liger.liger_patch`).

Each autograd function here allocates and saves, tensor for tensor, what liger's own function does
(``ops/rms_norm.py`` ``LigerRMSNormFunction``, ``ops/swiglu.py`` ``LigerSiLUMulFunction``, ``ops/geglu.py``
``LigerGELUMulFunction``, ``ops/rope.py`` ``LigerRopeFunction``, ``ops/cross_entropy.py``
``LigerCrossEntropyFunction``); its Triton kernels write into
those tensors (so the values here are not the norm's or the activation's: the bytes are).
tests/test_liger_kernels.py runs liger's own Python code with its Triton launches as no-ops beside them and holds
the two timelines equal.

:func:`patch_model` patches transformers' classes as liger's ``apply_liger_kernel_to_<family>(model=...)`` does
(each norm's and each MLP's ``forward`` rebound; transformers' loss with :func:`cross_entropy` is
core/simulation/loss.py's); the built-in builder (core/simulation/model.py) calls :func:`rms_norm`, :func:`glu`
and :func:`cross_entropy` in its norms, MLPs and loss.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import MethodType

import torch
from torch import nn

from vramlab.core.checks import SetupError
from vramlab.core.simulation import liger_moe
from vramlab.core.simulation.kernel_binding import rebind
from vramlab.core.spec import hub_kernels as spec_hub
from vramlab.core.spec import liger as spec_liger
from vramlab.core.spec.liger import LigerPatch, RecordedPatch


class LigerRMSNormFunction(torch.autograd.Function):
    """``LigerRMSNormFunction`` (``ensure_contiguous`` on its arguments): forward allocates the output in the
    input's dtype and an fp32 RSTD per row (casting modes "llama" and "gemma") and saves the input (a view of it),
    the weight and RSTD. Backward gathers the weight's gradient in an fp32 (SMs x hidden) buffer where the weight
    requires grad, writes the input's gradient into the incoming one (``in_place``) or into a new ``zeros_like``,
    then sums the buffer and casts it to the weight's dtype."""

    @staticmethod
    def forward(ctx, X: torch.Tensor, W: torch.Tensor, in_place: bool) -> torch.Tensor:  # noqa: ANN001
        X = X.contiguous()
        shape = X.shape
        X = X.view(-1, shape[-1])
        Y = torch.empty(X.shape, dtype=X.dtype, device=X.device)
        RSTD = torch.empty(X.shape[0], dtype=torch.float32, device=X.device)
        ctx.in_place = in_place
        ctx.save_for_backward(X, W, RSTD)
        return Y.view(*shape)

    @staticmethod
    def backward(ctx, dY: torch.Tensor) -> tuple:  # noqa: ANN001
        dY = dY.contiguous()
        X, W, RSTD = ctx.saved_tensors
        dX, dW = _rms_norm_backward(dY, W, ctx.in_place, ctx.needs_input_grad[1])
        return dX, dW, None


def _rms_norm_backward(dY: torch.Tensor, W: torch.Tensor, in_place: bool,
                       needs_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm_backward``'s allocations, its locals freed as it returns."""
    shape = dY.shape
    dY = dY.view(-1, shape[-1])
    _dW = torch.empty((spec_liger.LIGER_SM_COUNT, shape[-1]), dtype=torch.float32, device=W.device) if needs_dw \
        else None
    dX = dY if in_place else torch.zeros_like(dY)
    dX = dX.view(*shape)
    dW = _dW.sum(dim=0).to(W.dtype) if needs_dw else None
    return dX, dW


class LigerGLUFunction(torch.autograd.Function):
    """``LigerSiLUMulFunction`` and ``LigerGELUMulFunction`` (the same tensors): forward allocates the product
    (``empty_like(a)``) and saves the gate's and the up projection's outputs; backward writes their gradients into
    them and returns them (nothing allocated)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        a, b = a.contiguous(), b.contiguous()
        shape = a.shape
        a = a.view(-1, shape[-1])
        b = b.view(-1, shape[-1])
        c = torch.empty_like(a)
        ctx.save_for_backward(a, b)
        return c.view(*shape)

    @staticmethod
    def backward(ctx, dc: torch.Tensor) -> tuple:  # noqa: ANN001
        dc = dc.contiguous()
        a, b = ctx.saved_tensors
        shape = dc.shape
        return a.view(*shape), b.view(*shape)


class LigerCrossEntropyFunction(torch.autograd.Function):
    """``LigerCrossEntropyFunction`` (``ops/cross_entropy.py``; no weight, z-loss, accuracy or predicted tokens, as
    transformers' loss calls ``cross_entropy``): forward allocates a loss per row in the logits' dtype, the labels'
    mask, its count and the range checks' temporaries; its kernel writes the logits' gradient into the logits
    themselves, which it saves (a detached view). Backward compares the incoming gradient with a new scalar 1.0
    (scaling in place where it differs) and returns the saved logits as their gradient: nothing else allocated."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        grad = x.requires_grad
        loss, x = _cross_entropy_forward(x, target)
        if grad:
            ctx.save_for_backward(x.detach())
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        # torch.equal(grad_output, torch.tensor(1.0)): a scalar on the device (torch.full, which fake tensors count)
        one = torch.full((), 1.0, device=grad_out.device)
        del one
        return x, None


def _cross_entropy_forward(x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy_forward``'s allocations, its locals freed in the library's order as it returns; its
    ``.item()`` and ``assert`` reads (which fake tensors cannot answer) leave their tensors' bytes."""
    loss_1d = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    target_mask = target != -100
    count = target_mask.sum()  # .item()
    del count
    t = target * target_mask  # assert (target * target_mask).max() < V
    top = t.max()
    del t
    ok = top < x.shape[-1]
    del top, ok
    t = target * target_mask  # assert (target * target_mask).min() >= 0
    low = t.min()
    del t
    ok = low >= 0
    del low, ok
    loss = torch.sum(loss_1d)
    del loss_1d, target_mask
    return loss, x


class LigerLayerNormFunction(torch.autograd.Function):
    """``LigerLayerNormFunction`` (``ops/layer_norm.py``, the Triton implementation liger's dispatch picks on CUDA
    without cuTile / CuTe installed; ``ensure_contiguous``): forward allocates the output in the input's dtype and
    an fp32 mean and RSTD per row, and saves the input, the weight, the bias, the mean and RSTD. Backward allocates
    fp32 (SMs x hidden) buffers for the weight's and the bias's gradients where they require one, the input's
    gradient, then sums each buffer and casts it to its parameter's dtype."""

    @staticmethod
    def forward(ctx, X: torch.Tensor, W: torch.Tensor, B: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        X = X.contiguous()
        shape = X.shape
        X = X.view(-1, shape[-1])
        Y = torch.empty(X.shape, dtype=X.dtype, device=X.device)
        mean = torch.empty(X.shape[0], dtype=torch.float32, device=X.device)
        rstd = torch.empty(X.shape[0], dtype=torch.float32, device=X.device)
        ctx.save_for_backward(X, W, B, mean, rstd)
        return Y.view(*shape)

    @staticmethod
    def backward(ctx, dY: torch.Tensor) -> tuple:  # noqa: ANN001
        dY = dY.contiguous()
        X, W, B, _mean, _rstd = ctx.saved_tensors
        shape = dY.shape
        sm = spec_liger.LIGER_SM_COUNT
        _dW = torch.empty((sm, shape[-1]), dtype=torch.float32, device=W.device) if ctx.needs_input_grad[1] else None
        _dB = torch.empty((sm, shape[-1]), dtype=torch.float32, device=W.device) if ctx.needs_input_grad[2] else None
        dX = torch.empty((X.shape[0], shape[-1]), dtype=X.dtype, device=X.device).view(*shape)
        dW = _dW.sum(dim=0).to(W.dtype) if _dW is not None else None
        dB = _dB.sum(dim=0).to(B.dtype) if _dB is not None else None
        return dX, dW, dB


def _rope_cos(cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_forward`` / ``rope_backward``'s reshaping of cos and sin (views)."""
    if cos.ndim == 4:
        dim = unsqueeze_dim if cos.shape[unsqueeze_dim] == 1 else 1 if cos.shape[1] == 1 else None
        cos, sin = (cos.squeeze(dim), sin.squeeze(dim)) if dim is not None else (cos.squeeze(), sin.squeeze())
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos, sin


class LigerRopeFunction(torch.autograd.Function):
    """``LigerRopeFunction`` (``ops/rope.py``, the Triton implementation liger's dispatch picks on CUDA without CuTe
    installed): forward transposes q and k back to (batch, seq, heads, head_dim), makes them contiguous (a copy only
    where they are not laid out so: a slice of a fused qkv projection), rotates them in place and returns them
    transposed again (views of what it rotated); cos and sin made contiguous and saved. Backward does the same to
    the incoming gradients: a copy of each that arrives laid out (batch, heads, seq, head_dim) (eager attention's
    matmuls make it so), rotated in place and returned transposed."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # noqa: ANN001
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = _rope_cos(cos, sin, unsqueeze_dim)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor) -> tuple:  # noqa: ANN001
        cos, sin = ctx.saved_tensors
        cos, sin = _rope_cos(cos, sin, 1)
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: object = None,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``liger_rotary_pos_emb`` (and GPT-OSS's, which passes its rotary width: the same tensors), as liger's patch
    puts it in place of the modeling module's ``apply_rotary_pos_emb``."""
    return LigerRopeFunction.apply(q, k, cos, sin, unsqueeze_dim)


def patch_rope(root: nn.Module, modules: tuple[str, ...]) -> int:
    """Every module of ``root`` whose class lives in one of ``modules`` (transformers' modeling modules, by their
    last name) and whose forward calls its module's ``apply_rotary_pos_emb`` runs liger's RoPE there. Returns how
    many it patched."""
    patched = 0
    for module in root.modules():
        cls = type(module)
        code = getattr(inspect.unwrap(cls.forward), "__code__", None)  # under transformers' deprecate_kwarg
        if (cls.__module__.rsplit(".", 1)[-1] in modules
                and hasattr(sys.modules[cls.__module__], "apply_rotary_pos_emb")
                and "apply_rotary_pos_emb" in getattr(code, "co_names", ())):
            rebind(module, apply_rotary_pos_emb=rope)  # as liger rebinds the modeling module's function
            patched += 1
    return patched


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``LigerLayerNorm.forward``: liger's functional ``layer_norm`` (a bias-less norm gets ``zeros_like(weight)``)."""
    if bias is None:
        bias = torch.zeros_like(weight)
    return LigerLayerNormFunction.apply(x, weight, bias)


def cross_entropy(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``liger_cross_entropy`` as transformers' loss calls ``nn.functional.cross_entropy`` (liger's patch)."""
    return LigerCrossEntropyFunction.apply(x, target)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, patch: LigerPatch) -> torch.Tensor:
    return LigerRMSNormFunction.apply(x, weight, patch.in_place)


def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return LigerGLUFunction.apply(gate, up)


def fused_mlp(mods: nn.ModuleDict, x: torch.Tensor, patch: LigerPatch | None, act: Callable) -> torch.Tensor:
    """transformers' ``Phi3MLP.forward`` (one ``gate_up_proj``, chunked: ``down(up * act(gate))``), or
    ``LigerPhi3SwiGLUMLP.forward`` where liger's patch swaps its SwiGLU in: the two halves (strided views of the
    projection's output) go to ``LigerSiLUMulFunction``, which copies each to a contiguous tensor and saves the
    copies; the projection's output lives, under the views, until the MLP returns. (The builder's, kept beside the
    Liger function it dispatches to: no other kernel takes a fused gate_up_proj, Unsloth's included.)"""
    gate, up = mods["gate_up_proj"](x).chunk(2, dim=-1)
    if patch is not None and patch.glu:
        return mods["down_proj"](glu(gate, up))
    return mods["down_proj"](up * act(gate))


def _fused_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LigerPhi3SwiGLUMLP.forward`` on a module with one ``gate_up_proj`` (Phi-3's, GLM-4's)."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(glu(gate, up))


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.liger_patch)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LigerSwiGLUMLP.forward`` / ``LigerGEGLUMLP.forward``."""
    return self.down_proj(glu(self.gate_proj(x), self.up_proj(x)))


_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def patch_model(model: nn.Module, patch: LigerPatch | None) -> None:
    """Patch transformers causal LM ``model`` (or a peft model around it) as liger-kernel 0.8.5's
    ``apply_liger_kernel_to_<family>(model=...)`` does: the final norm, each layer's norms (its attention's
    q / k norms too) and each layer's MLP (a mixture of experts' experts module) get liger's ``forward``."""
    if patch is None:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.liger_cross_entropy = patch.cross_entropy  # read by core/simulation/loss.py apply
    inner = getattr(base, base.base_model_prefix, base)
    norms: list[nn.Module] = [inner.norm] if patch.rms_norm else []
    for i, layer in enumerate(inner.layers):
        if patch.glu and hasattr(layer.mlp, "experts"):  # a mixture of experts (Mixtral's, Qwen3-MoE's): LigerExperts
            liger_moe.bind_experts(f"layers.{i}.mlp.experts", layer.mlp.experts)
        elif patch.glu:
            fused = hasattr(layer.mlp, "gate_up_proj")  # LigerPhi3SwiGLUMLP
            layer.mlp.forward = MethodType(_fused_mlp_forward if fused else _mlp_forward, layer.mlp)
        if patch.rms_norm:
            norms += [getattr(layer, n) for n in _NORMS if hasattr(layer, n)]
            norms += [getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if hasattr(layer.self_attn, n)]
    for norm in norms:
        norm.liger_patch = patch
        norm.forward = MethodType(_norm_forward, norm)
    if patch.rope:  # liger's RoPE in the modeling module of the family's class
        patch_rope(inner, (type(inner.layers[0].self_attn).__module__.rsplit(".", 1)[-1],))


def _layer_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return layer_norm(hidden_states, self.weight, self.bias)


_FORWARDS = {"rms_norm": _norm_forward, "glu": _mlp_forward, "layer_norm": _layer_norm_forward}


def patch_recorded(model: nn.Module, patch: RecordedPatch | None) -> int:
    """Patch transformers' class ``model`` (or a peft model around it) as liger-kernel 0.8.5's
    ``apply_liger_kernel_to_<type>(model=...)`` patches it, read off liger itself
    (:func:`vramlab.core.spec.liger.recorded_patch`): each module it rebinds gets the reference's forward of its
    Liger module. Returns how many modules it patched."""
    if patch is None:
        return 0
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.liger_cross_entropy = patch.cross_entropy  # read by core/simulation/loss.py apply
    names = _rebind(base, patch, False)
    if patch.rope and not patch_rope(base, tuple(m for m, _f in patch.rope)):  # never the option silently dropped
        raise SetupError(f"liger-kernel's RoPE for {patch.model_type} replaces apply_rotary_pos_emb in "
                         f"{', '.join(m for m, _f in patch.rope)}, which this {type(base).__name__} does not call: "
                         "drop rope from --liger-kernels")
    # a part the type's record finds nothing of (a language model or tower of another type than the defaults the
    # record was taken on): liger's patch of the part's own type, as LLaVA's, InternVL's and SmolVLM's dispatch
    done: list[str] = []
    for name, part in base.named_modules():
        if (not name or not hasattr(part, "config") or any(name.startswith(d + ".") for d in done)
                or any(n.startswith(name + ".") for n in names)):
            continue
        part_type = str(getattr(part.config, "model_type", ""))
        sub = spec_liger.part_patch(part_type, patch.kernels) if part_type != patch.model_type else None
        found = _rebind(part, sub, True) if sub is not None else []
        if found:
            names += [f"{name}.{n}" for n in found]
            done.append(name)
    if patch.modules and not names:  # never the option silently dropped
        raise SetupError(f"liger-kernel's patch for {patch.model_type} was read off its default classes, and this "
                         f"{type(base).__name__} has none of them (its language or vision model of another type): "
                         "drop --liger-kernels")
    return len(names)


def _rebind(root: nn.Module, patch: RecordedPatch, base: bool) -> list[str]:
    """Each module of ``root`` that ``patch`` names (by its path, or its path under the type's base model) gets the
    reference's forward of its Liger module; returns their names."""
    names = []
    for name, module in root.named_modules():
        cls = type(module).__name__
        row = next((m for m in patch.modules if m.matches(name, cls, base)
                    or m.experts and m.matches(name, _wrapped(module), base)), None)
        if row is None:
            continue
        if row.experts:  # LigerExperts (on peft's wrapper where LoRA adapts the experts' tensors: refused)
            liger_moe.bind_experts(name, module)
            names.append(name)
            continue
        if row.kernel == "rms_norm":
            module.liger_patch = LigerPatch(True, False, row.in_place, False)
        module.forward = MethodType(_fused_mlp_forward if row.fused else _FORWARDS[row.kernel], module)
        names.append(name)
    return names


def _wrapped(module: nn.Module) -> str:
    """The class peft's tuner layer ``module`` wraps (its innermost base layer's); "" for another module."""
    get_base = getattr(module, "get_base_layer", None)
    return type(get_base()).__name__ if callable(get_base) else ""


def kernelize_hub(model: nn.Module, patch: LigerPatch) -> int:
    """transformers' Hub kernels as the kernels library's ``kernelize(model, mode=Mode.TRAINING, device="cuda")``
    swaps them in (core/spec/hub_kernels.py): every module whose class is decorated
    ``use_kernel_forward_from_hub("RMSNorm")`` (its ``kernel_layer_name``) gets kernels-community/liger-kernels'
    ``LigerRMSNorm.forward``, which is ``LigerRMSNormFunction`` on its ``weight``. Returns how many it swapped."""
    swapped = 0
    for module in model.modules():
        if getattr(type(module), "kernel_layer_name", None) == spec_hub.LAYER and isinstance(
                getattr(module, "weight", None), torch.Tensor):
            module.liger_patch = patch
            module.forward = MethodType(_norm_forward, module)
            swapped += 1
    return swapped


__all__ = ["LigerCrossEntropyFunction", "LigerGLUFunction", "LigerLayerNormFunction", "LigerRMSNormFunction",
           "LigerRopeFunction", "cross_entropy", "fused_mlp", "glu", "kernelize_hub", "layer_norm", "patch_model",
           "patch_recorded", "patch_rope", "rms_norm", "rope"]
