"""A stand-in for triton on a machine without it: a library whose Python code allocates the tensors its Triton
kernels write into (Cut Cross Entropy, Liger Kernel) imports over it, and every ``kernel[grid](...)`` launch does
nothing, so the library's own allocations can be counted on CPU tensors."""

from __future__ import annotations

import sys
import types

import pytest


class Stub:
    """Whatever triton gives at import (decorators, configs, language helpers); ``kernel[grid](...)`` does nothing."""

    def __init__(self, *_a: object, **_k: object) -> None:
        pass

    def __getattr__(self, name: str) -> Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub()

    def __call__(self, *_a: object, **_k: object) -> Stub:
        return Stub()

    def __getitem__(self, _grid: object):  # noqa: ANN204
        return lambda *a, **k: None

    def __iter__(self):  # noqa: ANN204
        return iter(())

    def __or__(self, _other: object) -> Stub:  # annotations such as autotuner.Autotuner | autotuner.Heuristics
        return Stub()


class StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub()


def install(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> dict[str, StubModule]:
    """Put stub modules named ``names`` (``triton`` and its submodules) in ``sys.modules`` for the test, each
    submodule reachable as its parent's attribute, ``triton.cdiv`` a real one; returns them by name."""
    mods = {n: StubModule(n) for n in names}
    for n, m in mods.items():
        parent, _, child = n.rpartition(".")
        if parent in mods:
            setattr(mods[parent], child, m)
        monkeypatch.setitem(sys.modules, n, m)
    mods["triton"].cdiv = lambda a, b: -(-a // b)
    return mods
