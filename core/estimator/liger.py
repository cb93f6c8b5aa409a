"""Liger Kernel's RMSNorm, SwiGLU / GeGLU and cross-entropy kernels on the symbolic engine (``--liger-kernels``):
the mirror of core/simulation/liger.py, called by the decoder's norms and MLPs (:mod:`.program`) and the loss
(:mod:`.driver`) where liger's patch for the family swaps them in (:func:`vramlab.core.spec.liger.liger_patch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.estimator.engine import Buf, Engine, Storage
from vramlab.core.spec import liger as spec_liger
from vramlab.core.spec.liger import LigerPatch

if TYPE_CHECKING:
    from vramlab.core.estimator.program import Model


def rms_norm(m: Model, patch: LigerPatch, w: Storage, x: Storage, rows: int, dim: int) -> Storage:
    """``LigerRMSNormFunction``: the output in the input's dtype and an fp32 RSTD per row; the input, the weight
    and RSTD saved. Backward: an fp32 (SMs x dim) buffer for the weight's gradient (where it trains), the input's
    gradient written into the incoming one (``in_place``) or a new zeros, the buffer summed (fp32) and cast to the
    weight's dtype; the input's gradient is made whether or not the input needs one."""
    ops, engine = m.ops, m.engine
    out = ops.new(rows * dim, x.dtype)
    rstd = ops.new(rows, "f32")

    def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        live = {id(h) for h, _ in node.edges}
        part = ops.new(spec_liger.LIGER_SM_COUNT * dim, "f32") if id(w) in live else None
        gx = ops.ref(buf.h) if patch.in_place else ops.new(rows * dim, x.dtype)
        gw = None
        if part is not None:
            total = ops.new(dim, "f32")  # _dW.sum(dim=0)
            gw = ops.new(dim, w.dtype) if w.dtype != "f32" else ops.ref(total)  # .to(W.dtype)
            ops.drop(total, part)
        engine.release_gradient(buf)
        for t in node.saved:
            engine.drop(t)
        if id(x) in live:
            engine.deliver(x, Buf(gx))
        else:  # a gradient for an input that needs none: autograd lets it go
            engine.drop(gx)
        if gw is not None:
            engine.deliver(w, Buf(gw))

    engine.node(out, [(x, 0), (w, 0)], [x, w, rstd], special=run)
    ops.drop(rstd)
    return out


def layer_norm(m: Model, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
    """``LigerLayerNormFunction`` (its Triton path): the output in the input's dtype, an fp32 mean and RSTD per row;
    the input, the weight, the bias (a new ``zeros_like(weight)`` where the norm has none), the mean and RSTD saved.
    Backward: fp32 (SMs x dim) buffers for the weight's and the bias's gradients where they train, the input's
    gradient, each buffer summed (fp32) and cast to its parameter's dtype, the buffers freed as it returns."""
    ops, engine = m.ops, m.engine
    w = ws[0]
    b = ws[1] if len(ws) > 1 else ops.new(dim, w.dtype)
    out = ops.new(rows * dim, x.dtype)
    mean = ops.new(rows, "f32")
    rstd = ops.new(rows, "f32")

    def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        live = {id(h) for h, _ in node.edges}
        parts = [ops.new(spec_liger.LIGER_SM_COUNT * dim, "f32") if id(p) in live else None for p in (w, b)]
        gx = ops.new(rows * dim, x.dtype)
        grads = []
        for p, part in zip((w, b), parts):
            if part is None:
                continue
            total = ops.new(dim, "f32")  # _DW.sum(dim=0), then .to(W.dtype)
            g = ops.new(dim, p.dtype) if p.dtype != "f32" else ops.ref(total)
            ops.drop(total)
            grads.append((p, g))
        ops.drop(*[q for q in parts if q is not None])
        engine.release_gradient(buf)
        for t in node.saved:
            engine.drop(t)
        if id(x) in live:
            engine.deliver(x, Buf(gx))
        else:
            engine.drop(gx)
        for p, g in grads:
            engine.deliver(p, Buf(g))

    engine.node(out, [(x, 0), (w, 0), (b, 0)], [x, w, b, mean, rstd], special=run)
    ops.drop(mean, rstd)
    if len(ws) == 1:
        ops.drop(b)
    return out


def cross_entropy(m: Model, x: Storage, rows: int) -> Storage:
    """``LigerCrossEntropyFunction`` on the (upcast) logits ``x``: a loss per row in their dtype, the labels' mask,
    its count and the two range checks' temporaries (int64 labels times the mask, its max / min, a bool); the
    logits saved, and handed back by backward as their own gradient (after a scalar 1.0 to compare with)."""
    ops, engine = m.ops, m.engine
    loss_1d = ops.new(rows, x.dtype)
    mask = ops.new(rows, "bool")
    ops.drop(ops.new(1, "i64"))  # target_mask.sum()
    for _ in range(2):  # (target * target_mask).max() < V, then .min() >= 0
        t = ops.new(rows, "i64")
        top = ops.new(1, "i64")
        ops.drop(t)
        ok = ops.new(1, "bool")
        ops.drop(top, ok)
    loss = ops.new(1, x.dtype)
    ops.drop(loss_1d, mask)

    def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        ops.drop(ops.new(1, "f32"))  # torch.equal(grad_output, torch.tensor(1.0))
        engine.release_gradient(buf)
        g = engine.ref(x)
        for t in node.saved:
            engine.drop(t)
        engine.deliver(x, Buf(g))

    engine.node(loss, [(x, 0)], [x], special=run)
    return loss


def _mul_function(m: Model, inputs: tuple[Storage, Storage], saved: tuple[Storage, Storage]) -> Storage:
    """``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` on ``inputs`` (the tensors it saves, ``saved``: the
    inputs, or the copies ``ensure_contiguous`` made of strided ones): the product allocated; backward writes each
    input's gradient into its saved tensor (nothing allocated) and hands those on."""
    engine = m.engine
    c = m.ops.new(saved[0].numel, saved[0].dtype)
    into = {id(i): s for i, s in zip(inputs, saved)}

    def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        grads = [(h, Buf(engine.ref(into[id(h)]))) for h, _ in node.edges]
        engine.release_gradient(buf)
        for t in node.saved:
            engine.drop(t)
        for h, gb in grads:
            engine.deliver(h, gb)

    engine.node(c, [(i, 0) for i in inputs], list(saved), special=run)
    return c


def glu(m: Model, mods: dict, x: Storage, rows: int) -> Storage:
    """``LigerSwiGLUMLP.forward`` / ``LigerGEGLUMLP.forward``: ``down_proj(fn(gate_proj(x), up_proj(x)))``, where
    ``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` allocate the product and save both projections' outputs,
    and backward writes their gradients into them (nothing allocated)."""
    ops = m.ops
    g = m.linear(mods["gate_proj"], x, rows)
    u = m.linear(mods["up_proj"], x, rows)
    c = _mul_function(m, (g, u), (g, u))
    ops.drop(g, u)
    y = m.linear(mods["down_proj"], c, rows)
    ops.drop(c)
    return y


def glu_fused(m: Model, mods: dict, x: Storage, rows: int) -> Storage:
    """``LigerPhi3SwiGLUMLP.forward``: ``gate_up_proj(x).chunk(2)``, the two halves to ``LigerSiLUMulFunction``,
    whose ``ensure_contiguous`` copies each (strided views) before it allocates the product and saves the copies;
    backward writes the halves' gradients into the copies and returns them, and the chunk's backward gathers them.
    The projection's output lives under the views until the MLP returns."""
    ops = m.ops
    gu = m.linear(mods["gate_up_proj"], x, rows)
    gate, up = m.chunk2(gu)
    ops.drop(gu)
    a, b = ops.new(gate.numel, gate.dtype), ops.new(up.numel, up.dtype)
    c = _mul_function(m, (gate, up), (a, b))
    ops.drop(a, b)
    y = m.linear(mods["down_proj"], c, rows)
    ops.drop(c, gate, up)
    return y


def rope(m: Model, q: Storage, k: Storage, cos: Storage, sin: Storage, copy: bool,
         grad_copy: tuple[bool, bool]) -> tuple[Storage, Storage]:
    """``LigerRopeFunction`` (``liger_rotary_pos_emb``): q and k rotated in place and returned as views of what was
    rotated (a contiguous copy of each first where ``copy``: the slices of a fused qkv projection are not laid out
    (batch, seq, heads, head_dim)); cos and sin saved. One node waits for both gradients; each is rotated in place
    and passed on, or first copied where ``grad_copy`` says it arrives laid out (batch, heads, seq, head_dim)
    (eager attention's and the math kernel's matmuls, repeat_kv's sum), the incoming ones then let go. Both outputs
    require grad where either input does (k's too in a layer where only q's LoRA trains)."""
    ops, engine = m.ops, m.engine
    ins = (q, k)
    srcs = [ops.new(t.numel, t.dtype) if copy else t for t in ins]
    outs = [engine.view(s, rg=t.rg) for s, t in zip(srcs, ins)]
    if copy:
        ops.drop(*srcs)

    def run(engine: Engine, node, _buf) -> None:  # noqa: ANN001
        bufs = [o.gbuf for o in outs]
        for o in outs:
            o.gbuf = None
        news = [ops.new(o.numel, o.dtype) if b is not None and c else None for o, b, c in zip(outs, bufs, grad_copy)]
        for b, n in zip(bufs, news):
            if n is not None:
                engine.release_gradient(b)
        for t in node.saved:
            engine.drop(t)
        for t, b, n in zip(ins, bufs, news):
            if b is None:
                continue
            if t.rg:
                engine.deliver(t, b if n is None else Buf(n))
            elif n is None:  # the gradient of an input that needs none: autograd lets it go
                engine.release_gradient(b)
            else:
                engine.drop(n)

    ops.gathering_node([(q, 0), (k, 0)], [cos, sin], run, tuple(outs))  # outputs: grad where either input has
    return outs[0], outs[1]
