"""The linear layers of the decoder program: their parameters (float, bitsandbytes-quantized, LoRA, DoRA) and
their forward (autocast's casts and weight cache, the dequantizing kernels, peft's LoRA and DoRA branches).

Part of :class:`~vramlab.core.estimator.program.Model` (a mixin: it uses the model's ``spec``, ``setup``,
``engine``, ``ops``, dtypes and ``_p``); mirrors ``Linear`` and ``QuantWeight`` of ``core/simulation/model.py``.
"""

from __future__ import annotations

from vramlab.core.estimator.engine import DTYPE_SIZE, FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.ops import promote
from vramlab.core.estimator.poly import Poly
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import LinearShape

NF4_BLOCK = 64
DQ_BLOCK = 256


class Lin:
    """Parameters of one linear layer: float weight or quantized storage, bias, LoRA A/B."""

    __slots__ = ("shape", "w", "q", "bias", "A", "B", "M", "lora")

    def __init__(self, shape: LinearShape) -> None:
        self.shape = shape
        self.w: Storage | None = None
        self.q: list[Storage] = []
        self.bias: Storage | None = None
        self.A: Storage | None = None
        self.B: Storage | None = None
        self.M: Storage | None = None  # DoRA's magnitude vector
        self.lora = False


class LinearLayers:
    """Linear layers as the model's methods (see the module docstring)."""

    def _linear(self, shape: LinearShape, trainable: bool, lora: bool, tied: Storage | None = None) -> Lin:
        lin = Lin(shape)
        out_f, in_f = shape.out_features, shape.in_features
        if tied is not None:
            lin.w = tied
        elif self.quant and shape.name not in ("lm_head", "router"):
            lin.q = self._quantize(out_f * in_f, out_f)
        else:
            lin.w = self._p(out_f * in_f, self.pdt, trainable, out_f, in_f)
        if shape.bias:
            lin.bias = self._p(out_f, self.pdt, trainable)
        if lora:
            r = self.r
            lin.lora = True
            lin.A = self._p(r * in_f, self.adt, not self.setup.lora_fa, r, in_f)
            lin.B = self._p(out_f * r, self.adt, True, out_f, r)
            self.adapters += [lin.A, lin.B]
            if self.setup.use_dora:
                lin.M = self._dora_magnitude(lin)
                self.adapters.append(lin.M)
        return lin

    def _dora_magnitude(self, lin: Lin) -> Storage:
        """peft 0.21.2 ``DoraLinearLayer.update_layer``: ``lora_B @ lora_A`` (the adapter's full weight), then
        ``norm(weight + scaling * lora_weight, dim=1)``, kept as the trainable magnitude (the sum's dtype)."""
        ops = self.ops
        out_f, in_f = lin.shape.out_features, lin.shape.in_features
        lw = ops.new(out_f * in_f, self.adt)
        t = ops.new(out_f * in_f, self.adt)
        total = ops.new(out_f * in_f, promote(lin.w.dtype, self.adt))
        ops.drop(t)
        m = self._p(out_f, total.dtype, True, out_f, 0)
        ops.drop(total, lw)
        return m

    def _quantize(self, n: int, rows: int) -> list[Storage]:
        """QuantWeight.__init__: a bf16 copy, then packed codes and scales (and double quantization)."""
        ops = self.ops
        full = ops.new(n, "bf16", Kind.TEMPORARIES)
        if self.sh is not None and self.sh.params_sharded:
            # quantized on the host side of the shard, then sharded buffer by buffer
            ops.drop(full)
            if self.quant == "int8":
                bufs = [(n, "i8"), (rows, "f32")]
            else:
                absmax_n = n // NF4_BLOCK
                bufs = [(n // 2, "u8"), (16, "f32")]
                if self.setup.double_quant:
                    bufs += [(absmax_n, "u8"), ((absmax_n + DQ_BLOCK - 1) // DQ_BLOCK, "f32"), (1, "f32")]
                else:
                    bufs.append((absmax_n, "f32"))
            out = []
            for numel, dt in bufs:
                h = Storage(Poly.of(0), Kind.WEIGHTS, False)
                h.param, h.numel, h.dtype = True, Poly.of(numel), dt
                self.sh.adopt(h, dt)
                out.append(h)
            return out
        if self.quant == "int8":
            q = ops.param(n, "i8", Kind.WEIGHTS, False)
            scb = ops.param(rows, "f32", Kind.WEIGHTS, False)
            ops.drop(full)
            return [q, scb]
        packed = ops.param(n // 2, "u8", Kind.WEIGHTS, False)
        absmax_n = n // NF4_BLOCK
        absmax = ops.new(absmax_n, "f32", Kind.WEIGHTS)
        ops.drop(full)
        code = ops.param(16, "f32", Kind.WEIGHTS, False)
        out = [packed, code]
        if self.setup.double_quant:
            nb = (absmax_n + DQ_BLOCK - 1) // DQ_BLOCK
            out += [ops.param(absmax_n, "u8", Kind.WEIGHTS, False), ops.param(nb, "f32", Kind.WEIGHTS, False),
                    ops.param(1, "f32", Kind.WEIGHTS, False)]
            ops.drop(absmax)
        else:
            absmax.param = True
            out.append(absmax)
        return out

    def amp_cast(self, x: Storage, weight: bool = False) -> Storage:
        """_amp_cast: fp32 operands become compute-dtype copies; weight copies are AMP copies, and a trainable
        parameter's copy is held by autocast's cache until its region ends (see :meth:`amp_region_end`)."""
        if x.dtype == self.cdt or not x.dtype.startswith(("f", "b")):
            return self.ops.ref(x)
        if weight:
            cache = self.amp_cache if x.dtype == "f32" and x.rg and x.param else None
            if cache is not None and id(x) in cache:
                return self.ops.ref(cache[id(x)][0])
            self.engine.region, old = Kind.AMP_COPIES, self.engine.region
            try:
                out = self.ops.cast(x, self.cdt)
            finally:
                self.engine.region = old
            if cache is not None:
                cache[id(x)] = (self.ops.ref(out), self.engine.tag)
            return out
        return self.ops.cast(x, self.cdt)

    def amp_region_start(self) -> bool:
        """An autocast region opens (a nested one shares the outer cache); True when this one opened it."""
        if not self.amp or self.amp_cache is not None:
            return False
        self.amp_cache = {}
        return True

    def amp_region_end(self, opened: bool) -> None:
        """The region that ``amp_region_start`` opened ends: autocast's cache lets its copies go (each
        under the tag of the layer that made it, so repeated layers free theirs as often)."""
        if not opened or self.amp_cache is None:
            return
        cache, self.amp_cache = self.amp_cache, None
        engine, old = self.engine, self.engine.tag
        for ref, tag in cache.values():
            engine.tag = tag
            self.ops.drop(ref)
        engine.tag = old

    def amp_linear(self, x: Storage, w: Storage, bias: Storage | None, rows: int, out_f: int, in_f: int,
                   contiguous: bool = True) -> Storage:
        ops = self.ops
        if self.amp:
            xc = self.amp_cast(x)
            wc = self.amp_cast(w, True)
            bc = self.amp_cast(bias, True) if bias is not None else None
            y = ops.linear(xc, wc, bc, rows, out_f, in_f, contiguous or xc is not x)
            ops.drop(xc, wc, bc)
            return y
        return ops.linear(x, w, bias, rows, out_f, in_f, contiguous)

    def dequant(self, lin: Lin, dtype: str) -> tuple[list[int], int]:
        """Temporaries of QuantWeight.dequantize: (the absmax fp32 buffer or none, the full weight)."""
        n = lin.shape.out_features * lin.shape.in_features
        extra = []
        if self.quant == "nf4" and self.setup.double_quant:
            extra = [(n // NF4_BLOCK) * 4]
        return extra, n * DTYPE_SIZE[dtype]

    def linear(self, lin: Lin, x: Storage, rows: int, contiguous: bool = True) -> Storage:
        """Linear.forward: the base layer, then peft's LoRA branch."""
        ops, engine = self.ops, self.engine
        out_f, in_f = lin.shape.out_features, lin.shape.in_features
        if lin.q:
            # bitsandbytes Linear4bit / Linear8bitLt: input and bias to the compute dtype, output back to the
            # input dtype
            xc = ops.cast(x, self.cdt)
            bc = ops.cast(lin.bias, self.cdt) if lin.bias is not None else None
            extra, wbytes = self.dequant(lin, self.cdt)
            with engine.in_region(Kind.TEMPORARIES):
                ex = [engine.alloc(b) for b in extra]
                w = engine.alloc(wbytes)
                for t in ex:
                    engine.drop(t)
            result = ops.new(rows * out_f, self.cdt)
            engine.drop(w)
            # backward dequantizes again: absmax buffer, weight, free absmax, grad_x, free weight
            prog = [Temp(0, b) for b in extra] + [Temp(0, wbytes)]
            if extra:
                prog.append(FreeTemp(0))
            prog += [Grad(0), FreeTemp(0)]
            edges = [(xc, ops.gbytes(xc))]
            if bc is not None:
                edges.append((bc, ops.gbytes(bc)))
                prog.append(Grad(1))
            # bitsandbytes' MatMul8bitLt keeps its input A for backward (ctx.tensors = (CAt, subA, A), 0.45-0.50);
            # MatMul4Bit keeps only the packed weight
            saved = (xc,) if self.quant == "int8" else ()
            engine.node(result, edges, saved, tuple(prog))
            ops.drop(xc, bc)
            if result.dtype != x.dtype:
                r2 = ops.cast(result, x.dtype)
                ops.drop(result)
                result = r2
        else:
            result = self.amp_linear(x, lin.w, lin.bias, rows, out_f, in_f, contiguous)
        if not lin.lora:
            return result
        # peft lora.Linear.forward: the cast input lives to the end of the call; ``result + B(A(dropout(x)))
        # * scaling`` is one expression, so A's output goes once B has run and B's once it is scaled
        r = self.r
        rdt = result.dtype
        bnb_amp = lin.q and self.quant == "nf4" and self.amp  # peft's Linear4bit under autocast: no conversions
        xa = ops.ref(x) if bnb_amp else ops.cast(x, lin.A.dtype)  # peft: to lora_A.weight's dtype as it runs
        if lin.M is not None:
            return self._dora(lin, xa, result, rows)
        src = self._lora_input(xa)
        a = self.amp_linear(src, lin.A, None, rows, r, in_f)
        if src is not xa:
            ops.drop(src)
        b = self.amp_linear(a, lin.B, None, rows, out_f, r)
        ops.drop(a)
        if lin.q and self.quant == "nf4":
            # peft 0.21.2's bnb Linear4bit.forward: ``lora_B(lora_A(dropout(x))) * scaling`` cast to the result's
            # dtype before it is added, outside autocast only
            t = ops.unary(b)
            ops.drop(b)
            o = ops.ref(t) if bnb_amp else ops.cast(t, rdt)
            ops.drop(t)
            out = ops.add(result, o)
            ops.drop(o, result, xa)
            return out
        t = ops.unary(b)
        ops.drop(b)
        s = ops.add(result, t)
        ops.drop(t, result)
        out = ops.cast(s, rdt)
        ops.drop(s, xa)
        return out

    def _lora_input(self, xa: Storage) -> Storage:
        """peft's ``lora_dropout(x)``: ``xa`` itself without dropout, else the dropout's output (its mask kept)."""
        if self.setup.lora_dropout > 0 and self.training:
            return self.dropout(xa, self.setup.lora_dropout)
        return xa

    def _dora(self, lin: Lin, xa: Storage, result: Storage, rows: int) -> Storage:
        """peft 0.21.2 ``DoraLinearVariant.forward`` and ``DoraLinearLayer.forward`` (tuners/lora/variants.py,
        dora.py) on the adapter-dtype input ``xa``: the adapter's full weight as ``lora_B(lora_A(eye))`` (its graph,
        holding the identity and A's output, lives to the end of the call though only its detached value is
        used), the base weight cast to the input's dtype, the weight norm of their sum, then
        ``(m / norm - 1) * base_result + m / norm * lora_B(lora_A(x)) * scaling`` added to the base output."""
        ops, engine = self.ops, self.engine
        out_f, in_f, r = lin.shape.out_features, lin.shape.in_features, self.r
        rdt = result.dtype
        src = self._lora_input(xa)
        start = len(engine.nodes)
        eye = ops.new(in_f * in_f, self.adt)
        ea = self.amp_linear(eye, lin.A, None, in_f, r, in_f)
        ops.drop(eye)
        lw0 = self.amp_linear(ea, lin.B, None, in_f, out_f, r)
        ops.drop(ea)
        lw = ops.cast(lw0, xa.dtype)
        ops.drop(lw0)
        # freed with the adapter's weight, never reached by backward; autocast's cached copy of A (and its cast)
        # stays, for the adapter's own matmul below
        cached = {id(c[0]) for c in self.amp_cache.values()} if self.amp_cache is not None else set()
        graph = [n for n in engine.nodes[start:] if id(n.out) not in cached]
        engine.nodes[start:] = [n for n in engine.nodes[start:] if id(n.out) in cached]
        weight = ops.cast(lin.w, xa.dtype)
        detached = engine.view(lw, rg=False)
        scaled = ops.unary(detached)
        total = ops.add(weight, scaled)
        ops.drop(scaled)
        norm = ops.new(out_f, total.dtype)
        ops.drop(total, detached)
        mns = ops.mul(lin.M, norm)  # magnitude / weight_norm: saves the norm
        a = self.amp_linear(src, lin.A, None, rows, r, in_f)
        lora_result = self.amp_linear(a, lin.B, None, rows, out_f, r)
        ops.drop(a)
        if src is not xa:  # with dropout the base output is computed again from the dropped input
            base = self.amp_linear(src, weight, None, rows, out_f, in_f)
        elif lin.bias is not None:
            base = ops.add(result, lin.bias)  # base_result - bias
        else:
            base = ops.ref(result)
        m1 = ops.unary(mns)
        p1 = ops.mul(m1, base)
        ops.drop(m1)
        p2 = ops.mul(mns, lora_result)
        p3 = ops.unary(p2)
        ops.drop(p2)
        dora = ops.add(p1, p3)
        ops.drop(p1, p3, base, lora_result, mns, norm, weight, lw)
        for node in graph:
            for h in node.saved:
                engine.drop(h)
        s = ops.add(result, dora)
        ops.drop(dora, result)
        if src is not xa:
            ops.drop(src)
        out = ops.cast(s, rdt)
        ops.drop(s, xa)
        return out
