"""DPO, IPO and KTO on a vision-language model (issue 28; refused before: "without ... a preference / RL
objective"), as TRL 1.16.0's DPOTrainer and KTOTrainer run one: ``DataCollatorForVisionPreference`` repeats every
prompt's images for its rejected row (2 x micro-batch rows of ids with the image placeholders, the pixel inputs of
as many samples; KTO's KL rows share their prompts' images), the policy's forward is the class's own backbone
(tower, projector, language model) and ``add_fused_lm_head``'s scoring, and the reference is the policy with its
adapters disabled (the tower's too), a second copy (tower and all) or precomputed. Each hand-written family's
estimate is held to transformers' own class under fake tensors running that step (core/objectives/<objective>/
reference.py over core/families/<family>/reference.py): the peak, every phase's peak, the parameters. What TRL
cannot run on a VLM stays refused with its reason.

Skipped without transformers and peft."""

from __future__ import annotations

import pytest

from tests.test_vlm_freeze import _spec  # the tiny configs of every hand-written family
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind, Phase
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _slow(*case: object) -> object:
    return pytest.param(case, marks=pytest.mark.slow)


# (family, method, vision tuning, more; _slow: marked slow): the reference as the policy without its adapters
# (LoRA), as a copy (full, freeze), precomputed; IPO; a LoRA tower (its adapters disabled with the language
# model's); checkpointing (TRL turns it off for the reference forward); CUDA autocast (one region over the forward
# and the fused head)
CASES = [
    ("llava", "lora", "frozen", {}),
    ("llava", "full", "full", {}),
    _slow("llava", "lora", "lora", {"micro_batch": 2}),
    _slow("llava", "freeze", "projector", {"trainable_layers": 1}),
    _slow("llava", "lora", "frozen", {"objective": "ipo"}),
    ("llava", "lora", "frozen", {"reference": "precomputed"}),
    _slow("llava", "lora", "frozen", {"grad_ckpt": True}),
    _slow("llava", "lora", "frozen", {"weights": "fp32", "compute": "bf16"}),
    ("qwen2_5_vl", "lora", "lora", {}),
    _slow("qwen2_5_vl", "full", "full", {"micro_batch": 2, "amp": True}),
    _slow("gemma3", "lora", "lora", {"grad_ckpt": True}),
    ("paligemma", "full", "full", {"grad_ckpt": True, "ckpt_reentrant": True}),
    ("llava", "full", "full", {"sharding": "zero2", "gpus": 4}),  # ZeRO-2's sharder, as on every step
    # ZeRO-3 / FSDP: the policy's units, and a reference copy sharded as TRL prepares it (FSDP: one unit, the
    # tower's blocks merged into it)
    _slow("qwen2_5_vl", "full", "full", {"sharding": "fsdp", "gpus": 4}),
    ("llava", "lora", "frozen", {"sharding": "zero3", "gpus": 4}),
    # KTO: unpaired rows and their mismatched KL rows, which share their prompts' images (Gemma's KL rows with
    # token_type_ids of their own)
    ("llava", "lora", "lora", {"objective": "kto", "micro_batch": 2, "grad_ckpt": True}),
    _slow("llava", "full", "full", {"objective": "kto", "micro_batch": 2}),
    _slow("qwen2_5_vl", "lora", "frozen", {"objective": "kto", "micro_batch": 2, "amp": True}),
    _slow("gemma3", "full", "projector", {"objective": "kto", "micro_batch": 2}),
    _slow("paligemma", "lora", "frozen", {"objective": "kto", "micro_batch": 2, "reference": "precomputed"}),
]


def _case_id(c: tuple) -> str:
    return "-".join((c[0], c[1], c[2], *(f"{k}={v}" for k, v in c[3].items())))


def estimated_and_simulated(case: tuple, objective: dict) -> tuple:
    """The estimate and transformers' class simulated for ``case`` under ``objective``'s settings, held equal: the
    peak, every phase's peak (1 KiB: the first class built in a process holds a 1 KiB buffer more;
    tests/test_vlm.py holds phases alike), the parameters. Returns (setup, estimate, simulation)."""
    from vramlab.core.simulation.simulate import simulate

    family, method, tune, more = case
    spec, kw = _spec(family)
    setup = TrainingSetup(method=method, vision_tuning=tune, **{**objective, **kw, **more})
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= 1024, (est.peak_allocated_bytes,
                                                                               sim.peak_allocated_bytes)
    assert est.peak_phase == sim.peak_phase
    for p, q in zip(est.phases, sim.phases, strict=True):
        assert p.key == q.key and abs(p.bytes - q.bytes) <= 1024, (p.key, p.bytes, q.bytes)
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    return setup, est, sim


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dpo_on_a_vlm_is_trls_step_on_transformers_vlm_simulated(case: tuple) -> None:
    setup, est, sim = estimated_and_simulated(case, {"objective": "dpo"})
    # the images run through the tower in the policy's forward (and the reference's, unless precomputed)
    forward = next(p for p in sim.phases if p.key == "forward@1")
    assert forward.components.get(Kind.VISION_ACTIVATIONS, 0) > 0
    assert any(p.phase is Phase.REFERENCE for p in est.phases)
    if setup.reference_mode.value == "copy":
        assert est.components.get(Kind.REFERENCE, 0) > 0


@pytest.mark.parametrize(("family", "kw", "fragment"), [
    ("llava", {"objective": "orpo"}, "the images never reach"),
    ("llava", {"objective": "simpo"}, "CPOTrainer passes the model token ids only"),
    ("mllama", {"objective": "dpo"}, "cross_attention_mask as long as the prompt"),
    ("qwen2_5_vl", {"objective": "dpo", "frames": 4}, "collates images, not video"),
    ("llava", {"objective": "dpo", "grad_ckpt": True, "vision_ckpt": False}, "drop --no-vision-ckpt"),
])
def test_what_trl_cannot_run_on_a_vlm_is_refused_with_its_reason(family: str, kw: dict, fragment: str) -> None:
    spec, base = _spec(family)
    with pytest.raises(SetupError, match=fragment):
        TrainingSetup(method="lora", **{**base, **kw}).validate(spec)
