"""Unsloth's fused loss on the symbolic engine (``fused_loss`` in ``--unsloth-kernels``): the mirror of
core/simulation/unsloth_loss.py, event by event, run by the step driver's ``head_loss`` where
:func:`vramlab.core.spec.unsloth.unsloth_patch` says FastLanguageModel's forward computes it. Sizes are concrete
(its chunks are a power of two of rows): no polynomial. No torch here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.estimator.engine import Buf, Engine, Storage
from vramlab.core.spec.unsloth_loss import UnslothDevice, loss_plan

if TYPE_CHECKING:
    from vramlab.core.estimator.driver import StepModel as Step
    from vramlab.core.estimator.program import Dims


def fused_loss(step: Step, h: Storage, d: Dims) -> Storage:
    """``unsloth_chunked_ce_loss`` and ``fused_linear_cross_entropy`` on the last hidden states ``h`` (every label
    valid but each row's last): the labels shifted and counted, the gradients made in forward and saved."""
    m, ops, engine = step.m, step.ops, step.engine
    V, H = m.spec.vocab_size, m.spec.hidden_size
    w = m.head.w
    b, s = int(d.b), int(d.s)
    N = b * s
    n_keep = b * max(s - 1, 0)
    # _ce_targets: a -100 column, the shifted labels (cat)
    pad = ops.new(b, "i64")
    targets = ops.new(N, "i64")
    ops.drop(pad)
    # _ce_divisor: (targets != -100).sum(), to fp32, kept off zero
    ne = ops.new(N, "bool")
    count = ops.new(1, "i64")
    ops.drop(ne)
    div0 = ops.new(1, "f32")
    ops.drop(count)
    divisor = _off_zero(ops, div0)
    ops.drop(div0)
    # fused_linear_cross_entropy: the divisor kept off zero again, a scale of one
    div1 = _off_zero(ops, divisor)
    scaling = ops.new(1, "f32")
    need_h, need_w = h.rg, w.rg
    engine.grad_enabled, grad = False, engine.grad_enabled  # inside the op: no graph
    cd = m.cdt if m.amp else w.dtype
    # _ce_checked: the out-of-vocabulary mask and its negated any (a device-side assert), alive while _ce_impl runs
    ne, lt, ge = (ops.new(N, "bool") for _ in range(3))
    either = ops.new(N, "bool")
    ops.drop(lt, ge)
    bad = ops.new(N, "bool")
    ops.drop(ne, either)
    any_, ok = ops.new(1, "bool"), ops.new(1, "bool")
    ops.drop(any_)
    loss, grad_h, grad_w = _ce_impl(step, h, w, cd, need_h, need_w, N, n_keep, V, H)
    ops.drop(bad, ok)
    engine.grad_enabled = grad
    saved = [t for t in (grad_h, grad_w, scaling) if t is not None]
    dtypes = (h.dtype, w.dtype)

    def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        s64 = [ops.new(1, "f32"), ops.new(1, "f32")]  # grad_loss.to(f64), scaling.to(f64): 8 bytes, one block
        sc = ops.new(1, "f32")
        ops.drop(*s64)
        outs = []
        for t, dt in ((grad_h, dtypes[0]), (grad_w, dtypes[1])):
            if t is None:
                outs.append(None)
                continue
            g = ops.new(1, "f32")
            outs.append(ops.new(t.numel, dt))
            ops.drop(g)
        ops.drop(sc)
        engine.release_gradient(buf)
        for t in node.saved:
            engine.drop(t)
        if outs[0] is not None:
            engine.deliver(h, Buf(outs[0]))
        if outs[1] is not None:
            engine.deliver(w, Buf(outs[1]))

    engine.node(loss, [(h, 0), (w, 0)], saved, special=run)
    ops.drop(grad_h, grad_w)
    ops.drop(div1, scaling, targets, divisor)
    return loss


def _off_zero(ops, x: Storage) -> Storage:  # noqa: ANN001
    """``torch.where(x == 0, torch.ones_like(x), x)``."""
    eq, one = ops.new(1, "bool"), ops.new(1, "f32")
    out = ops.new(1, "f32")
    ops.drop(eq, one)
    return out


def _ce_impl(step: Step, h: Storage, w: Storage, cd: str, need_h: bool, need_w: bool, N: int, n_keep: int,
             V: int, H: int) -> tuple[Storage, Storage | None, Storage | None]:
    """``_ce_impl``'s allocations and frees (core/simulation/unsloth_loss.py ``ce_impl``)."""
    ops = step.ops
    dev = UnslothDevice.of(step.setup.unsloth_gpu)
    # _keep_index
    ge, lt = ops.new(N, "bool"), ops.new(N, "bool")
    keep = ops.new(N, "bool")
    ops.drop(ge, lt)
    ne = ops.new(N, "bool")
    ops.drop(ne)
    idx = ops.new(n_keep, "i64")
    ops.drop(keep)
    grad_h = ops.new(N * H, h.dtype) if need_h else None
    acc_w = ops.new(V * H, w.dtype) if need_w else None
    loss = ops.new(1, "f32")
    wc = coef = lp_all = buf = ratio = pow2 = None
    last: list[Storage | None] = []  # the locals the return frees: the last chunk's rows, targets, lse, ...
    if n_keep > 0:
        plan = loss_plan(n_keep, H, V, cd, need_w, dev)
        R = plan.rows
        wc = ops.new(V * H, cd) if cd != w.dtype else None  # weight.to(compute_dtype)
        coef = ops.new(1, "f32")
        lp_all = ops.new(n_keep, "f32")
        n_chunked = n_keep
        if plan.flash:
            lse = ops.new(n_keep, "f32")
            neg = ops.new(1, "f32") if need_h else None
            _tiled(step, h, cd, plan, n_keep, need_h, H)
            ops.drop(lse, neg)
            n_chunked = 0
        else:
            buf = ops.new(R * plan.cols, "f32" if plan.fp32_logits else cd)
        if n_chunked and cd in ("bf16", "f16") and (not need_w or w.dtype == "f32"):
            log2 = ops.new(1, "f32")
            rnd = ops.new(1, "f32")
            ops.drop(log2)
            pow2 = ops.new(1, "f32")
            ops.drop(rnd)
            ratio = ops.new(1, "f32")
            ops.drop(coef)
            coef = None
        hc = tc = st = gh = None
        for a in range(0, n_chunked, R):
            n = min(a + R, n_keep) - a
            hc = _rebind(ops, hc, _rows(ops, h, cd, n, H))
            tc = _rebind(ops, tc, ops.new(n, "i64"))
            lse = ops.new(n, "f32")
            if plan.splits > 1:
                ops.drop(ops.new(7 * plan.splits * n, "f32"))
            ops.drop(ops.new(1, "f32"))  # -coef.reshape(())
            st = _rebind(ops, st, lse)
            if need_h:
                gh = _rebind(ops, gh, ops.new(n * H, "f32"))
                if h.dtype != "f32":  # gh.to(grad_h.dtype) for index_copy_
                    ops.drop(ops.new(n * H, h.dtype))
        # lp_all goes with the last chunk's statistics (views of it), the buffer with the last gradient view
        last = [lp_all, ratio, pow2, hc, tc, st] if plan.flash else [ratio, pow2, hc, tc, st, lp_all]
        last += [buf, gh]
        f64 = ops.new(n_keep * 2, "f32")  # lp_all.to(float64)
        nll = ops.new(n_keep * 2, "f32")
        ops.drop(f64)
        tail = [ops.new(2, "f32") for _ in range(3)]  # nll.sum(), divisor.to(f64), their quotient (f64)
        ops.drop(tail[0], tail[1])
        out = ops.new(1, "f32")
        ops.drop(tail[2])
        ops.drop(loss)
        loss = out
        last.append(nll)
    # at the return, in the order of the locals' first binding
    ops.drop(idx, wc, coef, *last)
    return loss, grad_h, acc_w


def _rows(ops, h: Storage, cd: str, n: int, H: int) -> Storage:  # noqa: ANN001
    """``hidden.index_select(0, idx[a:b]).to(compute_dtype)``."""
    sel = ops.new(n * H, h.dtype)
    if cd == h.dtype:
        return sel
    out = ops.new(n * H, cd)
    ops.drop(sel)
    return out


def _rebind(ops, old: Storage | None, new: Storage) -> Storage:  # noqa: ANN001
    ops.drop(old)
    return new


def _tiled(step: Step, h: Storage, cd: str, plan, n_keep: int, need_h: bool, H: int) -> None:  # noqa: ANN001
    """``_tiled_forward``: the tile buffer, the accumulator and running maximum, per chunk its rows, targets and
    partials (core/simulation/unsloth_loss.py)."""
    ops = step.ops
    R = plan.rows
    buf = ops.new(R * plan.cols, "f32")
    acc = ops.new(R * H, "f32") if need_h else None
    m_run = ops.new(R, "f32") if need_h else None
    hc = tc = part = None
    for a in range(0, n_keep, R):
        n = min(a + R, n_keep) - a
        hc = _rebind(ops, hc, _rows(ops, h, cd, n, H))
        tc = _rebind(ops, tc, ops.new(n, "i64"))
        part = _rebind(ops, part, ops.new(8 * plan.splits * n, "f32"))
    ops.drop(buf, acc, m_run, hc, tc, part)
