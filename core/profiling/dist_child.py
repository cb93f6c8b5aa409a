"""One rank of a sharded profile run, started by torchrun (see :mod:`.distributed`).

Started as ``python -m vramlab.core.profiling.dist_child RUN_DIR`` by ``python -m torch.distributed.run``
(or, in the frozen app, ``vramlab --profile-child --dist-rank RUN_DIR``); torchrun sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous. The request is ``RUN_DIR/request.json``; the rank
writes its events as JSON lines to ``RUN_DIR/rank<R>.jsonl`` (one file per rank, so lines of different
ranks never interleave): ``start`` (pid, device), ``phase`` at every phase boundary, then exactly one
``result`` or ``failure`` in the same format as the single-GPU child (:mod:`.child`), each tagged with
``rank``.

What runs is real ``torch.distributed``: the built-in decoder (:mod:`.model`, with the emulating sharder
of :mod:`.shard` switched off) is built on the meta device, each decoder layer and then the root are
wrapped with FSDP2 ``fully_shard`` (mixed precision as the setup says), the shards are materialised on
``cuda:LOCAL_RANK`` (NCCL) or the CPU (gloo), and the usual steps of :mod:`.step` run. Sharding modes:

* ``fsdp`` / ``zero3``: ``fully_shard`` per layer (resharded after forward), root kept unsharded from
  forward to the end of backward (FSDP2's default for the root).
* ``zero2``: the same with ``reshard_after_forward=False`` (FSDP's SHARD_GRAD_OP): parameters stay
  gathered from forward to the end of backward, gradients are reduce-scattered. Unlike DeepSpeed ZeRO-2
  the parameters are sharded again between steps (the optimizer step holds 1/N of them).
* ``zero1`` is refused by the launcher (see :func:`.distributed.check_supported`).

Measurement per rank: on CUDA ``max_memory_allocated`` / ``max_memory_reserved`` per phase; on the CPU
the dispatch :class:`~.tracker.MemoryTracker`, extended to see through DTensor wrappers and to follow
FSDP2's storage resizes (unsharded parameters are freed with ``storage.resize_(0)`` and re-allocated
with ``resize_(n)``, which no dispatched op reports).

Fault injection (request ``fault``, ``kind`` or ``kind@rank``; no rank: every rank): ``crash`` ends the
process at the first backward, ``oom`` raises an out-of-memory error there, ``hang`` never returns,
``error`` raises an ordinary exception, ``slow`` sleeps between phases.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FAULT_PHASE = "backward@1"


def parse_fault(fault: str | None, rank: int) -> str | None:
    """The fault that applies to ``rank``: ``"crash@1"`` is rank 1's only, ``"slow"`` every rank's."""
    if not fault:
        return None
    kind, _, where = fault.partition("@")
    if where and int(where) != rank:
        return None
    return kind


class _Channel:
    """This rank's event file (append, flushed per line)."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self.f = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives as long as the rank

    def emit(self, obj: dict[str, Any]) -> None:
        self.f.write(json.dumps({"rank": self.rank, **obj}) + "\n")
        self.f.flush()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m torch.distributed.run ... -m vramlab.core.profiling.dist_child RUN_DIR",
              file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    try:
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        print(f"error: a rank of VRAM Lab's sharded profile needs whole numbers in RANK, LOCAL_RANK and WORLD_SIZE "
              f"(torchrun sets them): {e}", file=sys.stderr)
        return 2
    if not (run_dir / "request.json").is_file():  # not a run folder `vramlab profile` made: nothing to report into
        print(f"error: {str(run_dir)[:200]!r} is not a run folder of VRAM Lab's sharded profile (no request.json "
              "in it); this entry is started by `vramlab profile --gpus N` (run that instead)", file=sys.stderr)
        return 2
    try:
        ch = _Channel(run_dir / f"rank{rank}.jsonl", rank)
    except OSError as e:
        print(f"error: {run_dir}: cannot write this rank's events ({e.strerror or e})", file=sys.stderr)
        return 2
    ch.emit({"event": "start", "pid": os.getpid(), "local_rank": local_rank, "world": world,
             "t_wall": time.time()})
    code = 1
    try:
        req = json.loads((run_dir / "request.json").read_text(encoding="utf-8"))
        req["ack_path"] = str(run_dir / f"ack{rank}")
        code = run(req, rank, local_rank, world, ch.emit)
        return code
    except BaseException as e:  # noqa: BLE001 - every failure becomes a result line
        ch.emit({"event": "failure", "kind": "error", "message": f"{type(e).__name__}: {e}",
                 "trace": traceback.format_exc(limit=12), "t_wall": time.time()})
        return 1
    finally:
        # Only a rank that finished (every rank passed the final barrier) leaves the group politely. A failed
        # rank's peers may sit in a collective: destroy_process_group() would wait on them (or abort NCCL
        # under them); exiting lets torchrun end the others, and the process's exit frees its resources.
        if code == 0:
            _destroy()


def _destroy() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def fsdp2() -> tuple[Any, Any, Any]:
    """``(fully_shard, MixedPrecisionPolicy, FSDPParamGroup)`` wherever this torch keeps FSDP2 (public
    ``torch.distributed.fsdp`` since 2.6, ``torch.distributed._composable.fsdp`` in 2.5)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed._composable.fsdp._fsdp_param_group import FSDPParamGroup
    return fully_shard, MixedPrecisionPolicy, FSDPParamGroup


# ---- measurement ------------------------------------------------------------------------------------------

def make_tracker_class():  # noqa: ANN201 - the class needs torch, imported lazily
    """A :class:`MemoryTracker` that counts the local tensors inside DTensors and follows storage resizes."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from vramlab.core.kinds import Kind
    from vramlab.core.simulation.tracker import MemoryTracker, round_block

    def inner(t: Any) -> Iterator[Any]:
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            for a in attrs:
                v = getattr(t, a)
                if isinstance(v, torch.Tensor):  # DTensor also flattens its device mesh
                    yield from inner(v)
        else:
            yield t

    class DistTracker(MemoryTracker):
        """Per-rank tracker for FSDP2: DTensor outputs are counted by their local tensors (the mode sees
        an op on DTensors before DTensor dispatch runs it locally), meta tensors are not memory, and
        :meth:`resized` re-reads a storage FSDP2 resized in place (see :func:`follow_fsdp`)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._lock = threading.RLock()  # a storage can die on a backend thread (its Work held it last)
            self.backend_internal_peak = 0  # largest storage a collective made inside its kernel

        def _track(self, t, func=None, kind=None):  # noqa: ANN001, ANN202
            for x in inner(t):
                if x.is_meta:  # the model is built on the meta device: no memory until to_empty
                    continue
                if getattr(func, "is_view", False) and id(x.untyped_storage()) not in self._live:
                    # a view of a storage no op returned: made inside a kernel (gloo's reduce-scatter
                    # copies its whole input, and the copy is released by the backend's own thread at a
                    # racy moment). NCCL has no such tensor; it is kept out of the tensor level.
                    st = x.untyped_storage()
                    self.backend_internal_peak = max(self.backend_internal_peak, st.nbytes())
                    with self.host():
                        super()._track(x, func, kind)
                    continue
                super()._track(x, func, kind)

        def _change(self, kind, delta):  # noqa: ANN001, ANN202
            with self._lock:
                super()._change(kind, delta)

        def reclassify(self, t, kind, label=None):  # noqa: ANN001, ANN202
            if t is None:
                return
            for x in inner(t):
                super().reclassify(x, kind, label)

        def resized(self, storage: Any) -> None:
            entry = self._live.get(id(storage))
            if entry is None:
                return
            nbytes = round_block(storage.nbytes(), self.block)
            if nbytes == entry.nbytes:
                return
            if entry.nbytes == 0 and nbytes:  # FSDP2 re-allocating an unsharded parameter
                entry.kind = Kind.WEIGHTS
            self._change(entry.kind, nbytes - entry.nbytes)
            entry.nbytes = nbytes

    return DistTracker


@contextlib.contextmanager
def follow_fsdp(tracker: Any) -> Iterator[None]:
    """While inside: report every ``UntypedStorage.resize_`` to ``tracker.resized``, and give what FSDP2's
    communication steps allocate a kind (this process runs nothing else, so patching is contained):
    all-gather (``unshard``: the flat all-gather buffer and, with mixed precision, the compute-dtype
    copies of the shards) → temporaries; copy-out (``wait_for_unshard``: the unsharded parameters) →
    weights; ``post_backward`` (the reduce-scatter input and output; the output becomes the gradient
    shards and is relabelled by the post-accumulate hook) → temporaries."""
    import torch

    from vramlab.core.kinds import Kind

    FSDPParamGroup = fsdp2()[2]  # noqa: N806 - a class
    original = torch.UntypedStorage.resize_

    def resize_(self, size):  # noqa: ANN001, ANN202
        out = original(self, size)
        tracker.resized(self)
        return out

    def labelled(method: Any, kind: Kind, text: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with tracker.region(kind), tracker.label(text):
                return method(*args, **kwargs)
        return wrapper

    methods = {"unshard": (Kind.TEMPORARIES, "fsdp all-gather"),
               "wait_for_unshard": (Kind.WEIGHTS, "fsdp unsharded params"),
               "post_backward": (Kind.TEMPORARIES, "fsdp reduce-scatter")}
    saved = {name: getattr(FSDPParamGroup, name) for name in methods}
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    for name, (kind, text) in methods.items():
        setattr(FSDPParamGroup, name, labelled(saved[name], kind, text))
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
        for name, method in saved.items():
            setattr(FSDPParamGroup, name, method)


# ---- the sharded model -------------------------------------------------------------------------------------

def sharded_builder(mesh: Any, device: Any, info: dict[str, Any]) -> Callable[..., Any]:
    """``builder(spec, setup, device=, real=)`` for :func:`.step.measure`: the decoder on the meta device,
    FSDP2 per layer and root, then the shards materialised on ``device`` and initialised."""
    import dataclasses

    import torch

    from vramlab.core.simulation.model import INIT_STD, TORCH_DTYPES, Decoder, Plan
    from vramlab.core.spec.options import DType, Sharding
    from vramlab.core.spec.sharded_precision import mixed_reduce_dtype

    fully_shard, MixedPrecisionPolicy, _group = fsdp2()  # noqa: N806 - a class

    def build(spec, setup, device=None, real=True):  # noqa: ANN001, ANN202, ARG001
        setup.validate(spec)
        plan = Plan.make(spec, setup, torch.device("meta"), real=True)  # values on meta are no-ops
        mixed = plan.sharder is not None and plan.sharder.mixed
        # real FSDP2 does the sharding: the emulating sharder is switched off (its `mixed` decision, and
        # so autocast off under FSDP mixed precision, is kept)
        plan = dataclasses.replace(plan, sharder=None)
        model = Decoder(plan)
        mp = MixedPrecisionPolicy()
        if mixed:
            # accelerate's policy: gathered and reduced in the compute dtype (core/spec/sharded_precision.py)
            mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[setup.compute],
                                      reduce_dtype=TORCH_DTYPES[mixed_reduce_dtype(setup)])
        raf = setup.sharding is not Sharding.ZERO2
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        if device_.type == "cpu" and hasattr(model, "set_force_sum_reduction_for_comms"):
            model.set_force_sum_reduction_for_comms(True)  # gloo has no ReduceOp.AVG: sum, then divide in place
        model.to_empty(device=device_)
        object.__setattr__(plan, "device", device_)  # the batch is made on plan.device
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif "lora_B" in name or name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, INIT_STD)
            if model.inv_freq is not None:  # the rotary table to_empty left uninitialised: made again
                model.inv_freq = None
                model.inv_freq = Decoder._inv_freq(spec.head_dim, plan)
        info["fsdp"] = {"mixed_precision": mixed, "param_dtype": str(mp.param_dtype),
                        "reduce_dtype": str(mp.reduce_dtype), "reshard_after_forward": raf,
                        "weights": DType(setup.weight_dtype).value}
        return model

    device_ = torch.device(device)
    return build


# ---- the run -------------------------------------------------------------------------------------------------

def run(req: dict[str, Any], rank: int, local_rank: int, world: int, emit: Callable[[dict[str, Any]], None]) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vramlab.core.simulation.step import Aborted, measure
    from vramlab.core.simulation.tracker import NullTracker
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    spec = ModelSpec.from_dict(req["spec"])
    setup = TrainingSetup.from_dict(req["setup"])
    device_kind = req.get("device", "cuda")
    steps = int(req.get("steps", 2))
    fault = parse_fault(req.get("fault"), rank)
    cuda = device_kind == "cuda"
    info: dict[str, Any] = {"device": device_kind, "pid": os.getpid(), "torch": torch.__version__,
                            "rank": rank, "local_rank": local_rank, "world_size": world}
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
            emit({"event": "failure", "kind": "no_gpu", "t_wall": time.time(),
                  "message": f"rank {rank} needs cuda:{local_rank}, but torch sees "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s)"})
            return 2
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # creates the context
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        free, total = torch.cuda.mem_get_info(device)
        info["device_total_bytes"] = total
        info["device_free_after_context_bytes"] = free
        from vramlab.core.profiling.readings import device_uuid

        uuid = device_uuid(torch, local_rank)
        if uuid:
            info["gpu_uuid"] = uuid
            emit({"event": "device", "uuid": uuid, "cuda_index": local_rank})
        backend = "nccl"
    else:
        device = torch.device("cpu")
        info["gpu"] = "CPU"
        backend = "gloo"
    info["backend"] = backend
    from vramlab.core.profiling.readings import PhaseMeter, allocator_env

    info.update(allocator_env())
    timeout = req.get("collective_timeout_s")
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout:
        import datetime

        kwargs["timeout"] = datetime.timedelta(seconds=float(timeout))
    if cuda:
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    mesh = init_device_mesh(device.type, (world,))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    if cuda and not req.get("tracked"):
        tracker: Any = NullTracker()
        follow = contextlib.nullcontext()
    else:
        tracker = make_tracker_class()(counts=(lambda t: t.is_cuda) if cuda else None)
        follow = follow_fsdp(tracker)
    # the same phase line as the single-GPU child (with the ended phase's peaks), tagged with the rank
    meter = PhaseMeter(torch, cuda, device, tracker, emit, time.perf_counter())
    phases = meter.phases

    def on_phase(key: str, live: int) -> None:
        meter(key, live)
        if fault == "slow":
            time.sleep(0.3)
        if key == FAULT_PHASE:
            if fault == "oom":
                raise torch.OutOfMemoryError(f"out of memory on rank {rank} (injected by the fault scenario 'oom')")
            if fault == "error":
                raise RuntimeError(f"injected error on rank {rank}")
            if fault == "crash":
                os._exit(139)
            if fault == "hang":
                while True:
                    time.sleep(1)

    sync = (lambda: torch.cuda.synchronize(device)) if cuda else None
    builder = sharded_builder(mesh, device, info)
    try:
        with follow:
            run_ = measure(spec, setup, device, real=True, tracker=tracker, steps=steps, on_phase=on_phase,
                           sync=sync, builder=builder)
            on_phase("end", getattr(tracker, "current", 0))
        if cuda and req.get("settle") and req.get("ack_path"):
            from vramlab.core.profiling.readings import settle_and_wait, wait_for_file

            info["context_settled"] = settle_and_wait(torch, lambda t: wait_for_file(req["ack_path"], t), emit,
                                                      index=device)
    except torch.OutOfMemoryError as e:
        failure = {"event": "failure", "kind": "oom", "phase": meter.key, "message": str(e).splitlines()[0],
                   "phases": phases, "info": info, "t_wall": time.time()}
        if cuda:
            failure["allocated_at_failure"] = torch.cuda.memory_allocated(device)
            failure["reserved_at_failure"] = torch.cuda.memory_reserved(device)
        elif hasattr(tracker, "current"):
            failure["allocated_at_failure"] = tracker.current
        emit(failure)
        return 1
    except Aborted:
        emit({"event": "failure", "kind": "cancelled", "message": "cancelled", "t_wall": time.time()})
        return 1
    except Exception as e:  # noqa: BLE001 - a failed rank says where
        emit({"event": "failure", "kind": "error", "phase": meter.key, "message": f"{type(e).__name__}: {e}",
              "trace": traceback.format_exc(limit=12), "info": info, "t_wall": time.time()})
        return 1
    from vramlab.core.profiling.readings import sdpa_info

    info.update(sdpa_info(torch, device_kind, spec, setup))
    out: dict[str, Any] = {"event": "result", "info": info, "phases": phases, "timing": run_.timing,
                           "total_params": run_.total_params, "trainable_params": run_.trainable_params,
                           "managed_bytes": run_.managed_bytes, "t_wall": time.time()}
    if cuda:
        out["peak_allocated_bytes"] = max(p["allocated"] for p in phases.values())
        out["peak_reserved_bytes"] = max(p["reserved"] for p in phases.values())
    if not isinstance(tracker, NullTracker):
        from vramlab.core.profiling.readings import tracked_json

        out["tracked"] = tracked_json(tracker)
        info["backend_internal_peak_bytes"] = getattr(tracker, "backend_internal_peak", 0)
        if not cuda:
            out["peak_allocated_bytes"] = tracker.peak.total_bytes
            out["peak_reserved_bytes"] = tracker.peak.total_bytes
    if not cuda:
        import resource

        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # every rank finishes its steps before any leaves the group (a late rank must not see a closed peer)
    dist.barrier()
    emit(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
