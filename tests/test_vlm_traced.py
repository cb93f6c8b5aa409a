"""Vision-language models traced whole from transformers' own classes (core/tracing/vlm_traced.py): a config of
SmolVLM / Idefics3, InternVL, Qwen2-VL, Qwen3-VL or LLaVA-NeXT imports with its tower and projector counted by the
class, its processor's rules give the image processor's own token counts, the recipe lands on the parts the user
named, and the traced estimate equals ``simulate --hf`` of the same class at a point the trace did not fit
(slow: a trace takes a minute on a loaded two-core machine; benchmarks/vlm_traced.py runs the matrix).

Tiny widths (tests/support/traced_vlm.py). Skipped without torch, transformers and peft."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.support.traced_vlm import processor_tokens, tiny_configs  # noqa: E402
from vramlab.core.checks import SetupError  # noqa: E402
from vramlab.core.kinds import Kind  # noqa: E402
from vramlab.core.sources.hf_config import hf_config_to_spec  # noqa: E402
from vramlab.core.sources.traced_vlm import processor_from_config  # noqa: E402
from vramlab.core.spec.training import TrainingSetup  # noqa: E402
from vramlab.core.vision import VisionInput, token_counts, vision_tokens  # noqa: E402

VISION_KINDS = (Kind.VISION_WEIGHTS, Kind.PROJECTOR_WEIGHTS, Kind.VISION_ACTIVATIONS, Kind.VISION_TRAINING)


def _spec(family: str):
    spec, warnings = hf_config_to_spec(tiny_configs()[family], id=family, name=family)
    return spec, warnings


@pytest.mark.parametrize("family", ["smolvlm", "internvl", "qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("size", [(100, 80), (300, 200), (1000, 333)])
def test_the_processor_rules_read_from_a_config_give_the_image_processors_tokens(family, size):
    pytest.importorskip("PIL")
    proc = processor_from_config(tiny_configs()[family])
    ours = vision_tokens(proc, VisionInput(images=1, width=size[0], height=size[1]))
    tokens, tower = processor_tokens(proc, *size)
    assert ours.llm_tokens == tokens
    assert (ours.patches if proc.kind == "qwen_vl" else ours.units[0].tiles) == tower


@pytest.mark.parametrize("family", sorted(tiny_configs()))
def test_a_vlm_config_imports_whole_with_the_classes_own_count(family):
    import torch
    from transformers import CONFIG_MAPPING

    from vramlab.core.tracing.vlm_traced import transformers_class

    spec, warnings = _spec(family)
    cfg = dict(tiny_configs()[family])
    config = CONFIG_MAPPING[cfg.pop("model_type")].from_dict(cfg)
    with torch.device("meta"):
        model = transformers_class(config)._from_config(config)
    v = spec.vision
    assert v.traced and spec.transformers_config and any("traced" in w for w in warnings)
    assert spec.param_count == sum(p.numel() for p in model.parameters())
    assert 0 < v.projector_params() < v.tower_params() < spec.param_count
    assert not any("not counted" in w for w in warnings)


def test_qwen_mergers_are_the_projector_and_the_blocks_the_tower():
    from vramlab.core.tracing.vlm_traced import kind_of

    tower, projector = (".model.visual.",), ()
    assert kind_of("inner.model.visual.blocks.0.attn.qkv.weight", tower, projector) is Kind.VISION_WEIGHTS
    assert kind_of("inner.base_model.model.model.visual.blocks.0.attn.qkv.lora_A.default.weight", tower,
                   projector) is Kind.VISION_WEIGHTS
    for name in ("inner.model.visual.merger.linear_fc1.weight",
                 "inner.model.visual.deepstack_merger_list.0.norm.weight"):
        assert kind_of(name, tower, projector) is Kind.PROJECTOR_WEIGHTS
    assert kind_of("inner.model.language_model.layers.0.mlp.up_proj.weight", tower, projector) is None
    assert kind_of("inner.model.image_newline", (".model.vision_tower.",), (".model.image_newline",)) \
        is Kind.PROJECTOR_WEIGHTS


def test_images_on_a_traced_vlm_are_validated_by_its_processor():
    spec, _ = _spec("internvl")
    setup = TrainingSetup(method="lora", images=2, image_width=300, image_height=200)
    setup.validate(spec)
    assert token_counts(spec, setup)["vision_tokens"] == 2 * processor_tokens(spec.vision.processor, 300, 200)[0]
    with pytest.raises(SetupError, match="max pixels"):
        TrainingSetup(method="lora", images=1, max_pixels=500_000).validate(spec)
    with pytest.raises(SetupError, match="use --method lora"):
        TrainingSetup(method="full", vision_tuning="lora", images=1).validate(spec)


def _simulate(family: str, method: str, tune: str, **kw):
    from vramlab.core.simulation.simulate import simulate

    spec, _ = _spec(family)
    setup = TrainingSetup(method=method, vision_tuning=tune, images=1, image_width=100, image_height=80, seq_len=24,
                          lora_rank=4, **kw)
    return spec, simulate(spec, setup, steps=1)


def test_vision_tuning_decides_what_of_the_tower_trains():
    """SmolVLM under ``simulate --hf``: a frozen tower has no vision gradients or states; a LoRA tower trains
    exactly rank x (in + out) per linear layer of its blocks, and files their gradients and states apart."""
    import torch

    from vramlab.core.tracing import vlm_traced

    spec, frozen = _simulate("smolvlm", "lora", "frozen")
    _, lora = _simulate("smolvlm", "lora", "lora")
    forward = next(p for p in frozen.phases if p.key == "forward@1")
    assert all(forward.components.get(k) for k in VISION_KINDS[:3])
    assert not any(p.components.get(Kind.VISION_TRAINING) for p in frozen.phases)
    cfg = vlm_traced.config_from_json(spec.transformers_config)
    with torch.device("meta"):
        model = vlm_traced.transformers_class(cfg)._from_config(cfg)
    linears = [m for _, stack in vlm_traced.layer_stacks(model.model.vision_model) for m in stack.modules()
               if isinstance(m, torch.nn.Linear)]
    assert lora.trainable_params - frozen.trainable_params == 4 * sum(m.in_features + m.out_features for m in linears)
    step = next(p for p in lora.phases if p.key == "optimizer@1")
    assert step.components.get(Kind.VISION_TRAINING, 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("family,method,tune,how", [
    ("smolvlm", "lora", "lora", "fitted at"), ("internvl", "lora", "frozen", "fitted at"),
    ("qwen2_vl", "full", "full", "for batch 3 only"),  # its attention loops over the images
    ("qwen3_vl", "lora", "lora", "simulated directly"),  # deepstack: its first decoder layers differ
    ("llava_next", "lora", "frozen", "fitted at")])
def test_traced_estimate_is_simulate_hf_at_a_point_not_fitted(family, method, tune, how, tmp_path, monkeypatch):
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = _spec(family)
    setup = TrainingSetup(method=method, vision_tuning=tune, images=1, image_width=300, image_height=200,
                          micro_batch=3, seq_len=100, lora_rank=16)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert how in est.notes[0]
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert {k: v for k, v in est.components.items() if k in VISION_KINDS} == \
        {k: v for k, v in sim.components.items() if k in VISION_KINDS}
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    if tune == "full":
        assert sim.trainable_params == sim.total_params == spec.param_count
    # the geometry is part of the tape's key: another image size is another trace, with its own tokens
    other = setup.replace(image_width=100, image_height=80)
    assert traced.cached_tape(spec, other, cuda=False) is None


@pytest.mark.slow
def test_a_tower_of_repeated_blocks_is_traced_at_three_and_repeated(tmp_path, monkeypatch):
    """SmolVLM with a six-block tower: traced with three blocks (one fewer, one more to verify), its blocks'
    events repeated four times, equal to simulate --hf of all six blocks and five decoder layers."""
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    cfg = tiny_configs()["smolvlm"]
    cfg["vision_config"]["num_hidden_layers"] = 6
    spec, _ = hf_config_to_spec(cfg, id="s", name="s")
    setup = TrainingSetup(method="lora", vision_tuning="lora", images=1, image_width=300, image_height=200,
                          micro_batch=3, seq_len=100, lora_rank=16)
    est = estimate(spec, setup, match_simulation=True)
    assert "3 layers and 3 vision blocks" in est.notes[0]
    sim = simulate(spec, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)


@pytest.mark.slow
@pytest.mark.parametrize("family,tune,autocast", [
    ("smolvlm", "lora", False), ("internvl", "frozen", False), ("qwen2_vl", "frozen", False),
    ("llava_next", "lora", False), ("idefics3", "frozen", True)])
def test_qlora_on_a_traced_vlm_is_simulate_hf_of_its_quantized_load(family, tune, autocast, tmp_path, monkeypatch):
    """QLoRA on a traced tower and language model (refused before: "not emulated yet"): transformers' own class
    loaded as its bitsandbytes quantizer stores it (every nn.Linear of tower, projector and language model but
    the output head), peft's LoRA on the quantized layers; the trace of that step equals simulate --hf of it."""
    from vramlab.core import traced
    from vramlab.core.estimate import estimate
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = _spec(family)
    setup = TrainingSetup(method="qlora", vision_tuning=tune, images=1, image_width=300, image_height=200,
                          micro_batch=3, seq_len=100, lora_rank=16, amp=autocast or None)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    lora = simulate(spec, setup.replace(method="lora", weights="bf16"))
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    assert sim.trainable_params == lora.trainable_params  # the same adapters, on quantized layers
    stored = sum(v for k, v in sim.phases[0].components.items() if k is not Kind.ADAPTERS)
    assert stored < 0.75 * sum(v for k, v in lora.phases[0].components.items() if k is not Kind.ADAPTERS)


def test_the_vision_regions_constant_arange_is_its_threads_own(monkeypatch: pytest.MonkeyPatch):
    """The app estimates in worker threads: the integer arange a vision region makes a constant under fake tensors
    (LFM2-VL's feature gather) is that thread's alone, meanwhile and after, whichever region leaves first (it was
    torch.arange patched for the process: another thread's arange was a constant meanwhile, and two regions
    overlapping in two threads left the first one's patch in place for good)."""
    import threading

    import torch
    import torch._subclasses.fake_tensor as ft
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.tracing.vlm_traced import _CONSTANT_LIMIT, TracedVlmModel

    monkeypatch.setattr(ft, "CONSTANT_NUMEL_LIMIT", _CONSTANT_LIMIT)  # as the traced VLM's guard raises it

    def constant() -> bool:
        return torch.arange(4).constant is not None

    original = torch.arange
    seen: dict[str, bool] = {}
    inside, leave = threading.Event(), threading.Event()

    def first_features() -> None:
        seen["first region"] = constant()
        inside.set()
        assert leave.wait(30)

    def first() -> None:
        with FakeTensorMode():
            TracedVlmModel._in_vision_region(first_features)()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(30)
        with FakeTensorMode():
            seen["other thread meanwhile"] = constant()

            def second_features() -> None:
                leave.set()  # the first region leaves before this one does
                thread.join(30)
                seen["second region"] = constant()

            TracedVlmModel._in_vision_region(second_features)()
            seen["after both"] = constant()
    finally:
        leave.set()
        thread.join(30)
    assert torch.arange is original
    assert seen == {"first region": True, "other thread meanwhile": False, "second region": True,
                    "after both": False}
