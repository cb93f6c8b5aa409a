"""Optimizers for the measured step, with the memory behaviour of the real ones.

* ``adamw``, ``sgd``, ``sgd_momentum``: torch's own classes with the chosen implementation (foreach:
  one temporary per parameter of the whole group; fused: none; single-tensor: one parameter's worth).
* ``adafactor``: torch's algorithm (factored second moment for matrices) written without ``.item()``
  so it runs on fake tensors; the temporaries match torch's single-tensor and foreach code.
* ``lion``: sign of the interpolated momentum; one state per parameter.
* ``adamw8bit`` / ``paged_adamw8bit``: bitsandbytes' block-wise 8-bit AdamW layout (uint8 states with an
  fp32 absmax per 256 elements; tensors under 4096 elements keep fp32 states). The update is one custom
  op that works in place, like the bitsandbytes kernel, so it makes no temporaries. Paged states of
  tensors with at least 1e5 elements live in CUDA managed memory, which torch's allocator does not count.
* on CUDA with bitsandbytes installed, ``adamw8bit`` / ``paged_adamw8bit`` are bitsandbytes' own
  ``bnb.optim.AdamW8bit`` / ``PagedAdamW8bit`` (:class:`BnbOptimizer`), as peft and TRL users get them;
  their states follow bitsandbytes 0.50.2 ``Optimizer2State.init_state`` / ``get_state_buffer``, which the
  emulation above reproduces: uint8 state1/state2 and fp32 absmax1/absmax2 (blocks of 256) from 4096
  elements, fp32 states below; paged buffers (``F.get_paged``: cudaMallocManaged) only for tensors of at
  least 1e5 elements, the absmax and small tensors staying in torch's allocator. On CUDA without
  bitsandbytes a profile is refused before it starts (``profile.bitsandbytes_refusal``): the emulation's real
  update works on fp32 padded copies of grad, m and v (about 24 bytes per element of the tensor stepped), scratch
  a user's run never has, since Trainer's 8-bit optimizers need bitsandbytes.
* ``adamw_torch_8bit`` / ``adamw_torch_4bit`` / ``adamw_torchao_fp8`` (torchao's low-bit AdamW) and
  ``paged_adamw_32bit`` (bitsandbytes): see :class:`SizeDependentAdam` (their own class on CUDA where torchao imports).
* ``master_weights``: fp32 master copies and persistent fp32 gradients beside 16-bit weights, the inner
  optimizer stepping the masters (Megatron's mixed precision). Under DeepSpeed's ZeRO the gradient partitions stay
  in the 16-bit dtype and the fp32 gradient is made at the step and freed after it (:class:`MasterWeights`).

Optimizer step counters live on the host unless the implementation is fused, as in torch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vramlab.core.kinds import Kind
from vramlab.core.simulation import context
from vramlab.core.spec.options import Optimizer, OptimizerImpl
from vramlab.core.spec.sharded_precision import deepspeed_masters, deepspeed_sub_groups
from vramlab.core.spec.training import TrainingSetup

BNB_MIN_8BIT = 4096
BNB_BLOCK = 256
BNB_PAGED_MIN = 100_000
LR = 1e-4


class OptimizerBase:
    """Common interface: step(), zero_grad(), state_tensors(), host_tensors(), managed_bytes."""

    managed_bytes = 0

    def state_tensors(self) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def host_tensors(self) -> Iterator[torch.Tensor]:
        return iter(())

    def _stepped(self, make: Callable[[nn.Parameter], Any]) -> list[nn.Parameter]:
        """An optimizer written here (``params``, ``state``): the parameters with a gradient, each one's state made
        by ``make`` at its first step, labelled as optimizer state."""
        ps = [p for p in self.params if p.grad is not None]  # type: ignore[attr-defined]
        with context.region(Kind.OPTIMIZER_STATES):
            for p in ps:
                if p not in self.state:  # type: ignore[attr-defined]
                    self.state[p] = make(p)  # type: ignore[attr-defined]
        return ps


class _Library(OptimizerBase):
    """A library's own ``torch.optim.Optimizer`` (``self.opt``): its step, its zero_grad (gradients set to None, as
    the Trainer does) and the tensors of its states but the step counters (each tensor as :meth:`_parts` names it)."""

    opt: torch.optim.Optimizer

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for st in self.opt.state.values():
            for k, v in st.items():
                if k != "step" and isinstance(v, torch.Tensor):
                    yield from self._parts(v)

    def _parts(self, v: torch.Tensor) -> Iterable[torch.Tensor]:
        return (v,)


class TorchOptimizer(_Library):
    """Wrap a torch.optim optimizer; label the states it creates in ``_init_group``."""

    def __init__(self, opt: torch.optim.Optimizer, fused: bool) -> None:
        self.opt = opt
        self.fused = fused
        inner = opt._init_group  # type: ignore[attr-defined]

        def init_group(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            tracker = context.current()
            scalars = tracker.host_scalars() if tracker is not None and not self.fused else contextlib.nullcontext()
            with context.region(Kind.OPTIMIZER_STATES), scalars:
                out = inner(*args, **kwargs)
                if isinstance(opt, torch.optim.SGD) and args[0]["momentum"] != 0:
                    # torch clones the first gradient into the momentum buffer inside the math; creating
                    # the zero buffer here (buf * momentum + grad == grad) labels it as state at birth
                    params, buffers = args[1], args[3]
                    for i, p in enumerate(params):
                        if buffers[i] is None:
                            buffers[i] = torch.zeros_like(p)
                            opt.state[p]["momentum_buffer"] = buffers[i]
            return out

        opt._init_group = init_group  # type: ignore[attr-defined]

    def host_tensors(self) -> Iterator[torch.Tensor]:
        for st in self.opt.state.values():
            v = st.get("step")
            if isinstance(v, torch.Tensor):
                yield v


class Lion(OptimizerBase):
    """Lion (Chen et al. 2023): update = sign(lerp(m, g, 1-beta1)); m = lerp(m, g, 1-beta2)."""

    def __init__(self, params: list[nn.Parameter], foreach: bool, lr: float = LR,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        self.params, self.foreach, self.lr, self.betas, self.wd = params, foreach, lr, betas, weight_decay
        self.state: dict[nn.Parameter, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        ps = self._stepped(torch.zeros_like)
        b1, b2 = self.betas
        ms = [self.state[p] for p in ps]
        gs = [p.grad for p in ps]
        if self.foreach and ps:
            upd = torch._foreach_lerp(ms, gs, 1 - b1)
            torch._foreach_sign_(upd)
            torch._foreach_add_(ps, upd, alpha=-self.lr)
            del upd
            torch._foreach_lerp_(ms, gs, 1 - b2)
        else:
            for p, m, g in zip(ps, ms, gs):
                upd = torch.lerp(m, g, 1 - b1).sign_()
                p.add_(upd, alpha=-self.lr)
                del upd
                m.lerp_(g, 1 - b2)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> Iterator[torch.Tensor]:
        return iter(self.state.values())


class Adafactor(OptimizerBase):
    """torch.optim.Adafactor's algorithm (beta2 decay -0.8, no momentum) without host syncs."""

    def __init__(self, params: list[nn.Parameter], foreach: bool, lr: float = 1e-2, eps1: float = 1e-30,
                 eps2: float = 1e-3, beta2_decay: float = -0.8) -> None:
        self.params, self.foreach, self.lr = params, foreach, lr
        self.eps1, self.eps2, self.decay = eps1, eps2, beta2_decay
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        ps = self._stepped(self._new_state)
        self.steps += 1
        beta = self.steps ** self.decay
        rho = min(self.lr, 1 / self.steps ** 0.5)
        if self.foreach:
            estimates = [self._estimate(p, beta) for p in ps]  # torch's foreach keeps all of them at once
            for p, est in zip(ps, estimates):
                est.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(p.grad)
                p.add_(est, alpha=-rho)
            del estimates
        else:
            for p in ps:
                est = self._estimate(p, beta)
                est.clamp_(min=self.eps1 * self.eps1).rsqrt_().mul_(p.grad)
                p.add_(est, alpha=-rho)
                del est

    @staticmethod
    def _new_state(p: nn.Parameter) -> dict[str, torch.Tensor]:
        g = p.grad
        if g.dim() > 1:
            row = list(g.shape)
            row[-1] = 1
            col = list(g.shape)
            col[-2] = 1
            return {"row_var": g.new_zeros(row), "col_var": g.new_zeros(col)}
        return {"variance": torch.zeros_like(g)}

    def _estimate(self, p: nn.Parameter, beta: float) -> torch.Tensor:
        g, st = p.grad, self.state[p]
        if g.dim() > 1:
            row_mean = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
            st["row_var"].lerp_(row_mean, beta)
            col_mean = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
            st["col_var"].lerp_(col_mean, beta)
            est = st["row_var"] @ st["col_var"]
            return est.div_(st["row_var"].mean(dim=-2, keepdim=True).clamp_(min=self.eps1))
        sq = g * g
        st["variance"].lerp_(sq, beta)
        del sq
        return st["variance"].clone()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for st in self.state.values():
            yield from st.values()


@torch.library.custom_op("vramlab::adam8bit_step_", mutates_args=("param", "state1", "state2", "absmax1", "absmax2"))
def adam8bit_step_(param: torch.Tensor, grad: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                   absmax1: torch.Tensor, absmax2: torch.Tensor, lr: float, step: int) -> None:
    """In-place block-wise 8-bit AdamW update (linear 8-bit codes; bitsandbytes uses a dynamic map)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    n = param.numel()
    nb = absmax1.numel()
    pad = nb * BNB_BLOCK - n
    g = torch.nn.functional.pad(grad.reshape(-1).float(), (0, pad)).view(nb, BNB_BLOCK)
    m = torch.nn.functional.pad(state1.reshape(-1).float(), (0, pad)).view(nb, BNB_BLOCK)
    v = torch.nn.functional.pad(state2.reshape(-1).float(), (0, pad)).view(nb, BNB_BLOCK)
    m = (m - 127.5) / 127.5 * absmax1[:, None] * b1 + (1 - b1) * g
    v = v / 255.0 * absmax2[:, None] * b2 + (1 - b2) * g * g
    upd = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
    param.add_(upd.reshape(-1)[:n].view_as(param).to(param.dtype), alpha=-lr)
    absmax1.copy_(m.abs().amax(dim=1).clamp_min(1e-12))
    absmax2.copy_(v.amax(dim=1).clamp_min(1e-12))
    state1.copy_((m / absmax1[:, None] * 127.5 + 127.5).round().clamp(0, 255).reshape(-1)[:n].view_as(state1))
    state2.copy_((v / absmax2[:, None] * 255.0).round().clamp(0, 255).reshape(-1)[:n].view_as(state2))


@adam8bit_step_.register_fake
def _(param, grad, state1, state2, absmax1, absmax2, lr, step):  # noqa: ANN001
    return None


class BnbOptimizer(_Library):
    """bitsandbytes' own 8-bit AdamW (paged or not); ``managed_bytes`` are its paged state buffers."""

    def __init__(self, params: list[nn.Parameter], paged: bool, lr: float = LR, bits: int = 8) -> None:
        import bitsandbytes as bnb

        if bits == 32:  # transformers' paged_adamw_32bit: bnb.optim.AdamW(is_paged=True, optim_bits=32)
            self.opt = bnb.optim.PagedAdamW(params, lr=lr, weight_decay=0.0)
            return
        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        self.opt = cls(params, lr=lr, weight_decay=0.0)

    def step(self) -> None:
        with context.region(Kind.OPTIMIZER_STATES):
            self.opt.step()

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for st in self.opt.state.values():
            yield from (t for t in st.values() if isinstance(t, torch.Tensor) and not getattr(t, "is_paged", False))

    @property
    def managed_bytes(self) -> int:  # type: ignore[override]
        return sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and getattr(t, "is_paged", False))


class Adam8bit(OptimizerBase):
    """bitsandbytes' AdamW8bit / PagedAdamW8bit state layout and in-place update."""

    def __init__(self, params: list[nn.Parameter], paged: bool, lr: float = LR) -> None:
        self.params, self.paged, self.lr = params, paged, lr
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        self.fp32: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self.steps = 0
        self.managed_bytes = 0
        self._qmaps: list[torch.Tensor] = []

    def _new_state(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        if not self._qmaps:  # the two quantization maps, made before the first parameter's states
            self._qmaps = [torch.zeros(256, dtype=torch.float32, device=p.device) for _ in range(2)]
        n = p.numel()
        if n < BNB_MIN_8BIT:
            return {"state1": torch.zeros_like(p, dtype=torch.float32),
                    "state2": torch.zeros_like(p, dtype=torch.float32)}
        nb = (n + BNB_BLOCK - 1) // BNB_BLOCK
        paged = self.paged and n >= BNB_PAGED_MIN
        with context.host() if paged else contextlib.nullcontext():  # cudaMallocManaged
            s1 = torch.zeros_like(p, dtype=torch.uint8)
            s2 = torch.zeros_like(p, dtype=torch.uint8)
        if paged:
            self.managed_bytes += 2 * n
        return {"state1": s1, "state2": s2,
                "absmax1": torch.zeros(nb, dtype=torch.float32, device=p.device),
                "absmax2": torch.zeros(nb, dtype=torch.float32, device=p.device)}

    @torch.no_grad()
    def step(self) -> None:
        ps = self._stepped(self._new_state)
        self.steps += 1
        for p in ps:
            st = self.state[p]
            if "absmax1" in st:
                adam8bit_step_(p, p.grad, st["state1"], st["state2"], st["absmax1"], st["absmax2"], self.lr,
                               self.steps)
            else:
                _fp32_adam_inplace(p, st["state1"], st["state2"], self.lr, self.steps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self._qmaps
        for st in self.state.values():
            yield from st.values()


@torch.library.custom_op("vramlab::adam32_step_", mutates_args=("param", "m", "v"))
def _adam32_op(param: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, lr: float,
               step: int) -> None:
    b1, b2, eps = 0.9, 0.999, 1e-8
    m.mul_(b1).add_(grad.float(), alpha=1 - b1)
    v.mul_(b2).addcmul_(grad.float(), grad.float(), value=1 - b2)
    upd = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
    param.add_(upd.to(param.dtype), alpha=-lr)


@_adam32_op.register_fake
def _(param, m, v, grad, lr, step):  # noqa: ANN001
    return None


def _fp32_adam_inplace(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, step: int) -> None:
    _adam32_op(p, m, v, p.grad, lr, step)


class MasterWeights(OptimizerBase):
    """fp32 masters for 16-bit trainable weights; the inner optimizer steps the masters and the result is copied
    back in place. The fp32 gradients are Megatron's persistent ones, or DeepSpeed's under ZeRO (``zero``).

    DeepSpeed 0.19.8 keeps a ZeRO rank's gradient partitions in the 16-bit dtype (stage 1 / 2's
    ``averaged_gradients``, stage 3's ``grad_partitions_flat_buffer``) and makes the fp32 gradient of the master
    partition only at the step, per parameter group: ``self.flatten(averaged_gradients).to(fp32)`` (a 16-bit flat
    copy, then its fp32 cast; stage 1 / 2 ``step``, stage 3 ``_prepare_fp32_grad_for_sub_group``), freed after the
    group's step (``fp32 .grad = None``). Stage 1 / 2 free the 16-bit gradients once the fp32 copy is made
    (``free_grad_in_param_list``): ``release`` (the sharder's: ZeRO-1's whole gradients, ZeRO-2's partitions; stage
    3 keeps its flat partition buffer). Stage 3 steps sub-groups of ``sub_group_size`` partition elements one
    after the other (:func:`~vramlab.core.spec.sharded_precision.deepspeed_sub_groups`); the Trainer's two parameter
    groups are one here (its no-decay group, biases and norms, is small)."""

    def __init__(self, params: list[nn.Parameter], make_inner: Callable[[list[nn.Parameter]], OptimizerBase],
                 setup: TrainingSetup, release: Callable[[], None] | None = None) -> None:
        self.params = params
        self.masters: list[nn.Parameter] = []
        self._make_inner = make_inner
        self.inner: OptimizerBase | None = None
        self.setup = setup
        self.zero = deepspeed_masters(setup)
        self.release = release

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is None:
            with context.region(Kind.MASTER_WEIGHTS):
                self.masters = [nn.Parameter(p.detach().to(torch.float32)) for p in self.params]
            if not self.zero:
                with context.region(Kind.GRADIENTS):
                    for m in self.masters:
                        m.grad = torch.zeros_like(m)
            self.inner = self._make_inner(self.masters)
        if self.zero:
            for group in deepspeed_sub_groups([p.numel() for p in self.params], self.setup):
                self._fp32_grad(group)
                self.inner.step()  # steps the masters with a gradient: this group's
                for i in group:
                    self.masters[i].grad = None  # the group's fp32 gradient freed
        else:
            for p, m in zip(self.params, self.masters):
                if p.grad is not None:
                    m.grad.copy_(p.grad)
                    p.grad = None
            self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def _fp32_grad(self, group: list[int]) -> None:
        """DeepSpeed's ZeRO: the group's 16-bit gradient partitions flattened, cast to fp32 (the masters' gradients
        are views of it), the 16-bit flat copy freed."""
        pairs = [(self.params[i], self.masters[i]) for i in group if self.params[i].grad is not None]
        if not pairs:
            return
        with context.region(Kind.OPTIMIZER_TEMPS):
            flat = torch.cat([p.grad.reshape(-1) for p, _m in pairs])
        with context.region(Kind.GRADIENTS):
            fp32 = flat.to(torch.float32)
        del flat
        offset = 0
        for p, m in pairs:
            m.grad = fp32[offset: offset + m.numel()].view_as(m)
            offset += m.numel()
            p.grad = None
        del fp32
        if self.release is not None:
            self.release()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            if m.grad is not None:
                m.grad.zero_()

    def state_tensors(self) -> Iterator[torch.Tensor]:
        return self.inner.state_tensors() if self.inner is not None else iter(())

    def host_tensors(self) -> Iterator[torch.Tensor]:
        return self.inner.host_tensors() if self.inner is not None else iter(())

    @property
    def managed_bytes(self) -> int:  # type: ignore[override]
        return self.inner.managed_bytes if self.inner is not None else 0


def _wrapper_code(make: str) -> object:
    """The code object of the wrapper a torch decorator makes (None where this torch has no such decorator)."""
    module, _, name = make.rpartition(".")
    import importlib

    decorator = getattr(importlib.import_module(module), name, None)
    return None if decorator is None else getattr(decorator(lambda *a: None), "__code__", None)


def _unwrap(fn: object, code: object) -> Callable | None:
    """The function inside the wrapper with ``code`` in ``fn``'s chain of ``functools.wraps`` wrappers."""
    while fn is not None and code is not None:
        if getattr(fn, "__code__", None) is code:
            return fn.__wrapped__  # type: ignore[attr-defined]
        fn = getattr(fn, "__wrapped__", None)
    return None


@functools.cache
def uncompiled(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` without torch's wrappers that keep ``torch.compile`` out: ``torch._disable_dynamo`` around
    ``add_param_group`` and ``zero_grad``, and ``_use_grad_for_differentiable`` around ``step`` (which sets
    grad mode to ``defaults["differentiable"]`` around the step, as here, and calls ``torch._dynamo.graph_break``,
    a no-op outside compilation). The measured step is never compiled, and each wrapper imports
    ``torch._dynamo`` at its first call (about 1.5 s, a fast simulation's largest cost); what the methods do
    is the same (``tests/test_simulate_fast.py`` holds it so on the installed torch). A wrapper this torch does
    not make as expected stays in place."""
    body: dict[str, object] = {}
    disabled = _wrapper_code("torch._compile._disable_dynamo")
    for name in ("add_param_group", "zero_grad"):
        raw = _unwrap(getattr(cls, name), disabled)
        if raw is not None:
            body[name] = raw
    raw_step = _unwrap(cls.step, _wrapper_code("torch.optim.optimizer._use_grad_for_differentiable"))
    if raw_step is not None:
        @functools.wraps(raw_step)
        def step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            with torch.set_grad_enabled(self.defaults["differentiable"]):
                return raw_step(self, *args, **kwargs)

        body["step"] = step
    # torch's names, so that the profiler's "Optimizer.step#AdamW.step" records read as torch's own
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__, **body})


def make_optimizer(params: Iterable[nn.Parameter], setup: TrainingSetup,
                   model: nn.Module | None = None, release: Callable[[], None] | None = None) -> OptimizerBase:
    """The optimizer of ``params``; LoRA-FA steps every parameter of ``model`` by name (peft's own class).
    ``release``: what DeepSpeed's ZeRO frees once the fp32 gradient is made (:class:`MasterWeights`)."""
    params = list(params)
    if setup.lora_fa and setup.uses_lora and model is not None:
        return LoraFA(model, setup)
    # on the GPU (a profile: the user's real run) torch's own classes, wrappers included; off it (simulate, the
    # trace: fake or meta tensors) the same classes without the wrappers whose first call imports torch._dynamo
    own = (lambda cls: cls) if any(p.is_cuda for p in params) else uncompiled

    def inner(ps: list[nn.Parameter]) -> OptimizerBase:
        impl = setup.impl
        foreach = impl is OptimizerImpl.FOREACH
        fused = impl is OptimizerImpl.FUSED
        opt = setup.optimizer
        if opt is Optimizer.ADAMW:
            return TorchOptimizer(own(torch.optim.AdamW)(ps, lr=LR, weight_decay=0.0, foreach=foreach,
                                                         fused=fused), fused)
        if opt in (Optimizer.SGD, Optimizer.SGD_MOMENTUM):
            momentum = 0.9 if opt is Optimizer.SGD_MOMENTUM else 0.0
            return TorchOptimizer(own(torch.optim.SGD)(ps, lr=LR, momentum=momentum, foreach=foreach,
                                                       fused=fused), fused)
        if opt is Optimizer.LION:
            return Lion(ps, foreach=foreach)
        if opt is Optimizer.ADAFACTOR:
            return Adafactor(ps, foreach=foreach)
        paged = opt.is_paged
        bits = 32 if opt is Optimizer.PAGED_ADAMW_32BIT else 8
        if ps and _real_cuda(ps[0]) and (opt.is_8bit or bits == 32):
            from vramlab.core.simulation.quant import bitsandbytes_version

            if bitsandbytes_version() is not None:
                return BnbOptimizer(ps, paged=paged, bits=bits)
        if opt.is_torchao or bits == 32:
            return size_dependent_adam(ps, opt)
        return Adam8bit(ps, paged=paged)

    if setup.has_master_copy:
        return MasterWeights(params, inner, setup, release=release)
    return inner(params)


def _real_cuda(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type == "cuda" and not isinstance(t, FakeTensor)


# ---- torchao's low-bit AdamW and bitsandbytes' PagedAdamW32bit ----------------------------------------------------
# torchao 0.18.0 optim/adam.py: ``_new_buffer`` quantizes a state when the tensor has at least 4096 elements and the
# block divides it (OptimState8bit: uint8 codes, an fp32 scale per 256 elements and its own 256-entry fp32 map;
# OptimState4bit: two codes per byte, a scale per 128, a 16-entry map; OptimStateFp8: float8_e4m3 codes, a scale per
# 256), else ``zeros_like(p)`` in the parameter's dtype; the step counter and the learning rate are CPU tensors; the
# update is one ``torch.compile``d function per parameter, fused in place on CUDA. bitsandbytes' PagedAdamW32bit
# keeps two fp32 states, in CUDA managed memory from 1e5 elements (``get_state_buffer``).
TORCHAO_MIN = 4096
TORCHAO_LAYOUT = {Optimizer.TORCHAO_ADAMW_8BIT: (256, torch.uint8, 1, 256),
                  Optimizer.TORCHAO_ADAMW_4BIT: (128, torch.uint8, 2, 16),
                  Optimizer.TORCHAO_ADAMW_FP8: (256, torch.float8_e4m3fn, 1, 0)}


@torch.library.custom_op("vramlab::state_adam_step_", mutates_args=("param", "states"))
def state_adam_step_(param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], lr: float) -> None:
    """The fused in-place update of a compiled torchao step or bitsandbytes' 32-bit kernel: its memory (none);
    the values move as plain SGD (a profile with the library installed runs the library's own)."""
    param.add_(grad, alpha=-lr)


@state_adam_step_.register_fake
def _(param, grad, states, lr):  # noqa: ANN001
    return None


class SizeDependentAdam(OptimizerBase):
    """torchao's AdamW8bit / AdamW4bit / AdamWFp8 or bitsandbytes' PagedAdamW32bit state layout, stepped in place."""

    def __init__(self, params: list[nn.Parameter], opt: Optimizer, lr: float = LR) -> None:
        self.params, self.opt, self.lr = params, opt, lr
        self.state: dict[nn.Parameter, list[torch.Tensor]] = {}
        self.managed_bytes = 0

    def _states(self, p: nn.Parameter) -> list[torch.Tensor]:
        n = p.numel()
        if self.opt is Optimizer.PAGED_ADAMW_32BIT:
            paged = n >= BNB_PAGED_MIN
            with context.host() if paged else contextlib.nullcontext():  # cudaMallocManaged
                out = [torch.zeros_like(p, dtype=torch.float32) for _ in range(2)]
            if paged:
                self.managed_bytes += 2 * 4 * n
            return out
        block, code_dtype, per_byte, qmap = TORCHAO_LAYOUT[self.opt]
        if n < TORCHAO_MIN or n % block:
            return [torch.zeros_like(p), torch.zeros_like(p)]
        out = []
        for _ in range(2):  # exp_avg, exp_avg_sq: OptimState*.zeros makes codes, scale, then the map
            out.append(torch.zeros(n // per_byte, dtype=code_dtype, device=p.device))
            out.append(torch.zeros(n // block, dtype=torch.float32, device=p.device))
            if qmap:
                out.append(torch.zeros(qmap, dtype=torch.float32, device=p.device))
        return out

    @torch.no_grad()
    def step(self) -> None:
        ps = self._stepped(self._states)
        for p in ps:
            state_adam_step_(p, p.grad, self.state[p], self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for st in self.state.values():
            yield from st


def size_dependent_adam(params: list[nn.Parameter], opt: Optimizer) -> OptimizerBase:
    """torchao's own optimizer on a real CUDA device where torchao imports; else :class:`SizeDependentAdam`."""
    if opt.is_torchao and params and _real_cuda(params[0]):
        try:
            from torchao import optim as ao
        except ImportError:
            pass
        else:
            cls = {Optimizer.TORCHAO_ADAMW_8BIT: ao.AdamW8bit, Optimizer.TORCHAO_ADAMW_4BIT: ao.AdamW4bit,
                   Optimizer.TORCHAO_ADAMW_FP8: ao.AdamWFp8}[opt]
            return TorchaoOptimizer(cls(params, lr=LR, weight_decay=0.0))
    return SizeDependentAdam(params, opt)


class TorchaoOptimizer(_Library):
    """torchao's own low-bit AdamW; the states its ``_new_buffer`` makes are labelled as optimizer state."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        inner = opt._new_buffer  # type: ignore[attr-defined]

        def new_buffer(p: torch.Tensor, signed: bool) -> torch.Tensor:
            with context.region(Kind.OPTIMIZER_STATES):
                return inner(p, signed)

        opt._new_buffer = new_buffer  # type: ignore[attr-defined]

    def _parts(self, v: torch.Tensor) -> Iterable[torch.Tensor]:
        names = getattr(v, "tensor_attrs", None)  # a quantized state: its codes, scales (and map) tensors
        return (getattr(v, n) for n in names) if names else (v,)


# ---- LoRA-FA ---------------------------------------------------------------------------------------------------
class _LabelStates(torch.overrides.TorchFunctionMode):
    """LoraFAOptimizer makes each state with ``torch.zeros_like`` inside its step: label those as optimizer state."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.zeros_like:
            with context.region(Kind.OPTIMIZER_STATES):
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class LoraFA(_Library):
    """peft 0.21.2's LoraFAOptimizer over every named parameter, as ``create_lorafa_optimizer`` groups them (the
    scaling of each adapter, betas 0.9 / 0.999, no weight decay). Its projection runs under bf16 autocast where
    accelerate finds bf16 (every GPU since Ampere), here too, with CUDA's op lists. On a real GPU the library's
    own autocast applies (the emulation only sees fake and meta tensors' calls the same way)."""

    def __init__(self, model: nn.Module, setup: TrainingSetup, lr: float = LR) -> None:
        from peft.optimizers.lorafa import LoraFAOptimizer

        named = list(model.named_parameters())
        scaling = setup.alpha / (setup.lora_rank ** 0.5 if setup.use_rslora else setup.lora_rank)
        self.params = [p for _, p in named]
        self.opt = LoraFAOptimizer([{
            "params": self.params, "lr": lr, "names": [n for n, _ in named],
            "scaling_factors": [scaling if ".lora_" in n else None for n, _ in named],
            "betas": (0.9, 0.999), "weight_decay": 0.0}])

    @torch.no_grad()
    def step(self) -> None:
        from peft.optimizers import lorafa

        from vramlab.core.simulation.autocast_cuda import CudaAutocast, emulating

        saved = lorafa.is_bf16_available
        lorafa.is_bf16_available = lambda: True
        try:  # its torch.autocast region as CUDA's (fake and meta tensors on the CPU build)
            with emulating(CudaAutocast(torch.bfloat16)), _LabelStates():
                self.opt.step()
        finally:
            lorafa.is_bf16_available = saved
