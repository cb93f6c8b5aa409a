"""Unsloth's RoPE kernel (issue 29 item 5: ``rope`` in ``--unsloth-kernels``, in ``all``): unsloth 2026.10.9's
``fast_rope_embedding`` as ``LlamaAttention_fast_forward`` calls it in training (``Fast_RoPE_Embedding_QK_Positions``).

Held three ways (the estimate against the built-in builder with the kernel installed, exactly, and against
transformers' classes under peft with their ``apply_rotary_pos_emb`` replaced); the families it does not run on
refused; and, in ``make conformance``, unsloth's own autograd function, read from its unpacked wheel and run on CPU
with the Triton launch a no-op, allocates what the reference allocates.
"""

from __future__ import annotations

import pytest

from tests.support.three_ways import held_three_ways
from tests.support.unsloth_source import definitions, run_definitions, unsloth_source
from tests.test_unsloth_kernels import LLAMA, SETUPS, _allocs
from vramlab.core.checks import SetupError
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import UNSLOTH_DEFAULT, unsloth_patch

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _allocations(result) -> int:  # noqa: ANN001
    steps = result.timeline
    return sum(1 for (_, a), (_, b) in zip(steps, steps[1:]) if b > a)


def test_the_kernel_rotates_in_place_on_the_builder_and_transformers_classes() -> None:
    """The estimate with the kernel equals the builder and transformers' classes with it installed; transformers'
    own RoPE makes its products, rotations and their gradients where the kernel makes only two gradients."""
    from vramlab.core.simulation.simulate import simulate

    base = SETUPS["lora"].replace(seq_len=64, micro_batch=1)
    setup = base.replace(unsloth_kernels="rope")
    est, own = held_three_ways(LLAMA, setup, base)
    assert any("xformers" in n for n in est.notes) and not any("xformers" in n for n in own.notes)  # named
    assert _allocations(simulate(LLAMA, setup)) < _allocations(simulate(LLAMA, base))


@pytest.mark.slow
def test_the_kernel_under_lora_qkv_and_checkpointing() -> None:
    setup = SETUPS["qlora-checkpointing"]
    held_three_ways(LLAMA, setup.replace(unsloth_kernels="lora_qkv,rope", unsloth_gc=True), setup)


def test_the_default_run_has_it_and_the_families_it_does_not_run_on_are_refused() -> None:
    assert "rope" in UNSLOTH_DEFAULT
    assert unsloth_patch(LLAMA, SETUPS["lora"].replace(unsloth_kernels="all")).rope
    full = TrainingSetup(method="full", seq_len=64, unsloth_kernels="rope")  # its attention forward runs there too
    assert unsloth_patch(LLAMA, full).rope
    from vramlab.core.catalog import find_model

    with pytest.raises(SetupError, match="fast_qk_norm_rope"):  # Qwen 3's q / k norms: fused with RoPE on CUDA
        unsloth_patch(find_model("qwen3-0.6b"), SETUPS["lora"].replace(unsloth_kernels="rope"))
    with pytest.raises(SetupError, match="FastModel"):
        unsloth_patch(find_model("phi-3-mini-4k"), SETUPS["lora"].replace(unsloth_kernels="rope"))


# ---- against unsloth's own function (make conformance: its wheel unpacked, named by VRAMLAB_UNSLOTH_SRC) ----------

def _unsloth_rope():  # noqa: ANN202
    import contextlib

    import torch

    src = unsloth_source("unsloth", "kernels", "rope_embedding.py")
    keep = definitions(src, ("Fast_RoPE_Embedding_QK_Positions", "_bshd_buffer", "_fast_rope_embedding_eager",
                             "fast_rope_embedding"))
    ns = dict(torch=torch, torch_gpu_device=lambda d: contextlib.nullcontext(), _eager_kernel=None,
              _rope_launch=lambda *a, **k: None, _sync_if_split=lambda q: None)
    return run_definitions(src, keep, ns)["fast_rope_embedding"]


@pytest.mark.parametrize("strided", [False, True])
def test_the_rope_allocates_what_unsloths_own_allocates(strided: bool) -> None:
    """A projection's output viewed as heads (rotated in place), or a (batch, heads, seq, head_dim) tensor (written
    into a fresh buffer); in backward, a fresh gradient for each."""
    import torch

    from vramlab.core.simulation.unsloth_rope import fast_rope_embedding as ours

    theirs = _unsloth_rope()

    def run(fn) -> None:  # noqa: ANN001
        x = torch.randn(2, 24, 64, dtype=torch.bfloat16).requires_grad_()
        cos, sin = torch.randn(1, 24, 16, dtype=torch.bfloat16), torch.randn(1, 24, 16, dtype=torch.bfloat16)
        q, k = x * 2, x[..., :32] * 3
        if strided:
            q, k = q.view(2, 24, 4, 16).permute(0, 2, 1, 3).contiguous(), k.view(2, 24, 2, 16).permute(0, 2, 1, 3)
        else:
            q, k = q.view(2, 24, 4, 16).transpose(1, 2), k.view(2, 24, 2, 16).transpose(1, 2)
        q, k = fn(q, k, cos, sin)
        (q.float().sum() + (k * 2).sum()).backward()

    assert _allocs(lambda: run(theirs)) == _allocs(lambda: run(ours))
