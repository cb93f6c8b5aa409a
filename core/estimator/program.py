"""The training step as a program over the symbolic engine, mirroring ``core/measure/model.py``.

Each function here follows the corresponding module of the builder line by line — the same tensors
allocated in the same order, the same Python variables going out of scope at the same points — because
the transient peaks inside a layer depend on exactly that. Sizes come from the :class:`ModelSpec`;
nothing here touches torch.

Layers of the same kind are identical, so the driver evaluates one layer of each kind on the engine and
repeats its net effect arithmetically (see :mod:`.driver`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kinds import Kind
from ..spec import (
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
from .engine import DTYPE_SIZE, Buf, Engine, FreeTemp, Grad, Storage, Temp
from .ops import Ops
from .poly import Poly
from .shard import ShardModel

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

    __slots__ = ("shape", "w", "q", "bias", "A", "B", "lora")

    def __init__(self, shape: LinearShape) -> None:
        self.shape = shape
        self.w: Storage | None = None
        self.q: list[Storage] = []
        self.bias: Storage | None = None
        self.A: Storage | None = None
        self.B: Storage | None = None
        self.lora = False


class Model:
    """The parameters (handles) and the forward program of the decoder."""

    def __init__(self, spec: ModelSpec, setup: TrainingSetup, e: Engine, rank: Poly | int | None = None,
                 plan: list[int] | None = None) -> None:
        """``plan``: the layer indices to replay (all by default; the driver passes a reduced plan whose
        repeated layers the tape multiplies). ``rank``: the LoRA rank (a polynomial for symbolic tapes)."""
        self.spec, self.setup, self.e = spec, setup, e
        self.o = Ops(e)
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
            self.sh = ShardModel(setup, e, self.o, self.cdt, mixed, reduce)

    # ---- load ---------------------------------------------------------------------------------------------
    def _p(self, numel: int, dtype: str, trainable: bool, rows: int = 0, cols: int = 0) -> Storage:
        if self.sh is not None and self.sh.params_sharded:
            h = self.sh.param(numel, dtype, trainable)
        else:
            h = self.o.param(numel, dtype, Kind.WEIGHTS, trainable)
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
            lin.A = self._p(r * in_f, self.adt, True, r, in_f)
            lin.B = self._p(out_f * r, self.adt, True, out_f, r)
            self.adapters += [lin.A, lin.B]
        return lin

    def _quantize(self, n: int, rows: int) -> list[Storage]:
        """QuantWeight.__init__: a bf16 copy, then packed codes and scales (and double quantization)."""
        o = self.o
        full = o.new(n, "bf16", Kind.TEMPORARIES)
        if self.sh is not None and self.sh.params_sharded:
            # quantized on the host side of the shard, then sharded buffer by buffer
            o.drop(full)
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
            q = o.param(n, "i8", Kind.WEIGHTS, False)
            scb = o.param(rows, "f32", Kind.WEIGHTS, False)
            o.drop(full)
            return [q, scb]
        packed = o.param(n // 2, "u8", Kind.WEIGHTS, False)
        absmax_n = n // NF4_BLOCK
        absmax = o.new(absmax_n, "f32", Kind.WEIGHTS)
        o.drop(full)
        code = o.param(16, "f32", Kind.WEIGHTS, False)
        out = [packed, code]
        if self.setup.double_quant:
            nb = (absmax_n + DQ_BLOCK - 1) // DQ_BLOCK
            out += [o.param(absmax_n, "u8", Kind.WEIGHTS, False), o.param(nb, "f32", Kind.WEIGHTS, False),
                    o.param(1, "f32", Kind.WEIGHTS, False)]
            o.drop(absmax)
        else:
            absmax.param = True
            out.append(absmax)
        return out

    def load(self) -> None:
        spec, o = self.spec, self.o
        h = spec.hidden_size
        train_embed = self.setup.method is Method.FULL
        self.embed = self._p(spec.vocab_size * h, self.pdt, train_embed, spec.vocab_size, h)
        self.pos = self._p(spec.max_position_embeddings * h, self.pdt, train_embed,
                           spec.max_position_embeddings, h) \
            if spec.learned_positions else None
        self.layers = []
        for tag, i in enumerate(self.plan):
            self.e.tag = tag
            self.layers.append(self._layer(i))
        self.e.tag = -1
        if self.sh is not None:
            self.sh.unit_index = -1
        train_head = self.train_base
        self.final_norm = self._norm(train_head)
        tied = self.embed if spec.tie_embeddings else None
        if tied is not None and train_head and not train_embed:
            train_head = False
        head = LinearShape("lm_head", spec.vocab_size, h, spec.lm_head_bias)
        self.head = self._linear(head, train_head, "lm_head" in self.targets, tied)
        # inv_freq: arange(int64) -> float -> t / dim -> 10000 ** x -> 1 / x
        half = spec.rope_dim // 2
        t = o.new(half, "i64")
        tf = o.new(half, "f32")
        o.drop(t)
        x = o.new(half, "f32")
        p = o.new(half, "f32")
        o.drop(x)
        r = o.new(half, "f32")  # 1.0 / p is reciprocal() * 1.0
        self.inv_freq = o.new(half, "f32")
        self.inv_freq.param = True
        o.drop(r, p, tf)

    def _norm(self, trainable: bool, dim: int | None = None) -> list[Storage]:
        dim = dim or self.spec.hidden_size
        if self.spec.norm_kind is NormKind.LAYERNORM:
            return [self._p(dim, self.pdt, trainable), self._p(dim, self.pdt, trainable)]
        return [self._p(dim, self.pdt, trainable)]

    def _layer(self, i: int) -> dict:
        spec = self.spec
        if self.sh is not None:
            self.sh.unit_index = self.e.tag
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
        """_amp_cast: fp32 operands become compute-dtype copies; weight copies are AMP copies."""
        if x.dtype == self.cdt or not x.dtype.startswith(("f", "b")):
            return self.o.ref(x)
        if weight:
            self.e.region, old = Kind.AMP_COPIES, self.e.region
            try:
                return self.o.cast(x, self.cdt)
            finally:
                self.e.region = old
        return self.o.cast(x, self.cdt)

    def amp_linear(self, x: Storage, w: Storage, bias: Storage | None, rows: int, out_f: int, in_f: int,
                   contiguous: bool = True) -> Storage:
        o = self.o
        if self.amp:
            xc = self.amp_cast(x)
            wc = self.amp_cast(w, True)
            bc = self.amp_cast(bias, True) if bias is not None else None
            y = o.linear(xc, wc, bc, rows, out_f, in_f, contiguous or xc is not x)
            o.drop(xc, wc, bc)
            return y
        return o.linear(x, w, bias, rows, out_f, in_f, contiguous)

    def dequant(self, lin: Lin, dtype: str) -> tuple[list[int], int]:
        """Temporaries of QuantWeight.dequantize: (the absmax fp32 buffer or none, the full weight)."""
        n = lin.shape.out_features * lin.shape.in_features
        extra = []
        if self.quant == "nf4" and self.setup.double_quant:
            extra = [(n // NF4_BLOCK) * 4]
        return extra, n * DTYPE_SIZE[dtype]

    def linear(self, lin: Lin, x: Storage, rows: int, contiguous: bool = True) -> Storage:
        """Linear.forward: the base layer, then peft's LoRA branch."""
        o, e = self.o, self.e
        out_f, in_f = lin.shape.out_features, lin.shape.in_features
        if lin.q:
            # bitsandbytes Linear4bit: input and bias to the compute dtype, output back to the input dtype
            xc = o.cast(x, self.cdt)
            bc = o.cast(lin.bias, self.cdt) if lin.bias is not None else None
            extra, wbytes = self.dequant(lin, self.cdt)
            with _region(e, Kind.TEMPORARIES):
                ex = [e.alloc(b) for b in extra]
                w = e.alloc(wbytes)
                for t in ex:
                    e.drop(t)
            result = o.new(rows * out_f, self.cdt)
            e.drop(w)
            # backward dequantizes again: absmax buffer, weight, free absmax, grad_x, free weight
            prog = [Temp(0, b) for b in extra] + [Temp(0, wbytes)]
            if extra:
                prog.append(FreeTemp(0))
            prog += [Grad(0), FreeTemp(0)]
            edges = [(xc, o.gbytes(xc))]
            if bc is not None:
                edges.append((bc, o.gbytes(bc)))
                prog.append(Grad(1))
            e.node(result, edges, (), tuple(prog))
            o.drop(xc, bc)
            if result.dtype != x.dtype:
                r2 = o.cast(result, x.dtype)
                o.drop(result)
                result = r2
        else:
            result = self.amp_linear(x, lin.w, lin.bias, rows, out_f, in_f, contiguous)
        if not lin.lora:
            return result
        r = self.r
        rdt = result.dtype
        xa = o.cast(x, self.adt)
        if self.setup.lora_dropout > 0:
            d = o.new(xa.numel, xa.dtype)
            mask = o.new(xa.numel, "bool")
            e.node(d, [(xa, o.gbytes(xa))], [mask])
            o.drop(mask, xa)
            xa = d
        a = self.amp_linear(xa, lin.A, None, rows, r, in_f)
        b = self.amp_linear(a, lin.B, None, rows, out_f, r)
        t = o.unary(b)
        s = o.add(result, t)
        o.drop(t, result)
        out = o.cast(s, rdt)
        o.drop(s, xa, a, b)
        return out

    def norm(self, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
        o = self.o
        if self.spec.norm_kind is NormKind.LAYERNORM:
            xin = o.cast(x, "f32") if self.amp and x.dtype != "f32" else o.ref(x)
            out = o.new(rows * dim, xin.dtype)
            stat = xin.dtype if self.e.match_simulation else "f32"  # CUDA keeps fp32 statistics
            mean = o.new(rows, stat)
            rstd = o.new(rows, stat)
            edges = [(xin, o.gbytes(xin)), (ws[0], o.gbytes(ws[0])), (ws[1], o.gbytes(ws[1]))]
            if self.e.node(out, edges, [xin, mean, rstd]):
                pass
            o.drop(mean, rstd, xin)
            return out
        dtype = x.dtype
        h = o.cast(x, "f32")
        # pow(2): saves h; backward makes two temporaries and the gradient
        p = o.new(h.numel, "f32")
        hb = o.gbytes(h)
        self.e.node(p, [(h, hb)], [h], (Temp(0, hb), Temp(0, hb), Grad(0), FreeTemp(0), FreeTemp(0)))
        var = o.new(rows, "f32")  # mean(-1, keepdim): backward expands to full size
        self.e.node(var, [(p, o.gbytes(p))])
        o.drop(p)
        a = o.add(var, _const(o))
        rs = o.new(rows, "f32")  # rsqrt saves its result; backward: two temporaries and the gradient
        rb = o.gbytes(rs)
        self.e.node(rs, [(a, rb)], [rs], (Temp(0, rb), Temp(0, rb), Grad(0), FreeTemp(0), FreeTemp(0)))
        o.drop(a)
        n = o.mul(h, rs)
        o.drop(rs, h)
        c = o.cast(n, dtype)
        out = o.mul(ws[0], c)
        o.drop(c, n, var)
        return out

    def attention(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        spec, o = self.spec, self.o
        T = d.T
        A = L["attn"]
        eager = self.setup.attention is Attention.EAGER
        if spec.fused_qkv:  # Phi3Attention: qkv_proj, sliced; each slice's backward makes a full-size zeros
            qkv = self.linear(A["qkv_proj"], x, T)
            q = self.head_view(self._slice(qkv, T * spec.q_dim), eager)
            k = self.head_view(self._slice(qkv, T * spec.kv_dim), eager)
            v = self.head_view(self._slice(qkv, T * spec.kv_dim), eager)
            o.drop(qkv)
        else:
            q = self.head_view(self.linear(A["q_proj"], x, T), eager)
            k = self.head_view(self.linear(A["k_proj"], x, T), eager)
            v = self.head_view(self.linear(A["v_proj"], x, T), eager)
        if spec.qk_norm:
            q2 = self.norm(L["q_norm"], q, T * spec.num_heads, spec.head_dim)
            o.drop(q)
            k2 = self.norm(L["k_norm"], k, T * spec.num_kv_heads, spec.head_dim)
            o.drop(k)
            q, k = q2, k2
        if spec.rope_pass_cat:
            q2, k2 = self.rope_pass_cat(q, k, cos, sin)
        else:
            q2 = self.rope(q, cos, sin)
            k2 = self.rope(k, cos, sin)
        o.drop(q, k)
        q, k = q2, k2
        if self.setup.attention is Attention.SDPA:
            if mask is not None:  # sliding window: HF repeats k and v instead of SDPA's enable_gqa
                k, v = self.repeat_kv(k), self.repeat_kv(v)
            if self.amp:
                q2, k2, v2 = self.amp_cast(q), self.amp_cast(k), self.amp_cast(v)
                o.drop(q, k, v)
                q, k, v = q2, k2, v2
            saved = [q, k, v]
            if mask is not None:  # SDPA turns the boolean mask into an additive one in q's dtype and saves it
                saved.append(o.new(d.b * d.s * d.s, q.dtype))
            out = o.new(T * spec.q_dim, q.dtype)
            lse = o.new(d.b * spec.num_heads * d.s, "f32")
            self.e.node(out, [(q, o.gbytes(q)), (k, o.gbytes(k)), (v, o.gbytes(v))], [*saved, out, lse])
            o.drop(lse, *saved[3:])
            if spec.rope_pass_cat:
                # the flash kernels allocate their output like q (empty_like); q concatenated by RoPE is laid
                # out (b, heads, s, d), so transpose(1, 2).contiguous() copies (and o_proj may save the copy)
                c = o.new(out.numel, out.dtype)
                self.e.node(c, [(out, 0)])
                o.drop(out)
                out = c
        else:
            att = self.eager(q, k, v, d, mask)
            out = o.new(att.numel, att.dtype)  # transpose(1, 2).contiguous() copies matmul's output
            self.e.node(out, [(att, 0)])
            o.drop(att)
        y = self.linear(A["o_proj"], out, T)
        o.drop(out, q, k, v)  # SelfAttention.forward's locals live until it returns
        return y

    def repeat_kv(self, x: Storage) -> Storage:
        """HF repeat_kv (the caller's name moves to the result): expand + reshape copies, except for one kv
        head, where the reshape is a view; backward sums the expanded gradient."""
        o, e = self.o, self.e
        rep = self.spec.num_heads // self.spec.num_kv_heads
        if rep == 1:
            return x
        if self.spec.num_kv_heads == 1:
            r = e.view(x, x.numel * rep)
        else:
            r = o.new(x.numel * rep, x.dtype)
        e.node(r, [(x, o.gbytes(x))])
        o.drop(x)
        return r

    def head_view(self, y: Storage, copy_grad: bool) -> Storage:
        """``proj(x).view(b, s, heads, hd)``: in backward the view reshapes the incoming gradient, which
        copies when that gradient arrives transposed (eager attention's matmuls produce it so)."""
        v = self.e.view(y)
        self.e.node(v, [(y, self.o.gbytes(y) if copy_grad else 0)])
        self.o.drop(y)
        return v

    def _slice(self, x: Storage, numel: Poly | int) -> Storage:
        """``x[..., a:b]``: a view whose backward (slice_backward) allocates zeros of ``x``'s full size."""
        v = self.e.view(x, numel)
        self.e.node(v, [(x, self.o.gbytes(x))])
        return v

    def rope_pass_cat(self, q: Storage, k: Storage, cos: Storage, sin: Storage) -> tuple[Storage, Storage]:
        """HF Phi3 apply_rotary_pos_emb: q[..., :rd] and the (here empty) q[..., rd:] sliced for q and k, each
        rotated part concatenated with its pass-through part (a copy; cat's backward passes views)."""
        o, e = self.o, self.e
        hd, rd = self.spec.head_dim, self.spec.rope_dim
        parts = [(self._slice(t, t.numel // hd * rd), self._slice(t, t.numel // hd * (hd - rd))) for t in (q, k)]
        out = []
        for (rot, keep), t in zip(parts, (q, k)):
            r = self.rope(rot, cos, sin)
            c = o.new(t.numel, t.dtype)
            e.node(c, [(r, 0), (keep, 0)])
            o.drop(r)
            out.append(c)
        for rot, keep in parts:
            o.drop(rot, keep)
        return out[0], out[1]

    def rope(self, q: Storage, cos: Storage, sin: Storage) -> Storage:
        """(q * cos) + (rotate_half(q) * sin): slices' backward allocates full-size zeros."""
        o = self.o
        t1 = o.mul(q, cos)
        half = q.numel // 2
        # slices: views whose backward allocates a zero tensor of q's size
        s1 = self.e.view(q, half)
        self.e.node(s1, [(q, o.gbytes(q))])
        s2 = self.e.view(q, half)
        self.e.node(s2, [(q, o.gbytes(q))])
        neg = o.unary(s2, numel=half)
        cat = o.new(q.numel, q.dtype)
        self.e.node(cat, [(neg, 0), (s1, 0)])
        o.drop(neg, s1, s2)
        t2 = o.mul(cat, sin)
        o.drop(cat)
        out = o.add(t1, t2)
        o.drop(t1, t2)
        return out

    def eager(self, q: Storage, k: Storage, v: Storage, d: Dims, mask: Storage | None) -> Storage:
        spec, o, e = self.spec, self.o, self.e
        # _eager's own locals: the caller's q, k, v stay referenced until SelfAttention.forward returns
        if self.amp:
            q, k, v = self.amp_cast(q), self.amp_cast(k), self.amp_cast(v)
        else:
            q, k, v = o.ref(q), o.ref(k), o.ref(v)
        rep = spec.num_heads // spec.num_kv_heads
        if rep > 1 and spec.num_kv_heads == 1:  # MQA: the reshape of the expand is a view (stride 0)
            kr = e.view(k, k.numel * rep)
            e.node(kr, [(k, o.gbytes(k))])
            vr = e.view(v, v.numel * rep)
            e.node(vr, [(v, o.gbytes(v))])
        elif rep > 1:  # repeat_kv: expand + reshape copies; backward sums the expanded gradient
            kr = o.new(k.numel * rep, k.dtype)
            e.node(kr, [(k, o.gbytes(k))])
            o.drop(k)  # k = repeat_kv(k): the name moves to the copy
            k = None
            vr = o.new(v.numel * rep, v.dtype)
            e.node(vr, [(v, o.gbytes(v))])
            o.drop(v)
            v = None
        else:
            kr, vr = o.ref(k), o.ref(v)
        nsc = d.b * spec.num_heads * d.s * d.s
        mqa = rep > 1 and spec.num_kv_heads == 1
        # matmul folds 4-D operands to 3-D: q (RoPE output, laid out b,s,h,d) and an expanded MQA key or
        # value need a copy when the batch is larger than 1; bmm then saves the copies
        qa = self._mm_operand(q, d.multi)
        ka = self._mm_operand(kr, d.multi and mqa)
        sc = o.new(nsc, q.dtype)
        # bmm saves each operand for the other's gradient; backward computes mat2's gradient first
        e.node(sc, [(qa, o.gbytes(qa)), (ka, o.gbytes(ka))], ([ka] if qa.rg else []) + ([qa] if ka.rg else []),
               (Grad(1), Grad(0)))
        o.drop(qa, ka)
        w = o.unary(sc, numel=nsc)
        o.drop(sc)
        cap = spec.attn_logit_softcap
        if cap:
            w2 = o.unary(w)
            o.drop(w)
            w3 = o.unary(w2, save_output=True)
            o.drop(w2)
            w = o.unary(w3)
            o.drop(w3)
        if mask is not None:
            w2 = o.add(w, mask, nsc)
            o.drop(w)
            w = w2
        # softmax(dtype=fp32): a cast node, then _softmax (saves its output)
        w32 = o.cast(w, "f32")
        sm = o.new(nsc, "f32")
        e.node(sm, [(w32, o.gbytes(w32))], [sm])
        o.drop(w32)
        pb = o.cast(sm, q.dtype)
        o.drop(sm, w)
        va = self._mm_operand(vr, d.multi and mqa)
        out = o.new(q.numel, q.dtype)
        e.node(out, [(pb, o.gbytes(pb)), (va, o.gbytes(va))], ([va] if pb.rg else []) + ([pb] if va.rg else []),
               (Grad(1), Grad(0)))
        o.drop(va, pb, kr, vr, q, k, v)
        return out

    def _mm_operand(self, x: Storage, copy: bool) -> Storage:
        """matmul's reshape of a 4-D operand: a view, or a contiguous copy whose backward passes the
        gradient through."""
        if not copy:
            return self.o.ref(x)
        c = self.o.new(x.numel, x.dtype)
        self.e.node(c, [(x, 0)])
        return c

    def mlp(self, mods: dict, x: Storage, rows: int) -> Storage:
        o = self.o
        act = self.spec.activation
        relu = act is Activation.RELU
        if "gate_up_proj" in mods:  # Phi3MLP: gate_up_proj(x).chunk(2); down(up * act(gate))
            gu = self.linear(mods["gate_up_proj"], x, rows)
            gate, up = self._chunk2(gu)
            o.drop(gu)
            a = o.unary(gate, save_input=not relu, save_output=relu)
            m = o.mul(up, a)
            o.drop(a)
            y = self.linear(mods["down_proj"], m, rows)
            o.drop(m, gate, up)
            return y
        if self.spec.mlp_kind is MlpKind.GATED:
            g = self.linear(mods["gate_proj"], x, rows)
            a = o.unary(g, save_input=not relu, save_output=relu)
            o.drop(g)
            u = self.linear(mods["up_proj"], x, rows)
            m = o.mul(a, u)
            o.drop(a, u)
        else:
            u = self.linear(mods["up_proj"], x, rows)
            m = o.unary(u, save_input=not relu, save_output=relu)
            o.drop(u)
        y = self.linear(mods["down_proj"], m, rows)
        o.drop(m)
        return y

    def _chunk2(self, x: Storage) -> tuple[Storage, Storage]:
        """``x.chunk(2, dim=-1)``: one SplitBackward node; once both halves' gradients arrived it allocates
        ``x``'s full gradient (a cat, zeros for a half that got none)."""
        e, o = self.e, self.o
        halves = [e.view(x, x.numel // 2), e.view(x, x.numel // 2)]

        def split_backward(engine: Engine, node, buf) -> None:  # noqa: ANN001
            grads = [h.gbuf for h in halves if h.gbuf is not None]
            for h in halves:
                h.gbuf = None
            for t in node.saved:
                engine.drop(t)
            if not grads:
                return
            g = engine.alloc(o.gbytes(x))
            for b in grads:
                engine._release_buf(b)
            engine.deliver(x, Buf(g))

        split_backward.gathers = True
        marker = e.view(x)
        e.node(marker, [(x, 0)], special=split_backward)
        o.drop(marker)
        return halves[0], halves[1]

    def moe(self, L: dict, x: Storage, d: Dims) -> Storage:
        """Experts.forward with the builder's fixed balanced routing; locals live as in the builder."""
        spec, o, e = self.spec, self.o, self.e
        T, h, E, k = d.T, spec.hidden_size, spec.num_experts, spec.experts_per_token
        logits = self.linear(L["router"], x, T)
        l32 = o.cast(logits, "f32")  # softmax(dtype=float): a cast node, then _softmax saving its output
        w = o.new(T * E, "f32")
        e.node(w, [(l32, o.gbytes(l32))], [w])
        o.drop(l32)
        topv = o.new(T * k, "f32")
        idx = o.new(T * k, "i64")
        e.node(topv, [(w, o.gbytes(w))], [idx])  # topk saves the indices; backward scatters into zeros
        o.drop(w)
        ssum = o.new(T, "f32")
        e.node(ssum, [(topv, 0)])
        nw = o.new(T * k, "f32")
        e.node(nw, [(topv, o.gbytes(topv)), (ssum, o.gbytes(ssum))], [ssum, topv],
               (Temp(1, T * k * 4), Grad(1), FreeTemp(1), Grad(0)))
        o.drop(topv, ssum)
        wc = o.cast(nw, x.dtype)
        o.drop(nw)
        out = o.new(T * h, x.dtype)
        slots = o.new(T * k, "i64")
        counts = [len(range(ei, T * k, E)) for ei in range(E)]
        tokens = xe = y = sel = None
        for ei, experts in enumerate(L["experts"]):
            c = counts[ei]
            if c == 0:
                continue
            s_new = e.view(slots, c)  # slots[e::E]
            o.drop(sel)
            sel = s_new
            t_new = o.new(c, "i64")
            o.drop(tokens)
            tokens = t_new
            x_new = o.new(c * h, x.dtype)  # x2[tokens]: index saves the indices
            # backward: new_zeros(x2) then an out-of-place index_put
            e.node(x_new, [(x, o.gbytes(x))], [tokens], (Temp(0, o.gbytes(x)), Grad(0), FreeTemp(0)))
            o.drop(xe)
            xe = x_new
            m = self.mlp(experts, xe, c)
            gw = o.new(c, wc.dtype)  # flat_w[sel, None]: saves the index, a view keeping slots alive
            e.node(gw, [(wc, o.gbytes(wc))], [sel], (Temp(0, o.gbytes(wc)), Grad(0), FreeTemp(0)))
            y_new = o.mul(m, gw)
            o.drop(m, gw, y)
            y = y_new
            new_out = e.view(out)  # index_add_ in place: a new autograd node on the same storage
            # IndexAddBackward saves the index and the source (its gradient is expand_as(source))
            e.node(new_out, [(out, 0), (y, o.gbytes(y))], [tokens, y] if y.rg else [tokens])
            o.drop(out)
            out = new_out
        if L["shared"]:
            sh = L["shared"]
            gl = self.linear(sh["shared_expert_gate"], x, T)
            g = o.unary(gl, save_output=True)
            o.drop(gl)
            gp = self.linear(sh["shared_gate_proj"], x, T)
            a = o.unary(gp, save_input=True)
            o.drop(gp)
            up = self.linear(sh["shared_up_proj"], x, T)
            m = o.mul(a, up)
            o.drop(a, up)
            hs = self.linear(sh["shared_down_proj"], m, T)
            o.drop(m)
            gh = o.mul(g, hs)
            o.drop(g, hs)
            o2 = o.add(out, gh)
            o.drop(gh, out)
            out = o2
        o.drop(logits, wc, idx, slots, sel, tokens, xe, y)
        return out

    def layer(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        spec, o = self.spec, self.o
        T = d.T
        hid = spec.hidden_size
        if spec.parallel_block:
            h = self.norm(L["in_norm"], x, T, hid)
            a = self.attention(L, h, d, cos, sin, mask)
            m = self.mlp(L["mlp"], h, T) if not spec.is_moe else self.moe(L, h, d)
            s = o.add(a, m)
            o.drop(a, m)
            out = o.add(s, x)
            o.drop(s, h)
            return out
        h = self.norm(L["in_norm"], x, T, hid)
        h2 = self.attention(L, h, d, cos, sin, mask)
        o.drop(h)
        h = h2
        if spec.norms_per_layer == 4:
            h2 = self.norm(L["post_norm"], h, T, hid)
            o.drop(h)
            h = h2
            x1 = o.add(x, h)
            n = self.norm(L["pre_ffn"], x1, T, hid)
            h2 = self._ffn(L, n, d)
            o.drop(n, h)
            h = h2
            f = self.norm(L["post_ffn"], h, T, hid)
            out = o.add(x1, f)
            o.drop(f, x1, h)
            return out
        x1 = o.add(x, h)
        n = self.norm(L["post_norm"], x1, T, hid)
        h2 = self._ffn(L, n, d)
        o.drop(n, h)
        out = o.add(x1, h2)
        o.drop(x1, h2)
        return out

    def _ffn(self, L: dict, x: Storage, d: Dims) -> Storage:
        return self.moe(L, x, d) if self.spec.is_moe else self.mlp(L["mlp"], x, d.T)


# ---- helpers ---------------------------------------------------------------------------------------------------

class _region:
    def __init__(self, e: Engine, kind: Kind) -> None:
        self.e, self.kind = e, kind

    def __enter__(self) -> None:
        self.old = self.e.region
        self.e.region = self.kind

    def __exit__(self, *a: object) -> None:
        self.e.region = self.old


def _const(o: Ops) -> Storage:
    h = Storage(0, Kind.TEMPORARIES, False)
    h.numel, h.dtype = 1, "f32"
    return h


def sqrt_hidden(spec: ModelSpec) -> float:
    return math.sqrt(spec.hidden_size)
