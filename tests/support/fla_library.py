"""fla (fla-core / flash-linear-attention 0.6.0) imported over a triton whose kernels are no-ops
(:mod:`tests.support.triton_stub`), for the tests that hold VRAM Lab's fla reference to the library's own Python code
on CPU tensors."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from tests.support import triton_stub
from tests.support.liger_library import _Constexpr

VERSION = "0.6.0"


def imported(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Skip without fla 0.6.0 (and einops, which its package imports); else stub triton (no driver: fla takes the
    CPU as its platform), keep torch.compile from importing inductor (which would import the real triton), drop
    any fla module imported before, yield, and drop the modules imported meanwhile. fla's shared-memory probe says
    Hopper (its CUDA tilings: ``chunk_bwd_dqkwg``'s BK = 128)."""
    from importlib import metadata, util

    if util.find_spec("fla") is None or util.find_spec("einops") is None:
        pytest.skip(f"pip install fla-core=={VERSION} einops --no-deps")
    if metadata.version("fla-core") != VERSION:
        pytest.skip(f"the reference models fla {VERSION}")
    import torch._dynamo  # noqa: F401 - imported before triton is stubbed (it probes triton at import)

    names = ["triton", "triton.language", "triton.language.extra", "triton.language.extra.libdevice",
             "triton.language.extra.cuda", "triton.language.math", "triton.runtime", "triton.testing",
             "triton.runtime.autotuner", "triton.backends", "triton.language.core", "triton.runtime.jit"]
    mods = triton_stub.install(monkeypatch, names)
    mods["triton"].next_power_of_2 = lambda n: 1 << (n - 1).bit_length()  # triton's own, for n >= 1
    mods["triton"].__version__ = "3.5.0"
    mods["triton.language"].constexpr = _Constexpr
    mods["triton.runtime"].driver = types.SimpleNamespace()  # no active driver: fla's device is the CPU
    for n in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, n)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f))
    monkeypatch.setattr(torch.compiler, "disable", lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f))
    from fla.ops.common import chunk_o

    monkeypatch.setattr(chunk_o, "check_shared_mem", lambda arch="none", idx=0: arch == "hopper")
    yield
    for n in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        del sys.modules[n]
