"""TRL's activation offloading (``activation_offloading=True`` in SFTConfig / DPOConfig / KTOConfig) as a
transformation of any step: the saved-tensors hooks of TRL 1.16.0's ``OffloadActivations`` (derived from
torchtune's), as ``get_act_offloading_ctx_manager(model)`` sets them up and the trainers' ``training_step`` enters
them around the forward and the backward of each micro-batch.

What stays on the GPU, following ``trl/models/activation_offloading.py`` with the arguments the trainers pass
(``use_streams=True``, ``min_offload_size=1024``, ``max_fwd_stash_size=5``):

* a saved tensor under 1,024 bytes, a parameter (or a tensor on a parameter's storage: ``weight.t()``), a tensor
  on another device, and, while an earlier save of the same storage is still in the forward stash, a second save
  of it (kept as it is until backward unpacks it);
* what the output head saves (its forward runs under TRL's ``NoOpManager``; the loss after it is offloaded);
* the forward stash: the GPU tensor of each of the last 5 packs (counted over every saved tensor, kept or not) is
  held until the copy stream is done with it; a non-contiguous or offset tensor is cloned first and the clone is
  what the stash holds. What the stash holds when the forward ends stays until the first node of backward that
  unpacks an offloaded tensor has run;
* in backward, a tensor brought back lives until the next node that brings one back has run (the "previous
  node's" tensors are dropped by that node's hook); what is left goes when backward ends.

axolotl 0.19.0's ``activation_offloading: true`` on an adapter run (``ActivationOffloadingMixin``) runs the same class
with two differences in what stays: its ``get_lora_act_offloading_ctx_manager`` never collects the parameters'
storages, so a view of a parameter (``weight.t()``, which a matmul saves) is offloaded, and its
``_patch_trl_offload_compute_stream_clone`` clones every saved tensor that is not a parameter and is non-contiguous
or offset (on the compute stream) before TRL's hook sees it, kept or not: the clone is what the stash, or the
kept entry, holds.

Under ZeRO-3 / FSDP (``sharder``: the step's :class:`~vramlab.core.simulation.shard.Sharder`), the weights a layer
computes with are the unit's gathered storages, none of which TRL's parameter set holds: the trainers build the
hooks in ``__init__`` (``get_act_offloading_ctx_manager(model=self.model)``), before accelerate's ``prepare``
shards the model, when its parameters are host tensors (FSDP2: Trainer leaves them on the CPU for ``fully_shard``;
DeepSpeed's ``zero.Init`` leaves each an empty tensor, whose null pointer ``update_model_params`` skips). So a
saved view of a gathered weight (``weight.t()``, which a matmul saves) of 1,024 bytes or more is offloaded like an
activation (its contiguous copy made on the GPU and held in the forward stash, a copy brought back in backward); a
gathered parameter saved as itself (a norm's weight: FSDP2's unsharded ``nn.Parameter``, DeepSpeed's own) stays,
by TRL's ``isinstance`` check.

The host copies are not device memory (:func:`vramlab.core.simulation.context.host`). Without CUDA streams
(``use_streams=False``, axolotl's ``legacy``) nothing is stashed: that mode is not what TRL runs and is not
modelled here. Verified against TRL's own class in ``tests/test_offloading.py``.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from vramlab.core.simulation import context
from vramlab.core.simulation.shard import Sharder
from vramlab.core.spec.options import ActivationOffload
from vramlab.core.spec.training import TrainingSetup

MIN_OFFLOAD_BYTES = 1024  # TRL's min_offload_size default (the trainers pass none)
FWD_STASH = 5  # TRL's max_fwd_stash_size default


def _storage_key(t: torch.Tensor) -> tuple:
    """TRL's ``_get_unique_tensor_key`` (storage pointer + offset, dtype), by storage identity: a fake tensor's
    data pointer is 0. The key lives as long as its storage (:meth:`OffloadActivations._track`)."""
    return id(t.untyped_storage()), t.storage_offset(), t.dtype


class OffloadActivations(saved_tensors_hooks):
    """The hooks (see the module docstring); ``device``: the step's device type (``cuda`` on a GPU run, ``cpu``
    under fake tensors, which stand for it); ``axolotl``: with axolotl's patches (``params``: whether the parameters'
    storages are kept, as TRL's manager collects them and axolotl's adapter manager does not)."""

    def __init__(self, model: nn.Module, device: str, axolotl: bool = False, params: bool = True,
                 sharder: Sharder | None = None) -> None:
        self.device = device
        self.sharder = sharder if sharder is not None and sharder.params_sharded else None
        self.pre_clone = axolotl
        self.tracker: dict[int, tuple] = {}
        self.tensor_id = 0
        self.first_forward = True
        self.first_backward = True
        self.storage_ids: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.graph_id: int | None = None
        self.node: object = None
        self.param_storages = {id(p.untyped_storage()) for p in model.parameters()} if params else set()
        super().__init__(self._clone_first if axolotl else self._pack, self._unpack)

    def _clone_first(self, t: torch.Tensor) -> int:
        """axolotl's ``pack_contiguous``: an offset or non-contiguous saved tensor (not a parameter) on the device is
        cloned on the compute stream before TRL's hook."""
        if (t.device.type == self.device and not context.on_host(t) and not isinstance(t, nn.Parameter)
                and (not t.is_contiguous() or t.storage_offset() != 0)):
            t = t.clone(memory_format=torch.contiguous_format)
        return self._pack(t)

    # ---- forward ---------------------------------------------------------------------------------------------
    def _track(self, key: tuple, tid: int, storage: torch.UntypedStorage) -> None:
        """``key`` (of ``storage``, the tensor's as TRL saw it) stands for ``tid``. It goes when the storage is freed:
        Python gives a later storage a freed one's id() at random (CPython's allocator), and a stale key would keep
        that storage on the device as "in the stash already" in one run and not the next. (On CUDA TRL's key is the
        data pointer, which the caching allocator may hand a later tensor: docs/levels.md.)"""
        if key not in self.storage_ids:
            weakref.finalize(storage, self._forget, key)
        self.storage_ids[key] = tid
        self.key_of[tid] = key

    def _forget(self, key: tuple) -> None:
        self.storage_ids.pop(key, None)

    def _release(self, tid: int) -> None:
        key = self.key_of.pop(tid, None)
        if key is not None and self.storage_ids.get(key) == tid:
            del self.storage_ids[key]

    def _keep(self, tid: int, t: torch.Tensor) -> int:
        self.tracker[tid] = (t, False, None)
        return tid

    def _pack(self, t: torch.Tensor) -> int:
        if self.first_forward:
            self.first_forward, self.first_backward = False, True
            self.storage_ids, self.key_of = {}, {}
        self.tensor_id += 1
        tid = self.tensor_id
        key, storage = _storage_key(t), t.untyped_storage()
        if key in self.storage_ids:  # this storage is in the stash already: kept on the GPU as it is
            self._keep(tid, t)
            self._track(key, tid, storage)
            return tid
        # a gathered weight (ZeRO-3 / FSDP) stands in host memory for the unit's all-gather buffer on the device
        gathered = self.sharder is not None and self.sharder.shard_of(t) is not None
        if (t.device.type != self.device or (context.on_host(t) and not gathered)  # offloaded checkpointing's input
                or t.element_size() * t.nelement() < MIN_OFFLOAD_BYTES or isinstance(t, nn.Parameter)
                or (id(t.untyped_storage()) in self.param_storages and not gathered)):
            return self._keep(tid, t)
        shape, stride, offset = t.size(), t.stride(), t.storage_offset()
        broadcast = 0 in stride
        if not broadcast and (not t.is_contiguous() or offset != 0):
            t = t.clone(memory_format=torch.contiguous_format) if offset != 0 else t.contiguous()
            shape, stride, offset = t.size(), t.stride(), t.storage_offset()
        for old in list(self.fwd_stash):
            if old > tid - FWD_STASH:
                break
            del self.fwd_stash[old]
            self._release(old)
        # pinned host memory, not the device's (fake and meta tensors stand for the device and stay where they are)
        where = torch.device("cpu") if t.is_cuda else t.device
        with context.host():
            if broadcast:  # the storage itself, not the broadcast
                n = t.untyped_storage().nbytes() // t.element_size()
                host = torch.empty(n, dtype=t.dtype, device=where)
                src = torch.as_strided(t, (n,), (1,), 0)
            else:
                host = torch.empty_like(t, device=where)
                src = t
            if not t.is_meta:
                host.copy_(src, non_blocking=True)
        self.tracker[tid] = (host, True, (shape, stride, offset, t.device))
        self.fwd_stash[tid] = t
        self._track(key, tid, storage)
        return tid

    # ---- backward --------------------------------------------------------------------------------------------
    def _end_of_backward(self) -> None:
        self.bwd_stash.clear()

    def _unpack(self, tid: int) -> torch.Tensor:
        if self.first_backward:
            self.graph_id = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.first_backward = False
        t, moved, layout = self.tracker[tid]
        if moved:
            node = torch._C._current_autograd_node()
            prev: list[int] = []
            if torch._C._current_graph_task_id() == self.graph_id and self.node is not node:
                self.node = node
                prev = list(self.bwd_stash)
            brought = tid not in self.fwd_stash
            refcount = 0
            if not brought:
                t = self.fwd_stash[tid]
            else:
                shape, stride, offset, device = layout
                t = torch.as_strided(t.to(device, copy=True), shape, stride, offset)  # the copy back to the GPU
                self.bwd_stash[tid] = t
                refcount = torch._C._storage_Use_Count(t.untyped_storage()._cdata)

            def hook(outputs, inputs):  # noqa: ANN001, ANN202 - the node's post hook, as TRL registers it
                if brought and tid in self.bwd_stash:
                    held = self.bwd_stash[tid]
                    if torch._C._storage_Use_Count(held.untyped_storage()._cdata) > refcount:
                        del self.bwd_stash[tid]  # record_stream: it goes with its last user
                for old in list(self.fwd_stash):  # the forward stash goes once backward has begun
                    del self.fwd_stash[old]
                    self._release(old)
                for old in prev:
                    self.bwd_stash.pop(old, None)
                return outputs

            node.register_hook(hook)
        del self.tracker[tid]
        self._release(tid)
        if not self.tracker:
            self.first_forward = True
        return t

    def __enter__(self) -> OffloadActivations:
        self.tracker.clear()
        self.storage_ids.clear()
        self.key_of.clear()
        self.tensor_id = 0
        self.first_forward = self.first_backward = True
        self.bwd_stash.clear()
        self.fwd_stash.clear()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.bwd_stash.clear()
            self.fwd_stash.clear()
        finally:
            super().__exit__(*exc)


class _NoOp(saved_tensors_hooks):
    """TRL's ``NoOpManager``: the innermost hooks, which keep every saved tensor as it is."""

    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)


def output_head(model: nn.Module) -> nn.Module | None:
    """The module ``get_act_offloading_ctx_manager`` exempts, by its own order of checks (after unwrapping
    ``module`` and a peft model's ``base_model``): ``output`` (or ``output.linear``), ``lm_head``, a ``decoder``'s
    ``output`` or ``lm_head``, ``final_layer_norm`` / ``ln_f``, ``head``. ``model`` may be VRAM Lab's wrapper of
    transformers' class (its ``inner``)."""
    m = getattr(model, "inner", model)
    if hasattr(m, "module"):
        m = m.module
    if hasattr(m, "base_model") and hasattr(m, "peft_config"):
        m = m.base_model
    if hasattr(m, "output"):
        out = m.output
        if isinstance(out, nn.Module):
            return out
        linear = getattr(out, "linear", None)
        return linear if isinstance(linear, nn.Module) else None
    if hasattr(m, "lm_head"):
        return m.lm_head
    if hasattr(m, "decoder"):
        dec = m.decoder
        return getattr(dec, "output", None) or getattr(dec, "lm_head", None)
    if hasattr(m, "final_layer_norm") or hasattr(m, "ln_f"):
        return getattr(m, "final_layer_norm", None) or m.ln_f
    head = getattr(m, "head", None)
    return head if isinstance(head, nn.Module) else None


def offload_context(model: nn.Module, device: str, setup: TrainingSetup) -> OffloadActivations:
    """``get_act_offloading_ctx_manager(model)`` (axolotl's ``get_lora_act_offloading_ctx_manager`` for an adapter
    run: the same exemptions): the hooks, with the output head's forward (and any module whose name holds "liger")
    under a no-op manager."""
    axolotl = setup.offload_activations is ActivationOffload.AXOLOTL
    plan = getattr(model, "plan", None)
    hooks = OffloadActivations(model, device, axolotl=axolotl, params=not (axolotl and setup.uses_lora),
                               sharder=getattr(plan, "sharder", None))
    noop = _NoOp()
    exempt = [output_head(model)]
    m = getattr(model, "inner", model)
    exempt += [mod for name, mod in m.named_modules() if "liger" in name.lower()]
    for mod in exempt:
        if mod is not None:
            mod.register_forward_pre_hook(lambda *_: noop.__enter__())
            mod.register_forward_hook(lambda *_: noop.__exit__(), always_call=True)
    return hooks
