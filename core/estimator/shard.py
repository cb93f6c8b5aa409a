"""The estimator's model of rank 0 of a sharded run: mirrors ``core/simulation/shard.py`` event by event."""

from __future__ import annotations

from vramlab.core.estimator.engine import DTYPE_SIZE, Buf, Engine, Storage
from vramlab.core.estimator.ops import Ops
from vramlab.core.estimator.poly import Poly
from vramlab.core.kinds import Kind
from vramlab.core.spec.options import Offload, Sharding
from vramlab.core.spec.training import TrainingSetup


def part(n: Poly | int, world: int) -> Poly:
    """ceil(n / world) of a constant size (sharded sizes are never symbolic)."""
    v = n if isinstance(n, int) else _const(n)
    return Poly.of(-(-v // world))


def _const(p: Poly) -> int:
    if any(p.coefficients[1:]):
        raise ValueError("a sharded tensor's size must not depend on batch, sequence or rank")
    return p.coefficients[0]


class ShardModel:
    def __init__(self, setup: TrainingSetup, engine: Engine, ops: Ops, unsharded_dtype: str, mixed: bool,
                 reduce_dtype: str) -> None:
        self.engine, self.ops = engine, ops
        self.mode = setup.sharding
        self.world = setup.gpus
        self.offload = setup.offload
        self.params_sharded = self.mode.shards_params
        self.unsharded_dtype = unsharded_dtype
        self.mixed = mixed
        self.reduce_dtype = reduce_dtype
        self.unit_index = -1
        self.unit_bytes: dict[int, Poly] = {}
        self.unsharded: dict[int, Storage] = {}
        self.shards: dict[int, Storage] = {}  # id(full) -> shard storage (or partition view)
        self.unit_of: dict[int, int] = {}  # id(full) -> the unit it was sharded in
        self.grad_params: dict[int, list[Storage]] = {}
        self.opt_params: list[tuple[Storage, Storage]] = []
        self.grad_shards: dict[int, Storage] = {}  # id(param) -> its gradient partition (ZeRO-2)
        self.unit_grads: dict[tuple[int, str], Storage] = {}  # (unit, dtype) -> the reduce-scatter output holding
        self.unit_grad_params: dict[tuple[int, str], list[Storage]] = {}  # its gradient shards, and their params
        self.done: set[int] = set()
        self.reference = False  # a reference copy's (as_reference): resharded after each forward
        self.held: Storage | None = None  # every unit gathered at once (gather_all)
        self.grad_buffers: dict[str, Storage] = {}  # DeepSpeed's stage 3: the flat gradient partition buffers

    def as_reference(self, layers: dict[int, int]) -> None:
        """core/simulation/shard.py ``Sharder.as_reference``: FSDP makes the whole reference copy one unit
        (``layers``: how many of the model's layers each replayed layer's unit stands for)."""
        self.reference = True
        if self.mode is Sharding.FSDP:
            for unit in [u for u in self.unit_bytes if u != -1]:  # a VLM's tower units too (below -1)
                self.unit_bytes[-1] = self.unit_bytes.get(-1, Poly.of(0)) + self.unit_bytes.pop(unit) * \
                    layers.get(unit, 1)

    # ---- parameters ---------------------------------------------------------------------------------
    def param(self, numel: Poly | int, own_dtype: str, trainable: bool) -> Storage:
        """A full parameter (its storage is the unit's gathered buffer) and its 1/N shard."""
        engine = self.engine
        full_dtype = self.unsharded_dtype if (self.mixed and own_dtype in ("f32", "bf16", "f16")) else own_dtype
        full = engine.param(Poly.of(0), Kind.WEIGHTS, trainable)
        full.numel, full.dtype = Poly.of(numel), full_dtype
        full.gbytes = Poly.of(numel) * DTYPE_SIZE[full_dtype]
        self._shard(full, own_dtype)
        return full

    def adopt(self, full: Storage, own_dtype: str) -> None:
        """Quantized storage made on the host: shard it like a parameter."""
        self._shard(full, own_dtype)

    def _shard(self, full: Storage, own_dtype: str) -> None:
        ops, engine = self.ops, self.engine
        k = part(full.numel, self.world)
        if self.offload is Offload.PARAMS:
            shard = Storage(Poly.of(0), Kind.WEIGHTS, False)
            shard.param = True
        else:
            shard = ops.param(k, own_dtype, Kind.WEIGHTS, False)
        shard.numel, shard.dtype, shard.tag = k, own_dtype, engine.tag
        self.shards[id(full)] = shard
        self.unit_of[id(full)] = self.unit_index
        self.unit_bytes[self.unit_index] = self.unit_bytes.get(self.unit_index, Poly.of(0)) + \
            full.numel * DTYPE_SIZE[full.dtype]

    def register_trainable(self, p: Storage, unit: int | None) -> Storage:
        if self.params_sharded:
            shard = self.shards[id(p)]
            self.grad_params.setdefault(self.unit_of.get(id(p), unit), []).append(p)
        else:
            shard = Storage(Poly.of(0), p.kind, True)  # a view of the partition
            shard.param = True
            shard.numel, shard.dtype = part(p.numel, self.world), p.dtype
        shard.tag = p.tag
        self.opt_params.append((p, shard))
        return shard

    def optimizer_buffers(self, layers: dict[int, int]) -> None:
        """core/simulation/shard.py ``Sharder.optimizer_buffers`` (``layers``: how many of the model's layers each
        replayed layer stands for)."""
        if self.mode is not Sharding.ZERO3 or self.offload is not Offload.NONE or not self.opt_params:
            return
        sizes: dict[str, Poly] = {}
        for p, _shard in self.opt_params:
            dtype = self.reduce_dtype if self.mixed else p.dtype
            sizes[dtype] = sizes.get(dtype, Poly.of(0)) + part(p.numel, self.world) * layers.get(p.tag, 1)
        engine = self.engine
        old, engine.region = engine.region, Kind.GRADIENTS
        engine.tag = -1
        self.grad_buffers = {dtype: self.ops.new(n, dtype) for dtype, n in sizes.items()}
        engine.region = old

    # ---- hooks --------------------------------------------------------------------------------------------
    def gather_all(self, layers: dict[int, int]) -> None:
        """core/simulation/shard.py ``Sharder.gather_all`` (``layers``: how many of the model's layers each
        replayed layer's unit stands for)."""
        units = [u for u in self.unit_bytes if u not in self.unsharded]
        if units:
            engine = self.engine
            old, engine.region = engine.region, Kind.WEIGHTS
            self.held = engine.alloc(sum((self.unit_bytes[u] * layers.get(u, 1) for u in units), Poly.of(0)))
            engine.region = old

    def release_all(self) -> None:
        if self.held is not None:
            self.engine.drop(self.held)
            self.held = None

    def unshard(self, unit: int) -> None:
        if self.held is not None or unit in self.unsharded or unit not in self.unit_bytes:
            return
        engine = self.engine
        old, engine.region = engine.region, Kind.REFERENCE if self.reference else Kind.WEIGHTS
        self.unsharded[unit] = engine.alloc(self.unit_bytes[unit])
        engine.region = old

    def reshard(self, unit: int) -> None:
        if self.held is not None:
            return
        h = self.unsharded.pop(unit, None)
        if h is not None:
            self.engine.drop(h)

    def post_backward(self, unit: int) -> None:
        if unit in self.done:
            return
        self.done.add(unit)
        params = [p for p in self.grad_params.get(unit, ()) if p.grad is not None]
        groups: dict[str, list[Storage]] = {}  # each trainable dtype its own (core/simulation/shard.py)
        for p in params:
            groups.setdefault(self.reduce_dtype if self.mixed else p.dtype, []).append(p)
        for reduce, ps in groups.items():
            self._reduce_scatter((unit, reduce), ps, reduce)
        self.reshard(unit)

    def _reduce_scatter(self, key: tuple[int, str], params: list[Storage], reduce: str) -> None:
        engine, ops = self.engine, self.ops
        total = sum((p.numel for p in params), Poly.of(0))
        old, engine.region = engine.region, Kind.TEMPORARIES
        rs_in = ops.new(total, reduce)
        engine.region = old
        for p in params:
            g, p.grad = p.grad, None
            g.param = False
            engine.drop(g)
        if self.grad_buffers:  # DeepSpeed's stage 3: into the flat partition buffer
            ops.drop(rs_in)
            if key not in self.unit_grads:
                self.unit_grads[key] = self.grad_buffers[reduce]
                self.unit_grad_params[key] = params
            return
        out = None
        n = sum((part(p.numel, self.world) for p in params), Poly.of(0))
        cast = self.mixed and reduce != "f32"  # core/simulation/shard.py: FSDP2's cast to the fp32 shards
        red = None
        if cast:
            engine.region, old = Kind.TEMPORARIES, engine.region
            red = ops.new(n, reduce)
            if self.offload is not Offload.NONE:
                ops.drop(ops.new(n, "f32"))
            engine.region = old
        if self.offload is Offload.NONE:
            engine.region, old = Kind.GRADIENTS, engine.region
            out = ops.new(n, "f32" if cast else reduce)
            engine.region = old
        if red is not None:
            ops.drop(red)
        prev = self.unit_grads.get(key)
        ops.drop(rs_in)
        if out is not None:
            if prev is None:
                self.unit_grads[key] = out
                self.unit_grad_params[key] = params
            else:
                ops.drop(out)

    def zero2(self, p: Storage) -> None:
        engine, ops = self.engine, self.ops
        if id(p) not in self.grad_shards:
            if self.offload is Offload.NONE:
                old, engine.region = engine.region, Kind.GRADIENTS
                self.grad_shards[id(p)] = ops.new(part(p.numel, self.world), p.grad.dtype or p.dtype)
                engine.region = old
            else:
                self.grad_shards[id(p)] = None
        g, p.grad = p.grad, None
        g.param = False
        engine.drop(g)

    def start_backward(self) -> None:
        self.done = set()

    def finish_backward(self, units: list[int]) -> None:
        """FSDP's end-of-backward callback: the units whose input needed no gradient, from the highest number
        down (``units``, the decoder layers, and a vision tower's units, numbered below the root's -1 in module
        order: core/families/vlm_base/program.py), then the root."""
        for u in sorted({*units, *self.unit_bytes} - {-1}, reverse=True):
            self.engine.tag = max(u, -1)  # a tower's unit replays no layer
            self.post_backward(u)
        self.engine.tag = -1
        self.post_backward(-1)

    # ---- optimizer -------------------------------------------------------------------------------------
    def grads_to_partitions(self) -> list[Storage]:
        """Give every optimizer parameter its gradient partition; returns those with one."""
        out = []
        for p, shard in self.opt_params:
            if self.mode is Sharding.ZERO1:
                g = p.grad
            elif self.mode is Sharding.ZERO2:
                g = self.grad_shards.get(id(p))
            else:
                g = self._unit_has_grad(p)
            if g is not None:
                shard.grad = g if isinstance(g, Storage) else _marker()
                out.append(shard)
        return out

    def release_grads(self) -> None:
        """core/simulation/shard.py ``Sharder.release_grads``: the 16-bit gradients stage 1 / 2 free once the step's
        fp32 gradient is made."""
        if self.offload is not Offload.NONE:
            return
        engine = self.engine
        for p, _shard in self.opt_params:
            engine.tag = p.tag
            if self.mode is Sharding.ZERO1 and p.grad is not None:
                g, p.grad = p.grad, None
                g.param = False
                engine.drop(g)
            elif self.mode is Sharding.ZERO2:
                g = self.grad_shards.pop(id(p), None)
                if g is not None:
                    engine.drop(g)
        engine.tag = -1

    def _unit_has_grad(self, p: Storage) -> object | None:
        for key, ps in self.unit_grad_params.items():
            if any(q is p for q in ps):
                return self.unit_grads[key] if self.offload is Offload.NONE else True
        return None

    def zero_grad(self) -> None:
        engine = self.engine
        for p, shard in self.opt_params:
            engine.tag = p.tag
            if p.grad is not None:
                g, p.grad = p.grad, None
                g.param = False
                engine.drop(g)
            shard.grad = None
        for p, _shard in self.opt_params:
            engine.tag = p.tag
            g = self.grad_shards.pop(id(p), None)
            if g is not None:
                engine.drop(g)
        for key in list(self.unit_grads):
            engine.tag = max(key[0], -1)
            g = self.unit_grads.pop(key)
            if not self.grad_buffers:  # DeepSpeed's stage-3 buffer is kept
                engine.drop(g)
        self.unit_grad_params.clear()
        engine.tag = -1


def replayed_layers(plan: list[int], num_layers: int) -> dict[int, int]:
    """How many of the model's layers each replayed layer stands for: those up to the next one replayed
    (:func:`vramlab.core.estimator.layer_plan`), by its tag (its place in ``plan``)."""
    ends = [*plan[1:], num_layers]
    return {tag: ends[tag] - layer for tag, layer in enumerate(plan)}


def _marker() -> Storage:
    h = Storage(Poly.of(0), Kind.GRADIENTS, False)
    h.param = True
    return h


def boundary(hook) -> object:  # noqa: ANN001
    """The special of a UnitBoundary node: run the FSDP hook, pass the gradient through."""

    def special(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        hook()
        for h in node.saved:
            engine.drop(h)
        engine.deliver(node.edges[0][0], buf)

    return special
