"""GRPO regenerating inside one optimizer step (issue 29): TRL 1.16.0's ``GRPOTrainer._prepare_inputs`` generates
when its micro-step counter is a multiple of ``steps_per_generation x num_iterations``; where that period is not a
multiple of the accumulation (``steps_per_generation x num_iterations < gradient_accumulation_steps``, or
misaligned), a generation runs after an optimizer step's first micro-batch, with its gradients alive. The step's
micro-batch 1 stands for every later one (``core/objectives/shared/trl.py`` ``generates_before``)."""

from __future__ import annotations

import types

import pytest

from tests.test_objectives import FAMILIES
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.objectives.shared.trl import generates_before
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.training import TrainingSetup

BASE = {"method": "full", "objective": "grpo", "micro_batch": 2, "num_generations": 2, "seq_len": 16,
        "completion_len": 4, "steps_per_generation": 1}


def _generate_phase(setup: TrainingSetup) -> tuple[int, int]:
    spec = FAMILIES["qwen2"]
    sim = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True)
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in sim.phases}
    return {p.key: p.bytes for p in sim.phases}["generate@2"], sim.components.get(Kind.GRADIENTS, 0)


def test_a_generation_inside_the_step_has_the_gradients_alive() -> None:
    once, _ = _generate_phase(TrainingSetup(**BASE))  # one micro-batch a step: generation before it
    twice, _ = _generate_phase(TrainingSetup(**BASE, grad_accum=2))  # again before the second micro-batch
    # the first micro-batch's gradients (bf16, every parameter trained) are alive through the second generation
    grads = FAMILIES["qwen2"].param_count * 2
    assert twice - once >= grads


def test_the_schedule_is_trls() -> None:
    """``generates_before`` against TRL 1.16.0's own ``_prepare_inputs``, stepped as Trainer steps it."""
    torch = pytest.importorskip("torch")
    trl = pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert trl.__version__ == "1.16.0"
    prepare = GRPOTrainer._prepare_inputs.__wrapped__  # past its profiling decorator
    for accum, spg, iterations in [(2, 1, 1), (4, 2, 1), (4, 1, 2), (4, 2, 2), (3, 2, 1), (2, 4, 1), (2, 2, 3)]:
        trainer = types.SimpleNamespace(
            model=types.SimpleNamespace(training=True), args=types.SimpleNamespace(steps_per_generation=spg),
            num_iterations=iterations, _step=0, _buffered_inputs=None)
        at: list[int] = []
        trainer._generate_and_score_completions = lambda batch, t=trainer, at=at: at.append(t._step) or batch
        for _ in range(accum * spg * iterations * 4):  # Trainer: training_step, then GRPOTrainer's _step += 1
            prepare(trainer, {"completion_ids": torch.zeros(spg, 1)})
            trainer._step += 1
        later = any(m % accum for m in at)  # a generation after some optimizer step's first micro-batch
        setup = TrainingSetup(**{**BASE, "steps_per_generation": spg}, grad_accum=accum, num_iterations=iterations)
        assert generates_before(setup, 1) == later, (accum, spg, iterations, at)
        assert any(m % accum == 0 for m in at)  # and at some step's first


def test_a_traced_tape_is_kept_apart_by_the_schedule() -> None:
    """A traced tape's key held the accumulation as at most two micro-batches: GRPO with 4 micro-batches a step and
    a generation every 2 (which regenerates inside the step and scores the old policy) took the tape of 2 and 2."""
    from vramlab.core import traced

    spec = FAMILIES["qwen2"]
    four, two = (TrainingSetup(**{**BASE, "steps_per_generation": 2}, grad_accum=a) for a in (4, 2))
    assert generates_before(four, 1) and not generates_before(two, 1)
    assert traced.tape_key(spec, four, {}, False) != traced.tape_key(spec, two, {}, False)
    assert traced.recipe_key(four) != traced.recipe_key(two)
    sft = [TrainingSetup(grad_accum=a) for a in (4, 2)]  # HF Trainer holds all four of a step (test_held_batches)
    assert traced.tape_key(spec, sft[0], {}, False) != traced.tape_key(spec, sft[1], {}, False)
