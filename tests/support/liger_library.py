"""liger-kernel 0.8.5 imported over a triton whose kernels are no-ops (:mod:`tests.support.triton_stub`), for the
tests that hold VRAM Lab's Liger references to the library's own Python code on CPU tensors."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from tests.support import triton_stub

VERSION = "0.8.5"


class _Constexpr:
    """``tl.constexpr(v)``: ``.value`` is ``v``."""

    def __init__(self, value: object = None) -> None:
        self.value = value


def imported(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Skip without liger-kernel 0.8.5; else stub triton (and torch.compile, which would import inductor and the
    real triton), drop any liger module imported before, yield, and drop the modules imported meanwhile."""
    from importlib import metadata, util

    if util.find_spec("liger_kernel") is None:
        pytest.skip(f"pip install liger-kernel=={VERSION} --no-deps")
    if metadata.version("liger-kernel") != VERSION:
        pytest.skip(f"the reference models liger-kernel {VERSION}")
    names = ["triton", "triton.language", "triton.language.extra", "triton.language.extra.libdevice",
             "triton.language.extra.cuda", "triton.language.math", "triton.runtime", "triton.testing"]
    mods = triton_stub.install(monkeypatch, names)
    mods["triton"].next_power_of_2 = lambda n: 1 << (n - 1).bit_length()  # triton's own, for n >= 1
    mods["triton"].__version__ = "3.5.0"
    mods["triton.language"].constexpr = _Constexpr  # the casting modes' values (rms_norm.py) are read in Python
    for n in [n for n in sys.modules if n.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, n)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f))
    monkeypatch.setattr(torch.compiler, "disable", lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f))
    yield
    for n in [n for n in sys.modules if n.startswith("liger_kernel")]:
        del sys.modules[n]


def apply_own(apply_fn, model: torch.nn.Module, *, lora: bool) -> None:  # noqa: ANN001
    """liger's own instance patch (``apply_liger_kernel_to_<type>(model=...)``, its RoPE and losses off) on
    ``model`` (a peft model's base when ``lora``), its module-level class swaps (``LlamaRMSNorm = LigerRMSNorm``,
    ...) undone after, so that the classes built next are transformers' own."""
    base = model.get_base_model() if lora else model
    modeling = sys.modules[type(base).__module__]
    before = dict(vars(modeling))
    apply_fn(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, model=base)
    vars(modeling).update(before)
