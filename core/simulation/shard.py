"""Rank 0 of an N-GPU sharded run, emulated on one process (ZeRO-1/2/3 and FSDP, with CPU offload).

What each rank holds, as DeepSpeed ZeRO and PyTorch FSDP2 hold it:

* **ZeRO-1**: parameters and gradients replicated; the optimizer steps a 1/N flat partition of every
  trainable tensor, so its states (and fp32 master copies) are 1/N.
* **ZeRO-2**: as ZeRO-1, and each gradient is reduce-scattered as soon as it is accumulated: the rank
  keeps a 1/N gradient partition, the full gradient is freed.
* **ZeRO-3 / FSDP** (FSDP2 semantics; each decoder layer is a unit, the embeddings, final norm and
  lm_head form the root unit): parameters are stored as 1/N shards. A layer's parameters are
  all-gathered into one unsharded buffer before its forward and freed after it, gathered again before
  its backward; after its backward the unsharded gradients are copied into a reduce-scatter input buffer
  (in the reduce dtype), freed, and reduce-scattered into 1/N gradient shards. The root unit stays
  unsharded from the start of forward to the end of backward. With fp32 weights and 16-bit compute this
  is FSDP mixed precision: shards and gradient shards in fp32, unsharded parameters and gradients in the
  compute dtype, no autocast copies.
* **Offload**: ``optimizer`` keeps optimizer states, fp32 masters and gradient partitions in host
  memory and steps there; ``params`` also keeps the parameter shards on the host.

A partition is the first ``ceil(numel / N)`` elements of the flattened tensor (DeepSpeed flattens,
FSDP2 chunks dim 0; the sizes agree up to padding). Communication buffers are not tensors of the model
and are modelled at the device level (NCCL).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.spec.options import DType, Offload, Sharding
from vramlab.core.spec.sharded_precision import mixed_reduce_dtype
from vramlab.core.spec.training import TrainingSetup

_TORCH = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def part(n: int, world: int) -> int:
    return -(-n // world)


@dataclass
class Unit:
    """One FSDP unit (a decoder layer, or the root): its unsharded parameters and buffers."""

    index: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    unsharded: torch.Tensor | None = None
    post_backward_done: bool = False
    nbytes: int = 0  # the unsharded parameters' bytes (in the dtype they are gathered in)

    def unsharded_bytes(self) -> int:
        return self.nbytes


class Sharder:
    @classmethod
    def for_setup(cls, setup: TrainingSetup) -> Sharder | None:
        """Rank 0's sharder for ``setup`` (None: not sharded). With fp32 weights and 16-bit compute, ZeRO-3 and
        FSDP are FSDP mixed precision (:attr:`mixed`): parameters gathered in the compute dtype, no autocast."""
        if setup.sharding is Sharding.NONE:
            return None
        compute = _TORCH[setup.compute]
        mixed = setup.sharded_mixed_precision
        return cls(setup, compute, mixed, _TORCH[mixed_reduce_dtype(setup)] if mixed else _TORCH[setup.trainable_dtype])

    def __init__(self, setup: TrainingSetup, unsharded_dtype: torch.dtype, mixed: bool,
                 reduce_dtype: torch.dtype) -> None:
        """``mixed``: FSDP mixed precision (fp32 shards, parameters gathered in ``unsharded_dtype``)."""
        self.mode = setup.sharding
        self.world = setup.gpus
        self.offload = setup.offload
        self.params_sharded = self.mode.shards_params
        self.unsharded_dtype = unsharded_dtype
        self.mixed = mixed
        # mixed precision over fp32 weights shards every float parameter in fp32; over a 16-bit model (accelerate's
        # FSDP upcast, core/spec/sharded_precision.py) only the trainable ones, the frozen keeping their own dtype
        self.fp32_frozen = setup.weight_dtype is DType.FP32
        self.reduce_dtype = reduce_dtype
        self.units: dict[int, Unit] = {}
        self.current_unit = -1
        self._storage: dict[int, torch.Tensor] = {}  # storage id of a full param/buffer -> its shard
        self.opt_params: list[tuple[nn.Parameter, nn.Parameter]] = []  # (full, what the optimizer steps)
        self.grad_params: dict[int, list[nn.Parameter]] = {}  # unit -> its trainable parameters
        self.grad_shards: dict[nn.Parameter, torch.Tensor] = {}
        self.reference = False  # a reference copy's (as_reference): resharded after each forward
        self.held: torch.Tensor | None = None  # every unit gathered at once (gather_all)
        # DeepSpeed's stage 3: the flat gradient partition buffer of each reduce dtype, each parameter's offset in it
        self.grad_buffers: dict[torch.dtype, torch.Tensor] = {}
        self._buffer_at: dict[nn.Parameter, tuple[torch.dtype, int]] = {}

    # ---- construction -----------------------------------------------------------------------------
    def as_reference(self) -> None:
        """A reference copy's sharding as TRL 1.16.0 prepares it: ``prepare_fsdp`` calls ``fully_shard`` on the
        whole model (FSDP2: one unit, gathered for the whole forward) and ``prepare_deepspeed`` a stage-3 engine
        (its modules gathered one by one, as the policy's); either way the model is resharded after its forward
        (accelerate's ``reshard_after_forward``, True, passed explicitly: the root does not stay gathered)."""
        self.reference = True
        if self.mode is Sharding.FSDP:
            root = self.unit(-1)
            for index in [i for i in self.units if i != -1]:  # a VLM's tower units too (below -1)
                u = self.units.pop(index)
                root.tensors += u.tensors
                root.nbytes += u.nbytes

    def unit(self, index: int) -> Unit:
        u = self.units.get(index)
        if u is None:
            u = self.units[index] = Unit(index)
        return u

    def new_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A parameter's full tensor, ``dtype`` being what it would be unsharded. Sharded modes keep
        only its 1/N shard (in ``dtype``) on the device; the full tensor (in the compute dtype under FSDP
        mixed precision) stands for the unsharded parameter, whose storage the unit's all-gather buffer
        provides."""
        if not self.params_sharded:
            return torch.empty(*shape, dtype=dtype, device=device)
        full_dtype = self.unsharded_dtype if (self.mixed and dtype.is_floating_point) else dtype
        with context.host():
            full = torch.empty(*shape, dtype=full_dtype, device=device)
        self._shard(full, dtype)
        return full

    def adopt(self, t: torch.Tensor) -> None:
        """A tensor made elsewhere under ``context.host()`` (quantized storage): shard it like a param."""
        if self.params_sharded:
            self._shard(t, t.dtype)

    def _shard(self, full: torch.Tensor, dtype: torch.dtype, gathered: torch.dtype | None = None) -> None:
        """Keep ``full``'s 1/N shard in ``dtype``; the unit gathers it in ``gathered`` (default: its own)."""
        with context.host() if self.offload is Offload.PARAMS else _null():
            shard = torch.empty(part(full.numel(), self.world), dtype=dtype, device=full.device)
        self._storage[id(full.untyped_storage())] = shard
        u = self.unit(self.current_unit)
        u.tensors.append(full)
        u.nbytes += full.numel() * (gathered or full.dtype).itemsize

    def shard_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The device shard standing for a full (host) parameter or buffer."""
        return self._storage.get(id(t.untyped_storage()))

    def register_trainable(self, p: nn.Parameter) -> None:
        """What the optimizer of this rank steps for ``p``: its partition (a view for ZeRO-1/2; the
        shard storage for ZeRO-3 / FSDP)."""
        if self.params_sharded:
            shard = nn.Parameter(self.shard_of(p), requires_grad=True)
            for index, u in self.units.items():
                if any(t.untyped_storage() is p.untyped_storage() for t in u.tensors):
                    self.grad_params.setdefault(index, []).append(p)
                    break
        else:
            shard = nn.Parameter(p.detach().view(-1)[: part(p.numel(), self.world)], requires_grad=True)
        self.opt_params.append((p, shard))

    def optimizer_buffers(self) -> None:
        """DeepSpeed's stage 3 with the optimizer on the device (0.19.8 ``_setup_for_real_optimizer``): one flat
        buffer of every trainable parameter's gradient partition, ``grad_partitions_flat_buffer`` (zeros, in the
        gradient accumulation dtype: the reduce dtype here), made with the optimizer and kept for the whole run; each
        unit's reduce-scattered gradients land in it (``partition_grads``). FSDP2 allocates its gradient shards at
        each reduce-scatter instead."""
        if self.mode is not Sharding.ZERO3 or self.offload is not Offload.NONE or not self.opt_params:
            return
        sizes: dict[torch.dtype, int] = {}
        for p, _shard in self.opt_params:
            dtype = self.reduce_dtype if self.mixed else p.dtype
            self._buffer_at[p] = (dtype, sizes.get(dtype, 0))
            sizes[dtype] = sizes.get(dtype, 0) + part(p.numel(), self.world)
        device = self.opt_params[0][1].device
        with context.region(Kind.GRADIENTS):
            self.grad_buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}

    # ---- forward / backward hooks -------------------------------------------------------------------
    def gather_all(self) -> None:
        """DeepSpeed's ``GatheredParameters(model.parameters())`` around GRPO's generation under ZeRO-3 (TRL 1.16.0's
        ``unwrap_model_for_generation``, ``ds3_gather_for_generation`` on by default): every unit gathered at once,
        ZeRO's hooks removed until :meth:`release_all`."""
        units = [u for u in self.units.values() if u.unsharded is None and u.tensors]
        if units:
            with context.region(Kind.WEIGHTS):
                self.held = torch.empty(sum(u.nbytes for u in units), dtype=torch.uint8,
                                        device=units[0].tensors[0].device)

    def release_all(self) -> None:
        self.held = None

    def unshard(self, index: int) -> None:
        if self.held is not None:  # gathered already, the hooks removed
            return
        u = self.unit(index)
        if u.unsharded is None and u.tensors:
            with context.region(Kind.REFERENCE if self.reference else Kind.WEIGHTS):
                u.unsharded = torch.empty(u.unsharded_bytes(), dtype=torch.uint8, device=u.tensors[0].device)

    def reshard(self, index: int) -> None:
        if self.held is None:
            self.unit(index).unsharded = None

    def post_backward(self, index: int) -> None:
        """Reduce-scatter the unit's gradients into 1/N shards, then free its unsharded parameters."""
        u = self.unit(index)
        if u.post_backward_done:
            return
        u.post_backward_done = True
        params = [p for p in self.grad_params.get(index, ()) if p.grad is not None]
        # FSDP2 reduces a unit's gradients in its trainable parameters' dtype (fp32 under mixed precision): the
        # fp32 adapters of a vision-language model's layers, its root's 16-bit projector each in their own (FSDP2
        # refuses a unit with two; DeepSpeed's ZeRO-3 runs one, which this reduces per dtype)
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            groups.setdefault(self.reduce_dtype if self.mixed else p.dtype, []).append(p)
        for reduce, ps in groups.items():
            self._reduce_scatter(ps, reduce)
        self.reshard(index)

    def _reduce_scatter(self, params: list[nn.Parameter], reduce: torch.dtype) -> None:
        """The gradients of ``params`` copied into one reduce-scatter input (freed), scattered into 1/N shards."""
        total = sum(p.numel() for p in params)
        with context.region(Kind.TEMPORARIES):
            rs_in = torch.empty(total, dtype=reduce, device=params[0].device)
        for p in params:
            p.grad = None  # copied into the reduce-scatter input, then freed
        if self.grad_buffers:  # DeepSpeed's stage 3: into the flat partition buffer (copied, or added)
            for p in params:
                dtype, offset = self._buffer_at[p]
                self.grad_shards.setdefault(p, self.grad_buffers[dtype][offset: offset + part(p.numel(), self.world)])
            del rs_in
            return
        offloaded = self.offload is not Offload.NONE
        n = sum(part(p.numel(), self.world) for p in params)  # the concatenated partitions: sum of ceil(numel / N),
        # which ceil(total / N) undercounts. FSDP2 reduces in accelerate's reduce dtype (bf16) and casts the output
        # to the fp32 shards' dtype (foreach_reduce's _to_dtype_if_needed), on the device before an offload's copy
        cast = self.mixed and reduce != torch.float32
        with context.region(Kind.TEMPORARIES):
            red = torch.empty(n, dtype=reduce, device=rs_in.device) if cast else None
            if cast and offloaded:
                torch.empty(n, dtype=torch.float32, device=rs_in.device)  # freed once copied to the host
        with context.region(Kind.GRADIENTS), context.host() if offloaded else _null():
            out = torch.empty(n, dtype=torch.float32 if cast else reduce, device=rs_in.device)
            del red
            offset = 0
            for p in params:
                k = part(p.numel(), self.world)
                view = out[offset: offset + k]
                offset += k
                prev = self.grad_shards.get(p)
                if prev is None:
                    self.grad_shards[p] = view
                else:
                    prev.add_(view)
        del rs_in, out

    def zero2_hook(self, p: nn.Parameter) -> None:
        """ZeRO-2: keep this gradient's partition, free the full gradient."""
        k = part(p.numel(), self.world)
        offloaded = self.offload is not Offload.NONE
        buf = self.grad_shards.get(p)
        with context.region(Kind.GRADIENTS), context.host() if offloaded else _null():
            if buf is None:
                self.grad_shards[p] = p.grad.view(-1)[:k].clone()
            else:
                buf.add_(p.grad.view(-1)[:k])
        p.grad = None

    def start_backward(self) -> None:
        for u in self.units.values():
            u.post_backward_done = False

    def finish_backward(self) -> None:
        """FSDP's end-of-backward callback: units whose input needed no gradient, then the root."""
        for index in sorted(self.units, reverse=True):
            if index >= 0:
                self.post_backward(index)
        self.post_backward(-1)

    # ---- optimizer ------------------------------------------------------------------------------------
    def grads_to_partitions(self) -> None:
        for p, shard in self.opt_params:
            if self.mode is Sharding.ZERO1:
                shard.grad = None if p.grad is None else p.grad.view(-1)[: shard.numel()]
            else:
                shard.grad = self.grad_shards.get(p)

    def release_grads(self) -> None:
        """DeepSpeed's stage 1 / 2 once the step's fp32 gradient is made (``free_grad_in_param_list``, the
        ``averaged_gradients`` dropped): the 16-bit gradients freed, ZeRO-1's whole ones, ZeRO-2's partitions (stage 3
        keeps its flat partition buffer). Not under offload, whose fp32 gradients are made on the host in backward."""
        if self.offload is not Offload.NONE:
            return
        if self.mode is Sharding.ZERO1:
            for p, _shard in self.opt_params:
                p.grad = None
        elif self.mode is Sharding.ZERO2:
            self.grad_shards.clear()

    def zero_grad(self) -> None:
        for p, shard in self.opt_params:
            p.grad = None
            shard.grad = None
        self.grad_shards.clear()


def shard_module(model: nn.Module, sharder: Sharder, units: list[nn.Module], root: nn.Module) -> None:
    """ZeRO-3 / FSDP2 applied to a model built elsewhere (transformers' own classes), as ``fully_shard`` applies
    it to any module: each of ``units`` (the model's decoder layers) is a unit, the rest of ``root`` the root
    unit. Every parameter, and a quantized base's storage, already on the device goes to the host (the load
    never holds the full model: the phase's peak so far is forgotten) and keeps its 1/N shard on the device;
    other buffers stay whole on the device (FSDP shards parameters only). Hooks do around each unit what
    :class:`~.model.Decoder` does around its layers: gather before the forward, free after it, gather again
    before the backward (the output's boundary), reduce-scatter after it (the input's); the root is gathered
    from the start of the forward."""
    from vramlab.core.simulation.quant import QuantWeight

    tracker = context.current()
    if sharder.mixed:  # each tensor stands for its unsharded parameter, which the step computes with as gathered
        for p in model.parameters():  # (peft's fp32 adapters included); before any storage is keyed by its id
            if p.dtype.is_floating_point and p.dtype != sharder.unsharded_dtype:
                with context.host():  # the old storage is freed as the device's (never marked host: see mark_host)
                    p.data = p.data.to(sharder.unsharded_dtype)
    unit_of: dict[int, int] = {}
    for i, layer in reversed(list(enumerate(units))):  # a unit inside another keeps its own (fully_shard's
        for p in (*layer.parameters(), *layer.buffers()):  # order: the innermost is sharded first)
            unit_of.setdefault(id(p.untyped_storage()), i)
    # a quantized base's packed storage is sharded like the parameters (FSDP-QLoRA)
    stored = [b for m in model.modules() if isinstance(m, QuantWeight) for b in m.buffers()]
    seen: set[int] = set()
    for p in (*model.parameters(), *stored):
        key = id(p.untyped_storage())
        if key in seen:  # a tied weight: one storage, one shard
            continue
        seen.add(key)
        if tracker is not None:
            tracker.mark_host(p)
        sharder.current_unit = unit_of.get(key, -1)
        mixed = sharder.mixed and p.dtype.is_floating_point
        own = torch.float32 if mixed and (p.requires_grad or sharder.fp32_frozen) else p.dtype
        sharder._shard(p, own, sharder.unsharded_dtype if mixed else None)
    sharder.current_unit = -1
    if tracker is not None:
        tracker.restart_phase_peak()
    for i, layer in enumerate(units):
        layer.register_forward_pre_hook(functools.partial(_before_unit, sharder, i), with_kwargs=True)
        layer.register_forward_hook(functools.partial(_after_unit, sharder, i))
    root.register_forward_pre_hook(lambda _m, _a: sharder.unshard(-1))


def _before_unit(sharder: Sharder, i: int, _module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    sharder.unshard(i)
    if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad and torch.is_grad_enabled():
        return (UnitBoundary.apply(args[0], functools.partial(sharder.post_backward, i)), *args[1:]), kwargs
    h = kwargs.get("hidden_states")
    if isinstance(h, torch.Tensor) and h.requires_grad and torch.is_grad_enabled():
        return args, {**kwargs, "hidden_states": UnitBoundary.apply(h, functools.partial(sharder.post_backward, i))}
    return None


def _after_unit(sharder: Sharder, i: int, _module: nn.Module, _args: tuple, out: object) -> object:
    sharder.reshard(i)
    first = out[0] if isinstance(out, tuple) and out else out
    if not (isinstance(first, torch.Tensor) and first.requires_grad and torch.is_grad_enabled()):
        return None
    wrapped = UnitBoundary.apply(first, functools.partial(sharder.unshard, i))
    return (wrapped, *out[1:]) if isinstance(out, tuple) else wrapped


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


class UnitBoundary(torch.autograd.Function):
    """Identity on a unit's input or output whose backward runs an FSDP hook: on the output it
    all-gathers the unit before its backward, on the input it reduce-scatters after it."""

    @staticmethod
    def forward(ctx, x, hook):  # noqa: ANN001
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        ctx.hook()
        return grad, None
