"""The fast simulation: the built-in builder's step on meta tensors, dispatching as fake CPU tensors do.

``simulate(fast=False)`` runs the step under ``FakeTensorMode`` with the model on the CPU: every ATen op
passes through FakeTensor's Python dispatch (cache key, output construction, a ``prim.device`` query each
time C++ asks a tensor for its device), about 70 µs an op, most of a simulation's time. Meta tensors carry
the same shapes, dtypes, strides and storages, and FakeTensor itself computes every output with the op's
meta kernel; on the meta device the tracker (:class:`MetaTracker`) is the only Python left per op, and
answers most ops from an op cache (below) without running their kernel.

Where a fake tensor says "cpu" and a meta tensor says "meta", torch takes other roads:

* composite code that picks a kernel by the device type: ``F.scaled_dot_product_attention`` (the CPU flash
  kernel where it applies, the math decomposition on meta). :func:`.composite.sdpa` runs the composite once per input
  layout on fake CPU tensors, records the ATen ops it dispatches and when each temporary died, and replays
  that on the meta tensors;
* meta kernels that branch on the device type (LayerNorm's statistics: the input dtype on the CPU, fp32
  elsewhere): the op cache takes every output layout from FakeTensorMode on fake CPU tensors;
* ``torch.tensor(data, device="meta")`` dispatches nothing where the CPU dispatches ``lift_fresh``, which
  the tracker counts (:class:`_TensorLiterals` counts it the same way).

What FakeTensorMode answers here (an op key's output layouts, the ops of an attention call, and whether an
in-place kernel changed what it writes) is kept on disk by :mod:`.fakeref` for later processes on the same
torch build: a setup simulated before asks it nothing, and so never pays for importing ``torch._dynamo``.

``benchmarks/simulate_identity.py`` holds the two paths equal, event by event, over the accuracy matrix,
the published setups and the objectives; ``tests/test_simulate_fast.py`` over a few varied setups. A step
that cannot run on meta tensors (torch's fused AdamW refuses meta parameters; an op the fake and the meta
kernel disagree on) is run on fake tensors by :func:`vramlab.core.simulation.simulate.simulate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from vramlab.core.simulation import context
from vramlab.core.simulation.composite import META, Unsupported
from vramlab.core.simulation.fakeref import MISSING, STORE
from vramlab.core.simulation.step import PhaseCallback, StepRun, measure
from vramlab.core.simulation.tracker import CUDA_BLOCK, MemoryTracker
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

# ---- the op cache ------------------------------------------------------------------------------------------
# A kernel's output metadata is a function of the op, its arguments' metadata and its non-tensor arguments
# (FakeTensor's dispatch cache rests on the same fact). On a first sight of a key, a functional op runs
# under FakeTensorMode on fake CPU tensors of its arguments' metadata: exactly what the reference does for
# it (meta kernels that branch on the device type, e.g. LayerNorm's statistics, in the input dtype on the
# CPU and in fp32 elsewhere, answer as for the CPU). Its outputs are then made with ``empty_strided`` of
# that metadata, then and on every later sight of the key. An in-place op (every output is one of the
# arguments it writes) that changed no argument's metadata or storage size is answered by returning those
# arguments (its kernel only checked shapes). Views, ops on non-meta tensors (host step counters whose
# values are read) and anything else run their kernel every time; an output the fake and the meta kernel
# disagree on that cannot be made fresh refuses (the caller then runs the whole step on fake tensors).
# FakeTensorMode's layout for a key, and an in-place kernel's verdict for a key and the storage sizes it
# wrote, are taken from :mod:`.fakeref` where an earlier process on this torch build found them.

class _NoKey(Exception):
    pass


_OUTPUT_CACHE: dict[torch.dtype, dict[tuple, object]] = {}  # per default dtype: key -> what to answer
_CACHE_LIMIT = 200_000  # keys (a 70B step has a few hundred)
_MISS = object()  # run the kernel (checked once against the fake kernel)
_UNCHANGED = object()  # in place, nothing resized: return the written arguments
_FRESH = "fresh"
_PLANS: dict[int, object] = {}  # id(op) -> _FRESH | ("in place", written args, returned args) | None
_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_TENSOR_RETURNS = {"Tensor", "Optional[Tensor]", "List[Tensor]"}


def _plan(func: Any) -> object:
    try:
        return _PLANS[id(func)]  # ops live as long as the process: their id is their name (and hashes fast)
    except KeyError:
        pass
    schema = func._schema
    params = schema.arguments
    plan: object = None
    if any(str(r.type) not in _TENSOR_RETURNS for r in schema.returns):
        plan = None  # a number, a profiler record, ...: no memory, run it
    elif all(a.alias_info is None for a in params) and all(r.alias_info is None for r in schema.returns):
        plan = _FRESH
    else:
        written = tuple((i, a.name) for i, a in enumerate(params) if a.alias_info is not None and a.alias_info.is_write)
        views = any(a.alias_info is not None and not a.alias_info.is_write for a in params)
        returned = []
        for r in schema.returns:
            ai = r.alias_info
            match = [(i, n) for i, n in written if ai is not None and ai.is_write
                     and params[i].alias_info.before_set == ai.before_set]
            returned.append(match[0] if len(match) == 1 else None)
        if written and not views and None not in returned:
            plan = ("in place", written, tuple(returned))
    _PLANS[id(func)] = plan
    return plan


def _leaf(a: object) -> object:
    if isinstance(a, torch.Tensor):
        if not a.is_meta:
            raise _NoKey
        return (a.shape, a.stride(), a.storage_offset(), a.dtype)
    if a is None:
        return None
    if isinstance(a, _SCALARS):
        return (type(a), a)
    if isinstance(a, (list, tuple)):  # a foreach op's hundreds of tensors: inline, as in op_key
        out = []
        for x in a:
            if isinstance(x, torch.Tensor):
                if not x.is_meta:
                    raise _NoKey
                out.append((x.shape, x.stride(), x.storage_offset(), x.dtype))
            else:
                out.append(_leaf(x))
        return tuple(out)
    raise _NoKey  # SymInt, a generator, anything else: run the kernel


def op_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The cache key of a functional or in-place op on meta tensors, or None (not cacheable)."""
    if _plan(func) is None:
        return None
    key: list = [id(func)]
    try:
        for a in args:
            if isinstance(a, torch.Tensor):  # the usual argument, inline
                if not a.is_meta:
                    return None
                key.append((a.shape, a.stride(), a.storage_offset(), a.dtype))
            else:
                key.append(_leaf(a))
        for k, v in kwargs.items():
            key.append(k)
            key.append(_leaf(v))
    except _NoKey:
        return None
    return tuple(key)


def _arg(i: int, name: str, args: tuple, kwargs: dict) -> object:
    return args[i] if i < len(args) else kwargs.get(name)


def _sizes(x: object) -> object:
    """Metadata and storage size of a written argument (a tensor or a list of them)."""
    if isinstance(x, torch.Tensor):
        return (_leaf(x), x.untyped_storage().nbytes())
    if isinstance(x, (list, tuple)):
        return tuple(_sizes(t) for t in x)
    return x


def _layout(out: object, args: tuple, kwargs: dict) -> object:
    """Each output tensor's (shape, stride, dtype, storage offset, storage bytes, aliased argument or None),
    or None where an output is not a plain tensor."""
    if isinstance(out, torch.Tensor):
        outs, kind = (out,), None
    elif isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        outs, kind = out, type(out)
    else:
        return None
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    storages = {id(t.untyped_storage()): i for i, t in enumerate(inputs)}
    specs = []
    for t in outs:
        if t is None:
            specs.append(None)
            continue
        if t.layout is not torch.strided or t.is_sparse:
            return None
        st = t.untyped_storage()
        specs.append((tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), st.nbytes(), storages.get(id(st))))
        storages.setdefault(id(st), -1 - len(specs))  # two outputs sharing a storage show it
    return kind, tuple(specs)


def _on_fake(func: Any, args: tuple, kwargs: dict) -> object:
    """The layout of ``func``'s outputs as the reference computes it: on fake CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        offset = x.storage_offset()
        extent = offset + 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n) if x.numel() else offset
        return torch.empty(extent, dtype=x.dtype).as_strided(x.shape, x.stride(), offset)

    with FakeTensorMode(allow_non_fake_inputs=False):
        fargs, fkwargs = tree_map(fake, args), tree_map(fake, kwargs)
        out = func(*fargs, **fkwargs)
        return _layout(out, fargs, fkwargs)


def _fresh(layout: object) -> object:
    """What ``remake`` makes for outputs that are fresh, offset-free storages of exactly their extent, or
    None."""
    kind, specs = layout
    made = []
    for spec in specs:
        if spec is None:
            made.append(None)
            continue
        shape, stride, dtype, offset, nbytes, aliased = spec
        if offset or aliased is not None or _make((shape, stride, dtype)).untyped_storage().nbytes() != nbytes:
            return None
        made.append((shape, stride, dtype))
    return made[0] if kind is None else (kind, tuple(made))


def _reference(func: Any, args: tuple, kwargs: dict, key: tuple) -> object:
    """:func:`_on_fake`'s answer for ``key``: kept from an earlier process on this torch build (see
    :mod:`.fakeref`), else asked now and kept."""
    stored = ("op", str(torch.get_default_dtype()), str(func), key[1:])  # key[0] is id(func)
    reference = STORE.get(stored)
    if reference is MISSING:
        reference = _on_fake(func, args, kwargs)
        STORE.put(stored, reference)
    return reference


def _first_sight(func: Any, args: tuple, kwargs: dict, key: tuple) -> tuple[object, object]:
    """Run a functional op whose key is new: (its outputs, what to answer for the key from now on)."""
    reference = _reference(func, args, kwargs, key)
    desc = _fresh(reference) if reference is not None else None
    if desc is not None:
        return remake(desc), desc
    out = func(*args, **kwargs)  # a view in disguise (_unsafe_view), no tensor out: the meta kernel, if it agrees
    if _layout(out, args, kwargs) != reference:
        raise Unsupported(f"{func} gives another layout on meta tensors than on the CPU")
    return out, _MISS


def _make(spec: tuple) -> torch.Tensor:
    return torch.empty_strided(spec[0], spec[1], dtype=spec[2], device=META)


def remake(desc: object) -> object:
    if desc[0].__class__ is tuple:  # one tensor: (shape, stride, dtype)
        return _make(desc)
    kind, specs = desc
    outs = [None if s is None else _make(s) for s in specs]
    return kind(outs) if kind is list else tuple(outs)


def _returned(plan: tuple, args: tuple, kwargs: dict) -> object:
    returned = plan[2]
    if not returned:
        return None
    if len(returned) == 1:
        return _arg(*returned[0], args, kwargs)
    return tuple(_arg(i, n, args, kwargs) for i, n in returned)


def run_cached(func: Any, args: tuple, kwargs: dict) -> object:
    """``func(*args, **kwargs)``, answered from the op cache where the op is functional or in place on meta
    tensors and its key was seen."""
    key = op_key(func, args, kwargs)
    if key is None:
        return func(*args, **kwargs)
    default = torch.get_default_dtype()
    cache = _OUTPUT_CACHE.get(default)
    if cache is None:
        cache = _OUTPUT_CACHE.setdefault(default, {})
    desc = cache.get(key)
    if desc is None:
        if len(cache) > _CACHE_LIMIT:  # a long session of many setups: start again rather than grow
            cache.clear()
        plan = _plan(func)
        if plan is _FRESH:
            out, cache[key] = _first_sight(func, args, kwargs, key)
            return out
        written = [_arg(i, n, args, kwargs) for i, n in plan[1]]
        before = _sizes(written)
        # what the kernel did to these arguments (their storage sizes too) in an earlier process on this torch
        # build: a kernel that changed nothing is not run again there either (see :mod:`.fakeref`)
        stored = ("in place", str(default), str(func), key[1:], before)
        if STORE.get(stored) is True:
            cache[key] = _UNCHANGED
            return _returned(plan, args, kwargs)
        out = func(*args, **kwargs)
        same = _sizes(written) == before and _same_objects(out, _returned(plan, args, kwargs))
        cache[key] = _UNCHANGED if same else _MISS
        STORE.put(stored, same)
        return out
    if desc is _MISS:
        return func(*args, **kwargs)
    if desc is _UNCHANGED:
        return _returned(_plan(func), args, kwargs)
    return remake(desc)


def _same_objects(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


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
    if setup.grad_ckpt and not setup.ckpt_reentrant and not setup.ckpt_offload:
        # torch's non-reentrant checkpoint counts the tensors a recompute saves against the forward's; answered
        # from the op cache, a recompute saves fewer (CheckpointError), so the fake path runs these steps
        raise NotImplementedError("non-reentrant checkpointing runs on the fake path")
    tracker = MetaTracker(block=block, record_allocations=True)
    try:
        with context.exclusive(), _TensorLiterals(tracker):
            return measure(spec, setup, META, real=False, tracker=tracker, steps=steps, on_phase=on_phase,
                           should_abort=should_abort)
    finally:
        STORE.save()  # what FakeTensorMode answered, for the next process (the answers are right either way)
