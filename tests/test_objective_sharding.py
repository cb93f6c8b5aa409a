"""Objectives with sharding (issue 28): the preference and RL steps under ZeRO-1 / 2, and under ZeRO-3 / FSDP
where the policy is the only model, instead of "modelled on one GPU without sharding".

TRL 1.16.0's ``prepare_deepspeed`` runs a reference copy at stage 0 below ZeRO-3 (whole on each GPU), so under
ZeRO-1 / 2 the step is the one-GPU step with the optimizer state (and gradients) partitioned; under ZeRO-3 / FSDP
it shards the reference with the policy and GRPO gathers every parameter for generation
(``ds3_gather_for_generation``), which stay refused. The estimate is held to the objective step's simulation
(core/objectives/*/reference.py, TRL's step on the built-in builder, with the sharder of core/simulation/shard.py):
peak, phases and components equal; and the sharding is seen to act (the states partitioned).
"""

from __future__ import annotations

import pytest

from tests.test_objectives import FAMILIES
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.training import TrainingSetup

LORA = {"method": "lora", "lora_targets": ("q_proj", "v_proj", "up_proj")}
CASES = {
    "dpo-full-zero2": dict(objective="dpo", method="full", sharding="zero2"),
    "dpo-lora-zero3": dict(objective="dpo", sharding="zero3", **LORA),
    "dpo-qlora-fsdp": dict(objective="dpo", method="qlora", sharding="fsdp"),
    "ipo-full-zero1-precomputed": dict(objective="ipo", method="full", sharding="zero1", reference="precomputed"),
    "orpo-full-fsdp": dict(objective="orpo", method="full", sharding="fsdp"),
    "kto-lora-zero2-offload": dict(objective="kto", sharding="zero2", offload="optimizer", **LORA),
    "grpo-full-zero2": dict(objective="grpo", method="full", sharding="zero2", num_generations=2),
    "grpo-lora-zero1-beta": dict(objective="grpo", sharding="zero1", num_generations=2, beta=0.04, **LORA),
}


def _setup(kw: dict) -> TrainingSetup:
    base = dict(seq_len=96, completion_len=32, micro_batch=2, gpus=4)
    if kw.get("method") != "qlora":
        base["weights"] = "bf16"
    return TrainingSetup(**{**base, **kw})


@pytest.mark.parametrize("name", list(CASES))
def test_an_objective_under_sharding_estimates_its_simulation(name: str) -> None:
    spec = FAMILIES["llama"]
    setup = _setup(CASES[name])
    setup.validate(spec)  # refused before: "modelled on one GPU without sharding"
    sim = simulate(spec, setup)
    est = estimate(spec, setup, match_simulation=True)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in sim.phases}
    assert dict(est.components) == dict(sim.components)


@pytest.mark.parametrize("name", ["dpo-full-zero2", "grpo-full-zero2"])
def test_zero2_partitions_the_objectives_optimizer_state(name: str) -> None:
    spec = FAMILIES["llama"]
    setup = _setup(CASES[name])
    one = estimate(spec, setup.replace(gpus=1, sharding="none"), match_simulation=True)
    four = estimate(spec, setup, match_simulation=True)

    def states(r) -> int:  # noqa: ANN001
        return max(p.components.get(Kind.OPTIMIZER_STATES, 0) for p in r.phases)

    assert 0 < states(four) < states(one) // 3  # a quarter each, with the partitions' padding
    assert four.peak_allocated_bytes < one.peak_allocated_bytes


@pytest.mark.parametrize(("kw", "needle"), [
    (dict(objective="grpo", method="full", sharding="zero3", num_generations=2), "ds3_gather_for_generation"),
    (dict(objective="grpo", sharding="fsdp", num_generations=2, **LORA), "ds3_gather_for_generation"),
    (dict(objective="dpo", method="full", sharding="zero3"), "prepare_deepspeed at stage 3"),
    (dict(objective="grpo", sharding="zero2", num_generations=2, generation_backend="vllm-colocate", **LORA),
     "vLLM generation"),
])
def test_what_trl_does_that_is_not_modelled_is_refused_with_what_it_does(kw: dict, needle: str) -> None:
    with pytest.raises(SetupError, match=needle):
        _setup(kw).validate(FAMILIES["llama"])
