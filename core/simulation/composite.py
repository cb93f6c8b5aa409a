"""Attention on meta tensors as the CPU dispatches it: ``F.scaled_dot_product_attention`` is composite code
that picks a kernel by the device type (the CPU flash kernel where it applies, the math decomposition on
meta). :func:`sdpa` runs the composite once per input layout on fake CPU tensors, records the ATen ops it
dispatches and when each temporary died, and replays that on the meta tensors.

The built-in builder (:mod:`.model`) calls :func:`sdpa` for meta inputs; the fast simulation
(:mod:`.metasim`) runs the builder's step. The recordings are kept on disk by :mod:`.fakeref` for later
processes on the same torch build.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from vramlab.core.simulation.fakeref import MISSING, STORE, Ref

META = torch.device("meta")


class Unsupported(Exception):
    """The meta path cannot reproduce the fake CPU path here (the caller runs the fake path)."""


# The ops a composite dispatched, in order: (func, args, kwargs, dead) with tensors replaced by Ref(index
# into [inputs..., outputs in order of appearance]) and ``dead`` the indices of the intermediate tensors the
# composite dropped after this op (C++ frees a temporary where its scope ends, not at its last use); the
# result's Ref.
_Program = tuple[tuple[tuple[Any, Any, Any, tuple[int, ...]], ...], Any]
_PROGRAMS: dict[tuple, _Program] = {}
_PROGRAMS_LIMIT = 2_000  # input layouts kept in memory (a 70B step has a few)


def _meta_key(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad)


class _Recorder(TorchDispatchMode):
    """Records the ops a composite dispatches, with tensors named by where they came from, and when each
    tensor it made died (weak references: the recording must not keep them alive)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # see MemoryTracker._should_skip_dynamo
        return False

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
            return Ref(i)
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
        return values[x.index] if isinstance(x, Ref) else x

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

    if attn_mask is not None:
        # with a mask (sliding window) the composite's temporaries die in an order the replay does not
        # reproduce in every case (two frees swapped, seen on Mistral-7B at its window): the fake path runs
        raise Unsupported("attention with a mask")

    key = (_meta_key(q), _meta_key(k), _meta_key(v), _meta_key(attn_mask), dropout_p, is_causal, scale,
           enable_gqa, torch.is_grad_enabled(), torch.backends.cuda.flash_sdp_enabled(),
           torch.backends.cuda.math_sdp_enabled(), torch.is_autocast_enabled("cpu"), torch.get_default_dtype())
    program = _PROGRAMS.get(key)
    if program is None:
        if len(_PROGRAMS) > _PROGRAMS_LIMIT:
            _PROGRAMS.clear()
        program = STORE.get(("sdpa", key))  # recorded by an earlier process on this torch build
        if program is MISSING:
            def call(q, k, v, m):  # noqa: ANN001, ANN202
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p,
                                                      is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

            program = _record([q, k, v, attn_mask], call)
            STORE.put(("sdpa", key), program)
        _PROGRAMS[key] = program
    return _replay(program, [t for t in (q, k, v, attn_mask) if t is not None])
