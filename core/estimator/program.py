"""The training step as a program over the symbolic engine, mirroring ``core/simulation/model.py``.

Each function here follows the corresponding module of the builder line by line — the same tensors
allocated in the same order, the same Python variables going out of scope at the same points — because
the transient peaks inside a layer depend on exactly that. Sizes come from the :class:`ModelSpec`;
nothing here touches torch.

Layers of the same kind are identical, so the driver evaluates one layer of each kind on the engine and
repeats its net effect arithmetically (see :mod:`.driver`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from vramlab.core.estimator import liger, unsloth
from vramlab.core.estimator.attention import SelfAttention
from vramlab.core.estimator.engine import Engine, FreeTemp, Grad, Storage, Temp
from vramlab.core.estimator.linear import LinearLayers
from vramlab.core.estimator.moe import MoeBlock
from vramlab.core.estimator.ops import Ops
from vramlab.core.estimator.poly import Poly
from vramlab.core.estimator.shard import ShardModel, boundary
from vramlab.core.kinds import Kind
from vramlab.core.sdpa import MATH, tape_kernel
from vramlab.core.spec.hub_kernels import kernel_patch, rope_runs
from vramlab.core.spec.model import Activation, LinearShape, MlpKind, ModelSpec, NormKind
from vramlab.core.spec.options import DType, Method, Sharding
from vramlab.core.spec.sharded_precision import mixed_reduce_dtype
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import unsloth_patch

DT = {DType.FP32: "f32", DType.BF16: "bf16", DType.FP16: "f16"}


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


class Model(LinearLayers, SelfAttention, MoeBlock):
    """The parameters (handles) and the forward program of the decoder: the linear layers
    (:mod:`.linear`) and self-attention (:mod:`.attention`) are its mixins, the norms, MLPs, MoE experts and the
    layer here."""

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
        self.kv = None  # generation: the objective's KV-cache hook (core/objectives/grpo/program.py)
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
            mixed = setup.sharded_mixed_precision
            if mixed:
                self.amp = False  # FSDP mixed precision: parameters are gathered in the compute dtype
            reduce = DT[mixed_reduce_dtype(setup)] if mixed else DT[setup.trainable_dtype]
            self.sh = ShardModel(setup, engine, self.ops, self.cdt, mixed, reduce)
        # SDPA's math kernel where a CUDA run of the modelled torch takes it (core/sdpa.py)
        self.math_kernel = tape_kernel(spec, setup, engine.match_simulation) == MATH
        self.liger = kernel_patch(spec, setup)  # Liger's and the Hub's RMSNorm / GLU kernels (core/estimator/liger.py)
        self.hub_rope = rope_runs(spec, setup)  # the Hub's RoPE kernel (core/estimator/attention.py)
        self.unsloth = unsloth_patch(spec, setup)  # Unsloth's fused LoRA kernels (core/estimator/unsloth.py)

    # ---- load ---------------------------------------------------------------------------------------------
    def _p(self, numel: int, dtype: str, trainable: bool, rows: int = 0, cols: int = 0) -> Storage:
        if trainable and self.setup.upcasts_trainable:
            dtype = "f32"  # LLaMA-Factory's or accelerate's upcast of what trains (upcasts_trainable)
        if self.sh is not None and self.sh.params_sharded:
            h = self.sh.param(numel, dtype, trainable)
        else:
            h = self.ops.param(numel, dtype, Kind.WEIGHTS, trainable)
        if trainable:
            self.params.append(h)
        self.shapes[id(h)] = (rows or numel, cols)
        return h

    def unit(self, index: int, x: Storage, run: Callable[[Storage], Storage | None]) -> Storage | None:
        """``run(x)`` as FSDP unit ``index`` (under ZeRO-3 / FSDP; otherwise ``run(x)`` alone), as ``fully_shard``'s
        hooks run it (core/simulation/shard.py ``shard_module``): gathered before the forward and freed after it; a
        boundary on the input where it needs a gradient (its backward reduce-scatters the unit) and one on the
        output (its backward gathers the unit again). The caller still owns ``x``."""
        sh = self.sh
        if sh is None or not sh.params_sharded:
            return run(x)
        engine = self.engine
        sh.unshard(index)
        xb = x
        if x.rg:
            xb = engine.view(x)
            engine.node(xb, [(x, 0)], special=boundary(functools.partial(sh.post_backward, index)))
        out = run(xb)
        if xb is not x:
            self.ops.drop(xb)
        sh.reshard(index)
        if out is not None and out.rg:
            ob = engine.view(out)
            engine.node(ob, [(out, 0)], special=boundary(functools.partial(sh.unshard, index)))
            self.ops.drop(out)
            out = ob
        return out

    def adapter_handles(self) -> list[Storage]:
        return self.adapters

    def shape_of(self, p: Storage) -> tuple[int, int]:
        return self.shapes[id(p)]

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
        self.original_inv_freq = ops.new(half, "f32")  # transformers' rotary module keeps a copy (the builder's)
        self.original_inv_freq.param = True

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
            self._moe_params(L, trainable)
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
    def norm(self, ws: list[Storage], x: Storage, rows: int, dim: int) -> Storage:
        ops = self.ops
        if self.spec.norm_kind is NormKind.LAYERNORM:
            # layer_norm is on CUDA autocast's fp32 list: its input, weight and bias are cast to fp32 (a 16-bit
            # weight's and bias's copies are not autocast's cached casts, and layer_norm saves them for backward)
            xin, w, b = (ops.cast(t, "f32") if self.amp and t.dtype != "f32" else t for t in (x, *ws))
            copies = [t for t, src in ((w, ws[0]), (b, ws[1])) if t is not src]
            xin = xin if xin is not x else ops.ref(x)
            out = ops.new(rows * dim, xin.dtype)
            stat = xin.dtype if self.engine.match_simulation else "f32"  # CUDA keeps fp32 statistics
            mean = ops.new(rows, stat)
            rstd = ops.new(rows, stat)
            edges = [(xin, ops.gbytes(xin)), (w, ops.gbytes(w)), (b, ops.gbytes(b))]
            self.engine.node(out, edges, [xin, mean, rstd, *copies])
            ops.drop(mean, rstd, xin, *copies)
            return out
        if self.liger is not None and self.liger.rms_norm:
            return liger.rms_norm(self, self.liger, ws[0], x, rows, dim)
        if self.unsloth is not None and self.unsloth.rms_norm is not None:  # Unsloth's: Liger's tensors, frozen
            return liger.rms_norm(self, self.unsloth.rms_norm, ws[0], x, rows, dim)
        dtype = x.dtype
        h = ops.cast(x, "f32")
        # pow(2): saves h; backward makes two temporaries and the gradient
        p = ops.new(h.numel, "f32")
        hb = ops.gbytes(h)
        self.engine.node(p, [(h, hb)], [h], (Temp(0, hb), Temp(0, hb), Grad(0), FreeTemp(0), FreeTemp(0)))
        var = ops.new(rows, "f32")  # mean(-1, keepdim): backward expands to full size
        self.engine.node(var, [(p, ops.gbytes(p))])
        ops.drop(p)
        a = ops.add(var, scalar_constant(ops))
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

    def mlp(self, mods: dict, x: Storage, rows: int) -> Storage:
        ops = self.ops
        if "gate_up_proj" in mods and self.liger is not None and self.liger.glu:  # LigerPhi3SwiGLUMLP.forward
            return liger.glu_fused(self, mods, x, rows)
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
        if self.spec.mlp_kind is MlpKind.GATED and self.unsloth is not None and self.unsloth.mlp:
            return unsloth.lora_mlp(self, mods, x, rows)
        if self.spec.mlp_kind is MlpKind.GATED and self.liger is not None and self.liger.glu:
            return liger.glu(self, mods, x, rows)
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
        # pow is on CUDA autocast's fp32 list: under autocast it takes an fp32 copy of x (which it saves), and
        # type promotion carries fp32 through the rest of the chain (x + fp32, tanh, 1 + t, half * fp32)
        xp = ops.cast(x, "f32") if self.amp and x.dtype != "f32" else ops.ref(x)
        xb = ops.gbytes(xp)
        p = ops.new(xp.numel, xp.dtype)  # pow saves its input; backward: x.pow(2), times 3, then the gradient
        self.engine.node(p, [(xp, xb)], [xp], (Temp(0, xb), Temp(0, xb), Grad(0), FreeTemp(0), FreeTemp(0)))
        ops.drop(xp)
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

    def layer(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        spec, ops = self.spec, self.ops
        T = d.T
        hid = spec.hidden_size
        if spec.parallel_block:
            # ``residual + attn_output + mlp_output`` (phi: ``attn_outputs + feed_forward_hidden_states +
            # residual``): both outputs are locals of the layer's forward, alive to its return beside the first sum
            h = self.norm(L["in_norm"], x, T, hid)
            a = self.attention(L, h, d, cos, sin, mask)
            m = self.dense_mlp(L["mlp"], h, T) if not spec.is_moe else self.moe(L, h, d)
            s = ops.add(x, a)
            out = ops.add(s, m)
            ops.drop(s, a, m, h)
            return out
        # ``hidden_states = residual + hidden_states``: each block's output goes at its add, unless the layer keeps
        # it in a local to its return (spec.keeps_attn_output, spec.keeps_input_norm)
        h = self.norm(L["in_norm"], x, T, hid)
        h2 = self.attention(L, h, d, cos, sin, mask)
        kept = [h] if spec.keeps_input_norm else []
        if not spec.keeps_input_norm:
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
        if spec.keeps_attn_output:
            kept.append(h)
        else:
            ops.drop(h)
        n = self.norm(L["post_norm"], x1, T, hid)
        h2 = self._ffn(L, n, d)
        ops.drop(n)
        out = ops.add(x1, h2)
        ops.drop(x1, h2, *kept)
        return out

    def _ffn(self, L: dict, x: Storage, d: Dims) -> Storage:
        return self.moe(L, x, d) if self.spec.is_moe else self.dense_mlp(L["mlp"], x, d.T)


# ---- helpers ---------------------------------------------------------------------------------------------------

class activation_region:
    """Kept for the families' programs, which import it (the estimator's own code uses Engine.in_region)."""

    def __init__(self, engine: Engine, kind: Kind) -> None:
        self.engine, self.kind = engine, kind

    def __enter__(self) -> None:
        self.old = self.engine.region
        self.engine.region = self.kind

    def __exit__(self, *a: object) -> None:
        self.engine.region = self.old


def scalar_constant(ops: Ops) -> Storage:
    h = Storage(0, Kind.TEMPORARIES, False)
    h.numel, h.dtype = 1, "f32"
    return h
