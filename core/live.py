"""A live profile run without Qt: the frozen records that cross threads (:class:`RunRequest`, :class:`PhaseMark`,
:class:`AllocatorReading`, :class:`LiveSample`, :class:`GpuProbe`), and the numbers behind the live view,
kept apart from drawing (ARCHITECTURE.md): a ring buffer of readings, phase bands, predicted-versus-measured rows,
the verdict, the message for each way a run can end, and the JSON document a result is saved as. The only
arithmetic is measured minus predicted. Times are seconds since the run started (``time.monotonic``);
memory is in bytes.

Levels, as everywhere in VRAM Lab: *tensors* (``max_memory_allocated``), *reserved* (the caching
allocator, ``max_memory_reserved``) and *device* (NVML, ``nvidia-smi``). On the CPU there is no caching
allocator and no device level: the tracker's tensor numbers are compared with the estimate in
simulation mode (what a tracked run measures), and the process's resident memory is shown for what it is.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

import numpy as np

from vramlab.core.kinds import KIND_ORDER
from vramlab.core.profiling.outcomes import OutcomeKind, ProfileOutcome
from vramlab.core.report import phase_label
from vramlab.core.result import MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import GiB, Unit, fmt_bytes

SAMPLE_INTERVAL_S = 0.05  # 20 Hz: how often the window reads NVML and the child process
DEFAULT_TIMEOUT_S = 1800.0


# ---- what crosses threads ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunRequest:
    """One profile run: what runs where, and the estimate it is compared with (fixed at start)."""

    spec: ModelSpec
    setup: TrainingSetup
    device: str  # 'cuda' | 'cpu'
    gpu: GpuSpec | None  # the GPU the run uses (for the estimate and the fit verdict); None on the CPU
    predicted: MemoryResult | None
    steps: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S
    fault: str | None = None  # core.profiling.child fault scenarios: oom | crash | hang | slow
    tracked: bool = False  # CUDA: also run the tensor tracker (split by kind; slower)
    nvml_index: int | None = None  # NVML index of CUDA device 0 when the run started (shown; the watch maps it)

    @property
    def phase_count(self) -> int:
        """Phase events a complete run emits after 'load': forward/backward per micro-batch (at most two,
        see core.simulation.step) and one optimizer step, per step; plus 'end'."""
        micro = min(self.setup.grad_accum, 2)
        return self.steps * (2 * micro + 1) + 1


@dataclass(frozen=True)
class RunStarted:
    pid: int
    t_s: float


@dataclass(frozen=True)
class PhaseMark:
    """A phase boundary reported by the child: the phase entered, the allocator's readings at that moment
    and the peaks of the phase that just ended (tensor level and allocator-reserved level)."""

    t_s: float
    key: str  # 'load', 'forward@1', ..., 'end'
    allocated_bytes: int
    reserved_bytes: int
    ended: str | None = None
    ended_peak_allocated_bytes: int | None = None
    ended_peak_reserved_bytes: int | None = None
    rank: int | None = None  # a sharded run under torchrun: the rank (one process per GPU) that reported it

    @classmethod
    def from_event(cls, event: dict[str, Any], t_s: float) -> PhaseMark:
        def opt(name: str) -> int | None:
            v = event.get(name)
            return int(v) if v is not None else None

        return cls(t_s, str(event.get("key", "?")), int(event.get("allocated") or 0),
                   int(event.get("reserved") or 0), event.get("ended"), opt("ended_peak_allocated"),
                   opt("ended_peak_reserved"), opt("rank"))

    @property
    def leads(self) -> bool:
        """Whether this mark drives the plot's phase bands and the progress bar: a single-process run's
        marks, or rank 0's of a sharded run (the other ranks run the same phases at about the same time)."""
        return self.rank is None or self.rank == 0


@dataclass(frozen=True, slots=True)
class AllocatorReading:
    """The child's allocator between phase boundaries (10 Hz): ``torch.cuda.memory_allocated`` /
    ``memory_reserved`` on CUDA, the tracker's live bytes (both) on the CPU."""

    t_s: float
    allocated_bytes: int
    reserved_bytes: int
    rank: int | None = None

    @classmethod
    def from_event(cls, event: dict[str, Any], t_s: float) -> AllocatorReading:
        rank = event.get("rank")
        return cls(t_s, int(event.get("allocated") or 0), int(event.get("reserved") or 0),
                   int(rank) if rank is not None else None)

    @property
    def leads(self) -> bool:
        return self.rank is None or self.rank == 0


@dataclass(frozen=True, slots=True)
class LiveSample:
    """One reading of the sampler thread. None: not available (no GPU, field not supported, process gone).

    GPU fields are NVML's for the GPU the run uses: ``device_used_bytes`` is the whole device as
    ``nvidia-smi`` shows it (every process), ``process_used_bytes`` this run's child alone. Host fields are
    psutil's for the child process: ``rss_bytes`` (resident memory) and ``cpu_pct`` (share of the whole
    machine, 0-100)."""

    t_s: float
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    process_used_bytes: int | None = None
    util_pct: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    rss_bytes: int | None = None
    cpu_pct: float | None = None
    gpu_lost: bool = False
    missing: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class GpuProbe:
    """What the GPU sampler says about this machine, read once (NVML init is not free)."""

    available: bool
    reason: str  # why not, when not available (NVML init failure)
    name: str | None = None
    memory_total_bytes: int | None = None
    nvml_index: int | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    count: int = 0
    compute_capability: tuple[int, int] | None = None
    order_certain: bool = True  # False: CUDA's fastest-first order on mixed GPUs; cuda:0 is NVML's first guess


def predicted_for(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None) -> MemoryResult:
    """The estimate a run on ``device`` is compared with: on CUDA the estimate on that GPU (every level); on
    the CPU the estimate in simulation mode, which is what the tracker measures there (no caching allocator,
    no device level)."""
    from vramlab.core.estimate import estimate

    if device == "cuda":
        return estimate(spec, setup, gpu)
    return estimate(spec, setup, None, match_simulation=True)


# ---- the numbers behind the view --------------------------------------------------------------------------

AGREEMENT_TOLERANCE = 0.03  # |measured - predicted| / measured at the tensor level that counts as agreement
DOCUMENT_FORMAT = "vramlab-profile/1"
MAX_SAVED_POINTS = 5000


def display_unit(max_bytes: float, unit: Unit) -> Unit:
    """The unit numbers of a run are shown in: the app's unit, or MiB (for GiB) when every number is below
    1 GiB (a tiny model). Headers, axis labels and texts always name the unit they use."""
    if unit is Unit.GIB and max_bytes < GiB:
        return Unit.MIB
    return unit


# ---- the ring buffer -------------------------------------------------------------------------------------------

SERIES = ("t_s", "device_used_bytes", "device_total_bytes", "process_used_bytes", "util_pct", "power_w",
          "rss_bytes", "cpu_pct")


class RingBuffer:
    """The last ``capacity`` samples as float64 columns (NaN where a value was not available).

    Preallocated: appending never allocates, so a long run has a flat memory profile. ``column(name)``
    returns the samples in time order (a view when the buffer has not wrapped, else a copy)."""

    def __init__(self, capacity: int = 72_000, names: Sequence[str] = SERIES) -> None:  # 1 h at 20 Hz
        self.names = tuple(names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._data = np.full((capacity, len(self.names)), np.nan)
        self._capacity = capacity
        self._next = 0
        self._count = 0
        self._appended = 0
        self._max = np.full(len(self.names), np.nan)  # per column, of every sample since clear()

    def __len__(self) -> int:
        return self._count

    @property
    def appended(self) -> int:
        """Samples appended since :meth:`clear` (more than ``len`` once the oldest were overwritten)."""
        return self._appended

    @property
    def capacity(self) -> int:
        return self._capacity

    def clear(self) -> None:
        self._next = 0
        self._count = 0
        self._appended = 0
        self._max[:] = np.nan

    def append(self, sample: LiveSample) -> None:
        row = self._data[self._next]
        row[:] = [np.nan if (v := getattr(sample, name)) is None else v for name in self.names]
        np.fmax(self._max, row, out=self._max)
        self._next = (self._next + 1) % self._capacity
        self._count = min(self._count + 1, self._capacity)
        self._appended += 1

    def column(self, name: str) -> np.ndarray:
        i = self._index[name]
        if self._count < self._capacity:
            return self._data[: self._count, i]
        return np.concatenate((self._data[self._next:, i], self._data[: self._next, i]))

    def last(self, name: str) -> float | None:
        if not self._count:
            return None
        v = self._data[(self._next - 1) % self._capacity, self._index[name]]
        return None if np.isnan(v) else float(v)

    def tail(self, name: str, n: int) -> np.ndarray:
        """The newest ``n`` samples of a column in time order (fewer when the buffer holds fewer)."""
        n = max(0, min(n, self._count))
        i = self._index[name]
        rows = (np.arange(self._next - n, self._next) % self._capacity) if n else np.empty(0, dtype=int)
        return self._data[rows, i]

    def max(self, name: str) -> float | None:
        """The highest reading of a column (NaN skipped): kept as samples arrive, so it costs nothing until the
        buffer has wrapped (then the samples still held are searched)."""
        if self._appended > self._capacity:
            col = self.column(name)
            v = np.nanmax(col) if col.size and not np.all(np.isnan(col)) else np.nan
        else:
            v = self._max[self._index[name]]
        return None if np.isnan(v) else float(v)


# ---- when the view draws -----------------------------------------------------------------------------------------

CALM_FRAME_S = 1.0  # while a run is on, the plots are redrawn at least this often (htop: 1.5 s; nvitop: 2 s)
MOVE_PX = 1.0  # a memory reading this many pixels from where the last frame drew its curve is drawn at once


class FramePacer:
    """When the live view draws a frame. Every reading goes into the ring buffer as it arrives and is shown to
    :meth:`observe`; the view asks :meth:`due` at each tick of its 20 Hz timer and draws only when something
    on screen would move:

    * ``"event"``: a phase boundary arrived, the unit changed, the run ended (the caller says ``forced``);
    * ``"peak"``: a memory reading since the last frame (NVML, psutil, the allocator) lies ``move_px`` or more
      pixels from the value the last frame drew for that curve, or above the plot's top (a new peak);
    * ``"calm"``: ``calm_s`` passed since the last frame: the curves grow to the right by a few pixels, the
      activity plot (utilisation, CPU, power: noisy by nature) follows at this rate.

    So a memory change is on screen within one tick (50 ms) and nothing lags more than ``calm_s``. Deciding
    costs a comparison per reading; a frame costs the same as before, there are just fewer of them while
    nothing moves. Pure arithmetic, no Qt."""

    def __init__(self, calm_s: float = CALM_FRAME_S, move_px: float = MOVE_PX) -> None:
        self.calm_s = calm_s
        self.move_px = move_px
        self.reset()

    def reset(self) -> None:
        self._last_t: float | None = None
        self._drawn: dict[str, float] = {}
        self._step = 0.0
        self._top = float("inf")
        self._moved = False
        self.reasons: dict[str, int] = {"event": 0, "peak": 0, "calm": 0}

    def set_scale(self, bytes_per_px: float, top_bytes: float) -> None:
        """The memory plot's scale and top as the last frame drew them."""
        self._step = self.move_px * max(0.0, bytes_per_px)
        self._top = top_bytes

    def observe(self, key: str, value: float | None) -> None:
        """A memory reading (bytes; None: not available) of curve ``key`` arrived."""
        if value is None or self._moved or math.isnan(value):
            return
        ref = self._drawn.get(key)
        if ref is None or value > self._top or abs(value - ref) >= self._step:
            self._moved = True

    def due(self, t: float, forced: bool = False) -> str | None:
        """Why a frame is due at monotonic time ``t`` (None: not yet)."""
        if forced or self._last_t is None:
            return "event"
        if self._moved:
            return "peak"
        if t - self._last_t >= self.calm_s:
            return "calm"
        return None

    def drawn(self, t: float, reason: str | None, latest: dict[str, float | None]) -> None:
        """A frame was drawn at ``t`` (for ``reason``) showing ``latest``, the newest value of each memory
        curve."""
        self._last_t = t
        self._moved = False
        if reason in self.reasons:
            self.reasons[reason] += 1
        self._drawn = {k: float(v) for k, v in latest.items() if v is not None and not math.isnan(v)}


# ---- phase bands -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Band:
    """One phase of the run on the time axis, with its predicted and (once it ended) measured peak."""

    key: str  # 'start' (child starting: importing torch), 'load', 'forward@1', ...
    t0_s: float
    t1_s: float
    predicted_bytes: int | None  # the estimate's peak for this phase (tensor level)
    measured_bytes: int | None  # the run's peak for this phase (tensor level); None while it runs
    done: bool

    @property
    def label(self) -> str:
        return band_label(self.key)


# the phases' short labels in the plot's bands
_ABBREV = {"load": "load", "forward": "fwd", "backward": "bwd",
           "optimizer": "opt"}  # the optimizer step, not a model type


def band_label(key: str, short: bool = True) -> str:
    if key == "start":
        return "start-up" if short else "Start-up (importing torch)"
    if key == "end":
        return "end"
    if not short:
        return phase_label(key)
    name, _, step = key.partition("@")
    abbrev = _ABBREV.get(name, name)
    return f"{abbrev} {step}" if step else abbrev


def bands(marks: Sequence[PhaseMark], now_s: float, predicted: MemoryResult | None,
          started_s: float | None = None) -> list[Band]:
    """Bands from the phase boundaries; the last one (still running) reaches ``now_s``. A repeated key (a
    second micro-batch) gets its own band with the phase's peak."""
    pred = {p.key: p.bytes for p in predicted.phases} if predicted is not None else {}
    measured: dict[str, int] = {}
    for m in marks:
        if m.ended and m.ended_peak_allocated_bytes is not None:
            measured[m.ended] = m.ended_peak_allocated_bytes
    out: list[Band] = []
    first = marks[0].t_s if marks else now_s
    if started_s is not None and first > started_s:
        out.append(Band("start", started_s, first, None, None, bool(marks)))
    for i, m in enumerate(marks):
        if m.key == "end":
            break
        end = marks[i + 1].t_s if i + 1 < len(marks) else now_s
        done = i + 1 < len(marks)
        out.append(Band(m.key, m.t_s, max(end, m.t_s), pred.get(m.key), measured.get(m.key) if done else None, done))
    return out


def phases_done(marks: Sequence[PhaseMark]) -> int:
    """Completed phases: every boundary after the first one closes a phase ('end' closes the last)."""
    return max(0, len(marks) - 1) if marks else 0


# ---- predicted versus measured -----------------------------------------------------------------------------------

LEVELS = "Levels"
KINDS = "Kinds at the peak (tensor level)"
PHASES = "Phase peaks (tensor level)"
OVERHEADS = "Overheads (device level)"
MEASURED_ONLY = "Measured only"
SECTIONS = (LEVELS, KINDS, PHASES, OVERHEADS, MEASURED_ONLY)


@dataclass(frozen=True)
class ComparisonRow:
    section: str  # one of SECTIONS
    label: str
    level: str  # which memory: 'tensors', 'reserved', 'device', 'host'
    predicted_bytes: int | None
    measured_bytes: int | None
    note: str = ""

    @property
    def residual_bytes(self) -> int | None:
        if self.predicted_bytes is None or self.measured_bytes is None:
            return None
        return self.measured_bytes - self.predicted_bytes

    @property
    def residual_fraction(self) -> float | None:
        """(measured - predicted) / measured."""
        r = self.residual_bytes
        if r is None or not self.measured_bytes:
            return None
        return r / self.measured_bytes


def prediction_note(device: str) -> str:
    if device == "cpu":
        return ("Predicted: the estimate in simulation mode, which models what a CPU run under the tensor "
                "tracker measures (no caching allocator, no CUDA context).")
    return "Predicted: the estimate for this GPU (calibrated if a calibration was saved for it)."


def rank_lines(outcome: ProfileOutcome, unit: Unit) -> list[str]:
    """How a sharded setup ran: one process per GPU under torchrun (each rank's own tensor peak, and which
    rank the table shows), or rank 0 emulated in one process (and why). Empty for a one-GPU setup."""
    ranks = getattr(outcome, "ranks", None)  # core.profiling.outcomes.DistributedOutcome
    if ranks:
        peaks = [(i, o.result.peak_allocated_bytes) for i, o in enumerate(ranks) if o.result is not None]
        backend = getattr(outcome, "backend", "") or "torch.distributed"
        line = f"{len(ranks)} ranks under torchrun ({escape(backend)}, FSDP2), one process per GPU"
        if peaks:
            top = max(peaks, key=lambda p: p[1])[0]
            per = ", ".join(f"rank {i} {fmt_bytes(b, unit)}" for i, b in peaks)
            line += f"; tensor peak per GPU: {per}. The table shows rank {top}, the highest"
        failed = getattr(outcome, "failed_rank", None)
        if failed is not None:
            line += f"; the failure started on rank {failed}"
        return [line + "."]
    why = (outcome.info or {}).get("emulated_rank0")
    if why:
        return [f"Sharded setup measured as rank 0 emulated in one process (not under torchrun: {escape(str(why))})."]
    return []


def comparison_rows(outcome: ProfileOutcome, predicted: MemoryResult | None) -> list[ComparisonRow]:
    """Rows of the result table: the three levels, the kinds at the peak, the phase peaks, and what only
    the measurement has (whole-device NVML peak, host RSS, the CUDA context)."""
    r = outcome.result
    if r is None:
        return []
    p = predicted
    cpu = outcome.device != "cuda"
    rows: list[ComparisonRow] = [
        ComparisonRow(LEVELS, "Tensor peak (max_memory_allocated)", "tensors",
                      p.peak_allocated_bytes if p else None, r.peak_allocated_bytes,
                      "CPU: the tensor tracker's peak" if cpu else "torch.cuda.max_memory_allocated"),
    ]
    if cpu:
        rows.append(ComparisonRow(LEVELS, "Allocator reserved (max_memory_reserved)", "reserved", None, None,
                                  "Not measured on the CPU: there is no caching allocator."))
        rows.append(ComparisonRow(LEVELS, "Device used (nvidia-smi)", "device", None, None,
                                  "Not measured on the CPU: no GPU; see the process RSS below."))
    else:
        rows.append(ComparisonRow(LEVELS, "Allocator reserved (max_memory_reserved)", "reserved",
                                  p.peak_reserved_bytes if p else None, r.peak_reserved_bytes,
                                  "torch.cuda.max_memory_reserved"))
        rows.append(ComparisonRow(LEVELS, "Device used (nvidia-smi)", "device",
                                  p.device_used_bytes if p else None, outcome.process_used_peak_bytes,
                                  "NVML: this run's process at its peak (context, allocator, workspaces)"
                                  if outcome.process_used_peak_bytes is not None
                                  else "NVML did not report per-process memory on this GPU/driver"))
    if r.components and any(r.components.values()):
        kinds = [k for k in KIND_ORDER if r.components.get(k) or (p and p.components.get(k))]
        for k in kinds:
            rows.append(ComparisonRow(KINDS, k.label, "tensors",
                                      p.components.get(k, 0) if p else None, r.components.get(k, 0)))
    elif p is not None:
        for k, v in p.ordered_components():
            rows.append(ComparisonRow(KINDS, k.label, "tensors", v, None,
                                      "Measured split by kind needs the tensor tracker ('Split by kind')."))
    measured_phases = {ph.key: ph.bytes for ph in r.phases}
    predicted_phases = {ph.key: ph.bytes for ph in p.phases} if p else {}
    for key in list(dict.fromkeys([*predicted_phases, *measured_phases])):
        rows.append(ComparisonRow(PHASES, phase_label(key), "tensors", predicted_phases.get(key),
                                  measured_phases.get(key)))
    if not cpu:
        ctx_pred = next((o.bytes for o in p.overheads if o.name == "CUDA context"), None) if p else None
        rows.append(ComparisonRow(OVERHEADS, "CUDA context", "device", ctx_pred, outcome.context_bytes,
                                  "NVML: the child's memory before its first phase"))
        if outcome.device_used_peak_bytes is not None:
            rows.append(ComparisonRow(MEASURED_ONLY, "Whole GPU at its peak (device level, all processes)", "device",
                                      None, outcome.device_used_peak_bytes, "NVML memory used, every process"))
    rss = next((o.bytes for o in r.overheads if o.name.startswith("Process resident")), None)
    if rss is not None:
        rows.append(ComparisonRow(MEASURED_ONLY, "Process RSS peak (host memory)", "host", None, rss,
                                  "getrusage max RSS of the child: torch itself, the model and the tensors"))
    return rows


def rows_unit(rows: Sequence[ComparisonRow], unit: Unit) -> Unit:
    """The display unit for a table of rows (see :func:`display_unit`); host RSS does not decide it."""
    sizes = [abs(v) for r in rows if r.level != "host" for v in (r.predicted_bytes, r.measured_bytes) if v]
    return display_unit(max(sizes, default=0), unit)


def rows_table(rows: Iterable[ComparisonRow], unit: Unit, for_csv: bool = False) -> tuple[list[str], list[list[str]]]:
    """Headers and text cells in ``unit`` (CSV: plain numbers in bytes, no separators)."""
    if for_csv:
        headers = ["section", "what", "level", "predicted_bytes", "measured_bytes", "residual_bytes",
                   "residual_pct_of_measured", "note"]
    else:
        headers = ["", f"Predicted [{unit.value}]", f"Measured [{unit.value}]", f"Residual [{unit.value}]",
                   "Residual [%]", "Note"]
    out: list[list[str]] = []
    for row in rows:
        frac = row.residual_fraction
        if for_csv:
            out.append([row.section, row.label, row.level,
                        "" if row.predicted_bytes is None else str(row.predicted_bytes),
                        "" if row.measured_bytes is None else str(row.measured_bytes),
                        "" if row.residual_bytes is None else str(row.residual_bytes),
                        "" if frac is None else f"{frac * 100:.3f}", row.note])
        else:
            def cell(v: int | None, signed: bool = False) -> str:
                if v is None:
                    return "—"
                text = fmt_bytes(v, unit, suffix=False)
                return ("+" + text) if signed and v > 0 else text

            out.append([row.label, cell(row.predicted_bytes), cell(row.measured_bytes),
                        cell(row.residual_bytes, signed=True), "—" if frac is None else f"{frac * 100:+.1f} %",
                        row.note])
    return headers, out


# ---- verdicts and messages -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LiveVerdict:
    state: str  # 'fits' | 'nofit' | 'unknown' (the style sheet's Verdict states)
    text: str
    agreement: float | None = None  # (measured - predicted) / measured at the tensor level


def _where(outcome: ProfileOutcome) -> str:
    if not outcome.failed_phase:
        return ""
    try:
        return f" in {band_label(outcome.failed_phase, short=False).lower()}"
    except ValueError:
        return f" in {outcome.failed_phase}"


def verdict(outcome: ProfileOutcome, predicted: MemoryResult | None, gpu_memory_bytes: int | None,
            unit: Unit) -> LiveVerdict:
    """One line: does the estimate agree with the measurement, and (on a GPU) does the run fit."""
    if not outcome.ok or outcome.result is None:
        kind, text = outcome_message(outcome, unit)
        return LiveVerdict("nofit" if kind == "error" else "unknown", f"✘ {text}" if kind == "error" else text)
    r = outcome.result
    measured = r.peak_allocated_bytes
    unit = display_unit(max(measured, outcome.process_used_peak_bytes or 0), unit)
    frac = (measured - predicted.peak_allocated_bytes) / measured if predicted is not None and measured else None
    if frac is None:
        agree = "No estimate to compare with."
    else:
        word = "agrees with" if abs(frac) <= AGREEMENT_TOLERANCE else "differs from"
        agree = (f"The estimate {word} the measured tensor peak: predicted "
                 f"{fmt_bytes(predicted.peak_allocated_bytes, unit)}, measured {fmt_bytes(measured, unit)} "
                 f"({frac * 100:+.1f} % of measured).")
    if outcome.device != "cuda":
        state = "fits" if frac is not None and abs(frac) <= AGREEMENT_TOLERANCE else "unknown"
        return LiveVerdict(state, ("✔ " if state == "fits" else "") + agree + " (CPU run: tensor level only.)", frac)
    used = outcome.process_used_peak_bytes or outcome.device_used_peak_bytes
    if used is None or not gpu_memory_bytes:
        return LiveVerdict("fits" if frac is not None and abs(frac) <= AGREEMENT_TOLERANCE else "unknown",
                           f"✔ Ran to the end on the GPU. {agree}", frac)
    head = gpu_memory_bytes - used
    what = "this run's device memory (NVML)" if outcome.process_used_peak_bytes else "device memory (NVML, whole GPU)"
    gpu = outcome.info.get("gpu", "the GPU")
    if head >= 0:
        return LiveVerdict("fits", f"✔ Fits {gpu}: {fmt_bytes(used, unit)} {what}, "
                                   f"{fmt_bytes(head, unit)} headroom. {agree}", frac)
    return LiveVerdict("nofit", f"✘ Over {gpu}'s memory: {fmt_bytes(used, unit)} {what}. {agree}", frac)


def outcome_message(outcome: ProfileOutcome, unit: Unit = Unit.GIB, timeout_s: float | None = None) -> tuple[str, str]:
    """(banner kind, text) for how a run ended: 'info' for a result or a cancel, 'error' for a failure."""
    k = outcome.kind
    where = _where(outcome)
    if k is OutcomeKind.OK:
        return "info", "The run finished; the result is below."
    if k is OutcomeKind.OOM:
        mem = (f" with {fmt_bytes(outcome.memory_at_failure, unit)} allocated (tensors)"
               if outcome.memory_at_failure else "")
        device = "the GPU" if outcome.device == "cuda" else "the CPU"
        return "error", (f"Out of memory{where}{mem}: this setup does not fit {device} "
                         f"({outcome.message}). The profiling process ended and its memory was returned.")
    if k is OutcomeKind.CRASHED:
        return "error", (f"The profiling process ended unexpectedly{where} ({outcome.message}). The window and "
                         "the device are unaffected; its memory was returned.")
    if k is OutcomeKind.TIMEOUT:
        limit = f" after {timeout_s:g} s" if timeout_s else ""
        return "error", (f"No result{limit}{where}: the run was ended ({outcome.message}). A large model may need "
                         "a longer timeout.")
    if k is OutcomeKind.CANCELLED:
        return "info", "Cancelled: the profiling process was ended."
    if k is OutcomeKind.NO_GPU:
        return "error", (f"No usable NVIDIA GPU: {outcome.message}. Choose CPU to profile on the processor "
                         "(tensor numbers from the tracker).")
    return "error", f"The run failed{where}: {outcome.message}"


# ---- saving -------------------------------------------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment_fingerprint(outcome: ProfileOutcome, probe: GpuProbe | None) -> dict[str, Any]:
    """What the numbers depend on: GPU, driver, CUDA, torch, bitsandbytes, and the host. The child's own
    report wins (it is what ran); package metadata fills in without importing torch here."""
    import psutil

    from vramlab.core import __version__

    info = outcome.info or {}
    gpu = probe if probe is not None and probe.available and outcome.device == "cuda" else None
    return {
        "device": outcome.device,
        "gpu": info.get("gpu") or (gpu.name if gpu else None),
        "gpu_memory_total_bytes": info.get("device_total_bytes") or (gpu.memory_total_bytes if gpu else None),
        "driver": gpu.driver_version if gpu else None,
        "cuda_driver": gpu.cuda_driver_version if gpu else None,
        "cuda_runtime": info.get("cuda"),
        "torch": info.get("torch") or _dist_version("torch"),
        "bitsandbytes": info.get("bitsandbytes") or _dist_version("bitsandbytes"),
        "vramlab": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": int(psutil.virtual_memory().total),
    }


def result_document(request: RunRequest, outcome: ProfileOutcome, probe: GpuProbe | None,
                    marks: Sequence[PhaseMark], buffer: RingBuffer | None,
                    nvml_lost_at_s: float | None = None) -> dict[str, Any]:
    """Everything needed to read a run again later: setup, outcome, prediction, comparison, environment,
    and the live readings (at most MAX_SAVED_POINTS, evenly thinned). Bytes throughout."""
    rows = comparison_rows(outcome, request.predicted)
    series: dict[str, list[float | None]] = {}
    if buffer is not None and len(buffer):
        step = max(1, -(-len(buffer) // MAX_SAVED_POINTS))
        for name in buffer.names:
            col = buffer.column(name)[::step]
            series[name] = [None if np.isnan(v) else (round(float(v), 4) if name in ("t_s", "cpu_pct", "util_pct",
                                                                                   "power_w") else int(v))
                            for v in col]
    return {
        "format": DOCUMENT_FORMAT,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": request.spec.to_dict(),
        "setup": request.setup.to_dict(),
        "device": request.device,
        "gpu": request.gpu.name if request.gpu else None,
        "steps": request.steps,
        "timeout_s": request.timeout_s,
        "fault": request.fault,
        "environment": environment_fingerprint(outcome, probe),
        "outcome": outcome.to_json(),
        "predicted": request.predicted.to_json() if request.predicted else None,
        "prediction_note": prediction_note(request.device),
        "comparison": [{"section": r.section, "what": r.label, "level": r.level, "predicted_bytes": r.predicted_bytes,
                        "measured_bytes": r.measured_bytes, "residual_bytes": r.residual_bytes,
                        "residual_fraction_of_measured": r.residual_fraction, "note": r.note} for r in rows],
        "phase_marks": [{"t_s": round(m.t_s, 4), "key": m.key, "allocated_bytes": m.allocated_bytes,
                         "reserved_bytes": m.reserved_bytes, "ended": m.ended,
                         "ended_peak_allocated_bytes": m.ended_peak_allocated_bytes,
                         "ended_peak_reserved_bytes": m.ended_peak_reserved_bytes} for m in marks],
        "nvml_lost_at_s": nvml_lost_at_s,
        "series": series,
    }
