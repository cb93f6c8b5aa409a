"""From the tensor peak to the allocator-reserved and device-used levels.

Every number here is an assumption about the CUDA runtime, stated with its source so the UI can show
it. The tensor level is exact (simulation); these outer levels are modelled.

* Allocator reserved: the caching allocator rounds blocks (512 B; large blocks come from 2 MiB / 20 MiB
  segments) and keeps freed blocks cached, so reserved exceeds the tensor peak by block slack plus
  fragmentation, which grows with the churn of activations and temporaries.
* Reserved also holds torch's cuBLAS workspaces (cuBLASLt shares them in torch 2.13) and the attention
  kernel's backward scratch (flash's dq accumulator, cuDNN's workspace), allocated through the caching allocator.
* Device used: reserved plus the CUDA context (driver + kernels of torch, cuBLAS, cuDNN loaded lazily),
  NCCL buffers with several GPUs, and managed memory of paged optimizers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from vramlab.core.allocator import AllocatorConfig, CachingAllocator
from vramlab.core.calibration import Calibration
from vramlab.core.kinds import Kind
from vramlab.core.result import MemLevel, Overhead
from vramlab.core.sdpa import CUDNN, FLASH, cuda_choice
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Attention, GenerationBackend, Objective
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import xformers_kernel, xformers_runs
from vramlab.core.units import MiB

T = TypeVar("T", int, np.ndarray)

# CUDA context with torch 2.x and lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since
# CUDA 11.7 / torch 1.13), as nvidia-smi shows it after the first kernels of a training step.
CONTEXT_BY_ARCH = {
    "volta": 310 * MiB, "turing": 300 * MiB, "ampere": 420 * MiB, "ada": 400 * MiB,
    "hopper": 520 * MiB, "blackwell": 560 * MiB, "cdna2": 350 * MiB, "cdna3": 400 * MiB,
}
DEFAULT_CONTEXT = 420 * MiB
# torch's cuBLAS workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp, torch 2.13): one per (cuBLAS handle,
# stream), CUBLAS_WORKSPACE_CONFIG ':4096:2:16:8' = 8 MiB + 128 KiB by default and 32 MiB on compute capability
# 9.x, 10.x, 11.x and 12.x (Hopper and Blackwell parts). In torch 2.13 the cuBLASLt workspace is the cuBLAS one
# (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default in CUDA builds: torch.backends.cuda.blas_workspace_size's
# docstring, "physically reuses the same allocation"), so no separate cuBLASLt workspace is added unless that
# variable is 0. Workspaces come from the caching allocator (getNewWorkspace), so they are inside
# memory_allocated and memory_reserved, not beside them; the device level counts them once, through the
# reserved level. A training step holds two handles on the default stream: the forward's thread and the autograd
# engine's device thread, each with its own workspace.
CUBLAS_HANDLES = 2
CUBLAS_LARGE_WS_MAJORS = (9, 10, 11, 12)
CUBLAS_LARGE_WS = 32 * MiB
DEFAULT_CUBLAS_WS = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLASLT_WS = 1 * MiB  # CUBLASLT_WORKSPACE_SIZE's default, for a cuBLASLt workspace of its own (unified off)
# NCCL: ring buffers per peer pair plus communicator state. UNVERIFIED: a rough figure, not yet measured on a
# multi-GPU machine (tools/gpu_check.py records the whole-GPU level of a two-GPU FSDP run where two GPUs exist).
NCCL_BUFFERS = 2 * 4 * MiB * 2 + 64 * MiB
NCCL_UNVERIFIED = True


# The fast model of the allocator's slack at the peak, fitted to full replays through the
# caching-allocator model (core/allocator.py) over 65 setups of the accuracy matrix: reserved - allocated
# ~ 0.055 x churned bytes (activations, temporaries, logits, optimizer temporaries, autocast copies)
# + 0.45 x the largest single allocation + 64 MiB (median error 2.7 %, p90 6.3 % of the reserved level).
FRAG_OF_CHURN = 0.055
FRAG_OF_LARGEST = 0.45
FRAG_BASE = 64 * MiB


# the most allocations and frees of one full-depth step that ``estimate(..., allocator=True)`` replays (about
# a second); beyond it the reserved level comes from the fast model and says so
REPLAY_BUDGET = 250_000

CHURN_KINDS = (Kind.ACTIVATIONS, Kind.TEMPORARIES, Kind.LOGITS, Kind.OPTIMIZER_TEMPS, Kind.AMP_COPIES)


def slack_model(churn: T, largest_alloc: T, alloc_conf: AllocatorConfig | None = None) -> T:
    """The fast model's reserved - allocated at the peak, for one setup (ints) or many (int64 arrays)."""
    frag = churn * FRAG_OF_CHURN + largest_alloc * FRAG_OF_LARGEST
    frag = (frag.astype(np.int64) if isinstance(frag, np.ndarray) else int(frag)) + FRAG_BASE
    if alloc_conf is not None and alloc_conf.expandable_segments:
        frag //= 3  # replays with expandable segments keep about a third of the slack
    return frag


def context_bytes(gpu: GpuSpec | None) -> int:
    if gpu is None:
        return DEFAULT_CONTEXT
    return CONTEXT_BY_ARCH.get(gpu.arch, DEFAULT_CONTEXT)


# compiled with the module: compiling it at the first estimate (a restart's) cost about 0.2 ms there
_CUBLAS_WORKSPACE = re.compile(r":([0-9]+):([0-9]+)")


def gpu_capability(gpu: GpuSpec | None) -> tuple[int, int] | None:
    """(major, minor) of ``gpu``'s compute capability, None where unknown (an AMD GPU's gfx name too)."""
    return gpu.capability() if gpu is not None else None


def cublas_bytes(gpu: GpuSpec | None, environ: Mapping[str, str] | None = None) -> int:
    """The cuBLAS workspaces a training process holds in the caching allocator (both handles), honouring
    CUBLAS_WORKSPACE_CONFIG as torch parses it; a cuBLASLt workspace of its own (CUBLASLT_WORKSPACE_SIZE, capped
    at the cuBLAS size) only where TORCH_CUBLASLT_UNIFIED_WORKSPACE=0."""
    env = os.environ if environ is None else environ
    cc = gpu_capability(gpu)
    ws = CUBLAS_LARGE_WS if cc is not None and cc[0] in CUBLAS_LARGE_WS_MAJORS else DEFAULT_CUBLAS_WS
    pairs = _CUBLAS_WORKSPACE.findall(env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        ws = sum(int(size) * 1024 * int(count) for size, count in pairs)
    lt = 0
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip() == "0":
        lt = CUBLASLT_WS
        if env.get("CUBLASLT_WORKSPACE_SIZE", "").strip().isdigit():
            lt = min(int(env["CUBLASLT_WORKSPACE_SIZE"]) * 1024, ws)  # capped at the cuBLAS size, as torch does
    return CUBLAS_HANDLES * (ws + lt)


def outer_levels(
    spec: ModelSpec,
    setup: TrainingSetup,
    peak_allocated: int,
    components: Mapping[Kind, int],
    gpu: GpuSpec | None,
    managed_bytes: int = 0,
    allocations: list[tuple[int, int]] | None = None,
    alloc_conf: AllocatorConfig | None = None,
    largest_alloc: int = 0,
    calibration: Calibration | None = None,
    replayed_reserved: int | None = None,
    replay_skipped: int = 0,
    kernel: str | None = None,
) -> tuple[int, int, tuple[Overhead, ...]]:
    """(reserved, device used, overheads) for a tensor peak with this breakdown. With the step's
    ``allocations`` (or the reserved level they replay to, ``replayed_reserved``) the reserved level comes
    from replaying them through the caching-allocator model; otherwise from a share of the churned bytes.
    ``replay_skipped``: the number of allocations a replay would have taken, when it was not done. ``kernel``: the
    SDPA kernel of the run (:func:`attention_kernel`, computed when None)."""
    if allocations is not None:
        replayed_reserved = CachingAllocator(alloc_conf).replay(allocations).peak_reserved
    if replayed_reserved is not None:
        reserved = max(replayed_reserved, peak_allocated)
        frag = reserved - peak_allocated
        why = ("Replayed through a model of the CUDA caching allocator: 2 MiB small / 20 MiB large segments, "
               "best-fit block splitting, freed blocks cached and never returned"
               + (", expandable segments" if alloc_conf and alloc_conf.expandable_segments else "") + ".")
    else:
        churn = sum(components.get(k, 0) for k in CHURN_KINDS)
        frag = int(slack_model(churn, largest_alloc, alloc_conf))
        reserved = peak_allocated + frag
        why = ("The caching allocator keeps freed blocks for reuse; a share of the activation and temporary "
               "churn is cached but unusable at the peak (a fast model; the full replay is exact for the step).")
        if replay_skipped:
            why += (f" Not replayed: the step makes {replay_skipped:,} allocations and frees, more than a replay "
                    f"takes in about a second ({REPLAY_BUDGET:,}).")
    if calibration is not None:
        frag = int(frag * calibration.slack_ratio)
        reserved = peak_allocated + frag
        why += f" Scaled by {calibration.slack_ratio:.2f} as measured ({calibration.label})."
    overheads = [Overhead(SLACK_NAME, frag, MemLevel.RESERVED, why)]
    cublas = cublas_bytes(gpu)
    overheads.append(Overhead("cuBLAS workspace", cublas, MemLevel.RESERVED,
                              f"torch's cuBLAS workspace, {CUBLAS_HANDLES} handles (forward and autograd threads; "
                              "cuBLASLt shares it in torch 2.13): allocated from the caching allocator, so inside "
                              "the reserved level (and inside a measured max_memory_allocated)."))
    reserved += cublas
    kernel = attention_kernel(spec, setup, gpu) if kernel is None else kernel
    scratch = attention_backward_scratch(spec, setup, kernel)
    if scratch:
        name, why = SCRATCH_WHY[kernel]
        overheads.append(Overhead(name, scratch, MemLevel.RESERVED, why))
        reserved += scratch
    ctx = calibration.context_bytes if calibration is not None else context_bytes(gpu)
    ctx_why = (f"Measured by a profile ({calibration.label})." if calibration is not None else
               f"Driver and lazily loaded kernels of torch/cuBLAS/cuDNN "
               f"({gpu.arch if gpu and gpu.arch else 'typical'} GPU, torch 2.x).")
    overheads.append(Overhead("CUDA context", ctx, MemLevel.DEVICE, ctx_why))
    device = reserved + ctx
    if setup.gpus > 1:
        overheads.append(Overhead("NCCL buffers", NCCL_BUFFERS, MemLevel.DEVICE,
                                  "Communicator ring buffers and state for collectives across GPUs (a rough "
                                  "figure, not yet verified on a multi-GPU machine)."))
        device += NCCL_BUFFERS
    if managed_bytes or setup.optimizer.is_paged:
        overheads.append(Overhead("Paged optimizer states (managed)", managed_bytes, MemLevel.DEVICE,
                                  "bitsandbytes pages large optimizer states in CUDA managed memory: not "
                                  "in torch's counters, resident on the GPU unless memory runs short."))
        device += managed_bytes
    extra = vllm_colocated(setup, gpu, components, device, cublas + ctx)
    if extra is not None:
        overheads.append(extra)
        device += extra.bytes
    return reserved, device, tuple(overheads)


VLLM_NAME = "vLLM (colocated)"
# what stays on the GPU while vLLM sleeps: the training tensors that live across steps
_RESIDENT_KINDS = (Kind.WEIGHTS, Kind.ADAPTERS, Kind.MASTER_WEIGHTS, Kind.OPTIMIZER_STATES, Kind.REFERENCE,
                   Kind.INPUTS)


def vllm_colocated(setup: TrainingSetup, gpu: GpuSpec | None, components: Mapping[Kind, int], device: int,
                   fixed: int) -> Overhead | None:
    """GRPO with vLLM in the training process (TRL's ``vllm_mode="colocate"``): vLLM takes
    ``gpu_memory_utilization`` of the device's total memory (its worker's ``requested_memory``: weights, its own
    activation peak, the KV cache filling the rest), outside the trainer's allocator. Without sleep mode it is
    there for the whole run. With ``vllm_enable_sleep_mode`` TRL sleeps it at level 2 between generations and,
    before waking it, calls ``torch.cuda.empty_cache()``: at generation the trainer holds only what lives across
    steps (weights, adapters, optimizer states, a reference copy) plus its context and workspaces, and vLLM its
    share beside them. None where the setup has no colocated vLLM or no GPU is given."""
    if setup.objective is not Objective.GRPO or setup.generation_backend is not GenerationBackend.VLLM_COLOCATE:
        return None
    if gpu is None:
        return None
    share = int(gpu.memory_bytes * setup.vllm_memory_fraction)
    frac = f"{setup.vllm_memory_fraction:g} x {gpu.name}'s memory"
    if not setup.vllm_sleep:
        return Overhead(VLLM_NAME, share, MemLevel.DEVICE,
                        f"vLLM's gpu_memory_utilization share ({frac}: its weights, activations and KV cache), held "
                        "for the whole run beside the training step.")
    resident = sum(components.get(k, 0) for k in _RESIDENT_KINDS) + fixed
    extra = max(0, resident + share - device)
    return Overhead(VLLM_NAME, extra, MemLevel.DEVICE,
                    f"Sleep mode: vLLM's share ({frac}) exists only while it generates, after TRL emptied the "
                    "allocator's cache; the device level is the larger of the training step and the tensors that "
                    "live across steps plus that share.")


SLACK_NAME = "Allocator cache & fragmentation"


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


SCRATCH_WHY = {
    FLASH: ("Flash-attention backward scratch",
            "Flash attention's backward allocates an fp32 dq accumulator (and, for grouped-query attention, dk/dv "
            "expanded to every head) per layer: a CUDA-only block inside max_memory_allocated while it runs, cached "
            "in the reserved level after."),
    CUDNN: ("cuDNN attention backward workspace",
            "cuDNN attention's backward takes its workspace (an fp32 dQ accumulator and softmax sums) from the "
            "caching allocator at every call, per layer: inside max_memory_allocated while it runs, cached in the "
            "reserved level after. Its gradients are k- and v-sized, with no dk/dv expanded for grouped-query "
            "attention."),
}


def attention_kernel(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None) -> str:
    """The SDPA kernel of a CUDA run of ``setup`` on ``gpu`` (:func:`vramlab.core.sdpa.cuda_choice`), or the one
    xformers dispatches Unsloth's attention to (:func:`vramlab.core.spec.unsloth.xformers_kernel`); "eager" where
    neither runs."""
    if xformers_runs(spec, setup):  # Unsloth's attention forward: xformers' kernel, not SDPA's
        return xformers_kernel(gpu_capability(gpu))
    choice = cuda_choice(spec, setup, gpu_capability(gpu))
    return choice.backend if choice is not None else "eager"


def attention_backward_scratch(spec: ModelSpec, setup: TrainingSetup, kernel: str, micro_batch: Any = None,
                               seq_len: Any = None) -> Any:
    """What the attention kernel's backward allocates for one layer beside its gradients, by kernel: flash
    (:func:`flash_backward_scratch`), cuDNN (cudnn-frontend's SDPA backward workspace: an fp32 dQ accumulator of
    batch x heads x seq x head_dim and fp32 softmax sums of batch x heads x seq; torch 2.13's
    ``_scaled_dot_product_cudnn_attention_backward`` makes k- and v-sized gradients, so no GQA expansion); none
    for the math kernel (ordinary ops, in the tape), none modelled for memory-efficient attention and none
    for a model without attention (a pure Mamba-2).
    ``micro_batch`` / ``seq_len`` replace the setup's (numpy arrays of points too: the sizes are arithmetic)."""
    if not spec.has_attention:  # a pure Mamba-2: no attention kernel runs
        return 0
    b = setup.micro_batch if micro_batch is None else micro_batch
    s = setup.seq_len if seq_len is None else seq_len
    if kernel == FLASH:
        return flash_backward_scratch(spec, setup, b, s)
    if kernel == CUDNN:
        h, d = spec.num_heads, spec.head_dim
        return 4 * b * s * h * d + 4 * b * h * s
    return 0


def flash_backward_scratch(spec: ModelSpec, setup: TrainingSetup, micro_batch: Any = None,
                           seq_len: Any = None) -> Any:
    """What flash attention's backward allocates for one layer beside its gradients (torch's
    ``flash_attn/flash_api.cpp`` ``mha_bwd``, as FlashAttention-2): an fp32 ``dq_accum`` of
    batch x seq (rounded to 128) x heads x head_dim (rounded to 32, 256 above 192), an fp32 ``softmax_d`` of
    batch x heads x seq (rounded), and with grouped-query attention ``dk`` / ``dv`` expanded to every query
    head in the compute dtype before they are summed per KV head (not under Unsloth's xformers attention, which
    hands the kernel k and v already repeated to every head: :func:`vramlab.core.spec.unsloth.xformers_kernel`
    names the same ``mha_bwd``). One layer at a time; a CUDA-only
    allocation inside one kernel call, so the CPU simulation cannot see it. 0 where flash does not run (eager
    attention, fp32 inputs)."""
    if spec.attention_run(setup.attention) is not Attention.SDPA or setup.compute.itemsize != 2:
        return 0
    b = setup.micro_batch if micro_batch is None else micro_batch
    s = setup.seq_len if seq_len is None else seq_len
    h = spec.num_heads
    d = spec.head_dim
    d_r = _round_up(d, 32) if d <= 192 else 256
    s_r = _round_up(s, 128)
    scratch = 4 * b * s_r * h * d_r + 4 * b * h * s_r
    if spec.num_kv_heads != spec.num_heads and not xformers_runs(spec, setup):  # xformers gets k, v repeated
        scratch += 2 * b * s * h * d * setup.compute.itemsize
    return scratch


def allocator_slack(result: object) -> int:
    """The modelled allocator slack of an estimate (its reserved level less the tensor peak and the cuBLAS
    workspaces): what a calibration's measured slack is compared with."""
    return next((o.bytes for o in getattr(result, "overheads", ()) if o.name == SLACK_NAME), 0)
