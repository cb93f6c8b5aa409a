"""From the tensor peak to the allocator-reserved and device-used levels.

Every number here is an assumption about the CUDA runtime, stated with its source so the UI can show
it. The tensor level is exact (simulation); these outer levels are modelled.

* Allocator reserved: the caching allocator rounds blocks (512 B; large blocks come from 2 MiB / 20 MiB
  segments) and keeps freed blocks cached, so reserved exceeds the tensor peak by block slack plus
  fragmentation, which grows with the churn of activations and temporaries.
* Device used: reserved plus the CUDA context (driver + kernels of torch, cuBLAS, cuDNN loaded lazily),
  the cuBLAS workspace, NCCL buffers with several GPUs, and managed memory of paged optimizers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import numpy as np

from .allocator import AllocatorConfig, CachingAllocator
from .calibration import Calibration
from .kinds import Kind
from .result import MemLevel, Overhead
from .spec import GpuSpec, ModelSpec, Optimizer, TrainingSetup
from .units import MiB

T = TypeVar("T", int, np.ndarray)

# CUDA context with torch 2.x and lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since
# CUDA 11.7 / torch 1.13), as nvidia-smi shows it after the first kernels of a training step.
CONTEXT_BY_ARCH = {
    "volta": 310 * MiB, "turing": 300 * MiB, "ampere": 420 * MiB, "ada": 400 * MiB,
    "hopper": 520 * MiB, "blackwell": 560 * MiB, "cdna2": 350 * MiB, "cdna3": 400 * MiB,
}
DEFAULT_CONTEXT = 420 * MiB
# torch's default cuBLAS workspace: 4096 KiB x 2 + 16 KiB x 8 before Hopper, 32 MiB on Hopper and later
# (see CUBLAS_WORKSPACE_CONFIG); cuBLASLt adds its own 1 MiB workspace.
CUBLAS_BY_ARCH = {"hopper": 33 * MiB, "blackwell": 33 * MiB}
DEFAULT_CUBLAS = 9 * MiB
NCCL_BUFFERS = 2 * 4 * MiB * 2 + 64 * MiB  # ring buffers per peer pair plus communicator state (rough)

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


def cublas_bytes(gpu: GpuSpec | None) -> int:
    if gpu is None:
        return DEFAULT_CUBLAS
    return CUBLAS_BY_ARCH.get(gpu.arch, DEFAULT_CUBLAS)


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
) -> tuple[int, int, tuple[Overhead, ...]]:
    """(reserved, device used, overheads) for a tensor peak with this breakdown. With the step's
    ``allocations`` (or the reserved level they replay to, ``replayed_reserved``) the reserved level comes
    from replaying them through the caching-allocator model; otherwise from a share of the churned bytes.
    ``replay_skipped``: the number of allocations a replay would have taken, when it was not done."""
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
    overheads = [Overhead("Allocator cache & fragmentation", frag, MemLevel.RESERVED, why)]
    ctx = calibration.context_bytes if calibration is not None else context_bytes(gpu)
    cublas = cublas_bytes(gpu)
    ctx_why = (f"Measured by a profile ({calibration.label})." if calibration is not None else
               f"Driver and lazily loaded kernels of torch/cuBLAS/cuDNN "
               f"({gpu.arch if gpu and gpu.arch else 'typical'} GPU, torch 2.x).")
    overheads.append(Overhead("CUDA context", ctx, MemLevel.DEVICE, ctx_why))
    overheads.append(Overhead("cuBLAS workspace", cublas, MemLevel.DEVICE,
                              "Workspace torch gives cuBLAS / cuBLASLt per stream."))
    device = reserved + ctx + cublas
    if setup.gpus > 1:
        overheads.append(Overhead("NCCL buffers", NCCL_BUFFERS, MemLevel.DEVICE,
                                  "Communicator ring buffers and state for collectives across GPUs."))
        device += NCCL_BUFFERS
    if managed_bytes or setup.optimizer is Optimizer.PAGED_ADAMW_8BIT:
        overheads.append(Overhead("Paged optimizer states (managed)", managed_bytes, MemLevel.DEVICE,
                                  "bitsandbytes pages large optimizer states in CUDA managed memory: not "
                                  "in torch's counters, resident on the GPU unless memory runs short."))
        device += managed_bytes
    return reserved, device, tuple(overheads)
