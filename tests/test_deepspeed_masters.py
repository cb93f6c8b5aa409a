"""DeepSpeed's fp32 masters under ZeRO are not Megatron's (issue 29).

DeepSpeed 0.19.8 keeps a rank's gradient partitions in the 16-bit dtype (stage 1 / 2 ``averaged_gradients``, stage 3
``grad_partitions_flat_buffer``) and makes the fp32 gradient of its master partition only at the step
(``single_grad_partition = flatten(...).to(fp32)``; stage 3 ``_prepare_fp32_grad_for_sub_group``), freeing it after
the group's step; stage 1 / 2 free the 16-bit gradients once it is made (``free_grad_in_param_list``). Megatron's
``--master-weights`` keeps persistent fp32 gradients beside the masters. A model with a tied embedding holds the
estimate to the simulation (the weight's two gradients summed before its one AccumulateGrad)."""

from __future__ import annotations

import pytest

from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

TIED = ModelSpec(id="tiny-tied-ds", name="TinyTiedDS", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=512, tie_embeddings=True)
FULL = dict(method="full", weights="bf16", seq_len=64, gpus=2)


def _between_steps(r, kind: Kind) -> int:  # noqa: ANN001
    """Bytes of ``kind`` at the peak of the second forward: what the first step left held."""
    return next(p for p in r.phases if p.key == "forward@2").components.get(kind, 0)


def _same(est, sim) -> None:  # noqa: ANN001
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in sim.phases}
    assert dict(est.components) == dict(sim.components)


@pytest.mark.parametrize("sharding", ["zero3", pytest.param("zero2", marks=pytest.mark.slow),
                                      pytest.param("zero1", marks=pytest.mark.slow)])
def test_zero_holds_no_fp32_gradient_between_steps(sharding: str) -> None:
    setup = TrainingSetup(**FULL, sharding=sharding)
    assert setup.has_master_copy
    sim = simulate(TIED, setup)
    _same(estimate(TIED, setup, match_simulation=True), sim)
    masters = _between_steps(sim, Kind.MASTER_WEIGHTS)
    assert masters > 0
    # the fp32 gradient (as large as the masters) is the step's only: what stays between steps is 16-bit
    assert _between_steps(sim, Kind.GRADIENTS) < masters
    # while the step runs, the fp32 gradient of the partition exists beside the masters
    step = next(p for p in sim.phases if p.key == "optimizer@2").components
    assert step.get(Kind.GRADIENTS, 0) >= masters


def test_zero2_frees_its_16bit_partitions_before_the_inner_step() -> None:
    """Stage 2 frees the 16-bit gradient partitions once the fp32 copy is made: when the first step makes the
    optimizer states (its peak), the fp32 gradient is the only gradient held."""
    setup = TrainingSetup(**FULL, sharding="zero2")
    sim = simulate(TIED, setup)
    _same(estimate(TIED, setup, match_simulation=True), sim)
    first = next(p for p in sim.phases if p.key == "optimizer@1").components
    assert first[Kind.OPTIMIZER_STATES] > 0
    assert 0 < first[Kind.GRADIENTS] <= first[Kind.MASTER_WEIGHTS]


def test_master_weights_without_sharding_keep_persistent_fp32_gradients() -> None:
    setup = TrainingSetup(**{**FULL, "gpus": 1}, master_weights=True)
    sim = simulate(TIED, setup)
    _same(estimate(TIED, setup, match_simulation=True), sim)
    assert _between_steps(sim, Kind.GRADIENTS) == _between_steps(sim, Kind.MASTER_WEIGHTS) > 0


def test_zero3_steps_its_partition_in_sub_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 makes the fp32 gradient one sub-group at a time (``sub_group_size`` partition elements, 1e9 by
    default; a tenth of this model's partition here): the step holds a part of it, and the estimate, which replays
    every layer where sub-groups split, still equals the simulation."""
    from vramlab.core.spec import sharded_precision

    deep = ModelSpec(id="tiny-tied-ds-subgroups", name="TinyTiedDSSub", num_layers=6, hidden_size=128, num_heads=4,
                     num_kv_heads=2, intermediate_size=256, vocab_size=512, tie_embeddings=True)
    setup = TrainingSetup(**FULL, sharding="zero3")
    monkeypatch.setattr(sharded_precision, "SUB_GROUP_SIZE", deep.param_count // setup.gpus // 10)
    sim = simulate(deep, setup)
    _same(estimate(deep, setup, match_simulation=True), sim)
    step = next(p for p in sim.phases if p.key == "optimizer@2").components
    assert 0 < step[Kind.GRADIENTS] < step[Kind.MASTER_WEIGHTS]


def test_zero3_keeps_its_16bit_gradient_partition_buffer_from_the_start() -> None:
    """Stage 3 makes one flat buffer of the rank's 16-bit gradient partitions with the optimizer and keeps it (each
    unit's reduce-scatter lands in it); FSDP2 allocates gradient shards at each reduce-scatter and frees them with
    zero_grad."""
    zero3 = simulate(TIED, TrainingSetup(**FULL, sharding="zero3"))
    _same(estimate(TIED, TrainingSetup(**FULL, sharding="zero3"), match_simulation=True), zero3)

    def grads(r, key: str) -> int:  # noqa: ANN001
        return next(p for p in r.phases if p.key == key).components.get(Kind.GRADIENTS, 0)

    masters = _between_steps(zero3, Kind.MASTER_WEIGHTS)
    held = grads(zero3, "forward@1")
    assert masters // 3 < held < masters  # 16-bit partitions: half the fp32 masters' bytes
    assert grads(zero3, "forward@2") == held
    fsdp = simulate(TIED, TrainingSetup(**{**FULL, "weights": "fp32"}, compute="bf16", sharding="fsdp"))
    assert grads(fsdp, "forward@1") == 0
