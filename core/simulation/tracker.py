"""A dispatch-mode tracker that counts live tensor storage by kind and phase.

Every ATen op's outputs pass through :meth:`MemoryTracker.__torch_dispatch__`; each new storage is
recorded with its size (optionally rounded like the CUDA caching allocator, which hands out 512-byte
multiples) and a :class:`~vramlab.core.kinds.Kind`, and forgotten through a weakref callback when its last
reference dies. That gives the exact live bytes at every moment, the same on fake tensors (simulation),
on CPU tensors and on CUDA tensors, and a breakdown of what was alive at the peak.

How tensors get their kind:

* by the phase they are created in (load → weights, forward → activations, backward → temporaries,
  optimizer → optimizer temporaries),
* overridden by an explicit :meth:`region` the code runs in (the loss, autocast weight casts,
  dequantisation, optimizer state creation), and
* reclassified later by :meth:`reclassify` when their role becomes known (a temporary that becomes a
  parameter's ``.grad``, a zeros tensor that is an optimizer state).

Limitation: allocations inside a single kernel that are not outputs (cuBLAS workspaces, flash-attention
scratch) are invisible at this level; the estimator models known kernel workspaces separately and the real
profile measures them.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vramlab.core.allocator import MIN_BLOCK
from vramlab.core.kinds import PHASE_KIND, Kind, LiveTensor, Phase, phase_key

CUDA_BLOCK = MIN_BLOCK  # the caching allocator rounds every block up to a multiple of 512 bytes

_DETACH = torch.ops.aten.detach.default
_ALIAS = torch.ops.aten.alias.default
_IGNORED_OPS = {_DETACH, _ALIAS}


def round_block(nbytes: int, block: int) -> int:
    if block <= 1 or nbytes == 0:
        return nbytes
    return ((nbytes + block - 1) // block) * block


class _Entry:
    """One live storage (a plain class with slots: one is made per allocation)."""

    __slots__ = ("dtype", "kind", "label", "nbytes", "phase", "ref", "serial", "shape")

    def __init__(self, nbytes: int, kind: Kind, label: str, shape: tuple[int, ...], dtype: str, phase: str) -> None:
        self.nbytes = nbytes
        self.kind = kind
        self.label = label
        self.shape = shape
        self.dtype = dtype
        self.phase = phase
        self.ref: weakref.ref | None = None
        self.serial = 0


_NBYTES = operator.attrgetter("nbytes")
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


@dataclass(frozen=True)
class PeakRecord:
    """The live bytes at a peak moment, split by kind, with the largest storages alive then."""

    total_bytes: int
    kinds: dict[Kind, int]
    phase: str
    event: int
    top: tuple[LiveTensor, ...] = ()


class MemoryTracker(TorchDispatchMode):
    """Count live storages. Use as a context manager around model build and training steps.

    ``block``: round each storage up to this many bytes (512 reproduces ``torch.cuda.memory_allocated``;
    1 counts raw bytes as torch's MemTracker does). ``counts(tensor)`` decides whether a storage is
    device memory at all (a real CUDA run ignores CPU tensors).
    """

    def __init__(
        self,
        block: int = CUDA_BLOCK,
        counts: Callable[[torch.Tensor], bool] | None = None,
        top_n: int = 12,
        record_timeline: bool = True,
        record_allocations: bool = False,
    ) -> None:
        super().__init__()
        self.block = block
        self._counts = counts
        self.top_n = top_n
        self._live: dict[int, _Entry] = {}
        self._host: set[int] = set()
        self.current = 0
        self.by_kind: dict[Kind, int] = dict.fromkeys(Kind, 0)
        self._phase = Phase.LOAD
        self._step = 0
        self._phase_key = phase_key(Phase.LOAD, 0)
        self._regions: list[Kind] = []
        self._host_depth = 0
        self._host_scalars = 0
        self._label = ""
        self.events = 0
        self.peak: PeakRecord = PeakRecord(0, dict.fromkeys(Kind, 0), phase_key(Phase.LOAD, 0), 0)
        self.phase_peaks: dict[str, PeakRecord] = {}
        self._pending_global = False
        self._pending_phase = False
        self.timeline: list[tuple[int, int]] = []  # (event, live bytes) at every change
        self.phase_marks: list[tuple[int, str]] = []  # (event, phase key) at every phase change
        self._record_timeline = record_timeline
        self.listeners: list[Callable[[str, int], None]] = []  # called on phase change (key, live bytes)
        # every allocation (serial, bytes) and free (serial, -1), for the caching-allocator model
        self.alloc_log: list[tuple[int, int]] | None = [] if record_allocations else None
        self._serial = 0
        self.ended_at: tuple[int, int] | None = None  # set by finish()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._disable_dynamo`` wrapper around ``__torch_dispatch__`` (TorchDispatchMode's default):
        the measured step is never compiled, and the wrapper cost an eval-frame switch on every op and, on
        the first op, the import of ``torch._dynamo`` (seconds)."""
        return False

    # ---- context -----------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._phase = phase
        self._phase_key = phase_key(phase, self._step)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        self._step = step
        self._phase_key = phase_key(self._phase, step)

    def set_phase(self, phase: Phase, step: int = 0) -> None:
        self._flush_pending()
        self.phase = phase
        self.step = step
        key = self._phase_key
        self.phase_marks.append((self.events, key))
        if key not in self.phase_peaks:
            self.phase_peaks[key] = PeakRecord(self.current, dict(self.by_kind), key, self.events)
        for listener in self.listeners:
            listener(key, self.current)

    def restart_phase_peak(self) -> None:
        """Forget the peak so far in the current phase (used only for a construction transient that the
        real loading path does not have, e.g. HF ``from_config`` allocating an untied head before tying)."""
        self._flush_pending()
        key = self.phase_name
        rec = PeakRecord(self.current, dict(self.by_kind), key, self.events)
        self.phase_peaks[key] = rec
        if self.peak.phase == key:
            self.peak = PeakRecord(rec.total_bytes, rec.kinds, key, self.events, self._top())

    @contextlib.contextmanager
    def region(self, kind: Kind) -> Iterator[None]:
        """Tensors created inside get ``kind`` instead of the phase default."""
        self._regions.append(kind)
        try:
            yield
        finally:
            self._regions.pop()

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Storages created inside are not device memory for the tensor level (CUDA managed memory of
        paged optimizers, host-side counters): they are never counted."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    @contextlib.contextmanager
    def host_scalars(self) -> Iterator[None]:
        """0-dim tensors created inside live on the host (torch's non-fused optimizer step counters)."""
        self._host_scalars += 1
        try:
            yield
        finally:
            self._host_scalars -= 1

    @contextlib.contextmanager
    def label(self, text: str) -> Iterator[None]:
        """A name for allocations made inside (module path), shown in the 'alive at peak' list."""
        old = self._label
        self._label = text
        try:
            yield
        finally:
            self._label = old

    @property
    def phase_name(self) -> str:
        return self._phase_key

    # ---- dispatch ------------------------------------------------------------------------------------
    @staticmethod
    def run_op(func, args, kwargs):  # noqa: ANN001, ANN205
        """Run one op below the mode (the fast simulation answers from its op cache instead)."""
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = self.run_op(func, args, kwargs or {})
        if func is _DETACH or func is _ALIAS:  # _IGNORED_OPS, by identity (an op's hash is Python code)
            return out
        if isinstance(out, torch.Tensor):
            self._track(out, func)
        elif isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
            for t in out:  # the order tree_flatten gives
                if t is not None:
                    self._track(t, func)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t, func)
        return out

    def _track(self, t: torch.Tensor, func: object = None, kind: Kind | None = None) -> None:
        if self._counts is not None and not self._counts(t):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(st)
        if key in self._host:
            return
        if self._host_depth or (self._host_scalars and t.dim() == 0):
            self._host.add(key)
            weakref.finalize(st, self._host.discard, key)
            return
        nbytes = st.nbytes()
        block = self.block
        if block > 1 and nbytes:
            nbytes = ((nbytes + block - 1) // block) * block  # round_block, inline: once per output
        entry = self._live.get(key)
        if entry is not None:
            if entry.nbytes != nbytes:  # resized in place (out= ops)
                self._change(entry.kind, nbytes - entry.nbytes)
                entry.nbytes = nbytes
            return
        if kind is None:
            kind = self._regions[-1] if self._regions else PHASE_KIND[self._phase]
        name = getattr(func, "__name__", "") if func is not None else ""
        label = f"{self._label}:{name}" if self._label else name
        entry = _Entry(nbytes, kind, label, tuple(t.shape), _dtype_name(t.dtype), self._phase_key)
        entry.ref = weakref.ref(st, self._make_release(key))
        self._live[key] = entry
        if self.alloc_log is not None and nbytes:
            self._serial += 1
            entry.serial = self._serial
            self.alloc_log.append((self._serial, nbytes))
        self._change(kind, nbytes)

    def _make_release(self, key: int) -> Callable[[object], None]:
        def release(_ref: object) -> None:
            self._flush_pending()  # a peak this free ends lists the storage freed, still alive at the peak
            entry = self._live.pop(key, None)
            if entry is not None:
                self._change(entry.kind, -entry.nbytes)
                if self.alloc_log is not None and entry.serial:
                    self.alloc_log.append((entry.serial, -1))
        return release

    def _change(self, kind: Kind, delta: int) -> None:
        if delta < 0:
            self._flush_pending()
        self.current += delta
        self.by_kind[kind] += delta
        self.events += 1
        if self._record_timeline:
            self.timeline.append((self.events, self.current))
        if delta > 0:
            key = self._phase_key
            if self.current > self.peak.total_bytes:
                self.peak = PeakRecord(self.current, {}, key, self.events)
                self._pending_global = True
            ph = self.phase_peaks.get(key)
            if ph is None or self.current > ph.total_bytes:
                self.phase_peaks[key] = PeakRecord(self.current, {}, key, self.events)
                self._pending_phase = True

    def _flush_pending(self) -> None:
        """Fill in the breakdown of a peak once it is known to be a local maximum (the next free)."""
        if self._pending_phase:
            rec = self.phase_peaks[self._phase_key]
            if rec.event == self.events:
                self.phase_peaks[self._phase_key] = PeakRecord(rec.total_bytes, dict(self.by_kind), rec.phase,
                                                               rec.event)
            self._pending_phase = False
        if self._pending_global:
            if self.peak.event == self.events:
                self.peak = PeakRecord(self.peak.total_bytes, dict(self.by_kind), self.peak.phase, self.peak.event,
                                       self._top())
            self._pending_global = False

    def _top(self) -> tuple[LiveTensor, ...]:
        if self.top_n <= 0:
            return ()
        entries = sorted(self._live.values(), key=_NBYTES, reverse=True)[: self.top_n]
        return tuple(LiveTensor(e.nbytes, e.kind, e.label, e.shape, e.dtype, e.phase) for e in entries)

    def finish(self) -> None:
        """Record the breakdown of a peak that was never followed by a free, and where the step's events end
        (``ended_at``: the lengths of the timeline and the allocation log; frees after it are the model's
        teardown, whenever Python's garbage collector reaches its reference cycles)."""
        self._flush_pending()
        self.ended_at = (len(self.timeline), len(self.alloc_log) if self.alloc_log is not None else 0)

    # ---- classification -------------------------------------------------------------------------------
    def register(self, t: torch.Tensor, kind: Kind) -> None:
        """Count a tensor created outside the tracker (or give a tracked one its kind)."""
        self._track(t, None, kind)
        self.reclassify(t, kind)

    def reclassify(self, t: torch.Tensor | None, kind: Kind, label: str | None = None) -> None:
        """``t``'s storage is of ``kind`` from now on; ``label`` names it (a parameter's name, say) in the
        list of what is alive at the peak instead of the op that allocated it."""
        if t is None:
            return
        try:
            key = id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        entry = self._live.get(key)
        if entry is None:
            return
        if label:
            entry.label = label
        if entry.kind is kind:
            return
        self.by_kind[entry.kind] -= entry.nbytes
        self.by_kind[kind] += entry.nbytes
        entry.kind = kind

    def mark_host(self, t: torch.Tensor) -> None:
        """This storage would live in host memory on the real device (e.g. optimizer step counters)."""
        try:
            key = id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        entry = self._live.pop(key, None)
        if entry is not None:
            self._change(entry.kind, -entry.nbytes)
            if self.alloc_log is not None and entry.serial:
                self.alloc_log.append((entry.serial, -1))
        self._host.add(key)

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is host memory (made in :meth:`host` or marked by :meth:`mark_host`)."""
        try:
            return id(t.untyped_storage()) in self._host
        except (RuntimeError, NotImplementedError):
            return False

    def kind_of(self, t: torch.Tensor) -> Kind | None:
        entry = self._live.get(id(t.untyped_storage()))
        return entry.kind if entry else None

    def live(self) -> list[LiveTensor]:
        return [LiveTensor(e.nbytes, e.kind, e.label, e.shape, e.dtype, e.phase) for e in self._live.values()]

    def live_bytes(self, kind: Kind | None = None) -> int:
        return self.current if kind is None else self.by_kind[kind]


class NullTracker:
    """The tracker's interface without tracking: a real run measured by the allocator's own counters
    (a dispatch mode would change how torch accumulates gradients, see estimator.engine)."""

    def __init__(self) -> None:
        self.phase = Phase.LOAD
        self.step = 0
        self.current = 0
        self.listeners: list[Callable[[str, int], None]] = []

    def __enter__(self) -> NullTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @property
    def phase_name(self) -> str:
        return phase_key(self.phase, self.step)

    def set_phase(self, phase: Phase, step: int = 0) -> None:
        self.phase, self.step = phase, step
        for listener in self.listeners:
            listener(self.phase_name, 0)

    def region(self, kind: Kind) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def host(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def host_scalars(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def label(self, text: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reclassify(self, t: torch.Tensor | None, kind: Kind, label: str | None = None) -> None:
        return None

    def register(self, t: torch.Tensor, kind: Kind) -> None:
        return None

    def mark_host(self, t: torch.Tensor) -> None:
        return None

    def is_host(self, t: torch.Tensor) -> bool:
        return False

    def finish(self) -> None:
        return None
