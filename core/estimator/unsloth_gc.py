"""Unsloth's own gradient checkpointing on the symbolic engine (core/simulation/unsloth_gc.py is the reference):
unsloth_zoo 2026.10.9's ``UnslothCheckpointFunction`` state for one run, its staging buffers as engine storages.

Its decisions follow sizes (a layer input over 2 MiB is offloaded), so its tapes are recorded at concrete sizes
(``symbolic_sizes``); the counts of checkpointed layers are those of the replayed plan, whose last layer is the
model's last (a middle layer standing for several counts once, before it as after it)."""

from __future__ import annotations

from collections.abc import Callable

from vramlab.core.estimator.engine import DTYPE_SIZE, Engine, Storage
from vramlab.core.kinds import Kind
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth_gc import INITIAL_GPU_BUFFER_BYTES, MINIMUM_SIZE, unsloth_gc_runs


class UnslothGC:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.first_pass, self.last_index, self.current = True, 0, 0
        self.backward_pass, self.double = True, False
        self.buffers: list[Storage | None] = [None, None]
        self.sizes = [0, 0]
        self.next_slot = 0

    def offload(self, x: Storage) -> Callable[[], Storage] | None:
        """The forward's decision for a checkpointed layer's input ``x``: None where it stays saved on the GPU,
        else what its backward recomputes from (a view of the staging buffer it comes back into)."""
        if not x.rg:
            return None
        if self.first_pass:
            self.last_index += 1
        self.current += 1
        itemsize = 2 if x.dtype == "f32" else DTYPE_SIZE[x.dtype]
        # numel() * itemsize as unsloth computes it: a view's own elements (it has no bytes of its own)
        numel = _concrete(x.numel) if x.base is not None else _concrete(x.nbytes) // DTYPE_SIZE[x.dtype]
        new_size = numel * itemsize
        if not (new_size > MINIMUM_SIZE and (self.current != self.last_index or self.first_pass)):
            return None
        slot = self._stage(new_size)
        numel, dtype = x.numel, x.dtype

        def staged() -> Storage:
            buffer = self.buffers[1] if self.double and slot == 1 else self.buffers[0]
            if dtype == "f32":  # stored as bfloat16, cast back: a copy
                xd = self.engine.alloc(numel * 4, rg=True)
                xd.numel, xd.dtype = numel, dtype
                return xd
            return self.engine.view(buffer, numel, rg=True)

        return staged

    def backward(self) -> None:
        self.backward_pass, self.first_pass, self.current = True, False, 0

    def _stage(self, new_size: int) -> int:
        e = self.engine
        tag, region, e.tag, e.region = e.tag, e.region, -1, Kind.TEMPORARIES  # buffers of no layer, for the run
        try:
            for i in (0, 1):  # _ensure_device_buffers: A, then B
                if self.buffers[i] is None:
                    self._make(i, INITIAL_GPU_BUFFER_BYTES)
            if self.backward_pass:
                self.backward_pass = False
                if not self.first_pass and not self.double:
                    self.double = True  # more than 512 MiB free (core/simulation/unsloth_gc.py)
            self._grow(0, new_size)
            if self.double:
                self._grow(1, new_size)
        finally:
            e.tag, e.region = tag, region
        slot = self.next_slot
        self.next_slot ^= 1
        return slot

    def _make(self, i: int, nbytes: int) -> None:
        n = -(-nbytes // 2) * 2
        h = self.engine.alloc(n)
        h.numel, h.dtype = n // 2, "bf16"
        self.buffers[i], self.sizes[i] = h, n

    def _grow(self, i: int, new_size: int) -> None:
        if -(-new_size // 2) * 2 > self.sizes[i]:  # resize_: the new storage, then the old one freed
            old = self.buffers[i]
            self._make(i, new_size)
            self.engine.drop(old)


def _concrete(p) -> int:  # noqa: ANN001 - a Poly recorded at concrete sizes
    if any(p.coefficients[1:]):
        raise AssertionError("Unsloth's checkpointing is recorded at concrete sizes")
    return int(p.coefficients[0])


def attach(engine: Engine, setup: TrainingSetup) -> None:
    """The run's state on ``engine`` where Unsloth's function is the checkpoint function."""
    engine.unsloth_gc = UnslothGC(engine) if unsloth_gc_runs(setup) else None
    if engine.unsloth_gc is not None:
        engine.ckpt_reentrant = True  # unsloth_checkpoint forces use_reentrant=True onto UnslothCheckpointFunction
