"""PaliGemma as a vision-language model: the estimate (core/families/paligemma/program.py) against transformers'
PaliGemmaForConditionalGeneration under fake tensors (core/families/paligemma/reference.py), its counts against
the class on the meta device, and its config.json's vision side (core/families/paligemma/config.py).

Tiny widths and three Gemma layers here. Skipped without transformers and peft where they are needed."""

from __future__ import annotations

import os

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.families.paligemma.config import vision_from_config
from vramlab.core.families.registry import PALIGEMMA
from vramlab.core.kinds import Kind
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import ProcessorSpec, VisionInput, VisionSpec, vision_tokens


def _spec(size: int) -> ModelSpec:
    side = size // 14
    proc = ProcessorSpec("siglip_fixed", patch_size=14, tile_size=size, tokens_per_tile=side * side)
    tower = VisionSpec("paligemma", depth=2, hidden_size=128, num_heads=2, intermediate_size=256,
                       out_hidden_size=256, hidden_act="gelu_pytorch_tanh", image_size=size, image_token_id=999,
                       processor=proc)
    return ModelSpec(id=f"paligemma-tiny-{size}", name="PaliGemma (tiny)", num_layers=3, hidden_size=256,
                     num_heads=4, num_kv_heads=1, head_dim=64, intermediate_size=512, vocab_size=1000,
                     activation="gelu_tanh", scale_embeddings=True, tie_embeddings=True, vision=tower)


# google/paligemma-3b-pt-224's config.json (the fields it writes)
PALIGEMMA_3B_PT_224 = {
    "architectures": ["PaliGemmaForConditionalGeneration"], "bos_token_id": 2, "eos_token_id": 1,
    "hidden_size": 2048, "ignore_index": -100, "image_token_index": 257152, "model_type": "paligemma",
    "pad_token_id": 0, "projection_dim": 2048, "torch_dtype": "float32", "transformers_version": "4.41.0.dev0",
    "text_config": {"hidden_size": 2048, "intermediate_size": 16384, "model_type": "gemma", "num_attention_heads": 8,
                    "num_hidden_layers": 18, "num_image_tokens": 256, "num_key_value_heads": 1,
                    "torch_dtype": "float32", "vocab_size": 257216},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "num_image_tokens": 256, "patch_size": 14,
                      "projection_dim": 2048, "projector_hidden_act": "gelu_fast", "vision_use_head": False},
}

# (vision tuning, method, images, batch, attention, checkpointing, image size): a trained, an adapted and a
# frozen tower, with and without images, at two image sizes (64 and 256 tokens an image)
CASES = [("lora", "lora", 1, 1, "sdpa", True, 112), ("frozen", "lora", 0, 1, "sdpa", False, 112),
         ("full", "full", 1, 1, "eager", True, 224)]
SLOW_CASES = [("lora", "lora", 2, 2, "sdpa", True, 112), ("frozen", "lora", 1, 1, "sdpa", False, 224),
              ("full", "full", 2, 1, "sdpa", True, 112),
              ("projector", "lora", 1, 2, "sdpa", False, 112), ("lora", "lora", 1, 1, "eager", False, 224),
              ("full", "full", 1, 1, "eager", False, 224)]


def _setup(tune: str, method: str, images: int, batch: int, attention: str, ckpt: bool, size: int) -> TrainingSetup:
    return TrainingSetup(method=method, vision_tuning=tune, images=images, micro_batch=batch, seq_len=32,
                         attention=attention, grad_ckpt=ckpt)


def _case_id(c: tuple) -> str:
    return f"{c[0]}-{c[2]}img-b{c[3]}-{c[4]}-{c[6]}px" + ("-ckpt" if c[5] else "")


def _held_to_the_simulation(case: tuple, **options) -> None:  # noqa: ANN003
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from vramlab.core.simulation.simulate import simulate

    spec = _spec(case[6])
    simulate(spec, _setup("frozen", "lora", 0, 1, "sdpa", False, 112))  # the first run in a process holds 1 KiB
    first = _setup(*case).replace(**options)
    # a quantized load's peak is the estimate's own: it holds the 16-bit weight that bitsandbytes quantizes on
    # the GPU, which the reference's emulated storage never makes (the step's phases are held)
    skip = {"load"} if first.weight_dtype.is_quantized else set()
    for setup in (first, first.replace(ckpt_reentrant=True)) if first.grad_ckpt else (first,):
        est = estimate(spec, setup, match_simulation=True)
        sim = simulate(spec, setup)
        assert est.peak_allocated_bytes == sim.peak_allocated_bytes, setup.ckpt_reentrant
        assert est.peak_phase == sim.peak_phase
        assert [(p.key, p.bytes) for p in est.phases if p.key not in skip] == \
            [(q.key, q.bytes) for q in sim.phases if q.key not in skip]
        # every category at the peak; the tower's optimizer states are filed as the tower's training once the
        # simulation's step has made them (VisionHFModel.file_optimizer_states), so a peak inside the first
        # optimizer step holds them as optimizer states there: those two categories are held by their sum
        filed = (Kind.VISION_TRAINING, Kind.OPTIMIZER_STATES)
        est_c, sim_c = dict(est.components), dict(sim.components)
        assert sum(est_c.pop(k, 0) for k in filed) == sum(sim_c.pop(k, 0) for k in filed)
        assert est_c == sim_c
        assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
        for kind in (Kind.VISION_WEIGHTS, Kind.PROJECTOR_WEIGHTS):
            assert est.components.get(kind, 0) > 0


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_paligemma_estimate_is_transformers_paligemma_simulated(case):
    """Every phase's peak and every category at the peak to the byte: the SigLIP tower, the linear projector,
    the (b, 1, s, s) prefix mask from token_type_ids that every Gemma layer's SDPA saves as an additive mask
    (eager: the additive mask itself), the 1-indexed positions the checkpointed layers keep."""
    _held_to_the_simulation(case)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VRAMLAB_SLOW") != "1", reason="set VRAMLAB_SLOW=1")
@pytest.mark.parametrize("case", SLOW_CASES, ids=[_case_id(c) for c in SLOW_CASES])
def test_paligemma_estimate_is_transformers_paligemma_simulated_more(case):
    _held_to_the_simulation(case)


# under CUDA autocast (issue 28): fp32 weights, and QLoRA's 16-bit tower under HF Trainer's bf16=True
AMP_CASES = [(("lora", "lora", 1, 1, "sdpa", True, 112), {"weights": "fp32"}),
             (("lora", "lora", 1, 1, "eager", False, 112), {"weights": "fp32"}),
             (("lora", "qlora", 1, 1, "sdpa", True, 112), {"amp": True})]


@pytest.mark.parametrize("case,options", AMP_CASES, ids=[_case_id(c) + "-" + "-".join(f"{k}={v}" for k, v in o.items())
                                                         for c, o in AMP_CASES])
def test_paligemma_under_autocast_is_transformers_paligemma_simulated_under_cuda_autocast(case, options):
    """Every phase and category to the byte under the reference's emulated CUDA autocast: the patch embedding's
    Conv2d is a lower-precision op (its output, which checkpointing keeps as the tower's input leaf, is bf16);
    a 16-bit LayerNorm weight and bias are cast to fp32 and saved; eager attention casts the key after
    repeat_kv (every head's copy); only autocast's cached copies of trained fp32 weights are AMP copies."""
    _held_to_the_simulation(case, **options)


def test_the_prefix_mask_costs_seq_squared_per_layer():
    """token_type_ids make transformers materialise the mask and hand it to SDPA (no is_causal): each layer
    saves a (b, 1, s, s) additive mask, so the activations grow with s² beyond what the s-linear parts add."""
    def acts(seq: int) -> int:
        return estimate(_spec(112), _setup("frozen", "lora", 1, 1, "sdpa", False, 112).replace(seq_len=seq)) \
            .components[Kind.ACTIVATIONS]
    a, b, c = acts(256), acts(512), acts(1024)
    assert (c - b) > 2 * (b - a)


def _hub_spec() -> ModelSpec:
    """google/paligemma-3b-pt-224 read as a config.json: the language model by the Gemma reader, the tower and
    projector by the family's config piece (asked by the reader through the registry)."""
    from vramlab.core.sources.hf_config import hf_config_to_spec

    spec, warnings = hf_config_to_spec(PALIGEMMA_3B_PT_224, id="pg", name="PaliGemma 3B")
    # only Gemma's class defaults; text_config.num_image_tokens is the family's to read, not an unread size
    assert [w for w in warnings if "defaults" not in w] == []
    assert spec.vision is not None and spec.vision.model_type == PALIGEMMA
    return spec


def test_the_reader_and_the_family_piece_read_the_same_tower():
    """The config.json route (hf_config asks the family's config piece) gives the tower the piece gives alone."""
    warnings: list[str] = []
    assert vision_from_config(PALIGEMMA_3B_PT_224, PALIGEMMA_3B_PT_224["text_config"], "config.json", warnings) \
        == _hub_spec().vision
    assert not warnings
    bad = {**PALIGEMMA_3B_PT_224, "text_config": {**PALIGEMMA_3B_PT_224["text_config"], "num_image_tokens": 100}}
    with pytest.raises(SetupError, match="num_image_tokens 100"):
        vision_from_config(bad, bad["text_config"], "config.json", [])


def test_a_paligemma_config_json_counts_what_transformers_builds():
    """The Hub config read here and by transformers' PaliGemmaConfig: the tower, the projector and the whole
    model's parameters on the meta device, and the image tokens the config derives, (224 / 14)² = 256."""
    pytest.importorskip("transformers")
    import torch
    import transformers as tf

    spec = _hub_spec()
    cfg = tf.PaliGemmaConfig(**{k: v for k, v in PALIGEMMA_3B_PT_224.items() if k != "model_type"})
    with torch.device("meta"):
        model = tf.PaliGemmaForConditionalGeneration(cfg)
    count = {part: sum(p.numel() for n, p in model.named_parameters() if part in n)
             for part in ("vision_tower", "multi_modal_projector")}
    assert count["vision_tower"] == spec.vision.tower_params()
    assert count["multi_modal_projector"] == spec.vision.projector_params()
    assert sum(p.numel() for p in model.parameters()) == spec.param_count
    tokens = vision_tokens(spec.vision.processor, VisionInput(images=1, width=640, height=480))
    assert tokens.llm_tokens == cfg.text_config.num_image_tokens == 256
    assert tokens.units[0].resized == (224, 224)


def test_the_reference_config_builds_the_spec_s_count():
    """reference.hf_config(spec) builds a class with the parameters the spec counts (tiny and Hub-sized)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import PaliGemmaForConditionalGeneration

    from vramlab.core.families.paligemma.reference import hf_config
    from vramlab.core.spec.options import Attention

    for spec in (_spec(224), _hub_spec()):
        with torch.device("meta"):
            model = PaliGemmaForConditionalGeneration._from_config(hf_config(spec, Attention.SDPA),
                                                                   dtype=torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) == spec.param_count


@pytest.mark.parametrize("change,match", [
    ({"text_config": {**PALIGEMMA_3B_PT_224["text_config"], "model_type": "gemma2"}}, "Gemma 2"),
    ({"vision_config": {**PALIGEMMA_3B_PT_224["vision_config"], "vision_use_head": True}}, "vision_use_head"),
    ({"projection_dim": 1024}, "projection_dim"),
    ({"vision_config": {k: v for k, v in PALIGEMMA_3B_PT_224["vision_config"].items() if k != "patch_size"}},
     "lacks vision_config.patch_size"),
])
def test_a_config_it_cannot_model_exactly_is_refused_in_one_line(change, match):
    cfg = {**PALIGEMMA_3B_PT_224, **change}
    with pytest.raises(SetupError, match=match) as e:
        vision_from_config(cfg, cfg["text_config"], "config.json", [])
    assert "\n" not in str(e.value)


def test_a_gemma2_language_model_and_video_are_refused_not_estimated():
    import dataclasses

    pg2 = dataclasses.replace(_spec(112), norms_per_layer=4, final_logit_softcap=30.0, attn_logit_softcap=50.0)
    with pytest.raises(SetupError, match="Gemma 2") as e:
        estimate(pg2, TrainingSetup(method="lora", images=1, seq_len=16))
    assert "\n" not in str(e.value)
    with pytest.raises(SetupError, match="not video"):
        estimate(_spec(112), TrainingSetup(method="lora", images=1, frames=2, seq_len=16))
