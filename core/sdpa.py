"""Which kernel ``torch.nn.functional.scaled_dot_product_attention`` runs, predicted without torch.

The memory of the attention step depends on the kernel torch picks at run time, and each is modelled as
itself: flash and memory-efficient attention save the output and an fp32 log-sum-exp; cuDNN attention
saves the same and takes its backward workspace from the caching allocator per call; the math fallback is a
composite of ordinary ops that keeps batch x heads x seq x seq fp32 probabilities per layer (see
:meth:`vramlab.core.estimator.program.Model.sdpa_math`). The estimator never imports torch, so the choice is
this pure function; ``tests/test_sdpa.py`` holds it to torch's own selection (``torch._fused_sdp_choice``,
the function SDPA's dispatch calls) where this machine can ask it: the CPU, and CUDA where a GPU is present
(``tools/gpu_check.py``). A profile records which kernel ran (:func:`backend_name`).

The rules for torch 2.13 (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` and
``sdp_utils_cpp.cpp``; the priority is cuDNN where torch prefers it, then flash, memory-efficient, math):

* cuDNN attention first on compute capability 9.x and 10.x (Hopper, Blackwell) with cuDNN >= 9.15, unless
  ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set: fp16 / bf16, head_dim at most 128 and a multiple of 8. Its
  backward makes gradients the size of k and v (``meta__scaled_dot_product_cudnn_backward``: ``empty_like``),
  so grouped-query attention costs no expanded dk / dv.
* CUDA flash attention: fp16 / bf16 only (never fp32), compute capability 8.0 to 12.1, head_dim at most 256
  and a multiple of 8; training with head_dim in (192, 224] is refused on sm86-sm89 and sm120-sm121.
  Grouped-query attention (``enable_gqa``, the way transformers calls SDPA for GQA models without a mask)
  is supported.
* CUDA memory-efficient attention: fp32 and fp16 everywhere from sm50, bf16 from sm80; no grouped-query
  attention in torch 2.13: its own meta registration of the backward
  (``torch/_meta_registrations.py``, ``meta__scaled_dot_product_efficient_backward``) still sizes grad_k and
  grad_v with the query's head count, ``F.scaled_dot_product_attention``'s docstring says GQA "works only for
  Flash_attention and math kernel on CUDA"; 2.14 is taken as the first release with it (its release notes list
  it as new; not checked against a 2.14 build here). So a GQA model
  whose attention inputs are fp32 (``--compute fp32``, or QLoRA with ``--kbit-prepare``) runs the math
  kernel under torch <= 2.13.
* CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``): fp32, bf16, fp16; it lacks
  grouped-query attention in torch 2.5-2.8, so those versions run the math kernel for GQA models on the CPU.

Not modelled: ROCm; cuDNN versions below 9.15 (their CUDA builds are assumed to carry 9.15 or newer).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

MATH = "math"
FLASH = "flash"
EFFICIENT = "efficient"
CUDNN = "cudnn"
FUSED = (FLASH, EFFICIENT, CUDNN)

# torch.nn.attention.SDPBackend values, as torch._fused_sdp_choice returns them
_BY_CODE = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN, 4: "overrideable", -1: "error"}

EFFICIENT_GQA_FROM = (2, 14)  # see the module docstring: not in 2.13's meta registration nor its docstring
CPU_FLASH_GQA_FROM = (2, 9)
CUDNN_PREFERRED_FROM = (2, 13)  # cuDNN attention ahead of flash on sm90 / sm100 (cuDNN >= 9.15)
CUDNN_MIN_VERSION = 91500  # torch.backends.cudnn.version()'s encoding of 9.15.0
CUDNN_DEPRIORITIZED_ENV = "TORCH_CUDNN_SDPA_DEPRIORITIZED"
MODELLED_TORCH = "2.13.0"  # the torch whose kernel choice an estimate models where no torch is installed


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


def _cudnn_first(tv: tuple[int, int], cc: tuple[int, int], dtype: str, head_dim: int,
                 cudnn_version: int | None, environ: Mapping[str, str]) -> str:
    """Why cuDNN attention is not torch's first choice here ('' when it is)."""
    if tv < CUDNN_PREFERRED_FROM or cc[0] not in (9, 10):
        return "not preferred"
    if environ.get(CUDNN_DEPRIORITIZED_ENV, "") not in ("", "0"):
        return f"{CUDNN_DEPRIORITIZED_ENV} is set"
    if cudnn_version is not None and cudnn_version < CUDNN_MIN_VERSION:
        return f"cuDNN {cudnn_version} is older than 9.15"
    if dtype == "fp32":
        return "cuDNN attention takes fp16/bf16 only"
    if head_dim > 128 or head_dim % 8:
        return f"cuDNN attention needs head_dim <= 128 and a multiple of 8 (got {head_dim})"
    return ""


def predict(torch_version: str, device: str, dtype: str, gqa: bool, head_dim: int,
            capability: tuple[int, int] | None = None, training: bool = True,
            environ: Mapping[str, str] | None = None, cudnn_version: int | None = None) -> Choice:
    """The kernel torch ``torch_version`` picks for causal SDPA without a mask, inputs of ``dtype``
    ('fp32' / 'bf16' / 'fp16') on ``device`` ('cuda' / 'cpu'); ``capability`` is the GPU's (major, minor)
    (None: assume sm80 or newer). ``environ`` (default ``os.environ``) is read for
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED``; ``cudnn_version`` as ``torch.backends.cudnn.version()`` gives it
    (None: a torch CUDA wheel's own, assumed >= 9.15)."""
    tv = torch_version_tuple(torch_version)
    if device != "cuda":
        if gqa and tv < CPU_FLASH_GQA_FROM:
            return Choice(MATH, f"torch {torch_version}'s CPU flash attention has no grouped-query attention "
                                "(added in 2.9): the math kernel runs")
        return Choice(FLASH, "CPU flash attention")
    cc = capability or (8, 0)
    env = os.environ if environ is None else environ
    if not _cudnn_first(tv, cc, dtype, head_dim, cudnn_version, env):
        return Choice(CUDNN, f"cuDNN attention (torch {tv[0]}.{tv[1]} prefers it on sm{cc[0]}{cc[1]}; "
                             f"{CUDNN_DEPRIORITIZED_ENV}=1 turns that off)")
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
        return Choice(MATH, f"{why_not_flash}; torch {tv[0]}.{tv[1]}'s memory-efficient attention has no "
                            f"grouped-query attention (from {EFFICIENT_GQA_FROM[0]}.{EFFICIENT_GQA_FROM[1]}): "
                            "the math kernel runs (fp32 scores and probabilities materialised)")
    return Choice(EFFICIENT, f"{why_not_flash}: memory-efficient attention")


def mismatch_note(modelled: str, ran: str) -> str | None:
    """A note when the kernel that ran is not the one the prediction modelled (None when it is). Each kernel
    keeps and scratches its own memory (cuDNN's workspace is not flash's dq accumulator), so any difference is
    named."""
    if ran == modelled:
        return None
    names = {MATH: "the math kernel (batch x heads x seq^2 fp32 probabilities kept)",
             CUDNN: "cuDNN attention (its backward workspace from the caching allocator)",
             FLASH: "flash attention", EFFICIENT: "memory-efficient attention"}
    return (f"SDPA ran {names.get(ran, f'the {ran} kernel')}, while the prediction modelled "
            f"{names.get(modelled, modelled)}")


@functools.cache
def installed_torch() -> str:
    """torch's version from its metadata (no import), or '' where torch is not installed."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def modelled_torch() -> str:
    """The torch whose choice an estimate models: the installed one, else :data:`MODELLED_TORCH`."""
    return installed_torch() or MODELLED_TORCH


def attention_dtype(setup: TrainingSetup) -> str:
    """The dtype of the tensors SDPA gets in ``setup``: autocast's compute dtype; a quantized model's compute
    dtype, or fp32 where ``--kbit-prepare`` upcast the rest of the model; else the weights' own."""
    if setup.autocast:
        return setup.compute.value
    w = setup.weight_dtype
    if w.is_quantized:
        return "fp32" if setup.kbit_upcast else setup.compute.value
    return w.value


def uses_gqa(spec: ModelSpec, seq_len: int) -> bool:
    """transformers passes ``enable_gqa=True`` for a GQA model without a mask (``use_gqa_in_sdpa``); with a
    sliding-window mask it repeats k and v itself, so SDPA sees as many kv heads as query heads."""
    return spec.num_kv_heads != spec.num_heads and not spec.sdpa_mask(seq_len)


def cuda_choice(spec: ModelSpec, setup: TrainingSetup, capability: tuple[int, int] | None = None,
                torch_version: str | None = None, environ: Mapping[str, str] | None = None) -> Choice | None:
    """The kernel a CUDA run of ``setup`` takes for its SDPA calls (None: eager attention runs)."""
    if spec.attention_run(setup.attention) != "sdpa":  # spec.Attention.SDPA (a StrEnum): this module reads setups only
        return None
    deprioritized = ""
    if capability is not None and capability[0] in (9, 10):  # the variable matters only where cuDNN comes first
        deprioritized = (os.environ if environ is None else environ).get(CUDNN_DEPRIORITIZED_ENV, "")
    return _cuda_predict(torch_version or modelled_torch(), attention_dtype(setup), uses_gqa(spec, setup.seq_len),
                         spec.head_dim, capability, deprioritized)


@functools.lru_cache(maxsize=1024)  # a pure function of a few settings, asked several times per estimate
def _cuda_predict(version: str, dtype: str, gqa: bool, head_dim: int, capability: tuple[int, int] | None,
                  deprioritized: str) -> Choice:
    return predict(version, "cuda", dtype, gqa, head_dim, capability,
                   environ={CUDNN_DEPRIORITIZED_ENV: deprioritized} if deprioritized else {})


def tape_kernel(spec: ModelSpec, setup: TrainingSetup, simulation: bool) -> str:
    """What the estimator's tape models for the attention of ``setup``: the math kernel where a CUDA run of
    the modelled torch takes it on any GPU from sm80 (fp32 grouped-query attention before 2.14, above all),
    else a fused kernel (their saved tensors are alike; cuDNN and flash differ in their backward scratch, which
    the reserved level adds by GPU: :func:`vramlab.core.levels.attention_backward_scratch`). The simulation runs
    the CPU's kernels, always fused for the modelled torch."""
    if simulation or spec.num_kv_heads == spec.num_heads:
        return FLASH  # without grouped-query attention every dtype has a fused kernel from sm80 (see predict)
    choice = cuda_choice(spec, setup, environ={})
    return MATH if choice is not None and choice.backend == MATH else FLASH
