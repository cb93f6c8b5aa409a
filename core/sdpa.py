"""Which kernel ``torch.nn.functional.scaled_dot_product_attention`` runs, predicted without torch.

The memory of the attention step depends on the kernel torch picks at run time: the fused kernels (flash,
memory-efficient, cuDNN) save the output and an fp32 log-sum-exp; the math fallback materialises
batch x heads x seq x seq scores and probabilities, like eager attention. VRAM Lab's estimate and
simulation model a fused kernel for ``--attention sdpa``; this module says when torch will not run one,
so that a prediction can say it assumed another kernel, and a profile can record which one ran
(:func:`backend_name` turns torch's own choice, ``torch._fused_sdp_choice``, into a name).

The rules, from ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` and ``sdp_utils_cpp.cpp``
(the priority is flash, then memory-efficient, then math; cuDNN is first only where torch prefers it):

* CUDA flash attention: fp16 / bf16 only (never fp32), compute capability 8.0 to 12.1, head_dim at most 256
  and a multiple of 8; training with head_dim in (192, 224] is refused on sm86-sm89 and sm120-sm121.
  Grouped-query attention (``enable_gqa``, the way transformers calls SDPA for GQA models since torch 2.5)
  is supported.
* CUDA memory-efficient attention: fp32 and fp16 everywhere from sm50, bf16 from sm80; grouped-query
  attention only from pytorch PR #191085 (July 2026; torch 2.13 is the first release that can carry it).
  Before it a GQA model whose attention inputs are fp32 (``--compute fp32``, or QLoRA with
  ``--kbit-prepare``) falls back to math.
* CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``): fp32, bf16, fp16; it lacks
  grouped-query attention in torch 2.5-2.8, so those versions run the math kernel for GQA models on the
  CPU, which changes the simulation's kernel at the project's own lower torch bound.

Known limitations: cuDNN attention (preferred over flash on some Hopper / Blackwell builds) is not
modelled separately (its memory is that of a fused kernel); ROCm is not modelled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MATH = "math"
FLASH = "flash"
EFFICIENT = "efficient"
CUDNN = "cudnn"
FUSED = (FLASH, EFFICIENT, CUDNN)

# torch.nn.attention.SDPBackend values, as torch._fused_sdp_choice returns them
_BY_CODE = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN, 4: "overrideable", -1: "error"}

EFFICIENT_GQA_FROM = (2, 13)  # pytorch PR #191085
CPU_FLASH_GQA_FROM = (2, 9)


def backend_name(code: int) -> str:
    return _BY_CODE.get(int(code), f"unknown ({code})")


_VERSION = re.compile(r"(\d+)\.(\d+)")  # compiled with the module, not at a restart's first estimate


def torch_version_tuple(version: str) -> tuple[int, int]:
    """'2.8.0+cu128' -> (2, 8); an unreadable version reads as (0, 0)."""
    m = _VERSION.match(version or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str

    @property
    def fused(self) -> bool:
        return self.backend in FUSED


def predict(torch_version: str, device: str, dtype: str, gqa: bool, head_dim: int,
            capability: tuple[int, int] | None = None, training: bool = True) -> Choice:
    """The kernel torch ``torch_version`` picks for causal SDPA without a mask, inputs of ``dtype``
    ('fp32' / 'bf16' / 'fp16') on ``device`` ('cuda' / 'cpu'); ``capability`` is the GPU's (major, minor)
    (None: assume sm80 or newer)."""
    tv = torch_version_tuple(torch_version)
    if device != "cuda":
        if gqa and tv < CPU_FLASH_GQA_FROM:
            return Choice(MATH, f"torch {torch_version}'s CPU flash attention has no grouped-query attention "
                                "(added in 2.9): the math kernel runs")
        return Choice(FLASH, "CPU flash attention")
    cc = capability or (8, 0)
    why_not_flash = ""
    if dtype == "fp32":
        why_not_flash = "flash attention takes fp16/bf16 only"
    elif not ((8, 0) <= cc <= (12, 1)):
        why_not_flash = f"flash attention needs sm80-sm121, this GPU is sm{cc[0]}{cc[1]}"
    elif head_dim > 256 or head_dim % 8:
        why_not_flash = f"flash attention needs head_dim <= 256 and a multiple of 8 (got {head_dim})"
    elif training and 192 < head_dim <= 224 and ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)):
        why_not_flash = f"flash attention cannot train head_dim {head_dim} on sm{cc[0]}{cc[1]}"
    if not why_not_flash:
        return Choice(FLASH, "flash attention")
    efficient_dtypes = {"fp32", "fp16", "bf16"} if cc >= (8, 0) else {"fp32", "fp16"}
    if cc < (5, 0) or dtype not in efficient_dtypes:
        return Choice(MATH, f"{why_not_flash}; memory-efficient attention does not take {dtype} on "
                            f"sm{cc[0]}{cc[1]}: the math kernel runs")
    if gqa and tv < EFFICIENT_GQA_FROM:
        return Choice(MATH, f"{why_not_flash}; memory-efficient attention has no grouped-query attention "
                            f"before torch {EFFICIENT_GQA_FROM[0]}.{EFFICIENT_GQA_FROM[1]}: the math kernel "
                            "runs (scores materialised)")
    return Choice(EFFICIENT, f"{why_not_flash}: memory-efficient attention")


def mismatch_note(modelled: str, ran: str) -> str | None:
    """A note when the kernel that ran is not of the kind the prediction assumed (None when it is)."""
    if ran in FUSED and modelled in FUSED:
        return None
    if ran == modelled:
        return None
    what = {MATH: "the math kernel (batch x heads x seq^2 scores materialised)"}.get(ran, f"the {ran} kernel")
    return (f"SDPA ran {what}, while the prediction assumed "
            f"{'a fused kernel (output and log-sum-exp saved)' if modelled in FUSED else 'the math kernel'}")
