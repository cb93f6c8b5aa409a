"""Unsloth's attention (issue 29: ``attention`` in ``--unsloth-kernels``, in ``all``): unsloth 2026.10.9's
``run_attention`` on its default install, xformers' ``memory_efficient_attention`` fed k and v repeated to every
query head (a copy the kernel saves).

Held three ways (the estimate against the built-in builder with it installed, exactly, and against transformers'
classes under peft with their attention interface replaced); the default estimate rises by the repeated k and v; what
it does not model refused; and, in ``make conformance``, the XFORMERS branch of unsloth's own ``_run_attention``, read
from its unpacked wheel and run on CPU with xformers' kernel standing in as torch's SDPA, allocates what the
reference allocates.
"""

from __future__ import annotations

import pytest

from tests.support.three_ways import held_three_ways
from tests.support.unsloth_source import definitions, run_definitions, unsloth_source
from tests.test_unsloth_kernels import LLAMA, SETUPS, _allocs
from vramlab.core.checks import SetupError
from vramlab.core.spec.unsloth import UNSLOTH_DEFAULT, attention_note, unsloth_patch

pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_the_kernel_keeps_k_and_v_repeated_on_the_builder_and_transformers_classes() -> None:
    """The estimate with the kernel equals the builder and transformers' classes with it installed; the repeated k
    and v it saves (where SDPA's enable_gqa keeps them at their kv heads) raise the peak."""
    base = SETUPS["lora"].replace(seq_len=64, micro_batch=1, unsloth_kernels="rope")
    est, own = held_three_ways(LLAMA, base.replace(unsloth_kernels="rope,attention"), base)
    # per layer: k and v at num_heads instead of num_kv_heads, each b x s x heads x head_dim bf16
    extra = LLAMA.num_layers * 2 * 64 * (LLAMA.num_heads - LLAMA.num_kv_heads) * LLAMA.head_dim * 2
    assert est.peak_allocated_bytes - own.peak_allocated_bytes == extra
    assert any("xformers" in n and "FlashAttention-2" in n for n in est.notes)
    assert any("not modelled (attention not in" in n for n in own.notes)


def test_the_kernel_under_autocast_as_llama_factorys_unsloth_runs_it() -> None:
    """LLaMA-Factory's use_unsloth: fp32 adapters under HF Trainer's bf16 autocast (the run was refused)."""
    base = SETUPS["lora"].replace(seq_len=64, micro_batch=1, unsloth_kernels="rope", amp=True)
    assert base.autocast
    held_three_ways(LLAMA, base.replace(unsloth_kernels="rope,attention"), base)


@pytest.mark.slow
def test_the_kernel_under_the_lora_kernels_and_unsloths_checkpointing() -> None:
    """Checkpointing's first forward runs under no_grad: xformers is handed k and v at their kv heads there."""
    setup = SETUPS["qlora-checkpointing"].replace(seq_len=64, unsloth_gc=True, unsloth_kernels="lora_mlp,lora_qkv,rope")
    held_three_ways(LLAMA, setup.replace(unsloth_kernels="lora_mlp,lora_qkv,rope,attention"), setup)


def test_the_default_run_has_it_and_what_is_not_modelled_is_refused() -> None:
    from vramlab.core.catalog import find_model

    assert "attention" in UNSLOTH_DEFAULT
    setup = SETUPS["lora"].replace(unsloth_kernels="all")
    assert unsloth_patch(LLAMA, setup).attention
    gemma2 = find_model("gemma-2-2b")  # its softcapped torch attention: named, not modelled
    assert not unsloth_patch(gemma2, setup).attention
    assert "slow_attention_softcapping" in attention_note(gemma2, setup)
    with pytest.raises(SetupError, match="keep rope"):
        unsloth_patch(LLAMA, SETUPS["lora"].replace(unsloth_kernels="attention"))
    with pytest.raises(SetupError, match="attn_implementation"):
        unsloth_patch(LLAMA, setup.replace(attention="eager"))
    with pytest.raises(SetupError, match="FastModel"):
        unsloth_patch(find_model("phi-3-mini-4k"), SETUPS["lora"].replace(unsloth_kernels="rope,attention"))


# ---- against unsloth's own code (make conformance: its wheel unpacked, named by VRAMLAB_UNSLOTH_SRC) --------------

def _xformers_branch():  # noqa: ANN202
    """The body of ``_run_attention``'s ``elif backend == XFORMERS:`` as a function of the names it reads."""
    import ast

    import torch
    import torch.nn.functional as F

    src = unsloth_source("unsloth", "utils", "attention_dispatch.py")
    fn = definitions(src, ("_run_attention",))[0]
    body = next(n.orelse[0].body for n in ast.walk(fn) if isinstance(n, ast.If) and n.orelse
                and isinstance(n.orelse[0], ast.If) and ast.unparse(n.orelse[0].test) == "backend == XFORMERS")
    names = ("Q", "K", "V", "config", "context", "bsz", "q_len", "kv_seq_len", "n_heads", "head_dim",
             "requires_grad", "sliding_window", "direction", "xformers_kwargs")
    wrapper = ast.parse(f"def branch({', '.join(names)}):\n    pass").body[0]
    wrapper.body = body

    def kernel(q, k, v, attn_bias=None):  # noqa: ANN001, ANN202 - xformers' saved tensors: torch's fused SDPA's
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    ns = dict(torch=torch, xformers=None, XFORMERS_BLOCK_DIAG_CLS=None, xformers_attention=kernel,
              build_xformers_block_causal_mask=lambda *a, **k: None, move_xformers_attention_bias=lambda b, d: b)
    return run_definitions(src, [wrapper], ns)["branch"]


def test_the_attention_allocates_what_unsloths_own_branch_allocates() -> None:
    """k and v expanded and reshaped (copies) and handed to the kernel with q; in backward the kernel's gradients
    at every query head, summed back to the kv heads."""
    from types import SimpleNamespace

    import torch

    from vramlab.core.simulation.unsloth_attention import xformers_attention

    branch = _xformers_branch()
    b, s, h, kv, d = 2, 24, 4, 2, 16

    def run(theirs: bool) -> None:
        x = torch.randn(b, s, (h + 2 * kv) * d, dtype=torch.bfloat16).requires_grad_()
        y = x * 2  # the projections' outputs, viewed as heads
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in y.split([h * d, kv * d, kv * d], dim=-1))
        if theirs:
            config = SimpleNamespace(n_groups=h // kv, n_kv_heads=kv)
            context = SimpleNamespace(causal_mask=None, is_causal=True, seq_info=None)
            out = branch(q, k, v, config, context, b, s, s, h, d, True, None, {}, {})
        else:
            out = xformers_attention(q, k, v, None).transpose(1, 2)
        out.float().sum().backward()

    assert _allocs(lambda: run(True)) == _allocs(lambda: run(False))
