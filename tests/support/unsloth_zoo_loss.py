"""unsloth_zoo 2026.10.9's own fused loss (``fused_losses/fused_linear.py`` and ``chunked_logprob.py``'s
``unsloth_chunked_ce_loss``), run on real CPU tensors in place of VRAM Lab's (core/simulation/unsloth_loss.py), for
tests/test_unsloth_loss.py.

unsloth_zoo imports only with a GPU, so its files are read from the unpacked wheel (``make conformance``:
``VRAMLAB_UNSLOTH_SRC``) and their module bodies run as they are, with what a CPU build lacks supplied around them:

* triton, a stub whose kernel launches do nothing (tests/support/triton_stub.py: the kernels write into tensors the
  Python code has made), with its ``next_power_of_2``;
* the GPU's answers: the device predicates (``_use_triton``, ``_logits_mode``, ``_flash_min_rows``,
  ``_flash_ce_ok``, ``_budget_bytes``) asked of a CUDA device, whose capability and memory ``torch.cuda`` answers
  with the GPU under test (``mem_get_info``'s free memory through ``unsloth_zoo.tiled_mlp._default_target_gb``,
  read as that module reads it); ``torch.mm(..., out_dtype=float32)`` (``_fp32_out_ok``) where the GPU runs it;
* a tensor's ``is_cuda`` read as True (``_ce_checked``'s device-side assert path);
* the fp32-out GEMMs ``_mm_fp32`` / ``_addmm_fp32`` (aten's ``mm.dtype`` has no CPU kernel): a new fp32 product, or
  nothing where they write ``out=``;
* ``torch.library.custom_op``: the op's body called with the op's own autograd (``register_autograd``), as the op
  runs eagerly, so that the allocations inside it are counted.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import triton_stub
from tests.support.unsloth_source import unsloth_source

CUDA = torch.device("cuda", 0)


class _Op:
    """A ``custom_op``: its body, run under its registered autograd."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.setup, self.backward = fn, None, None

    def register_fake(self, fake: Any) -> Any:
        return fake

    def register_autograd(self, backward: Any, setup_context: Any) -> None:
        self.backward, self.setup = backward, setup_context

    def __call__(self, *args: Any) -> Any:
        if self.backward is None:
            return self.fn(*args)
        op = self

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(*a: Any) -> Any:
                return op.fn(*a)

            @staticmethod
            def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
                op.setup(ctx, inputs, output)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                return op.backward(ctx, *grads)

        return Fn.apply(*args)


class _Props:
    def __init__(self, total: int) -> None:
        self.total_memory = total


class _Cuda:
    def __init__(self, gpu: tuple[int, int, int, int]) -> None:
        self.gpu = gpu

    def get_device_capability(self, _device: object = None) -> tuple[int, int]:
        return self.gpu[0], self.gpu[1]

    def get_device_properties(self, _device: object = None) -> _Props:
        return _Props(self.gpu[2])

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)


class _Torch:
    """``torch`` as the module sees it: its ``cuda`` the GPU under test, its ops namespace ``unsloth_zoo`` the
    module's own ops."""

    _unsloth_fused_linear_ops = None

    def __init__(self, gpu: tuple[int, int, int, int]) -> None:
        self.cuda = _Cuda(gpu)
        self.ops = types.SimpleNamespace(unsloth_zoo=types.SimpleNamespace(), aten=torch.ops.aten)

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


class _IsCuda(ast.NodeTransformer):
    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        if node.attr == "is_cuda" and isinstance(node.ctx, ast.Load):
            return ast.copy_location(ast.Constant(True), node)
        return node


def source() -> Path:
    """unsloth_zoo's ``fused_losses`` folder in the unpacked wheel; skips the test where it is not."""
    return unsloth_source("unsloth_zoo", "fused_losses", "fused_linear.py").parent


def load(monkeypatch: pytest.MonkeyPatch, gpu: tuple[int, int, int, int]) -> Any:
    """unsloth_zoo's ``unsloth_chunked_ce_loss`` over its ``fused_linear_cross_entropy``, on ``gpu`` (capability
    major, minor, memory bytes, free bytes)."""
    src = source()
    stub = triton_stub.install(monkeypatch, ["triton", "triton.language", "triton.language.extra"])
    stub["triton"].next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    major, minor, total, free = gpu
    tiled = types.ModuleType("unsloth_zoo.tiled_mlp")
    tiled._default_target_gb = lambda device=None: free / 1024 / 1024 / 1024 * 0.5  # mem_get_info's free, halved
    ns: dict = {}
    for name, module in (("unsloth_zoo", types.ModuleType("unsloth_zoo")),
                         ("unsloth_zoo.fused_losses", types.ModuleType("unsloth_zoo.fused_losses")),
                         ("unsloth_zoo.fused_losses.fused_linear", types.ModuleType("x")),
                         ("unsloth_zoo.tiled_mlp", tiled)):
        monkeypatch.setitem(sys.modules, name, module)
    fake_torch = _Torch(gpu)

    def custom_op(name: str, mutates_args: object = ()) -> Any:
        def wrap(fn: Any) -> _Op:
            op = _Op(fn)
            setattr(fake_torch.ops.unsloth_zoo, name.split("::")[1], op)
            return op
        return wrap

    tree = _IsCuda().visit(ast.parse((src / "fused_linear.py").read_text()))
    tree.body = [n for n in tree.body if not (isinstance(n, ast.Import) and any(a.name == "torch" for a in n.names))]
    for node in ast.walk(tree):  # the ops' registration: ours
        if isinstance(node, ast.If):
            node.body = [n for n in node.body if not (isinstance(n, ast.ImportFrom) and n.module == "torch.library")]
    ns.update(torch=fake_torch, custom_op=custom_op, _custom_op=custom_op, __name__="unsloth_zoo.fused_linear")
    exec(compile(ast.fix_missing_locations(tree), str(src / "fused_linear.py"), "exec"), ns)  # noqa: S102

    def on_cuda(fn: Any) -> Any:
        return lambda _device, *a: fn(CUDA, *a)

    for name in ("_use_triton", "_logits_mode", "_flash_min_rows", "_flash_ce_ok", "_budget_bytes"):
        ns[name] = on_cuda(ns[name])
    ns["_fp32_out_ok"] = lambda _device, dtype=torch.float16: dtype == torch.float16 or major >= 8

    def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return out if out is not None else torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32)

    ns.update(_mm_fp32=mm_fp32, _addmm_fp32=lambda acc, a, b: None, _launch=lambda _device, fn: fn())
    sys.modules["unsloth_zoo.fused_losses.fused_linear"].__dict__.update(ns)

    # chunked_logprob.py's unsloth_chunked_ce_loss and its two helpers, as written
    tree = ast.parse((src / "chunked_logprob.py").read_text())
    keep = ("_ce_targets", "_ce_divisor", "unsloth_chunked_ce_loss", "chunked_logprob_rows")
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in keep]
    cl: dict = dict(torch=torch, _FUSED_LINEAR=True, __name__="unsloth_zoo.fused_losses.chunked_logprob")
    exec(compile(ast.Module(body=body, type_ignores=[]), str(src / "chunked_logprob.py"), "exec"), cl)  # noqa: S102
    return cl["unsloth_chunked_ce_loss"]
