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
    gemma2 = find_model("gemma-2-2b")  # its softcapped torch attention, not xformers
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


def test_the_kernels_backward_scratch_is_flashs_at_every_head() -> None:
    """xformers runs torch's FlashAttention-2 from sm80 (below: cutlass, whose workspace is named, not counted), on k
    and v already repeated: the reserved level holds flash's backward scratch of the model with a kv head per query
    head, not SDPA's kernel's (cuDNN on the H100, flash with dk / dv expanded on the A100)."""
    import dataclasses

    from vramlab.core.catalog import find_gpu
    from vramlab.core.estimate import estimate
    from vramlab.core.levels import flash_backward_scratch

    setup = SETUPS["lora"].replace(unsloth_kernels="all")
    every_head = dataclasses.replace(LLAMA, num_kv_heads=LLAMA.num_heads)
    for gpu in ("h100-sxm", "a100-sxm4-80gb"):
        overheads = {o.name: o.bytes for o in estimate(LLAMA, setup, find_gpu(gpu)).overheads}
        assert overheads.get("Flash-attention backward scratch") == flash_backward_scratch(every_head, setup), gpu
        assert "cuDNN attention backward workspace" not in overheads
    result = estimate(LLAMA, setup.replace(compute="fp16", weights="fp16"), find_gpu("t4"))
    assert not any("scratch" in o.name or "workspace" in o.name and "cuBLAS" not in o.name for o in result.overheads)
    assert any("cutlass" in n and "not counted" in n for n in result.notes)


def test_xformers_own_dispatch_picks_the_kernel_modelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """xformers 0.0.35's own ``_dispatch_fw`` / ``_dispatch_bw`` (its Python, from the unpacked wheel in
    VRAMLAB_UNSLOTH_SRC), asked with a CUDA build's answers (torch's flash built in, no flash_attn / flash_attn_3
    packages, as unsloth installs it) for Unsloth's call: bf16 (fp16 below sm80), (batch, seq, heads, head_dim),
    LowerTriangularMask, k and v repeated."""
    import sys

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.spec.unsloth import xformers_kernel

    root = unsloth_source("xformers", "ops", "fmha", "dispatch.py").parents[3]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability[0])
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m == "xformers" or m.startswith("xformers.")]:
        monkeypatch.delitem(sys.modules, name)
    from xformers.ops.fmha import common, dispatch
    from xformers.ops.fmha.attn_bias import LowerTriangularMask

    monkeypatch.setattr(common, "_built_with_cuda", True)  # the CUDA wheel's build metadata
    names = {"fa2F": "flash", "fa2B": "flash", "cutlassF": "efficient", "cutlassB": "efficient"}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for capability[0] in ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)):
            dtype = torch.bfloat16 if capability[0] >= (8, 0) else torch.float16
            q = torch.empty(1, 256, 32, 128, dtype=dtype, device="cuda")
            inp = common.Inputs(query=q, key=q, value=q, attn_bias=LowerTriangularMask())
            fw = dispatch._dispatch_fw(inp, True).NAME.split("@")[0].removesuffix("-pt")
            bw = dispatch._dispatch_bw(inp, None).NAME.split("@")[0].removesuffix("-pt")
            assert names[fw] == names[bw] == xformers_kernel(capability[0]), capability[0]


# ---- Gemma 2: unsloth's softcapped torch attention, compiled (slow_attention_softcapping) ----------------------------

def test_gemma2s_softcapped_attention_on_the_builder_and_transformers_classes() -> None:
    """Without flash-attn, Unsloth's Gemma 2 attention is its compiled softcapped one (not xformers): the estimate with
    it equals the builder and transformers' classes with it installed, and differs from transformers' eager
    attention, which it replaces (bf16 scores and probabilities kept where eager keeps the tanh's output, fp32
    probabilities and their bf16 copy)."""
    from tests.test_unsloth_kernels import _small

    gemma = _small("gemma-2-2b")
    base = SETUPS["lora"].replace(seq_len=64, micro_batch=1, unsloth_kernels="rope")
    setup = base.replace(unsloth_kernels="rope,attention")
    patch = unsloth_patch(gemma, setup)
    assert patch.softcap and not patch.attention
    est, own = held_three_ways(gemma, setup, base)
    assert est.peak_allocated_bytes < own.peak_allocated_bytes
    assert any("slow_attention_softcapping" in n and "modelled:" in n for n in est.notes)
    batch = setup.replace(micro_batch=2)  # its compiled graph above a batch of one: named, not modelled
    assert not unsloth_patch(gemma, batch).softcap
    assert "micro batch above 1" in attention_note(gemma, batch)


@pytest.mark.slow
def test_gemma2s_softcapped_attention_under_unsloths_checkpointing() -> None:
    """Checkpointing's first forward runs the inference graph (each buffer freed after its last use), its recompute
    the training one."""
    from tests.test_unsloth_kernels import _small

    setup = SETUPS["qlora-checkpointing"].replace(seq_len=64, unsloth_gc=True, unsloth_kernels="lora_mlp,lora_qkv,rope")
    gemma, softcapped = _small("gemma-2-2b"), setup.replace(unsloth_kernels="lora_mlp,lora_qkv,rope,attention")
    assert unsloth_patch(gemma, softcapped).softcap
    held_three_ways(gemma, softcapped, setup)


def _compiled_softcapping():  # noqa: ANN202
    """unsloth's ``_compiled_slow_attention_softcapping`` (``unsloth/kernels/flex_attention.py``, flex attention
    off) as written, compiled as its decorator compiles it (inductor, fullgraph, dynamic), for the CPU."""
    import ast

    import torch

    src = unsloth_source("unsloth", "kernels", "flex_attention.py")
    branch = next(n for n in ast.parse(src.read_text()).body
                  if isinstance(n, ast.If) and ast.unparse(n.test) == "not HAS_FLEX_ATTENTION")
    fn = next(n for n in branch.body
              if isinstance(n, ast.FunctionDef) and n.name == "_compiled_slow_attention_softcapping")
    assert [ast.unparse(d) for d in fn.decorator_list] == [
        "torch.compile(fullgraph=True, dynamic=True, options=torch_compile_options)"]
    fn.decorator_list = []
    torch._dynamo.reset()
    f = run_definitions(src, [fn], {"torch": torch})["_compiled_slow_attention_softcapping"]
    return torch.compile(f, fullgraph=True, dynamic=True)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (6, 3)])
def test_the_softcapped_attention_allocates_what_unsloths_own_compiled_function_allocates(
        monkeypatch: pytest.MonkeyPatch, grad: bool, heads: tuple[int, int]) -> None:
    """unsloth's function compiled by inductor and run on CPU (a batch of one), each buffer its generated code
    allocates (``empty_strided_cpu``) recorded with its lifetime, against :func:`softcap_attention` under the tracker:
    the forward's allocations and frees alike, in order (what the graph keeps included); in backward, which frees
    each kept tensor at its last use where ours go as their node returns, the same most bytes live."""
    import contextlib
    import itertools
    import weakref
    from types import SimpleNamespace

    import torch
    from torch._inductor.codecache import PyCodeCache

    from vramlab.core.simulation.tracker import MemoryTracker
    from vramlab.core.simulation.unsloth_attention import softcap_attention

    compiled = _compiled_softcapping()
    h, kv = heads
    b, s, d = 1, 64, 16
    config = SimpleNamespace(num_attention_heads=h, num_key_value_heads=kv, query_pre_attn_scalar=d,
                             attn_logit_softcapping=50.0)
    module = SimpleNamespace(config=config, head_dim=d, num_key_value_groups=h // kv)
    mask = torch.full((s, s), float("-inf")).triu(1).to(torch.bfloat16)  # unsloth's static (n, n) mask
    theirs: list[int] = []  # bytes allocated (+) and freed (-) by the compiled code's buffers
    tracker = MemoryTracker(block=1)

    def step(ours: bool) -> int:
        """One forward (and backward); the number of events its forward made."""
        y = torch.randn(b, s, (h + 2 * kv) * d, dtype=torch.bfloat16)  # the projections' outputs, as heads
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2).detach().requires_grad_(grad)
                   for t in y.split([h * d, kv * d, kv * d], dim=-1))
        g = torch.randn(b, s, h, d, dtype=torch.bfloat16) if ours else torch.randn(b, s, h * d, dtype=torch.bfloat16)
        with torch.set_grad_enabled(grad), (tracker if ours else contextlib.nullcontext()):
            out = softcap_attention(q, k, v, mask, d ** -0.5) if ours else compiled(q, k, v, mask, module, b, s)
            forward = len(tracker.timeline) if ours else len(theirs)
            if grad:
                out.backward(g)
            del out
        return forward

    try:
        step(False)  # compiles
    except Exception as error:  # noqa: BLE001 - inductor's CPU code needs a C++ compiler
        pytest.skip(f"inductor cannot compile here: {error}")

    def recorded(empty):  # noqa: ANN001, ANN202
        def made(*args: object, **kwargs: object) -> torch.Tensor:
            t = empty(*args, **kwargs)
            n = t.untyped_storage().nbytes()
            theirs.append(n)
            weakref.finalize(t.untyped_storage(), theirs.append, -n)
            return t
        return made

    for mod in list(PyCodeCache.modules):
        if hasattr(mod, "empty_strided_cpu"):
            monkeypatch.setattr(mod, "empty_strided_cpu", recorded(mod.empty_strided_cpu))
    forward = step(False)
    assert theirs, "the compiled code allocated nothing recorded"
    ours_forward = step(True)
    live = [c for _, c in tracker.timeline]
    ours = [c - p for p, c in zip([0, *live], live)]
    assert ours[:ours_forward] == theirs[:forward]
    assert max(itertools.accumulate(ours)) == max(itertools.accumulate(theirs))


def test_the_estimate_and_the_simulation_carry_the_same_unsloth_notes() -> None:
    """One function says what an Unsloth run's result notes (core/spec/unsloth.py result_notes): the simulation's
    result carries the GPU its fused loss was sized for (no GPU named: the H100) and what its attention is, as the
    estimate's does."""
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate

    setup = SETUPS["lora"].replace(seq_len=64, micro_batch=1, unsloth_kernels="all")
    est, sim = estimate(LLAMA, setup), simulate(LLAMA, setup)
    for result in (est, sim):
        assert any("fused loss sized for" in n for n in result.notes)
        assert any(n == attention_note(LLAMA, setup) for n in result.notes)
    assert sim.setup == setup  # the setup asked, not the one with the GPU filled in
