"""Objectives with sharding (issue 28): the preference and RL steps under ZeRO-1 / 2, and under ZeRO-3 / FSDP,
instead of "modelled on one GPU without sharding".

TRL 1.16.0's ``prepare_deepspeed`` runs a reference copy at stage 0 below ZeRO-3 (whole on each GPU), so under
ZeRO-1 / 2 the step is the one-GPU step with the optimizer state (and gradients) partitioned; under ZeRO-3 / FSDP
it shards the reference too (``prepare_deepspeed`` at stage 3, ``prepare_fsdp``: the whole copy one unit), and
GRPO gathers every parameter for generation under ZeRO-3 (``ds3_gather_for_generation``). The estimate is
held to the objective step's simulation (core/objectives/*/reference.py, TRL's step on the built-in builder, with
the sharder of core/simulation/shard.py): peak, phases and components equal; and the sharding is seen to act (the
states partitioned).
"""

from __future__ import annotations

import dataclasses

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
    # a reference copy sharded as TRL prepares it (refused before: "TRL shards the reference model too")
    "dpo-full-zero3-reference-copy": dict(objective="dpo", method="full", sharding="zero3"),
    "dpo-full-fsdp-reference-copy": dict(objective="dpo", method="full", sharding="fsdp"),
    "kto-full-zero3-offload-params": dict(objective="kto", method="full", sharding="zero3", offload="params"),
    "dpo-lora-fsdp-reference-copy": dict(objective="dpo", sharding="fsdp", reference="copy", **LORA),
    # GRPO's generation with every parameter gathered (ZeRO-3) or unit by unit (FSDP): refused before
    "grpo-full-zero3": dict(objective="grpo", method="full", sharding="zero3", num_generations=2),
    "grpo-lora-fsdp": dict(objective="grpo", sharding="fsdp", num_generations=2, **LORA),
    "grpo-full-zero3-reference-copy": dict(objective="grpo", method="full", sharding="zero3", num_generations=2,
                                           beta=0.04),
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
    # DeepSpeed's ZeRO optimizer keeps fp32 masters of the 16-bit weights: one GPU with the same masters
    one = estimate(spec, setup.replace(gpus=1, sharding="none", master_weights=True), match_simulation=True)
    four = estimate(spec, setup, match_simulation=True)

    def states(r) -> int:  # noqa: ANN001
        return max(p.components.get(Kind.OPTIMIZER_STATES, 0) for p in r.phases)

    assert 0 < states(four) < states(one) // 3  # a quarter each, with the partitions' padding
    assert four.peak_allocated_bytes < one.peak_allocated_bytes


def test_a_reference_copy_is_sharded_as_trl_prepares_it() -> None:
    """TRL 1.16.0's ``prepare_fsdp`` calls ``fully_shard`` on the whole reference model: under FSDP it is one
    unit, every weight gathered for the reference forward and freed after it; ``prepare_deepspeed`` makes it a
    stage-3 engine, whose modules are gathered one by one (the policy's units). Between reference forwards only the
    shards stay."""
    spec = dataclasses.replace(FAMILIES["llama"], num_layers=12, vocab_size=256)  # layers outweigh the root
    whole = spec.param_count * 2  # the reference's bf16 weights

    def reference_bytes(sharding: str) -> dict[str, int]:
        r = estimate(spec, _setup(dict(objective="dpo", method="full", sharding=sharding)), match_simulation=True)
        return {p.key: p.components.get(Kind.REFERENCE, 0) for p in r.phases}

    fsdp, zero3 = reference_bytes("fsdp"), reference_bytes("zero3")
    shards = fsdp["backward@1"]
    assert shards == zero3["backward@1"] < whole / 2  # a quarter each, resharded after the forward
    assert fsdp["reference@1"] - shards >= whole  # the whole model gathered at once
    assert zero3["reference@1"] - shards < whole / 2  # the root and one layer


def test_grpo_generates_with_every_parameter_gathered_under_zero3() -> None:
    """TRL 1.16.0's ``unwrap_model_for_generation`` wraps ``generate`` in DeepSpeed's
    ``GatheredParameters(model.parameters())`` under ZeRO-3 (``ds3_gather_for_generation``, on by default): the
    whole policy is on each GPU while it generates. FSDP generates through its units, one layer gathered at a time."""
    spec = dataclasses.replace(FAMILIES["llama"], num_layers=12, vocab_size=256)  # layers outweigh the root
    whole = spec.param_count * 2

    def generate_weights(sharding: str) -> int:
        kw = dict(objective="grpo", method="full", sharding=sharding, num_generations=2)
        r = estimate(spec, _setup(kw), match_simulation=True)
        return next(p.components.get(Kind.WEIGHTS, 0) for p in r.phases if p.key == "generate@1")

    zero3, fsdp = generate_weights("zero3"), generate_weights("fsdp")
    assert zero3 >= whole > fsdp  # the whole policy (and its shards) against one layer and the root


@pytest.mark.parametrize(("kw", "needle"), [
    (dict(objective="grpo", sharding="zero2", num_generations=2, generation_backend="vllm-colocate", **LORA),
     "vLLM generation"),
])
def test_what_trl_does_that_is_not_modelled_is_refused_with_what_it_does(kw: dict, needle: str) -> None:
    with pytest.raises(SetupError, match=needle):
        _setup(kw).validate(FAMILIES["llama"])
