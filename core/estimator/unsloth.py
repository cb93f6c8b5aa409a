"""Unsloth's fused LoRA kernels on the symbolic engine (``--unsloth-kernels``): the mirror of
core/simulation/unsloth.py, event by event, called by the decoder's MLP (:mod:`.program`) and attention
(:mod:`.attention`) where :func:`vramlab.core.spec.unsloth.unsloth_patch` installs them.

Each backward runs as the library's does, then as torch's engine goes on: the adapters' gradients, made in the
input's dtype, cast to the adapters' own (``validate_outputs``), the incoming gradient let go, the saved tensors
released, the gradients delivered."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.estimator.engine import Buf, Engine, Storage
from vramlab.core.kinds import Kind

if TYPE_CHECKING:
    from vramlab.core.estimator.linear import Lin
    from vramlab.core.estimator.program import Dims, Model


class _Scratch:
    """unsloth's ``_SCRATCH`` buffer and each weight's ``_unsloth_nf4_plan`` (the buffer it last used)."""

    def __init__(self) -> None:
        self.buffer: Storage | None = None
        self.plans: dict[int, Storage] = {}


def _scratch(m: Model) -> _Scratch:
    s = m.__dict__.get("_unsloth_scratch")
    if s is None:
        s = m.__dict__["_unsloth_scratch"] = _Scratch()
    return s


def _dense(m: Model, lin: Lin, dtype: str, global_buffer: bool) -> Storage | None:
    """``fast_dequantize``: None for a float weight; a fresh weight-sized tensor (the caller frees it), or the
    scratch buffer (grown where this weight is larger, the weight's plan holding the buffer it used)."""
    if not lin.q:
        return None
    ops, engine = m.ops, m.engine
    numel = lin.shape.out_features * lin.shape.in_features
    with engine.in_region(Kind.TEMPORARIES):
        if not global_buffer:
            return ops.new(numel, dtype)
        s = _scratch(m)
        plan = s.plans.get(id(lin))
        if plan is not None and plan is s.buffer:
            return None
        buf = s.buffer
        if buf is None or buf.dtype != dtype or buf.numel < numel:
            old, s.buffer = buf, ops.new(numel, dtype)
            ops.drop(old)
            buf = s.buffer
        s.plans[id(lin)] = ops.ref(buf)
        ops.drop(plan)
    return None


def _copy(m: Model, lin_param: Storage, dtype: str) -> Storage | None:
    """``A.to(dtype)``: a copy where the adapter's dtype differs (else the adapter itself: nothing made)."""
    return m.ops.new(lin_param.numel, dtype) if lin_param.dtype != dtype else None


def _matmul_lora(m: Model, dt: str, lin: Lin, rows: int, out_f: int, casts: bool = True) -> Storage:
    """``matmul_lora`` of an input in ``dt``: the product, then ``X @ A.to(dtype)`` (A's copy freed once used) and
    ``B.to(dtype)`` added into it; ``casts`` False: A and B already in the input's dtype (backward)."""
    ops, r = m.ops, m.r
    w = _dense(m, lin, dt, True)
    out = ops.new(rows * out_f, dt)
    ops.drop(w)
    a = _copy(m, lin.A, dt) if casts else None
    xa = ops.new(rows * r, dt)
    ops.drop(a)
    b = _copy(m, lin.B, dt) if casts else None
    ops.drop(b, xa)
    return out


def _finish(engine: Engine, node, buf: Buf | list, grads: list[tuple[Storage, Storage]],  # noqa: ANN001
            x: Storage, dx: Storage) -> None:
    """After the library's backward: each adapter's gradient cast to its dtype (the one made freed), the incoming
    gradient(s) let go, the saved tensors released, the gradients delivered (the input's where it needs one)."""
    ops_new = engine.alloc
    out = []
    for p, made in grads:
        g = made
        if made.dtype != p.dtype:
            g = ops_new(p.numel * _size(p.dtype))
            g.numel, g.dtype = p.numel, p.dtype
            engine.drop(made)
        out.append((p, g))
    for b in buf if isinstance(buf, list) else [buf]:
        engine.release_gradient(b)
    for t in node.saved:
        engine.drop(t)
    if x.rg:
        engine.deliver(x, Buf(dx))
    else:
        engine.drop(dx)
    for p, g in out:
        if p.rg:
            engine.deliver(p, Buf(g))
        else:
            engine.drop(g)


def _size(dtype: str) -> int:
    from vramlab.core.estimator.engine import DTYPE_SIZE

    return DTYPE_SIZE[dtype]


def _grad_pair(m: Model, lin: Lin, dt: str) -> tuple[Storage, Storage]:
    """``torch.empty_like`` of A and B (their copies in ``dt``)."""
    return m.ops.new(lin.A.numel, dt), m.ops.new(lin.B.numel, dt)


def lora_mlp(m: Model, mods: dict, x: Storage, rows: int) -> Storage:
    """``LoRA_MLP``: gate and up through ``matmul_lora``, the activation's output (``torch.empty``) through the
    down projection's; the input and the gate and up outputs saved, the activation's output freed."""
    ops, engine = m.ops, m.engine
    gate, up, down = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
    H, inter = gate.shape.in_features, gate.shape.out_features
    dt, r = x.dtype, m.r
    e = _matmul_lora(m, dt, gate, rows, inter)
    g = _matmul_lora(m, dt, up, rows, inter)
    h = ops.new(rows * inter, dt)
    i = _matmul_lora(m, dt, down, rows, H)

    def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        casts = [_copy(m, p, dt) for p in (gate.A, gate.B, up.A, up.B, down.A, down.B)]
        dw = _matmul_lora(m, dt, down, rows, inter, casts=False)  # into the scratch buffer
        grads = [*_grad_pair(m, down, dt), *_grad_pair(m, gate, dt), *_grad_pair(m, up, dt)]
        for _ in range(2):  # dY @ downB.t(), downA.t() @ h.t()
            ops.drop(ops.new(rows * r, dt))
        up_db, gate_db = ops.new(rows * r, dt), ops.new(rows * r, dt)
        for _ in range(2):  # upA.t() @ X.t(), gateA.t() @ X.t()
            ops.drop(ops.new(rows * r, dt))
        for lin in (up, gate):  # dX written into the saved input; each weight dequantized afresh
            ops.drop(_dense(m, lin, dt, False))
        ops.drop(*casts, dw, up_db, gate_db)
        d_downA, d_downB, d_gateA, d_gateB, d_upA, d_upB = grads
        _finish(engine, node, buf, [(gate.A, d_gateA), (gate.B, d_gateB), (up.A, d_upA), (up.B, d_upB),
                                    (down.A, d_downA), (down.B, d_downB)], x, engine.ref(x))

    edges = [(x, 0)] + [(p, 0) for lin in (gate, up, down) for p in (lin.A, lin.B)]
    engine.node(i, edges, [x, e, g], special=run)
    ops.drop(e, g, h)
    return i


def lora_qkv(m: Model, mods: dict, x: Storage, rows: int) -> tuple[Storage, Storage, Storage]:
    """``LoRA_QKV``: the three projections through ``matmul_lora``, the input saved once; one node waits for the
    three outputs' gradients."""
    ops = m.ops
    lins = [mods[n] for n in ("q_proj", "k_proj", "v_proj")]
    dt, r = x.dtype, m.r
    outs = [_matmul_lora(m, dt, lin, rows, lin.shape.out_features) for lin in lins]

    def run(engine: Engine, node, _buf) -> None:  # noqa: ANN001
        bufs = [o.gbuf for o in outs]
        for o in outs:
            o.gbuf = None
        if all(b is None for b in bufs):
            for t in node.saved:
                engine.drop(t)
            return
        casts = [_copy(m, p, dt) for lin in lins for p in (lin.A, lin.B)]
        grads = [t for lin in lins for t in _grad_pair(m, lin, dt)]
        dbs = [ops.new(rows * r, dt) for _ in lins]  # dQ @ QB.t(), ...
        for _ in lins:  # QA.t() @ X.t(), ...
            ops.drop(ops.new(rows * r, dt))
        for lin in lins:
            ops.drop(_dense(m, lin, dt, False))
        ops.drop(*casts, *dbs)
        pairs = [(p, grads[2 * i + j]) for i, lin in enumerate(lins) for j, p in enumerate((lin.A, lin.B))]
        _finish(engine, node, [b for b in bufs if b is not None], pairs, x, engine.ref(x))

    ops.gathering_node([(x, 0)] + [(p, 0) for lin in lins for p in (lin.A, lin.B)], [x], run, outs)
    return outs[0], outs[1], outs[2]


def lora_o(m: Model, lin: Lin, x: Storage, rows: int) -> Storage:
    """``LoRA_W``: ``matmul_lora``, the input saved; backward makes the input's gradient anew (after a fresh
    dequantization of an NF4 weight)."""
    ops, engine = m.ops, m.engine
    out_f, in_f = lin.shape.out_features, lin.shape.in_features
    dt, r = x.dtype, m.r
    y = _matmul_lora(m, dt, lin, rows, out_f)

    def run(engine: Engine, node, buf: Buf) -> None:  # noqa: ANN001
        casts = [_copy(m, p, dt) for p in (lin.A, lin.B)]
        d_a, d_b = _grad_pair(m, lin, dt)
        y_db = ops.new(rows * r, dt)
        ops.drop(ops.new(rows * r, dt))  # A.t() @ X.t()
        w = _dense(m, lin, dt, False)
        dx = ops.new(rows * in_f, dt)
        ops.drop(w)
        ops.drop(*casts, y_db)
        _finish(engine, node, buf, [(lin.A, d_a), (lin.B, d_b)], x, dx)

    engine.node(y, [(x, 0), (lin.A, 0), (lin.B, 0)], [x], special=run)
    return y


# ---- the cross-entropy ------------------------------------------------------------------------------------------

def _logsumexp(ops, x: Storage, rows: int) -> Storage:  # noqa: ANN001
    """``torch.logsumexp(x, dim=1)`` as ATen runs it on CUDA: the max, its abs and infinity mask, ``x - max``, the
    sum; the max freed as it returns."""
    maxes = ops.new(rows, "f32")
    a = ops.new(rows, "f32")
    inf = ops.new(rows, "bool")
    ops.drop(a, inf)
    sub = ops.new(x.numel, "f32")
    result = ops.new(rows, "f32")
    ops.drop(sub, maxes)
    return result


def causal_lm_loss(m: Model, logits: Storage, head_out: Storage, d, old_kind: Kind) -> Storage:  # noqa: ANN001
    """``UnslothForCausalLMLoss``: the labels shifted into a new tensor, ``Fast_CrossEntropyLoss`` on the logits as
    the model made them (an fp32 loss and log-sum-exp per row, a vocabulary over the block size a block at a time;
    logits, log-sum-exp, losses and labels saved; backward: the logits' gradient in their dtype), then the labelled
    tokens counted and the losses' sum divided by the count (which the division keeps)."""
    from vramlab.core.spec.unsloth import UNSLOTH_CE_BLOCK

    ops, engine = m.ops, m.engine
    rows, vocab = d.T, m.spec.vocab_size
    shift = ops.new(rows, "i64")
    losses = ops.new(rows, "f32")
    if vocab <= UNSLOTH_CE_BLOCK:
        lse = ops.new(rows, "f32")
    else:
        blocks = -(-vocab // UNSLOTH_CE_BLOCK)
        lse2, others = ops.new(rows * blocks, "f32"), ops.new(rows * blocks, "f32")
        lse = _logsumexp(ops, lse2, rows)
        ops.drop(lse2)
        t1 = _logsumexp(ops, others, rows)
        t2 = ops.new(rows, "f32")
        ops.drop(t1)
        soft = ops.new(rows, "f32")
        ops.drop(t2, losses)
        mask = ops.new(rows, "bool")
        losses = ops.new(rows, "f32")
        ops.drop(mask, soft, others)
    engine.node(losses, [(logits, ops.gbytes(logits))], [logits, lse, losses, shift])
    ops.drop(lse)
    ne = ops.new(rows, "bool")  # labels != -100
    count = ops.new(1, "i64")
    ops.drop(ne)
    eq, ones = ops.new(1, "bool"), ops.new(1, "i64")
    n_items = ops.new(1, "i64")  # torch.where(n_items == 0, ones_like(n_items), n_items)
    ops.drop(eq, ones, count)
    total = ops.new(1, "f32")
    engine.node(total, [(losses, 0)])  # sum: backward expands the gradient (a view)
    loss = ops.new(1, "f32")
    engine.node(loss, [(total, ops.gbytes(total))], [n_items])  # DivBackward keeps the divisor
    ops.drop(total, n_items, losses, shift, head_out)
    if logits is not head_out:
        ops.drop(logits)
    engine.node_kind = old_kind
    return loss


def rope(m: Model, q: Storage, k: Storage) -> tuple[Storage, Storage]:
    """``Fast_RoPE_Embedding_QK_Positions`` (core/simulation/unsloth_rope.py): q and k rotated in place (views of
    the projections' outputs), nothing saved; one node waits for both gradients and writes each into a fresh tensor,
    then lets the incoming ones go."""
    ops, engine = m.ops, m.engine
    outs = (engine.view(q), engine.view(k))

    def run(engine: Engine, node, _buf) -> None:  # noqa: ANN001
        bufs = [o.gbuf for o in outs]
        for o in outs:
            o.gbuf = None
        if all(b is None for b in bufs):
            return
        grads = [ops.new(t.numel, t.dtype) for t in (q, k)]
        for b in bufs:
            if b is not None:
                engine.release_gradient(b)
        for t, g in zip((q, k), grads):
            if t.rg:
                engine.deliver(t, Buf(g))
            else:
                engine.drop(g)

    ops.gathering_node([(q, 0), (k, 0)], [], run, outs)
    ops.drop(q, k)
    return outs


def attention(m: Model, q: Storage, k: Storage, v: Storage, d: Dims) -> tuple[Storage, list[Storage]]:
    """xformers' ``memory_efficient_attention`` as unsloth's ``run_attention`` calls it in training
    (core/simulation/unsloth_attention.py): k and v expanded to every query head and reshaped (a copy; a view for one
    kv head; under no_grad, as checkpointing's first forward, not repeated), the caller's k and v living on to the
    return; the kernel saves q, the repeated k and v, its output and an fp32 log-sum-exp, and its backward makes
    gradients of its inputs' sizes, which the expands' backward sums.
    Returns the output and the repeated k and v (locals to the attention's return)."""
    spec, ops, engine = m.spec, m.ops, m.engine
    rep = spec.num_heads // spec.num_kv_heads
    reps: list[Storage] = []
    if rep > 1 and engine.grad_enabled:  # requires_grad: else xformers' grouped layout, views
        for t in (k, v):
            r = engine.view(t, t.numel * rep) if spec.num_kv_heads == 1 else ops.new(t.numel * rep, t.dtype)
            engine.node(r, [(t, ops.gbytes(t))])
            reps.append(r)
        k, v = reps
    out = ops.new(d.T * spec.q_dim, q.dtype)
    lse = ops.new(d.b * spec.num_heads * d.s, "f32")
    engine.node(out, [(q, ops.gbytes(q)), (k, ops.gbytes(k)), (v, ops.gbytes(v))], [q, k, v, out, lse])
    ops.drop(lse)
    return out, reps


def softcap_attention(m: Model, q: Storage, k: Storage, v: Storage, d: Dims, mask: Storage | None) -> Storage:
    """unsloth's Gemma 2 attention, ``_compiled_slow_attention_softcapping`` as inductor runs it
    (core/simulation/unsloth_attention.py ``softcap_attention``, buffer for buffer): under grad two nodes, the
    scores' (keeping the mask, the scores, the softcap constant, the row max and sum, the scaled q and the repeated k)
    and the output's (keeping the probabilities and the repeated v); without grad each buffer freed after its last
    use. Returns the output (batch, seq, heads, head_dim)."""
    spec, ops, engine = m.spec, m.ops, m.engine
    h, dt = spec.num_heads, q.dtype
    hsd, hss, rows = d.T * h * spec.head_dim, d.b * h * d.s * d.s, d.b * h * d.s
    kvsd = d.T * spec.num_kv_heads * spec.head_dim
    if not (engine.grad_enabled and (q.rg or k.rg or v.rg)):
        qs, kr = ops.new(hsd, dt), ops.new(hsd, k.dtype)
        scores = ops.new(hss, dt)
        ops.drop(qs, kr)
        f32, amax, total = ops.new(hss, "f32"), ops.new(rows, "f32"), ops.new(rows, "f32")
        probs, vr = ops.new(hss, dt), ops.new(hsd, v.dtype)
        ops.drop(scores, f32, amax, total)
        o = ops.new(hsd, dt)
        ops.drop(probs, o)
        return vr  # the copy written into the repeated v's buffer
    qs_mm, qs, kr = ops.new(hsd, dt), ops.new(hsd, dt), ops.new(hsd, k.dtype)
    scores = ops.new(hss, dt)
    ops.drop(qs_mm)
    cap = ops.new(1, "f32")
    f32, amax, total = ops.new(hss, "f32"), ops.new(rows, "f32"), ops.new(rows, "f32")
    probs, vr = ops.new(hss, dt), ops.new(hsd, v.dtype)
    ops.drop(f32)
    kept = [*([mask] if mask is not None else []), scores, cap, amax, total, qs, kr]

    def scores_backward(engine: Engine, node, buf) -> None:  # noqa: ANN001
        f32, grow = ops.new(hss, "f32"), ops.new(rows, "f32")
        ops.drop(f32, grow)  # the scores' gradient written into the incoming one's storage
        gk_rep, gq_s = ops.new(hsd, dt), ops.new(hsd, dt)
        gk, gq = ops.new(kvsd, dt), ops.new(hsd, dt)
        ops.drop(gk_rep, gq_s)
        _finish(engine, node, buf, [(k, gk)], q, gq)

    engine.node(probs, [(q, 0), (k, 0)], kept, special=scores_backward)
    ops.drop(scores, cap, amax, total, qs, kr)
    o = ops.new(hsd, dt)
    out = ops.new(hsd, dt)
    ops.drop(o)

    def output_backward(engine: Engine, node, buf) -> None:  # noqa: ANN001
        gv_rep = ops.new(hsd, dt)
        gv = ops.new(kvsd, dt)
        ops.drop(gv_rep)
        gp = ops.new(hss, dt)
        _finish(engine, node, buf, [(v, gv)], probs, gp)

    engine.node(out, [(probs, 0), (v, 0)], [probs, vr], special=output_backward)
    ops.drop(probs, vr)
    return out
