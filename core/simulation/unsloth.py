"""Unsloth's fused LoRA kernels (unsloth 2026.10.9 ``unsloth/kernels/fast_lora.py``), as its CUDA path allocates
around its Triton kernels: the reference of ``--unsloth-kernels`` (``TrainingSetup.unsloth_kernels``; which kernels
a model gets is :func:`vramlab.core.spec.unsloth.unsloth_patch`).

:class:`LoRAMLP`, :class:`LoRAQKV` and :class:`LoRAW` allocate and save, tensor for tensor, what unsloth's
``LoRA_MLP``, ``LoRA_QKV`` and ``LoRA_W`` do on their plain path (no dropout, no LoRA bias): ``matmul_lora``'s
product and its low-rank intermediate, the adapters cast to the input's dtype, the SwiGLU / GeGLU kernels' output
(``torch.empty``; their backward writes into the tensors it is given), the input's gradient written into the saved
input (``inplace``). An NF4 base weight is dequantized as unsloth's ``fast_dequantize`` does on CUDA with its NF4
kernels: in forward (and for the down projection's backward product) into one scratch buffer per device
(``_scratch``: a new one where a larger weight comes, the last dequantization of each weight keeping the buffer it
used alive through its ``_unsloth_nf4_plan``), elsewhere into a fresh tensor; no absmax buffer (the kernel reads the
double-quantized absmax itself). tests/test_unsloth_kernels.py runs unsloth's own functions beside these.

:func:`patch_model` installs them as ``FastLlamaModel.patch_peft_model`` does, on transformers' classes under peft
and on the built-in builder's decoder alike: the MLP's ``forward`` rebound (``apply_lora_mlp_swiglu``); the q, k and
v projections computed together at q_proj's call (unsloth's attention forward calls ``apply_qkv`` once), k_proj and
v_proj handing back their share; o_proj's ``forward`` rebound (``apply_lora_o``).
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context, liger, unsloth_attention, unsloth_rope
from vramlab.core.spec import unsloth as spec_unsloth
from vramlab.core.spec.unsloth import UnslothPatch


class Scratch:
    """unsloth's ``_SCRATCH[("weight", device)]``: the buffer ``use_global_buffer`` dequantizes into."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None


class Weight:
    """One adapted projection's base weight and adapter, as ``get_lora_parameters`` reads them."""

    def __init__(self, mod: nn.Module, scratch: Scratch) -> None:
        base = getattr(mod, "base_layer", mod)
        self.quant = getattr(base, "quant", None) or getattr(mod, "qweight", None)  # a QuantWeight
        self.weight = None if self.quant is not None else base.weight
        if hasattr(mod, "base_layer"):  # peft's layer
            self.A, self.B = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            self.S = mod.scaling["default"]
        else:  # the builder's Linear
            self.A, self.B, self.S = mod.lora_A, mod.lora_B, mod.scaling
        self.scratch = scratch
        self.plan: tuple[torch.Tensor, torch.Tensor] | None = None  # quant_state._unsloth_nf4_plan's buffer, out

    def dense(self, dtype: torch.dtype, global_buffer: bool, transposed: bool = False) -> torch.Tensor:
        """``fast_dequantize(W, W_quant, use_global_buffer=..., dtype=...)`` (the packed weight transposed in
        backward: the dense one comes back transposed)."""
        if self.quant is None:
            return self.weight.t() if transposed else self.weight
        rows, cols = self.quant.rows, self.quant.cols
        numel = rows * cols
        with context.region(Kind.TEMPORARIES):
            if not global_buffer:
                out = torch.empty(rows, cols, dtype=dtype, device=self.A.device)
            elif self.plan is not None and self.plan[0] is self.scratch.buffer:
                out = self.plan[1]
            else:
                buf = self.scratch.buffer
                if buf is None or buf.dtype != dtype or buf.numel() < numel:
                    buf = self.scratch.buffer = torch.empty(numel, dtype=dtype, device=self.A.device)
                out = buf[:numel].view(rows, cols)
                self.plan = (buf, out)
        return out.t() if transposed else out


def matmul_lora(X: torch.Tensor, W: torch.Tensor, A: torch.Tensor | None, B: torch.Tensor | None,
                s: float) -> torch.Tensor:
    """unsloth's ``matmul_lora`` with ``W`` already dense."""
    dtype = X.dtype
    reshape = X.dim() == 3
    if reshape:
        batch, seq_len, _ = X.shape
        X = X.view(-1, X.shape[-1])
    out = torch.matmul(X, W.t())
    del W
    if A is not None:
        A, B = A.t(), B.t()
        XA = torch.matmul(X, A.to(dtype))
        out.addmm_(XA, B.to(dtype), alpha=s)
        del XA
    return out.view(batch, seq_len, -1) if reshape else out


def _lora(X: torch.Tensor, w: Weight) -> torch.Tensor:
    return matmul_lora(X, w.dense(X.dtype, True), w.A, w.B, w.S)


class LoRAMLP(torch.autograd.Function):
    """``LoRA_MLP``: saves the input and the gate and up projections' outputs (the activation's output is made
    again in backward, into the down projection's input gradient)."""

    @staticmethod
    def forward(ctx, X, gA, gB, uA, uB, dA, dB, ws):  # noqa: ANN001
        gate, up, down = ws
        e = _lora(X, gate)
        g = _lora(X, up)
        h = torch.empty(e.shape, dtype=e.dtype, device=e.device)  # swiglu_fg_kernel / geglu_*_forward_kernel
        i = _lora(h, down)
        ctx.ws = ws
        ctx.save_for_backward(gA, gB, uA, uB, dA, dB, X, e, g)
        return i

    @staticmethod
    def backward(ctx, dY):  # noqa: ANN001
        gate, up, down = ctx.ws
        gateA, gateB, upA, upB, downA, downB, X, e, g = ctx.saved_tensors
        batch, seq_len, hd = X.shape
        dY = dY.reshape(-1, dY.shape[-1])
        X = X.view(-1, X.shape[-1])
        e = e.view(-1, e.shape[-1])
        g = g.view(-1, g.shape[-1])
        dtype = X.dtype
        gateA, gateB, upA, upB, downA, downB = (gateA.to(dtype), gateB.to(dtype), upA.to(dtype), upB.to(dtype),
                                                downA.to(dtype), downB.to(dtype))
        gateA, gateB, upA, upB, downA, downB = gateA.t(), gateB.t(), upA.t(), upB.t(), downA.t(), downB.t()
        DW = matmul_lora(dY, down.dense(dY.dtype, True, transposed=True), downB, downA, down.S)
        h, df, de = DW, e, g  # swiglu_DWf_DW_dfg_kernel writes them in place
        d_downA = torch.empty_like(downA)
        d_downB = torch.empty_like(downB)
        d_gateA = torch.empty_like(gateA)
        d_gateB = torch.empty_like(gateB)
        d_upA = torch.empty_like(upA)
        d_upB = torch.empty_like(upB)
        d_downA.addmm_(h.t(), dY @ downB.t(), alpha=down.S, beta=0)
        d_downB.addmm_(downA.t() @ h.t(), dY, alpha=down.S, beta=0)
        up_dB = df @ upB.t()
        gate_dB = de @ gateB.t()
        d_upA.addmm_(X.t(), up_dB, alpha=up.S, beta=0)
        d_upB.addmm_(upA.t() @ X.t(), df, alpha=up.S, beta=0)
        d_gateA.addmm_(X.t(), gate_dB, alpha=gate.S, beta=0)
        d_gateB.addmm_(gateA.t() @ X.t(), de, alpha=gate.S, beta=0)
        upW = up.dense(df.dtype, False, transposed=True)
        dX = torch.matmul(df, upW.t(), out=X)
        del upW
        dX.addmm_(up_dB, upA.t(), alpha=up.S)
        gateW = gate.dense(de.dtype, False, transposed=True)
        dX.addmm_(de, gateW.t())
        del gateW
        dX.addmm_(gate_dB, gateA.t(), alpha=gate.S)
        return (dX.view(batch, seq_len, hd), d_gateA.t(), d_gateB.t(), d_upA.t(), d_upB.t(), d_downA.t(),
                d_downB.t(), None)


class LoRAQKV(torch.autograd.Function):
    """``LoRA_QKV``: the input saved once for the three projections."""

    @staticmethod
    def forward(ctx, X, QA, QB, KA, KB, VA, VB, ws):  # noqa: ANN001
        q, k, v = ws
        orig_shape = X.shape
        Xm = X.view(-1, X.shape[-1]) if X.dim() == 3 else X
        Q, K, V = _lora(Xm, q), _lora(Xm, k), _lora(Xm, v)
        if len(orig_shape) == 3:
            Q = Q.view(orig_shape[0], orig_shape[1], -1)
            K = K.view(orig_shape[0], orig_shape[1], -1)
            V = V.view(orig_shape[0], orig_shape[1], -1)
        ctx.ws = ws
        ctx.save_for_backward(X, QA, QB, KA, KB, VA, VB)
        return Q, K, V

    @staticmethod
    def backward(ctx, dQ, dK, dV):  # noqa: ANN001
        q, k, v = ctx.ws
        X, QA, QB, KA, KB, VA, VB = ctx.saved_tensors
        batch, seq_len, hd = X.shape
        dQ = dQ.reshape(-1, dQ.shape[-1])
        dK = dK.reshape(-1, dK.shape[-1])
        dV = dV.reshape(-1, dV.shape[-1])
        X = X.view(-1, X.shape[-1])
        dtype = X.dtype
        QA, QB, KA, KB, VA, VB = QA.to(dtype), QB.to(dtype), KA.to(dtype), KB.to(dtype), VA.to(dtype), VB.to(dtype)
        QA, QB, KA, KB, VA, VB = QA.t(), QB.t(), KA.t(), KB.t(), VA.t(), VB.t()
        d_QA, d_QB = torch.empty_like(QA), torch.empty_like(QB)
        d_KA, d_KB = torch.empty_like(KA), torch.empty_like(KB)
        d_VA, d_VB = torch.empty_like(VA), torch.empty_like(VB)
        q_dB = dQ @ QB.t()
        k_dB = dK @ KB.t()
        v_dB = dV @ VB.t()
        d_QA.addmm_(X.t(), q_dB, alpha=q.S, beta=0)
        d_QB.addmm_(QA.t() @ X.t(), dQ, alpha=q.S, beta=0)
        d_KA.addmm_(X.t(), k_dB, alpha=k.S, beta=0)
        d_KB.addmm_(KA.t() @ X.t(), dK, alpha=k.S, beta=0)
        d_VA.addmm_(X.t(), v_dB, alpha=v.S, beta=0)
        d_VB.addmm_(VA.t() @ X.t(), dV, alpha=v.S, beta=0)
        QW = q.dense(dQ.dtype, False, transposed=True)
        dX = torch.matmul(dQ, QW.t(), out=X)
        del QW
        dX.addmm_(q_dB, QA.t(), alpha=q.S)
        KW = k.dense(dK.dtype, False, transposed=True)
        dX.addmm_(dK, KW.t())
        del KW
        dX.addmm_(k_dB, KA.t(), alpha=k.S)
        VW = v.dense(dV.dtype, False, transposed=True)
        dX.addmm_(dV, VW.t())
        del VW
        dX.addmm_(v_dB, VA.t(), alpha=v.S)
        return dX.view(batch, seq_len, hd), d_QA.t(), d_QB.t(), d_KA.t(), d_KB.t(), d_VA.t(), d_VB.t(), None


class LoRAW(torch.autograd.Function):
    """``LoRA_W`` (o_proj): saves its input; backward makes the input's gradient anew."""

    @staticmethod
    def forward(ctx, X, A, B, w):  # noqa: ANN001
        XW = _lora(X, w)
        ctx.w = w
        ctx.save_for_backward(A, B, X)
        return XW

    @staticmethod
    def backward(ctx, dY):  # noqa: ANN001
        w = ctx.w
        A, B, X = ctx.saved_tensors
        batch, seq_len, hd = X.shape
        dY = dY.reshape(-1, dY.shape[-1])
        X = X.reshape(-1, X.shape[-1])
        dtype = X.dtype
        A, B = A.to(dtype), B.to(dtype)
        A, B = A.t(), B.t()
        d_A = torch.empty_like(A)
        d_B = torch.empty_like(B)
        y_dB = dY @ B.t()
        d_A.addmm_(X.t(), y_dB, alpha=w.S, beta=0)
        d_B.addmm_(A.t() @ X.t(), dY, alpha=w.S, beta=0)
        W = w.dense(dY.dtype, False, transposed=True)
        dX = dY @ W.t()
        del W
        dX.addmm_(y_dB, A.t(), alpha=w.S)
        return dX.view(batch, seq_len, hd), d_A.t(), d_B.t(), None


# ---- the cross-entropy (unsloth/kernels/cross_entropy_loss.py, unsloth_zoo/loss_utils.py) ----------------------

def _cuda_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, dim=1)`` as ATen's ``logsumexp_out_impl`` runs on CUDA (its max, the max's abs and
    infinity mask, ``(x - max).exp_()`` summed into the result); the CPU meta kernel makes only the result."""
    maxes = torch.amax(x, 1, keepdim=True)
    squeezed = maxes.squeeze(1)
    squeezed.masked_fill_(squeezed.abs() == float("inf"), 0)
    result = (x - maxes).exp_().sum(1)
    result.log_().add_(squeezed)
    return result


class FastCrossEntropy(torch.autograd.Function):
    """``Fast_CrossEntropyLoss`` on logits in their own dtype (no upcast): an fp32 loss and log-sum-exp per row
    (a vocabulary over :data:`UNSLOTH_CE_BLOCK` is done a block at a time: a log-sum-exp per row and block, two
    such tensors, then reduced); the logits, the log-sum-exp, the losses and the labels saved. Backward: the
    logits' gradient in their dtype (``torch.empty_like``)."""

    @staticmethod
    def forward(ctx, logits, labels):  # noqa: ANN001
        n_rows, vocab = logits.shape
        logits = logits.contiguous()
        labels = labels.contiguous()
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        if vocab <= spec_unsloth.UNSLOTH_CE_BLOCK:
            lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        else:
            blocks = -(-vocab // spec_unsloth.UNSLOTH_CE_BLOCK)
            lse = torch.empty((n_rows, blocks), dtype=torch.float32, device=logits.device)
            others = torch.empty_like(lse)
            lse = _cuda_logsumexp(lse)
            losses = F.softplus(_cuda_logsumexp(others) + losses)
            losses = losses.masked_fill(labels == -100, 0)
            del others
        ctx.save_for_backward(logits, lse, losses, labels)
        return losses

    @staticmethod
    def backward(ctx, dlosses):  # noqa: ANN001
        logits, lse, losses, labels = ctx.saved_tensors
        return torch.empty_like(logits), None


def fast_cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``fast_cross_entropy_loss`` without ``n_items``: the mean over the labelled tokens."""
    batch, seq_len, d = logits.shape
    loss = FastCrossEntropy.apply(logits.reshape(batch * seq_len, d), labels.reshape(-1))
    n_items = torch.count_nonzero(labels != -100)
    n_items = torch.where(n_items == 0, torch.ones_like(n_items), n_items)
    return loss.sum() / n_items


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``UnslothForCausalLMLoss`` (``patch_loss_functions``: transformers' ``ForCausalLMLoss`` replaced): the
    labels shifted into a new tensor, then :func:`fast_cross_entropy_loss`."""
    shift = torch.empty_like(labels)
    shift[..., :-1] = labels[..., 1:]
    with context.host():  # CUDA: the Python scalar is set from a CPU tensor
        shift[..., -1] = -100
    return fast_cross_entropy_loss(logits, shift)


def head_loss(h: torch.Tensor, head: nn.Module, labels: torch.Tensor, post) -> torch.Tensor:  # noqa: ANN001
    """The causal LM's forward with unsloth's loss in transformers' loss's place: ``lm_head``, the model's own
    operations on its logits (``post``), :func:`causal_lm_loss` on them."""
    with context.region(Kind.LOGITS):
        logits = head_out = head(h)
        logits = post(logits)
        loss = causal_lm_loss(logits, labels)
        context.label_backward(loss, head_out, Kind.LOGITS)
        return loss


def softcap(cap: float):  # noqa: ANN201
    """A model's final logit softcap, op by op as transformers writes it (none where ``cap`` is 0)."""
    def post(logits: torch.Tensor) -> torch.Tensor:
        if cap:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits
    return post


# ---- installing them --------------------------------------------------------------------------------------

def _mods(holder: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    proj = getattr(holder, "proj", None)  # the builder's ModuleDict
    return [proj[n] if proj is not None else getattr(holder, n) for n in names]


def _mlp_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``apply_lora_mlp_swiglu`` / ``apply_lora_mlp_geglu_approx``."""
    ws = self.unsloth_weights
    return LoRAMLP.apply(X, ws[0].A, ws[0].B, ws[1].A, ws[1].B, ws[2].A, ws[2].B, ws)


def _q_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``apply_lora_qkv``: Q here, K and V waiting for k_proj's and v_proj's calls."""
    ws = self.unsloth_weights
    Q, K, V = LoRAQKV.apply(X, ws[0].A, ws[0].B, ws[1].A, ws[1].B, ws[2].A, ws[2].B, ws)
    if getattr(self, "unsloth_rope", None) is not None:  # the builder's attention: RoPE here (unsloth_rope.py)
        Q, K = unsloth_rope.rotate(self, Q, K)
    self.unsloth_kv[0].unsloth_out, self.unsloth_kv[1].unsloth_out = K, V
    return Q


def _kv_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    out, self.unsloth_out = self.unsloth_out, None
    return out


def _o_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``apply_lora_o``."""
    w = self.unsloth_weight
    return LoRAW.apply(X, w.A, w.B, w)


def _inner(model: nn.Module) -> nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, getattr(base, "base_model_prefix", ""), base)


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(_inner(model).layers)


# a decoder layer's norms: transformers' names, then the builder's
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "input_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm")


def _norm_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``fast_rms_layernorm``: ``Fast_RMS_Layernorm`` allocates and saves what Liger's RMSNorm does with a frozen
    weight (the input, the weight, an fp32 statistic per row; the input's gradient into the incoming one, or
    into a new one for Gemma), so Liger's reference stands for it."""
    return liger.rms_norm(X, self.weight, self.unsloth_norm)


def patch_model(model: nn.Module, patch: UnslothPatch | None) -> None:
    """Install the kernels of ``patch`` on every layer of ``model`` (transformers' class under peft, or the
    builder's decoder), as unsloth's ``patch_peft_model`` does."""
    if patch is None:
        return
    scratch = Scratch()
    if patch.rms_norm is not None:
        inner = _inner(model)
        final = getattr(inner, "norm", None) or inner.final_norm
        for norm in [final] + [getattr(layer, n) for layer in inner.layers for n in _NORMS if hasattr(layer, n)]:
            norm.unsloth_norm = patch.rms_norm
            norm.forward = MethodType(_norm_forward, norm)
    for layer in _layers(model):
        attn = getattr(layer, "self_attn", None) or layer.attn
        if patch.mlp:
            mods = _mods(layer.mlp, ("gate_proj", "up_proj", "down_proj"))
            layer.mlp.unsloth_weights = tuple(Weight(m, scratch) for m in mods)
            layer.mlp.forward = MethodType(_mlp_forward, layer.mlp)
        if patch.qkv:
            q, k, v = _mods(attn, ("q_proj", "k_proj", "v_proj"))
            q.unsloth_weights = tuple(Weight(m, scratch) for m in (q, k, v))
            q.__dict__["unsloth_kv"] = (k, v)  # outside the module tree
            k.unsloth_out = v.unsloth_out = None
            q.forward = MethodType(_q_forward, q)
            k.forward = MethodType(_kv_forward, k)
            v.forward = MethodType(_kv_forward, v)
        if patch.attention or patch.softcap:  # before the RoPE kernel's, which wraps the builder's forward
            unsloth_attention.install(attn, patch.softcap)
        if patch.rope:
            unsloth_rope.install(attn, *_mods(attn, ("q_proj", "k_proj", "v_proj")), patch.qkv)
        if patch.o:
            (o,) = _mods(attn, ("o_proj",))
            o.unsloth_weight = Weight(o, scratch)
            o.forward = MethodType(_o_forward, o)


__all__ = ["FastCrossEntropy", "LoRAMLP", "LoRAQKV", "LoRAW", "Scratch", "Weight", "causal_lm_loss",
           "fast_cross_entropy_loss", "head_loss", "matmul_lora", "patch_model", "softcap"]
