"""Unsloth's fused LoRA kernels (issue 29 item 5: ``LoRA_MLP``, ``LoRA_QKV``, ``LoRA_W`` of unsloth 2026.10.9, what
``FastLanguageModel.get_peft_model`` and LLaMA-Factory's ``use_unsloth`` run).

Held three ways: the estimate against the built-in builder with the kernels installed (exactly, phase by phase)
and against transformers' classes under peft with the same kernels installed by core/simulation/unsloth.py's
``patch_model`` (within HF's few small buffers); the families unsloth dispatches elsewhere refused; the configs'
keys read (LLaMA-Factory's ``use_unsloth``; axolotl 0.19.0's removed ``unsloth_*`` keys refused, as axolotl does).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.three_ways import held_three_ways
from tests.support.unsloth_source import definitions, run_definitions, unsloth_source
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import unsloth_patch

pytest.importorskip("transformers")
pytest.importorskip("peft")

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)

# transformers' torch norms beside them (without the Hub's RMSNorm, whose tensors Unsloth's frozen-weight norm keeps
# too: with it on, rms_norm changes nothing)
SETUPS = {
    "lora": TrainingSetup(method="lora", lora_targets="all-linear", seq_len=256, micro_batch=2, hub_kernels=False),
    "qlora": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256, micro_batch=2, hub_kernels=False),
    "qlora-checkpointing": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256, grad_ckpt=True,
                                         hub_kernels=False),
    "lora-attention": TrainingSetup(method="lora", lora_targets="q_proj,k_proj,v_proj,o_proj", seq_len=200,
                                    hub_kernels=False),
}


@pytest.mark.parametrize("name", ["lora", "qlora", pytest.param("qlora-checkpointing", marks=pytest.mark.slow),
                                  pytest.param("lora-attention", marks=pytest.mark.slow)])
def test_the_estimate_matches_the_kernels_on_transformers_classes(name: str) -> None:
    setup = SETUPS[name].replace(unsloth_kernels="all")
    est, own = held_three_ways(LLAMA, setup, SETUPS[name])
    if not setup.grad_ckpt:  # activations hold the peak: the kernels keep no fp32 input copies nor h
        assert est.peak_allocated_bytes < own.peak_allocated_bytes


@pytest.mark.parametrize("name", ["lora", pytest.param("qlora", marks=pytest.mark.slow)])
def test_the_cross_entropy_keeps_the_logits_in_their_dtype(name: str) -> None:
    """UnslothForCausalLMLoss in transformers' loss's place: no fp32 upcast, the logits' gradient in their dtype."""
    est, own = held_three_ways(LLAMA, SETUPS[name].replace(unsloth_kernels="cross_entropy"), SETUPS[name])
    assert est.peak_allocated_bytes < own.peak_allocated_bytes


@pytest.mark.slow
def test_the_cross_entropy_over_a_large_vocabulary_goes_a_block_at_a_time() -> None:
    spec = dataclasses.replace(LLAMA, vocab_size=140000)  # over the H100's 65536 block: two blocks per row
    held_three_ways(spec, SETUPS["lora"].replace(unsloth_kernels="all,cross_entropy"), SETUPS["lora"])


def test_the_cross_entropy_beside_another_loss_is_refused_and_under_trl_does_nothing() -> None:
    with pytest.raises(SetupError, match="both replace transformers' loss"):
        SETUPS["lora"].replace(unsloth_kernels="cross_entropy", loss_kernel="liger").validate(LLAMA)
    dpo = SETUPS["lora"].replace(unsloth_kernels="cross_entropy", objective="dpo")
    assert unsloth_patch(LLAMA, dpo) is None
    assert any("never runs" in w for w in dpo.warnings(LLAMA))


def test_each_kernel_is_its_own_switch() -> None:
    s = SETUPS["lora"]
    peaks = {k: estimate(LLAMA, s.replace(unsloth_kernels=k), match_simulation=True).peak_allocated_bytes
             for k in ("none", "lora_mlp", "lora_qkv", "lora_o", "rms_norm", "all", "all,cross_entropy")}
    assert len(set(peaks.values())) == 7
    assert peaks["all,cross_entropy"] == min(peaks.values())


def _small(preset: str) -> ModelSpec:
    from vramlab.core.catalog import find_model

    return dataclasses.replace(find_model(preset), num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                               head_dim=64, intermediate_size=512, vocab_size=32000)


@pytest.mark.parametrize("preset", ["phi-3-mini-4k", "gemma-3-1b", "mixtral-8x7b"])
def test_families_unsloth_loads_through_fastmodel_are_refused(preset: str) -> None:
    from vramlab.core.catalog import find_model

    with pytest.raises(SetupError, match="FastModel"):
        SETUPS["lora"].replace(unsloth_kernels="all").validate(find_model(preset))


def test_qwen2s_biased_qkv_runs_peft_and_its_other_projections_the_kernels() -> None:
    spec = _small("qwen2.5-0.5b")
    assert spec.qkv_bias
    patch = unsloth_patch(spec, SETUPS["lora"].replace(unsloth_kernels="all"))
    assert patch is not None and not patch.qkv and patch.o and patch.mlp


@pytest.mark.parametrize("change", [dict(method="full"), dict(use_dora=True), dict(weights="fp32"),
                                    dict(lora_targets="q_proj,v_proj")])
def test_where_unsloth_falls_back_to_peft_the_option_changes_nothing(change: dict) -> None:
    setup = SETUPS["lora"].replace(unsloth_kernels="lora_mlp,lora_qkv,lora_o", **change)
    assert unsloth_patch(LLAMA, setup) is None
    assert any("change nothing, as peft's own layers run" in w for w in setup.warnings(LLAMA))


def test_the_rms_norm_keeps_the_input_and_a_statistic_per_row() -> None:
    """fast_rms_layernorm on every norm: transformers' RMSNorm keeps fp32 copies of its input instead."""
    est, own = held_three_ways(LLAMA, SETUPS["lora"].replace(unsloth_kernels="rms_norm"), SETUPS["lora"])
    assert est.peak_allocated_bytes < own.peak_allocated_bytes


def test_what_is_not_modelled_is_refused() -> None:
    with pytest.raises(SetupError, match="fused with RoPE"):  # Qwen 3's q / k norms: fast_qk_norm_rope
        SETUPS["lora"].replace(unsloth_kernels="rms_norm").validate(_small("qwen3-0.6b"))
    with pytest.raises(SetupError, match="trained norm weights"):
        SETUPS["lora"].replace(unsloth_kernels="all", method="full").validate(LLAMA)
    with pytest.raises(SetupError, match="lora_dropout"):
        SETUPS["lora"].replace(unsloth_kernels="all", lora_dropout=0.05).validate(LLAMA)
    with pytest.raises(SetupError, match="Unsloth kernels must be"):
        TrainingSetup(unsloth_kernels="xformers")


def test_llamafactorys_use_unsloth_turns_the_kernels_on(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "lf.yaml"
    cfg.write_text("model_name_or_path: x\nstage: sft\nfinetuning_type: lora\nlora_target: all\nuse_unsloth: true\n")
    src = read_training_configs([cfg])
    assert src.changes["unsloth_kernels"] == ["lora_mlp", "lora_qkv", "lora_o", "rms_norm", "rope", "attention",
                                              "fused_loss"]
    row = next(r for r in src.rows if r.key == "use_unsloth" and r.field == "unsloth_kernels")
    assert "fused loss" in row.note  # what the row does not model is named
    assert src.changes["unsloth_gc"] is True  # its checkpointing, with LLaMA-Factory's default checkpointing on


def test_axolotls_removed_unsloth_keys_are_refused(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "ax.yaml"
    cfg.write_text("base_model: x\nadapter: lora\nlora_target_linear: true\nunsloth_lora_mlp: true\n")
    row = next(r for r in read_training_configs([cfg]).rows if r.key == "unsloth_lora_mlp")
    assert row.status == "refused" and "removed from axolotl" in row.note


# ---- against unsloth's own functions (a conformance check: unsloth needs a GPU and triton at import, so its
# fast_lora.py is read from the unpacked wheel, `pip download unsloth==2026.10.9 --no-deps`, named by
# VRAMLAB_UNSLOTH_SRC, and its autograd functions run on CPU with the Triton kernels' allocations stubbed)

def _unsloth_functions():  # noqa: ANN202
    import torch

    src = unsloth_source("unsloth", "kernels", "fast_lora.py")
    keep = definitions(src, ("LoRA_MLP", "LoRA_W", "LoRA_QKV", "_add_lora_dX", "_dropout_replay", "_lora_bias_grad",
                             "_dropout_forward", "_matmul_lora_ext", "_may_overwrite_input"))
    keep += definitions(unsloth_source("unsloth", "kernels", "utils.py"), ("matmul_lora",))

    class _Never:
        pass

    ns = dict(torch=torch, torch_matmul=torch.matmul, Float8Tensor=_Never, Int4QuantState=_Never,
              _is_packed_state=lambda q: False, fast_dequantize=lambda W, q=None, **k: W,
              addmm_=lambda out, A, B, alpha=1.0, beta=1.0: out.addmm_(A, B, alpha=alpha, beta=beta),
              torch_amp_custom_fwd=lambda f: f, torch_amp_custom_bwd=lambda f: f, _is_compiling=lambda: False,
              _rms_layernorm=type("N", (), {"_SAVE_OUTPUT": False}))
    return run_definitions(src, keep, ns)


def _allocs(fn) -> list[int]:  # noqa: ANN001
    """Live bytes after each allocation of ``fn`` (frees between allocations, whatever their order, in)."""
    from vramlab.core.simulation.tracker import MemoryTracker

    tracker = MemoryTracker(block=1)
    with tracker:
        fn()
    out, prev = [], 0
    for _, c in tracker.timeline:
        if c > prev:
            out.append(c)
        prev = c
    return out


def test_the_references_allocate_what_unsloths_own_functions_allocate() -> None:
    """LoRA_W, LoRA_MLP and LoRA_QKV with a 16-bit base (an NF4 one dequantizes in Triton or bitsandbytes' CUDA
    library, which no CPU run reaches)."""
    import torch
    from torch import nn

    from vramlab.core.simulation import unsloth as ours

    ns = _unsloth_functions()

    def layer(o: int, i: int) -> nn.Module:
        m = nn.Module()
        m.weight = nn.Parameter(torch.randn(o, i, dtype=torch.bfloat16), requires_grad=False)
        m.lora_A, m.lora_B, m.scaling = nn.Parameter(torch.randn(4, i)), nn.Parameter(torch.randn(o, 4)), 2.0
        return m

    def run(theirs: bool, kind: str) -> None:
        x = torch.randn(2, 12, 32, dtype=torch.bfloat16).requires_grad_()
        if kind == "qkv":
            q, k, v = layer(32, 32), layer(16, 32), layer(16, 32)
            if theirs:
                out = ns["LoRA_QKV"].apply(x, q.weight, None, q.lora_A, q.lora_B, 2.0, k.weight, None, k.lora_A,
                                           k.lora_B, 2.0, v.weight, None, v.lora_A, v.lora_B, 2.0)
            else:
                ws = tuple(ours.Weight(m, ours.Scratch()) for m in (q, k, v))
                out = ours.LoRAQKV.apply(x, q.lora_A, q.lora_B, k.lora_A, k.lora_B, v.lora_A, v.lora_B, ws)
            y = out[0].sum() + out[1].sum() + out[2].sum()
        elif kind == "o":
            m = layer(32, 32)
            y = (ns["LoRA_W"].apply(x, m.weight, None, m.lora_A, m.lora_B, 2.0) if theirs
                 else ours.LoRAW.apply(x, m.lora_A, m.lora_B, ours.Weight(m, ours.Scratch())))
        else:
            g, u, d = layer(64, 32), layer(64, 32), layer(32, 64)

            def fwd(e, gg):  # noqa: ANN001, ANN202 - swiglu_fg_kernel's output
                return torch.empty(e.shape, dtype=e.dtype)
            if theirs:
                y = ns["LoRA_MLP"].apply(x, g.weight, None, g.lora_A, g.lora_B, 2.0, u.weight, None, u.lora_A,
                                         u.lora_B, 2.0, d.weight, None, d.lora_A, d.lora_B, 2.0, fwd,
                                         lambda DW, e, gg: (DW, e, gg))
            else:
                ws = tuple(ours.Weight(m, ours.Scratch()) for m in (g, u, d))
                y = ours.LoRAMLP.apply(x, g.lora_A, g.lora_B, u.lora_A, u.lora_B, d.lora_A, d.lora_B, ws)
        y.backward(torch.ones_like(y))

    for kind in ("o", "mlp", "qkv"):
        assert _allocs(lambda k=kind: run(True, k)) == _allocs(lambda k=kind: run(False, k))


def _unsloth_cross_entropy():  # noqa: ANN202
    """unsloth's ``Fast_CrossEntropyLoss`` and ``fast_cross_entropy_loss`` from its source, Triton launches as
    no-ops, CUDA's block size (H100), and torch.logsumexp as ATen runs it on CUDA (the CPU kernel hides its
    temporaries from the tracker)."""
    import contextlib

    import torch

    from vramlab.core.simulation.unsloth import _cuda_logsumexp

    src = unsloth_source("unsloth", "kernels", "cross_entropy_loss.py")
    keep = definitions(src, ("Fast_CrossEntropyLoss", "fast_cross_entropy_loss"))

    class _Launch:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *a, **k: None

    class _Torch:  # torch, with logsumexp as CUDA runs it
        def __getattr__(self, name: str):  # noqa: ANN204
            return (lambda x, dim: _cuda_logsumexp(x)) if name == "logsumexp" else getattr(torch, name)

    ns = dict(torch=_Torch(), MAX_FUSED_SIZE=65536, calculate_settings=lambda n: (65536, 32), is_cdna=lambda: False,
              torch_gpu_device=lambda d: contextlib.nullcontext(), _chunked_forward_config=lambda d, v: (65536, 32),
              _chunked_evict_policy=lambda d: "", _cross_entropy_forward=_Launch(),
              _chunked_cross_entropy_forward=_Launch(), _cross_entropy_backward=_Launch())
    return run_definitions(src, keep, ns)["fast_cross_entropy_loss"]


@pytest.mark.parametrize("vocab", [500, 140000])
def test_the_cross_entropy_allocates_what_unsloths_own_allocates(vocab: int) -> None:
    import torch

    from vramlab.core.simulation import unsloth as ours

    theirs = _unsloth_cross_entropy()

    def run(fn) -> None:  # noqa: ANN001
        logits = torch.randn(2, 20, vocab, dtype=torch.bfloat16).requires_grad_()
        labels = torch.randint(0, vocab, (2, 20))
        labels[:, ::5] = -100
        fn(logits, labels).backward()

    assert _allocs(lambda: run(theirs)) == _allocs(lambda: run(ours.fast_cross_entropy_loss))


@pytest.mark.parametrize("fmt", ["axolotl", "llamafactory", "trl"])
def test_an_export_with_unsloths_kernels_is_refused(fmt: str) -> None:
    """use_unsloth would run unsloth's fused loss and offloaded checkpointing besides: not what was estimated."""
    from vramlab.core.sources.export import export_setup

    with pytest.raises(SetupError, match="Unsloth's kernels"):
        export_setup(SETUPS["qlora"].replace(unsloth_kernels="all"), fmt, model="meta-llama/Llama-2-7b-hf")


@pytest.mark.parametrize("gemma", [False, True])
def test_the_rms_norm_allocates_what_unsloths_own_allocates(gemma: bool) -> None:
    """``fast_rms_layernorm`` as FastLanguageModel's decoder layers call it (``reuse_grad``, a frozen weight), from
    unsloth's source with its Triton launches as no-ops, against Liger's reference that stands for it."""
    import contextlib

    import torch

    from vramlab.core.simulation import liger

    src = unsloth_source("unsloth", "kernels", "rms_layernorm.py")
    keep = definitions(src, ("Fast_RMS_Layernorm", "_rms_forward", "_rms_backward", "_rms_sum_partials"))
    kernels = {n.name: None for n in definitions(src, lambda name: name.endswith(("_forward", "_backward")))}
    ns = dict(kernels, torch=torch, torch_gpu_device=lambda d: contextlib.nullcontext(), _eager_kernel=None,
              _multirow_checked=lambda *a: None, long_indexing=lambda *a, **k: False, _INDEX_MARGIN=0,
              _settings=lambda n, d, **k: (1024, 4), _launch=lambda *a, **k: None, _SAVE_OUTPUT=False,
              _rms_layernorm_forward=None, _rms_layernorm_backward=None)
    run_definitions(src, keep, ns)
    patch = unsloth_patch(_small("gemma-2b") if gemma else LLAMA,
                          SETUPS["lora"].replace(unsloth_kernels="rms_norm")).rms_norm

    def run(theirs: bool) -> None:
        w = torch.randn(96, dtype=torch.bfloat16)
        x = torch.randn(2, 30, 96, dtype=torch.bfloat16).requires_grad_()
        y = (ns["Fast_RMS_Layernorm"].apply(x, w, 1e-6, gemma, True, True) if theirs
             else liger.rms_norm(x, w, patch))
        (y * 2).sum().backward()

    assert _allocs(lambda: run(True)) == _allocs(lambda: run(False))


def test_the_nf4_scratch_buffer_grows_and_is_kept_as_unsloths_is() -> None:
    """``fast_dequantize`` with its NF4 kernels (CUDA's branch, the launches stubbed): into the ``_scratch`` buffer
    with ``use_global_buffer`` (a new one where a larger weight comes, each weight's ``_unsloth_nf4_plan`` holding
    the one it used), else into a fresh tensor; over two steps of a layer's seven weights, against the
    reference's :class:`Weight`."""
    import ast
    from types import SimpleNamespace

    import torch

    from vramlab.core.simulation import unsloth as ours

    src = unsloth_source("unsloth", "kernels", "utils.py")
    keep = definitions(src, ("_scratch", "_unpack_quant_state", "_quant_type", "_no_plan", "_NF4Plan",
                             "_gathered_plan_hit"))
    cuda = next(n for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.If)
                and any(isinstance(f, ast.FunctionDef) and f.name == "_fast_dequantize_ctypes" for f in n.body))
    keep += [f for f in cuda.body if isinstance(f, ast.FunctionDef) and f.name == "fast_dequantize"]

    class _Never:
        pass

    ns = dict(torch=torch, torch_empty=torch.empty, torch_Tensor=torch.Tensor, torch_float16=torch.float16,
              torch_bfloat16=torch.bfloat16, torch_float32=torch.float32, Float8Tensor=_Never,
              NVFP4QuantState=_Never, _USE_NF4_KERNELS=True, _SCRATCH={}, _can_use_scratch=lambda d: True,
              _current_device=lambda: None, dequantize_nf4_planned=lambda *a: (lambda out: True),
              # nf4.py dequantize_nf4: ``out = torch.empty(shape, dtype = dtype)`` when none is given
              dequantize_nf4=lambda *a, out=None: torch.empty(a[8], dtype=a[9]) if out is None else out)
    run_definitions(src, keep, ns)
    shapes = [(64, 32), (16, 32), (16, 32), (32, 64), (128, 32), (128, 32), (32, 128)]  # q k v o gate up down

    def theirs() -> None:
        states = []
        for rows, cols in shapes:
            qs = SimpleNamespace(absmax=torch.empty(rows * cols // 64), shape=torch.Size((rows, cols)),
                                 dtype=torch.bfloat16, blocksize=64, code=torch.empty(16), offset=None, state2=None,
                                 quant_type="nf4")
            states.append((torch.empty(rows * cols // 2, 1, dtype=torch.uint8), qs))
        for _ in range(2):
            for W, qs in states:  # forward: matmul_lora's use_global_buffer
                ns["fast_dequantize"](W, qs, use_global_buffer=True, dtype=torch.bfloat16)
            ns["fast_dequantize"](states[-1][0].t(), states[-1][1], use_global_buffer=True, dtype=torch.bfloat16)
            for W, qs in states[:-1]:  # backward: a fresh weight each
                out = ns["fast_dequantize"](W.t(), qs, dtype=torch.bfloat16)
                del out

    def mine() -> None:
        scratch, ws = ours.Scratch(), []
        for rows, cols in shapes:
            m = nn_module(rows, cols)
            ws.append((torch.empty(rows * cols // 64), torch.empty(16), torch.empty(rows * cols // 2, 1,
                                                                                    dtype=torch.uint8),
                       ours.Weight(m, scratch)))
        for _ in range(2):
            for *_, w in ws:
                w.dense(torch.bfloat16, True)
            ws[-1][-1].dense(torch.bfloat16, True, transposed=True)
            for *_, w in ws[:-1]:
                out = w.dense(torch.bfloat16, False, transposed=True)
                del out

    def nn_module(rows: int, cols: int):  # noqa: ANN202 - a builder Linear's attributes, its NF4 weight's shape
        return SimpleNamespace(qweight=SimpleNamespace(rows=rows, cols=cols), lora_A=torch.empty(0),
                               lora_B=torch.empty(0), scaling=1.0)

    assert _allocs(theirs) == _allocs(mine)
