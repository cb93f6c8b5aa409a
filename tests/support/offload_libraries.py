"""The libraries' own offloading code, run under fake or meta tensors in place of VRAM Lab's transformations of the
step, for the tests that hold one to the other (tests/test_offloading.py): TRL 1.16.0's activation offloading
(``trl.models.activation_offloading``; VRAM Lab's: core/simulation/act_offload.py) and the offloaded checkpoint
function of LLaMA-Factory 0.9.5 and axolotl 0.19.0 (core/simulation/offload_ckpt.py).

TRL's class runs as it is, on its CUDA-streams path; what a CPU build and fake tensors lack is supplied around it:

* the accelerator: ``torch.accelerator.current_accelerator()`` is None on a CPU build; the hooks are built for the
  device the step's tensors are on (``cpu`` for fake tensors, ``meta`` for the builder's fast path), and a stream
  module whose streams and events do nothing (the ordering they give has no bearing on what is allocated);
* storage pointers: a fake or meta tensor's ``data_ptr()`` is 0 for every storage; TRL keys storages by it (its
  de-duplication, the parameters it skips), so each storage's pointer is its identity here;
* where the parameters are when TRL collects them: the trainers build the hooks in ``__init__``, before accelerate
  shards the model under ZeRO-3 / FSDP, when its parameters are host tensors (or DeepSpeed's empty ones, whose null
  pointer TRL skips), whose pointers no device storage has. The sharded step's full parameters stand in host memory
  for the units' gathered storages, so while TRL collects, a parameter in host memory gives a null pointer;
* host memory: TRL's pinned CPU copies (``torch.empty(_like)(..., pin_memory=..., device="cpu")``) are made on the
  step's device under the tracker's host region, and ``.to(accelerator)`` of one of them, TRL's copy back to the
  GPU, is a counted copy.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from vramlab.core.simulation import context

VERSION = "1.16.0"


class _Stream:
    def wait_stream(self, _other: object) -> None:
        return None

    def wait_event(self, _event: object) -> None:
        return None

    def record_event(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _Streams:
    """``torch.cuda``'s stream API, doing nothing."""

    Stream = _Stream

    def __init__(self) -> None:
        self._current = _Stream()

    def current_stream(self) -> _Stream:
        return self._current

    def stream(self, _s: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _Torch:
    """``torch`` as TRL's module sees it: its pinned host copies made on the step's device under the tracker's
    host region, and the copy back of one (``.to(accelerator)``, then ``torch.as_strided`` to its layout: on the
    same device ``.to`` returns the tensor itself) a counted copy. Which storages are host memory is the tracker's
    to say (it forgets one when it is freed: a storage's identity is reused)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    def empty_like(self, t: torch.Tensor, pin_memory: bool = False, **kw: object) -> torch.Tensor:
        kw["device"] = t.device
        with context.host():
            return torch.empty_like(t, **kw)

    def empty(self, *size: object, pin_memory: bool = False, **kw: object) -> torch.Tensor:
        kw["device"] = self.device
        with context.host():
            return torch.empty(*size, **kw)

    def as_strided(self, t: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        if context.on_host(t):
            t = t.clone()  # the copy back to the GPU
        return torch.as_strided(t, *args, **kw)


def installed() -> None:
    from importlib import metadata, util

    if util.find_spec("trl") is None:
        pytest.skip(f"pip install trl=={VERSION}")
    if metadata.version("trl") != VERSION:
        pytest.skip(f"the transformation models trl {VERSION}")


def trl_context(monkeypatch: pytest.MonkeyPatch, axolotl: bool = False):  # noqa: ANN201
    """A replacement for :func:`vramlab.core.simulation.act_offload.offload_context` that builds TRL's own hooks
    with TRL's ``get_act_offloading_ctx_manager`` or (``axolotl``) axolotl 0.19.0's
    ``get_lora_act_offloading_ctx_manager``, and axolotl's clone before TRL's pack hook
    (``_patch_trl_offload_compute_stream_clone``'s ``pack_contiguous``, restated: its device check names CUDA, XPU
    and NPU only, so on the fake tensors' device its own closure would clone nothing)."""
    from trl.models import activation_offloading as ao

    manager = ao.get_act_offloading_ctx_manager
    if axolotl:
        from tests.support.frameworks import module

        manager = module("axolotl.core.trainers.mixins.activation_checkpointing").get_lora_act_offloading_ctx_manager

    def make(model: torch.nn.Module, device: str, setup: object = None) -> contextlib.AbstractContextManager:
        monkeypatch.setattr(torch.UntypedStorage, "data_ptr", lambda self: id(self))  # noqa: PLW0108 - a method
        monkeypatch.setattr(ao, "torch", _Torch(device))
        on_host = {id(p.untyped_storage()) for p in model.parameters() if context.on_host(p)}
        with monkeypatch.context() as m:  # while TRL builds its hooks
            m.setattr(torch.UntypedStorage, "data_ptr", lambda self: 0 if id(self) in on_host else id(self))
            m.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(device))
            m.setattr(torch, "get_device_module", lambda *a, **k: _Streams())
            hooks = manager(model=getattr(model, "inner", model))
        assert hooks.accelerator_type == device
        if axolotl:
            pack = hooks.pack_hook

            def pack_contiguous(tensor: torch.Tensor) -> int:
                if (torch.is_tensor(tensor) and tensor.device.type == device
                        and not isinstance(tensor, torch.nn.Parameter)
                        and (not tensor.is_contiguous() or tensor.storage_offset() != 0)):
                    tensor = tensor.clone(memory_format=torch.contiguous_format)
                return pack(tensor)

            hooks.pack_hook = pack_contiguous
        return hooks

    return make


def _copies_to_and_from_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """``x.to("cpu", non_blocking=True)``: a host copy (not device memory); ``x.to("cuda", non_blocking=True)``: a
    counted copy on the step's device (the fake and meta tensors stand for the GPU)."""
    to = torch.Tensor.to

    def patched(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        where = args[0] if args else kwargs.get("device")
        if kwargs.get("non_blocking") and where in ("cpu", "cuda"):
            if where == "cpu":
                with context.host():
                    return self.clone()
            return self.clone()
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", patched)


def offloaded_checkpoint(monkeypatch: pytest.MonkeyPatch, framework: str) -> None:
    """The framework's own offloaded checkpoint function in place of VRAM Lab's, in the built-in builder and in
    transformers' layers: LLaMA-Factory's ``get_unsloth_gradient_checkpointing_func()`` (its wrapper that checkpoints
    only trained layers reads ``func.func.__self__``, which transformers 5.25's layers no longer give: not used) or
    axolotl's ``CPU_Offloaded_Gradient_Checkpointer.apply``."""
    from tests.support.frameworks import module
    from vramlab.core.simulation import model
    from vramlab.core.tracing import hf

    if framework == "llamafactory":
        apply = module("llamafactory.model.model_utils.checkpointing").get_unsloth_gradient_checkpointing_func()
    else:
        offload_cpu = module("axolotl.monkeypatch.gradient_checkpointing.offload_cpu")
        apply = offload_cpu.CPU_Offloaded_Gradient_Checkpointer.apply

    def fn(function: object, *args: object, **_mode: object) -> object:
        return apply(function, *args)

    monkeypatch.setattr(model, "checkpoint_to_host", fn)
    monkeypatch.setattr(hf, "checkpoint_to_host", fn)
    _copies_to_and_from_host(monkeypatch)
