"""Tensor operations over the symbolic engine: what each torch op allocates, saves and needs in backward.

Each function mirrors one torch op used by the model builder: the outputs it allocates (or views it
returns), the tensors its autograd node saves (torch saves an operand only when the other operand's
gradient needs it), and the gradients it allocates in backward (an input whose dtype equals the
gradient's passes it through without a copy). Rules are taken from torch's derivatives.yaml and checked
against the dispatch tracker; comments name the torch behaviour where it is not obvious.
"""

from __future__ import annotations

from collections.abc import Callable

from vramlab.core.estimator.engine import DTYPE_SIZE, Buf, Engine, Grad, Returned, Storage
from vramlab.core.kinds import Kind


class Ops:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # ---- creation -------------------------------------------------------------------------------------
    def new(self, numel: int, dtype: str, kind: Kind | None = None, rg: bool = False, name: str = "") -> Storage:
        h = self.engine.alloc(numel * DTYPE_SIZE[dtype], kind, rg, name=name)
        h.numel, h.dtype = numel, dtype
        return h

    def param(self, numel: int, dtype: str, kind: Kind, rg: bool) -> Storage:
        h = self.engine.param(numel * DTYPE_SIZE[dtype], kind, rg)
        h.numel, h.dtype = numel, dtype
        return h

    def drop(self, *hs: Storage | None) -> None:
        for h in hs:
            self.engine.drop(h)

    def ref(self, h: Storage) -> Storage:
        return self.engine.ref(h)

    def gbytes(self, h: Storage, dtype: str | None = None) -> int:
        """Bytes of a gradient shaped like ``h`` (in ``h``'s dtype unless given)."""
        return h.numel * DTYPE_SIZE[dtype or h.dtype]

    # ---- views --------------------------------------------------------------------------------------------
    def gathering_views(self, x: Storage, numels: list, copy: bool = False) -> list[Storage]:
        """Views of ``x`` made by one op whose backward gathers them (``chunk``, ``split``, ``unbind``): one
        node waits for every view's gradient, then allocates ``x``'s whole gradient (a cat or a stack, zeros
        for a view that got none), releases the views' gradients and passes it on; ``copy``: it is copied once
        more first (the reshape of a permuted stack). Nothing is allocated when no view got a gradient."""
        engine = self.engine
        views = [engine.view(x, n) for n in numels]

        def gather(engine: Engine, node, buf) -> None:  # noqa: ANN001 - a Node, no gradient of its own
            grads = [v.gbuf for v in views if v.gbuf is not None]
            for v in views:
                v.gbuf = None
            if not grads:
                return
            g = engine.alloc(self.gbytes(x))
            for b in grads:
                engine.release_gradient(b)
            if copy:
                c = engine.alloc(self.gbytes(x))
                engine.drop(g)
                g = c
            engine.deliver(x, Buf(g))

        self.gathering_node([(x, 0)], [], gather)
        return views

    def gathering_node(self, edges: list[tuple[Storage, int]], saved: list[Storage], run: Callable,
                       outs: tuple[Storage, ...] = ()) -> bool:
        """One backward node for several outputs (a split's views, a function returning two tensors): ``run`` is its
        special backward, called once every output's gradient has come (each held in the output's ``gbuf``, which
        ``run`` takes); a marker view of the first input carries it, let go at once. ``outs`` require grad where a
        node is recorded (some input requires grad), as an autograd function's outputs do. Returns that."""
        run.gathers = True
        marker = self.engine.view(edges[0][0])
        recorded = self.engine.node(marker, edges, saved, special=run)
        for o in outs:
            o.rg = recorded
        self.drop(marker)
        return recorded

    # ---- elementwise -----------------------------------------------------------------------------------
    def cast(self, x: Storage, dtype: str, kind: Kind | None = None) -> Storage:
        """``x.to(dtype)``: returns ``x`` itself when the dtype already matches (a new reference)."""
        if x.dtype == dtype:
            return self.ref(x)
        out = self.new(x.numel, dtype, kind)
        self.engine.node(out, [(x, self.gbytes(x))])
        return out

    def softmax(self, x: Storage, dtype: str = "f32") -> Storage:
        """``F.softmax(x, dim=-1, dtype=dtype)``: a cast node (none when ``x`` has the dtype), then ``_softmax``,
        which saves its output; the cast goes when the softmax has run."""
        xc = self.cast(x, dtype)
        out = self.new(x.numel, dtype)
        self.engine.node(out, [(xc, self.gbytes(xc))], [out])
        self.drop(xc)
        return out

    def unary(self, x: Storage, save_input: bool = False, save_output: bool = False, dtype: str | None = None,
              numel: int | None = None) -> Storage:
        """An elementwise op with one input (silu, gelu, tanh, neg, x * python scalar, x / scalar)."""
        out = self.new(numel if numel is not None else x.numel, dtype or x.dtype)
        saved = ([x] if save_input else []) + ([out] if save_output else [])
        self.engine.node(out, [(x, self.gbytes(x))], saved)
        return out

    def add(self, a: Storage, b: Storage, out_numel: int | None = None) -> Storage:
        """``a + b`` with type promotion: the function hands the incoming gradient back to both inputs, so a
        same-dtype, same-shape input gets it passed through; autograd sums it to a broadcast input's shape and casts
        it to a promoted input's dtype (:class:`Returned`)."""
        dtype = promote(a.dtype, b.dtype)
        n = out_numel or max(a.numel, b.numel)
        out = self.new(n, dtype)
        edges, prog = [], []
        for i, x in enumerate((a, b)):
            same = x.dtype == dtype and x.numel == n
            edges.append((x, 0 if same else self.gbytes(x)))
            prog.append(Grad(i) if same else Returned(i, n, dtype, passed=True))
        self.engine.node(out, edges, prog=tuple(prog))
        return out

    def mul(self, a: Storage, b: Storage) -> Storage:
        """``a * b`` (b may broadcast). Saves b for a's gradient and a for b's. Backward computes the other
        operand's gradient first, each at the output's size and dtype; autograd then sums a broadcast operand's
        down to its shape and casts a promoted one back to its dtype, once the function has returned
        (:class:`Returned`)."""
        dtype = promote(a.dtype, b.dtype)
        n = max(a.numel, b.numel)
        out = self.new(n, dtype)
        saved = []
        if a.rg:
            saved.append(b)
        if b.rg:
            saved.append(a)
        edges = [(a, self.gbytes(a)), (b, self.gbytes(b))]
        prog = tuple(Grad(i) if (a, b)[i].numel == n and (a, b)[i].dtype == dtype else Returned(i, n, dtype)
                     for i in (1, 0))
        self.engine.node(out, edges, saved, prog)
        return out

    # ---- linear algebra --------------------------------------------------------------------------------
    def linear(self, x: Storage, w: Storage, bias: Storage | None, rows: int, out_f: int, in_f: int,
               contiguous: bool = True) -> Storage:
        """``F.linear``: saves x when the weight needs a gradient and the weight when x does. A
        non-contiguous 3-D input is copied by matmul's reshape, and its bias is then added by a separate
        op (in place on CUDA, out of place while a dispatch mode is active)."""
        engine = self.engine
        if not contiguous:
            xc = self.new(x.numel, x.dtype)
            engine.node(xc, [(x, 0)])
            y = self.linear(xc, w, None, rows, out_f, in_f)
            self.drop(xc)
            if bias is None:
                return y
            if engine.match_simulation:
                out = self.new(rows * out_f, promote(y.dtype, bias.dtype))
                engine.node(out, [(y, 0), (bias, self.gbytes(bias))])
                self.drop(y)
                return out
            out = engine.view(y)
            engine.node(out, [(y, 0), (bias, self.gbytes(bias))])
            self.drop(y)
            return out
        out = self.new(rows * out_f, x.dtype)
        saved = []
        if w.rg:
            saved.append(x)
        if x.rg:
            saved.append(w)
        edges = [(x, rows * in_f * DTYPE_SIZE[x.dtype]), (w, out_f * in_f * DTYPE_SIZE[w.dtype])]
        if bias is not None:  # addmm: the bias's gradient is the incoming one, summed to its shape on return
            edges.append((bias, out_f * DTYPE_SIZE[bias.dtype]))
            prog = (Grad(0), Grad(1), Returned(2, rows * out_f, x.dtype, passed=True))
        else:
            prog = (Grad(1), Grad(0))
        engine.node(out, edges, saved, prog)
        return out


def promote(a: str, b: str) -> str:
    if a == b:
        return a
    order = {"bool": 0, "u8": 1, "i8": 1, "i32": 2, "i64": 3, "f16": 4, "bf16": 4, "f32": 5}
    if {a, b} == {"f16", "bf16"}:
        return "f32"
    return a if order[a] >= order[b] else b
