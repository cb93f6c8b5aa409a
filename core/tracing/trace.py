"""The second source of tapes: the training step of transformers' own classes, traced.

The hand-written program (:mod:`vramlab.core.estimator.program`) mirrors a few families by hand. A trace
needs no mirror: the real model class (and peft) runs the instrumented step of :mod:`.step` under fake
tensors, as ``simulate --hf`` does, and every allocation, free and reclassification is recorded with its
kind and phase. Run

* at reduced depth: with 3 layers as the template, and once with 2 layers, whose difference is the
  events one more layer adds (pure insertions, else the layers do not repeat and the trace says so); a
  model of N layers is the template with those events repeated N - 2 times (the tape's blocks);
* at enough (batch, sequence, rank) points to determine every size exactly as an integer polynomial in
  the estimator's monomials (an exact rational solve; every event sequence must have the same form). Only
  the points that determine each tensor's *dimensions* are run (each dimension an integer polynomial in 1,
  b, s, r and bs: 4 points for full fine-tuning, 5 with LoRA, where the sizes need 5 and 8), the sizes at
  the others computed from those dimensions; and besides the template those points run the first optimizer
  step alone, each allocation of the second step sized as the one it repeats in the first (the phases of
  the two steps aligned event by event). Where that does not hold, or the tape it gives fails its
  verification, every point is traced with both steps, as the sizes were fitted before;
* and verified at a further point (another batch, sequence and rank, and 4 layers), event by event.

Where the step changes form with the sequence length (a sliding-window mask from ``s >= window`` on),
the sequence range is split at the config's window and each piece traced on its own; if the form still
changes, or a size is not a polynomial, the tape is traced for the requested sequence length only
(``SEQUENCE_FIXED``), and failing that the full-depth model is traced at exactly the requested point
(``DIRECT``, which is ``simulate --hf``). The mode and the reason are part of the result.

Under fake tensors torch runs the CPU's kernels and treats every tensor as a subclass: the tape is the
simulation's (``simulate --hf``), with the two known differences from a CUDA run that the hand-written
estimator models (see :class:`~vramlab.core.estimator.engine.Engine`) corrected here: a second gradient
added into an autograd input buffer is added in place on CUDA (under a dispatch mode torch allocates the
sum; the trace recognises the ``add`` that the engine runs between two nodes), and LayerNorm keeps its
statistics in fp32 on CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import gc
import math
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from vramlab.core.checks import SetupError
from vramlab.core.estimator.engine import KIND_INDEX
from vramlab.core.estimator.poly import MONOMIALS, N
from vramlab.core.estimator.stored import DIRECT, FITTED, SEQUENCE_FIXED, TracedTape
from vramlab.core.kinds import Kind
from vramlab.core.simulation.step import Aborted, measure
from vramlab.core.simulation.tracker import MemoryTracker
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

Progress = Callable[[str, float], None]  # (what is being traced, fraction done)

_A, _F, _R, _P = 1, -1, 0, 2  # row ops: allocate, free, reclassify, phase mark
B_FIT, B_CHECK = (2, 3), 5
R_FIT, R_CHECK = (4, 8), 6


class TraceFailed(Exception):
    """The step cannot be written as one tape over these points (the message says why)."""


# ---- recording ------------------------------------------------------------------------------------------
class _Log(list):
    """The tracker's allocation log, copied into the recorder's rows as it is written."""

    def __init__(self, rows: list) -> None:
        super().__init__()
        self.rows = rows

    def append(self, item: tuple[int, int]) -> None:
        super().append(item)
        serial, nbytes = item
        self.rows.append([_A, serial, nbytes, None] if nbytes > 0 else [_F, serial])


_ADD = torch.ops.aten.add.Tensor
_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_DEVICE = torch.ops.prim.device.default


class Recorder(MemoryTracker):
    """A tracker that keeps the sequence of events (raw bytes: the tape rounds to the allocator's blocks
    when it is evaluated), with CUDA's in-place gradient accumulation and fp32 LayerNorm statistics
    applied (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(block=1, record_timeline=False, record_allocations=True, top_n=0)
        self.rows: list[list] = []
        self.alloc_log = _Log(self.rows)
        self._serials: dict[int, int] = {}
        self.resized = False
        self.between_nodes = False  # the autograd engine is between two nodes (accumulating gradients)
        self.accumulations: list[tuple[int, int | None, int | None]] = []  # (sum, old, new) serials
        self.fp32_on_cuda: set[int] = set()  # LayerNorm statistics kept in the input dtype here
        self.shapes: dict[int, tuple[int, ...]] = {}  # an allocation's tensor shape, where it fills the storage

    def set_phase(self, phase, step: int = 0) -> None:  # noqa: ANN001
        gc.collect()  # garbage in reference cycles goes at phase boundaries, not whenever Python's gc runs
        super().set_phase(phase, step)
        self.rows.append([_P, self.phase_name])

    def restart_phase_peak(self) -> None:
        """The tracker forgets the phase's peak so far (a construction transient a real load does not have:
        from_config's untied head before tying). A tape cannot forget a peak, so it forgets the events: what
        was allocated and freed in this phase before now. What is still alive stays, so the level after this
        point is unchanged and the phase's peak before it is that level, as the tracker has it."""
        super().restart_phase_peak()
        start = max((i for i, row in enumerate(self.rows) if row[0] == _P), default=0)
        here = self.rows[start:]
        allocated = {row[1] for row in here if row[0] == _A}
        gone = allocated & {row[1] for row in here if row[0] == _F}
        self.rows[start:] = [row for row in here if row[0] == _P or row[1] not in gone]

    def serial_of(self, t: object) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        try:
            return self._serials.get(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is _DEVICE:  # most of the ops a step dispatches: C++ asking a tensor for its device
            t = args[0]
            if isinstance(t, FakeTensor) and not t.fake_mode.in_kernel_invocation:
                return t.fake_device  # FakeTensorMode's own answer (its device handler), without the round trip
            return func(*args, **(kwargs or {}))  # a query: no storage is made, nothing to record
        watch = func is _LAYER_NORM or (func is _ADD and self.between_nodes and len(args) >= 2)
        if not watch:
            return super().__torch_dispatch__(func, types, args, kwargs)
        addends = (self.serial_of(args[0]), self.serial_of(args[1])) if func is _ADD else ()
        start = len(self.rows)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        new = {row[1]: row for row in self.rows[start:] if row[0] == _A}
        if func is _ADD:
            if len(new) == 1:
                self.accumulations.append((next(iter(new)), *addends))
        else:
            for t in out[1:3]:  # mean and rstd: fp32 on CUDA, the input dtype on the CPU
                serial = self.serial_of(t)
                if serial in new and t.dtype in (torch.bfloat16, torch.float16):
                    self.fp32_on_cuda.add(serial)
        return out

    def _track(self, t: torch.Tensor, func: object = None, kind: Kind | None = None) -> None:
        before, current = len(self.rows), self.current
        super()._track(t, func, kind)
        if len(self.rows) > before and self.rows[-1][0] == _A and self.rows[-1][3] is None:
            row = self.rows[-1]
            row[3] = self.kind_of(t)
            self._serials[id(t.untyped_storage())] = row[1]
            if t.numel() * t.element_size() == row[2]:
                self.shapes[row[1]] = tuple(t.shape)
        elif self.current != current:
            self.resized = True

    def reclassify(self, t: torch.Tensor | None, kind: Kind, label: str | None = None) -> None:
        before = None
        if t is not None:
            try:
                before = self.kind_of(t)
            except (RuntimeError, NotImplementedError):
                before = None
        super().reclassify(t, kind, label)
        if before is not None and before is not kind:
            serial = self.serial_of(t)
            if serial is not None:
                self.rows.append([_R, serial, kind])

    def cuda_rows(self) -> list[list]:
        """The rows with each out-of-place gradient accumulation made in place, as CUDA runs it: the
        autograd engine's ``old + new`` (then ``old`` and ``new`` freed when unshared) becomes an in-place
        add into whichever of the two it held the last reference to (torch's InputBuffer::accumulate),
        so the sum is never allocated and that addend lives on in its place."""
        rows = [[_A, r[1], r[2] * 2, r[3]] if r[0] == _A and r[1] in self.fp32_on_cuda else r for r in self.rows]
        if not self.accumulations:
            return rows
        size = {row[1]: row[2] for row in rows if row[0] == _A}
        position = {row[1]: i for i, row in enumerate(rows) if row[0] == _A}
        drop: set[int] = set()
        rename: dict[int, int] = {}
        for total, old, new in self.accumulations:
            i = position.get(total)
            if i is None:
                continue
            freed: list[int] = []
            j = i + 1
            while j < len(rows) and rows[j][0] == _F and len(freed) < 2:
                freed.append(j)
                j += 1
            by_serial = {rows[k][1]: k for k in freed}
            survivor = new if new in by_serial else old if old in by_serial else None
            if survivor is None or size.get(survivor) != size.get(total):
                continue  # both addends still referenced: out of place on CUDA too
            drop.add(i)
            drop.add(by_serial[survivor])
            rename[total] = survivor
        out = []
        for i, row in enumerate(rows):
            if i in drop:
                continue
            if row[0] in (_F, _R) and row[1] in rename:
                serial = row[1]
                while serial in rename:
                    serial = rename[serial]
                out.append([row[0], serial, *row[2:]])
                continue
            out.append(row)
        return out


@dataclasses.dataclass(frozen=True)
class Point:
    depth: int
    b: int
    s: int
    r: int


@dataclasses.dataclass
class Trace:
    """One traced run: rows (op, allocation index, kind, new kind, phase index) and each allocation's size."""

    ops: list[tuple]
    sizes: list[int]
    phases: list[str]
    total_params: int
    trainable_params: int
    managed_bytes: int
    # each allocation's bytes per element and shape (None: its storage is not one tensor's elements)
    dims: list[tuple[int, tuple[int, ...]] | None] = dataclasses.field(default_factory=list)
    adapted: tuple[str, ...] = ()  # the modules peft wrapped with LoRA, by their own names (adapted_names)
    build_notes: tuple[str, ...] = ()  # what the build chose for the user to know (hf.HFModel.notes)

    def structure(self) -> tuple:
        return tuple(self.ops), tuple(self.phases)

    def tokens(self, sizes: list[int] | None = None) -> list[tuple]:
        """Rows as comparable tokens: op, kinds, phase and the size of the allocation they concern."""
        sizes = self.sizes if sizes is None else sizes
        return [(op, k, nk, self.phases[ph], sizes[ref] if ref >= 0 else 0) for op, ref, k, nk, ph in self.ops]


def _convert(rows: list[list], run_total: int, run_trainable: int, managed: int,
             shapes: dict[int, tuple[int, ...]] | None = None) -> Trace:
    index: dict[int, int] = {}
    kind_now: dict[int, int] = {}
    sizes: list[int] = []
    dims: list[tuple[int, tuple[int, ...]] | None] = []
    shapes = shapes or {}
    ops: list[tuple] = []
    phases: list[str] = []
    for row in rows:
        op = row[0]
        if op == _P:
            phases.append(row[1])
            ops.append((_P, -1, 0, 0, len(phases) - 1))
            continue
        ph = max(len(phases) - 1, 0)
        serial = row[1]
        if op == _A:
            index[serial] = len(sizes)
            sizes.append(int(row[2]))
            shape = shapes.get(serial)
            numel = math.prod(shape) if shape is not None else 0  # exact; np.prod: 6 µs a tuple, 40x more
            dims.append((sizes[-1] // numel, shape) if numel and sizes[-1] % numel == 0 else None)
            kind_now[serial] = KIND_INDEX[row[3]]
            ops.append((_A, index[serial], kind_now[serial], 0, ph))
        elif serial not in index:
            continue  # a storage made before the tracker started (never counted)
        elif op == _F:
            ops.append((_F, index[serial], kind_now[serial], 0, ph))
        else:
            nk = KIND_INDEX[row[2]]
            ops.append((_R, index[serial], kind_now[serial], nk, ph))
            kind_now[serial] = nk
    return Trace(ops, sizes, phases, run_total, run_trainable, managed, dims)


# ---- running ---------------------------------------------------------------------------------------------
def hf_config_at(config_json: str, depth: int):  # noqa: ANN201
    """The transformers config of ``config_json`` (canonical JSON of its ``to_dict``) at ``depth`` layers."""
    import json

    from vramlab.core.sources.traced_config import config_from_dict

    cfg = config_from_dict(json.loads(config_json))
    if getattr(cfg, "is_encoder_decoder", False):
        return encoder_decoder_at(cfg, depth)
    cfg.num_hidden_layers = depth
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) > depth:
        cfg.layer_types = types[:depth]
    return cfg


def encoder_decoder_at(cfg, depth: int):  # noqa: ANN001, ANN201
    """An encoder-decoder config (T5, mT5) with ``depth`` layers in both stacks. The tape repeats what one
    more layer adds ``N - 2`` times, for one layer more in each stack: an encoder and a decoder of different
    depths are not fitted (the trace says so, and the model is simulated directly at its full depth)."""
    from vramlab.core.tracing.hf import layer_counts, with_depth

    counts = layer_counts(cfg)
    if depth >= max(counts.values(), default=0):
        return cfg
    if len(set(counts.values())) > 1:
        raise TraceFailed(f"the encoder and decoder have different depths ({counts}): one more layer of the "
                          "reduced model stands for one of each")
    return with_depth(cfg, depth)


@contextlib.contextmanager
def _engine_watch(rec: Recorder) -> Iterator[None]:
    """Mark when the autograd engine is between two nodes, where it accumulates gradients into input
    buffers: every node's pre-hook ends such a stretch and its post-hook starts one (nested backward
    passes of reentrant checkpointing included: they go through ``torch.autograd.backward`` too)."""
    original = torch.autograd.backward
    mine = threading.get_ident()

    def backward(tensors, *args, **kwargs):  # noqa: ANN001, ANN202
        if threading.get_ident() != mine:  # another thread's backward (a simulation beside this trace)
            return original(tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        _hook_graph([t.grad_fn for t in roots if isinstance(t, torch.Tensor)], rec)
        old, rec.between_nodes = rec.between_nodes, True
        try:
            return original(tensors, *args, **kwargs)
        finally:
            rec.between_nodes = old

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def _hook_graph(roots: list, rec: Recorder) -> None:
    def pre(_grad_outputs):  # noqa: ANN001, ANN202
        rec.between_nodes = False

    def post(_grad_inputs, _grad_outputs):  # noqa: ANN001, ANN202
        rec.between_nodes = True

    seen: set[int] = set()
    todo = list(roots)
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ != "AccumulateGrad":
            fn.register_prehook(pre)
            fn.register_hook(post)
        todo.extend(nxt for nxt, _ in fn.next_functions)


def trace_once(spec: ModelSpec, setup: TrainingSetup, point: Point, config_json: str = "",
               should_abort: Callable[[], bool] | None = None, cuda: bool = True) -> Trace:
    """Run the step of ``spec`` at ``point`` (depth and sizes) under fake tensors and record it."""
    return trace_both(spec, setup, point, config_json, should_abort)[0 if cuda else 1]


def trace_both(spec: ModelSpec, setup: TrainingSetup, point: Point, config_json: str = "",
               should_abort: Callable[[], bool] | None = None, vision_depth: int | None = None,
               steps: int = 2) -> tuple[Trace, Trace]:
    """:func:`trace_once` as CUDA runs it and as the simulation itself does, from one run (of ``steps``
    optimizer steps: the tape's two, or the first alone)."""
    from vramlab.core.tracing import hf as hfmod

    reduced = dataclasses.replace(spec, num_layers=point.depth)
    at = setup.replace(micro_batch=point.b, seq_len=point.s, lora_rank=point.r)
    cfg = hf_config_at(config_json, point.depth) if config_json else None
    rec = Recorder()
    builder = functools.partial(hfmod.build_hf, config=cfg)
    guard = hfmod.guard(at)
    if spec.vision is not None and spec.vision.traced:  # a vision-language model traced whole
        builder, guard = _vlm_builder(spec, at, point, config_json, vision_depth)
    adapted: list[str] = []

    def build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the builder's own arguments
        model = builder(*args, **kwargs)
        adapted[:] = adapted_names(model)
        return model
    _preload(at)
    enabled = gc.isenabled()
    gc.disable()  # the order of events must not depend on when Python's cycle collector happens to run
    # and collecting at phase boundaries looks only at what the run itself made; what the app froze once it
    # had started (app/workers.py: settle_collector) stays frozen afterwards: unfreezing it would hand the
    # window's objects back to every later full collection
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        with FakeTensorMode(allow_non_fake_inputs=False), guard, _engine_watch(rec):
            run = measure(reduced, at, torch.device("cpu"), real=False, tracker=rec, steps=steps, builder=build,
                          should_abort=should_abort)
    except hfmod.NoTargetModule as e:
        if point.depth < spec.num_layers:  # LFM2's first layers are convolutions: its q_proj comes later
            raise TraceFailed(f"{point.depth} of its {spec.num_layers} layers hold no module for a LoRA target "
                              f"({e})") from e
        raise
    except (SetupError, Aborted, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - transformers, peft or fake tensors refusing this model or recipe
        raise TraceFailed(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else 'no message'}") from e
    finally:
        if not frozen_before:
            gc.unfreeze()
        if enabled:
            gc.enable()
    if rec.resized:
        raise TraceFailed("a tensor was resized in place (an out= operation)")
    counts = (run.total_params, run.trainable_params, run.managed_bytes)
    both = _convert(rec.cuda_rows(), *counts, rec.shapes), _convert(rec.rows, *counts, rec.shapes)
    for tr in both:
        tr.adapted = tuple(adapted)
        tr.build_notes = tuple(n for n in run.notes if n.startswith(_KEPT_NOTES))
    return both


# the build's notes a tape keeps for its estimate's (the others, attention and emulation, say how the trace ran)
_KEPT_NOTES = ("without LoRA dropout on ", "16-bit, not ")


def adapted_names(model: torch.nn.Module) -> list[str]:
    """The modules peft wrapped with LoRA, by their own (last) names in the order the model has them, each once:
    what a user's LoRA trains, fused projections included (Falcon's ``query_key_value``, ``dense_h_to_4h``); a
    parameter adapted in place (``target_parameters``, MoE experts) as ``module.parameter``; nothing without
    LoRA (peft is not imported then: its import is seconds of a first trace)."""
    import sys

    if "peft" not in sys.modules:  # no model built here was wrapped by peft
        return []
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return []
    from vramlab.core.tracing.hf import param_wrapped

    out = dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper))
    return [*out, *param_wrapped(model)]


def _preload(setup: TrainingSetup) -> None:
    """Import, outside the fake-tensor mode, what the step imports on its first use: a module imported inside
    the mode has its import-time tensors (peft's ``torch.tensor(1)`` defaults) recorded as the run's, and the
    first run in a process would then not have the form of every later one. A step without LoRA never imports
    peft (a fifth of a second saved on the first trace of full fine-tuning)."""
    if not setup.uses_lora:
        return
    with contextlib.suppress(ImportError):
        import peft.peft_model  # noqa: F401 - peft's tuners, imported by its first get_peft_model


def _vlm_builder(spec: ModelSpec, setup: TrainingSetup, point: Point, config_json: str,
                 vision_depth: int | None) -> tuple[Callable, object]:
    """The builder and guard of a vision-language model traced whole (:mod:`.vlm_traced`): its language model
    at the point's depth, its tower at ``vision_depth`` blocks (None: whole), the processor's batch for the
    setup's images."""
    from vramlab.core.tracing import vlm_traced

    cfg = vlm_traced.config_from_json(config_json or spec.transformers_config, text_depth=point.depth,
                                      vision_depth=vision_depth)
    return functools.partial(vlm_traced.build, config=cfg), vlm_traced.guard(setup, spec)


# ---- fitting --------------------------------------------------------------------------------------------
def basis(symbolic: tuple[bool, bool, bool]) -> list[int]:
    """The monomials (indices into MONOMIALS) a size is fitted over: where a size is concrete, monomials
    that differ only in its power are one column, kept as the one with the lowest such power (so that its
    coefficient stays a whole number: at a fixed s, ``bsr`` and ``br`` are both ``br`` times a constant)."""
    groups: dict[tuple[int, ...], int] = {}
    for i, m in enumerate(MONOMIALS):
        effective = tuple(e if sym else 0 for e, sym in zip(m, symbolic))
        concrete = sum(e for e, sym in zip(m, symbolic) if not sym)
        j = groups.get(effective)
        if j is None or concrete < sum(e for e, sym in zip(MONOMIALS[j], symbolic) if not sym):
            groups[effective] = i
    return sorted(groups.values())


def _row(cols: list[int], b: int, s: int, r: int) -> list[int]:
    v = (1, b, s, r, b * s, b * s * s, b * s * r, b * r)
    return [v[i] for i in cols]


def choose_points(candidates: list[tuple[int, int, int]], cols: list[int]) -> list[tuple[int, int, int]]:
    """The first candidates (in order) that together determine every coefficient over ``cols``."""
    chosen: list[tuple[int, int, int]] = []
    rank = 0
    for p in candidates:
        trial = np.array([_row(cols, *q) for q in (*chosen, p)], dtype=np.float64)
        if np.linalg.matrix_rank(trial) > rank:
            chosen.append(p)
            rank += 1
            if rank == len(cols):
                return chosen
    raise TraceFailed("the fit points do not determine the sizes")


def solve_exact(points: list[tuple[int, int, int]], cols: list[int], sizes: np.ndarray) -> np.ndarray:
    """Integer coefficients (allocations x monomials) with ``sizes[p, a]`` the size of allocation ``a``
    at point ``p``; exact rational elimination over the distinct size columns. Raises TraceFailed when a
    size is not an integer polynomial of that form."""
    distinct, inverse = np.unique(sizes, axis=1, return_inverse=True)
    inverse = inverse.reshape(-1)
    k = len(cols)
    inv = _inverse([[Fraction(v) for v in _row(cols, *p)] for p in points])  # once (k <= 8)
    coef = np.zeros((distinct.shape[1], N), dtype=np.int64)
    for u in range(distinct.shape[1]):
        y = [int(v) for v in distinct[:, u]]
        for i, col in enumerate(cols):
            c = sum((inv[i][j] * y[j] for j in range(k)), Fraction(0))
            if c.denominator != 1:
                raise TraceFailed("an allocation's size is not a polynomial in batch, sequence and rank")
            coef[u, col] = int(c)
    return coef[inverse]


_DIM_MONOMIALS = (0, 1, 2, 3, 4)  # 1, b, s, r, bs: what one dimension of a tensor is made of (b x s: tokens)


def dim_basis(symbolic: tuple[bool, bool, bool]) -> list[int]:
    """The monomials (of :func:`basis`) a tensor dimension is fitted over."""
    return [i for i in basis(symbolic) if i in _DIM_MONOMIALS]


def sizes_from_dims(dims: list[list[tuple[int, tuple[int, ...]] | None]], ran: list[tuple[int, int, int]],
                    points: list[tuple[int, int, int]], cols: list[int]) -> np.ndarray:
    """Every allocation's size at each of ``points`` from its dimensions at ``ran`` (``dims[i][a]``: allocation
    ``a``'s bytes per element and shape at ``ran[i]``; points that determine a polynomial over ``cols``): each
    dimension of each allocated tensor fitted exactly as an integer polynomial over ``cols`` (1, b, s, r, bs, as
    far as they vary), times its bytes per element. Where every dimension has that form, this is what a trace
    at the other points measures; the tape fitted from it is verified at a further point like any other.
    Raises TraceFailed where an allocation has no such form (its rank or bytes per element differ between
    runs, its storage is not one tensor's elements, or a dimension is not such a polynomial)."""
    count = len(dims[0])
    width = 0
    for row in dims:
        if len(row) != count:
            raise TraceFailed("the runs differ in form")
        for d in row:
            if d is None:
                raise TraceFailed("an allocation is not one tensor's elements")
            width = max(width, len(d[1]))
    values = np.ones((len(dims), count, width), dtype=np.int64)  # missing leading dimensions: 1
    for i, row in enumerate(dims):
        for a, (per, shape) in enumerate(row):
            if len(shape) != len(dims[0][a][1]) or per != dims[0][a][0]:
                raise TraceFailed("an allocation changes its rank or element size between runs")
            values[i, a, width - len(shape):] = shape
    if len(ran) != len(cols):
        raise TraceFailed("the runs do not determine the dimensions")
    inv = _inverse([[Fraction(v) for v in _row(cols, *p)] for p in ran])
    scale = 1
    for row in inv:
        for v in row:
            scale = scale * v.denominator // np.gcd(scale, v.denominator)
    adj = np.array([[int(v * scale) for v in row] for row in inv], dtype=np.int64)
    flat = values.reshape(len(dims), -1)
    scaled = adj @ flat  # each dimension's coefficients over cols, times scale
    if np.any(scaled % scale):
        raise TraceFailed("a tensor dimension is not a polynomial in batch, sequence and rank")
    coef = scaled // scale
    at = np.array([_row(cols, *p) for p in points], dtype=np.int64) @ coef
    per = np.array([d[0] for d in dims[0]], dtype=np.int64)
    return at.reshape(len(points), count, width).prod(axis=2) * per


def _inverse(x: list[list[Fraction]]) -> list[list[Fraction]]:
    """The inverse of a small square matrix, exactly (Gauss-Jordan over fractions)."""
    k = len(x)
    inv = [[Fraction(int(i == j)) for j in range(k)] for i in range(k)]
    a = [row[:] for row in x]
    for c in range(k):
        pivot = next(i for i in range(c, k) if a[i][c] != 0)
        a[c], a[pivot] = a[pivot], a[c]
        inv[c], inv[pivot] = inv[pivot], inv[c]
        f = a[c][c]
        a[c] = [v / f for v in a[c]]
        inv[c] = [v / f for v in inv[c]]
        for i in range(k):
            if i != c and a[i][c] != 0:
                g = a[i][c]
                a[i] = [u - g * v for u, v in zip(a[i], a[c])]
                inv[i] = [u - g * v for u, v in zip(inv[i], inv[c])]
    return inv


def _values(coef: np.ndarray, b: int, s: int, r: int) -> list[int]:
    v = np.array((1, b, s, r, b * s, b * s * s, b * s * r, b * r), dtype=np.int64)
    return (coef @ v).tolist()


def _chunks(low: Trace, template: Trace) -> list[tuple[int, int]]:
    """The stretches of ``template`` (one layer more than ``low``) that the extra layer adds: the
    difference must be pure insertions."""
    matcher = difflib.SequenceMatcher(None, low.tokens(), template.tokens(), autojunk=False)
    out = []
    for tag, _i1, _i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            raise TraceFailed("one more layer changes more than it adds (the layers do not repeat identically)")
        # a stretch that ends a run of reclassifications and starts another run (of allocations: peft's
        # adapters, then the parameters classified) may be read across the two runs; each half repeats
        # within its own run
        cuts = [j for j in range(j1 + 1, j2) if (template.ops[j][0] == _R) != (template.ops[j - 1][0] == _R)]
        if len(cuts) == 1:
            out.extend([(j1, cuts[0]), (cuts[0], j2)])
        else:
            out.append((j1, j2))
    if any(template.ops[j][0] == _P for a, b in out for j in range(a, b)):
        raise TraceFailed("one more layer adds a phase")
    return out


def _expanded(tokens: np.ndarray, chunks: list[tuple[int, int]], reps: int) -> tuple[np.ndarray, list[int]]:
    """``tokens`` with each chunk written ``reps`` times, and where each chunk starts in the result."""
    parts, starts, at, shift = [], [], 0, 0
    for a, b in chunks:
        parts.append(tokens[at:a])
        starts.append(a + shift)
        parts.extend([tokens[a:b]] * reps)
        shift += (reps - 1) * (b - a)
        at = b
    parts.append(tokens[at:])
    return np.concatenate(parts) if parts else tokens, starts


def place_chunks(template: np.ndarray, chunks: list[tuple[int, int]], target: np.ndarray,
                 reps: int) -> list[tuple[int, int]] | None:
    """Where each added stretch of ``template`` really is one layer. The difference of two depths says
    what one more layer adds, but a stretch inside a run of alike layers can be read at several offsets
    (shifted while the event leaving it equals the one entering it), and one read across the end of one
    run and the start of the next (the optimizer's per-tensor temporaries, then its frees) is two
    stretches, and two read with a few events of another layer between them are one. Chunk by chunk, left
    to right, each is shifted, cut in two, or joined with the next, until ``template`` with every chunk
    repeated ``reps`` times reads as ``target`` (a trace with that many more layers) past it. None: no
    placement does."""

    def mismatch(ch: list[tuple[int, int]]) -> int:
        got, _ = _expanded(template, ch, reps)
        n = min(len(got), len(target))
        bad = np.flatnonzero(got[:n] != target[:n])
        return int(bad[0]) if len(bad) else (n if len(got) != len(target) else -1)

    def done_past(ch: list[tuple[int, int]], c: int) -> bool:
        m = mismatch(ch)
        if m < 0:
            return True
        _, starts = _expanded(template, ch, reps)
        a, b = ch[c]
        return m >= starts[c] + reps * (b - a)

    def shifted(ch: list[tuple[int, int]], c: int, right: bool = True) -> list[tuple[int, int]] | None:
        a, b = ch[c]
        lo = ch[c - 1][1] if c else 0
        hi = ch[c + 1][0] if c + 1 < len(ch) else len(template)
        options = [0]
        k = 1
        while right and b + k - 1 < hi and template[a + k - 1] == template[b + k - 1]:
            options.append(k)
            k += 1
        k = -1
        while a + k >= lo and template[a + k] == template[b + k]:
            options.append(k)
            k -= 1
        for k in sorted(options, key=abs):
            trial = ch[:c] + [(a + k, b + k)] + ch[c + 1:]
            if done_past(trial, c):
                return trial
        return None

    def merged(ch: list[tuple[int, int]], c: int) -> list[tuple[int, int]] | None:
        """Chunks c and c + 1 as one stretch of their joint length that removes the same events."""
        (a1, b1), (a2, b2) = ch[c], ch[c + 1]
        length = (b1 - a1) + (b2 - a2)
        lo = ch[c - 1][1] if c else 0
        hi = ch[c + 2][0] if c + 2 < len(ch) else len(template)
        rest = np.concatenate((template[lo:a1], template[b1:a2], template[b2:hi]))
        for w in range(lo, hi - length + 1):
            if np.array_equal(np.concatenate((template[lo:w], template[w + length:hi])), rest):
                trial = ch[:c] + [(w, w + length)] + ch[c + 2:]
                if done_past(trial, c):
                    return trial
        return None

    chunks = list(chunks)
    c = 0
    while c < len(chunks):
        found = shifted(chunks, c)
        step = 1
        if found is None:  # cut in two where the events change, each part placed on its own
            a, b = chunks[c]
            for p in range(a + 1, b):
                if template[p] == template[p - 1]:
                    continue
                first = shifted(chunks[:c] + [(a, p), (p, b)] + chunks[c + 1:], c, right=False)
                found = shifted(first, c + 1) if first is not None else None
                if found is not None:
                    step = 2
                    break
        if found is None and c + 1 < len(chunks):  # two stretches with a few events between: one layer
            found = merged(chunks, c)
        if found is None:
            return None
        chunks = found
        c += step
    return chunks


_WARM: set[tuple[str, str]] = set()


@dataclasses.dataclass
class Plan:
    """What to trace: the model (spec, and its transformers config for an architecture only traced),
    the recipe, and which sizes stay symbolic with the sequence values to fit them at."""

    spec: ModelSpec
    setup: TrainingSetup
    config_json: str
    layers: int
    symbolic: tuple[bool, bool, bool]
    s_fit: tuple[int, ...]  # the sequence lengths to fit at (one: the sequence is fixed)
    s_check: int
    kept: int = 0  # last layers kept at their full count in every run (a freeze recipe's trained layers)


def trace_fitted(plan: Plan, progress: Progress | None = None,
                 should_abort: Callable[[], bool] | None = None) -> dict[bool, TracedTape | TraceFailed]:
    """Trace ``plan`` at reduced depth over enough points to fit every size, verify at a further point
    (and one more layer), and return the tape of the full model as CUDA runs it (``True``) and as the
    simulation does (``False``), each a tape or the TraceFailed saying why there is none."""
    if plan.spec.vision is not None and plan.spec.vision.traced:  # a whole VLM: its tower reduced too
        from vramlab.core.tracing.vlm_traced import trace_fitted_with_tower

        made = trace_fitted_with_tower(plan, progress, should_abort)
        if made is not None:
            return made
    uneven = _uneven_layers(plan)
    if uneven:
        raise TraceFailed(uneven)
    t0 = time.perf_counter()
    setup = plan.setup
    sym_b, _sym_s, sym_r = plan.symbolic
    n = plan.layers - plan.kept  # the layers that repeat (depths below count these; plan.kept more follow)
    depth = min(n, 3)
    cols = basis(plan.symbolic)
    bs = B_FIT if sym_b else (setup.micro_batch,)
    rs = R_FIT if sym_r else (setup.lora_rank,)
    candidates = [(b, s, r) for r in rs for s in plan.s_fit for b in bs]
    points = choose_points(candidates, cols)
    # traced: the points that determine every tensor dimension; the sizes at the others follow from those
    # (traced too where they do not, or the tape they give fails its verification)
    ran = choose_points(points, dim_basis(plan.symbolic))
    check = (B_CHECK if sym_b else setup.micro_batch, plan.s_check, R_CHECK if sym_r else setup.lora_rank)
    total_runs = len(ran) + (1 if n > 3 else 0) + 1
    done = 0

    def run(d: int, p: tuple[int, int, int], steps: int = 2) -> tuple[Trace, Trace]:
        nonlocal done
        if progress is not None:
            progress(f"tracing {d + plan.kept} layers at batch {p[0]}, sequence {p[1]}"
                     + (f", rank {p[2]}" if setup.uses_lora else ""), min(done / total_runs, 0.99))
        out = trace_both(plan.spec, setup, Point(d + plan.kept, *p), plan.config_json, should_abort, steps=steps)
        done += 1
        return out

    key = (plan.config_json or repr(plan.spec), repr(setup))
    cold = key not in _WARM
    if cold and len(ran) < 2:
        # the first run of a model class in a process may allocate or free a few load-time temporaries that
        # every later run does not (what it imports on first use): with nothing to compare it with, one
        # throw-away layer first, so that the runs compared have the same form
        trace_both(plan.spec, setup, Point(1 + plan.kept, *points[0]), plan.config_json, should_abort)
    _WARM.add(key)
    template = run(depth, points[0])
    # the other points of `ran` run the first optimizer step only: its events are the template's first ones,
    # and each allocation of the second step has the size of the one it repeats (step_one_sources)
    sources = [step_one_sources(template[v]) for v in (0, 1)]
    first = {p: run(depth, p, steps=1) for p in ran[1:]} if None not in sources else {}
    if cold and first and not all(_prefix_of(first[ran[1]][v], template[v]) for v in (0, 1)):
        template = run(depth, points[0])  # the first run was not of the later runs' form: once more, warm
        sources = [step_one_sources(template[v]) for v in (0, 1)]
    low = run(2, points[0]) if n > 3 else None
    verify = run(4 if n > 3 else depth, check)
    full = {points[0]: template}  # two-step runs at every point (the fallback, and where ran is all there is)

    def fit(v: int) -> TracedTape:
        lower = low[v] if low else None
        if len(full) == len(points):  # every point traced: the sizes as measured
            runs = [full[p][v] for p in points]
            for tr, p in zip(runs[1:], points[1:]):
                if tr.structure() != runs[0].structure():
                    raise TraceFailed(f"the step changes form between batch/sequence/rank {points[0]} and {p}")
            return _fit(plan, points, points, check, runs, np.array([tr.sizes for tr in runs], dtype=np.int64),
                        lower, verify[v], time.perf_counter() - t0)
        tpl, src = template[v], sources[v]
        runs = [first[p][v] for p in ran[1:]]
        if src is None or not all(_prefix_of(tr, tpl) for tr in runs):
            raise TraceFailed("the first optimizer step changes form between the points")
        dims = [tpl.dims, *([tr.dims[a] for a in src] for tr in runs)]
        sizes = sizes_from_dims(dims, ran, points, dim_basis(plan.symbolic))
        return _fit(plan, points, ran, check, [tpl, *runs], sizes, lower, verify[v], time.perf_counter() - t0)

    if not first and len(points) > 1:  # no second step to read from the first: two steps at every point
        total_runs += len(points) - len(ran)
        full.update({p: run(depth, p) for p in points[1:]})
        if cold and any(full[points[1]][v].structure() != template[v].structure() for v in (0, 1)):
            template = full[points[0]] = run(depth, points[0])  # as above: the first run once more, warm
    out: dict[bool, TracedTape | TraceFailed] = {}
    for v, cuda in enumerate((True, False)):
        try:
            out[cuda] = fit(v)
        except TraceFailed as e:
            out[cuda] = e
    failed = [v for v, cuda in enumerate((True, False)) if isinstance(out[cuda], TraceFailed)]
    if failed and len(full) < len(points):  # as before: two steps at every point, the sizes as measured
        total_runs += len(points) - 1
        full.update({p: run(depth, p) for p in points[1:]})
        for v in failed:
            cuda = (True, False)[v]
            try:
                out[cuda] = fit(v)
            except TraceFailed as e:
                out[cuda] = e
    if progress is not None:
        progress("traced", 1.0)
    return out


def _uneven_layers(plan: Plan) -> str | None:
    """Why the model's layers cannot be fitted at reduced depth (None: they can). The fit runs its first three
    layers and two, and repeats the third for the rest, so every layer from the third on must be alike (class,
    ``layer_types`` entry, parameter shapes): a stack that starts with other layers (DeepSeek's dense ones) is
    fitted, one that interleaves kinds (Gemma 3's full-attention layer every six, LFM2's attention among
    convolutions) was cut to its first layers and the others silently left out. Read from the full model built
    on the meta device."""
    from vramlab.core.tracing import hf as hfmod

    try:
        cfg = hf_config_at(plan.config_json, plan.layers) if plan.config_json else \
            hfmod.hf_config(plan.spec, plan.setup.attention)
        stacks = hfmod.plan_depth(hfmod.task_of(cfg)).full_layers
    except (SetupError, TraceFailed, ValueError, TypeError, KeyError, AttributeError, RuntimeError):
        return None  # the trace itself says what it cannot build
    for name, sigs in stacks.items():
        kinds = list(dict.fromkeys(sigs[2:]))
        if len(kinds) > 1:
            shown = ", ".join(str(k[1] or k[0]) for k in kinds) if len({k[1] or k[0] for k in kinds}) > 1 \
                else f"{len(kinds)} parameter layouts"
            return (f"the layers of {name} are not all alike from the third on ({shown}): one more layer cannot "
                    "stand for the rest")
    return None


def _prefix_of(run: Trace, template: Trace) -> bool:
    """Whether ``run`` (the first optimizer step) has the form of the start of ``template`` (two steps)."""
    return run.ops == template.ops[:len(run.ops)] and run.phases == template.phases[:len(run.phases)] \
        and len(run.ops) < len(template.ops) and template.ops[len(run.ops)][0] == _P


def step_one_sources(template: Trace) -> list[int] | None:
    """For each allocation of ``template`` (two optimizer steps), the allocation of the first step whose size
    it has: itself within the first step; for the second step's, the allocation at the same place of the first
    step's phase of the same kind (each phase of the second step aligned with its counterpart, event by event;
    the optimizer's first step also creates its states). None where an allocation of the second step has no
    counterpart (the tape is then fitted from two-step runs)."""
    segments: list[tuple[str, int, int]] = []  # (phase, first op, end op)
    for i, (op, _a, _k, _nk, ph) in enumerate(template.ops):
        if op == _P:
            if segments:
                segments[-1] = (*segments[-1][:2], i)
            segments.append((template.phases[ph], i + 1, len(template.ops)))
    steps: dict[int, list[tuple[str, int, int]]] = {}
    for name, a, b in segments:
        kind, _, step = name.partition("@")
        if step.isdigit():
            steps.setdefault(int(step), []).append((kind, a, b))
    if sorted(steps) != [1, 2]:
        return None
    sources = list(range(len(template.sizes)))
    tokens = template.tokens()

    def same(j: int) -> tuple:  # an event without its phase's name (which names the step)
        op, k, nk, _ph, size = tokens[j]
        return op, k, nk, size

    one, two = steps[1], steps[2]
    if [k for k, _, _ in one] != [k for k, _, _ in two]:
        return None
    for (_, a1, b1), (_, a2, b2) in zip(one, two):
        matcher = difflib.SequenceMatcher(None, [same(j) for j in range(a2, b2)], [same(j) for j in range(a1, b1)],
                                          autojunk=False)
        mapped: dict[int, int] = {}
        for tag, i1, i2, j1, _j2 in matcher.get_opcodes():
            if tag == "equal":
                mapped.update({a2 + i: a1 + j1 + (i - i1) for i in range(i1, i2)})
        for j in range(a2, b2):
            op, alloc = template.ops[j][:2]
            if op != _A:
                continue
            there = mapped.get(j)
            if there is None:
                return None
            sources[alloc] = template.ops[there][1]
    return sources


def _fit(plan: Plan, points: list[tuple[int, int, int]], ran: list[tuple[int, int, int]], check: tuple[int, int, int],
         traces: list[Trace], sizes: np.ndarray, low: Trace | None, verify: Trace, seconds: float) -> TracedTape:
    """The tape from ``traces`` (run at ``ran``; the first, at the first of ``points``, is the template, whose
    form the others have) and ``sizes`` (every allocation's size at each of ``points``), verified against
    ``verify``."""
    setup = plan.setup
    n = plan.layers - plan.kept
    depth = min(n, 3)
    sym_r = plan.symbolic[2]
    template = traces[0]
    if any(tr.managed_bytes for tr in traces):
        raise TraceFailed("paged optimizer states are not traced")
    chunks = _chunks(low, template) if low is not None else []
    coef = solve_exact(points, basis(plan.symbolic), sizes)
    # parameters: the template's, one layer's difference repeated (LoRA: adapters scale with the rank)
    total_at = functools.partial(_extend, template.total_params, low.total_params if low else 0, depth=depth)
    lora = setup.uses_lora and sym_r
    if lora:
        by_rank = {p[2]: tr.trainable_params for p, tr in zip(ran, traces)}
        r1, r2 = sorted(by_rank)[:2]
        per_rank, rem = divmod(by_rank[r2] - by_rank[r1], r2 - r1)
        base = by_rank[r1] - per_rank * r1
        layer, rem2 = divmod(template.trainable_params - low.trainable_params, points[0][2]) if low else (0, 0)
        if rem or rem2:
            raise TraceFailed("trainable parameters are not proportional to the LoRA rank")

        def trainable_at(d: int, r: int) -> int:
            return base + (per_rank + (d - depth) * layer) * r
    else:
        def trainable_at(d: int, r: int) -> int:
            return _extend(template.trainable_params, low.trainable_params if low else 0, d, depth)
    # verify at a point not fitted, with one more layer than the template where the model has it
    vdepth = 4 if n > 3 else depth
    codes: dict[tuple, int] = {}
    expect = np.array([codes.setdefault(t, len(codes)) for t in template.tokens(_values(coef, *check))])
    got = np.array([codes.setdefault(t, len(codes)) for t in verify.tokens()])
    placed = place_chunks(expect, chunks, got, vdepth - 2) if chunks else \
        ([] if np.array_equal(expect, got) else None)
    where = f"batch {check[0]}, sequence {check[1]}" + (f", rank {check[2]}" if setup.uses_lora else "")
    if placed is None:
        raise TraceFailed(f"the fitted tape differs from a trace at {where} ({vdepth + plan.kept} layers)")
    chunks = placed
    if (verify.total_params, verify.trainable_params) != (total_at(vdepth), trainable_at(vdepth, check[2])):
        raise TraceFailed("the parameter counts of one more layer do not follow the fitted ones")
    tag = np.full(len(template.ops), -1, dtype=np.int64)
    for j, (a, b) in enumerate(chunks):
        tag[a:b] = j
    mult = {j: n - 2 for j in range(len(chunks))}
    base, per_rank = trainable_at(n, 0), (trainable_at(n, 1) - trainable_at(n, 0) if lora else 0)
    return _tape(template, coef, tag, mult, plan.symbolic, total_at(n), base, per_rank, FITTED,
                 f"fitted at {len(ran)} points ({depth + plan.kept} and {(2 if n > 3 else depth) + plan.kept} "
                 f"layers{_kept_note(plan)}), verified at {where} with {vdepth + plan.kept} layers", seconds)


def _kept_note(plan: Plan) -> str:
    return f", the last {plan.kept} trained in each and the frozen ones repeated" if plan.kept else ""


def _extend(at_depth: int, at_two: int, n: int, depth: int) -> int:
    return at_depth + (n - depth) * (at_depth - at_two) if n > depth else at_depth


def trace_direct(spec: ModelSpec, setup: TrainingSetup, config_json: str, reason: str,
                 progress: Progress | None = None,
                 should_abort: Callable[[], bool] | None = None) -> dict[bool, TracedTape]:
    """The full-depth model traced at exactly the setup's batch, sequence and rank (``simulate --hf``), as
    CUDA runs it (``True``) and as the simulation does (``False``)."""
    t0 = time.perf_counter()
    if progress is not None:
        progress(f"simulating all {spec.num_layers} layers at this point", 0.0)
    both = trace_both(spec, setup, Point(spec.num_layers, setup.micro_batch, setup.seq_len, setup.lora_rank),
                      config_json, should_abort)
    if progress is not None:
        progress("simulated", 1.0)
    out = {}
    for cuda, tr in zip((True, False), both):
        if tr.managed_bytes:
            raise TraceFailed("paged optimizer states are not traced")
        coef = np.zeros((len(tr.sizes), N), dtype=np.int64)
        coef[:, 0] = tr.sizes
        out[cuda] = _tape(tr, coef, np.full(len(tr.ops), -1, dtype=np.int64), {}, (False, False, False),
                          tr.total_params, tr.trainable_params, 0, DIRECT, reason, time.perf_counter() - t0)
    return out


def _tape(template: Trace, coef: np.ndarray, tag: np.ndarray, mult: dict[int, int],
          symbolic: tuple[bool, bool, bool], total: int, base: int, per_rank: int, mode: str, note: str,
          seconds: float) -> TracedTape:
    """The tape of ``template``'s events sized by ``coef``; its meta names the modules LoRA adapted."""
    import transformers

    rows = len(template.ops)
    out_coef = np.zeros((rows, N), dtype=np.int64)
    sign = np.zeros(rows, dtype=np.int64)
    kind = np.zeros(rows, dtype=np.int64)
    new_kind = np.zeros(rows, dtype=np.int64)
    phase = np.zeros(rows, dtype=np.int64)
    ref = np.full(rows, -1, dtype=np.int64)
    for i, (op, a, k, nk, ph) in enumerate(template.ops):
        phase[i] = ph
        if op == _P:
            sign[i] = 1
            continue
        out_coef[i] = coef[a]
        sign[i] = op
        kind[i] = k
        new_kind[i] = nk
        ref[i] = a
    meta: dict = {"lora_modules": list(template.adapted)} if template.adapted else {}
    if template.build_notes:
        meta["notes"] = list(template.build_notes)
    return TracedTape(out_coef, sign, kind, new_kind, tag, phase, ref, tuple(template.phases), mult, symbolic,
                      total, base, per_rank, mode, note, transformers.__version__, seconds, meta)


def supported(setup: TrainingSetup) -> str | None:
    """Why a recipe cannot be traced at reduced depth (None: it can). Freezing is: the trained last layers
    are kept at their full count in every run (``Plan.kept``) and the frozen ones before them repeat."""
    return None


__all__ = ["DIRECT", "FITTED", "SEQUENCE_FIXED", "Plan", "Point", "Recorder", "SetupError", "TraceFailed",
           "trace_both", "trace_direct", "trace_fitted", "trace_once"]
