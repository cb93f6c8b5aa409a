"""Liger's kernels on any model type liger patches (issue 28: options are transformations of any tape): a family
only the trace answers and the vision-language models get what liger-kernel 0.8.5's own
``apply_liger_kernel_to_<type>(model=...)`` swaps into transformers' class of their type, read off liger itself
(``tools/liger_map.py`` into ``resources/liger_patches.json``), with no line of their own.

Held three ways. transformers' classes patched from the record against the same classes patched by liger's own
apply function (its Python code on CPU tensors over a no-op triton), alloc for alloc, and the LayerNorm reference
against ``LigerLayerNormFunction``; the estimate against transformers' classes patched (the trace's tape, a
vision-language program); the record against the installed liger. And what liger itself cannot run is refused
with liger's own error.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import liger_library
from tests.support.step_timeline import step_timeline
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec import liger as spec_liger
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vramlab.core.simulation import liger  # noqa: E402
from vramlab.core.simulation.simulate import simulate  # noqa: E402
from vramlab.core.simulation.tracker import MemoryTracker  # noqa: E402

SIZE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512, eos_token_id=1, pad_token_id=0)


def _traced(model_type: str, **extra: object):  # noqa: ANN202
    from vramlab.core.sources.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({"model_type": model_type, **SIZE, **extra}, id=model_type, name=f"{model_type}-ish")
    assert spec.transformers_config  # only the trace answers it
    return spec


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    gen = liger_library.imported(monkeypatch)
    next(gen)
    monkeypatch.setattr(spec_liger, "LIGER_SM_COUNT", 1)  # liger's backward takes one row off CUDA
    yield
    next(gen, None)


def test_a_traced_family_gets_ligers_patch_for_its_type() -> None:
    """OLMo-2 (its q / k norms over the whole projection, its post-norms): the trace's estimate with the kernels is
    transformers' class patched as liger's record says, and the kernels change it."""
    spec = _traced("olmo2")
    setup = TrainingSetup(method="lora", seq_len=200, micro_batch=2, liger_kernels="all,cross_entropy")
    est = estimate(spec, setup)
    ref = simulate(spec, setup, hf=True)
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 1024
    assert est.peak_phase == ref.peak_phase
    plain = estimate(spec, setup.replace(liger_kernels="none"))
    assert est.peak_allocated_bytes < plain.peak_allocated_bytes
    assert not [w for w in setup.warnings(spec) if "Liger" in w or "liger" in w]


def test_a_fused_gate_up_gets_ligers_swiglu() -> None:
    """GLM-4 (one gate_up_proj, chunked): liger's patch swaps in LigerPhi3SwiGLUMLP, whose SwiGLU copies both
    halves and saves the copies; the trace's estimate is transformers' class patched so, and differs from the
    estimate without the MLP's kernel."""
    spec = _traced("glm4")
    setup = TrainingSetup(method="lora", lora_targets="all-linear", seq_len=200, micro_batch=2, liger_kernels="all")
    assert any(m.fused for m in spec_liger.recorded_patch("glm4", setup.liger_kernels).modules)
    est = estimate(spec, setup)
    ref = simulate(spec, setup, hf=True)
    assert abs(est.peak_allocated_bytes - ref.peak_allocated_bytes) <= 1024
    assert est.peak_phase == ref.peak_phase
    assert est.peak_allocated_bytes != estimate(spec, setup.replace(liger_kernels="rms_norm,rope")).peak_allocated_bytes


def _causal(model_type: str, **extra: object):  # noqa: ANN202
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in SIZE.items() if k != "max_position_embeddings"},
                               **extra)
    cfg._attn_implementation = "eager"
    return cfg, lambda: AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


@pytest.mark.parametrize(("model_type", "extra"), [
    ("olmo2", {}),
    pytest.param("smollm3", {}, marks=pytest.mark.slow),
    pytest.param("exaone4", {"sliding_window": 16}, marks=pytest.mark.slow),
    ("glm4", {}),  # LigerPhi3SwiGLUMLP on its fused gate_up_proj
    pytest.param("hunyuan_v1_dense", {"head_dim": 16}, marks=pytest.mark.slow),  # LigerHunyuanV1SwiGLUMLP
])
@pytest.mark.parametrize("lora", [False, True])
def test_the_record_patches_as_liger_patches(library, model_type: str, extra: dict,  # noqa: ANN001
                                             lora: bool) -> None:
    """liger's own apply function for the type on transformers' class, and :func:`patch_recorded` from the record
    on the same class: the same tensors, alloc for alloc."""

    import peft
    from liger_kernel.transformers import monkey_patch as mp

    _cfg, make = _causal(model_type, **extra)
    ids = torch.randint(0, 1000, (2, 24))

    def run(patcher) -> list[int]:  # noqa: ANN001
        torch.manual_seed(0)
        model = make()
        if lora:
            up = "gate_up_proj" if hasattr(model.model.layers[0].mlp, "gate_up_proj") else "up_proj"
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", up]))
        patcher(model)
        return step_timeline(model, ids)

    def theirs(model) -> None:  # noqa: ANN001
        liger_library.apply_own(mp.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type], model, lora=lora)

    ours = run(lambda model: liger.patch_recorded(model, spec_liger.recorded_patch(model_type, ("rms_norm", "glu"))))
    assert run(theirs) == ours
    assert ours != run(lambda model: None)


@pytest.mark.parametrize(("dtype", "grads"), [(torch.bfloat16, (True, True, True)),
                                              (torch.bfloat16, (True, False, False)),
                                              (torch.float32, (False, True, True))])
def test_the_layer_norm_reference_allocates_what_liger_allocates(library, dtype: torch.dtype,  # noqa: ANN001
                                                                 grads: tuple) -> None:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    x, w, b = torch.randn(3, 40, 96, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(96, dtype=dtype)

    def timeline(fn) -> tuple[list[int], list[int]]:  # noqa: ANN001
        tracker = MemoryTracker(block=1)
        with tracker:
            xs = [t.detach().clone().requires_grad_(g) for t, g in zip((x, w, b), grads)]
            y = fn(*xs)
            y.backward(torch.ones_like(y))
            sizes = [t.grad.numel() * t.grad.element_size() for t in xs if t.grad is not None]
            del y, xs
        return [c for _, c in tracker.timeline], sizes

    assert timeline(lambda a, c, d: LigerLayerNormFunction.apply(a, c, d, 1e-6)) == timeline(liger.layer_norm)


def _vlm(name: str):  # noqa: ANN202
    if name == "gemma3":
        from tests.test_vlm_gemma3 import GEMMA3

        return GEMMA3
    if name == "mllama":
        from tests.test_vlm_mllama import TINY

        return TINY
    if name == "paligemma":
        from tests.test_vlm_paligemma import _spec

        return _spec(112)
    from tests.test_vlm import LLAVA

    return LLAVA


@pytest.mark.parametrize(("name", "tune"), [
    ("gemma3", "lora"),  # its RMSNorms (q / k and the projector's too, not in place), GeGLU, SigLIP's LayerNorms
    pytest.param("gemma3", "frozen", marks=pytest.mark.slow),
    pytest.param("mllama", "lora", marks=pytest.mark.slow),  # its cross-attention q / k norms left as they are
    pytest.param("paligemma", "full", marks=pytest.mark.slow),
    pytest.param("llava", "lora", marks=pytest.mark.slow),  # the language model only: liger leaves CLIP alone
])
def test_a_vision_language_program_gets_ligers_patch(name: str, tune: str) -> None:
    """The family's program with the kernels against its transformers class patched as liger's record says: every
    phase's peak within the kilobyte its plain run differs by."""
    spec = _vlm(name)
    setup = TrainingSetup(method="full" if tune == "full" else "lora", vision_tuning=tune, images=1, micro_batch=1,
                          seq_len=64, liger_kernels="all")
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= 1024
    assert est.peak_phase == sim.peak_phase
    for p, q in zip(est.phases, sim.phases):
        assert p.key == q.key and abs(p.bytes - q.bytes) <= 1024, (p.key, p.bytes, q.bytes)
    if setup.uses_lora:  # activations hold the peak (a full fine-tune's is its optimizer step)
        plain = estimate(spec, setup.replace(liger_kernels="none"), match_simulation=True)
        assert est.peak_allocated_bytes < plain.peak_allocated_bytes


@pytest.mark.parametrize("name", ["gemma3", *(pytest.param(n, marks=pytest.mark.slow)
                                              for n in ("mllama", "paligemma", "llava", "llava-pixtral"))])
def test_the_record_rebinds_the_modules_liger_rebinds_on_a_vision_language_class(library, name: str) -> None:  # noqa: ANN001
    """The family's class as its reference builds it (other depths and sizes than the config defaults the record was
    taken on), on the meta device: the modules :func:`patch_recorded` rebinds are the ones liger's own apply function
    rebinds, each to the same Liger module."""
    import importlib

    from liger_kernel.transformers import monkey_patch as mp
    from transformers.models.auto import modeling_auto as ma

    from vramlab.core.spec.options import Attention

    if name == "llava-pixtral":  # Pixtral 12B's layout: liger's LLaVA patch applies Mistral's and Pixtral's own
        from transformers import LlavaConfig

        name = "llava"
        cfg = LlavaConfig(text_config=dict(model_type="mistral", hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           vocab_size=1000, head_dim=16),
                          vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, image_size=64,
                                             patch_size=16, head_dim=8))
    else:
        cfg = importlib.import_module(f"vramlab.core.families.{name}.reference").hf_config(_vlm(name),
                                                                                          Attention.SDPA)
    cls = ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(cfg)]

    def rebound(patcher) -> dict[str, str]:  # noqa: ANN001
        with torch.device("meta"):
            model = cls._from_config(cfg)
        patcher(model)
        return {n: m._get_name() if "_get_name" in vars(m) else "" for n, m in model.named_modules()
                if "forward" in vars(m)}

    def theirs(model) -> None:  # noqa: ANN001
        from tools.liger_map import _restore, _snapshot

        saved = _snapshot()  # its class-level swaps (Gemma3RMSNorm = LigerRMSNormForGemma3, ...) undone after
        try:
            mp.MODEL_TYPE_TO_APPLY_LIGER_FN[name](rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                                                model=model)
        finally:
            _restore(saved)

    kernels = ("rms_norm", "glu", "layer_norm")
    ours = rebound(lambda model: liger.patch_recorded(model, spec_liger.recorded_patch(name, kernels)))
    lib = rebound(theirs)
    assert lib and set(lib) == set(ours)


def test_a_patch_liger_cannot_run_is_refused_with_its_error() -> None:
    """liger-kernel 0.8.5's Qwen2.5-VL patch imports an output class transformers 5 renamed: Trainer's
    use_liger_kernel raises ImportError on it, so the estimate refuses with that error."""
    from tests.test_vlm import QWEN25_VL

    with pytest.raises(SetupError, match="ImportError: cannot import name 'LigerQwen2_5_VLCausalLMOutputWithPast'"):
        TrainingSetup(liger_kernels="all", images=1).validate_for(QWEN25_VL)
    TrainingSetup(images=1).validate_for(QWEN25_VL)


def test_a_type_liger_does_not_patch_is_unchanged_and_said_so() -> None:
    """OLMo (1): liger-kernel 0.8.5 has no patch for it."""
    spec = _traced("olmo")
    setup = TrainingSetup(method="lora", seq_len=128, liger_kernels="all")
    assert spec_liger.recorded_patch("olmo", setup.liger_kernels) is None
    assert spec_liger.liger_patch(spec, setup.liger_kernels) is None
    assert any("patches no" in w for w in setup.warnings(spec))


@pytest.mark.slow
def test_the_record_is_the_installed_ligers() -> None:
    """``resources/liger_patches.json`` is what liger-kernel 0.8.5's apply functions do on the installed
    transformers (rewrite it with ``tools/liger_map.py`` when either moves); in a process of its own, as liger's
    class-level swaps and the other tests' patches stay out of it."""
    import importlib.util
    import subprocess
    import sys
    from importlib import metadata
    from pathlib import Path

    if importlib.util.find_spec("liger_kernel") is None or metadata.version("liger-kernel") != liger_library.VERSION:
        pytest.skip(f"pip install liger-kernel=={liger_library.VERSION} --no-deps")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tools" / "liger_map.py"), "--check"], capture_output=True,
                         text=True, cwd=root, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]


@pytest.mark.slow
def test_a_traced_vision_language_model_gets_ligers_patch(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """SmolVLM (traced): its Llama language model's kernels and its SigLIP tower's LigerLayerNorm, the fitted
    tape's estimate equal to transformers' class patched, and lower than without them."""
    from tests.support.traced_vlm import tiny_configs
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.sources.hf_config import hf_config_to_spec

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = hf_config_to_spec(tiny_configs()["smolvlm"], id="smolvlm", name="smolvlm")
    setup = TrainingSetup(method="lora", vision_tuning="lora", images=1, image_width=300, image_height=200,
                          micro_batch=3, seq_len=100, lora_rank=16, liger_kernels="all")
    est = estimate(spec, setup, match_simulation=True)
    assert est.source.startswith("traced")
    assert est.peak_allocated_bytes == simulate(spec, setup).peak_allocated_bytes
    assert est.peak_allocated_bytes < estimate(spec, setup.replace(liger_kernels="none"),
                                               match_simulation=True).peak_allocated_bytes


@pytest.mark.slow
def test_a_traced_vision_language_model_with_a_fused_gate_up_gets_ligers_swiglu(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """GLM-4V (traced): its language model's LigerPhi3SwiGLUMLP (refused before as not modelled), the fitted tape's
    estimate equal to transformers' class patched, and lower than without liger's kernels."""
    from tests.support.traced_vlm import generic_configs
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.sources.hf_config import hf_config_to_spec

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = hf_config_to_spec(generic_configs()["glm4v"], id="glm4v", name="glm4v")
    setup = TrainingSetup(method="lora", images=1, image_width=100, image_height=80, seq_len=100, lora_rank=16,
                          liger_kernels="all")
    est = estimate(spec, setup, match_simulation=True)
    assert est.source.startswith("traced")
    assert est.peak_allocated_bytes == simulate(spec, setup).peak_allocated_bytes
    assert est.peak_allocated_bytes < estimate(spec, setup.replace(liger_kernels="none"),
                                               match_simulation=True).peak_allocated_bytes
