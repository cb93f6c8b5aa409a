"""Liger Kernel's RMSNorm, SwiGLU / GeGLU and plain cross-entropy kernels (issue 29 item 5: what
``use_liger_kernel``, LLaMA-Factory's ``enable_liger_kernel`` and axolotl's ``liger_rms_norm`` /
``liger_glu_activation`` / ``liger_cross_entropy`` swap in besides the fused loss).

Held three ways. The references (core/simulation/liger.py) against liger-kernel 0.8.5's own Python code, run on
real CPU tensors with its Triton kernels launched as no-ops (tests/support/liger_library.py): each autograd
function alone, and transformers' classes patched by liger's own ``apply_liger_kernel_to_<family>(model=...)``
against the same classes patched by :func:`patch_model`, every alloc and free of forward and backward counted, the
timelines equal byte for byte. The estimate against the reference on transformers' classes (Llama, Gemma 2 and the
other families, LoRA and full, with and without checkpointing). And the families liger does not patch, or patches
in a way not modelled, answered as such.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support import liger_library
from tests.support.step_timeline import step_timeline
from tests.support.three_ways import held_three_ways
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec import liger as spec_liger
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation import liger  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402

KERNELS = dict(liger_kernels="all")


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """liger-kernel 0.8.5 over a no-op triton; the reference's SM count set to what the library takes off CUDA (1:
    its ``rms_norm_backward`` asks ``multi_processor_count`` of a CUDA device only)."""
    gen = liger_library.imported(monkeypatch)
    next(gen)
    monkeypatch.setattr(spec_liger, "LIGER_SM_COUNT", 1)
    yield
    next(gen, None)


def _timeline(fn, inputs: list[torch.Tensor], grads: list[bool]) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Live bytes after every alloc and free of ``fn``'s forward and backward; the gradients' sizes."""
    tracker = MemoryTracker(block=1)
    with tracker:
        xs = [x.detach().clone().requires_grad_(g) for x, g in zip(inputs, grads)]
        y = fn(*xs)
        y.backward(torch.ones_like(y))
        sizes = [x.grad.numel() * x.grad.element_size() for x in xs if x.grad is not None]
        del y, xs
    return [c for _, c in tracker.timeline], sizes


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize(("dtype", "train_weight"), [(torch.bfloat16, True), (torch.bfloat16, False),
                                                     (torch.float32, True)])
def test_the_rms_norm_reference_allocates_what_liger_allocates(library, casting: str, in_place: bool,  # noqa: ANN001
                                                               dtype: torch.dtype, train_weight: bool) -> None:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    offset = 1.0 if casting == "gemma" else 0.0
    patch = spec_liger.LigerPatch(True, casting == "gemma", in_place, False)
    x = torch.randn(3, 40, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)

    def theirs(xx: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return LigerRMSNormFunction.apply(xx, ww, 1e-6, offset, casting, in_place, None)

    lib, lib_grads = _timeline(theirs, [x, w], [True, train_weight])
    ours, our_grads = _timeline(lambda xx, ww: liger.rms_norm(xx, ww, patch), [x, w], [True, train_weight])
    assert lib_grads == our_grads
    assert lib == ours


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("grads", [(True, True), (False, True)])
def test_the_glu_reference_allocates_what_liger_allocates(library, kind: str, grads: tuple) -> None:  # noqa: ANN001
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    fn = LigerSiLUMulFunction if kind == "swiglu" else LigerGELUMulFunction
    a, b = torch.randn(2, 30, 160, dtype=torch.bfloat16), torch.randn(2, 30, 160, dtype=torch.bfloat16)
    lib, lib_grads = _timeline(fn.apply, [a, b], list(grads))
    ours, our_grads = _timeline(liger.glu, [a, b], list(grads))
    assert lib_grads == our_grads
    assert lib == ours


@pytest.mark.parametrize(("dtype", "reduction"), [(torch.float32, "mean"), (torch.float32, "sum"),
                                                (torch.bfloat16, "mean")])
def test_the_cross_entropy_reference_allocates_what_liger_allocates(library, dtype: torch.dtype,  # noqa: ANN001
                                                                    reduction: str) -> None:
    """As transformers' loss calls it once liger's patch has put it in torch's place (``nn.functional
    .cross_entropy(logits, labels, ignore_index=-100, reduction=...)``)."""
    from liger_kernel.transformers.functional import liger_cross_entropy

    x = torch.randn(70, 500, dtype=dtype)
    target = torch.randint(0, 500, (70,))
    target[::7] = -100

    def theirs(xx: torch.Tensor) -> torch.Tensor:
        return liger_cross_entropy(xx, target, ignore_index=-100, reduction=reduction)

    lib, lib_grads = _timeline(theirs, [x], [True])
    ours, our_grads = _timeline(lambda xx: liger.cross_entropy(xx, target), [x], [True])
    assert lib_grads == our_grads
    assert lib == ours


def test_the_weight_gradient_buffer_is_one_row_per_sm_on_cuda(library) -> None:  # noqa: ANN001
    """On CUDA liger gathers the norm weight's gradient in a (multi_processor_count, hidden) fp32 buffer (the CPU
    run above takes one row): the reference's row count is the modelled GPU's."""
    import inspect

    from liger_kernel.ops import rms_norm

    src = inspect.getsource(rms_norm.rms_norm_backward)
    assert "torch.cuda.get_device_properties(X.device).multi_processor_count" in src
    assert "torch.empty((sm_count, n_cols), dtype=torch.float32" in src


SIZE = dict(vocab_size=32, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _family(name: str):  # noqa: ANN202
    """transformers' config of ``name``, liger's apply function for it, and the patch VRAM Lab reads of it."""
    import transformers as tf
    from liger_kernel.transformers import monkey_patch as mp

    cfgs = {
        "llama": (tf.LlamaConfig(**SIZE), mp.apply_liger_kernel_to_llama, {}),
        "qwen3": (tf.Qwen3Config(**SIZE, head_dim=16), mp.apply_liger_kernel_to_qwen3, dict(qk_norm=True)),
        "gemma": (tf.GemmaConfig(**SIZE, head_dim=16), mp.apply_liger_kernel_to_gemma, dict(gemma=True)),
        "gemma2": (tf.Gemma2Config(**SIZE, head_dim=16), mp.apply_liger_kernel_to_gemma2, dict(gemma=True, four=True)),
        "gemma3_text": (tf.Gemma3TextConfig(**SIZE, head_dim=16), mp.apply_liger_kernel_to_gemma3_text,
                        dict(gemma=True, four=True)),
        # its fused gate_up_proj: LigerPhi3SwiGLUMLP hands the two chunks to LigerSiLUMulFunction
        "phi3": (tf.Phi3Config(**SIZE, pad_token_id=0), mp.apply_liger_kernel_to_phi3,
                 dict(targets=["qkv_proj", "gate_up_proj"])),
    }
    return cfgs[name]


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"])
@pytest.mark.parametrize("lora", [False, True])
def test_transformers_classes_patched_as_liger_patches_them(library, name: str, lora: bool) -> None:  # noqa: ANN001
    """liger's own instance patch (``apply_liger_kernel_to_<family>(model=...)``, its RoPE and losses off) and
    :func:`patch_model` on the same transformers class: the same tensors, alloc for alloc."""
    import peft

    cfg, apply_fn, feats = _family(name)
    patch = spec_liger.LigerPatch(True, bool(feats.get("gemma")), not feats.get("four"), True)
    cfg._attn_implementation = "eager"
    ids = torch.randint(0, 32, (2, 24))

    def run(patcher) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        model = type(_model_class(cfg))._from_config(cfg, dtype=torch.bfloat16)
        if lora:
            targets = feats.get("targets", ["q_proj", "up_proj"])
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
        patcher(model)
        return step_timeline(model, ids)

    def theirs(model) -> None:  # noqa: ANN001
        liger_library.apply_own(apply_fn, model, lora=lora)

    lib = run(theirs)
    ours = run(lambda model: liger.patch_model(model, patch))
    plain = run(lambda model: None)
    assert lib == ours
    assert ours != plain  # the patch took: transformers' own norms and MLPs allocate otherwise


def _model_class(cfg):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(cfg)


LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)


def _gemma2() -> ModelSpec:
    from vramlab.core.catalog import find_model

    return dataclasses.replace(find_model("gemma-2-2b"), num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                               head_dim=64, intermediate_size=512, vocab_size=32000)


SETUPS = {
    "lora": TrainingSetup(method="lora", lora_targets="all-linear", seq_len=256, micro_batch=2),
    "lora-checkpointing": TrainingSetup(method="lora", lora_targets="q_proj,v_proj", seq_len=256, grad_ckpt=True),
    "full": TrainingSetup(method="full", seq_len=200, micro_batch=2),
    "full-checkpointing": TrainingSetup(method="full", seq_len=256, micro_batch=2, grad_ckpt=True),
    "qlora": TrainingSetup(method="qlora", lora_targets="all-linear", seq_len=256),
    "full-amp": TrainingSetup(method="full", seq_len=128, micro_batch=2, weights="fp32", compute="bf16", amp=True),
    "freeze-flce": TrainingSetup(method="freeze", trainable_layers=1, seq_len=256, loss_kernel="liger"),
}


# Llama through every setup, Gemma 2 (its GeGLU and offset norm) through two by default, the rest slow
_CASES = [pytest.param(m, n, marks=[pytest.mark.slow] if m == "gemma2" and n not in ("lora", "full-checkpointing")
                       else []) for m in ("llama", "gemma2") for n in SETUPS]


@pytest.mark.parametrize(("model", "name"), _CASES)
def test_the_estimate_matches_transformers_classes_patched(model: str, name: str) -> None:
    spec = LLAMA if model == "llama" else _gemma2()
    setup = SETUPS[name].replace(**KERNELS)
    # transformers' classes (+ peft) patched as liger patches them, and the built-in builder with the same kernels
    est, own = held_three_ways(spec, setup, SETUPS[name])
    if setup.uses_lora and not setup.grad_ckpt:  # activations hold the peak: the kernels keep fewer of them
        assert est.peak_allocated_bytes < own.peak_allocated_bytes


def _small(preset: str, layers: int = 2) -> ModelSpec:
    from vramlab.core.catalog import find_model

    spec = find_model(preset)
    return dataclasses.replace(spec, num_layers=layers, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                               intermediate_size=512, vocab_size=32000,
                               sliding_window=min(spec.sliding_window or 0, 128))


# the other families liger patches: Qwen 3 and Gemma 3 (their q / k norms too; Gemma 3's not in place), Mistral
# (sliding window), Gemma 1 (Gemma's norm in place), Phi-3 (LigerPhi3SwiGLUMLP on its fused gate_up_proj)
OTHERS = {"qwen3": ("qwen3-0.6b", 2), "mistral": ("mistral-7b-v0.1", 2), "gemma": ("gemma-2b", 2),
          "gemma3": ("gemma-3-1b", 6), "phi3": ("phi-3-mini-4k", 2)}


@pytest.mark.parametrize("family", list(OTHERS))
@pytest.mark.parametrize("name", ["lora", pytest.param("full-checkpointing", marks=pytest.mark.slow)])
def test_the_estimate_matches_the_other_families_patched(family: str, name: str) -> None:
    spec = _small(*OTHERS[family])
    setup = SETUPS[name].replace(**KERNELS, seq_len=200)
    ref = simulate(spec, setup, hf=True)
    est = estimate(spec, setup, match_simulation=True)
    assert est.source == "hand-written"
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8192
    assert est.peak_phase == ref.peak_phase
    # against transformers' torch norms and MLPs (the Hub's RMSNorm, on by default, is liger's own)
    assert est.peak_allocated_bytes != estimate(spec, SETUPS[name].replace(seq_len=200, hub_kernels=False),
                                                match_simulation=True).peak_allocated_bytes


@pytest.mark.parametrize("model", ["llama", "gemma2"])
@pytest.mark.parametrize("name", ["lora", "full-checkpointing", "full-amp"])
def test_the_estimate_matches_transformers_loss_with_ligers_cross_entropy(model: str, name: str) -> None:
    """transformers' loss with liger's cross-entropy in torch's place (``--liger-kernels cross_entropy``): no
    log-softmax output kept, the fp32 logits become their own gradient."""
    spec = LLAMA if model == "llama" else _gemma2()
    setup = SETUPS[name].replace(liger_kernels="rms_norm,glu,cross_entropy")
    ref = simulate(spec, setup, hf=True)
    built = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True)
    assert est.peak_allocated_bytes == built.peak_allocated_bytes
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in built.phases}
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 8192
    assert est.peak_phase == ref.peak_phase
    if name == "lora":  # the logits hold the peak: one fp32 logits-sized tensor fewer at least
        plain = estimate(spec, SETUPS[name].replace(**KERNELS), match_simulation=True)
        assert plain.peak_allocated_bytes - est.peak_allocated_bytes > 0.99 * 4 * 2 * 256 * spec.vocab_size


@pytest.mark.parametrize(("extra", "needle"), [(dict(loss_kernel="liger"), "cannot both be True"),
                                               (dict(chunked_loss=True), "one pass"),
                                               (dict(objective="dpo", completion_len=64), "SFT step")])
def test_ligers_cross_entropy_is_refused_where_it_is_not_modelled(extra: dict, needle: str) -> None:
    with pytest.raises(SetupError, match=needle):
        TrainingSetup(liger_kernels="cross_entropy", **extra).validate(LLAMA)


def test_a_family_liger_does_not_patch_is_unchanged() -> None:
    """GPT-2 (LayerNorm, learned positions): liger-kernel 0.8.5 has no patch for it, so nothing changes."""
    from vramlab.core.catalog import find_model

    spec = find_model("gpt2")
    setup = TrainingSetup(method="full", seq_len=256)
    assert (estimate(spec, setup.replace(**KERNELS)).peak_allocated_bytes
            == estimate(spec, setup).peak_allocated_bytes)
    assert any("patches no GPT-2 model" in w for w in setup.replace(**KERNELS).warnings(spec))


def test_the_cli_takes_the_kernels(capsys) -> None:  # noqa: ANN001
    import json

    from vramlab.core.cli import main

    args = ["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--json"]
    assert main([*args, "--liger-kernels", "all"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["liger_kernels"] == ["rms_norm", "glu", "layer_norm", "rope"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] > out["peak_allocated_bytes"]
    assert main([*args, "--liger-kernels", "rope,swish"]) == 2  # a kernel liger has no switch for
    assert "Liger kernels must be some of" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "text", "kernels", "loss"), [
    ("ax.yaml", "base_model: m\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\nliger_glu_activation: true\n",
     ["glu"], None),
    ("ax-both.yaml", "base_model: m\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\nliger_rms_norm: true\n"
     "liger_swiglu: true\nliger_rope: true\n", ["rms_norm", "glu", "rope"], None),
    ("args.json", '{"per_device_train_batch_size": 1, "use_liger_kernel": true, '
     '"liger_kernel_config": {"rms_norm": false}}', ["glu", "layer_norm", "rope"], "liger"),
    # the family's apply function takes swiglu= or geglu=: either off, VRAM Lab cannot tell which applies
    ("args-swiglu.json", '{"per_device_train_batch_size": 1, "use_liger_kernel": true, '
     '"liger_kernel_config": {"swiglu": false, '
     '"fused_linear_cross_entropy": false}}', ["rms_norm", "layer_norm", "rope"], None),
    ("lf.yaml", "model_name_or_path: m\nstage: pt\nfinetuning_type: full\nenable_liger_kernel: true\n",
     ["rms_norm", "glu", "layer_norm", "rope"], "liger"),
    ("ax-ce.yaml", "base_model: m\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\nliger_cross_entropy: true\n",
     ["cross_entropy"], None),
    ("args-ce.json", '{"per_device_train_batch_size": 1, "use_liger_kernel": true, "liger_kernel_config": '
     '{"cross_entropy": true, "fused_linear_cross_entropy": false}}', ["rms_norm", "glu", "cross_entropy",
                                                                       "layer_norm", "rope"], None),
], ids=["axolotl-glu", "axolotl-both", "trainer-no-norm", "trainer-no-swiglu", "llamafactory-pt", "axolotl-ce",
        "trainer-ce"])
def test_the_frameworks_switches_set_the_kernels(tmp_path, name: str, text: str, kernels: list,  # noqa: ANN001
                                                 loss: str | None) -> None:
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / name
    cfg.write_text(text)
    read = read_training_configs([cfg])
    assert read.changes.get("liger_kernels") == kernels
    assert read.changes.get("loss_kernel") == loss
    assert not any(r.key in ("liger_rms_norm", "liger_glu_activation", "liger_swiglu", "liger_cross_entropy")
                   and r.status == "not modelled" for r in read.rows)
    assert TrainingSetup().replace(**read.changes).liger_kernels == tuple(kernels)


def test_an_imported_config_estimates_the_kernels(capsys, tmp_path) -> None:  # noqa: ANN001
    import json

    from vramlab.core.cli import main

    cfg = tmp_path / "ax.yaml"
    cfg.write_text("base_model: m\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\nliger_rms_norm: true\n"
                   "liger_glu_activation: true\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n"
                   "sequence_len: 1024\nmicro_batch_size: 1\nbf16: true\n")
    args = ["estimate", "--model", "llama-3.2-1b", "--json"]
    assert main([*args, "--config", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["liger_kernels"] == ["rms_norm", "glu"]
    assert out["models_versions"]["liger_kernels"] == {"liger-kernel": "0.8.5"}
    assert main([*args, "--config", str(cfg), "--liger-kernels", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] > out["peak_allocated_bytes"]


@pytest.mark.parametrize(("name", "text", "kernels"), [
    ("sft.json", '{"max_length": 512, "use_liger_kernel": true}', ["rms_norm", "glu", "layer_norm", "rope"]),
    ("dpo.json", '{"loss_type": "sigmoid", "beta": 0.1, "use_liger_kernel": true}',
     ["rms_norm", "glu", "layer_norm", "rope"]),
    ("grpo.json", '{"num_generations": 8, "use_liger_kernel": true, "liger_kernel_config": {"rms_norm": false}}',
     ["glu", "layer_norm", "rope"]),
], ids=["sft", "dpo", "grpo"])
def test_trls_trainers_keep_liger_layer_kernels_beside_their_own_head(tmp_path, name: str, text: str,  # noqa: ANN001
                                                                      kernels: list) -> None:
    """TRL 1.16's SFT / DPO / KTO / GRPO trainers turn liger's fused linear cross-entropy off before Trainer applies
    the family's patch: its RMSNorm and GLU kernels run, the loss stays TRL's fused LM head."""
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / name
    cfg.write_text(text)
    read = read_training_configs([cfg])
    assert read.changes.get("liger_kernels") == kernels
    assert read.changes.get("loss_kernel") in (None, "trl")
    row = next(r for r in read.rows if r.key == "use_liger_kernel")
    assert row.status != "not modelled" and "fused linear cross-entropy off" in row.note


def test_trl_refuses_liger_fused_loss_beside_its_head(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    cfg = tmp_path / "dpo.json"
    cfg.write_text('{"loss_type": "sigmoid", "use_liger_kernel": true, '
                   '"liger_kernel_config": {"fused_linear_cross_entropy": true}}')
    read = read_training_configs([cfg])
    row = next(r for r in read.rows if r.key == "liger_kernel_config")
    assert row.status == "refused" and "fused LM head" in row.note
