"""The decoder program's mixture-of-experts block: transformers 5.25.0's ``<Family>SparseMoeBlock`` with its experts
run by ``grouped_mm_experts_forward`` (what ``from_pretrained`` picks on CUDA), mirroring
``core/simulation/moe.py`` op for op and local for local.

Part of :class:`~vramlab.core.estimator.program.Model` (a mixin: it uses the model's ``spec``, ``engine``, ``ops``,
dtypes, ``_p``, ``_linear``, ``linear``, ``act``, ``mlp`` and ``gathering`` views). Every size is a multiple of
the routed tokens ``S = T x k``: no routing is assumed.
"""

from __future__ import annotations

from vramlab.core.estimator.engine import FreeTemp, Grad, Storage, Temp
from vramlab.core.families.registry import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from vramlab.core.spec.model import MlpKind


class MoeBlock:
    """The MoE block as the model's methods (see the module docstring)."""

    def _moe_params(self, L: dict, trainable: bool) -> None:
        """The router, the two fused expert tensors and Qwen2-MoE's shared expert, in transformers' order."""
        spec = self.spec
        E, h, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate
        up = (2 if spec.mlp_kind is MlpKind.GATED else 1) * inter
        family = spec.moe_family
        if family != QWEN3_MOE:
            L["router"] = self._linear(spec.router_linear(), trainable, False)
        # Adafactor's factored states of a 3-D tensor: rows over the last dim, columns over the one before
        L["gate_up"] = self._p(E * up * h, self.pdt, trainable, E * up, E * h)
        L["down"] = self._p(E * h * inter, self.pdt, trainable, E * h, E * inter)
        if family == QWEN3_MOE:
            L["router"] = self._linear(spec.router_linear(), trainable, False)
        L["shared"] = {s.name: self._linear(s, trainable, False) for s in spec.shared_expert_linears()}

    def moe(self, L: dict, x: Storage, d) -> Storage:  # noqa: ANN001 - program.Dims
        """``<Family>SparseMoeBlock.forward``; the caller owns ``x``."""
        ops, T = self.ops, d.T
        shared = None
        sh = L["shared"]
        if sh:  # Qwen2MoeSparseMoeBlock: the shared expert first
            shared = self.mlp({"gate_proj": sh["shared_gate_proj"], "up_proj": sh["shared_up_proj"],
                               "down_proj": sh["shared_down_proj"]}, x, T)
        logits, weights, chosen = self._route(L["router"], x, T)  # ``_`` keeps the logits to the return
        out = self._grouped_experts(L, x, chosen, weights, T)
        if shared is not None:
            gl = self.linear(sh["shared_expert_gate"], x, T)
            g = ops.unary(gl, save_output=True)  # sigmoid
            ops.drop(gl)
            gs = ops.mul(g, shared)
            ops.drop(g, shared)
            total = ops.add(out, gs)
            ops.drop(out)
            out = total
            ops.drop(gs)
        ops.drop(logits, weights, chosen)
        return out

    def _route(self, router, x: Storage, T) -> tuple[Storage, Storage, Storage]:  # noqa: ANN001
        """``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter`` / ``Qwen3MoeTopKRouter``: the logits, the top-k weights
        (fp32 for Mixtral, the logits' dtype for Qwen) and the chosen experts."""
        ops, engine, spec = self.ops, self.engine, self.spec
        k = spec.experts_per_token
        logits = self.linear(router, x, T)
        family = spec.moe_family
        probs = ops.softmax(logits, "f32")  # Mixtral's softmax(logits.float()), Qwen's softmax(dtype=float)
        top = ops.new(T * k, "f32")
        chosen = ops.new(T * k, "i64")
        engine.node(top, [(probs, ops.gbytes(probs))], [chosen])  # topk saves the indices; backward scatters
        if family != QWEN2_MOE:  # ``top /= top.sum(-1, keepdim=True)`` (Qwen2MoeConfig's norm_topk_prob is off)
            total = ops.new(T, "f32")
            engine.node(total, [(top, 0)])
            original = ops.new(T * k, "f32")  # an in-place div saves a clone of what it overwrites
            divided = engine.view(top)
            tk = ops.gbytes(top)
            # grad / other for self; -grad * (self / other) / other, summed to other's shape, for other
            engine.node(divided, [(top, tk), (total, ops.gbytes(total))], [total, original],
                        (Grad(0), Temp(1, tk), Temp(1, tk), Temp(1, tk), FreeTemp(1), FreeTemp(1), Temp(1, tk),
                         FreeTemp(1), Grad(1), FreeTemp(1)))
            ops.drop(top, total, original)
            top = divided
        if family != MIXTRAL:  # ``.to(router_logits.dtype)``
            cast = ops.cast(top, logits.dtype)
            ops.drop(top)
            top = cast
        ops.drop(probs)
        return logits, top, chosen

    def _grouped(self, x: Storage, w: Storage, offsets: Storage, rows, out_f: int) -> Storage:  # noqa: ANN001
        """``_grouped_linear`` through ``_grouped_mm``: the input cast to the weights' dtype (no autocast), one
        output for every routed token; GroupedMmBackward saves the input where the weights train, the weights
        where the input does, and the offsets; backward makes the weights' gradient, then the input's."""
        ops = self.ops
        xc = ops.cast(x, w.dtype)
        out = ops.new(rows * out_f, w.dtype)
        saved = ([xc] if w.rg else []) + ([w] if xc.rg else []) + ([offsets] if w.rg or xc.rg else [])
        self.engine.node(out, [(xc, ops.gbytes(xc)), (w, ops.gbytes(w))], saved, (Grad(1), Grad(0)))
        ops.drop(xc)
        return out

    def _grouped_experts(self, L: dict, x: Storage, chosen: Storage, weights: Storage, T) -> Storage:  # noqa: ANN001
        """``grouped_mm_experts_forward``: sort the routed tokens by expert, gather them, two grouped matmuls,
        the routing weights applied (type promotion: fp32 for Mixtral), the original order restored, the top k
        summed, cast to the input's dtype."""
        ops, engine, spec = self.ops, self.engine, self.spec
        k, E, h, inter = spec.experts_per_token, spec.num_experts, spec.hidden_size, spec.expert_intermediate
        S = T * k
        ids_g = ops.new(S, "i64")  # torch.sort: values and permutation
        perm = ops.new(S, "i64")
        q = ops.new(S, "i64")  # perm // k
        sel = ops.new(S * h, x.dtype)  # hidden_states[...]: index saves the indices; backward zeros + index_put
        engine.node(sel, [(x, ops.gbytes(x))], [q], (Temp(0, ops.gbytes(x)), Grad(0), FreeTemp(0)))
        ops.drop(q)
        swg = ops.new(S, weights.dtype)  # sample_weights[perm]
        engine.node(swg, [(weights, ops.gbytes(weights))], [perm], (Temp(0, ops.gbytes(weights)), Grad(0),
                                                                     FreeTemp(0)))
        hist_in = ops.new(S, "f32")  # .float() on the CPU, .int() on CUDA: 4 bytes a routed token either way
        hist = ops.new(E, "f32")
        offsets = ops.new(E, "i32")
        proj = self._grouped(sel, L["gate_up"], offsets, S, L["gate_up"].numel // (E * h))
        if spec.mlp_kind is MlpKind.GATED:  # _default_apply_gate: chunk, act(gate) * up
            gate, up = ops.gathering_views(proj, [S * inter, S * inter])
            a = self.act(gate)
            act = ops.mul(a, up)
            ops.drop(a, gate, up)
        else:
            act = self.act(proj)
        ops.drop(proj)
        proj = self._grouped(act, L["down"], offsets, S, h)
        ops.drop(act)
        weighted = ops.mul(proj, swg)  # proj_out * sample_weights_g.unsqueeze(-1)
        inv = ops.new(S, "i64")  # empty_like(perm), then inv[perm] = arange(S)
        ar = ops.new(S, "i64")
        ops.drop(ar)
        back = ops.new(S * h, weighted.dtype)  # weighted_out[inv_perm]
        engine.node(back, [(weighted, ops.gbytes(weighted))], [inv],
                    (Temp(0, ops.gbytes(weighted)), Grad(0), FreeTemp(0)))
        ops.drop(weighted)
        total = ops.new(T * h, back.dtype)  # view(T, k, h).sum(1): backward reshapes the expanded gradient (a copy)
        engine.node(total, [(back, ops.gbytes(back))])
        out = ops.cast(total, x.dtype)
        ops.drop(ids_g, perm, sel, swg, hist_in, hist, offsets, proj, back, inv, total)
        return out
