"""Gemma 3 as a vision-language model: the estimate (core/families/gemma3/program.py) against transformers'
Gemma3ForConditionalGeneration under fake tensors (core/families/gemma3/reference.py), its presets' counts against the
class on the meta device, pan-and-scan against the image processor, and the config import.

Tiny widths here (7 layers: six sliding-window ones and a global one); benchmarks/vlm.py --family gemma3 runs a
wider matrix and gemma-3-4b-it at full size. Skipped without transformers and peft."""

from __future__ import annotations

import os

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import ProcessorSpec, VisionInput, VisionSpec, vision_tokens

PROC = ProcessorSpec("siglip_fixed", patch_size=14, tile_size=112, tokens_per_tile=16, pan_and_scan_max_crops=4,
                     pan_and_scan_min_crop=56)
SIGLIP = VisionSpec("gemma3", depth=2, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=256,
                    hidden_act="gelu_pytorch_tanh", image_size=112, image_token_id=999, processor=PROC)
GEMMA3 = ModelSpec(id="gemma3-tiny", name="Gemma 3 (tiny)", num_layers=7, hidden_size=256, num_heads=4,
                   num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000, activation="gelu_tanh",
                   norms_per_layer=4, qk_norm=True, scale_embeddings=True, tie_embeddings=True, vision=SIGLIP)

# (vision tuning, method, images, batch, attention, checkpointing, pan-and-scan): frozen, LoRA and trained towers,
# one and two images, a 300x100 image with its two pan-and-scan crops; every phase to the byte
CASES = [("lora", "lora", 2, 2, "sdpa", True, True)]  # 10-25 s on the shared machine; the rest with VRAMLAB_SLOW=1
SLOW_CASES = [
    ("frozen", "lora", 1, 1, "sdpa", False, True),
    ("full", "full", 1, 1, "eager", False, False),
    ("projector", "lora", 1, 2, "sdpa", False, False),
    ("lora", "lora", 2, 2, "eager", False, True),
    ("full", "full", 2, 2, "sdpa", True, False),
    ("frozen", "lora", 0, 1, "sdpa", False, False),
    ("lora", "lora", 8, 1, "sdpa", True, False),  # eight tiles: the tower's recompute decides the peak
]


def _setup(tune: str, method: str, images: int, batch: int, attention: str, ckpt: bool, pas: bool) -> TrainingSetup:
    # checkpointing in transformers' default (non-reentrant) mode; _held_to_the_simulation holds the reentrant one too
    return TrainingSetup(method=method, vision_tuning=tune, images=images, image_width=300, image_height=100,
                         pan_and_scan=pas, micro_batch=batch, seq_len=32, attention=attention, grad_ckpt=ckpt)


def _case_id(c: tuple) -> str:
    return f"{c[0]}-{c[2]}img-b{c[3]}-{c[4]}" + ("-ckpt" if c[5] else "") + ("-pan" if c[6] else "")


def _held_to_the_simulation(case: tuple) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    simulate(GEMMA3, _setup("frozen", "lora", 0, 1, "sdpa", False, False))  # the first run in a process holds 1 KiB
    first = _setup(*case)
    # both of torch's checkpointing modes: transformers' default (non-reentrant: each block's recompute stops at its
    # last saved tensor, and the keyword arguments the layer binds go with its backward) and the reentrant one
    for setup in (first, first.replace(ckpt_reentrant=True)) if first.grad_ckpt else (first,):
        est = estimate(GEMMA3, setup, match_simulation=True)
        sim = simulate(GEMMA3, setup)
        assert est.peak_allocated_bytes == sim.peak_allocated_bytes, setup.ckpt_reentrant
        assert est.peak_phase == sim.peak_phase
        assert [(p.key, p.bytes) for p in est.phases] == [(q.key, q.bytes) for q in sim.phases]
        assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
        for kind in (Kind.VISION_WEIGHTS, Kind.PROJECTOR_WEIGHTS):
            assert est.components.get(kind) == sim.components.get(kind) > 0


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_gemma3_estimate_is_transformers_gemma3_simulated(case):
    """Every phase's peak to the byte: the SigLIP tower, the pooled projector, the two (b, 1, s, s) image masks
    from token_type_ids that every layer's SDPA saves as an additive mask, a RoPE pair per layer type."""
    _held_to_the_simulation(case)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VRAMLAB_SLOW") != "1", reason="set VRAMLAB_SLOW=1")
@pytest.mark.parametrize("case", SLOW_CASES, ids=[_case_id(c) for c in SLOW_CASES])
def test_gemma3_estimate_is_transformers_gemma3_simulated_more(case):
    _held_to_the_simulation(case)


def test_the_image_masks_cost_seq_squared_per_layer():
    """token_type_ids make transformers build the masks and pass them to SDPA (no is_causal): each layer saves
    a (b, 1, s, s) additive mask, so the activations grow with s² beyond what the s-linear parts add."""
    def acts(seq: int) -> int:
        return estimate(GEMMA3, _setup("frozen", "lora", 1, 1, "sdpa", False, False).replace(seq_len=seq)) \
            .components[Kind.ACTIVATIONS]
    a, b, c = acts(256), acts(512), acts(1024)
    assert (c - b) > 2 * (b - a)


@pytest.mark.parametrize("preset", ["gemma-3-4b-it", "gemma-3-12b-it", "gemma-3-27b-it"])
def test_gemma3_presets_count_what_transformers_builds(preset):
    pytest.importorskip("transformers")
    import torch
    from transformers import Gemma3ForConditionalGeneration

    from vramlab.core.catalog import find_model
    from vramlab.core.families.gemma3.reference import hf_config
    from vramlab.core.spec.options import Attention

    spec = find_model(preset)
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration._from_config(hf_config(spec, Attention.SDPA), dtype=torch.bfloat16)
    count = {part: sum(p.numel() for n, p in model.named_parameters() if part in n)
             for part in ("vision_tower", "multi_modal_projector")}
    assert count["vision_tower"] == spec.vision.tower_params()
    assert count["multi_modal_projector"] == spec.vision.projector_params()
    assert sum(p.numel() for p in model.parameters()) == spec.param_count == spec.published_params


@pytest.mark.parametrize("w,h", [(448, 448), (1280, 720), (333, 1000), (3000, 400), (600, 500), (300, 1200)])
def test_pan_and_scan_crops_are_the_image_processors(w, h):
    pytest.importorskip("PIL")
    pytest.importorskip("transformers")
    import numpy as np
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from vramlab.core.catalog import find_model

    proc = find_model("gemma-3-4b-it").vision.processor
    ip = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, do_pan_and_scan=True,
                                 pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                                 pan_and_scan_min_ratio_to_activate=1.2)  # Gemma3Processor's defaults
    out = ip(images=[np.zeros((h, w, 3), dtype=np.uint8)], return_tensors="np")
    ours = vision_tokens(proc, VisionInput(images=1, width=w, height=h, pan_and_scan=True)).units[0]
    assert ours.tiles == 1 + int(out["num_crops"][0]) == out["pixel_values"].shape[0]
    assert ours.sequences == (64 * 64,) * ours.tiles and ours.llm_tokens == 256 * ours.tiles


def test_pan_and_scan_is_refused_where_the_processor_has_none(capsys):
    from vramlab.core.cli import main

    assert main(["estimate", "-m", "llava-1.5-7b", "--method", "lora", "--images", "1", "--pan-and-scan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pan-and-scan" in err
    assert main(["estimate", "-m", "gemma-3-4b-it", "--method", "lora", "--images", "1", "--image-size", "1280x720",
                 "--pan-and-scan", "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["vision"]["vision_tokens"] == 3 * 256  # the image and two crops



def test_a_gemma3_config_json_brings_its_tower_and_other_towers_stay_uncounted():
    from tests.test_hf_config import GEMMA3_4B_IT  # google/gemma-3-4b-it's config.json
    from vramlab.core.catalog import find_model
    from vramlab.core.sources.hf_config import hf_config_to_spec

    spec, warnings = hf_config_to_spec(GEMMA3_4B_IT, id="g", name="g")
    preset = find_model("gemma-3-4b-it")
    assert spec.vision == preset.vision and spec.param_count == preset.param_count
    assert not any("not counted" in w for w in warnings)
    for key, value, match in (("vision_use_head", True, "pooling head"), ("hidden_act", "gelu", "tanh GELU"),
                              ("model_type", "clip_vision_model", "SigLIP")):
        cfg = {**GEMMA3_4B_IT, "vision_config": {**GEMMA3_4B_IT["vision_config"], key: value}}
        spec, warnings = hf_config_to_spec(cfg, id="g", name="g")
        assert spec.vision is None and any(match in w for w in warnings) and any("not counted" in w for w in warnings)
    broken = {**GEMMA3_4B_IT["vision_config"], "num_hidden_layers": "27"}
    with pytest.raises(SetupError, match="vision_config.num_hidden_layers"):
        hf_config_to_spec({**GEMMA3_4B_IT, "vision_config": broken}, id="g", name="g")


def test_gemma3_video_frames_are_refused_not_dropped():
    with pytest.raises(SetupError, match="not video"):
        estimate(GEMMA3, TrainingSetup(method="lora", images=1, frames=2, seq_len=16))


def test_the_advisor_offers_pan_and_scan_off_where_it_adds_crops():
    from vramlab.core.advisor import savings
    from vramlab.core.catalog import find_gpu

    wide = _setup("frozen", "lora", 1, 1, "sdpa", False, True)  # 300x100: the image and three crops
    found = {s.key: s for s in savings(GEMMA3, wide, find_gpu("rtx-4090"))}
    assert found["no_pan_and_scan"].saves_bytes > 0 and not found["no_pan_and_scan"].setup.pan_and_scan
    square = wide.replace(image_width=100)  # no crops for a square image: nothing to offer
    assert "no_pan_and_scan" not in {s.key for s in savings(GEMMA3, square, find_gpu("rtx-4090"))}


def test_a_gemma3_folder_counts_the_tower_from_its_safetensors_headers(tmp_path):
    """A model folder (config.json and the headers of the weights transformers' class has, the tied head not
    stored) gives the spec's count, tower and projector included."""
    pytest.importorskip("transformers")
    import json

    import torch
    from transformers import Gemma3ForConditionalGeneration

    from tests.support.hub_server import safetensors_head
    from vramlab.core.catalog import resolve_model
    from vramlab.core.families.gemma3.reference import hf_config
    from vramlab.core.spec.options import Attention

    cfg = hf_config(GEMMA3, Attention.SDPA)
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    head, size = safetensors_head({n: ("BF16", tuple(p.shape)) for n, p in model.state_dict().items()
                                   if n != "lm_head.weight"})
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(head)
        f.truncate(size)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    entry = resolve_model(str(tmp_path))
    import dataclasses

    # the processor's crop size is the real one (256 px), not the tiny tile's 56
    assert dataclasses.replace(entry.spec.vision, processor=PROC) == GEMMA3.vision
    assert entry.spec.param_count == GEMMA3.param_count
    assert entry.tensor_params == sum(p.numel() for p in model.parameters())
