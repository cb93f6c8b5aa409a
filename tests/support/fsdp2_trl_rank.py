"""One rank of real FSDP2 (``fully_shard``, gloo on the CPU) under TRL 1.16.0's own activation offloading hooks,
built as ``SFTTrainer.__init__`` builds them: on the model before accelerate shards it. Prints, as one JSON line,
for each saved tensor whose storage is one of FSDP2's unsharded (gathered) parameters, whether TRL offloaded it and
whether it was the parameter itself. Run by tests/test_offloading.py under ``torch.distributed.run``.

The parameters TRL collects at that point are the unsharded model's (host tensors in the user's run, where the
trainer leaves the model on the CPU for ``fully_shard``); they are kept alive here so that no later storage reuses
their addresses on this CPU-only run (on a GPU a host pointer never equals a device one)."""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn


class _Stream:
    def wait_stream(self, _o: object) -> None: ...
    def wait_event(self, _e: object) -> None: ...
    def record_event(self) -> None: ...
    def synchronize(self) -> None: ...


class _Streams:
    Stream = _Stream

    def current_stream(self) -> _Stream:
        return _Stream()

    def stream(self, _s: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _Torch:
    """``torch`` for TRL's module on a CPU-only build: no pinned memory."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    def empty_like(self, t: torch.Tensor, pin_memory: bool = False, **kw: object) -> torch.Tensor:
        return torch.empty_like(t, **kw)

    def empty(self, *size: object, pin_memory: bool = False, **kw: object) -> torch.Tensor:
        return torch.empty(*size, **kw)


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class Model(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(2))
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trl.models import activation_offloading as ao

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model(512)
    seen_by_trl = [p.data for p in model.parameters()]  # noqa: F841 - kept: see the module docstring
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
    torch.get_device_module = lambda *a, **k: _Streams()
    ao.torch = _Torch()
    hooks = ao.get_act_offloading_ctx_manager(model=model)  # SFTTrainer.__init__
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if hasattr(model, "set_force_sum_reduction_for_comms"):
        model.set_force_sum_reduction_for_comms(True)  # gloo has no ReduceOp.AVG
    gathered: dict[int, str] = {}

    def note(module: nn.Module, _args: object) -> None:  # after FSDP2's pre-forward: the unsharded parameters
        for name, p in module.named_parameters(recurse=False):
            if not hasattr(p, "_local_tensor"):
                gathered[p.untyped_storage().data_ptr()] = name

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.RMSNorm)):
            m.register_forward_pre_hook(note)
    seen: list[dict] = []
    pack = hooks.pack_hook

    def recording(t: torch.Tensor) -> int:
        tid = pack(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr in gathered:
            seen.append({"name": gathered[ptr], "offloaded": bool(hooks.tracker[tid][1]),
                         "parameter": isinstance(t, nn.Parameter), "bytes": t.element_size() * t.nelement()})
        return tid

    hooks.pack_hook = recording
    x = torch.randn(2, 16, 512, requires_grad=True)
    with hooks:
        out = model(x)
        out.float().pow(2).mean().backward()
    if dist.get_rank() == 0:
        print(json.dumps({"saved": seen, "world": dist.get_world_size(), "pid": os.getpid()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
