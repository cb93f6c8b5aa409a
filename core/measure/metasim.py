"""The fast simulation: the built-in builder's step on meta tensors, dispatching as fake CPU tensors do.

``simulate`` runs the step under ``FakeTensorMode`` with the model on the CPU: every ATen op passes through
FakeTensor's Python dispatch (cache key, output construction, a ``prim.device`` query each time C++ asks a
tensor for its device), about 70 µs an op, most of a simulation's time. Meta tensors carry the same
shapes, dtypes, strides and storages, and FakeTensor itself computes every output by running the op's
meta kernel; on the meta device that kernel is reached without the Python layer, so the tracker (the
only Python left per op) sees the same outputs, storages, sizes and frees in the same order.

What differs is composite C++ code above the dispatcher that branches on the device type, where a fake
tensor says "cpu" and a meta tensor says "meta". The one our builder reaches is
``F.scaled_dot_product_attention``: it picks its kernel by the device type (on the CPU the flash kernel
``_scaled_dot_product_flash_attention_for_cpu`` where it applies, on meta the math decomposition). Here
attention is run by :func:`sdpa`: the composite is run once per distinct input metadata on fake CPU
tensors of that metadata, the ATen ops it dispatches are recorded, and the recording is replayed on the
meta tensors (every tensor an op takes is an input or an earlier op's output; anything else refuses).

``benchmarks/simulate_identity.py`` holds the two paths equal, event by event, over the accuracy matrix;
``tests/test_simulate_fast.py`` over a few varied setups. A run that fails on meta tensors (an op with no
meta kernel, a value read) is run again on fake tensors by :func:`vramlab.core.measure.simulate.simulate`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ..spec import ModelSpec, TrainingSetup
from .step import PhaseCallback, StepRun, measure
from .tracker import CUDA_BLOCK, MemoryTracker

META = torch.device("meta")


class Unsupported(Exception):
    """The meta path cannot reproduce the fake CPU path here (the caller runs the fake path)."""


# The ops a composite dispatched, in order: (func, args, kwargs, dead) with tensors replaced by _Ref(index
# into [inputs..., outputs in order of appearance]) and ``dead`` the indices of the intermediate tensors the
# composite dropped after this op (C++ frees a temporary where its scope ends, not at its last use); the
# result's _Ref.
_Program = tuple[tuple[tuple[Any, Any, Any, tuple[int, ...]], ...], Any]
_PROGRAMS: dict[tuple, _Program] = {}


class _Ref:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _meta_key(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad)


class _Recorder(TorchDispatchMode):
    """Records the ops a composite dispatches, with tensors named by where they came from, and when each
    tensor it made died (weak references: the recording must not keep them alive)."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.known: dict[int, int] = {id(t): i for i, t in enumerate(inputs)}
        self.count = len(inputs)
        self.refs: list[weakref.ref] = []
        self.ops: list[list] = []

    def ref(self, x: object) -> object:
        if isinstance(x, torch.Tensor):
            i = self.known.get(id(x))
            if i is None:
                raise Unsupported("attention used a tensor that none of its ops made")
            return _Ref(i)
        return x

    def _died(self, key: int, index: int) -> None:
        if self.known.get(key) == index:
            del self.known[key]
        self.ops[-1][3].append(index)  # a tensor is made by an op, so there is one

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        rargs, rkwargs = tree_map(self.ref, args), tree_map(self.ref, kwargs)
        out = func(*args, **kwargs)
        self.ops.append([func, rargs, rkwargs, []])
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self.known:
                index = self.count
                self.count += 1
                self.known[id(t)] = index
                self.refs.append(weakref.ref(t, functools.partial(self._died_ref, id(t), index)))
        return out

    def _died_ref(self, key: int, index: int, _ref: object) -> None:
        self._died(key, index)


def _record(inputs: list[torch.Tensor | None], call: Callable[..., torch.Tensor]) -> _Program:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=False):
        fakes = []
        for t in inputs:
            if t is None:
                fakes.append(None)
                continue
            offset = t.storage_offset()
            extent = offset + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n)
            base = torch.empty(extent if t.numel() else offset, dtype=t.dtype, device="cpu")
            fakes.append(base.as_strided(t.shape, t.stride(), offset).requires_grad_(t.requires_grad))
        present = [f for f in fakes if f is not None]
        rec = _Recorder(present)
        with rec:
            out = call(*fakes)
            # what died inside the composite; what dies from here on (its result, what autograd saved, the
            # temporaries it still held at its return) is released by the replay when it returns
            ops = tuple((func, args, kwargs, tuple(dead)) for func, args, kwargs, dead in rec.ops)
            result = rec.ref(out)
        del out
    return ops, result


def _replay(program: _Program, inputs: list[torch.Tensor]) -> torch.Tensor:
    ops, result = program
    values: list[torch.Tensor | None] = list(inputs)

    def value(x: object) -> object:
        return values[x.index] if isinstance(x, _Ref) else x

    for func, args, kwargs, dead in ops:
        out = func(*tree_map(value, args), **tree_map(value, kwargs))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and all(t is not v for v in values):
                values.append(t)
        del out
        for i in dead:
            values[i] = None
    return value(result)  # type: ignore[return-value]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on meta tensors, dispatching what it dispatches on CPU tensors."""
    import torch.nn.functional as F

    key = (_meta_key(q), _meta_key(k), _meta_key(v), _meta_key(attn_mask), dropout_p, is_causal, scale,
           enable_gqa, torch.is_grad_enabled(), torch.backends.cuda.flash_sdp_enabled(),
           torch.backends.cuda.math_sdp_enabled(), torch.is_autocast_enabled("cpu"))
    program = _PROGRAMS.get(key)
    if program is None:
        def call(q, k, v, m):  # noqa: ANN001, ANN202
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=scale, enable_gqa=enable_gqa)

        program = _record([q, k, v, attn_mask], call)
        _PROGRAMS[key] = program
    return _replay(program, [t for t in (q, k, v, attn_mask) if t is not None])


# ---- the op cache ------------------------------------------------------------------------------------------
# A meta kernel's outputs are a function of the op, its arguments' metadata and its non-tensor arguments
# (FakeTensor's dispatch cache rests on the same fact). Many of torch's meta kernels are Python
# (``torch._refs`` elementwise rules, ~150 µs an op); a functional op whose outputs are fresh storages is
# run once per distinct key and afterwards answered with ``empty_strided`` outputs of the recorded
# metadata. Views, in-place and out= ops (aliasing outputs), ops on non-meta tensors (host step counters
# whose values are read) and outputs that are not a plain fresh storage run their kernel every time.

class _NoKey(Exception):
    pass


_OUTPUT_CACHE: dict[torch.dtype, dict[tuple, object]] = {}  # per default dtype: key -> outputs or _MISS
_MISS = object()
_FUNCTIONAL: dict[object, bool] = {}
_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _functional(func: Any) -> bool:
    f = _FUNCTIONAL.get(func)
    if f is None:
        schema = func._schema
        f = not schema.is_mutable and all(r.alias_info is None for r in schema.returns) \
            and all(a.alias_info is None for a in schema.arguments)
        _FUNCTIONAL[func] = f
    return f


def _leaf(a: object) -> object:
    if isinstance(a, torch.Tensor):
        if not a.is_meta:
            raise _NoKey
        return (a.shape, a.stride(), a.storage_offset(), a.dtype)
    if a is None:
        return None
    if isinstance(a, _SCALARS):
        return (type(a), a)
    if isinstance(a, (list, tuple)):
        return tuple(_leaf(x) for x in a)
    raise _NoKey  # SymInt, a generator, anything else: run the kernel


def op_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The cache key of a functional op on meta tensors, or None (not cacheable)."""
    if not _functional(func):
        return None
    try:
        key = [func]
        key.extend(_leaf(a) for a in args)
        for k, v in kwargs.items():
            key.append(k)
            key.append(_leaf(v))
    except _NoKey:
        return None
    return tuple(key)


def describe_outputs(out: object, args: tuple, kwargs: dict) -> object:
    """How to remake ``out`` without running the kernel, or _MISS where empty_strided would not be it."""
    single = isinstance(out, torch.Tensor)
    if not single and not (isinstance(out, (tuple, list)) and all(
            o is None or isinstance(o, torch.Tensor) for o in out)):
        return _MISS
    inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    specs = []
    for t in ((out,) if single else out):
        if t is None:
            specs.append(None)
            continue
        if type(t) is not torch.Tensor or not t.is_meta or t.layout is not torch.strided or t.storage_offset():
            return _MISS
        st = t.untyped_storage()
        if id(st) in inputs:
            return _MISS
        inputs.add(id(st))
        spec = (tuple(t.shape), t.stride(), t.dtype)
        if _make(spec).untyped_storage().nbytes() != st.nbytes():
            return _MISS
        specs.append(spec)
    return specs[0] if single else (type(out), tuple(specs))


def _make(spec: tuple) -> torch.Tensor:
    return torch.empty_strided(spec[0], spec[1], dtype=spec[2], device=META)


def remake(desc: object) -> object:
    if desc[0].__class__ is tuple:  # one tensor: (shape, stride, dtype)
        return _make(desc)
    kind, specs = desc
    outs = [None if s is None else _make(s) for s in specs]
    return kind(outs) if kind is list else tuple(outs)


def run_cached(func: Any, args: tuple, kwargs: dict) -> object:
    """``func(*args, **kwargs)``, answered from the op cache where the op is functional on meta tensors."""
    key = op_key(func, args, kwargs)
    if key is None:
        return func(*args, **kwargs)
    cache = _OUTPUT_CACHE.get(torch.get_default_dtype())
    if cache is None:
        cache = _OUTPUT_CACHE.setdefault(torch.get_default_dtype(), {})
    desc = cache.get(key)
    if desc is None:
        out = func(*args, **kwargs)
        cache[key] = describe_outputs(out, args, kwargs)
        return out
    if desc is _MISS:
        return func(*args, **kwargs)
    return remake(desc)


class MetaTracker(MemoryTracker):
    """The memory tracker with its ops answered from the op cache."""

    run_op = staticmethod(run_cached)


_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_LITERALS = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}


class _TensorLiterals(TorchFunctionMode):
    """``torch.tensor(data, device="meta")`` makes its tensor without dispatching an op; on the CPU (a fake
    tensor) the same call dispatches ``lift_fresh``, whose output the tracker counts. Count it as that."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func in _LITERALS and isinstance(out, torch.Tensor) and out.is_meta:
            self.tracker._track(out, _LIFT_FRESH)
        return out


def measure_meta(spec: ModelSpec, setup: TrainingSetup, block: int = CUDA_BLOCK, steps: int = 2,
                 on_phase: PhaseCallback | None = None, should_abort: Callable[[], bool] | None = None) -> StepRun:
    """The built-in builder's measured step on meta tensors (raises where it cannot run there)."""
    tracker = MetaTracker(block=block, record_allocations=True)
    with _TensorLiterals(tracker):
        return measure(spec, setup, META, real=False, tracker=tracker, steps=steps, on_phase=on_phase,
                       should_abort=should_abort)
