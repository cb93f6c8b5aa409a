"""The optimizer step on the symbolic engine: torch's foreach / fused / single-tensor AdamW and SGD, and the
builder's Lion, Adafactor, bitsandbytes' 8-bit and paged AdamW, torchao's low-bit AdamW, peft's LoRA-FA and the
master-weight wrapper (see ``core/simulation/optim.py``): the states each creates, the temporaries of its step.
Every event carries the layer tag of its parameter, so repeated layers repeat their optimizer work too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vramlab.core.estimator.engine import DTYPE_SIZE, VISION_PARAM_KINDS, Storage
from vramlab.core.estimator.poly import Poly
from vramlab.core.estimator.shard import replayed_layers
from vramlab.core.kinds import Kind
from vramlab.core.spec.options import Optimizer, OptimizerImpl
from vramlab.core.spec.sharded_precision import deepspeed_masters, deepspeed_sub_groups

if TYPE_CHECKING:
    from vramlab.core.estimator.driver import StepModel


BNB_MIN_8BIT = 4096
BNB_BLOCK = 256
BNB_PAGED_MIN = 100_000
# torchao 0.18.0 optim/adam.py ``_new_buffer``: a quantized state for tensors of at least 4096 elements whose size the
# block divides, else ``zeros_like(p)`` (the parameter's dtype); (block, code bytes per element x 2, qmap entries)
TORCHAO_MIN = 4096
TORCHAO_LAYOUT = {Optimizer.TORCHAO_ADAMW_8BIT: (256, 2, 256), Optimizer.TORCHAO_ADAMW_4BIT: (128, 1, 16),
                  Optimizer.TORCHAO_ADAMW_FP8: (256, 2, 0)}


def state_kind(p: Storage) -> Kind:
    """Optimizer states of the vision tower and projector are vision training state; the rest optimizer states."""
    return Kind.VISION_TRAINING if p.kind in VISION_PARAM_KINDS else Kind.OPTIMIZER_STATES


def _const_numel(p: Poly) -> int:
    return p.coefficients[0] if isinstance(p, Poly) else int(p)


class OptimizerModel:
    """Allocations of the optimizer step per setup (see core/simulation/optim.py). Every event carries
    the layer tag of the parameter it belongs to, so repeated layers repeat their optimizer work too."""

    def __init__(self, sm: StepModel) -> None:
        self.sm = sm
        self.engine = sm.engine
        self.setup = sm.setup
        self.params = sm.m.params
        sh = sm.m.sh
        if sh is not None:  # the optimizer steps each parameter's partition
            units = {}
            for tag, ps in enumerate(sm.m.layer_params):
                for p in ps:
                    units[id(p)] = tag
            shards = []
            for p in self.params:
                s = sh.register_trainable(p, units.get(id(p), -1))
                sm.m.shapes[id(s)] = (_const_numel(s.numel), 0)
                shards.append(s)
            self.params = shards
            sh.optimizer_buffers(replayed_layers(sm.m.plan, sm.m.spec.num_layers))
        self.states: dict[int, tuple[Storage, list[Storage]]] = {}
        self.managed: dict[int, Poly] = {}  # CUDA managed bytes by layer tag
        self.masters: list[Storage] = []
        self.main_grads: list[Storage] = []
        self.in_backward = self._step_one if self.setup.optimizer_in_backward else None

    def _state_shapes(self, p: Storage, dtype: str) -> list[tuple[Poly, str, bool]]:
        """(numel, dtype, managed) of each state tensor of parameter ``p``."""
        opt = self.setup.optimizer
        if opt is Optimizer.ADAMW:
            return [(p.numel, dtype, False), (p.numel, dtype, False)]
        if opt is Optimizer.SGD:
            return []
        if opt in (Optimizer.SGD_MOMENTUM, Optimizer.LION):
            return [(p.numel, dtype, False)]
        if opt is Optimizer.ADAFACTOR:
            rows, cols = self.sm.m.shape_of(p)
            if cols:
                return [(rows, dtype, False), (cols, dtype, False)]
            return [(p.numel, dtype, False)]
        if opt.is_torchao or opt is Optimizer.PAGED_ADAMW_32BIT:
            return size_dependent_states(opt, p, dtype)
        # bitsandbytes 8-bit: small tensors keep fp32 states; paged states of large ones are managed
        n = p.numel.generic() if isinstance(p.numel, Poly) else p.numel
        if n < BNB_MIN_8BIT:
            return [(p.numel, "f32", False), (p.numel, "f32", False)]
        if isinstance(p.numel, Poly) and any(p.numel.coefficients[1:]):
            raise ValueError("8-bit optimizer state of a rank-dependent tensor needs a concrete rank")
        num = int(p.numel.coefficients[0]) if isinstance(p.numel, Poly) else p.numel
        nb = (num + BNB_BLOCK - 1) // BNB_BLOCK
        paged = opt is Optimizer.PAGED_ADAMW_8BIT and num >= BNB_PAGED_MIN
        return [(p.numel, "u8", paged), (p.numel, "u8", paged), (Poly.of(nb), "f32", False),
                (Poly.of(nb), "f32", False)]

    def _fused(self) -> bool:
        return self.setup.impl is OptimizerImpl.FUSED and self.setup.optimizer in (
            Optimizer.ADAMW, Optimizer.SGD, Optimizer.SGD_MOMENTUM)

    def _create_states(self, ps: list[Storage]) -> None:
        engine, ops = self.engine, self.sm.ops
        old_tag = engine.tag
        engine.region, old = Kind.OPTIMIZER_STATES, engine.region
        if self.setup.optimizer.is_8bit and not self.states:
            self.qmaps = [ops.new(256, "f32"), ops.new(256, "f32")]
        for p in ps:
            engine.tag = p.tag
            engine.region = state_kind(p)
            hs = []
            if self.setup.optimizer is Optimizer.ADAMW and self._fused():
                hs.append(ops.new(1, "f32"))  # fused: the step counter lives on the device
            for numel, dtype, managed in self._state_shapes(p, p.dtype):
                if managed:  # CUDA managed memory: outside torch's allocator
                    self.managed[p.tag] = self.managed.get(p.tag, Poly.of(0)) + numel * DTYPE_SIZE[dtype]
                    continue
                hs.append(ops.new(numel, dtype))
            self.states[id(p)] = (p, hs)
        engine.tag = old_tag
        engine.region = old

    def _temps(self, ps: list[Storage]) -> None:
        """Optimizer-step temporaries (kind optimizer_temps) for a group of parameters."""
        engine, ops = self.engine, self.sm.ops
        old_tag = engine.tag
        setup = self.setup
        opt = setup.optimizer
        impl = setup.impl
        foreach = impl is OptimizerImpl.FOREACH
        if opt is Optimizer.ADAMW and impl is OptimizerImpl.SINGLE:
            prev = None
            for p in ps:  # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                engine.tag = p.tag
                a = ops.new(p.numel, p.dtype)
                b = ops.new(p.numel, p.dtype)
                ops.drop(a, prev)  # the previous parameter's denom lives until the name is rebound
                prev = b
            ops.drop(prev)
        elif opt is Optimizer.LION or (opt is Optimizer.ADAMW and foreach):
            # _foreach_sqrt(exp_avg_sqs) / _foreach_lerp(...): one temporary per parameter, all at once (foreach)
            self._per_param(ps, lambda p: ops.new(p.numel, p.dtype), together=foreach)
        elif opt is Optimizer.ADAFACTOR:
            self._per_param(ps, self._adafactor_est, together=foreach)
        # SGD: momentum updated in place; 8-bit: in-place kernels; fused AdamW: no temporaries
        engine.tag = old_tag

    def _per_param(self, ps: list[Storage], make: Callable[[Storage], Storage], together: bool) -> None:
        """One temporary per parameter (``make``, under the parameter's tag): all alive at once (a foreach
        step), or each freed before the next is made (single-tensor)."""
        engine, ops = self.engine, self.sm.ops
        if together:
            ts = []
            for p in ps:
                engine.tag = p.tag
                ts.append(make(p))
            for p, t in zip(ps, ts):
                engine.tag = p.tag
                ops.drop(t)
        else:
            for p in ps:
                engine.tag = p.tag
                ops.drop(make(p))

    def _adafactor_est(self, p: Storage) -> Storage:
        ops = self.sm.ops
        rows, cols = self.sm.m.shape_of(p)
        if cols:
            rm = ops.new(rows, p.dtype)  # norm(dim=-1).square_().div_(): lives until _estimate returns
            cm = ops.new(cols, p.dtype)
            est = ops.new(p.numel, p.dtype)  # row_var @ col_var
            mean = ops.new(1, p.dtype)
            ops.drop(mean, rm, cm)
            return est
        sq = ops.new(p.numel, p.dtype)
        ops.drop(sq)
        return ops.new(p.numel, p.dtype)

    def step(self, ps: list[Storage] | None = None) -> None:
        engine, ops = self.engine, self.sm.ops
        if ps is None:
            ps = [p for p in self.params if p.grad is not None]
        engine.region, old = Kind.OPTIMIZER_TEMPS, engine.region
        if self.setup.has_master_copy:
            zero = deepspeed_masters(self.setup)
            if not self.masters:
                engine.region = Kind.MASTER_WEIGHTS
                for p in self.params:
                    engine.tag = p.tag
                    mh = ops.new(p.numel, "f32")
                    mh.param, mh.tag = True, p.tag
                    self.sm.m.shapes[id(mh)] = self.sm.m.shape_of(p)
                    self.masters.append(mh)
                engine.region = Kind.GRADIENTS
                for p in ([] if zero else self.params):
                    engine.tag = p.tag
                    g = ops.new(p.numel, "f32")
                    g.param = True
                    self.main_grads.append(g)
                engine.region = Kind.OPTIMIZER_TEMPS
            if zero:
                self._zero_step(ps)
                ps = None
            else:
                for p in ps:
                    engine.tag = p.tag
                    g, p.grad = p.grad, None
                    if self.sm.m.sh is None:  # partitions' gradients belong to the sharder
                        g.param = False
                        engine.drop(g)
                ps = self.masters
                for mh, g in zip(self.masters, self.main_grads):
                    mh.grad = g
        if ps is not None:
            self._inner_step(ps)
        engine.region = old
        for p, hs in self.states.values():
            engine.tag = p.tag
            for h in hs:
                engine.reclassify(h, state_kind(p))
        engine.tag = -1

    def _inner_step(self, ps: list[Storage]) -> None:
        """The inner optimizer's step of ``ps``: its states made at their first step, its temporaries."""
        if self.setup.lora_fa and self.setup.uses_lora:
            self._lorafa_step(ps)
        else:
            new = [p for p in ps if id(p) not in self.states]
            if new:
                self._create_states(new)
            self._temps(ps)

    def _zero_step(self, ps: list[Storage]) -> None:
        """core/simulation/optim.py ``MasterWeights.step`` under DeepSpeed's ZeRO: group after group (stage 3's
        sub-groups), the fp32 gradient made, the group's masters stepped, the fp32 gradient freed. A replayed layer
        counts for the layers it stands for; sub-groups split only where every layer is replayed
        (:func:`~vramlab.core.spec.sharded_precision.deepspeed_splits`)."""
        engine, ops, m = self.engine, self.sm.ops, self.sm.m
        layers = replayed_layers(m.plan, m.spec.num_layers)
        stepped = {id(p) for p in ps}
        groups = deepspeed_sub_groups([_const_numel(p.numel) * layers.get(p.tag, 1) for p in self.params], self.setup)
        if len(groups) > 1 and any(n > 1 for n in layers.values()):
            raise ValueError("DeepSpeed's stage-3 sub-groups need every layer replayed")
        for group in groups:
            idx = [i for i in group if id(self.params[i]) in stepped]
            if not idx:
                continue
            fp32 = self._fp32_grad([self.params[i] for i in idx], layers)
            masters = [self.masters[i] for i in idx]
            for mh in masters:
                mh.grad = fp32
            engine.region = Kind.OPTIMIZER_TEMPS
            self._inner_step(masters)
            engine.tag = -1
            ops.drop(fp32)  # the group's fp32 gradient freed after its step
            for mh in masters:
                mh.grad = None

    def _fp32_grad(self, ps: list[Storage], layers: dict[int, int]) -> Storage:
        """core/simulation/optim.py ``MasterWeights._fp32_grad``: the group's 16-bit gradient partitions flattened
        and cast to fp32, the flat copy freed; then stage 1 / 2 free the 16-bit gradients (the sharder's
        ``release_grads``)."""
        engine, ops, sh = self.engine, self.sm.ops, self.sm.m.sh
        total = sum((p.numel * layers.get(p.tag, 1) for p in ps), Poly.of(0))
        dtypes = {p.grad.dtype or p.dtype for p in ps}
        engine.tag = -1
        flat = ops.new(total, "f32" if "f32" in dtypes else next(iter(dtypes)))  # torch.cat's promoted dtype
        engine.region = Kind.GRADIENTS
        fp32 = ops.new(total, "f32")
        engine.region = Kind.OPTIMIZER_TEMPS
        ops.drop(flat)
        for p in ps:
            p.grad = None  # the partition's gradient belongs to the sharder
        if sh is not None:
            sh.release_grads()
        return fp32

    def _lorafa_step(self, ps: list[Storage]) -> None:
        """peft 0.21.2 ``LoraFAOptimizer.step`` over the trainable B matrices in module order: each B's two states
        (``zeros_like``, created as it is reached), then ``A @ A.T`` and its pseudo-inverse (rank x rank), the
        gradient projected under bf16 autocast and cast back, and ``exp_avg_sq.sqrt()``; the projection, the
        gradient and the denominator stay bound until the next B rebinds them."""
        engine, ops = self.engine, self.sm.ops
        held: dict[str, Storage] = {}  # the names the loop rebinds: each goes once its next value exists

        def rebind(name: str, h: Storage) -> None:
            ops.drop(held.get(name))
            held[name] = h

        for p in ps:
            engine.tag = p.tag
            if id(p) not in self.states:
                self._create_states([p])
                engine.region = Kind.OPTIMIZER_TEMPS
            r = self.sm.m.shape_of(p)[1] or 1
            rebind("AA_T", ops.new(r * r, "f32"))  # A @ A.T
            eye = ops.new(r * r, "f32")  # torch.eye(r).to(A.device)
            scaled_eye = ops.new(r * r, "f32")  # delta * eye
            total = ops.new(r * r, "f32")
            ops.drop(scaled_eye, eye)
            inv = ops.new(r * r, "f32")  # pinv
            ops.drop(total)
            rebind("AA_T_inv", inv)
            g16 = ops.new(p.numel, "bf16")  # autocast: the gradient and the inverse in bf16, their product
            i16 = ops.new(r * r, "bf16")
            prod = ops.new(p.numel, "bf16")
            ops.drop(g16, i16)
            scaled = ops.new(p.numel, "bf16")  # (1 / scaling**2) * product
            ops.drop(prod)
            rebind("grad_B", scaled)
            if p.dtype != "bf16":  # grad_B.to(B.grad.dtype)
                rebind("grad_B", ops.new(p.numel, p.dtype))
            rebind("denom_B", ops.new(p.numel, p.dtype))  # exp_avg_sq_B.sqrt().add_(eps)
        ops.drop(*held.values())

    def _step_one(self, p: Storage) -> None:
        """optimizer-in-backward: step one parameter as its gradient lands, then free the gradient."""
        engine = self.engine
        engine.region, old = Kind.OPTIMIZER_TEMPS, engine.region
        if id(p) not in self.states:
            self._create_states([p])
        self._temps([p])
        engine.region = old
        engine.tag = p.tag
        g = p.grad
        p.grad = None
        if g is not None:
            g.param = False
            engine.drop(g)

    def zero_grad(self) -> None:
        sharded = self.sm.m.sh is not None  # a partition's gradient belongs to the sharder, which frees it
        for p in self.params:
            if p.grad is not None:
                self.engine.tag = p.tag
                g = p.grad
                p.grad = None
                if not sharded:
                    g.param = False
                    self.engine.drop(g)
        self.engine.tag = -1


def size_dependent_states(opt: Optimizer, p: Storage, dtype: str) -> list[tuple[Poly, str, bool]]:
    """(numel, dtype, managed) of each state tensor of ``p`` for torchao's low-bit AdamW (exp_avg then exp_avg_sq,
    each its codes, block scales and, 8- and 4-bit, its own quantization map: ``OptimState*bit.zeros``) and
    bitsandbytes' PagedAdamW32bit (two fp32 states, in CUDA managed memory from 100,000 elements)."""
    if isinstance(p.numel, Poly) and any(p.numel.coefficients[1:]):
        raise ValueError("a size-dependent optimizer state of a rank-dependent tensor needs a concrete rank")
    n = int(p.numel.coefficients[0]) if isinstance(p.numel, Poly) else int(p.numel)
    if opt is Optimizer.PAGED_ADAMW_32BIT:
        paged = n >= BNB_PAGED_MIN
        return [(p.numel, "f32", paged), (p.numel, "f32", paged)]
    block, per2, qmap = TORCHAO_LAYOUT[opt]
    if n < TORCHAO_MIN or n % block:
        return [(p.numel, dtype, False), (p.numel, dtype, False)]
    one = [(Poly.of(n * per2 // 2), "u8", False), (Poly.of(n // block), "f32", False)]
    if qmap:
        one.append((Poly.of(qmap), "f32", False))
    return one + one
