"""Unsloth's fused loss (``fused_loss`` in ``TrainingSetup.unsloth_kernels``): the loss FastLanguageModel's own
forward computes in training, read from unsloth 2026.10.9 and unsloth_zoo 2026.10.9's source.

``CausalLM_fast_forward`` (``unsloth/models/llama.py``; Mistral's own forward in ``mistral.py`` alike) never makes the
logits when labels are given and ``UNSLOTH_RETURN_LOGITS`` is not "1": it calls ``unsloth_fused_ce_loss``
(``unsloth_zoo/fused_losses/cross_entropy_loss.py``), which, with none of the ``UNSLOTH_CE_LOSS_*`` /
``UNSLOTH_CHUNKED_CE`` / ``UNSLOTH_FUSED_LINEAR`` variables set, goes to ``unsloth_chunked_ce_loss``
(``chunked_logprob.py``: the labels shifted by a ``cat`` with one -100 per row, the divisor the labelled count) and
on to ``fused_linear_cross_entropy`` (``fused_linear.py``), the custom op ``unsloth_zoo::fused_linear_ce_v2``
(``_ce_impl``). Its gradient is taken in forward: the hidden states' (``zeros``, their dtype) and a trainable
head's (``zeros``, the head's dtype) are made during the loss and saved for backward, which scales them by the
incoming gradient into new tensors (``fused_linear_scale_rows``). The rows it scores are the labelled ones
(``nonzero``: every token but each row's last, as the step models them), one chunk of rows at a time, by one of
two paths that depend on the GPU:

* the **tiled ("flash") forward** (``_tiled_forward``), with a frozen head only, on compute capability 8.0 or
  later, a vocabulary of more than two 16,384-column splits, and either a GPU of at most 24.5 GiB (every batch) or
  at least 4,096 labelled rows: a (rows x vocabulary tile) fp32 buffer, an fp32 (rows x hidden) accumulator, the
  statistics of one row chunk; the logits never exist whole even for one chunk;
* the **chunked forward**: one (rows x vocabulary) fp32 logits buffer (compute capability 8.0 or later: an fp32-out
  GEMM) the Triton kernel overwrites with the logits' gradient, then per chunk an fp32 product into the hidden
  states' gradient, copied in.

The chunk's rows (``fused_linear_rows``): a power of two at or below rows x hidden / vocabulary, at least 512 rows
(more for a small vocabulary), at most 4,096, and at most what a chunk budget holds: ``_budget_bytes``, half the
free memory that ``torch.cuda.mem_get_info`` reports when the loss first runs, capped at 2 GiB (read once per
device). What the GPU decides enters as :class:`UnslothDevice`, from the setup's GPU (``TrainingSetup.unsloth_gpu``,
part of the estimate's key); with no GPU named, the H100 SXM 80GB, and with no free memory named, at least 4 GiB
free (the cap), which holds wherever the run leaves 4 GiB of the GPU unused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError, short_repr

GIB = 1024**3
# unsloth_zoo 2026.10.9 fused_losses/fused_linear.py, its defaults (no UNSLOTH_* variable set)
CHUNK_GB = 2.0  # _CHUNK_GB: the chunk budget's cap
MIN_LOGITS = 512 * 151936  # _MIN_LOGITS: "fewer than 512 rows starve the K = vocab GEMM"
MAX_ROWS = 4096  # _MAX_ROWS
SPLIT_COLS = 16384  # _SPLIT_COLS: the Triton kernels' vocabulary split
BWD_ROWS = 4096  # _BWD_ROWS (CUDA)
BWD_TILE_BYTES = 256 * 1024**2  # _BWD_TILE_BYTES (CUDA)
SMALL_CARD_BYTES = 24.5 * GIB  # _SMALL_CARD_BYTES: at or below it the tiled forward runs for every batch
FLASH_MIN_ROWS = 4096  # _flash_min_rows_auto on a larger card
# the H100 SXM 80GB (resources/gpus.json): the GPU modelled when none is named
DEFAULT_GPU = (9, 0, 85520809984, 0)


@dataclass(frozen=True)
class UnslothDevice:
    """What unsloth_zoo's loss asks of the GPU: its compute capability (``get_device_capability``), its memory
    (``get_device_properties(...).total_memory``) and the free memory when the loss first runs (``mem_get_info``;
    0: unknown, taken as at least 4 GiB)."""

    major: int
    minor: int
    total_bytes: int
    free_bytes: int = 0

    @classmethod
    def of(cls, value: Sequence[int]) -> UnslothDevice:
        return cls(*(value or DEFAULT_GPU))

    def budget_bytes(self) -> int:
        """``_budget_bytes``: ``min(2, free / GiB * 0.5)`` GiB (``_default_target_gb``), at least a byte."""
        gb = min(CHUNK_GB, self.free_bytes / GIB * 0.5) if self.free_bytes else CHUNK_GB
        return max(int(gb * GIB), 1)

    def fp32_logits(self, half: bool, bf16: bool) -> bool:
        """``_logits_mode``: fp32 logits from an fp32-out GEMM for half compute, where the GPU runs one (bf16 on
        compute capability 8.0 or later)."""
        return half and (not bf16 or self.major >= 8)

    def flash_min_rows(self) -> int:
        return 0 if self.total_bytes <= SMALL_CARD_BYTES else FLASH_MIN_ROWS


def parse_unsloth_gpu(value: Any) -> tuple[int, ...]:
    """``TrainingSetup.unsloth_gpu`` as a setup holds it: () or (major, minor, total bytes, free bytes or 0)."""
    if value in (None, "", (), []):
        return ()
    ok = (isinstance(value, (list, tuple)) and len(value) == 4
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value))
    if not ok or value[2] <= 0 or value[3] > value[2]:
        raise SetupError(f"Unsloth's GPU must be (capability major, minor, total bytes, free bytes or 0) (got "
                         f"{short_repr(value)})")
    return tuple(value)


def unsloth_gpu_of(gpu: Any, free_bytes: int = 0) -> tuple[int, ...]:
    """The setup's ``unsloth_gpu`` for a :class:`~vramlab.core.spec.gpu.GpuSpec` (its compute capability and
    memory; the H100's capability where the catalogue has none, as for an AMD GPU; None: the H100)."""
    if gpu is None:
        return (*DEFAULT_GPU[:3], min(int(free_bytes), DEFAULT_GPU[2]))
    major, minor = gpu.capability() or DEFAULT_GPU[:2]
    total = int(gpu.memory_bytes)
    return major, minor, total, min(int(free_bytes), total)


def unsloth_gpu_free(gpu: Any, free_gib: Any) -> tuple[int, ...]:
    """The setup's ``unsloth_gpu`` for ``gpu`` (None: the H100) with ``free_gib`` GiB free when the loss first
    runs; a value that is not a size in (0, the GPU's memory] is refused in one line."""
    total = gpu.memory_bytes if gpu is not None else DEFAULT_GPU[2]
    ok = isinstance(free_gib, (int, float)) and not isinstance(free_gib, bool) and 0 < free_gib * GIB <= total
    if not ok:
        raise SetupError(f"Unsloth's free memory must be a size in GiB above 0 and at most the GPU's "
                         f"{total / GIB:.2f} GiB (got {short_repr(free_gib)})")
    return unsloth_gpu_of(gpu, max(int(free_gib * GIB), 1))


def unsloth_gpu_on(value: Sequence[int], gpu: Any) -> tuple[int, ...]:
    """The setup's ``unsloth_gpu`` once ``gpu`` (None: the H100) is chosen instead: the free memory given kept, at
    most the GPU's memory, the capability and memory ``gpu``'s; () where no free memory was given (the estimate
    reads the GPU chosen, :func:`with_gpu`)."""
    free = value[3] if len(value or ()) == 4 else 0
    return unsloth_gpu_of(gpu, free) if free else ()


def _pow2(x: float) -> int:
    """``_pow2``: the power of two at or above ``x`` (at least 1)."""
    return 1 << max(math.ceil(math.log2(max(x, 1))), 0)


def fused_linear_rows(n_rows: int, hidden: int, vocab: int, bytes_per_logit: int, budget: int) -> int:
    """``fused_linear_rows``: a power of two at or below ``n_rows * hidden / vocab``, clamped to
    [max(512, ~_MIN_LOGITS / vocab), 4096], at most what ``budget`` holds of logits, at most ``n_rows``."""
    ratio = n_rows * hidden / max(vocab, 1)
    rows = _pow2(ratio)
    if rows > ratio:
        rows //= 2
    least = MIN_LOGITS / max(vocab, 1)
    min_rows = _pow2(least)
    if min_rows > least:
        min_rows //= 2
    min_rows = min(max(min_rows, 512), MAX_ROWS)
    rows = min(max(rows, min_rows), MAX_ROWS)
    cap = budget // max(vocab * bytes_per_logit, 1)
    rows = min(rows, max(cap, 2))
    return max(min(rows, max(n_rows, 1)), 1)


def tiled_vocab(vocab: int) -> bool:
    """``_tiled_vocab``: more than two 16,384-column splits."""
    return -(-vocab // SPLIT_COLS) > 2


@dataclass(frozen=True)
class LossPlan:
    """The path ``_ce_impl`` takes and its sizes."""

    flash: bool  # the tiled forward
    rows: int  # rows per chunk
    cols: int  # the logits buffer's columns (the vocabulary, or a vocabulary tile), padded to a multiple of 8
    splits: int  # the Triton kernels' vocabulary splits (partial statistics per row)
    fp32_logits: bool


def loss_plan(n_keep: int, hidden: int, vocab: int, compute: str, head_trains: bool, dev: UnslothDevice) -> LossPlan:
    """What ``_ce_impl`` runs for ``n_keep`` labelled rows in ``compute`` ("bf16", "f16", "f32") on ``dev``."""
    half = compute in ("bf16", "f16")
    fp32 = dev.fp32_logits(half, compute == "bf16")
    bpl = 4 if fp32 or not half else 2
    budget = dev.budget_bytes()
    rows = min(fused_linear_rows(n_keep, hidden, vocab, bpl, budget), n_keep)
    splits = -(-vocab // SPLIT_COLS)
    flash = (fp32 and half and n_keep >= dev.flash_min_rows() and not head_trains and tiled_vocab(vocab)
             and dev.major >= 8)
    if not flash:
        return LossPlan(False, rows, -(-vocab // 8) * 8, splits if splits > 2 else 1, fp32)
    # _tiled_layout(n_keep, V, 0, 4, device)
    tile_budget = min(BWD_TILE_BYTES, budget)
    rows = max(min(BWD_ROWS, n_keep, tile_budget // (SPLIT_COLS * 4)), 1)
    tile = max(tile_budget // max(rows * 4, 1), SPLIT_COLS)
    if dev.flash_min_rows() == 0:  # _FWD_TILE_COLS: 16384 on a small card
        tile = min(tile, SPLIT_COLS)
    tile = min(tile - tile % SPLIT_COLS, splits * SPLIT_COLS)
    return LossPlan(True, rows, -(-tile // 8) * 8, splits, True)


def validate_fused_loss(setup: Any) -> None:
    """What unsloth_zoo runs that is not modelled: bf16 where the GPU has no fp32-out GEMM for it (compute capability
    below 8.0: its fallback products) and a GPU without Triton's code generation (below 7.0: its torch bodies)."""
    dev = UnslothDevice.of(setup.unsloth_gpu)
    if dev.major < 8 and setup.compute.value == "bf16":
        raise SetupError(f"Unsloth's fused loss in bf16 on compute capability {dev.major}.{dev.minor}: torch's "
                         "fp32-out GEMM it uses raises there (bf16 needs 8.0), and its fallback products are not "
                         "modelled: train in fp16 (--compute fp16) as Unsloth does on such a GPU")
    if dev.major < 7:
        raise SetupError(f"Unsloth's fused loss on compute capability {dev.major}.{dev.minor} runs its torch bodies "
                         "(no Triton there), which are not modelled: add cross_entropy to --unsloth-kernels in "
                         "fused_loss's place (UNSLOTH_RETURN_LOGITS=1)")


def fused_loss_runs(setup: Any) -> bool:
    """Whether the setup asks for Unsloth's fused loss where FastLanguageModel's forward computes it: SFT (TRL's
    other trainers compute their own loss from the logits)."""
    return "fused_loss" in setup.unsloth_kernels and setup.objective.value == "sft"


def with_gpu(setup: Any, gpu: Any) -> Any:
    """``setup`` with its ``unsloth_gpu`` read from ``gpu`` (a GpuSpec) where Unsloth's fused loss runs and none
    was given: what the estimate and the simulation do before they look a tape up (it is part of the key)."""
    if not fused_loss_runs(setup) or gpu is None:
        return setup
    if str(getattr(gpu, "vendor", "nvidia")).lower() != "nvidia":
        raise SetupError(f"Unsloth's fused loss on {gpu.name} (ROCm) takes other paths (no tiled pass, no fp32-out "
                         "GEMM, smaller tiles), which are not modelled: add cross_entropy to --unsloth-kernels in "
                         "fused_loss's place (UNSLOTH_RETURN_LOGITS=1)")
    return setup if setup.unsloth_gpu else setup.replace(unsloth_gpu=unsloth_gpu_of(gpu))


def headroom_note(setup: Any, gpu: Any, device_used: int) -> str | None:
    """A warning where Unsloth's fused loss sizes its chunks from a free memory the estimate did not know: the run
    leaves under 4 GiB of ``gpu`` unused at its peak (``device_used``), so ``mem_get_info`` may report less than
    twice the 2 GiB cap when the loss first runs, and its chunks be smaller than modelled."""
    if gpu is None or not fused_loss_runs(setup) or UnslothDevice.of(setup.unsloth_gpu).free_bytes:
        return None
    if gpu.memory_bytes - device_used >= 2 * CHUNK_GB * GIB:
        return None
    return ("Unsloth's fused loss sizes its chunks from half the GPU's free memory when it first runs (capped at "
            "2 GiB); this run leaves under 4 GiB free, so its chunks may be smaller than the estimate's (an upper "
            "bound here): give it with --unsloth-free-memory (the setup's unsloth_gpu) to model it")


def gpu_note(setup: Any) -> str | None:
    """What the estimate took of the GPU for Unsloth's fused loss (the setup as :func:`with_gpu` filled it)."""
    if not fused_loss_runs(setup):
        return None
    dev = UnslothDevice.of(setup.unsloth_gpu)
    which = "" if setup.unsloth_gpu else " (the H100 SXM 80GB: no GPU named)"
    free = (f"{dev.free_bytes / GIB:.2f} GiB free" if dev.free_bytes else
            "at least 4 GiB free (its 2 GiB chunk cap)")
    return (f"Unsloth's fused loss sized for compute capability {dev.major}.{dev.minor} and "
            f"{dev.total_bytes / GIB:.2f} GiB{which}, {free} when it first runs")
