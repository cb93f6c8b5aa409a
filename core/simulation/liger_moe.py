"""Liger Kernel's fused MoE experts (liger-kernel 0.8.5): ``LigerExperts.forward``, which liger's patch binds on the
experts of Mixtral, Qwen3-MoE, Qwen3-Next, Qwen 3.5 MoE, HunYuan-MoE and DeepSeek-V2 / V3 (their ``swiglu`` switch),
and the autograd function it calls, ``LigerFusedMoEFunction`` (``ops/fused_moe.py``), as its CUDA path allocates
around its Triton kernels (the values here are not the experts' output: the bytes are).

Forward (``ensure_contiguous`` on its arguments): the routing metadata under ``no_grad`` (``compute_routing_metadata``:
an int32 (E, n_tiles) histogram, per-expert counts, start and tile offsets, the tiles' rows and experts, and three
int32 permutations of the T x K routed tokens), the gate / up pre-activations (TK x 2I) and the SwiGLU output
(TK x I), the down projection's per-routed-token output (TK x H), and the weighted sum (T x H). It saves the input,
both expert tensors, the pre-activations, the flat routing weights and the routing metadata. Backward: the
pre-activations' gradient (TK x 2I), the weighted activation (TK x I), the routing weights' gradient (zeros, TK), a
``zeros_like`` of ``down_proj`` and of ``gate_up_proj`` (whether they train or not: autograd drops them after),
the expanded input gradient (TK x H) and the input's (zeros, T x H).

Routing decides two sizes, which a run reads off its routing (``.item()``): the number of 64-row M tiles
(``sum_e ceil(tokens_e / 64)``) and the histogram's token tiles (``cdiv(T, 1024 // next_pow2(K))``). The reference
takes the bound that holds for any routing and is a polynomial of the sizes (so a traced tape fits it): one tile
per routed token, one token tile per token (:func:`routing_tiles`); int32 arrays, 8 bytes per routed token saved
per layer and 4 x E bytes per token for a moment, above the real count (said in the result's note).
"""

from __future__ import annotations

import torch
from torch import nn

from vramlab.core.checks import SetupError


def routing_tiles(tokens: int, top_k: int, experts: int) -> tuple[int, int]:
    """The histogram's token tiles and the M tiles ``compute_routing_metadata`` allocates, as the reference takes
    them: their bounds over every routing (each at least one token: ``tokens`` and ``tokens * top_k``)."""
    return tokens, tokens * top_k


def _routing_metadata(topk_indices: torch.Tensor, E: int) -> tuple:
    """``compute_routing_metadata``'s allocations (its kernels write them), its locals freed as it returns."""
    T, K = topk_indices.shape
    TK = T * K
    device = topk_indices.device
    n_tiles, num_m_tiles = routing_tiles(T, K, E)
    tile_expert_counts = torch.empty(E, n_tiles, dtype=torch.int32, device=device)
    expert_token_count = tile_expert_counts.sum(dim=1, dtype=torch.int32)
    expert_start_idx = torch.empty(E + 1, dtype=torch.int32, device=device)
    expert_tile_offset = torch.empty(E + 1, dtype=torch.int32, device=device)  # noqa: F841 - alive to the return
    tile_row_start = torch.empty(num_m_tiles, dtype=torch.int32, device=device)
    tile_expert = torch.empty(num_m_tiles, dtype=torch.int32, device=device)
    s_scatter_idx = torch.empty(TK, dtype=torch.int32, device=device)
    s_reverse_scatter_idx = torch.empty(TK, dtype=torch.int32, device=device)
    x_gather_idx = torch.empty(TK, dtype=torch.int32, device=device)
    return (expert_token_count, expert_start_idx, x_gather_idx, s_scatter_idx, s_reverse_scatter_idx, tile_row_start,
            tile_expert)


def _contiguous(fn):  # noqa: ANN001, ANN202
    """liger's ``ensure_contiguous``: every tensor argument made contiguous (a copy only where it is not), the copies
    held until the function returns."""
    def wrapper(ctx, *args):  # noqa: ANN001, ANN002, ANN202
        args = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
        return fn(ctx, *args)
    return wrapper


class LigerFusedMoEFunction(torch.autograd.Function):
    """``LigerFusedMoEFunction``: see the module's docstring."""

    @staticmethod
    @_contiguous
    def forward(ctx, x, gate_up_proj, down_proj, top_k_index, top_k_weights):  # noqa: ANN001, ANN205
        T, K = top_k_index.shape
        E = gate_up_proj.shape[0]
        H = x.shape[1]
        intermediate_dim = gate_up_proj.shape[1] // 2
        TK = T * K
        with torch.no_grad():
            (_, expert_start_idx, x_gather_idx, s_scatter_idx, s_reverse_scatter_idx, tile_row_start,
             tile_expert) = _routing_metadata(top_k_index, E)
        pre_act = torch.empty(TK, 2 * intermediate_dim, dtype=x.dtype, device=x.device)
        post_act = torch.empty(TK, intermediate_dim, dtype=x.dtype, device=x.device)  # noqa: F841 - alive to the return
        Y = torch.empty(TK, H, dtype=x.dtype, device=x.device)
        topk_weights_flat = top_k_weights.flatten().contiguous()
        out = torch.empty(T, H, dtype=Y.dtype, device=Y.device)  # _token_aggregation
        ctx.save_for_backward(x, gate_up_proj, down_proj, pre_act, topk_weights_flat, expert_start_idx, x_gather_idx,
                              s_scatter_idx, s_reverse_scatter_idx, tile_row_start, tile_expert)
        ctx.sizes = (T, K, H, intermediate_dim, TK)
        ctx.mark_non_differentiable(top_k_index)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    @_contiguous
    def backward(ctx, dO):  # noqa: ANN001, ANN205
        if dO is None:
            return None, None, None, None, None
        (x, gate_up_proj, down_proj, pre_act, topk_weights_flat, expert_start_idx, x_gather_idx, s_scatter_idx,
         s_reverse_scatter_idx, tile_row_start, tile_expert) = ctx.saved_tensors
        T, K, H, intermediate_dim, TK = ctx.sizes
        d_pre_act = torch.empty(TK, 2 * intermediate_dim, dtype=dO.dtype, device=dO.device)  # noqa: F841 - alive to the return
        weighted_act = torch.empty(TK, intermediate_dim, dtype=dO.dtype, device=dO.device)  # noqa: F841 - alive to the return
        dS = torch.zeros(TK, dtype=dO.dtype, device=dO.device)
        ddown_proj = torch.zeros_like(down_proj)
        dx_expanded = torch.empty(TK, H, dtype=dO.dtype, device=dO.device)  # noqa: F841 - alive to the return
        dx = torch.zeros(T, H, dtype=dO.dtype, device=dO.device)
        dgate_up_proj = torch.zeros_like(gate_up_proj)
        return dx, dgate_up_proj, ddown_proj, None, dS.view(T, K)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """``LigerExperts.forward`` on transformers' experts module (its fused ``gate_up_proj`` and ``down_proj``): the
    routing indices cast to int32 (a new tensor, freed as it returns), then :class:`LigerFusedMoEFunction`."""
    orig_shape = hidden_states.shape
    x = hidden_states.view(-1, self.hidden_dim)
    top_k_index_2d = top_k_index.view(-1, top_k_index.shape[-1]).to(torch.int32)
    top_k_weights_2d = top_k_weights.view(-1, top_k_weights.shape[-1])
    out = LigerFusedMoEFunction.apply(x, self.gate_up_proj, self.down_proj, top_k_index_2d, top_k_weights_2d)
    return out.view(orig_shape)


def bind_experts(name: str, module: nn.Module) -> None:
    """``LigerExperts.forward`` bound on ``module`` as liger's ``_patch_swiglu_module`` binds it. Where peft adapts the
    experts' tensors (``target_parameters``: a ``ParamWrapper`` in the experts' place, as HF Trainer applies liger
    after peft), liger's forward runs on the wrapper and fails: refused with its error."""
    if not hasattr(module, "hidden_dim"):
        raise SetupError(f"liger-kernel 0.8.5's LigerExperts.forward on {name} ({type(module).__name__}: peft's LoRA "
                         f"on the experts' tensors, which HF Trainer's use_liger_kernel patches after peft) fails: "
                         f"AttributeError: '{type(module).__name__}' object has no attribute 'hidden_dim': drop glu "
                         "from --liger-kernels, or the experts from the LoRA targets")
    module.forward = experts_forward.__get__(module)


__all__ = ["LigerFusedMoEFunction", "bind_experts", "experts_forward", "routing_tiles"]
