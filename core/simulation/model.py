"""A trainable decoder built from any :class:`ModelSpec` and :class:`TrainingSetup`.

The modules reproduce, operation by operation, what Hugging Face ``transformers`` (Llama-style decoder),
``peft`` (LoRA) and ``bitsandbytes`` (NF4 / int8 storage) do in a training step, because the tensors each
operation saves for backward are what decide the peak:

* RMSNorm upcasts to fp32 and casts back (HF ``LlamaRMSNorm``); LayerNorm runs in the input dtype.
* Attention: q/k/v projections, RoPE (``q * cos + rotate_half(q) * sin``), then either torch SDPA (the
  flash / memory-efficient kernels save q, k, v, the output and an fp32 log-sum-exp) or HF's eager
  attention (materialised scores, fp32 softmax, bf16 probabilities, ``repeat_kv`` copies for GQA).
* MLP: ``down(act(gate(x)) * up(x))`` or ``down(act(up(x)))``; an MoE block is transformers 5's fused experts
  through ``grouped_mm`` (:mod:`.moe`), whose memory does not depend on the routing.
* LoRA as peft's ``Linear.forward``: cast the input to the adapter dtype, optional dropout, ``B(A(x))``
  times the scaling, added to the base output, cast back.
* Autocast is emulated with explicit casts (fake tensors cannot run under autocast on a CPU build): each
  matmul casts fp32 inputs and weights to the compute dtype, as autocast does, and the weight copies are
  labelled AMP copies.
* The loss is HF's ``ForCausalLMLoss``: logits upcast to fp32, labels shifted by padding, cross entropy.

Parameters are created directly in their dtype on the target device (``Module.to(dtype)`` does not work
on fake tensors). Weights are random: this model exists to be measured, not to learn.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context, dora, liger, trl_head, unsloth, unsloth_loss
from vramlab.core.simulation.composite import sdpa as composite_sdpa
from vramlab.core.simulation.loss import cut_cross_entropy, liger_fused_linear_cross_entropy
from vramlab.core.simulation.moe import Experts
from vramlab.core.simulation.offload_ckpt import checkpoint_to_host
from vramlab.core.simulation.quant import QuantLinearFn, QuantWeight, use_bitsandbytes
from vramlab.core.simulation.rope import hub_rope, rotate_half
from vramlab.core.simulation.shard import Sharder, UnitBoundary
from vramlab.core.simulation.unsloth_gc import checkpoint_function
from vramlab.core.spec.hub_kernels import kernel_patch, rope_runs
from vramlab.core.spec.liger import LigerPatch
from vramlab.core.spec.model import Activation, LinearShape, MlpKind, ModelSpec, NormKind
from vramlab.core.spec.options import Attention, DType, LossKernel, Method
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import unsloth_patch

TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}
INIT_STD = 0.02


# The SDPA kernel torch chose in this process, per (backend, dtype, gqa, head_dim): a real run records it (SDPA's
# dispatch's ``torch._fused_sdp_choice``) for the profile to name. Fake tensors are not asked (not the device's).
SDPA_CHOICES: dict[tuple[str, str, bool, int], int] = {}


def record_sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> None:
    from vramlab.core.sdpa import backend_name

    try:
        code = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=gqa)
    except Exception:  # noqa: BLE001 - an older torch without the argument, or no choice function
        return
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, str(q.dtype))
    key = (backend_name(code), dtype, gqa, int(q.shape[-1]))
    SDPA_CHOICES[key] = SDPA_CHOICES.get(key, 0) + 1


@dataclass(frozen=True)
class Plan:
    """Per-setup facts the modules need, resolved once."""

    spec: ModelSpec
    setup: TrainingSetup
    device: torch.device
    param_dtype: torch.dtype  # float base weights (and non-quantized parts of a quantized model)
    compute_dtype: torch.dtype
    adapter_dtype: torch.dtype
    autocast: bool
    quant: str | None  # "nf4" | "int8" | None
    first_trainable_layer: int  # layers below are frozen (freeze method); 0 = all
    train_base: bool  # base weights trainable (full / freeze)
    real: bool  # real tensors (initialise values) rather than fake / meta
    sharder: Sharder | None = None  # rank 0 of a sharded run
    bitsandbytes: bool = False  # quantized layers are bitsandbytes' own modules (real tensors on CUDA)
    liger: LigerPatch | None = None  # Liger's RMSNorm / GLU kernels swapped in (core/simulation/liger.py)

    @classmethod
    def make(cls, spec: ModelSpec, setup: TrainingSetup, device: torch.device, real: bool) -> Plan:
        w = setup.weight_dtype
        quant = w.value if w.is_quantized else None
        param_dtype = TORCH_DTYPES[setup.compute] if quant else TORCH_DTYPES[w]
        if quant and setup.kbit_upcast:
            param_dtype = torch.float32
        first = 0
        if setup.method is Method.FREEZE:
            first = spec.num_layers - int(setup.trainable_layers or spec.num_layers)
        autocast = setup.autocast
        sharder = Sharder.for_setup(setup)
        if sharder is not None and sharder.mixed:
            autocast = False  # FSDP mixed precision gathers parameters in the compute dtype instead
        return cls(
            spec=spec, setup=setup, device=device, param_dtype=param_dtype,
            compute_dtype=TORCH_DTYPES[setup.compute], adapter_dtype=TORCH_DTYPES[setup.adapter_dtype],
            autocast=autocast, quant=quant, first_trainable_layer=first,
            train_base=setup.method in (Method.FULL, Method.FREEZE), real=real, sharder=sharder,
            bitsandbytes=bool(quant) and sharder is None and use_bitsandbytes(device, real),
            liger=kernel_patch(spec, setup),  # liger's patch and the Hub's RMSNorm
        )

    def new_param(self, *shape: int, dtype: torch.dtype | None = None, trainable: bool = False,
                  fill: float | None = None) -> nn.Parameter:
        dtype = dtype or self.param_dtype
        if trainable and self.setup.upcasts_trainable:
            dtype = torch.float32  # LLaMA-Factory's or accelerate's upcast of what trains (upcasts_trainable)
        if self.sharder is not None:
            t = self.sharder.new_tensor(shape, dtype, self.device)
        else:
            t = torch.empty(*shape, dtype=dtype, device=self.device)
        if self.real:
            with torch.no_grad():
                if fill is not None:
                    t.fill_(fill)
                else:
                    t.normal_(0.0, INIT_STD)
        return nn.Parameter(t, requires_grad=trainable)


# ---- autocast emulation -----------------------------------------------------------------------------------

# CUDA autocast's weight cache (``cached_cast`` in ATen's autocast_mode.cpp): inside an autocast region an fp32
# leaf that requires grad (a trainable parameter) is cast once and the copy held until the outermost region
# exits. HF Trainer's region is the whole forward (the loss included); a reentrant checkpoint's recompute in
# backward opens one of its own. Under checkpointing nothing else keeps a layer's copies: the cache holds them.
_AMP_CACHES: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []


class _AmpRegion:
    """An autocast region for ``plan`` (nested regions share the outermost one's cache)."""

    def __init__(self, plan: Plan) -> None:
        self.opens = plan.autocast and not _AMP_CACHES

    def __enter__(self) -> None:
        if self.opens:
            _AMP_CACHES.append({})

    def __exit__(self, *exc: object) -> None:
        if self.opens:
            _AMP_CACHES.pop()


def _amp_cast(t: torch.Tensor, dtype: torch.dtype, weight: bool = False) -> torch.Tensor:
    """What autocast does to one matmul operand: cast fp32 to the compute dtype (weights are labelled,
    and a trainable parameter's copy is cached for the region)."""
    if t.dtype == dtype or not t.is_floating_point():
        return t
    if weight:
        cache = _AMP_CACHES[-1] if _AMP_CACHES and t.dtype == torch.float32 and t.requires_grad and t.is_leaf \
            else None
        hit = cache.get(id(t)) if cache is not None else None
        if hit is not None and hit[0] is t:
            return hit[1]
        with context.region(Kind.AMP_COPIES):
            out = t.to(dtype)
        if cache is not None:
            cache[id(t)] = (t, out)
        return out
    return t.to(dtype)


def amp_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan) -> torch.Tensor:
    if plan.autocast:
        cd = plan.compute_dtype
        return F.linear(_amp_cast(x, cd), _amp_cast(weight, cd, True),
                        None if bias is None else _amp_cast(bias, cd, True))
    return F.linear(x, weight, bias)


# ---- building blocks -------------------------------------------------------------------------------------

class Linear(nn.Module):
    """A base linear layer (float, NF4 or int8) with optional peft-style LoRA."""

    def __init__(self, shape: LinearShape, plan: Plan, trainable: bool, lora: bool,
                 weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.shape = shape
        out_f, in_f = shape.out_features, shape.in_features
        self.qweight: QuantWeight | None = None
        if weight is not None:  # tied to the input embedding
            self.weight = weight
        elif plan.quant and shape.name not in ("lm_head", "router"):
            self.weight = None
            self.qweight = QuantWeight(out_f, in_f, plan.quant, plan.setup.double_quant, plan.device, plan.sharder,
                                       compute_dtype=plan.compute_dtype, bnb=plan.bitsandbytes)
        else:
            self.weight = plan.new_param(out_f, in_f, trainable=trainable)
        self.bias = plan.new_param(out_f, trainable=trainable, fill=0.0) if shape.bias else None
        self.lora = lora
        self.lora_magnitude_vector: nn.Parameter | None = None
        if lora:
            s = plan.setup
            self.scaling = s.alpha / (math.sqrt(s.lora_rank) if s.use_rslora else s.lora_rank)
            self.dropout = s.lora_dropout
            self.lora_A = plan.new_param(s.lora_rank, in_f, dtype=plan.adapter_dtype, trainable=not s.lora_fa)
            self.lora_B = plan.new_param(out_f, s.lora_rank, dtype=plan.adapter_dtype, trainable=True, fill=0.0)
            if s.use_dora:
                self.lora_magnitude_vector = self._dora_magnitude()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if self.qweight is not None:
            # bitsandbytes Linear4bit: input and bias to the compute dtype, output back to the input dtype
            cd = plan.compute_dtype
            xc = x.to(cd) if x.dtype != cd else x
            bias = self.bias.to(cd) if self.bias is not None and self.bias.dtype != cd else self.bias
            if self.qweight.bnb_linear is not None:  # bitsandbytes' own Linear4bit / Linear8bitLt
                result = self.qweight.bnb_linear(xc)
                if bias is not None:
                    result = result + bias
            else:
                result = QuantLinearFn.apply(xc, bias, self.qweight)
            del xc, bias
            if result.dtype != x.dtype:
                result = result.to(x.dtype)
        else:
            result = amp_linear(x, self.weight, self.bias, plan)
        if not self.lora:
            return result
        # peft lora.Linear.forward: the input cast to the adapter dtype (held to the end of the call), then
        # ``result + lora_B(lora_A(dropout(x))) * scaling`` as one expression: A's output goes once B has run
        # (unless B's graph saves it) and B's once it is scaled; the sum cast back
        result_dtype = result.dtype
        if self.qweight is not None and self.qweight.kind == "nf4":
            # peft 0.21.2's bnb Linear4bit.forward: the input cast to the adapter dtype, and the scaled LoRA output
            # back to the result's before it is added, only outside autocast (``requires_conversion = not
            # torch.is_autocast_enabled()``); under autocast the adapters take the input as it is
            if plan.autocast:
                return result + amp_linear(amp_linear(self._dropout(x), self.lora_A, None, plan), self.lora_B, None,
                                           plan) * self.scaling
            xa = x if x.dtype == self.lora_A.dtype else x.to(self.lora_A.dtype)
            return result + (amp_linear(amp_linear(self._dropout(xa), self.lora_A, None, plan), self.lora_B, None,
                                        plan) * self.scaling).to(result_dtype)
        # peft casts to lora_A.weight's dtype as the step runs it (FSDP mixed precision gathers it in bf16)
        xa = x if x.dtype == self.lora_A.dtype else x.to(self.lora_A.dtype)
        if self.lora_magnitude_vector is not None:
            result = self._dora(xa, result)
            return result.to(result_dtype)
        result = result + amp_linear(amp_linear(self._dropout(xa), self.lora_A, None, plan), self.lora_B, None,
                                     plan) * self.scaling
        return result.to(result_dtype)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_dropout(x, self.dropout, self.training)

    def _dora_magnitude(self) -> nn.Parameter:
        return dora.magnitude(self)

    def _dora(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        return dora.forward(self, x, result, amp_linear)


def cuda_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``nn.Dropout`` as CUDA runs it in training: the fused kernel, whose 1-byte mask backward keeps (the CPU
    kernel keeps a noise tensor in the input's dtype instead: :mod:`.cuda_dropout`)."""
    return torch.native_dropout(x, p, True)[0] if training and p > 0.0 else x


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: compute in fp32, cast back, multiply by the weight."""

    def __init__(self, dim: int, plan: Plan, trainable: bool, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = plan.new_param(dim, trainable=trainable, fill=1.0)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """HF GemmaRMSNorm: normalise in fp32, multiply by ``1 + weight`` in fp32, then cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LigerRMSNorm(RMSNorm):
    """Liger's RMSNorm (``--liger-kernels rms_norm``), as its patch sets it up for the family."""

    def __init__(self, dim: int, plan: Plan, trainable: bool) -> None:
        super().__init__(dim, plan, trainable)
        self.patch = plan.liger

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return liger.rms_norm(x, self.weight, self.patch)


def rms_norm(dim: int, plan: Plan, trainable: bool) -> RMSNorm:
    if plan.liger is not None and plan.liger.rms_norm:
        return LigerRMSNorm(dim, plan, trainable)
    return GemmaRMSNorm(dim, plan, trainable) if plan.spec.gemma_norm else RMSNorm(dim, plan, trainable)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, plan: Plan, trainable: bool, eps: float = 1e-5) -> None:
        super().__init__()
        self.plan = plan
        self.weight = plan.new_param(dim, trainable=trainable, fill=1.0)
        self.bias = plan.new_param(dim, trainable=trainable, fill=0.0)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.plan.autocast:  # layer_norm is on autocast's fp32 list: input, weight and bias cast to fp32
            x, w, b = x.float(), w.float(), b.float()
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


def make_norm(dim: int, plan: Plan, trainable: bool) -> nn.Module:
    if plan.spec.norm_kind is NormKind.LAYERNORM:
        return LayerNorm(dim, plan, trainable)
    return rms_norm(dim, plan, trainable)


def _act(x: torch.Tensor, act: Activation, amp: bool = False) -> torch.Tensor:
    if act is Activation.SILU:
        return F.silu(x)
    if act is Activation.GELU_NEW:  # transformers' NewGELUActivation, op by op; pow is on autocast's fp32 list:
        c = math.sqrt(2.0 / math.pi)  # its fp32 copy of x is no local, freed as pow returns where nothing saves it
        return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x.float() if amp else x, 3.0))))
    if act is Activation.GELU_TANH:
        return F.gelu(x, approximate="tanh")
    if act is Activation.GELU:
        return F.gelu(x)
    return F.relu(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, nkv, s, hd = x.shape
    return x[:, :, None, :, :].expand(b, nkv, n_rep, s, hd).reshape(b, nkv * n_rep, s, hd)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on meta tensors (the fast simulation) as it dispatches on the CPU."""
    if q.device.type == "meta":
        return composite_sdpa(q, k, v, **kwargs)  # type: ignore[arg-type]
    return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]


class SelfAttention(nn.Module):
    def __init__(self, plan: Plan, trainable: bool) -> None:
        super().__init__()
        spec, setup = plan.spec, plan.setup
        self.plan = plan
        targets = set(spec.lora_modules(setup.lora_targets)) if setup.uses_lora else set()
        self.proj = nn.ModuleDict({
            s.name: Linear(s, plan, trainable, s.name in targets) for s in spec.attn_linears()
        })
        self.fused = spec.fused_qkv
        self.rope_pass_cat = spec.rope_pass_cat
        self.hub_rope = rope_runs(spec, setup)  # kernels-community/rotary's RoPE (Hub kernels): its allocations
        self.q_norm = rms_norm(spec.head_dim, plan, trainable) if spec.qk_norm else None
        self.k_norm = rms_norm(spec.head_dim, plan, trainable) if spec.qk_norm else None
        self.nh, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scaling = self.hd ** -0.5
        self.kv = None  # a KV cache layer while generating (core/objectives/grpo/reference.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        if self.fused:  # HF Phi3Attention: one qkv_proj, sliced
            qkv = self.proj["qkv_proj"](x)
            qd, kvd = self.nh * self.hd, self.nkv * self.hd
            q = qkv[..., :qd].view(b, s, self.nh, self.hd)
            k = qkv[..., qd:qd + kvd].view(b, s, self.nkv, self.hd)
            v = qkv[..., qd + kvd:].view(b, s, self.nkv, self.hd).transpose(1, 2)
            del qkv
        else:
            q = self.proj["q_proj"](x).view(b, s, self.nh, self.hd)
            k = self.proj["k_proj"](x).view(b, s, self.nkv, self.hd)
            v = self.proj["v_proj"](x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cos is None:  # learned positions (GPT-2): no rotary embedding
            pass
        elif self.plan.liger is not None and self.plan.liger.rope:  # liger_rotary_pos_emb (its patch's)
            q, k = liger.rope(q, k, cos, sin)
        elif self.hub_rope and not self.rope_pass_cat and q.dtype == cos.dtype:  # the Hub's (simulation/rope.py)
            q, k = hub_rope(q, k, cos, sin)
        elif self.rope_pass_cat:  # HF Phi3 apply_rotary_pos_emb: rotary dims, then the (empty) rest, concatenated
            rd = cos.shape[-1]
            q_rot, q_pass = q[..., :rd], q[..., rd:]
            k_rot, k_pass = k[..., :rd], k[..., rd:]
            if self.plan.spec.rope_parts_kept:  # HF StableLM / Phi: both rotated, then concatenated; locals to the end
                q_rot, k_rot = hub_rope(q_rot, k_rot, cos, sin) if self.hub_rope and q.dtype == cos.dtype else (
                    (q_rot * cos) + (rotate_half(q_rot) * sin), (k_rot * cos) + (rotate_half(k_rot) * sin))
                q, k = torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)
            else:
                q = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
                k = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
                del q_rot, q_pass, k_rot, k_pass
        else:
            q = (q * cos) + (rotate_half(q) * sin)
            k = (k * cos) + (rotate_half(k) * sin)
        if self.kv is not None:  # generation: transformers' DynamicLayer.update concatenates the new keys/values
            k, v = self.kv.update(k, v)
        plan = self.plan
        run = plan.spec.attention_run(plan.setup.attention)
        if run is Attention.SDPA and mask is not None:  # HF's sliding window: k, v repeated; SDPA saves the mask
            rep = self.nh // self.nkv
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
            if plan.autocast:
                cd = plan.compute_dtype
                q, k, v = _amp_cast(q, cd), _amp_cast(k, cd), _amp_cast(v, cd)
            o = _sdpa(q, k, v, attn_mask=mask, is_causal=False, scale=self.scaling)
        elif run is Attention.SDPA:  # its dropout (attention_dropout): drawn in the fused kernel, no mask kept
            if plan.autocast:  # SDPA is on autocast's lower-precision list
                cd = plan.compute_dtype
                q, k, v = _amp_cast(q, cd), _amp_cast(k, cd), _amp_cast(v, cd)
            if plan.real:
                record_sdpa_choice(q, k, v, self.scaling, self.nkv != self.nh)
            o = _sdpa(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.nkv != self.nh)
        else:
            o = self._eager(q, k, v, mask)
        o = o.transpose(1, 2).contiguous().reshape(b, s, self.nh * self.hd)
        return cuda_dropout(self.proj["o_proj"](o), plan.spec.resid_dropout, self.training)

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """HF ``eager_attention_forward``."""
        plan = self.plan
        if plan.autocast:  # matmul is on autocast's lower-precision list
            cd = plan.compute_dtype
            q, k, v = _amp_cast(q, cd), _amp_cast(k, cd), _amp_cast(v, cd)
        rep = self.nh // self.nkv
        k = repeat_kv(k, rep)
        v = repeat_kv(v, rep)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        cap = plan.spec.attn_logit_softcap
        if cap:
            w = w / cap
            w = torch.tanh(w)
            w = w * cap
        if mask is not None:
            w = w + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = cuda_dropout(w, plan.spec.attention_dropout, self.training)
        return torch.matmul(w, v)


def _keyword_run(layer: nn.Module, *args: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor):  # noqa: ARG001, ANN202
    return layer(*args, mask=mask)  # GradientCheckpointingLayer's partial(forward, **kwargs) holds position_ids


def _sliding_window_mask(b: int, s: int, window: int, device: torch.device) -> torch.Tensor:
    """HF masking_utils.sdpa_mask with sliding_window_causal_mask_function, index-based: a (1, 1, s, s)
    boolean ``(kv > q - window) & (kv <= q)``, expanded over the batch."""
    q_idx = torch.arange(s, device=device)[None, None, :, None]
    kv_idx = torch.arange(s, device=device)[None, None, None, :]
    m = q_idx.new_ones((), dtype=torch.bool)
    m = m & (kv_idx > q_idx - window)
    m = m & (kv_idx <= q_idx)
    return m.expand(b, -1, -1, -1)


def _mlp(mods: nn.ModuleDict, x: torch.Tensor, plan: Plan) -> torch.Tensor:
    act = plan.spec.activation
    if "gate_up_proj" in mods:  # HF Phi3MLP: one gate_up_proj, chunked (or LigerPhi3SwiGLUMLP's)
        return liger.fused_mlp(mods, x, plan.liger, lambda gate: _act(gate, act, plan.autocast))
    if plan.spec.mlp_kind is MlpKind.GATED and plan.liger is not None and plan.liger.glu:  # LigerSwiGLUMLP.forward
        return mods["down_proj"](liger.glu(mods["gate_proj"](x), mods["up_proj"](x)))
    if plan.spec.mlp_kind is MlpKind.GATED:
        return mods["down_proj"](_act(mods["gate_proj"](x), act, plan.autocast) * mods["up_proj"](x))
    return mods["down_proj"](_act(mods["up_proj"](x), act, plan.autocast))


class Mlp(nn.Module):
    def __init__(self, plan: Plan, trainable: bool) -> None:
        super().__init__()
        self.plan = plan
        targets = set(plan.spec.lora_modules(plan.setup.lora_targets)) if plan.setup.uses_lora else set()
        self.proj = nn.ModuleDict({s.name: Linear(s, plan, trainable, s.name in targets)
                                   for s in plan.spec.mlp_linears()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cuda_dropout(_mlp(self.proj, x, self.plan), self.plan.spec.resid_dropout, self.training)


class DecoderLayer(nn.Module):
    def __init__(self, plan: Plan, index: int) -> None:
        super().__init__()
        self.plan = plan
        spec = plan.spec
        trainable = plan.train_base and index >= plan.first_trainable_layer
        self.index = index
        self.parallel = spec.parallel_block
        self.sandwich = spec.norms_per_layer == 4
        self.input_norm = make_norm(spec.hidden_size, plan, trainable)
        self.attn = SelfAttention(plan, trainable)
        self.mlp = Experts(plan, trainable, Linear, lambda t: _act(t, spec.activation, plan.autocast)) if spec.is_moe \
            else Mlp(plan, trainable)
        if not self.parallel:
            self.post_attn_norm = make_norm(spec.hidden_size, plan, trainable)
        if self.sandwich:
            self.pre_ffn_norm = make_norm(spec.hidden_size, plan, trainable)
            self.post_ffn_norm = make_norm(spec.hidden_size, plan, trainable)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        with _AmpRegion(self.plan):  # a checkpoint's recompute in backward: a region of its own
            return self._forward(x, cos, sin, mask)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        # transformers' ``hidden_states = residual + hidden_states``: the block's output goes at the add (seen
        # where the layer runs without a graph to save it: a checkpoint's recompute)
        if self.parallel:  # GPT-J / phi: one norm, attention and MLP side by side, both outputs locals to the return
            h = self.input_norm(x)
            a, m = self.attn(h, cos, sin, mask), self.mlp(h)
            return x + a + m
        n = self.input_norm(x)  # StableLM's sequential block keeps it to the return (spec.keeps_input_norm)
        h = self.attn(n, cos, sin, mask)
        n = n if self.plan.spec.keeps_input_norm else None
        if self.sandwich:
            h = self.post_attn_norm(h)
            x = x + h
            del h
            return x + self.post_ffn_norm(self.mlp(self.pre_ffn_norm(x)))
        x = x + h
        h = h if self.plan.spec.keeps_attn_output else None  # GPT-2's attn_output, StableLM's self_attn_output
        return x + self.mlp(self.post_attn_norm(x))


class Decoder(nn.Module):
    """The whole causal LM; ``forward(ids, labels)`` returns the mean loss and nothing else (HF Trainer
    drops the other outputs before backward)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        spec, setup = plan.spec, plan.setup
        self.plan = plan
        train_embed = setup.trains("embed_tokens")
        self.embed = plan.new_param(spec.vocab_size, spec.hidden_size, trainable=train_embed)
        self.pos_embed = (plan.new_param(spec.max_position_embeddings, spec.hidden_size,
                                         trainable=setup.method is Method.FULL)
                          if spec.learned_positions else None)
        layers = []
        for i in range(spec.num_layers):
            if plan.sharder is not None:
                plan.sharder.current_unit = i
            layers.append(DecoderLayer(plan, i))
        if plan.sharder is not None:
            plan.sharder.current_unit = -1
        self.layers = nn.ModuleList(layers)
        self.final_norm = make_norm(spec.hidden_size, plan, setup.trains("norm"))
        train_head = setup.trains("lm_head")
        head_lora = setup.uses_lora and "lm_head" in setup.lora_targets
        head_shape = LinearShape("lm_head", spec.vocab_size, spec.hidden_size, spec.lm_head_bias)
        tied = self.embed if spec.tie_embeddings else None
        if tied is not None:
            train_head = train_embed  # a tied head is the embedding's weight
        self.lm_head = Linear(head_shape, plan, train_head, head_lora, weight=tied)
        # GPT-2's learned positions replace the rotary table (transformers' GPT-2 has none)
        self.register_buffer("inv_freq", None if spec.learned_positions else self._inv_freq(spec.rope_dim, plan),
                             persistent=False)
        # transformers' rotary module keeps a copy for its dynamic / long-rope variants, whatever the rope type
        self.register_buffer("original_inv_freq", None if self.inv_freq is None else self.inv_freq.clone(),
                             persistent=False)

    @staticmethod
    def _inv_freq(dim: int, plan: Plan) -> torch.Tensor:
        t = torch.arange(0, dim, 2, dtype=torch.int64, device=plan.device).float()
        return 1.0 / (10000.0 ** (t / dim))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """HF LlamaRotaryEmbedding: fp32 frequencies, cos/sin cast to the hidden dtype."""
        inv = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1)
        pos = positions[:, None, :].float()
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with _AmpRegion(self.plan):  # HF Trainer's autocast region: the forward and the loss
            return self._forward(ids, labels)

    def _forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.backbone(ids)
        if self.plan.setup.loss_kernel is LossKernel.CCE:  # the head's weight and the hidden states, no logits
            with context.region(Kind.LOGITS):
                return cut_cross_entropy(h, self.lm_head.weight, labels, self.plan.spec.final_logit_softcap or None)
        if self.plan.setup.loss_kernel is LossKernel.TRL:  # TRL's fused LM head, as SFTTrainer computes its loss
            dtype = self.plan.compute_dtype if self.plan.autocast else h.dtype
            return trl_head.sft_loss(h, labels, self.lm_head.weight, self.lm_head.bias, dtype)
        if self.plan.setup.loss_kernel is LossKernel.LIGER:  # logits a tile of tokens at a time, gradients in forward
            cd = self.plan.compute_dtype
            amp = self.plan.autocast and h.dtype != cd  # @ under autocast: _amp_cast's operands

            def matmul(a: torch.Tensor, b: torch.Tensor, weight: bool) -> torch.Tensor:
                return _amp_cast(a, cd) @ _amp_cast(b, cd, weight)

            with context.region(Kind.LOGITS):
                return liger_fused_linear_cross_entropy(h, self.lm_head.weight, labels, matmul if amp else None)
        if (u := unsloth_patch(self.plan.spec, self.plan.setup)) is not None and u.cross_entropy:  # its loss
            return unsloth.head_loss(h, self.lm_head, labels, unsloth.softcap(self.plan.spec.final_logit_softcap))
        if u is not None and u.fused_loss:  # FastLanguageModel's forward's (core/simulation/unsloth_loss.py)
            amp = self.plan.compute_dtype if self.plan.autocast else None
            return unsloth_loss.fused_loss(h, self.lm_head.weight, labels, self.plan.setup, amp)
        if self.plan.setup.chunked_loss:
            return self._chunked_loss(h, labels)
        with context.region(Kind.LOGITS):
            return self._loss(h, labels, mean=True)

    def backbone(self, ids: torch.Tensor, checkpointing: bool | None = None, start: int = 0) -> torch.Tensor:
        """The base model: the final norm's output. ``checkpointing`` overrides the setup's (TRL turns it off
        for forwards under no_grad); ``start``: the position of the first token (generation with a KV cache,
        which the layers' attention modules hold in ``attn.kv``)."""
        spec, setup = self.plan.spec, self.plan.setup
        ckpt = setup.grad_ckpt if checkpointing is None else checkpointing
        if self.plan.sharder is not None and self.plan.sharder.params_sharded:
            self.plan.sharder.unshard(-1)  # the root unit stays gathered until the end of backward
        b, s = ids.shape
        positions = torch.arange(start, start + s, device=ids.device).unsqueeze(0)
        h = F.embedding(ids, self.embed)
        if spec.scale_embeddings:
            h = h * torch.tensor(math.sqrt(spec.hidden_size), dtype=h.dtype, device=h.device)
        if (ckpt or (setup.input_grads and torch.is_grad_enabled())) and not h.requires_grad:
            h.requires_grad_(True)  # HF enable_input_require_grads: its hook on the embedding's output
        # transformers' ``inputs_embeds`` (Gemma's scaled by its embedding module) and GPT-2's ``position_embeds``:
        # locals of the base model's forward, held until it returns (tests/test_embeddings_held.py)
        held = [h]
        if self.pos_embed is not None:
            held.append(F.embedding(positions, self.pos_embed))
            h = h + held[-1]
        h = cuda_dropout(h, spec.embed_dropout, self.training)
        cos, sin = (None, None) if spec.learned_positions else self._rope(positions, h.dtype)
        mask, masks = None, []
        if spec.attention_run(setup.attention) is Attention.EAGER:  # one additive mask per layer type
            masks = [torch.full((b, 1, s, s), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu_(1)
                     for _ in range(spec.eager_masks)]
            mask = masks[0]
        elif spec.sdpa_mask(s):
            mask = _sliding_window_mask(b, s, spec.sliding_window, h.device)
        sh = self.plan.sharder if self.plan.sharder is not None and self.plan.sharder.params_sharded else None
        reentrant = self.plan.setup.ckpt_reentrant  # transformers 5's default: non-reentrant
        ckpt_fn = checkpoint_to_host if self.plan.setup.ckpt_offload else checkpoint  # LLaMA-Factory's use_unsloth_gc
        ckpt_fn = checkpoint_function(self.plan.setup, self) or ckpt_fn  # Unsloth's own (core/simulation/unsloth_gc.py)
        for i, layer in enumerate(self.layers):
            if sh is not None:  # FSDP: gather the layer, and reduce-scatter it after its backward
                sh.unshard(i)
                if h.requires_grad:
                    h = UnitBoundary.apply(h, functools.partial(sh.post_backward, i))
            m = masks[-1] if i == 0 and masks else mask  # Gemma 2 / 3: the first layer slides (the second mask)
            if ckpt and not spec.learned_positions:
                # transformers passes the mask and the position ids by keyword: the run function, which the graph
                # keeps, holds them
                h = ckpt_fn(functools.partial(_keyword_run, layer, mask=m, position_ids=positions), h, cos, sin,
                            use_reentrant=reentrant, preserve_rng_state=False)
            elif ckpt:  # GPT-2's blocks take it by position: saved with the inputs
                h = ckpt_fn(layer, h, cos, sin, m, use_reentrant=reentrant, preserve_rng_state=False)
            else:
                h = layer(h, cos, sin, m)
            if sh is not None:
                sh.reshard(i)
                if h.requires_grad:
                    h = UnitBoundary.apply(h, functools.partial(sh.unshard, i))
        # HF's base model returns here: its embeddings, position ids, rotary tables and mask go before the head runs
        return self.final_norm(h)

    def _loss(self, h: torch.Tensor, labels: torch.Tensor, mean: bool) -> torch.Tensor:
        """lm_head + HF ForCausalLMLoss (labels shifted by padding, fp32 upcast, cross entropy)."""
        spec = self.plan.spec
        logits = self.lm_head(h)
        stop = logits.grad_fn  # the head's output itself goes with the softcap's first rebinding
        cap = spec.final_logit_softcap
        if cap:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        # the model's forward holds its (capped) logits while ForCausalLMLoss upcasts them
        upcast = logits.float() if self.plan.setup.loss_fp32 else logits
        labels = F.pad(labels, (0, 1), value=-100)
        shift = labels[..., 1:].contiguous()
        reduction = "mean" if mean else "sum"
        if self.plan.liger is not None and self.plan.liger.cross_entropy:  # liger's in torch's place (not autocast's)
            loss = liger.cross_entropy(upcast.view(-1, spec.vocab_size), shift.view(-1))
        elif self.plan.autocast and upcast.dtype != torch.float32:
            # CUDA autocast runs cross_entropy's log_softmax with dtype=float32: fp16 logits go straight to an fp32
            # output (aten's half_to_float path, CUDA only), bf16 ones are converted to fp32 first
            x = upcast.view(-1, spec.vocab_size)
            lsm = (torch._log_softmax(x, -1, True) if x.dtype == torch.float16
                   else F.log_softmax(x, dim=-1, dtype=torch.float32))
            loss = F.nll_loss(lsm, shift.view(-1), ignore_index=-100, reduction=reduction)
        else:
            loss = F.cross_entropy(upcast.view(-1, spec.vocab_size), shift.view(-1), ignore_index=-100,
                                   reduction=reduction)
        context.label_backward(loss, stop, Kind.LOGITS)
        return loss

    def _chunked_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """lm_head + loss per token chunk under checkpointing: only one chunk's logits exist at a time."""
        n = self.plan.setup.loss_chunks
        total = None
        tokens = labels.numel()

        def chunk_loss(hc: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
            with context.region(Kind.LOGITS), _AmpRegion(self.plan):
                return self._loss(hc, lc, mean=False)

        for hc, lc in zip(h.chunk(n, dim=1), labels.chunk(n, dim=1)):
            part = checkpoint(chunk_loss, hc, lc, use_reentrant=True, preserve_rng_state=False)
            total = part if total is None else total + part
        return total / tokens


def build_model(spec: ModelSpec, setup: TrainingSetup, device: torch.device | str = "cpu",
                real: bool = True) -> Decoder:
    """Build the decoder for ``setup`` on ``device``; ``real=False`` skips value initialisation (fake or
    meta tensors)."""
    setup.validate(spec)
    plan = Plan.make(spec, setup, torch.device(device), real)
    model = Decoder(plan)
    unsloth.patch_model(model, unsloth_patch(spec, setup))  # Unsloth's fused LoRA kernels, installed after peft's
    return model

