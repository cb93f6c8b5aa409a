"""Vision-language models: the estimate (core/families/qwen2_5_vl/program.py) against transformers' own VLM class
run under fake tensors (core/families/qwen2_5_vl/reference.py), with the images shaped as the processor shapes them.

Tiny widths here; benchmarks/vlm.py runs the full-size models. Skipped without transformers and peft."""

from __future__ import annotations

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import ProcessorSpec, VisionSpec, vision_tokens

QWEN_PROC = ProcessorSpec("qwen_vl", patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136,
                          max_pixels=12845056)
TOWER = VisionSpec("qwen2_5_vl", depth=2, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=256,
                   window_size=112, fullatt_block_indexes=(1,), mrope_section=(8, 12, 12), processor=QWEN_PROC)
QWEN25_VL = ModelSpec(id="qwen2.5-vl-tiny", name="Qwen2.5-VL (tiny)", num_layers=2, hidden_size=256, num_heads=4,
                      num_kv_heads=2, intermediate_size=512, vocab_size=1000, qkv_bias=True, vision=TOWER)

CLIP_PROC = ProcessorSpec("siglip_fixed", patch_size=14, tile_size=56, tokens_per_tile=16, cls_token=True)
CLIP = VisionSpec("llava", depth=2, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=256,
                  hidden_act="quick_gelu", image_size=56, image_token_id=999, processor=CLIP_PROC)
LLAVA = ModelSpec(id="llava-tiny", name="LLaVA (tiny)", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4,
                  intermediate_size=512, vocab_size=1000, vision=CLIP)

# (vision tuning, method, image size, batch, attention, checkpointing[, frames]): frozen, LoRA and fully trained
# towers over image sizes (a checkpointed backward is held to 1 %, the rest to the byte); benchmarks/vlm.py runs
# the wider matrix (eager attention, the projector alone, checkpointing) and the full-size models
CASES = [
    ("frozen", "lora", (224, 168), 1, "sdpa", False),
    ("lora", "lora", (640, 480), 2, "sdpa", False),
    ("full", "full", (333, 1000), 1, "sdpa", False),
    ("full", "full", (320, 240), 2, "sdpa", False, 5),  # an image and a 5-frame video: two runs of the tower
]


def _setup(tune: str, method: str, size: tuple[int, int], batch: int, attention: str,
           ckpt: bool = False, frames: int = 0) -> TrainingSetup:
    return TrainingSetup(method=method, vision_tuning=tune, images=1, image_width=size[0], image_height=size[1],
                         micro_batch=batch, seq_len=64, attention=attention, grad_ckpt=ckpt, frames=frames)


def _case_id(c: tuple) -> str:
    video = f"-video{c[6]}" if len(c) > 6 else ""
    return f"{c[0]}-{c[2][0]}x{c[2][1]}-b{c[3]}-{c[4]}" + ("-ckpt" if c[5] else "") + video


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_estimate_is_the_transformers_vlm_simulated(case):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = _setup(*case)
    est = estimate(QWEN25_VL, setup, match_simulation=True)
    sim = simulate(QWEN25_VL, setup)
    tolerance = sim.peak_allocated_bytes // 100 if setup.grad_ckpt else 1024
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= tolerance, (est.peak_allocated_bytes,
                                                                                    sim.peak_allocated_bytes)
    assert est.peak_phase == sim.peak_phase
    for p, q in zip(est.phases, sim.phases):
        assert p.key == q.key and abs(p.bytes - q.bytes) <= max(1024, q.bytes // 100), (p.key, p.bytes, q.bytes)
    assert est.total_params == sim.total_params and est.trainable_params == sim.trainable_params
    # the vision side is filed apart in both
    for kind in (Kind.VISION_WEIGHTS, Kind.PROJECTOR_WEIGHTS):
        assert est.components.get(kind) == sim.components.get(kind) > 0


# under CUDA autocast (issue 28): fp32 weights, and QLoRA's 16-bit model under HF Trainer's bf16=True
AMP_CASES = [(("frozen", "lora", (224, 168), 1, "sdpa", False), {"weights": "fp32"}),
             (("lora", "lora", (640, 480), 2, "sdpa", False), {"weights": "fp32"}),
             (("full", "full", (320, 240), 2, "sdpa", False, 5), {"weights": "fp32"}),
             (("frozen", "qlora", (640, 480), 2, "sdpa", False), {"amp": True})]


@pytest.mark.parametrize("case,options", AMP_CASES,
                         ids=[_case_id(c) + "-" + "-".join(f"{k}={v}" for k, v in o.items()) for c, o in AMP_CASES])
def test_qwen25_vl_under_autocast_is_transformers_qwen25_vl_simulated_under_cuda_autocast(case, options):
    """Every step phase and category to the byte under the reference's emulated CUDA autocast: the forward and
    the loss run in HF Trainer's autocast region, whose weight cache holds each trained fp32 weight's copy until
    the region ends; the Conv3d patch embedding is a lower-precision op, so the tower's residual stream is bf16."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    simulate(QWEN25_VL, _setup("frozen", "lora", (224, 168), 1, "sdpa"))  # the first run in a process holds 1 KiB
    setup = _setup(*case).replace(**options)
    assert setup.autocast
    est = estimate(QWEN25_VL, setup, match_simulation=True)
    sim = simulate(QWEN25_VL, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.peak_phase == sim.peak_phase
    # the load's peak is 1 KiB apart with or without autocast (the reference's buffers): the step's phases
    assert [(p.key, p.bytes) for p in est.phases if p.key != "load"] == \
        [(q.key, q.bytes) for q in sim.phases if q.key != "load"]
    assert est.components == sim.components


def test_tower_training_shows_as_vision_activations_and_state():
    frozen = estimate(QWEN25_VL, _setup("frozen", "lora", (640, 480), 1, "sdpa"))
    lora = estimate(QWEN25_VL, _setup("lora", "lora", (640, 480), 1, "sdpa"))
    checkpointed = estimate(QWEN25_VL, _setup("lora", "lora", (640, 480), 1, "sdpa", ckpt=True))
    assert checkpointed.components[Kind.VISION_ACTIVATIONS] < lora.components[Kind.VISION_ACTIVATIONS]
    assert not frozen.components.get(Kind.VISION_ACTIVATIONS)  # a frozen tower keeps nothing for backward
    assert lora.components.get(Kind.VISION_ACTIVATIONS, 0) > 0
    assert lora.components.get(Kind.VISION_TRAINING, 0) > 0
    assert lora.peak_allocated_bytes > frozen.peak_allocated_bytes


def test_the_language_model_sees_the_processors_tokens():
    setup = _setup("frozen", "lora", (640, 480), 1, "sdpa")
    tokens = vision_tokens(QWEN_PROC, setup.vision_input())
    small = estimate(QWEN25_VL, setup.replace(max_pixels=100_352))
    big = estimate(QWEN25_VL, setup)
    assert tokens.llm_tokens == 17 * 23  # smart_resize(480, 640) = 476 x 644 pixels, 2x2 patches merged
    assert small.peak_allocated_bytes < big.peak_allocated_bytes


def test_images_on_a_text_model_or_a_frozen_tower_lora_are_refused():
    text = ModelSpec(id="t", name="Text", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                     intermediate_size=512, vocab_size=1000)
    with pytest.raises(SetupError, match="text model"):
        TrainingSetup(images=1).validate(text)
    with pytest.raises(SetupError, match="--method lora"):
        TrainingSetup(images=1, vision_tuning="lora").validate(QWEN25_VL)
    with pytest.raises(SetupError, match="vision tuning"):
        TrainingSetup(images=1, vision_tuning="half").validate(QWEN25_VL)


def test_cli_images_flags_show_the_tokens_and_bad_sizes_exit_2(capsys):
    from vramlab.core.cli import main

    assert main(["estimate", "-m", "qwen2.5-vl-3b", "--method", "lora", "--images", "2", "--image-size", "1280x720",
                 "--seq", "256", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["vision"]["vision_tokens"] == 2 * 1196 and out["vision"]["sequence"] == 256 + 2 * 1196
    assert out["components"]["vision_weights"] > 0 and out["setup"]["images"] == 2
    assert main(["estimate", "-m", "qwen2.5-vl-7b", "--image-size", "12x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WIDTHxHEIGHT" in err
    assert main(["estimate", "-m", "llama-3-8b", "--images", "1"]) == 2
    assert "text model" in capsys.readouterr().err


def test_the_advisor_knows_the_vision_levers():
    from vramlab.core.advisor import savings
    from vramlab.core.catalog import find_gpu

    setup = TrainingSetup(method="lora", images=1, image_width=640, image_height=480, frames=4, seq_len=64,
                          vision_tuning="lora", grad_ckpt=True, vision_ckpt=False)
    found = {s.key: s for s in savings(QWEN25_VL, setup, find_gpu("rtx-4090"))}
    for key in ("max_pixels", "freeze_tower", "fewer_frames", "vision_ckpt"):
        assert found[key].saves_bytes > 0, key
    assert found["freeze_tower"].setup.vision_tuning == "frozen"
    assert found["max_pixels"].setup.max_pixels < 476 * 644


QWEN25_VL_7B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 128000, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "temporal_patch_size": 2},
}


def test_a_qwen25_vl_config_json_brings_its_tower_and_a_broken_one_is_refused():
    from vramlab.core.catalog import find_model
    from vramlab.core.sources.hf_config import hf_config_to_spec

    spec, warnings = hf_config_to_spec(QWEN25_VL_7B_CONFIG, id="q", name="q")
    assert spec.vision == find_model("qwen2.5-vl-7b").vision
    assert spec.param_count == find_model("qwen2.5-vl-7b").param_count
    assert not any("not counted" in w for w in warnings) and any("max_pixels" in w for w in warnings)
    broken = {**QWEN25_VL_7B_CONFIG, "vision_config": {**QWEN25_VL_7B_CONFIG["vision_config"], "depth": "32"}}
    with pytest.raises(SetupError, match="vision_config.depth"):
        hf_config_to_spec(broken, id="q", name="q")


def test_a_qwen25_vl_folder_counts_the_tower_from_its_safetensors_headers(tmp_path):
    """The folder import holds the spec's count (tower and merger included) to the headers of the weights that
    transformers' own class has."""
    pytest.importorskip("transformers")
    import json

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.support.hub_server import safetensors_head
    from vramlab.core.catalog import resolve_model
    from vramlab.core.families.qwen2_5_vl.reference import hf_config
    from vramlab.core.spec.options import Attention

    cfg = hf_config(QWEN25_VL, Attention.SDPA)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    head, size = safetensors_head({n: ("BF16", tuple(p.shape)) for n, p in model.state_dict().items()})
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(head)
        f.truncate(size)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    entry = resolve_model(str(tmp_path))
    assert entry.spec.vision is not None and entry.spec.param_count == QWEN25_VL.param_count
    assert entry.tensor_params == sum(p.numel() for p in model.parameters())


def test_the_llava_preset_counts_what_transformers_builds():
    """llava-1.5-7b (CLIP ViT-L/14-336 tower, GELU projector, Llama) against LlavaForConditionalGeneration built
    from the preset on the meta device: tower, projector and total, each to the parameter."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlavaForConditionalGeneration

    from vramlab.core.catalog import find_model
    from vramlab.core.families.llava.reference import hf_config
    from vramlab.core.spec.options import Attention

    spec = find_model("llava-1.5-7b")
    with torch.device("meta"):
        model = LlavaForConditionalGeneration._from_config(hf_config(spec, Attention.SDPA), dtype=torch.float16)
    count = {part: sum(p.numel() for n, p in model.named_parameters() if part in n)
             for part in ("vision_tower", "multi_modal_projector")}
    assert count["vision_tower"] == spec.vision.tower_params()
    assert count["multi_modal_projector"] == spec.vision.projector_params()
    assert sum(p.numel() for p in model.parameters()) == spec.param_count == spec.published_params
    assert vision_tokens(spec.vision.processor, TrainingSetup(images=1).vision_input()).llm_tokens == 576


# LLaVA-1.5 (CLIP tower at a 56-px tile, 16 tokens an image): (vision tuning, method, images, batch, attention,
# checkpointing); the processor resizes every image to the tile, so images per sample is the size that varies
LLAVA_CASES = [
    ("frozen", "lora", 1, 2, "sdpa", False),
    ("projector", "lora", 1, 1, "sdpa", False),
    ("lora", "lora", 2, 2, "sdpa", False),
    ("full", "full", 1, 2, "eager", False),
    ("lora", "lora", 1, 2, "sdpa", True),
]


@pytest.mark.parametrize("case", LLAVA_CASES, ids=[f"{c[0]}-{c[2]}img-b{c[3]}-{c[4]}" + ("-ckpt" if c[5] else "")
                                                   for c in LLAVA_CASES])
def test_llava_estimate_is_transformers_llava_simulated(case):
    """core/families/llava/program.py against LlavaForConditionalGeneration under fake tensors: the peak to the byte
    (a checkpointed backward to 1 %), every phase's peak, the vision parts' weights."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    tune, method, images, batch, attention, ckpt = case
    setup = TrainingSetup(method=method, vision_tuning=tune, images=images, micro_batch=batch, seq_len=64,
                          attention=attention, grad_ckpt=ckpt)
    est = estimate(LLAVA, setup, match_simulation=True)
    sim = simulate(LLAVA, setup)
    tolerance = sim.peak_allocated_bytes // 100 if ckpt else 0
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= tolerance, (est.peak_allocated_bytes,
                                                                                    sim.peak_allocated_bytes)
    assert est.peak_phase == sim.peak_phase
    for p, q in zip(est.phases, sim.phases):
        assert p.key == q.key and abs(p.bytes - q.bytes) <= max(1024, q.bytes // 100), (p.key, p.bytes, q.bytes)
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    for kind in (Kind.VISION_WEIGHTS, Kind.PROJECTOR_WEIGHTS):
        assert est.components.get(kind) == sim.components.get(kind) > 0


LLAVA_15_7B_CONFIG = {  # llava-hf/llava-1.5-7b-hf config.json
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_a_llava_config_json_brings_its_clip_tower_and_other_towers_stay_uncounted():
    from vramlab.core.catalog import find_model
    from vramlab.core.sources.hf_config import hf_config_to_spec

    spec, warnings = hf_config_to_spec(LLAVA_15_7B_CONFIG, id="l", name="l")
    preset = find_model("llava-1.5-7b")
    assert spec.vision == preset.vision and spec.param_count == preset.param_count
    assert not any("not counted" in w for w in warnings)
    for key, value, match in (("vision_feature_select_strategy", "full", "CLS"),
                              ("vision_feature_layer", [-2, -5], "one feature layer"),
                              ("projector_hidden_act", "relu", "GELU")):
        spec, warnings = hf_config_to_spec({**LLAVA_15_7B_CONFIG, key: value}, id="l", name="l")
        assert spec.vision is None and any(match in w for w in warnings) and any("not counted" in w for w in warnings)
    siglip = {**LLAVA_15_7B_CONFIG["vision_config"], "model_type": "siglip_vision_model"}
    spec, warnings = hf_config_to_spec({**LLAVA_15_7B_CONFIG, "vision_config": siglip}, id="l", name="l")
    assert spec.vision is None and any("CLIP" in w for w in warnings)
    broken = {**LLAVA_15_7B_CONFIG["vision_config"], "num_hidden_layers": "24"}
    with pytest.raises(SetupError, match="vision_config.num_hidden_layers"):
        hf_config_to_spec({**LLAVA_15_7B_CONFIG, "vision_config": broken}, id="l", name="l")


def test_llava_video_frames_are_refused_not_dropped():
    with pytest.raises(SetupError, match="not video"):
        estimate(LLAVA, TrainingSetup(method="lora", images=1, frames=2, seq_len=16))


@pytest.mark.slow  # the same load as the text classes' (tests/test_traced_routing.py), on a VLM class
def test_kbit_prepare_on_a_vlm_is_peft_s_own_on_the_class():
    """--kbit-prepare on a vision-language model: peft's prepare_model_for_kbit_training runs on transformers'
    class after its quantized load (every 16-bit parameter left, the tower's included, in fp32); it was refused
    ("not applied on the HF path")."""
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    setup = _setup("frozen", "qlora", (320, 240), 1, "sdpa", False).replace(lora_targets=("q_proj", "v_proj"))
    prepared = setup.replace(kbit_upcast=True)
    est = estimate(QWEN25_VL, prepared, match_simulation=True)
    assert est.peak_allocated_bytes == simulate(QWEN25_VL, prepared).peak_allocated_bytes
    assert est.peak_allocated_bytes > estimate(QWEN25_VL, setup, match_simulation=True).peak_allocated_bytes
