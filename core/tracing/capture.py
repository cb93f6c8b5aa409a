"""The trace's capture: one run of transformers' own step under fake tensors, recorded.

:class:`Recorder` is the simulation's tracker that also keeps every allocation, free, reclassification and
phase mark as a row (and the rows as CUDA runs them: a second gradient added in place into an autograd input
buffer, LayerNorm's statistics in fp32); :func:`trace_both` builds the model at a point's depth and sizes
(:mod:`.hf`, or a whole vision-language model by :mod:`.vlm_traced`), runs the step and returns the two
:class:`Trace` records. The fit over many points (:mod:`.trace`) and its exact solve (:mod:`.solve`) read them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from vramlab.core.checks import SetupError
from vramlab.core.estimator.engine import KIND_INDEX
from vramlab.core.families import piece
from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.simulation.step import Aborted, measure, preload
from vramlab.core.simulation.tracker import MemoryTracker
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

ALLOC, FREE, RECLASSIFY, PHASE = 1, -1, 0, 2  # a row's op: allocate, free, reclassify, phase mark


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
        self.rows.append([ALLOC, serial, nbytes, None] if nbytes > 0 else [FREE, serial])


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
        self._serials: dict[int, tuple[int, weakref.ref]] = {}  # a storage's row, while that storage lives
        self.resized = False
        self.between_nodes = False  # the autograd engine is between two nodes (accumulating gradients)
        self.accumulations: list[tuple[int, int | None, int | None]] = []  # (sum, old, new) serials
        self.fp32_on_cuda: set[int] = set()  # LayerNorm statistics kept in the input dtype here
        self.shapes: dict[int, tuple[int, ...]] = {}  # an allocation's tensor shape, where it fills the storage

    def finish(self) -> None:
        """The step's events end here: what goes after it (the last step's held micro-batches, when the step's
        frame returns; the model's teardown) is not recorded."""
        super().finish()
        self.alloc_log.rows = []

    def set_phase(self, phase, step: int = 0) -> None:  # noqa: ANN001
        gc.collect()  # garbage in reference cycles goes at phase boundaries, not whenever Python's gc runs
        super().set_phase(phase, step)
        self.rows.append([PHASE, self.phase_name])

    def restart_phase_peak(self) -> None:
        """The tracker forgets the phase's peak so far (a construction transient a real load does not have:
        from_config's untied head before tying). A tape cannot forget a peak, so it forgets the events: what
        was allocated and freed in this phase before now. What is still alive stays, so the level after this
        point is unchanged and the phase's peak before it is that level, as the tracker has it."""
        super().restart_phase_peak()
        start = max((i for i, row in enumerate(self.rows) if row[0] == PHASE), default=0)
        here = self.rows[start:]
        allocated = {row[1] for row in here if row[0] == ALLOC}
        gone = allocated & {row[1] for row in here if row[0] == FREE}
        self.rows[start:] = [row for row in here if row[0] == PHASE or row[1] not in gone]

    def serial_of(self, t: object) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        try:
            st = t.untyped_storage()
            serial, ref = self._serials.get(id(st), (None, None))
            return serial if ref is not None and ref() is st else None  # (a freed storage's id() is reused)
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
        new = {row[1]: row for row in self.rows[start:] if row[0] == ALLOC}
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
        if len(self.rows) > before and self.rows[-1][0] == ALLOC and self.rows[-1][3] is None:
            row = self.rows[-1]
            row[3] = self.kind_of(t)
            st = t.untyped_storage()
            self._serials[id(st)] = (row[1], weakref.ref(st))
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
                self.rows.append([RECLASSIFY, serial, kind])

    def cuda_rows(self) -> list[list]:
        """The rows with each out-of-place gradient accumulation made in place, as CUDA runs it: the
        autograd engine's ``old + new`` (then ``old`` and ``new`` freed when unshared) becomes an in-place
        add into whichever of the two it held the last reference to (torch's InputBuffer::accumulate),
        so the sum is never allocated and that addend lives on in its place."""
        rows = [[ALLOC, r[1], r[2] * 2, r[3]] if r[0] == ALLOC and r[1] in self.fp32_on_cuda else r for r in self.rows]
        if not self.accumulations:
            return rows
        size = {row[1]: row[2] for row in rows if row[0] == ALLOC}
        position = {row[1]: i for i, row in enumerate(rows) if row[0] == ALLOC}
        drop: set[int] = set()
        rename: dict[int, int] = {}
        for total, old, new in self.accumulations:
            i = position.get(total)
            if i is None:
                continue
            freed: list[int] = []
            j = i + 1
            while j < len(rows) and rows[j][0] == FREE and len(freed) < 2:
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
            if row[0] in (FREE, RECLASSIFY) and row[1] in rename:
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
        if op == PHASE:
            phases.append(row[1])
            ops.append((PHASE, -1, 0, 0, len(phases) - 1))
            continue
        ph = max(len(phases) - 1, 0)
        serial = row[1]
        if op == ALLOC:
            index[serial] = len(sizes)
            sizes.append(int(row[2]))
            shape = shapes.get(serial)
            numel = math.prod(shape) if shape is not None else 0  # exact; np.prod: 6 µs a tuple, 40x more
            dims.append((sizes[-1] // numel, shape) if numel and sizes[-1] % numel == 0 else None)
            kind_now[serial] = KIND_INDEX[row[3]]
            ops.append((ALLOC, index[serial], kind_now[serial], 0, ph))
        elif serial not in index:
            continue  # a storage made before the tracker started (never counted)
        elif op == FREE:
            ops.append((FREE, index[serial], kind_now[serial], 0, ph))
        else:
            nk = KIND_INDEX[row[2]]
            ops.append((RECLASSIFY, index[serial], kind_now[serial], nk, ph))
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
    from vramlab.core.tracing.hfconfig import layer_counts, with_depth

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


def trace_both(spec: ModelSpec, setup: TrainingSetup, point: Point, config_json: str = "",
               should_abort: Callable[[], bool] | None = None, vision_depth: int | None = None,
               steps: int = 2) -> tuple[Trace, Trace]:
    """Run the step of ``spec`` at ``point`` (depth and sizes) under fake tensors and record it as CUDA runs it
    and as the simulation itself does, from one run (of ``steps`` optimizer steps: the tape's two, or the first
    alone)."""
    from vramlab.core.tracing import hf as hfmod
    from vramlab.core.tracing.hflora import NoTargetModule

    reduced = dataclasses.replace(spec, num_layers=point.depth)
    at = setup.replace(micro_batch=point.b, seq_len=point.s, lora_rank=point.r)
    cfg = hf_config_at(config_json, point.depth) if config_json else None
    rec = Recorder()
    builder = functools.partial(hfmod.build_hf, config=cfg)
    guard = hfmod.guard(at)
    if spec.vision is not None and spec.vision.traced:  # a vision-language model traced whole
        builder, guard = _vlm_builder(spec, at, point, config_json, vision_depth)
    elif spec.vision is not None:  # a hand-written family's classes (its reference), as simulate runs them
        reference = piece(spec.vision.model_type, "reference")
        builder, guard = functools.partial(reference.build, config=cfg), reference.guard(at)
    adapted: list[str] = []

    def build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the builder's own arguments
        model = builder(*args, **kwargs)
        adapted[:] = adapted_names(model)
        return model
    preload(at)
    with context.exclusive():  # one measured step at a time in the process (core/simulation/context.py)
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
        except NoTargetModule as e:
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
    from vramlab.core.tracing.hflora import param_wrapped

    out = dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper))
    return [*out, *param_wrapped(model)]


def _vlm_builder(spec: ModelSpec, setup: TrainingSetup, point: Point, config_json: str,
                 vision_depth: int | None) -> tuple[Callable, object]:
    """The builder and guard of a vision-language model traced whole (:mod:`.vlm_traced`): its language model
    at the point's depth, its tower at ``vision_depth`` blocks (None: whole), the processor's batch for the
    setup's images."""
    from vramlab.core.tracing import vlm_traced

    cfg = vlm_traced.config_from_json(config_json or spec.transformers_config, text_depth=point.depth,
                                      vision_depth=vision_depth)
    return functools.partial(vlm_traced.build, config=cfg), vlm_traced.guard(setup, spec)


WARM: set[tuple[str, str]] = set()  # (model, recipe) pairs traced once in this process: their first run is done
