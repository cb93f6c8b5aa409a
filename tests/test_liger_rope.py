"""Liger Kernel's RoPE (issue 29 item 5: ``liger_rotary_pos_emb``, on by default in the patch of every family that
takes it: ``use_liger_kernel``, LLaMA-Factory's ``enable_liger_kernel``, axolotl's ``liger_rope``).

The reference (core/simulation/liger.py ``LigerRopeFunction``) against liger-kernel 0.8.5's own autograd function run
on real CPU tensors with its Triton kernel a no-op (tests/support/liger_library.py), every alloc and free counted;
the estimate against transformers' classes patched as liger patches them; the readers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support import liger_library
from tests.support.three_ways import held_three_ways
from vramlab.core.checks import SetupError
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation import liger  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    gen = liger_library.imported(monkeypatch)
    next(gen)
    yield
    next(gen, None)


def _timeline(fn, fused: bool, grad_layout: str, k_grad: bool) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Live bytes after every alloc and free of ``fn``'s forward and backward on q and k made as transformers'
    attention makes them (a projection's output viewed as heads and transposed; a fused qkv's slices), their
    gradients arriving laid out (batch, heads, seq, head_dim) ("bhsd": eager attention's matmuls) or as q and k
    ("bshd": the fused SDPA kernels)."""
    b, s, h, kv, d = 2, 24, 4, 2, 32
    tracker = MemoryTracker(block=1)
    with tracker:
        x = torch.randn(b, s, (h + 2 * kv) * d if fused else h * d, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randn(b, s, kv * d, dtype=torch.bfloat16, requires_grad=k_grad)
        if fused:
            q, k = x[..., :h * d].view(b, s, h, d), x[..., h * d:(h + kv) * d].view(b, s, kv, d)
        else:
            q, k = (x * 1).view(b, s, h, d), (y * 1).view(b, s, kv, d)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = torch.randn(1, s, d, dtype=torch.bfloat16), torch.randn(1, s, d, dtype=torch.bfloat16)
        q2, k2 = fn(q, k, cos, sin)
        grads = [torch.ones_like(t) if grad_layout == "bhsd" else torch.ones_like(t.transpose(1, 2)).transpose(1, 2)
                 for t in (q2, k2)]
        torch.autograd.backward([q2, k2], grads)
        sizes = [t.grad.numel() * t.grad.element_size() for t in (x, y) if t.grad is not None]
        del q, k, q2, k2, grads, x, y, cos, sin
    return [c for _, c in tracker.timeline], sizes


@pytest.mark.parametrize("fused", [False, True], ids=["projections", "fused-qkv"])
@pytest.mark.parametrize("grad_layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("k_grad", [True, False])
def test_the_rope_reference_allocates_what_liger_allocates(library, fused: bool, grad_layout: str,  # noqa: ANN001
                                                           k_grad: bool) -> None:
    from liger_kernel.ops.rope import LigerRopeFunction

    def theirs(q, k, cos, sin):  # noqa: ANN001, ANN202 - liger_rotary_pos_emb's call on CUDA (its Triton impl)
        return LigerRopeFunction.apply(q, k, cos, sin, None, 1, None)

    lib, lib_grads = _timeline(theirs, fused, grad_layout, k_grad)
    ours, our_grads = _timeline(liger.rope, fused, grad_layout, k_grad)
    assert lib_grads == our_grads
    assert lib == ours


LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=320)
SETUPS = {
    "lora-eager": TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=128, micro_batch=2,
                                attention="eager"),
    "lora": TrainingSetup(method="lora", lora_targets="all-linear", seq_len=256, micro_batch=2),
    "full-checkpointing": TrainingSetup(method="full", seq_len=128, micro_batch=2, grad_ckpt=True,
                                        attention="eager"),
}


@pytest.mark.parametrize("name", ["lora-eager", pytest.param("lora", marks=pytest.mark.slow),
                                  pytest.param("full-checkpointing", marks=pytest.mark.slow)])
def test_the_estimate_with_ligers_rope_matches_transformers_classes_patched(name: str) -> None:
    """transformers' LlamaAttention calling liger's RoPE in its module's ``apply_rotary_pos_emb`` (as liger's patch
    rebinds it), the built-in builder and the estimate: equal; and the RoPE changes the estimate (its k requires
    grad where only q's LoRA trains; eager attention's gradients are copied)."""
    setup = SETUPS[name].replace(liger_kernels="rms_norm,glu,rope")
    est, own = held_three_ways(LLAMA, setup, SETUPS[name].replace(liger_kernels="rms_norm,glu"))
    if name == "lora-eager":
        assert est.peak_allocated_bytes != own.peak_allocated_bytes


def test_the_hf_patch_is_undone_after_each_call() -> None:
    """liger's RoPE is bound in the modeling module only while a patched attention runs: another model built after
    sees transformers' own function."""
    from transformers.models.llama import modeling_llama

    before = modeling_llama.apply_rotary_pos_emb
    from vramlab.core.simulation.simulate import simulate

    simulate(LLAMA, SETUPS["lora-eager"].replace(liger_kernels="rope", seq_len=32), hf=True)
    assert modeling_llama.apply_rotary_pos_emb is before


def test_the_families_patch_decides_the_rope() -> None:
    from vramlab.core.spec.liger import liger_patch, recorded_patch

    assert liger_patch(LLAMA, ("rope",)).rope
    assert recorded_patch("olmo2", ("rope",)).rope == (("modeling_olmo2", "liger_rotary_pos_emb"),)
    assert recorded_patch("qwen3_next", ("rope",)) is None  # rope=False in liger's own default
    assert recorded_patch("glm4", ("rope",)) is None
    with pytest.raises(SetupError, match="liger_llama4_text_rotary_pos_emb"):
        recorded_patch("llama4_text", ("rope",))
    assert not liger_patch(dataclasses.replace(LLAMA, learned_positions=True, norm_kind="layernorm"), ("rope",))


@pytest.mark.parametrize(("name", "text", "kernels"), [
    ("ax.yaml", "base_model: m\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\nliger_rope: true\n", ["rope"]),
    ("lf.yaml", "model_name_or_path: m\nstage: sft\nfinetuning_type: lora\nenable_liger_kernel: true\n",
     ["rms_norm", "glu", "layer_norm", "rope"]),
    ("args.json", '{"per_device_train_batch_size": 1, "use_liger_kernel": true, '
     '"liger_kernel_config": {"rope": false}}',
     ["rms_norm", "glu", "layer_norm"]),
], ids=["axolotl", "llamafactory", "trainer-rope-off"])
def test_the_frameworks_rope_switch_is_read(tmp_path, name: str, text: str, kernels: list) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / name
    cfg.write_text(text)
    read = read_training_configs([cfg])
    assert read.changes.get("liger_kernels") == kernels
    assert not any("RoPE" in (r.note or "") and "not modelled" in (r.note or "") for r in read.rows)
    assert not any(r.key == "liger_rope" and r.status == "not modelled" for r in read.rows)


@pytest.mark.parametrize(("attn", "lora"), [("eager", True), pytest.param("eager", False, marks=pytest.mark.slow),
                                            pytest.param("sdpa", True, marks=pytest.mark.slow),
                                            pytest.param("sdpa", False, marks=pytest.mark.slow)])
def test_transformers_classes_with_ligers_own_rope(library, attn: str, lora: bool) -> None:  # noqa: ANN001
    """liger's own ``apply_liger_kernel_to_llama(rope=True)`` (its module-level ``apply_rotary_pos_emb`` swap, its
    dispatch to the Triton implementation) and :func:`patch_recorded` from the record on the same transformers
    class: the same tensors, alloc for alloc; and not transformers' own RoPE's."""
    import peft
    import transformers as tf
    from liger_kernel.transformers import monkey_patch as mp
    from transformers.models.llama import modeling_llama

    from tests.support.step_timeline import step_timeline
    from vramlab.core.spec.liger import recorded_patch

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = attn
    ids = torch.randint(0, 64, (2, 24))

    def run(patcher) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
        if lora:
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
        patcher(model.get_base_model() if lora else model)
        return step_timeline(model, ids)

    # liger resolves its implementation at the first call, logging the ones that fail to import (CuTe DSL, Ascend)
    # with their tracebacks, which pytest's log capture keeps, and the attention's frame with them: resolved first
    from liger_kernel.backends.dispatch import resolve_impl

    resolve_impl("rope", requested=None, device=None)
    before = dict(vars(modeling_llama))
    try:
        lib = run(lambda model: mp.apply_liger_kernel_to_llama(rope=True, rms_norm=False, swiglu=False,
                                                                cross_entropy=False, fused_linear_cross_entropy=False,
                                                                model=model))
    finally:
        vars(modeling_llama).update(before)
    ours = run(lambda model: liger.patch_recorded(model, recorded_patch("llama", ("rope",))))
    assert lib == ours
    assert ours != run(lambda model: None)


def test_a_vision_language_model_says_its_rope_is_torchs() -> None:
    from vramlab.core.catalog import find_model

    spec = find_model("gemma-3-4b-it")
    assert spec.vision is not None
    assert any("RoPE too: not modelled" in w for w in TrainingSetup(liger_kernels="all").warnings(spec))
    assert not any("RoPE" in w for w in TrainingSetup(liger_kernels="rms_norm").warnings(spec))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen3-0.6b", "mistral-7b-v0.1", "phi-3-mini-4k", "gemma-2-2b"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_other_families_with_ligers_rope(preset: str, attention: str) -> None:
    """Qwen 3 (q / k norms before the RoPE), Mistral (a sliding window: k repeated before SDPA), Phi-3 (q and k
    sliced from one qkv projection: liger copies them) and Gemma 2: the estimate against the builder phase by
    phase and against transformers' classes patched."""
    from vramlab.core.catalog import find_model

    spec = dataclasses.replace(find_model(preset), num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                               head_dim=64, intermediate_size=512, vocab_size=320,
                               sliding_window=min(find_model(preset).sliding_window or 0, 64))
    setup = TrainingSetup(method="full", seq_len=128, micro_batch=2, attention=attention,
                          liger_kernels="rms_norm,rope")
    held_three_ways(spec, setup, setup.replace(liger_kernels="rms_norm"))


@pytest.mark.slow
def test_a_traced_family_gets_ligers_rope() -> None:
    """OLMo-2 (only the trace answers it), eager attention, LoRA on q and v: the traced estimate with liger's RoPE
    (its record's ``modeling_olmo2.apply_rotary_pos_emb``) equals transformers' class patched so, and differs from
    the estimate without it."""
    from vramlab.core.estimate import estimate
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({"model_type": "olmo2", "vocab_size": 1000, "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "eos_token_id": 1, "pad_token_id": 0},
                               id="olmo2", name="olmo2-ish")
    setup = TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=200, micro_batch=2,
                          attention="eager", liger_kernels="rms_norm,glu,rope")
    est = estimate(spec, setup)
    assert est.source.startswith("traced")
    assert est.peak_allocated_bytes == simulate(spec, setup, hf=True).peak_allocated_bytes
    assert est.peak_allocated_bytes != estimate(spec, setup.replace(liger_kernels="rms_norm,glu")).peak_allocated_bytes
