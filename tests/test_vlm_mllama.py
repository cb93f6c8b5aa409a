"""Llama 3.2 Vision (mllama): the estimate (core/families/mllama/program.py) against transformers'
MllamaForConditionalGeneration run under fake tensors (core/families/mllama/reference.py),
the preset's count against the
class on the meta device, the builder's batch against the image processor's, and the config import.

Tiny widths here; benchmarks/vlm.py --family mllama runs the wider matrix and llama-3.2-11b-vision."""

from __future__ import annotations

import os

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import ProcessorSpec, VisionInput, VisionSpec, vision_tokens

PROC = ProcessorSpec("mllama", patch_size=14, tile_size=56, max_tiles=4, cls_token=True)
TINY = ModelSpec(id="mllama-tiny", name="Llama 3.2 Vision (tiny)", num_layers=5, hidden_size=256, num_heads=4,
                 num_kv_heads=2, intermediate_size=512, vocab_size=1000,
                 vision=VisionSpec("mllama", depth=4, global_depth=2, hidden_size=128, num_heads=2,
                                   intermediate_size=256, out_hidden_size=256, hidden_act="gelu", image_size=56,
                                   intermediate_layers=(1, 3), aspect_ratios=8, cross_attention_layers=(1, 3),
                                   image_token_id=999, processor=PROC))

# (vision tuning, method, image side, images, batch, attention): a LoRA tower and two images by default; the rest
# of the matrix (frozen, projector, full, eager, four tiles, batch 2) with VRAMLAB_SLOW=1, and wider in
# benchmarks/vlm.py --family mllama
SLOW = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("VRAMLAB_SLOW") != "1", reason="set VRAMLAB_SLOW=1")]
CASES = [
    ("lora", "lora", 56, 2, 1, "sdpa"),
    pytest.param(("lora", "lora", 112, 2, 2, "sdpa"), marks=SLOW),
    pytest.param(("frozen", "lora", 56, 1, 1, "sdpa"), marks=SLOW),
    pytest.param(("full", "full", 56, 1, 2, "eager"), marks=SLOW),
    pytest.param(("projector", "lora", 112, 1, 1, "eager"), marks=SLOW),
]


def _setup(tune: str, method: str, side: int, images: int, batch: int, attention: str) -> TrainingSetup:
    return TrainingSetup(method=method, vision_tuning=tune, images=images, image_width=side, image_height=side,
                         micro_batch=batch, seq_len=64, attention=attention)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_mllama_estimate_is_transformers_mllama_simulated(case):
    """Every phase's peak to the byte, the parameters counted alike and the vision side filed apart."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = _setup(*case)
    est = estimate(TINY, setup, match_simulation=True)
    sim = simulate(TINY, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.peak_phase == sim.peak_phase
    assert [(p.key, p.bytes) for p in est.phases] == [(q.key, q.bytes) for q in sim.phases]
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    for kind in (Kind.VISION_WEIGHTS, Kind.PROJECTOR_WEIGHTS, Kind.ACTIVATIONS, Kind.VISION_ACTIVATIONS):
        assert est.components.get(kind) == sim.components.get(kind)


# under CUDA autocast (issue 28): fp32 weights, bf16 compute
AMP_CASES = [("lora", "lora", 56, 2, 1, "sdpa"), ("frozen", "lora", 56, 1, 1, "sdpa"),
             ("full", "full", 56, 1, 2, "eager")]


@pytest.mark.parametrize("case", AMP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_mllama_under_autocast_is_transformers_mllama_simulated_under_cuda_autocast(case):
    """Every phase and category to the byte under the reference's emulated CUDA autocast: SDPA with a mask is a
    lower-precision op (q, k, v and the additive mask cast, the casts saved); the tower's aspect-ratio mask is a
    matmul, so it is made in the compute dtype; the Conv2d patch embedding's input and weight are cast (and saved
    where the tower trains); eager attention's matmuls cast their operands."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = _setup(*case).replace(weights="fp32")
    assert setup.autocast
    est = estimate(TINY, setup, match_simulation=True)
    sim = simulate(TINY, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.peak_phase == sim.peak_phase
    assert [(p.key, p.bytes) for p in est.phases] == [(q.key, q.bytes) for q in sim.phases]
    # the tower's optimizer states are filed as its training once the simulation's step has made them
    filed = (Kind.VISION_TRAINING, Kind.OPTIMIZER_STATES)
    est_c, sim_c = dict(est.components), dict(sim.components)
    assert sum(est_c.pop(k, 0) for k in filed) == sum(sim_c.pop(k, 0) for k in filed)
    assert est_c == sim_c


def test_the_llama_32_11b_vision_preset_counts_what_transformers_builds():
    pytest.importorskip("transformers")
    import torch
    from transformers import MllamaForConditionalGeneration

    from vramlab.core.catalog import find_model
    from vramlab.core.families.mllama.reference import hf_config
    from vramlab.core.spec.options import Attention

    spec = find_model("llama-3.2-11b-vision")
    with torch.device("meta"):
        model = MllamaForConditionalGeneration._from_config(hf_config(spec, Attention.SDPA), dtype=torch.bfloat16)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model) == spec.param_count
    assert count(model.model.vision_model) == spec.vision.tower_params()
    assert count(model.model.multi_modal_projector) == spec.vision.projector_params()


@pytest.mark.parametrize("w,h", [(560, 560), (1120, 560), (560, 1680), (800, 600), (4000, 3000), (300, 2000)])
def test_the_builders_image_batch_is_the_image_processors(w, h):
    """pixel_values, aspect_ratio_ids and aspect_ratio_mask as MllamaImageProcessor makes them for one image."""
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    import numpy as np
    import torch
    from PIL import Image
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    from vramlab.core.catalog import find_model
    from vramlab.core.families.mllama.reference import MllamaHFModel, _aspect_ratio_id
    from vramlab.core.tracing.hf import BuildPlan

    spec = find_model("llama-3.2-11b-vision")
    setup = TrainingSetup(method="lora", images=1, image_width=w, image_height=h, seq_len=8)
    tokens = vision_tokens(spec.vision.processor, setup.vision_input())
    ip = MllamaImageProcessorPil(size={"height": 560, "width": 560}, max_image_tiles=4)
    out = ip(images=[[Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8))]], return_tensors="np")
    model = MllamaHFModel.__new__(MllamaHFModel)
    torch.nn.Module.__init__(model)
    model.plan, model.tokens = BuildPlan(spec, setup, torch.device("cpu"), False), tokens
    with torch.device("meta"):
        batch = model.make_batch(setup, torch.device("meta"), real=False)
    assert tuple(batch["pixel_values"].shape) == out["pixel_values"].shape
    # meta tensors carry no values: the ids and the mask the batch is filled from
    assert [[_aspect_ratio_id(u.resized, 560, 4) for u in tokens.units]] == out["aspect_ratio_ids"].tolist()
    assert [[[1] * u.tiles + [0] * (4 - u.tiles) for u in tokens.units]] == out["aspect_ratio_mask"].tolist()
    assert tuple(batch["cross_attention_mask"].shape) == (1, setup.seq_len + 1, 1, 4)


LLAMA_32_11B_VISION_CONFIG = {  # meta-llama/Llama-3.2-11B-Vision config.json (the keys that size the model)
    "architectures": ["MllamaForConditionalGeneration"], "image_token_index": 128256, "model_type": "mllama",
    "torch_dtype": "bfloat16",
    "text_config": {"cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38], "hidden_act": "silu",
                    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
                    "model_type": "mllama_text_model", "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                    "tie_word_embeddings": False, "vocab_size": 128256},
    "vision_config": {"attention_heads": 16, "hidden_act": "gelu", "hidden_size": 1280, "image_size": 560,
                      "intermediate_layers_indices": [3, 7, 15, 23, 30], "intermediate_size": 5120,
                      "max_num_tiles": 4, "model_type": "mllama_vision_model", "num_channels": 3,
                      "num_global_layers": 8, "num_hidden_layers": 32, "patch_size": 14,
                      "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]],
                      "vision_output_dim": 7680},
}


def test_an_hf_config_json_gives_the_presets_spec_and_a_broken_one_is_refused():
    import copy

    from vramlab.core.catalog import find_model
    from vramlab.core.sources.hf_config import hf_config_to_spec

    spec, warnings = hf_config_to_spec(LLAMA_32_11B_VISION_CONFIG, id="x", name="x")
    preset = find_model("llama-3.2-11b-vision")
    assert spec.vision == preset.vision and spec.param_count == preset.param_count
    assert not any("not counted" in w for w in warnings)
    for path, value, word in ((("vision_config", "num_global_layers"), None, "num_global_layers"),
                              (("text_config", "cross_attention_layers"), "3,8", "cross_attention_layers"),
                              (("vision_config", "vision_output_dim"), 1280, "vision_output_dim"),
                              (("text_config", "cross_attention_layers"), [3, 40], "outside the 40")):
        cfg = copy.deepcopy(LLAMA_32_11B_VISION_CONFIG)
        if value is None:
            del cfg[path[0]][path[1]]
        else:
            cfg[path[0]][path[1]] = value
        with pytest.raises(SetupError, match=word):
            hf_config_to_spec(cfg, id="x", name="x")


def test_lora_names_mean_the_language_models_self_and_cross_attention():
    """q_proj / v_proj adapt both kinds of decoder layer (the cross-attention layers' k/v read the vision
    states); the tower's same-named projections only with --vision-tuning lora."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import re

    from vramlab.core.families.mllama.reference import _target_regex

    setup = TrainingSetup(method="lora", lora_targets=("q_proj", "v_proj"))
    rx = re.compile(_target_regex(TINY, setup))
    assert rx.match("base_model.model.model.language_model.layers.1.cross_attn.v_proj")
    assert rx.match("base_model.model.model.language_model.layers.0.self_attn.q_proj")
    assert not rx.match("base_model.model.model.vision_model.transformer.layers.0.self_attn.q_proj")
    tower = re.compile(_target_regex(TINY, setup.replace(vision_tuning="lora")))
    assert tower.match("base_model.model.model.vision_model.global_transformer.layers.1.self_attn.o_proj")
    # what plain peft does with the same names (docs/vision.md): the tower's q/v of both encoders as well
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MllamaForConditionalGeneration

    from vramlab.core.families.mllama.reference import hf_config
    from vramlab.core.spec.options import Attention

    with torch.device("meta"):
        model = MllamaForConditionalGeneration._from_config(hf_config(TINY, Attention.SDPA))
        adapted = [n for n, _ in get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
                   .named_modules() if n.endswith(".lora_A")]
    v = TINY.vision
    assert sum(".vision_model." in n for n in adapted) == 2 * (v.depth + v.global_depth)
    assert sum(".cross_attn." in n for n in adapted) == 2 * len(v.cross_attention_layers)
    assert sum(".self_attn." in n and ".language_model." in n for n in adapted) == 2 * (
        TINY.num_layers - len(v.cross_attention_layers))


def test_reentrant_checkpointing_with_images_fails_in_transformers_and_is_refused():
    """The refusal's reason, held to transformers itself: a real tiny step under reentrant checkpointing fails
    in backward (the vision states reach each cross-attention layer as a keyword argument); non-reentrant runs."""
    setup = _setup("frozen", "lora", 56, 1, 1, "sdpa").replace(grad_ckpt=True)
    with pytest.raises(SetupError, match="reentrant gradient checkpointing"):
        setup.replace(ckpt_reentrant=True).validate(TINY)
    setup.validate(TINY)  # transformers' default, non-reentrant, trains
    pytest.importorskip("transformers")
    import torch
    from transformers import MllamaForConditionalGeneration

    from vramlab.core.families.mllama.reference import MllamaHFModel, hf_config
    from vramlab.core.spec.options import Attention

    torch.manual_seed(0)
    model = MllamaForConditionalGeneration._from_config(hf_config(TINY, Attention.SDPA), dtype=torch.float32)
    model.train()
    tokens = vision_tokens(PROC, VisionInput(images=1, width=56, height=56))
    wrapper = MllamaHFModel.__new__(MllamaHFModel)
    torch.nn.Module.__init__(wrapper)
    from vramlab.core.tracing.hf import BuildPlan

    wrapper.plan, wrapper.tokens = BuildPlan(TINY, setup, torch.device("cpu"), True), tokens
    for reentrant, fails in ((True, True), (False, False)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        batch = wrapper.make_batch(setup, torch.device("cpu"), real=True)
        loss = model(**batch, use_cache=False).loss
        if fails:
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
        else:
            loss.backward()
        model.zero_grad(set_to_none=True)


def test_an_mllama_folder_counts_the_tower_from_its_safetensors_headers(tmp_path):
    """The folder import holds the spec's count (tower, projector and the cross-attention layers' norms and
    gates included) to the headers of the weights that transformers' own class has."""
    pytest.importorskip("transformers")
    import json

    import torch
    from transformers import MllamaForConditionalGeneration

    from tests.support.hub_server import safetensors_head
    from vramlab.core.catalog import resolve_model
    from vramlab.core.families.mllama.reference import hf_config
    from vramlab.core.spec.options import Attention

    cfg = hf_config(TINY, Attention.SDPA)
    with torch.device("meta"):
        model = MllamaForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    head, size = safetensors_head({n: ("BF16", tuple(p.shape)) for n, p in model.state_dict().items()})
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(head)
        f.truncate(size)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    entry = resolve_model(str(tmp_path))
    assert entry.spec.vision == TINY.vision and entry.spec.param_count == TINY.param_count
    assert entry.tensor_params == sum(p.numel() for p in model.parameters())


def test_the_advisor_offers_no_checkpointing_with_images_but_the_frozen_tower():
    """Reentrant checkpointing is an invalid setup here (the setup's own validation says why) and the default
    non-reentrant one is not in the estimate, so the Advisor leaves it out instead of failing; freezing the tower
    is the large lever."""
    from vramlab.core.advisor import savings

    setup = _setup("lora", "lora", 112, 1, 1, "sdpa")
    with pytest.raises(SetupError, match="checkpointing"):
        setup.replace(grad_ckpt=True, ckpt_reentrant=True).validate(TINY)
    keys = [s.key for s in savings(TINY, setup)]
    assert "freeze_tower" in keys and "grad_ckpt" not in keys
    setup.replace(grad_ckpt=True, images=0).validate(TINY)  # a text-only batch skips the cross-attention layers


@pytest.mark.parametrize("method", [pytest.param("lora", marks=SLOW), pytest.param("full", marks=SLOW)])
def test_a_text_only_batch_checkpointed_skips_the_cross_attention_layers(method):
    """Without images transformers skips the cross-attention layers, and reentrant checkpointing runs: held
    within 1 % (the checkpointed step is 512 B low in the forward, as for the other families' checkpointing)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = TrainingSetup(method=method, images=0, seq_len=64, grad_ckpt=True, ckpt_reentrant=True)
    est = estimate(TINY, setup, match_simulation=True)
    sim = simulate(TINY, setup)
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= sim.peak_allocated_bytes // 100
    for p, q in zip(est.phases, sim.phases):
        assert p.key == q.key and abs(p.bytes - q.bytes) <= q.bytes // 100


def test_default_checkpointing_with_images_answers_under_transformers_own_classes():
    """Llama 3.2 Vision LoRA + checkpointing with images under transformers 5's default (non-reentrant) mode:
    the simulation of transformers' own classes answers; the estimate names it as not modelled and points there."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = _setup("lora", "lora", 56, 2, 1, "sdpa").replace(grad_ckpt=True)
    plain = simulate(TINY, setup.replace(grad_ckpt=False))
    ckpt = simulate(TINY, setup)
    assert 0 < ckpt.peak_allocated_bytes < plain.peak_allocated_bytes
    with pytest.raises(SetupError, match="vramlab simulate"):
        estimate(TINY, setup)


def test_qlora_under_autocast_is_refused_until_it_is_held() -> None:
    """Each alone is held to transformers' class; together they are 0.75-1.6 % low on the tiny model, so refused."""
    from vramlab.core.checks import SetupError

    setup = TrainingSetup(method="qlora", amp=True, images=1, image_width=112, image_height=112, seq_len=48)
    with pytest.raises(SetupError, match="quantized step under autocast"):
        setup.validate(TINY)
    setup.replace(amp=False).validate(TINY)
    TrainingSetup(method="lora", weights="fp32", amp=True, images=1, image_width=112, image_height=112,
                  seq_len=48).validate(TINY)
