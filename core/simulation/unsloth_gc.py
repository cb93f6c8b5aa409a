"""Unsloth's own gradient checkpointing (``--unsloth-gc``): unsloth_zoo 2026.10.9's ``UnslothCheckpointFunction``
(``unsloth_zoo/gradient_checkpointing.py``), which ``patch_unsloth_smart_gradient_checkpointing`` puts in
``torch.utils.checkpoint``'s and transformers' place (``unsloth_checkpoint`` forces the reentrant path onto it).

Its module globals are one :class:`UnslothGC` per run (they live as long as the process, across steps):

* forward: the layer's first argument, where it requires grad and its bytes (float32 stored as bfloat16) exceed
  2 MiB, is copied into a host slot and not saved; the last checkpointed layer's input stays on the GPU from the
  second pass on (``LAST_GC_INDEX``, counted over the first forward, in which every layer is offloaded). The first
  offload makes the device's staging buffer A and buffer B (2 MiB each, ``INITIAL_GPU_BUFFER_SIZE``) and grows A
  to the input (``resize_``: the new storage made, the old freed); from the second pass on, where the GPU has more
  than 512 MiB free at its first offload, B grows to the input too (double buffering), otherwise B is freed.
* backward: the host copy comes back into a staging buffer (A, or B for every other offload when double
  buffering), and the recompute runs on a leaf that is a view of it (no new tensor; a float32 input is cast back:
  a copy); a layer kept on the GPU recomputes from a detached view of its saved input, as the reentrant checkpoint.

The other arguments are saved (``save_for_backward``) and their gradients returned, as the reentrant checkpoint
does. Streams, events and pinned-memory checks order copies and change no device bytes. Free memory, which decides
double buffering, is not known to a step replayed without a GPU: it is taken as more than 512 MiB (the run's
activations alone exceed that wherever the double buffer is not the difference between fitting and not).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.utils.checkpoint as checkpoint_utils

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.spec.unsloth_gc import INITIAL_GPU_BUFFER_BYTES, MINIMUM_SIZE


class UnslothGC:
    """unsloth_zoo's module state for one run (``initialize_unsloth_gradient_checkpointing``)."""

    def __init__(self) -> None:
        self.first_pass = True  # FIRST_PASS
        self.last_index = 0  # LAST_GC_INDEX
        self.current = 0  # CURRENT_GC_INDEX
        self.backward_pass = True  # BACKWARD_PASS: the next offload starts a new graph
        self.double = False  # USE_DOUBLE_BUFFER
        self.buffers: list[torch.Tensor | None] = [None, None]  # GPU_BUFFERS, GPU_BUFFERS_B (one device)
        self.next_slot = 0  # NEXT_BUFFER_SLOT

    def checkpoint(self, function: Any, *args: Any, use_reentrant: bool | None = None,
                   preserve_rng_state: bool = True, **kwargs: Any) -> Any:
        """``unsloth_checkpoint``: keywords bound into the function (``_bind_checkpoint_kwargs``), reentrant."""
        if kwargs:
            function = functools.partial(function, **kwargs)
        return _UnslothCheckpoint.apply(self, function, *args)

    # ---- the forward's bookkeeping (UnslothCheckpointFunction.forward) -----------------------------------------
    def offloads(self, arg: torch.Tensor) -> bool:
        if self.first_pass:
            self.last_index += 1
        self.current += 1
        store = torch.bfloat16 if arg.dtype == torch.float32 else arg.dtype
        new_size = arg.numel() * store.itemsize
        return new_size > MINIMUM_SIZE and (self.current != self.last_index or self.first_pass)

    def stage(self, device: torch.device, new_size: int) -> int:
        """The staging buffers ready for ``new_size`` bytes; returns the buffer slot this offload takes."""
        with context.region(Kind.TEMPORARIES):
            if self.buffers[0] is None:  # _ensure_device_buffers: A, then B (unless freed)
                self.buffers[0] = _buffer(INITIAL_GPU_BUFFER_BYTES, device)
            if self.buffers[1] is None:
                self.buffers[1] = _buffer(INITIAL_GPU_BUFFER_BYTES, device)
            if self.backward_pass:
                self.backward_pass = False
                if not self.first_pass and not self.double:
                    self.double = True  # torch.cuda.mem_get_info: more than DOUBLE_BUFFER_HEADROOM free
            self._grow(0, new_size)
            if self.double:
                self._grow(1, new_size)
        slot = self.next_slot
        self.next_slot ^= 1
        return slot

    def _grow(self, i: int, new_size: int) -> None:
        old = self.buffers[i]
        if -(-new_size // 2) > old.numel():  # resize_: the new storage, the old one's bytes copied, then freed
            new = _buffer(new_size, old.device)
            self.buffers[i] = new
            del old

    def staged(self, slot: int, new_size: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        buffer = self.buffers[1] if self.double and slot == 1 else self.buffers[0]
        return buffer.view(torch.uint8)[:new_size].view(dtype).view(shape)  # _view_bytes_as


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(-(-nbytes // 2), dtype=torch.bfloat16, device=device)


class _UnslothCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, state: UnslothGC, run_function: Any, *args: Any) -> Any:
        ctx.state, ctx.run_function = state, run_function
        # the forward's autocast state, entered again for the recompute (as torch's reentrant CheckpointFunction)
        ctx.device_type = checkpoint_utils._infer_device_type(*args)
        ctx.device_autocast_kwargs, ctx.cpu_autocast_kwargs = checkpoint_utils._get_autocast_kwargs(ctx.device_type)
        ctx.inputs, ctx.tensor_indices, tensors = [], [], []
        ctx.requires_gradient = False
        ctx.offload = None
        for i, arg in enumerate(args):
            if torch.is_tensor(arg):
                ctx.requires_gradient |= arg.requires_grad
                if i == 0 and arg.requires_grad and state.offloads(arg):
                    store = torch.bfloat16 if arg.dtype == torch.float32 else arg.dtype
                    new_size = arg.numel() * store.itemsize
                    slot = state.stage(arg.device, new_size)
                    with context.host():  # CPU_BUFFERS[CPU_INDEX]: a pinned host slot
                        host = torch.empty(arg.shape, dtype=store, device=arg.device)
                    ctx.offload = (new_size, arg.shape, slot, arg.dtype, store, host)
                    tensors.append(None)
                else:
                    tensors.append(arg)
                ctx.tensor_indices.append(i)
                ctx.inputs.append(None)
            else:
                ctx.inputs.append(arg)
        if ctx.requires_gradient:
            ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        if not ctx.requires_gradient:
            return (None,) * (2 + len(ctx.inputs))
        state: UnslothGC = ctx.state
        inputs = list(ctx.inputs)
        tensors = ctx.saved_tensors
        for i, idx in enumerate(ctx.tensor_indices):
            inputs[idx] = tensors[i]
        staged = None
        if ctx.offload is not None:
            new_size, shape, slot, saved_dtype, store, _host = ctx.offload
            staged = state.staged(slot, new_size, store, shape)
        state.backward_pass, state.first_pass, state.current = True, False, 0
        detached = []
        for inp in inputs:
            if isinstance(inp, torch.Tensor):
                x = inp.detach()
                x.requires_grad = inp.requires_grad
                detached.append(x)
            else:
                detached.append(inp)
        if staged is not None:
            x = staged.detach() if store == saved_dtype else staged.to(saved_dtype)
            x.requires_grad_(True)
            detached[0] = x
        device_autocast = torch.amp.autocast(device_type=ctx.device_type, **ctx.device_autocast_kwargs) \
            if torch.amp.is_autocast_available(ctx.device_type) else contextlib.nullcontext()
        with torch.enable_grad(), device_autocast, torch.amp.autocast("cpu", **ctx.cpu_autocast_kwargs):
            outputs = ctx.run_function(*detached)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=False) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        out = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in detached)
        return (None, None, *out)


def checkpoint_function(setup: Any, owner: Any) -> Any:
    """The checkpoint function the setup's layers run under: Unsloth's (one state per ``owner``, the model, which
    lives across the steps as unsloth_zoo's globals do) where :func:`unsloth_gc_runs`, else None."""
    from vramlab.core.spec.unsloth_gc import unsloth_gc_runs

    if not unsloth_gc_runs(setup):
        return None
    state = owner.__dict__.get("_unsloth_gc")
    if state is None:
        state = owner.__dict__["_unsloth_gc"] = UnslothGC()
    return state.checkpoint
