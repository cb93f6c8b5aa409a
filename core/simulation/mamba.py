"""mamba-ssm's fused Mamba-2 mixer, ``mamba_split_conv1d_scan_combined``, as CUDA runs it in a training step: what
the Mamba-2 mixers of transformers 5.25.0 (Mamba-2, Bamba, GraniteMoeHybrid / Granite 4, Nemotron-H, Falcon-H1,
Zamba 2) call when ``self.training and cache is None``, through the Hub's kernels-community/mamba-ssm layer (on by
default, core/spec/hub_kernels.py) or the installed mamba-ssm package, in place of their torch path.

:class:`SplitConv1dScanCombined` has the autograd contract of mamba-ssm 2.3.2.post1's
``MambaSplitConv1dScanCombinedFn`` (``mamba_ssm/ops/triton/ssd_combined.py``) over causal-conv1d 1.6.1's
``causal_conv1d_fwd_function`` / ``causal_conv1d_bwd_function`` (``causal_conv1d/cpp_functions.py``): the same
Python, line for line, with every Triton / CUDA kernel launch left out (they write into what the Python allocated
and allocate nothing themselves), so the forward allocates, keeps and frees what the library's does (the conv's
output, ``_chunk_cumsum_fwd``'s dt and dA cumsum, the fp32 chunk states, the passed states, ``CB``, the scan's
output, the gated RMSNorm's output and ``rstd``, the out projection), saves what it saves (``zxbcdt``, the scan's
output ``out_x``, ``rstd``, the out projection's weight, cast to the autocast dtype under autocast), and the
backward allocates its temporaries in the same order (its recomputed conv and scan states, the split-head
partial sums whose split count is set by the GPU's SM count: :data:`SM_COUNT`, an H100 SXM's). The non-
deterministic kernels are the default (``MAMBA_DETERMINISTIC`` unset, torch's deterministic algorithms off).

The out projection runs inside the Function on ``out_proj.weight`` as the mixer passes it: where peft wraps
``out_proj`` in a LoRA layer, ``weight`` is its base layer's (peft's ``BaseTunerLayer.weight``), so the adapter
is not applied and gets no gradient (:func:`bypassed_adapters`, named in the note).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vramlab.core.checks import SetupError
from vramlab.core.simulation.kernel_binding import bind_funcs
from vramlab.core.spec.hub_kernels import MAMBA2_FUSED, QUANTIZED_OUT_PROJ

SM_COUNT = 132  # an H100 SXM's multiprocessors: the split count of the backward's dB / dC / dCB partial sums
_DX_MIN_BLOCK_N = 32  # min BLOCK_SIZE_N of _chunk_scan_chunk_state_bwd_dx_kernel's autotune configs (unused: dD
# has one column for a 1-D D in the non-deterministic mode)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _ensure_stride(inp: torch.Tensor) -> torch.Tensor:
    assert inp.shape[2] % 8 == 0, "Number of convolution channels is required to be a multiple of 8."
    return inp if inp.stride(1) % 8 == 0 else inp.contiguous()


def _conv_fwd(xbc: torch.Tensor) -> torch.Tensor:
    """``causal_conv1d_fwd_function`` on ``rearrange(ensure_stride(xBC), "b s d -> b d s")``, rearranged back:
    ``torch.empty_like`` of the channels-last view (its layout kept), filled by the kernel."""
    return torch.empty_like(_ensure_stride(xbc).transpose(1, 2)).transpose(1, 2)


def _chunk_cumsum(dt: torch.Tensor, nheads: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen = dt.shape[:2]
    nchunks = math.ceil(seqlen / chunk_size)
    dt_out = torch.empty(batch, nheads, nchunks, chunk_size, device=dt.device, dtype=torch.float32)
    da_cumsum = torch.empty(batch, nheads, nchunks, chunk_size, device=dt.device, dtype=torch.float32)
    return da_cumsum, dt_out


def _chunk_states(x: torch.Tensor, nchunks: int, dstate: int) -> torch.Tensor:
    batch, _, nheads, headdim = x.shape
    return torch.empty((batch, nchunks, nheads, headdim, dstate), device=x.device, dtype=torch.float32)


def _state_passing(states: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    batch, nchunks, nheads, dim = states.shape
    out = torch.empty((batch, nchunks, nheads, dim), device=states.device, dtype=out_dtype)
    final_states = torch.empty((batch, nheads, dim), device=states.device, dtype=torch.float32)
    return out, final_states


def _bmm_chunk(c: torch.Tensor, chunk_size: int) -> torch.Tensor:
    batch, seqlen, ngroups = c.shape[:3]
    nchunks = math.ceil(seqlen / chunk_size)
    return torch.empty((batch, nchunks, ngroups, chunk_size, chunk_size), device=c.device, dtype=torch.float32)


def _flat(t: torch.Tensor) -> torch.Tensor:  # rearrange(t, "... p n -> ... (p n)")
    return t.reshape(*t.shape[:-2], -1)


def _scan_fwd(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk_size: int,
              z: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``_mamba_chunk_scan_combined_fwd`` (no initial states, no seq_idx): out, out_x, dt, dA_cumsum, states,
    final_states."""
    dstate = b.shape[-1]
    if b.stride(-1) != 1:
        b = b.contiguous()
    if c.stride(-1) != 1:
        c = c.contiguous()
    if x.stride(-1) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    if z is not None and z.stride(-1) != 1 and z.stride(1) != 1:
        z = z.contiguous()
    da_cumsum, dt = _chunk_cumsum(dt, x.shape[2], chunk_size)
    states = _chunk_states(x, da_cumsum.shape[2], dstate)
    states, final_states = _state_passing(_flat(states), c.dtype)
    states, final_states = states.unflatten(-1, (-1, dstate)), final_states.unflatten(-1, (-1, dstate))
    cb = _bmm_chunk(c, chunk_size)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    out_x = torch.empty(x.shape, device=x.device, dtype=x.dtype) if z is not None else None
    del cb
    return out, out_x, dt, da_cumsum, states, final_states


def _nsplits(batch: int, nchunks: int, nheads: int, ngroups: int) -> int:
    ratio = nheads // ngroups
    per_program = max(min(math.ceil(batch * nchunks * nheads / SM_COUNT), ratio), 1)
    return -(-ratio // per_program)


def _scan_bwd(dout: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,  # noqa: PLR0913
              c: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor, chunk_size: int, dx: torch.Tensor,
              ddt: torch.Tensor, db: torch.Tensor, dc: torch.Tensor, z: torch.Tensor | None = None,
              dz: torch.Tensor | None = None, out: torch.Tensor | None = None,
              recompute_output: bool = False) -> tuple[torch.Tensor | None, ...]:
    """``_mamba_chunk_scan_combined_bwd`` with no initial / final states, the gradients' buffers given: dA, dD,
    ddt_bias and (``recompute_output`` with z) the recomputed gated output; the others are written into ``dx`` /
    ``ddt`` / ``db`` / ``dc`` / ``dz``."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = b.shape[2:]
    dt_in = dt.clone()
    da_cumsum, dt = _chunk_cumsum(dt_in, nheads, chunk_size)
    nchunks = da_cumsum.shape[2]
    cb = _bmm_chunk(c, chunk_size)
    states = _chunk_states(x, nchunks, dstate)
    states, _ = _state_passing(_flat(states), torch.float32)
    states = states.unflatten(-1, (-1, dstate))
    outz = dd_z = None
    if z is not None:  # _chunk_scan_bwd_dz(has_ddAcs=False, dz=dz): dD's partial sums, outz, dout_x
        dd_z = torch.empty(-(-chunk_size // 32), batch, nchunks, nheads, headdim if d.dim() == 2 else 1,
                           device=d.device, dtype=torch.float32)
        outz = torch.empty_like(x) if recompute_output else None
        dout = torch.empty_like(dout)
        dd_z = dd_z.sum(dim=(0, 1, 2)).to(dtype=d.dtype)
        dd_z = dd_z.squeeze(-1) if d.dim() == 1 else dd_z
    # _chunk_scan_bwd_dstates (dtype: the states')
    dstates = torch.empty(batch, nchunks, nheads, headdim, dstate, device=c.device, dtype=states.dtype)
    # _state_passing_bwd(dstates_dtype=states_dtype=x.dtype)
    flat_states, flat_dstates = _flat(states), _flat(dstates)
    new_dstates = torch.empty_like(flat_dstates, dtype=x.dtype)
    converted = torch.empty_like(flat_states, dtype=x.dtype) if flat_states.dtype != x.dtype else flat_states
    n_blocks = (headdim * dstate + 63) // 64  # BLOCK_SIZE_min = 64
    dda_chunk = torch.empty(batch, nheads, nchunks, n_blocks, dtype=torch.float32, device=x.device)
    dda_chunk_cumsum = dda_chunk.sum(dim=-1).to(dtype=torch.float32)  # [..., :n_valid_blocks]: a view
    del dda_chunk, flat_states, flat_dstates
    dstates, states = new_dstates.unflatten(-1, (-1, dstate)), converted.unflatten(-1, (-1, dstate))
    del new_dstates, converted
    # _chunk_scan_chunk_state_bwd_dx: dD's partial sums (pid_m_tiles = cdiv(chunk_size, 32), one column for a 1-D
    # D), dx given, ddt's workspace
    dd = torch.zeros(-(-chunk_size // 32), batch, nchunks, nheads, headdim if d.dim() == 2 else 1,
                     device=d.device, dtype=torch.float32)
    ddt_ws = torch.empty(batch, nheads, nchunks, chunk_size, device=x.device, dtype=torch.float32)
    dd = dd.sum(dim=(0, 1, 2))
    if d.dim() == 1:
        dd = dd.sum(dim=-1)
    dd = dd.to(dtype=d.dtype)
    # _chunk_state_bwd_db(B=B): ddA_next, dB's split partial sums
    split = _nsplits(batch, nchunks, nheads, ngroups)
    dda_next = torch.empty(batch, nheads, nchunks, chunk_size, device=x.device, dtype=torch.float32)
    db_part = torch.empty(batch, seqlen, split, ngroups, dstate, device=x.device, dtype=torch.float32)
    db_sum = db_part.sum(2)
    del db_part
    # _chunk_scan_bwd_dC(states.to(x.dtype), C=C): ddA_cumsum_prev, dC's split partial sums
    states_x = states.to(x.dtype)
    dda_prev = torch.empty(batch, nheads, nchunks, chunk_size, device=x.device, dtype=torch.float32)
    dc_part = torch.empty(batch, seqlen, split, ngroups, dstate, device=x.device, dtype=torch.float32)
    dc_sum = dc_part.sum(2)
    del dc_part, states_x
    # _chunk_scan_bwd_dcb (no CB): its split partial sums
    dcb_part = torch.empty(batch, nchunks, split, ngroups, chunk_size, chunk_size, device=x.device,
                           dtype=torch.float32)
    dcb = dcb_part.sum(2)
    del dcb_part
    dcb = dcb.to(cb.dtype)
    # _bmm_chunk_bwd(C, dCB, residual=dB, out=dB_given), (B, dCB^T, residual=dC, out=dC_given): written in place
    dda_prev[..., -1] += dda_chunk_cumsum
    dda_prev_sum = dda_prev.flip([-1]).cumsum(dim=-1).flip([-1])
    # _chunk_scan_bwd_ddAcs_stable: cdiv(chunk_size, 16) partial rows
    dda_part = torch.empty(batch, nheads, nchunks, -(-chunk_size // 16), chunk_size, device=x.device,
                           dtype=torch.float32)
    dda = dda_part.sum(dim=3)
    del dda_part
    dda += dda_next + dda_prev_sum
    # _chunk_cumsum_bwd(ddt=ddt_given): ddt_bias, dA
    ddt_bias = torch.empty_like(dt_bias, dtype=torch.float32)
    da = torch.empty_like(a, dtype=torch.float32)
    del dda, dcb, db_sum, dc_sum, ddt_ws, dda_next, dda_prev, dda_prev_sum, dda_chunk_cumsum, dstates, states, _
    del cb, dt, da_cumsum, dt_in
    return da, dd if z is None else dd_z, ddt_bias, outz


class SplitConv1dScanCombined(torch.autograd.Function):
    """mamba-ssm 2.3.2.post1's ``MambaSplitConv1dScanCombinedFn`` with its kernels left out (module docstring):
    the mixers of transformers 5.25.0 pass no initial states, no seq_idx, no final states, and a ``zxbcdt`` with
    no non-SSM part (``d_nonssm`` 0)."""

    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, a, d, chunk_size, activation, rmsnorm_weight,  # noqa: ANN001, ANN205, PLR0913
                rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate):
        nheads = d.shape[0]
        headdim = headdim if d.dim() == 1 else d.shape[1]
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        if (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2:
            raise NotImplementedError("a zxbcdt with a non-SSM part (d_nonssm > 0): no transformers mixer passes one")
        batch, seqlen, _ = zxbcdt.shape
        z, xbc, dt = torch.split(zxbcdt, [dim, dim + ngroups * dstate * 2, nheads], dim=-1)
        xbc_conv = _conv_fwd(xbc)
        x, b, c = torch.split(xbc_conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        x = x.unflatten(-1, (nheads, headdim))
        b = b.unflatten(-1, (ngroups, dstate))
        c = c.unflatten(-1, (ngroups, dstate))
        z = z.unflatten(-1, (nheads, headdim))
        if rmsnorm_weight is None:
            out, out_x, dt_out, da_cumsum, states, final_states = _scan_fwd(x, dt, b, c, chunk_size, z)
            out = out.flatten(-2)
            rstd = None
        else:
            out_x, _, dt_out, da_cumsum, states, final_states = _scan_fwd(x, dt, b, c, chunk_size, None)
            x_rms = out_x.reshape(batch * seqlen, dim)
            rmsnorm_weight = rmsnorm_weight.contiguous()
            out = torch.empty_like(x_rms)  # _layer_norm_fwd(out=None)
            rstd = torch.empty((ngroups * batch * seqlen,), dtype=torch.float32, device=x_rms.device)
            out = out.view(batch, seqlen, dim)
        if outproj_weight is not None:
            if torch.is_autocast_enabled():
                dtype = torch.get_autocast_dtype("cuda")
                out, outproj_weight = out.to(dtype), outproj_weight.to(dtype)
                outproj_bias = outproj_bias.to(dtype) if outproj_bias is not None else None
            out = F.linear(out, outproj_weight, outproj_bias)
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, a, d, dt_bias, rmsnorm_weight, rstd,
                              outproj_weight, outproj_bias)
        ctx.chunk_size, ctx.headdim, ctx.ngroups, ctx.dstate = chunk_size, headdim, ngroups, dstate
        ctx.autocast = torch.is_autocast_enabled()  # custom_bwd runs the backward under the forward's autocast
        del xbc_conv, x, b, c, dt_out, da_cumsum, states, final_states
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        zxbcdt, conv1d_weight, conv1d_bias, out, a, d, dt_bias, rmsnorm_weight, rstd, outproj_weight, \
            outproj_bias = ctx.saved_tensors
        headdim, ngroups, dstate = ctx.headdim, ctx.ngroups, ctx.dstate
        nheads = d.shape[0]
        dim = nheads * headdim
        recompute_output = outproj_weight is not None
        out_recompute = (torch.empty(*out.shape[:2], dim, device=out.device, dtype=out.dtype)
                         if recompute_output else None)
        z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        xbc_conv = _conv_fwd(xbc)
        x, b, c = torch.split(xbc_conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        x, b, c = x.unflatten(-1, (nheads, headdim)), b.unflatten(-1, (ngroups, dstate)), c.unflatten(
            -1, (ngroups, dstate))
        dzxbcdt = torch.empty_like(zxbcdt)
        dz, dxbc_given, ddt_given = torch.split(dzxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        dxbc = torch.empty_like(xbc)
        dx, db, dc = torch.split(dxbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        dx, db, dc = dx.unflatten(-1, (nheads, headdim)), db.unflatten(-1, (ngroups, dstate)), dc.unflatten(
            -1, (ngroups, dstate))
        dout_og = dout
        if recompute_output:
            dout = F.linear(dout, outproj_weight.t())
        dout = dout.view(*dout.shape[:2], nheads, headdim)
        held: tuple[torch.Tensor, ...] = ()  # what the library's backward keeps in its locals to its end
        if rmsnorm_weight is None:  # the scan gates its own output (Falcon-H1 without mamba_rms_norm)
            da, dd, ddt_bias, outz = _scan_bwd(
                dout, x, dt, a, b, c, d, dt_bias, ctx.chunk_size, dx, ddt_given, db, dc,
                z=z.unflatten(-1, (nheads, headdim)), dz=dz.unflatten(-1, (nheads, headdim)), out=out,
                recompute_output=recompute_output)
            out_for_linear = outz.flatten(-2) if recompute_output else None
            drmsnorm_weight = None
        else:
            # _layer_norm_bwd(dy, x, weight, ..., rstd, z, dz=dz, out=out1_recompute): dx, _dw's row groups
            dx_rms = torch.empty_like(out.reshape(-1, dim))
            block_n = min(65536 // dx_rms.element_size(), _next_power_of_2(dim // ngroups))
            num_warps = min(max(block_n // 256, 1), 8)
            nrow_groups = math.ceil(SM_COUNT * math.ceil(4 / num_warps) / ngroups)
            dw_part = torch.empty((nrow_groups, dim), dtype=torch.float32, device=rmsnorm_weight.device)
            drmsnorm_weight = dw_part.sum(0).to(rmsnorm_weight.dtype)
            del dw_part
            held = (dout,)
            dout = dx_rms.view(*out.shape[:2], nheads, headdim)
            da, dd, ddt_bias, _ = _scan_bwd(dout, x, dt, a, b, c, d, dt_bias, ctx.chunk_size, dx, ddt_given, db,
                                            dc)
            out_for_linear = out_recompute
        doutproj_weight = doutproj_bias = None
        if recompute_output:
            doutproj_weight = torch.einsum("bso,bsd->od", dout_og, out_for_linear)
            # sum is on CUDA autocast's fp32 list: under autocast it sums an fp32 copy of the gradient
            grad = dout_og.to(torch.float32) if ctx.autocast and outproj_bias is not None else dout_og
            doutproj_bias = grad.sum(dim=(0, 1)) if outproj_bias is not None else None
            del grad
        # causal_conv1d_bwd_function(ensure_stride(xBC), ..., ensure_stride(dxBC), dx=ensure_stride(dxBC_given)):
        # dweight / dbias in fp32, cast back; the arguments' copies live through the call, dx's after it
        conv_args = (_ensure_stride(xbc), _ensure_stride(dxbc))
        dx_given = _ensure_stride(dxbc_given)
        dweight = torch.zeros_like(conv1d_weight, dtype=torch.float32)
        dbias = torch.zeros_like(conv1d_bias, dtype=torch.float32) if conv1d_bias is not None else None
        dweight = dweight.type_as(conv1d_weight)
        dbias = dbias.type_as(conv1d_bias) if dbias is not None else None
        del conv_args
        if dx_given.stride() != dxbc_given.stride():
            dxbc_given.copy_(dx_given)
        del held, dx_given, xbc_conv, dxbc, dz
        return (dzxbcdt, dweight, dbias, ddt_bias, da, dd, None, None, drmsnorm_weight, None, doutproj_weight,
                doutproj_bias, None, None, None)


def split_conv1d_scan_combined(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                               dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, chunk_size: int,  # noqa: N803
                               initial_states: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                               dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False,
                               activation: str = "silu", rmsnorm_weight: torch.Tensor | None = None,
                               rmsnorm_eps: float = 1e-6, outproj_weight: torch.Tensor | None = None,
                               outproj_bias: torch.Tensor | None = None, headdim: int | None = None,
                               ngroups: int = 1, norm_before_gate: bool = True, **_: object) -> torch.Tensor:
    """mamba-ssm's ``mamba_split_conv1d_scan_combined`` (its signature), on :class:`SplitConv1dScanCombined`."""
    dim = D.shape[0] * (headdim if D.dim() == 1 else D.shape[1])
    if outproj_weight is not None and not outproj_weight.is_floating_point() and (
            tuple(outproj_weight.shape[1:]) != (dim,) or not torch.is_autocast_enabled()):
        raise SetupError(f"{QUANTIZED_OUT_PROJ} ({outproj_weight.dtype} codes of shape "
                         f"{tuple(outproj_weight.shape)})")
    if initial_states is not None or seq_idx is not None or return_final_states:
        raise NotImplementedError("initial states, seq_idx or final states: no transformers training step passes them")
    return SplitConv1dScanCombined.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, activation,
                                         rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim,
                                         ngroups, norm_before_gate)


def _fused_forward(self: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
    return split_conv1d_scan_combined(*args, **kwargs)


def runs_fused(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba-2 mixer that ``use_kernelized_func`` gave a wrapper of the fused function (its
    ``_kernel_funcs``): in training without a cache it calls nothing else."""
    return any(getattr(type(f), "kernel_layer_name", None) == MAMBA2_FUSED
               for f in (vars(module).get("_kernel_funcs") or {}).values())


def kernelize_mamba(model: nn.Module) -> int:
    """mamba-ssm's fused Mamba-2 mixer as ``kernelize(model, mode=Mode.TRAINING, device="cuda")`` puts it in: every
    module whose ``use_kernelized_func`` wrapper of a function decorated ``use_kernel_func_from_hub_with_fallback(
    "mamba_split_conv1d_scan_combined", ...)`` (its ``_kernel_funcs``) gets the layer's forward (its conv, where
    called: core/simulation/causal_conv1d.py). Returns how many Mamba-2 mixers got it."""
    return bind_funcs(model, MAMBA2_FUSED, _fused_forward)


def bypassed_adapters(model: nn.Module) -> list[str]:
    """The Mamba-2 mixers whose ``out_proj`` is a peft tuner layer that the fused Function bypasses (it multiplies
    by ``out_proj.weight``, the base layer's): the adapter is not applied and gets no gradient."""
    return [name for name, module in model.named_modules() if runs_fused(module)
            and callable(getattr(getattr(module, "out_proj", None), "get_base_layer", None))]
