"""The training step as a program over the symbolic engine, mirroring ``core/simulation/model.py``.

Each function here follows the corresponding module of the builder line by line — the same tensors
allocated in the same order, the same Python variables going out of scope at the same points — because
the transient peaks inside a layer depend on exactly that. Sizes come from the :class:`ModelSpec`;
nothing here touches torch.

Layers of the same kind are identical, so the driver evaluates one layer of each kind on the engine and
repeats its net effect arithmetically (see :mod:`.driver`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramlab.core.estimator.engine import DTYPE_SIZE, Engine, FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.ops import Ops, promote
from vramlab.core.estimator.poly import Poly
from vramlab.core.estimator.shard import ShardModel
from vramlab.core.kinds import Kind
from vramlab.core.sdpa import MATH, tape_kernel
from vramlab.core.spec import (
    Activation,
    Attention,
    DType,
    LinearShape,
    Method,
    MlpKind,
    ModelSpec,
    NormKind,
    Sharding,
    TrainingSetup,
)

DT = {DType.FP32: "f32", DType.BF16: "bf16", DType.FP16: "f16"}
NF4_BLOCK = 64
DQ_BLOCK = 256


@dataclass
class Dims:
    """Micro-batch and sequence length (ints, or polynomials when the tape is symbolic). ``multi``:
    the batch is larger than one, which changes tensor layouts (and so copies)."""

    b: Poly | int
    s: Poly | int
    multi: bool
    masked: bool = False  # SDPA gets an explicit sliding-window mask (ModelSpec.sdpa_mask)

    @property
    def T(self) -> Poly | int:  # noqa: N802
        return self.b * self.s


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


class Model:
    """The parameters (handles) and the forward program of the decoder."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, engine: Engine, rank: Poly | int | None = None,
                 plan: list[int] | None = None) -> None:
        """``plan``: the layer indices to replay (all by default; the driver passes a reduced plan whose
        repeated layers the tape multiplies). ``rank``: the LoRA rank (a polynomial for symbolic tapes)."""
        self.spec, self.setup, self.engine = spec, setup, engine
        self.ops = Ops(engine)
        self.r = setup.lora_rank if rank is None else rank
        self.plan = list(range(spec.num_layers)) if plan is None else plan
        w = setup.weight_dtype
        self.quant = w.value if w.is_quantized else None
        self.pdt = DT[setup.compute] if self.quant else DT[w]  # float parameters
        if self.quant and setup.kbit_upcast:
            self.pdt = "f32"
        self.cdt = DT[setup.compute]
        self.adt = DT[setup.adapter_dtype]
        self.amp = setup.autocast
        self.amp_cache: dict[int, tuple[Storage, int]] | None = None  # autocast's weight cache (a region open)
        self.training = True  # eval mode (generation, a reference copy) skips LoRA dropout
        self.kv = None  # generation: the objective's KV-cache hook (core/estimator/objective.py)
        self.train_base = setup.method in (Method.FULL, Method.FREEZE)
        self.first_trainable = 0
        if setup.method is Method.FREEZE:
            self.first_trainable = spec.num_layers - int(setup.trainable_layers or spec.num_layers)
        self.targets = set(spec.lora_modules(setup.lora_targets)) if setup.uses_lora else set()
        self.params: list[Storage] = []  # trainable, in module order (optimizer order)
        self.layer_params: list[list[Storage]] = []
        self.shapes: dict[int, tuple[int, int]] = {}  # id(param) -> (rows, cols); cols 0 for vectors
        self.adapters: list[Storage] = []
        self.sh: ShardModel | None = None
        if setup.sharding is not Sharding.NONE:
            mixed = setup.sharding.shards_params and w is DType.FP32 and setup.compute is not DType.FP32
            if mixed:
                self.amp = False  # FSDP mixed precision: parameters are gathered in the compute dtype
            reduce = "f32" if mixed else DT[setup.trainable_dtype]
            self.sh = ShardModel(setup, engine, self.ops, self.cdt, mixed, reduce)
        # SDPA's math kernel where a CUDA run of the modelled torch takes it (core/sdpa.py)
        self.math_kernel = tape_kernel(spec, setup, engine.match_simulation) == MATH

    # ---- load ---------------------------------------------------------------------------------------------
    def _p(self, numel: int, dtype: str, trainable: bool, rows: int = 0, cols: int = 0) -> Storage:
        if self.sh is not None and self.sh.params_sharded:
            h = self.sh.param(numel, dtype, trainable)
        else:
            h = self.ops.param(numel, dtype, Kind.WEIGHTS, trainable)
        if trainable:
            self.params.append(h)
        self.shapes[id(h)] = (rows or numel, cols)
        return h

    def adapter_handles(self) -> list[Storage]:
        return self.adapters

    def shape_of(self, p: Storage) -> tuple[int, int]:
        return self.shapes[id(p)]

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

    def load(self) -> None:
        spec, ops = self.spec, self.ops
        h = spec.hidden_size
        train_embed = self.setup.trains("embed_tokens")
        self.embed = self._p(spec.vocab_size * h, self.pdt, train_embed, spec.vocab_size, h)
        self.pos = self._p(spec.max_position_embeddings * h, self.pdt, self.setup.method is Method.FULL,
                           spec.max_position_embeddings, h) \
            if spec.learned_positions else None
        self.layers = []
        for tag, i in enumerate(self.plan):
            self.engine.tag = tag
            self.layers.append(self._layer(i))
        self.engine.tag = -1
        if self.sh is not None:
            self.sh.unit_index = -1
        self.final_norm = self._norm(self.setup.trains("norm"))
        train_head = self.setup.trains("lm_head")
        tied = self.embed if spec.tie_embeddings else None
        if tied is not None:
            train_head = train_embed  # a tied head is the embedding's weight
        head = LinearShape("lm_head", spec.vocab_size, h, spec.lm_head_bias)
        self.head = self._linear(head, train_head, "lm_head" in self.targets, tied)
        if spec.learned_positions:  # no rotary table (GPT-2)
            self.inv_freq = None
            return
        # inv_freq: arange(int64) -> float -> t / dim -> 10000 ** x -> 1 / x
        half = spec.rope_dim // 2
        t = ops.new(half, "i64")
        tf = ops.new(half, "f32")
        ops.drop(t)
        x = ops.new(half, "f32")
        p = ops.new(half, "f32")
        ops.drop(x)
        r = ops.new(half, "f32")  # 1.0 / p is reciprocal() * 1.0
        self.inv_freq = ops.new(half, "f32")
        self.inv_freq.param = True
        ops.drop(r, p, tf)

    def _norm(self, trainable: bool, dim: int | None = None) -> list[Storage]:
        dim = dim or self.spec.hidden_size
        if self.spec.norm_kind is NormKind.LAYERNORM:
            return [self._p(dim, self.pdt, trainable), self._p(dim, self.pdt, trainable)]
        return [self._p(dim, self.pdt, trainable)]

    def _layer(self, i: int) -> dict:
        spec = self.spec
        if self.sh is not None:
            self.sh.unit_index = self.engine.tag
        trainable = self.train_base and i >= self.first_trainable
        start = len(self.params)
        L: dict = {"trainable": trainable, "index": i}
        L["in_norm"] = self._norm(trainable)
        L["attn"] = {s.name: self._linear(s, trainable, s.name in self.targets) for s in spec.attn_linears()}
        if spec.qk_norm:
            L["q_norm"] = self._norm(trainable, spec.head_dim)
            L["k_norm"] = self._norm(trainable, spec.head_dim)
        if spec.is_moe:
            L["router"] = self._linear(spec.router_linear(), trainable, False)
            L["experts"] = [
                {s.name: self._linear(LinearShape(s.name, s.out_features, s.in_features, s.bias), trainable,
                                      s.name in self.targets) for s in spec.mlp_linears()}
                for _ in range(spec.num_experts)
            ]
            L["shared"] = {s.name: self._linear(s, trainable, False) for s in spec.shared_expert_linears()}
        else:
            L["mlp"] = {s.name: self._linear(s, trainable, s.name in self.targets) for s in spec.mlp_linears()}
        if not spec.parallel_block:
            L["post_norm"] = self._norm(trainable)
        if spec.norms_per_layer == 4:
            L["pre_ffn"] = self._norm(trainable)
            L["post_ffn"] = self._norm(trainable)
        self.layer_params.append(self.params[start:])
        return L

    # ---- modules ---------------------------------------------------------------------------------------------
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
            with _region(engine, Kind.TEMPORARIES):
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
            if lin.lora and self.quant == "nf4":  # peft's Linear4bit: result = result.clone()
                r2 = ops.new(result.numel, result.dtype)
                engine.node(r2, [(result, 0)])
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
        xa = ops.cast(x, self.adt)
        if lin.M is not None:
            return self._dora(lin, xa, result, rows)
        src = xa
        if self.setup.lora_dropout > 0 and self.training:
            src = ops.new(xa.numel, xa.dtype)
            mask = ops.new(xa.numel, "bool")
            engine.node(src, [(xa, ops.gbytes(xa))], [mask])
            ops.drop(mask)
        a = self.amp_linear(src, lin.A, None, rows, r, in_f)
        if src is not xa:
            ops.drop(src)
        b = self.amp_linear(a, lin.B, None, rows, out_f, r)
        ops.drop(a)
        if lin.q and self.quant == "nf4":
            # peft's bnb Linear4bit.forward: ``lora_B(lora_A(dropout(x))) * scaling`` cast to the result's dtype
            # before it is added (its defensive ``result.clone()`` recorded above)
            t = ops.unary(b)
            ops.drop(b)
            o = ops.cast(t, rdt)
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

    def _dora(self, lin: Lin, xa: Storage, result: Storage, rows: int) -> Storage:
        """peft 0.21.2 ``DoraLinearVariant.forward`` and ``DoraLinearLayer.forward`` (tuners/lora/variants.py,
        dora.py) on the adapter-dtype input ``xa``: the adapter's full weight as ``lora_B(lora_A(eye))`` (its graph,
        holding the identity and A's output, lives to the end of the call though only its detached value is
        used), the base weight cast to the input's dtype, the weight norm of their sum, then
        ``(m / norm - 1) * base_result + m / norm * lora_B(lora_A(x)) * scaling`` added to the base output."""
        ops, engine = self.ops, self.engine
        out_f, in_f, r = lin.shape.out_features, lin.shape.in_features, self.r
        rdt = result.dtype
        src = xa
        if self.setup.lora_dropout > 0 and self.training:
            src = ops.new(xa.numel, xa.dtype)
            mask = ops.new(xa.numel, "bool")
            engine.node(src, [(xa, ops.gbytes(xa))], [mask])
            ops.drop(mask)
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

    def norm(self, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
        ops = self.ops
        if self.spec.norm_kind is NormKind.LAYERNORM:
            xin = ops.cast(x, "f32") if self.amp and x.dtype != "f32" else ops.ref(x)
            out = ops.new(rows * dim, xin.dtype)
            stat = xin.dtype if self.engine.match_simulation else "f32"  # CUDA keeps fp32 statistics
            mean = ops.new(rows, stat)
            rstd = ops.new(rows, stat)
            edges = [(xin, ops.gbytes(xin)), (ws[0], ops.gbytes(ws[0])), (ws[1], ops.gbytes(ws[1]))]
            if self.engine.node(out, edges, [xin, mean, rstd]):
                pass
            ops.drop(mean, rstd, xin)
            return out
        dtype = x.dtype
        h = ops.cast(x, "f32")
        # pow(2): saves h; backward makes two temporaries and the gradient
        p = ops.new(h.numel, "f32")
        hb = ops.gbytes(h)
        self.engine.node(p, [(h, hb)], [h], (Temp(0, hb), Temp(0, hb), Grad(0), FreeTemp(0), FreeTemp(0)))
        var = ops.new(rows, "f32")  # mean(-1, keepdim): backward expands to full size
        self.engine.node(var, [(p, ops.gbytes(p))])
        ops.drop(p)
        a = ops.add(var, _const(ops))
        gemma = self.spec.gemma_norm
        if gemma:  # GemmaRMSNorm._norm: the mean is a temporary
            ops.drop(var)
        rs = ops.new(rows, "f32")  # rsqrt saves its result; backward: two temporaries and the gradient
        rb = ops.gbytes(rs)
        self.engine.node(rs, [(a, rb)], [rs], (Temp(0, rb), Temp(0, rb), Grad(0), FreeTemp(0), FreeTemp(0)))
        ops.drop(a)
        n = ops.mul(h, rs)
        ops.drop(rs, h)
        if gemma:  # (n * (1.0 + weight.float())).type_as(x): the weight applied in fp32
            wf = ops.cast(ws[0], "f32")
            w1 = ops.unary(wf)
            ops.drop(wf)
            o = ops.mul(n, w1)
            ops.drop(n, w1)
            out = ops.cast(o, dtype)
            ops.drop(o)
            return out
        c = ops.cast(n, dtype)
        out = ops.mul(ws[0], c)
        ops.drop(c, n, var)
        return out

    def attention(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        spec, ops = self.spec, self.ops
        T = d.T
        A = L["attn"]
        run = spec.attention_run(self.setup.attention)
        eager = run is Attention.EAGER
        if spec.fused_qkv:  # Phi3Attention: qkv_proj, sliced; each slice's backward makes a full-size zeros
            qkv = self.linear(A["qkv_proj"], x, T)
            q = self.head_view(self._slice(qkv, T * spec.q_dim), eager)
            k = self.head_view(self._slice(qkv, T * spec.kv_dim), eager)
            v = self.head_view(self._slice(qkv, T * spec.kv_dim), eager)
            ops.drop(qkv)
        else:
            q = self.head_view(self.linear(A["q_proj"], x, T), eager)
            k = self.head_view(self.linear(A["k_proj"], x, T), eager)
            v = self.head_view(self.linear(A["v_proj"], x, T), eager)
        if spec.qk_norm:
            q2 = self.norm(L["q_norm"], q, T * spec.num_heads, spec.head_dim)
            ops.drop(q)
            k2 = self.norm(L["k_norm"], k, T * spec.num_kv_heads, spec.head_dim)
            ops.drop(k)
            q, k = q2, k2
        if cos is None:  # learned positions (GPT-2): no rotary embedding
            pass
        elif spec.rope_pass_cat:
            q2, k2 = self.rope_pass_cat(q, k, cos, sin)
            ops.drop(q, k)
            q, k = q2, k2
        else:
            q2 = self.rope(q, cos, sin)
            k2 = self.rope(k, cos, sin)
            ops.drop(q, k)
            q, k = q2, k2
        if self.kv is not None:  # generation: DynamicLayer.update concatenates the new keys and values
            k, v = self.kv(L, k, v)
        # (generation's cached keys, of another length than the queries, keep the fused model)
        if run is Attention.SDPA and mask is None and self.math_kernel and self.kv is None:
            if self.amp:
                q2, k2, v2 = self.amp_cast(q), self.amp_cast(k), self.amp_cast(v)
                ops.drop(q, k, v)
                q, k, v = q2, k2, v2
            att = self.sdpa_math(q, k, v, d)
            out = ops.new(att.numel, att.dtype)  # transpose(1, 2).contiguous() copies the (b, h, s, d) output
            self.engine.node(out, [(att, 0)])
            ops.drop(att)
        elif run is Attention.SDPA:
            if mask is not None:  # sliding window: HF repeats k and v instead of SDPA's enable_gqa
                k, v = self.repeat_kv(k), self.repeat_kv(v)
            if self.amp:
                q2, k2, v2 = self.amp_cast(q), self.amp_cast(k), self.amp_cast(v)
                ops.drop(q, k, v)
                q, k, v = q2, k2, v2
            saved = [q, k, v]
            if mask is not None:  # SDPA turns the boolean mask into an additive one in q's dtype and saves it
                saved.append(ops.new(d.b * d.s * d.s, q.dtype))
            out = ops.new(T * spec.q_dim, q.dtype)
            lse = ops.new(d.b * spec.num_heads * d.s, "f32")
            self.engine.node(out, [(q, ops.gbytes(q)), (k, ops.gbytes(k)), (v, ops.gbytes(v))], [*saved, out, lse])
            ops.drop(lse, *saved[3:])
            if spec.rope_pass_cat:
                # the flash kernels allocate their output like q (empty_like); q concatenated by RoPE is laid
                # out (b, heads, s, d), so transpose(1, 2).contiguous() copies (and o_proj may save the copy)
                c = ops.new(out.numel, out.dtype)
                self.engine.node(c, [(out, 0)])
                ops.drop(out)
                out = c
        else:
            att = self.eager(q, k, v, d, mask)
            out = ops.new(att.numel, att.dtype)  # transpose(1, 2).contiguous() copies matmul's output
            self.engine.node(out, [(att, 0)])
            ops.drop(att)
        y = self.linear(A["o_proj"], out, T)
        y2 = self.dropout(y, spec.resid_dropout)
        ops.drop(y, out, q, k, v)  # SelfAttention.forward's locals live until it returns
        return y2

    def sdpa_math(self, q: Storage, k: Storage, v: Storage, d: Dims) -> Storage:
        """SDPA's math kernel, ``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/
        attention.cpp, torch 2.13), causal, no mask, ``enable_gqa``: a composite of ordinary ops, so autograd
        keeps what they save, as dispatched on the CPU with the math kernel forced (tests/test_sdpa.py holds
        this model to that dispatch). 16-bit q, k, v are first copied to fp32 (query_acc, key_acc,
        value_acc); q is scaled (saved by the first bmm); the causal mask is built as an (s, s) bool
        ``ones().tril()`` and turned into an fp32 additive mask; k and v are repeated to every query head
        (expand + clone); the scaled, transposed k is saved by the bmm; scores + mask; ``_safe_softmax`` keeps
        its fp32 output (batch x heads x seq², the mechanism that matters), which the second bmm saves too
        with the repeated v; the output is cast back to the input dtype, and the probabilities' cast back
        (``attn.to(origin_dtype)``, returned and dropped by the caller) is a transient. Locals of the
        function (the fp32 copies, the scaled q, the repeated k and v, the mask) live until it returns."""
        spec, ops, engine = self.spec, self.ops, self.engine
        low = q.dtype != "f32"
        qa, ka, va = ops.cast(q, "f32"), ops.cast(k, "f32"), ops.cast(v, "f32")
        qs = ops.unary(qa)  # query_acc * sqrt(scale)
        ss = d.s * d.s
        ones = ops.new(ss, "bool")
        tril = ops.new(ss, "bool")
        ops.drop(ones)
        mask = ops.new(ss, "f32")  # convert_boolean_attn_mask: where(mask, 0, -inf)
        ops.drop(tril)
        rep = spec.num_heads // spec.num_kv_heads
        if rep > 1:  # pre_process_group_query_attention_input: repeat_interleave as expand + clone
            kx = ops.new(ka.numel * rep, "f32")
            engine.node(kx, [(ka, ops.gbytes(ka))])
            vx = ops.new(va.numel * rep, "f32")
            engine.node(vx, [(va, ops.gbytes(va))])
        else:
            kx, vx = ops.ref(ka), ops.ref(va)
        ks = ops.unary(kx)  # key_expanded.transpose(-2, -1) * sqrt(scale)
        nsc = d.b * spec.num_heads * ss
        sc = ops.new(nsc, "f32")
        engine.node(sc, [(qs, ops.gbytes(qs)), (ks, ops.gbytes(ks))],
                    ([ks] if qs.rg else []) + ([qs] if ks.rg else []), (Grad(1), Grad(0)))
        ops.drop(ks)
        att = ops.add(sc, mask, nsc)
        ops.drop(sc)
        sm = ops.new(nsc, "f32")  # _safe_softmax saves its output
        engine.node(sm, [(att, ops.gbytes(att))], [sm])
        ops.drop(att)
        out = ops.new(qs.numel, "f32")
        engine.node(out, [(sm, ops.gbytes(sm)), (vx, ops.gbytes(vx))],
                    ([vx] if sm.rg else []) + ([sm] if vx.rg else []), (Grad(1), Grad(0)))
        if low:
            o2 = ops.cast(out, q.dtype)
            ops.drop(out)
            out = o2
            ops.drop(ops.new(nsc, q.dtype))  # attn.to(origin_dtype): returned, and dropped by SDPA
        ops.drop(sm, kx, vx, mask, qs, qa, ka, va)
        return out

    def repeat_kv(self, x: Storage) -> Storage:
        """HF repeat_kv (the caller's name moves to the result): expand + reshape copies, except for one kv
        head, where the reshape is a view; backward sums the expanded gradient."""
        ops, engine = self.ops, self.engine
        rep = self.spec.num_heads // self.spec.num_kv_heads
        if rep == 1:
            return x
        if self.spec.num_kv_heads == 1:
            r = engine.view(x, x.numel * rep)
        else:
            r = ops.new(x.numel * rep, x.dtype)
        engine.node(r, [(x, ops.gbytes(x))])
        ops.drop(x)
        return r

    def head_view(self, y: Storage, copy_grad: bool) -> Storage:
        """``proj(x).view(b, s, heads, hd)``: in backward the view reshapes the incoming gradient, which
        copies when that gradient arrives transposed (eager attention's matmuls produce it so)."""
        v = self.engine.view(y)
        self.engine.node(v, [(y, self.ops.gbytes(y) if copy_grad else 0)])
        self.ops.drop(y)
        return v

    def _slice(self, x: Storage, numel: Poly | int) -> Storage:
        """``x[..., a:b]``: a view whose backward (slice_backward) allocates zeros of ``x``'s full size."""
        v = self.engine.view(x, numel)
        self.engine.node(v, [(x, self.ops.gbytes(x))])
        return v

    def rope_pass_cat(self, q: Storage, k: Storage, cos: Storage, sin: Storage) -> tuple[Storage, Storage]:
        """HF Phi3 apply_rotary_pos_emb: q[..., :rd] and the (here empty) q[..., rd:] sliced for q and k, each
        rotated part concatenated with its pass-through part (a copy; cat's backward passes views)."""
        ops, engine = self.ops, self.engine
        hd, rd = self.spec.head_dim, self.spec.rope_dim
        parts = [(self._slice(t, t.numel // hd * rd), self._slice(t, t.numel // hd * (hd - rd))) for t in (q, k)]
        out = []
        for (rot, keep), t in zip(parts, (q, k)):
            r = self.rope(rot, cos, sin)
            c = ops.new(t.numel, t.dtype)
            engine.node(c, [(r, 0), (keep, 0)])
            ops.drop(r)
            out.append(c)
        for rot, keep in parts:
            ops.drop(rot, keep)
        return out[0], out[1]

    def rope(self, q: Storage, cos: Storage, sin: Storage) -> Storage:
        """(q * cos) + (rotate_half(q) * sin): slices' backward allocates full-size zeros."""
        ops = self.ops
        t1 = ops.mul(q, cos)
        half = q.numel // 2
        # slices: views whose backward allocates a zero tensor of q's size
        s1 = self.engine.view(q, half)
        self.engine.node(s1, [(q, ops.gbytes(q))])
        s2 = self.engine.view(q, half)
        self.engine.node(s2, [(q, ops.gbytes(q))])
        neg = ops.unary(s2, numel=half)
        cat = ops.new(q.numel, q.dtype)
        self.engine.node(cat, [(neg, 0), (s1, 0)])
        ops.drop(neg, s1, s2)
        t2 = ops.mul(cat, sin)
        ops.drop(cat)
        out = ops.add(t1, t2)
        ops.drop(t1, t2)
        return out

    def eager(self, q: Storage, k: Storage, v: Storage, d: Dims, mask: Storage | None) -> Storage:
        spec, ops, engine = self.spec, self.ops, self.engine
        # _eager's own locals: the caller's q, k, v stay referenced until SelfAttention.forward returns
        if self.amp:
            q, k, v = self.amp_cast(q), self.amp_cast(k), self.amp_cast(v)
        else:
            q, k, v = ops.ref(q), ops.ref(k), ops.ref(v)
        rep = spec.num_heads // spec.num_kv_heads
        if rep > 1 and spec.num_kv_heads == 1:  # MQA: the reshape of the expand is a view (stride 0)
            kr = engine.view(k, k.numel * rep)
            engine.node(kr, [(k, ops.gbytes(k))])
            vr = engine.view(v, v.numel * rep)
            engine.node(vr, [(v, ops.gbytes(v))])
        elif rep > 1:  # repeat_kv: expand + reshape copies; backward sums the expanded gradient
            kr = ops.new(k.numel * rep, k.dtype)
            engine.node(kr, [(k, ops.gbytes(k))])
            ops.drop(k)  # k = repeat_kv(k): the name moves to the copy
            k = None
            vr = ops.new(v.numel * rep, v.dtype)
            engine.node(vr, [(v, ops.gbytes(v))])
            ops.drop(v)
            v = None
        else:
            kr, vr = ops.ref(k), ops.ref(v)
        nsc = d.b * spec.num_heads * d.s * d.s
        mqa = rep > 1 and spec.num_kv_heads == 1
        # matmul folds 4-D operands to 3-D: q (RoPE output, laid out b,s,h,d) and an expanded MQA key or
        # value need a copy when the batch is larger than 1; bmm then saves the copies
        qa = self._mm_operand(q, d.multi)
        ka = self._mm_operand(kr, d.multi and mqa)
        sc = ops.new(nsc, q.dtype)
        # bmm saves each operand for the other's gradient; backward computes mat2's gradient first
        engine.node(sc, [(qa, ops.gbytes(qa)), (ka, ops.gbytes(ka))], ([ka] if qa.rg else []) + ([qa] if ka.rg else []),
                    (Grad(1), Grad(0)))
        ops.drop(qa, ka)
        w = ops.unary(sc, numel=nsc)
        ops.drop(sc)
        cap = spec.attn_logit_softcap
        if cap:
            w2 = ops.unary(w)
            ops.drop(w)
            w3 = ops.unary(w2, save_output=True)
            ops.drop(w2)
            w = ops.unary(w3)
            ops.drop(w3)
        if mask is not None:
            w2 = ops.add(w, mask, nsc)
            ops.drop(w)
            w = w2
        # softmax(dtype=fp32): a cast node, then _softmax (saves its output)
        w32 = ops.cast(w, "f32")
        sm = ops.new(nsc, "f32")
        engine.node(sm, [(w32, ops.gbytes(w32))], [sm])
        ops.drop(w32)
        pb = ops.cast(sm, q.dtype)
        ops.drop(sm, w)
        if spec.attention_dropout and self.training:
            pd = self.dropout(pb, spec.attention_dropout)
            ops.drop(pb)
            pb = pd
        va = self._mm_operand(vr, d.multi and mqa)
        out = ops.new(q.numel, q.dtype)
        engine.node(out, [(pb, ops.gbytes(pb)), (va, ops.gbytes(va))],
                    ([va] if pb.rg else []) + ([pb] if va.rg else []), (Grad(1), Grad(0)))
        ops.drop(va, pb, kr, vr, q, k, v)
        return out

    def _mm_operand(self, x: Storage, copy: bool) -> Storage:
        """matmul's reshape of a 4-D operand: a view, or a contiguous copy whose backward passes the
        gradient through."""
        if not copy:
            return self.ops.ref(x)
        c = self.ops.new(x.numel, x.dtype)
        self.engine.node(c, [(x, 0)])
        return c

    def mlp(self, mods: dict, x: Storage, rows: int) -> Storage:
        ops = self.ops
        if "gate_up_proj" in mods:  # Phi3MLP: gate_up_proj(x).chunk(2); down(up * act(gate))
            gu = self.linear(mods["gate_up_proj"], x, rows)
            gate, up = self.chunk2(gu)
            ops.drop(gu)
            a = self.act(gate)
            m = ops.mul(up, a)
            ops.drop(a)
            y = self.linear(mods["down_proj"], m, rows)
            ops.drop(m, gate, up)
            return y
        if self.spec.mlp_kind is MlpKind.GATED:
            g = self.linear(mods["gate_proj"], x, rows)
            a = self.act(g)
            ops.drop(g)
            u = self.linear(mods["up_proj"], x, rows)
            m = ops.mul(a, u)
            ops.drop(a, u)
        else:
            u = self.linear(mods["up_proj"], x, rows)
            m = self.act(u)
            ops.drop(u)
        y = self.linear(mods["down_proj"], m, rows)
        ops.drop(m)
        return y

    def act(self, x: Storage) -> Storage:
        """The MLP's activation: one op saving its input (ReLU its output), or transformers' NewGELUActivation
        op by op, ``0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0))))``, which keeps four
        tensors of ``x``'s size for backward (``x``, the tanh, ``0.5 * x`` and ``1 + tanh``)."""
        ops = self.ops
        act = self.spec.activation
        if act is not Activation.GELU_NEW:
            relu = act is Activation.RELU
            return ops.unary(x, save_input=not relu, save_output=relu)
        half = ops.unary(x)
        xb = ops.gbytes(x)
        p = ops.new(x.numel, x.dtype)  # pow saves its input; backward: x.pow(2), times 3, then the gradient
        self.engine.node(p, [(x, xb)], [x], (Temp(0, xb), Temp(0, xb), Grad(0), FreeTemp(0), FreeTemp(0)))
        b = ops.unary(p)
        ops.drop(p)
        c = ops.add(x, b)
        ops.drop(b)
        d = ops.unary(c)
        ops.drop(c)
        t = ops.unary(d, save_output=True)
        ops.drop(d)
        e = ops.unary(t)
        ops.drop(t)
        out = ops.mul(half, e)
        ops.drop(half, e)
        return out

    def dense_mlp(self, mods: dict, x: Storage, rows: int) -> Storage:
        """Mlp.forward: the MLP, then its output dropout (GPT2MLP's; an expert has none)."""
        y = self.mlp(mods, x, rows)
        if not self.spec.resid_dropout:
            return y
        out = self.dropout(y, self.spec.resid_dropout)
        self.ops.drop(y)
        return out

    def dropout(self, x: Storage, p: float) -> Storage:
        """``nn.Dropout`` in training as CUDA's fused kernel runs it: the output and a 1-byte mask that backward
        keeps (``x`` is not kept). A new reference to ``x`` when it does nothing."""
        ops = self.ops
        if not (p > 0 and self.training):
            return ops.ref(x)
        out = ops.new(x.numel, x.dtype)
        mask = ops.new(x.numel, "bool")
        self.engine.node(out, [(x, ops.gbytes(x))], [mask])
        ops.drop(mask)
        return out

    def chunk2(self, x: Storage) -> tuple[Storage, Storage]:
        """``x.chunk(2, dim=-1)``: one SplitBackward node gathering both halves' gradients (zeros for a half
        that got none) into ``x``'s full gradient."""
        first, second = self.ops.gathering_views(x, [x.numel // 2, x.numel // 2])
        return first, second

    def moe(self, L: dict, x: Storage, d: Dims) -> Storage:
        """Experts.forward with the builder's fixed balanced routing; locals live as in the builder."""
        spec, ops, engine = self.spec, self.ops, self.engine
        T, h, E, k = d.T, spec.hidden_size, spec.num_experts, spec.experts_per_token
        logits = self.linear(L["router"], x, T)
        l32 = ops.cast(logits, "f32")  # softmax(dtype=float): a cast node, then _softmax saving its output
        w = ops.new(T * E, "f32")
        engine.node(w, [(l32, ops.gbytes(l32))], [w])
        ops.drop(l32)
        topv = ops.new(T * k, "f32")
        idx = ops.new(T * k, "i64")
        engine.node(topv, [(w, ops.gbytes(w))], [idx])  # topk saves the indices; backward scatters into zeros
        ops.drop(w)
        ssum = ops.new(T, "f32")
        engine.node(ssum, [(topv, 0)])
        nw = ops.new(T * k, "f32")
        engine.node(nw, [(topv, ops.gbytes(topv)), (ssum, ops.gbytes(ssum))], [ssum, topv],
                    (Temp(1, T * k * 4), Grad(1), FreeTemp(1), Grad(0)))
        ops.drop(topv, ssum)
        wc = ops.cast(nw, x.dtype)
        ops.drop(nw)
        out = ops.new(T * h, x.dtype)
        slots = ops.new(T * k, "i64")
        counts = [len(range(ei, T * k, E)) for ei in range(E)]
        tokens = xe = y = sel = None
        for ei, experts in enumerate(L["experts"]):
            c = counts[ei]
            if c == 0:
                continue
            s_new = engine.view(slots, c)  # slots[e::E]
            ops.drop(sel)
            sel = s_new
            t_new = ops.new(c, "i64")
            ops.drop(tokens)
            tokens = t_new
            x_new = ops.new(c * h, x.dtype)  # x2[tokens]: index saves the indices
            # backward: new_zeros(x2) then an out-of-place index_put
            engine.node(x_new, [(x, ops.gbytes(x))], [tokens], (Temp(0, ops.gbytes(x)), Grad(0), FreeTemp(0)))
            ops.drop(xe)
            xe = x_new
            m = self.mlp(experts, xe, c)
            gw = ops.new(c, wc.dtype)  # flat_w[sel, None]: saves the index, a view keeping slots alive
            engine.node(gw, [(wc, ops.gbytes(wc))], [sel], (Temp(0, ops.gbytes(wc)), Grad(0), FreeTemp(0)))
            y_new = ops.mul(m, gw)
            ops.drop(m, gw, y)
            y = y_new
            new_out = engine.view(out)  # index_add_ in place: a new autograd node on the same storage
            # IndexAddBackward saves the index and the source (its gradient is expand_as(source))
            engine.node(new_out, [(out, 0), (y, ops.gbytes(y))], [tokens, y] if y.rg else [tokens])
            ops.drop(out)
            out = new_out
        if L["shared"]:
            sh = L["shared"]
            gl = self.linear(sh["shared_expert_gate"], x, T)
            g = ops.unary(gl, save_output=True)
            ops.drop(gl)
            gp = self.linear(sh["shared_gate_proj"], x, T)
            a = ops.unary(gp, save_input=True)
            ops.drop(gp)
            up = self.linear(sh["shared_up_proj"], x, T)
            m = ops.mul(a, up)
            ops.drop(a, up)
            hs = self.linear(sh["shared_down_proj"], m, T)
            ops.drop(m)
            gh = ops.mul(g, hs)
            ops.drop(g, hs)
            o2 = ops.add(out, gh)
            ops.drop(gh, out)
            out = o2
        ops.drop(logits, wc, idx, slots, sel, tokens, xe, y)
        return out

    def layer(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        spec, ops = self.spec, self.ops
        T = d.T
        hid = spec.hidden_size
        if spec.parallel_block:
            h = self.norm(L["in_norm"], x, T, hid)
            a = self.attention(L, h, d, cos, sin, mask)
            m = self.dense_mlp(L["mlp"], h, T) if not spec.is_moe else self.moe(L, h, d)
            s = ops.add(a, m)
            ops.drop(a, m)
            out = ops.add(s, x)
            ops.drop(s, h)
            return out
        # ``hidden_states = residual + hidden_states``: each block's output goes at its add
        h = self.norm(L["in_norm"], x, T, hid)
        h2 = self.attention(L, h, d, cos, sin, mask)
        ops.drop(h)
        h = h2
        if spec.norms_per_layer == 4:
            h2 = self.norm(L["post_norm"], h, T, hid)
            ops.drop(h)
            x1 = ops.add(x, h2)
            ops.drop(h2)
            n = self.norm(L["pre_ffn"], x1, T, hid)
            m = self._ffn(L, n, d)
            ops.drop(n)
            f = self.norm(L["post_ffn"], m, T, hid)
            ops.drop(m)
            out = ops.add(x1, f)
            ops.drop(f, x1)
            return out
        x1 = ops.add(x, h)
        ops.drop(h)
        n = self.norm(L["post_norm"], x1, T, hid)
        h2 = self._ffn(L, n, d)
        ops.drop(n)
        out = ops.add(x1, h2)
        ops.drop(x1, h2)
        return out

    def _ffn(self, L: dict, x: Storage, d: Dims) -> Storage:
        return self.moe(L, x, d) if self.spec.is_moe else self.dense_mlp(L["mlp"], x, d.T)


# ---- helpers ---------------------------------------------------------------------------------------------------

class _region:
    def __init__(self, engine: Engine, kind: Kind) -> None:
        self.engine, self.kind = engine, kind

    def __enter__(self) -> None:
        self.old = self.engine.region
        self.engine.region = self.kind

    def __exit__(self, *a: object) -> None:
        self.engine.region = self.old


def _const(ops: Ops) -> Storage:
    h = Storage(0, Kind.TEMPORARIES, False)
    h.numel, h.dtype = 1, "f32"
    return h
