"""4-bit NF4 and 8-bit weight storage: bitsandbytes' own modules on CUDA where it is installed, else an
emulation in plain torch that runs on CPU, CUDA and fake tensors.

On CUDA with ``bitsandbytes`` importable (:func:`use_bitsandbytes`) a quantized base layer is
``bnb.nn.Linear4bit`` (NF4, blocksize 64, ``compress_statistics`` = double quantization) or
``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``), loaded the way transformers' ``BitsAndBytesConfig``
loads them: a 16-bit weight put on the GPU and quantized there by ``Params4bit._quantize`` /
``Int8Params._quantize``. The profile then measures bitsandbytes' kernels, not a stand-in; the result's
``quantization`` says which ran ("bitsandbytes <version>" or "emulated"). The emulation below exists for
the simulation (fake tensors) and CPU runs; a CUDA profile without bitsandbytes is refused before it starts
(:func:`vramlab.core.profiling.profile.bitsandbytes_refusal`: the user's own run needs it too).

What bitsandbytes 0.50.2 allocates (``nn/modules.py``, ``autograd/_functions.py``, ``functional.py``,
``backends/cuda/ops.py``), and so what the emulation reproduces:

Storage is laid out as bitsandbytes lays it out, so the bytes match:

* NF4: two 4-bit codes per uint8 (``numel / 2`` bytes), one absmax per block of 64 elements; with double
  quantization the absmax values are themselves quantized to uint8 in blocks of 256 with an fp32 scale
  per block and one fp32 offset per tensor; a 16-entry fp32 code book per tensor.
* int8 (LLM.int8 storage): one int8 per element plus an fp32 scale per output row.

* load: the 16-bit weight on the device, then the packed codes and absmax beside it until the 16-bit copy
  is dropped (with double quantization a centred fp32 copy of the absmax and its uint8 codes, per tensor);
* forward (``MatMul4Bit.forward``): for many tokens ``dequantize_4bit`` makes the whole weight in the
  dtype it was quantized from, cast to the input dtype when that differs, then ``F.linear``; for few
  tokens (the cutoff depends on the GPU, ``_gemm_4bit_use_custom_cuda``) a fused kernel makes none. Only
  the packed weight is saved for backward;
* backward: the weight dequantized again (and cast to the gradient's dtype), then one matmul;
* with double quantization each dequantization first makes an fp32 absmax (one value per 64 weights).

Dequantisation here is a custom op whose fake implementation allocates what the real kernel returns: the
full weight in the compute dtype, as a temporary the autograd function does not save. The emulation's
real implementation works in row chunks so its own scratch stays small; being inside one op, that
scratch is invisible to the tracker, like a CUDA kernel's. Not reproduced: the fused small-token kernel
(our prediction keeps the dequantized temporary, an upper bound there) and the second temporary of a
16-bit weight cast to an fp32 input (``--compute fp32`` or ``--kbit-prepare``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context

NF4_BLOCK = 64
DQ_BLOCK = 256  # double quantization block size for the absmax values
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CHUNK_ELEMS = 1 << 22
# transformers' BitsAndBytesConfig(llm_int8_threshold=6.0): the outlier threshold a user's 8-bit model gets
LLM_INT8_THRESHOLD = 6.0


def bitsandbytes_version() -> str | None:
    """bitsandbytes' version when it imports here, else None."""
    try:
        import bitsandbytes
    except Exception:  # noqa: BLE001 - not installed, or broken (no CUDA library for this platform)
        return None
    return str(getattr(bitsandbytes, "__version__", "unknown"))


def use_bitsandbytes(device: torch.device | str, real: bool) -> bool:
    """Use bitsandbytes' own modules and optimizers: real tensors on CUDA with bitsandbytes importable."""
    return real and torch.device(device).type == "cuda" and bitsandbytes_version() is not None


def _dtype_of(code: int) -> torch.dtype:
    return (torch.float32, torch.bfloat16, torch.float16)[code]


def dtype_code(dtype: torch.dtype) -> int:
    return (torch.float32, torch.bfloat16, torch.float16).index(dtype)


# ---- NF4 --------------------------------------------------------------------------------------------------

@torch.library.custom_op("vramlab::dequant_nf4", mutates_args=())
def dequant_nf4(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, rows: int, cols: int,
                out_dtype: int) -> torch.Tensor:
    """Dequantize NF4 codes (``packed``: uint8, 2 per byte; ``absmax``: fp32 per 64-element block)."""
    dtype = _dtype_of(out_dtype)
    out = torch.empty(rows, cols, dtype=dtype, device=packed.device)
    flat = out.view(-1)
    pk = packed.view(-1)
    n = rows * cols
    step = _CHUNK_ELEMS
    for start in range(0, n, step):
        stop = min(n, start + step)
        p = pk[start // 2: stop // 2]
        hi = (p >> 4).long()
        lo = (p & 0x0F).long()
        idx = torch.stack((hi, lo), dim=1).view(-1)
        vals = code[idx]
        scale = absmax[start // NF4_BLOCK: stop // NF4_BLOCK].repeat_interleave(NF4_BLOCK)
        flat[start:stop] = (vals * scale).to(dtype)
    return out


@dequant_nf4.register_fake
def _(packed, absmax, code, rows, cols, out_dtype):  # noqa: ANN001
    return packed.new_empty((rows, cols), dtype=_dtype_of(out_dtype))


@torch.library.custom_op("vramlab::dequant_absmax", mutates_args=())
def dequant_absmax(qabsmax: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Undo double quantization: uint8 absmax codes -> fp32 absmax (linear code, per-256-block scale)."""
    n = qabsmax.numel()
    scale = absmax2.repeat_interleave(DQ_BLOCK)[:n]
    return (qabsmax.float() - 127.5) / 127.5 * scale + offset


@dequant_absmax.register_fake
def _(qabsmax, absmax2, offset):  # noqa: ANN001
    return qabsmax.new_empty(qabsmax.shape, dtype=torch.float32)


@torch.library.custom_op("vramlab::quantize_nf4", mutates_args=())
def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a float weight into NF4 codes + fp32 block absmax (nearest code, as bitsandbytes does)."""
    flat = weight.reshape(-1)
    n = flat.numel()
    packed = torch.empty(n // 2, 1, dtype=torch.uint8, device=weight.device)
    absmax = torch.empty(n // NF4_BLOCK, dtype=torch.float32, device=weight.device)
    code = torch.tensor(NF4_CODE, device=weight.device)
    pk = packed.view(-1)
    for start in range(0, n, _CHUNK_ELEMS):
        stop = min(n, start + _CHUNK_ELEMS)
        blocks = flat[start:stop].float().view(-1, NF4_BLOCK)
        amax = blocks.abs().amax(dim=1).clamp_min(1e-12)
        absmax[start // NF4_BLOCK: stop // NF4_BLOCK] = amax
        normed = (blocks / amax[:, None]).view(-1)
        idx = (normed[:, None] - code[None, :]).abs().argmin(dim=1).to(torch.uint8).view(-1, 2)
        pk[start // 2: stop // 2] = (idx[:, 0] << 4) | idx[:, 1]
    return packed, absmax


@quantize_nf4.register_fake
def _(weight):  # noqa: ANN001
    n = weight.numel()
    return (weight.new_empty((n // 2, 1), dtype=torch.uint8),
            weight.new_empty((n // NF4_BLOCK,), dtype=torch.float32))


@torch.library.custom_op("vramlab::quantize_absmax", mutates_args=())
def quantize_absmax(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization of the fp32 absmax: uint8 codes, fp32 scale per 256 values, fp32 offset."""
    offset = absmax.mean().reshape(())
    centred = absmax - offset
    n = centred.numel()
    nblocks = (n + DQ_BLOCK - 1) // DQ_BLOCK
    padded = torch.zeros(nblocks * DQ_BLOCK, dtype=torch.float32, device=absmax.device)
    padded[:n] = centred
    scale = padded.view(nblocks, DQ_BLOCK).abs().amax(dim=1).clamp_min(1e-12)
    q = (padded.view(nblocks, DQ_BLOCK) / scale[:, None] * 127.5 + 127.5).round().clamp(0, 255)
    return q.view(-1)[:n].to(torch.uint8), scale, offset


@quantize_absmax.register_fake
def _(absmax):  # noqa: ANN001
    n = absmax.numel()
    nblocks = (n + DQ_BLOCK - 1) // DQ_BLOCK
    return (absmax.new_empty((n,), dtype=torch.uint8), absmax.new_empty((nblocks,), dtype=torch.float32),
            absmax.new_empty((), dtype=torch.float32))


# ---- int8 -------------------------------------------------------------------------------------------------

@torch.library.custom_op("vramlab::dequant_int8", mutates_args=())
def dequant_int8(weight: torch.Tensor, scb: torch.Tensor, out_dtype: int) -> torch.Tensor:
    """int8 rows times their fp32 absmax / 127 (LLM.int8 storage)."""
    dtype = _dtype_of(out_dtype)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    rows = max(1, _CHUNK_ELEMS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        stop = min(weight.shape[0], start + rows)
        out[start:stop] = (weight[start:stop].float() * (scb[start:stop, None] / 127.0)).to(dtype)
    return out


@dequant_int8.register_fake
def _(weight, scb, out_dtype):  # noqa: ANN001
    return weight.new_empty(weight.shape, dtype=_dtype_of(out_dtype))


@torch.library.custom_op("vramlab::quantize_int8", mutates_args=())
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scb = weight.float().abs().amax(dim=1).clamp_min(1e-12)
    q = (weight.float() / scb[:, None] * 127.0).round().clamp(-127, 127).to(torch.int8)
    return q, scb


@quantize_int8.register_fake
def _(weight):  # noqa: ANN001
    return (weight.new_empty(weight.shape, dtype=torch.int8),
            weight.new_empty((weight.shape[0],), dtype=torch.float32))


# ---- storage modules ----------------------------------------------------------------------------------------

class QuantWeight(torch.nn.Module):
    """Frozen quantized weight storage with a ``dequantize(dtype)`` returning a temporary full weight."""

    def __init__(self, rows: int, cols: int, kind: str, double_quant: bool, device: torch.device,
                 sharder=None, init_std: float = 0.02, compute_dtype: torch.dtype | None = None,
                 bnb: bool = False) -> None:  # noqa: ANN001
        super().__init__()
        sharded = sharder is not None and sharder.params_sharded
        self.rows, self.cols, self.kind, self.double_quant = rows, cols, kind, double_quant
        # bitsandbytes' own module, kept out of the module tree (its packed "parameter" is storage, not
        # a parameter of the model: the totals count rows x cols, as for the emulation)
        self.__dict__["bnb_linear"] = None
        if bnb and not sharded:
            self.__dict__["bnb_linear"] = _bnb_linear(rows, cols, kind, double_quant, device, init_std,
                                                      compute_dtype)
            return
        # bitsandbytes loads each weight in 16-bit and quantizes it on the device: that 16-bit copy is the
        # load phase's transient.
        with context.region(Kind.TEMPORARIES):
            full = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
            if full.device.type != "meta" and not _is_fake(full):
                full.normal_(0.0, init_std)
        # sharded (FSDP + QLoRA): the quantized storage is gathered per unit like parameters
        with context.host() if sharded else contextlib.nullcontext():
            if kind == "nf4":
                packed, absmax = quantize_nf4(full)
                del full
                self.register_buffer("packed", packed)
                self.register_buffer("code", torch.tensor(NF4_CODE, dtype=torch.float32, device=device))
                if double_quant:
                    q, scale, offset = quantize_absmax(absmax)
                    del absmax
                    self.register_buffer("qabsmax", q)
                    self.register_buffer("absmax2", scale)
                    self.register_buffer("offset", offset)
                else:
                    self.register_buffer("absmax", absmax)
            elif kind == "int8":
                q, scb = quantize_int8(full)
                del full
                self.register_buffer("qweight", q)
                self.register_buffer("scb", scb)
            else:
                raise ValueError(f"unknown quantization {kind!r}")
        if sharded:
            for b in self.buffers():
                sharder.adopt(b)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        with context.region(Kind.TEMPORARIES):
            if self.kind == "int8":
                return dequant_int8(self.qweight, self.scb, dtype_code(dtype))
            absmax = dequant_absmax(self.qabsmax, self.absmax2, self.offset) if self.double_quant else self.absmax
            return dequant_nf4(self.packed, absmax, self.code, self.rows, self.cols, dtype_code(dtype))


def _bnb_linear(rows: int, cols: int, kind: str, double_quant: bool, device: torch.device, init_std: float,
                compute_dtype: torch.dtype | None) -> torch.nn.Module:
    """``bnb.nn.Linear4bit`` / ``Linear8bitLt`` loaded as transformers loads a quantized checkpoint: the
    16-bit weight on the device, quantized by the parameter's ``.to(device)``."""
    import bitsandbytes as bnb

    # Int8Params quantizes only on its way from the CPU (``Int8Params.to``), as transformers' loader moves it;
    # Params4bit quantizes on any move, and its 16-bit copy on the GPU is the same either way
    where = torch.device("cpu") if kind == "int8" else device
    with context.region(Kind.TEMPORARIES):
        full = torch.empty(rows, cols, dtype=torch.bfloat16, device=where).normal_(0.0, init_std)
    if kind == "nf4":
        layer = bnb.nn.Linear4bit(cols, rows, bias=False, compute_dtype=compute_dtype,
                                  compress_statistics=double_quant, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(full, requires_grad=False, quant_type="nf4",
                                         compress_statistics=double_quant, blocksize=NF4_BLOCK)
    elif kind == "int8":
        layer = bnb.nn.Linear8bitLt(cols, rows, bias=False, has_fp16_weights=False, threshold=LLM_INT8_THRESHOLD,
                                    device="meta")
        layer.weight = bnb.nn.Int8Params(full, requires_grad=False, has_fp16_weights=False)
    else:
        raise ValueError(f"unknown quantization {kind!r}")
    del full
    return layer.to(device)  # quantizes on the device; the 16-bit copy is dropped


class QuantLinearFn(torch.autograd.Function):
    """y = x @ W^T + b with W dequantized on the fly in forward and again in backward. NF4 saves nothing big
    (bitsandbytes' MatMul4Bit keeps only the packed weight, which the module holds anyway); int8 keeps its input,
    as bitsandbytes' MatMul8bitLt keeps A (``ctx.tensors = (CAt, subA, A)`` in 0.45-0.50) whenever the input or
    the weight needs a gradient."""

    @staticmethod
    def forward(ctx, x, bias, qw):  # noqa: ANN001
        ctx.qw = qw
        ctx.x_dtype = x.dtype
        if qw.kind == "int8" and ctx.needs_input_grad[0]:
            ctx.save_for_backward(x)
        w = qw.dequantize(x.dtype)
        y = F.linear(x, w, bias)
        del w
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = ctx.qw.dequantize(grad.dtype)
            grad_x = grad.matmul(w)
            del w
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_b, None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
