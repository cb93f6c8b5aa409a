"""``--method freeze`` on a vision-language model (issue 28; refused before: "modelled for full, LoRA or QLoRA SFT"):
LLaMA-Factory 0.9.5's ``_setup_freeze_tuning`` on a composite model trains the language model's last
``freeze_trainable_layers`` layers (its ``text_config`` counts them) and the ``freeze_extra_modules``; the tower and
the projector stay frozen unless ``freeze_vision_tower`` / ``freeze_multi_modal_projector`` say otherwise, which
VRAM Lab's ``--vision-tuning`` says. Every hand-written family's estimate and the trace of transformers' own class
(its trained last layers at their full count, the frozen ones repeated) are held to transformers' classes under
fake tensors with that freeze applied (the reference): the peak, every phase's peak, the parameters.

Skipped without transformers and peft."""

from __future__ import annotations

import pytest

from tests.test_vlm import LLAVA, QWEN25_VL
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.spec.training import TrainingSetup

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _spec(family: str):  # noqa: ANN202
    if family == "llava":
        return LLAVA, dict(images=1, image_width=224, image_height=168, seq_len=64)
    if family == "qwen2_5_vl":
        return QWEN25_VL, dict(images=1, image_width=224, image_height=168, seq_len=64)
    if family == "gemma3":
        from tests.test_vlm_gemma3 import GEMMA3

        return GEMMA3, dict(images=1, image_width=300, image_height=100, seq_len=32)
    if family == "paligemma":
        from tests.test_vlm_paligemma import _spec as paligemma

        return paligemma(112), dict(images=1, seq_len=32)
    from tests.test_vlm_mllama import TINY

    return TINY, dict(images=1, image_width=56, image_height=56, seq_len=64)


# (family, trained last layers, freeze extras, vision tuning, checkpointing): the tower frozen, the projector
# trained, the whole tower trained, with and without the embedding / final norm / head
CASES = [
    ("llava", 1, (), "frozen", False),
    ("llava", 1, ("norm",), "projector", False),
    ("qwen2_5_vl", 1, ("embed_tokens", "lm_head"), "full", False),
    ("gemma3", 2, ("embed_tokens", "norm", "lm_head"), "full", True),  # a tied head trains with the table
    ("paligemma", 2, (), "frozen", False),
    ("mllama", 2, (), "frozen", False),  # its last two layers: a cross-attention layer and a self-attention one
    ("mllama", 2, ("embed_tokens", "norm", "lm_head"), "full", False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-last{c[1]}-{'+'.join(c[2]) or 'layers'}-{c[3]}"
                         + ("-ckpt" if c[4] else ""))
def test_freeze_on_a_handwritten_vlm_is_transformers_vlm_simulated(case: tuple) -> None:
    from vramlab.core.simulation.simulate import simulate

    family, n, extra, tune, ckpt = case
    spec, kw = _spec(family)
    setup = TrainingSetup(method="freeze", trainable_layers=n, freeze_extra=extra, vision_tuning=tune,
                          micro_batch=2, grad_ckpt=ckpt, **kw)
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.peak_phase == sim.peak_phase
    for p, q in zip(est.phases, sim.phases, strict=True):
        # the load phase is 1 KiB apart as for every other method of these families (tests/test_vlm.py)
        assert p.key == q.key and abs(p.bytes - q.bytes) <= 1024, (p.key, p.bytes, q.bytes)
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    # the tower and the projector train as --vision-tuning says, whatever the language model does
    assert bool(sim.components.get(Kind.VISION_TRAINING)) == (tune != "frozen")
    # the frozen layers hold no gradients or states: less than training every layer
    full = TrainingSetup(method="full", vision_tuning=tune, micro_batch=2, grad_ckpt=ckpt, **kw)
    assert sim.trainable_params < estimate(spec, full, match_simulation=True).trainable_params


def test_freeze_trains_the_language_models_last_layers_not_the_towers() -> None:
    """The trained layers are the language model's last ones (LLaMA-Factory counts ``text_config``'s layers):
    one more trained layer adds one language-model layer's parameters, and none of the tower's."""
    from vramlab.core.simulation.simulate import simulate

    spec, kw = _spec("llava")
    one, two = (simulate(spec, TrainingSetup(method="freeze", trainable_layers=n, micro_batch=1, **kw), steps=1)
                for n in (1, 2))
    assert two.trainable_params - one.trainable_params == spec.layer_params()
    assert not any(p.components.get(Kind.VISION_TRAINING) for p in two.phases)


def test_freeze_on_a_vlm_refuses_only_what_it_cannot_run() -> None:
    spec, kw = _spec("llava")
    with pytest.raises(SetupError, match="use --method lora"):  # a LoRA tower needs peft's LoRA
        TrainingSetup(method="freeze", trainable_layers=1, vision_tuning="lora", **kw).validate(spec)
    with pytest.raises(SetupError, match="choose 1-2"):
        TrainingSetup(method="freeze", trainable_layers=3, **kw).validate(spec)


@pytest.mark.slow
@pytest.mark.parametrize("family,tower,n,extra,tune", [
    ("smolvlm", 0, 1, (), "frozen"),  # the tower traced whole (three blocks)
    ("internvl", 0, 2, ("embed_tokens",), "projector"),
    ("smolvlm", 6, 1, ("norm", "lm_head"), "full"),  # the tower cut and its blocks repeated too
])
def test_freeze_on_a_traced_vlm_is_simulate_hf(family, tower, n, extra, tune, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The trace of transformers' own class with the freeze applied (refused before: "traced for full, LoRA or
    QLoRA fine-tuning"): fitted with the trained last layers at their full count in every run, equal to
    ``simulate --hf`` of the whole model at a point not fitted."""
    from tests.support.traced_vlm import tiny_configs
    from vramlab.core import traced
    from vramlab.core.estimator.stored import TraceStore
    from vramlab.core.simulation.simulate import simulate
    from vramlab.core.sources.hf_config import hf_config_to_spec

    monkeypatch.setattr(traced, "STORE", TraceStore(tmp_path))
    cfg = tiny_configs()[family]
    if tower:
        cfg["vision_config"]["num_hidden_layers"] = tower
    spec, _ = hf_config_to_spec(cfg, id=family, name=family)
    setup = TrainingSetup(method="freeze", trainable_layers=n, freeze_extra=extra, vision_tuning=tune, images=1,
                          image_width=300, image_height=200, micro_batch=3, seq_len=100)
    est = estimate(spec, setup, match_simulation=True)
    assert f"last {n} trained" in est.notes[0]
    sim = simulate(spec, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert est.peak_phase == sim.peak_phase
    for p, q in zip(est.phases, sim.phases, strict=True):
        assert p.key == q.key and p.bytes == q.bytes, (p.key, p.bytes, q.bytes)
    assert (est.total_params, est.trainable_params) == (sim.total_params, sim.trainable_params)
    assert est.trainable_params < est.total_params
