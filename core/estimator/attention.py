"""Self-attention in the decoder program: projections to heads, RoPE (and Phi-3's partial RoPE), the fused SDPA
kernels, SDPA's math kernel, the eager path with its softmax, and repeat_kv.

Part of :class:`~vramlab.core.estimator.program.Model` (a mixin: it uses the model's ``spec``, ``setup``,
``engine``, ``ops``, ``linear``, ``norm``, ``dropout`` and the autocast casts); mirrors ``SelfAttention`` of
``core/simulation/model.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.estimator import liger, unsloth
from vramlab.core.estimator.engine import Grad, Storage
from vramlab.core.estimator.poly import Poly
from vramlab.core.spec.options import Attention

if TYPE_CHECKING:
    from vramlab.core.estimator.program import Dims


class SelfAttention:
    """Self-attention as the model's methods (see the module docstring)."""

    # eager attention under autocast: q, k and v cast before repeat_kv (the built-in builder), or by the matmuls
    # that use them, after it (transformers' eager_attention_forward: a repeated fp32 key is cast whole)
    amp_at_matmul = False

    def attention(self, L: dict, x: Storage, d: Dims, cos: Storage, sin: Storage, mask: Storage | None) -> Storage:
        spec, ops = self.spec, self.ops
        T = d.T
        A = L["attn"]
        run = spec.attention_run(self.setup.attention)
        eager = run is Attention.EAGER
        # liger's RoPE (core/estimator/liger.py rope): the gradients it passes on are laid out as the projections'
        rope = cos is not None and self.liger is not None and self.liger.rope
        if spec.fused_qkv:  # Phi3Attention: qkv_proj, sliced; each slice's backward makes a full-size zeros
            qkv = self.linear(A["qkv_proj"], x, T)
            q = self.head_view(self._slice(qkv, T * spec.q_dim), eager and not rope)
            k = self.head_view(self._slice(qkv, T * spec.kv_dim), eager and not rope)
            v = self.head_view(self._slice(qkv, T * spec.kv_dim), eager)
            ops.drop(qkv)
        elif self.unsloth is not None and (self.unsloth.qkv or self.unsloth.rope):  # core/estimator/unsloth.py
            # Unsloth's LoRA_QKV, or the three projections; its RoPE kernel on q and k before they are viewed
            if self.unsloth.qkv:
                q, k, v = unsloth.lora_qkv(self, A, x, T)
            else:
                q, k, v = (self.linear(A[n], x, T) for n in ("q_proj", "k_proj", "v_proj"))
            if self.unsloth.rope:
                q, k = unsloth.rope(self, q, k)
            q, k, v = (self.head_view(t, eager) for t in (q, k, v))
        else:
            q = self.head_view(self.linear(A["q_proj"], x, T), eager and not rope)
            k = self.head_view(self.linear(A["k_proj"], x, T), eager and not rope)
            v = self.head_view(self.linear(A["v_proj"], x, T), eager)
        if spec.qk_norm:
            q2 = self.norm(L["q_norm"], q, T * spec.num_heads, spec.head_dim)
            ops.drop(q)
            k2 = self.norm(L["k_norm"], k, T * spec.num_kv_heads, spec.head_dim)
            ops.drop(k)
            q, k = q2, k2
        held: list[Storage] = []  # the RoPE's locals StableLM keeps to the return (rope_pass_cat)
        if cos is None or (self.unsloth is not None and self.unsloth.rope):  # none (GPT-2), or Unsloth's (above)
            pass
        elif self.hub_rope and not spec.rope_pass_cat and q.dtype == cos.dtype:  # kernels-community/rotary's
            q2, k2 = self.clone(q), self.clone(k)  # then rotated in place, which autograd does not see
            ops.drop(q, k)
            q, k = q2, k2
        elif rope:
            q2, k2 = liger.rope(self, q, k, cos, sin, spec.fused_qkv, self._rope_grad_copy(run, mask))
            ops.drop(q, k)
            q, k = q2, k2
        elif spec.rope_pass_cat:
            q2, k2, held = self.rope_pass_cat(q, k, cos, sin)
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
        if self.unsloth is not None and self.unsloth.attention and self.kv is None:  # xformers' (unsloth's forward)
            out, reps = unsloth.attention(self, q, k, v, d)
            held.extend(reps)
        elif self.unsloth is not None and self.unsloth.softcap and self.kv is None:  # Gemma 2's, compiled
            out = unsloth.softcap_attention(self, q, k, v, d, mask)
        elif run is Attention.SDPA and mask is None and self.math_kernel and self.kv is None:
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
            if spec.rope_pass_cat and not rope:
                # the flash kernels allocate their output like q (empty_like); q concatenated by RoPE is laid
                # out (b, heads, s, d), so transpose(1, 2).contiguous() copies (and o_proj may save the copy);
                # liger's RoPE returns q laid out (b, s, heads, d)
                c = ops.new(out.numel, out.dtype)
                self.engine.node(c, [(out, 0)])
                ops.drop(out)
                out = c
        else:
            att = self.eager(q, k, v, d, mask)
            out = ops.new(att.numel, att.dtype)  # transpose(1, 2).contiguous() copies matmul's output
            self.engine.node(out, [(att, 0)])
            ops.drop(att)
        o = self.unsloth is not None and self.unsloth.o  # Unsloth's LoRA_W
        y = unsloth.lora_o(self, A["o_proj"], out, T) if o else self.linear(A["o_proj"], out, T)
        y2 = self.dropout(y, spec.resid_dropout)
        ops.drop(y, out, q, k, v, *held)  # SelfAttention.forward's locals live until it returns
        return y2

    def _rope_grad_copy(self, run: Attention, mask: Storage | None) -> tuple[bool, bool]:
        """Whether q's and k's gradients reach liger's RoPE laid out (batch, heads, seq, head_dim), so that its
        ``contiguous()`` of their (batch, seq, heads, head_dim) transpose copies: from eager attention's or the math
        kernel's matmuls, and k's from repeat_kv's sum; the fused kernels make them like their inputs
        (``empty_like``). A single head is laid out both ways."""
        spec = self.spec
        matmul = run is Attention.EAGER or (run is Attention.SDPA and mask is None and self.math_kernel
                                            and self.kv is None)
        repeated = run is Attention.SDPA and mask is not None and spec.num_heads != spec.num_kv_heads
        return matmul and spec.num_heads > 1, (matmul or repeated) and spec.num_kv_heads > 1

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

    def rope_pass_cat(self, q: Storage, k: Storage, cos: Storage, sin: Storage) -> tuple[Storage, Storage, list]:
        """HF Phi3 apply_rotary_pos_emb: q[..., :rd] and the (here empty) q[..., rd:] sliced for q and k, each
        rotated part concatenated with its pass-through part (a copy; cat's backward passes views). StableLM
        (``spec.rope_parts_kept``) rotates both before either is concatenated and keeps the rotated parts and the
        pass-through views (the projections' outputs with them) as locals until the attention returns: the third
        value, for the caller to drop then."""
        ops, engine = self.ops, self.engine
        hd, rd = self.spec.head_dim, self.spec.rope_dim
        parts = [(self._slice(t, t.numel // hd * rd), self._slice(t, t.numel // hd * (hd - rd))) for t in (q, k)]
        kept = self.spec.rope_parts_kept
        hub = self.hub_rope and q.dtype == cos.dtype  # Phi's rotary slices by the Hub's RoPE: clones (attention)
        rotated = [self.clone(rot) if hub else self.rope(rot, cos, sin) for rot, _ in parts] if kept else []
        out = []
        for i, ((rot, keep), t) in enumerate(zip(parts, (q, k))):
            r = rotated[i] if kept else self.rope(rot, cos, sin)
            c = ops.new(t.numel, t.dtype)
            engine.node(c, [(r, 0), (keep, 0)])
            if not kept:
                ops.drop(r)
            out.append(c)
        for rot, keep in parts:
            ops.drop(rot)
            if not kept:
                ops.drop(keep)
        return out[0], out[1], [*rotated, *(keep for _, keep in parts)] if kept else []

    def clone(self, t: Storage) -> Storage:
        """``t.clone()``: ``CloneBackward`` passes the gradient on as it comes."""
        c = self.ops.new(t.numel, t.dtype)
        self.engine.node(c, [(t, 0)])
        return c

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
        late = self.amp and self.amp_at_matmul
        # _eager's own locals: the caller's q, k, v stay referenced until SelfAttention.forward returns
        if self.amp and not late:
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
        qc, kc = (self.amp_cast(q), self.amp_cast(kr)) if late else (ops.ref(q), ops.ref(kr))
        qa = self._mm_operand(qc, d.multi)
        ka = self._mm_operand(kc, d.multi and mqa and kc is kr)  # a cast of the expanded key is contiguous
        sc = ops.new(nsc, qc.dtype)
        # bmm saves each operand for the other's gradient; backward computes mat2's gradient first
        engine.node(sc, [(qa, ops.gbytes(qa)), (ka, ops.gbytes(ka))], ([ka] if qa.rg else []) + ([qa] if ka.rg else []),
                    (Grad(1), Grad(0)))
        ops.drop(qa, ka, qc, kc)
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
        sm = ops.softmax(w, "f32")
        pb = ops.cast(sm, q.dtype)
        ops.drop(sm, w)
        if spec.attention_dropout and self.training:
            pd = self.dropout(pb, spec.attention_dropout)
            ops.drop(pb)
            pb = pd
        pc, vc = (self.amp_cast(pb), self.amp_cast(vr)) if late else (ops.ref(pb), ops.ref(vr))
        va = self._mm_operand(vc, d.multi and mqa and vc is vr)
        out = ops.new(q.numel, pc.dtype)
        engine.node(out, [(pc, ops.gbytes(pc)), (va, ops.gbytes(va))],
                    ([va] if pc.rg else []) + ([pc] if va.rg else []), (Grad(1), Grad(0)))
        ops.drop(va, pc, vc, pb, kr, vr, q, k, v)
        return out

    def _mm_operand(self, x: Storage, copy: bool) -> Storage:
        """matmul's reshape of a 4-D operand: a view, or a contiguous copy whose backward passes the
        gradient through."""
        if not copy:
            return self.ops.ref(x)
        c = self.ops.new(x.numel, x.dtype)
        self.engine.node(c, [(x, 0)])
        return c
