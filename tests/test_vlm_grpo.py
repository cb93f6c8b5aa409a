"""GRPO on a vision-language model (issue 28; refused before: "--objective grpo is not modelled on a vision-language
model yet"), as TRL 1.16.0's GRPOTrainer runs one: the processor over the prompts and their images, ``generate`` with
the pixel inputs in the prefill only (the decoding reads the KV cache, the prompt's image tokens in it), the
processor again for the scoring forwards (old policy, reference) in chunks of the micro-batch, each micro-batch's
pixel inputs concatenated into a copy of their own (``unsplit_pixel_values_by_grid``) and kept to the next
generation, and the policy's loss forward over prompt + completion with them. The same GRPO step as a text model's
(core/objectives/grpo/), its images handed through; each hand-written family's estimate is held to transformers'
own class under fake tensors running that step: the peak, every phase's peak, the parameters.

Skipped without transformers and peft."""

from __future__ import annotations

import pytest

from tests.test_vlm_dpo import _case_id, _slow, estimated_and_simulated
from tests.test_vlm_freeze import _spec  # the tiny configs of every hand-written family
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind, Phase
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")

GRPO = {"objective": "grpo", "completion_len": 16, "num_generations": 2, "micro_batch": 2}


# (family, method, vision tuning, more): LoRA with the policy's adapters off as the reference (beta > 0: a scoring
# pass with the images); vLLM's token ids (no generation on the training allocator, the images only in the
# scoring and the loss); Qwen2.5-VL's patches and grid rows sliced per chunk; a full reference copy scoring the
# same pixel inputs; old-policy scoring (generation every step, more micro-batches than generated at once: each
# its own pixel copy); ZeRO-3's gathered generation; checkpointing (off while generating and scoring); autocast
CASES = [
    ("llava", "lora", "frozen", {"beta": 0.04}),
    ("llava", "lora", "frozen", {"generation_backend": "vllm-colocate"}),
    _slow("qwen2_5_vl", "lora", "lora", {}),
    _slow("llava", "full", "full", {"beta": 0.04}),
    _slow("qwen2_5_vl", "full", "full", {"weights": "fp32", "compute": "bf16", "beta": 0.04}),
    _slow("llava", "lora", "lora", {"micro_batch": 1, "grad_accum": 2, "num_iterations": 2}),
    _slow("llava", "full", "frozen", {"sharding": "zero3", "gpus": 4}),
    _slow("llava", "lora", "frozen", {"grad_ckpt": True}),
    _slow("paligemma", "full", "full", {}),
]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_grpo_on_a_vlm_is_trls_step_on_transformers_vlm_simulated(case: tuple) -> None:
    setup, _est, sim = estimated_and_simulated(case, GRPO)
    # the images run through the tower in the generation's prefill (unless vLLM generates; at these sizes its peak)
    # and the loss's forward
    phases = {p.key: p for p in sim.phases}
    assert phases["forward@1"].components.get(Kind.VISION_ACTIVATIONS, 0) > 0
    generated = [p for p in sim.phases if p.phase is Phase.GENERATE]
    if setup.generation_backend.value == "transformers":
        assert generated and generated[0].components.get(Kind.VISION_ACTIVATIONS, 0) > 0


def test_the_prompts_image_tokens_are_in_the_generation_cache() -> None:
    """Generation's KV cache holds the prompt's image placeholders: each image more, a larger cache at the
    generation's peak (the estimate alone: the step the test above holds to the class)."""
    spec, kw = _spec("llava")
    setup = TrainingSetup(method="lora", **{**GRPO, **kw})

    def cache(images: int) -> int:
        est = estimate(spec, setup.replace(images=images), match_simulation=True)
        return next(p for p in est.phases if p.phase is Phase.GENERATE).components.get(Kind.KV_CACHE, 0)

    assert 0 < cache(0) < cache(1) < cache(2)


@pytest.mark.parametrize(("family", "kw", "fragment"), [
    ("qwen2_5_vl", {"frames": 4}, "GRPOTrainer takes images, not video"),
    ("mllama", {}, "aspect_ratio_ids` must be provided"),
    ("llava", {"grad_ckpt": True, "vision_ckpt": False}, "drop --no-vision-ckpt"),
])
def test_what_trl_cannot_run_as_grpo_on_a_vlm_is_refused_with_its_reason(family: str, kw: dict,
                                                                           fragment: str) -> None:
    spec, base = _spec(family)
    with pytest.raises(SetupError, match=fragment):
        TrainingSetup(method="lora", **{**base, **GRPO, **kw}).validate(spec)


# ---- a traced vision-language family: the same step on its class ---------------------------------------------------
TRACED = dict(method="lora", vision_tuning="frozen", images=1, image_width=100, image_height=80, seq_len=24,
              lora_rank=4, **{**GRPO, "completion_len": 4})


def test_grpo_runs_on_a_traced_vlms_class_with_its_processors_images() -> None:
    """A traced family (Qwen2-VL: its processor's placeholders and ``mm_token_type_ids``, extended over the
    completion, and the grid that its M-RoPE positions read) runs TRL's GRPO step on its class: the pixel inputs
    in the generation, the tower in the loss's forward."""
    from tests.test_vlm_traced import _spec as traced_spec
    from vramlab.core.simulation.simulate import simulate

    spec, _ = traced_spec("qwen2_vl")
    setup = TrainingSetup(**TRACED)
    phases = {p.key: p for p in simulate(spec, setup, steps=1).phases}
    text = {p.key: p for p in simulate(spec, setup.replace(images=0), steps=1).phases}
    assert phases["forward@1"].components.get(Kind.VISION_ACTIVATIONS, 0) > 0
    # the processor's pixel inputs in the generation (the prefill's, then the scoring's and each micro-batch's copy)
    inputs = [p["generate@1"].components.get(Kind.INPUTS, 0) for p in (text, phases)]
    assert 0 < inputs[0] < inputs[1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm", "internvl", "llava_next"])
def test_traced_vlm_grpo_estimate_is_its_class_simulated(family: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The traced estimate (fitted in sequence and rank at the batch asked: 40-55 s each on two cores) equals
    ``simulate --hf`` of the class running the step, every phase."""
    from tests.test_vlm_traced import _spec as traced_spec
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    spec, _ = traced_spec(family)
    setup = TrainingSetup(**TRACED)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert [(p.key, p.bytes) for p in est.phases] == [(q.key, q.bytes) for q in sim.phases]


def test_the_grpo_note_counts_the_prompts_image_tokens_in_the_cache() -> None:
    """The note's KV cache at the last token is over the prompt's text and image tokens (Qwen2.5-VL-7B, one 448 x 448
    image: 256 tokens beside 768 of text and 256 of completion)."""
    import re

    from vramlab.core.catalog import find_model
    from vramlab.core.estimate import objective_notes

    spec = find_model("qwen2.5-vl-7b")
    setup = TrainingSetup(method="lora", objective="grpo", micro_batch=4, num_generations=4, seq_len=1024,
                          completion_len=256, images=1, image_width=448, image_height=448)
    notes = objective_notes(spec, setup)
    gib = float(re.search(r"KV cache reaches ([\d.]+) GiB", " ".join(notes)).group(1))
    tokens = 768 + 256 + 256 - 1  # the prompt's text and image tokens, the completion but its last
    per_token = 2 * spec.num_layers * 4 * spec.num_kv_heads * spec.head_dim * 2  # 4 rows, bf16 keys and values
    assert gib == round(tokens * per_token / 2**30, 2)
    assert any("images run through the tower in the generation's prefill" in n for n in notes)
