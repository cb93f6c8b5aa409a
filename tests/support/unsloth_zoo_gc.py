"""unsloth_zoo 2026.10.9's own ``unsloth_checkpoint`` / ``UnslothCheckpointFunction`` (``unsloth_zoo/
gradient_checkpointing.py``), run on CPU under fake tensors in place of VRAM Lab's (core/simulation/unsloth_gc.py),
for tests/test_unsloth_gc.py.

unsloth_zoo imports only with a GPU, so its file is read from the unpacked wheel (``make conformance``:
``VRAMLAB_UNSLOTH_SRC``) and its module body run as it is, with what a CPU build and fake tensors lack supplied
around it:

* its package's relative imports (``DEVICE_TYPE`` "cuda", one device, ``Version``);
* ``torch.cuda``'s streams, events and ``mem_get_info``: streams and events that do nothing (they order copies and
  change no bytes), and a GPU with 1 TiB free (double buffering on, as VRAM Lab models it);
* the device index: a CPU tensor's is None where unsloth indexes its per-device lists by a CUDA device's 0;
* its buffers' device: the GPU staging buffers made on the step's device with unsloth's own sizes and dtype
  (``INITIAL_GPU_BUFFER_SIZE``, ``GPU_BUFFER_DTYPE``), its pinned host buffers made in the tracker's host region.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.offload_libraries import _Stream  # the CUDA stream's calls as no-ops (TRL's hooks use it too)
from tests.support.unsloth_source import unsloth_source
from vramlab.core.simulation import context


class _Event:
    def record(self, _stream: object = None) -> None:
        return None


class _Cuda:
    Stream = _Stream
    Event = _Event

    def current_stream(self, _device: object = None) -> _Stream:
        return _Stream()

    default_stream = current_stream

    def stream(self, _s: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def mem_get_info(self, _device: object = None) -> tuple[int, int]:
        return 1 << 40, 1 << 40

    def device_count(self) -> int:
        return 1

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)


class _Torch:
    cuda = _Cuda()

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


class _Indexed:
    """One device's slot whatever the index (None: a CPU tensor's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getitem__(self, i: object) -> Any:
        return self.inner[0 if i is None else i]

    def __setitem__(self, i: object, v: object) -> None:
        self.inner[0 if i is None else i] = v

    def __iter__(self):  # noqa: ANN204
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def source() -> Path:
    """unsloth_zoo's ``gradient_checkpointing.py`` in the unpacked wheel; skips the test where it is not."""
    return unsloth_source("unsloth_zoo", "gradient_checkpointing.py")


def load(device: list) -> dict:
    """unsloth_zoo's module namespace; ``device[0]`` is the step's device when a staging buffer is made."""
    src = source()
    from packaging.version import Version

    tree = ast.parse(src.read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.ImportFrom) and n.level)
            and not (isinstance(n, ast.Import) and any(a.name == "torch" for a in n.names))]
    ns: dict = dict(torch=_Torch(), Version=Version, DEVICE_TYPE="cuda", DEVICE_TYPE_TORCH="cuda", DEVICE_COUNT=1,
                    is_hip=lambda: False, get_device_type=lambda: "cuda", ALLOW_PREQUANTIZED_MODELS=True,
                    is_distributed=lambda: False, _get_dtype=lambda d: d, _any_device_integrated=lambda: False,
                    __name__="unsloth_zoo.gradient_checkpointing")
    exec(compile(ast.Module(body=body, type_ignores=[]), str(src), "exec"), ns)  # noqa: S102 - unsloth_zoo's code

    def host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
        with context.host():
            return ns["_mark_host_buffer"](torch.empty(numel, dtype=dtype, device=device[0]))

    def grow_host_buffer(buffer: torch.Tensor, new_size: int) -> torch.Tensor:
        return buffer if new_size <= buffer.numel() else host_buffer(new_size, buffer.dtype)

    ns.update(_new_host_buffer=host_buffer, _grow_host_buffer=grow_host_buffer,
              _new_gpu_buffer=lambda _i: torch.empty(ns["INITIAL_GPU_BUFFER_SIZE"], dtype=ns["GPU_BUFFER_DTYPE"],
                                                     device=device[0]),
              _new_extra_stream=lambda _i: _Stream(), _double_buffer_disabled=lambda: False,
              _double_buffer_event_ctor=lambda: _Event, _release_pool_pinned=lambda *a: None,
              _reset_pinned_cap=lambda: None, torch_gpu_stream=lambda _s: contextlib.nullcontext())
    return ns


def initialize(ns: dict, dtype: torch.dtype) -> None:
    """``initialize_unsloth_gradient_checkpointing(dtype)`` (what ``patch_unsloth_smart_gradient_checkpointing``
    calls), its per-device lists then indexed by a CPU tensor's device."""
    ns["initialize_unsloth_gradient_checkpointing"](dtype)
    for name in ("NEXT_BUFFER_SLOT", "GPU_BUFFERS", "GPU_BUFFERS_B", "EXTRA_STREAMS", "MAIN_STREAMS",
                 "BUFFER_EVENTS_A", "BUFFER_EVENTS_B"):
        if ns.get(name) is not None:
            ns[name] = _Indexed(ns[name])


def in_place_of_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """unsloth_zoo's ``unsloth_checkpoint`` as the layers' checkpoint function in the builder and in transformers'
    classes, one initialization per model (unsloth's globals live across the steps of one run)."""
    from vramlab.core.simulation import model, unsloth_gc
    from vramlab.core.tracing import hf

    device: list = [None]
    ns = load(device)

    def checkpoint_function(setup: Any, owner: Any) -> Any:
        if unsloth_gc.checkpoint_function(setup, owner) is None:
            return None
        if owner.__dict__.get("_unsloth_zoo") is None:
            owner.__dict__["_unsloth_zoo"] = True
            initialize(ns, torch.bfloat16)

        def fn(function: Any, *args: Any, **kwargs: Any) -> Any:
            device[0] = args[0].device
            return ns["unsloth_checkpoint"](function, *args, **kwargs)
        return fn

    monkeypatch.setattr(model, "checkpoint_function", checkpoint_function)
    monkeypatch.setattr(hf, "checkpoint_function", checkpoint_function)
