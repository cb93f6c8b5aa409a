"""What the sharding frameworks do to precision (issue 29: the user's real run, not our reading of it).

DeepSpeed 0.19's ZeRO optimizers keep fp32 master partitions of 16-bit trainable weights whatever the config says
(stage 1 / 2: ``single_partition_of_fp32_groups``; stage 3: ``fp32_partitioned_groups_flat``), and accelerate 1.16
upcasts the trainable parameters to fp32 under FSDP with mixed precision (``Accelerator.prepare_model`` for FSDP1,
``fsdp2_prepare_model`` for FSDP2), gathering them in bf16."""

from __future__ import annotations

import pytest

from vramlab.core.catalog import resolve_model
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.spec.training import TrainingSetup

SPEC = resolve_model("qwen2.5-0.5b").spec
FULL = dict(method="full", weights="bf16", gpus=4, seq_len=256, micro_batch=1)


@pytest.mark.parametrize("sharding", ["zero1", "zero2", "zero3"])
def test_deepspeed_keeps_fp32_masters_of_16bit_weights(sharding: str) -> None:
    setup = TrainingSetup(**FULL, sharding=sharding)
    got = estimate(SPEC, setup)
    assert got.peak_allocated_bytes == estimate(SPEC, setup.replace(master_weights=True)).peak_allocated_bytes
    assert "fp32 master" in setup.precision_label()
    # LoRA's adapters are fp32 already: no masters
    lora = TrainingSetup(**{**FULL, "method": "lora"}, sharding=sharding)
    assert not lora.has_master_copy


def test_a_deepspeed_config_with_bf16_trains_fp32_masters(tmp_path) -> None:  # noqa: ANN001
    from vramlab.core.sources.training import read_training_configs

    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}')
    (tmp_path / "sft.json").write_text('{"bf16": true, "deepspeed": "ds.json", "max_length": 256}')
    setup = TrainingSetup().replace(**read_training_configs([tmp_path / "sft.json"]).changes)
    assert setup.sharding.value == "zero3" and setup.has_master_copy


def test_fsdp_with_mixed_precision_trains_fp32_shards() -> None:
    amp = TrainingSetup(**FULL, sharding="fsdp", amp=True)
    fp32 = TrainingSetup(**{**FULL, "weights": "fp32"}, sharding="fsdp")
    assert amp.weight_dtype.value == "fp32" and amp.sharded_mixed_precision
    assert estimate(SPEC, amp).peak_allocated_bytes == estimate(SPEC, fp32).peak_allocated_bytes
    # without mixed precision (bf16 = False) accelerate leaves the bf16 parameters as they are
    pure = TrainingSetup(**FULL, sharding="fsdp")
    assert estimate(SPEC, pure).peak_allocated_bytes < estimate(SPEC, amp).peak_allocated_bytes


def test_fsdp_upcasts_only_the_trainable_parameters() -> None:
    """Freeze and LoRA: the trained layers' (or the adapters') shards fp32, the frozen ones bf16 as loaded."""
    freeze = TrainingSetup(**{**FULL, "method": "freeze", "trainable_layers": 2}, sharding="fsdp", amp=True)
    assert freeze.trainable_dtype.value == "fp32" and freeze.weight_dtype.value == "bf16"
    assert freeze.sharded_mixed_precision
    lora = TrainingSetup(**{**FULL, "method": "lora", "adapter_dtype": "bf16"}, sharding="fsdp", amp=True)
    # 16-bit adapters are upcast too: the run is the fp32 adapters' run
    assert estimate(SPEC, lora).peak_allocated_bytes == estimate(SPEC, lora.replace(
        adapter_dtype="fp32")).peak_allocated_bytes


def test_a_vlm_with_trained_parts_under_the_fsdp_upcast_is_said() -> None:
    vlm = resolve_model("qwen2.5-vl-3b").spec
    with pytest.raises(SetupError, match="upcasts the trained parameters"):
        TrainingSetup(**{**FULL, "method": "freeze", "trainable_layers": 2}, sharding="fsdp", amp=True).validate(vlm)


def test_deepspeed_stage0_with_bf16_keeps_fp32_masters(tmp_path) -> None:  # noqa: ANN001
    """Stage 0: DeepSpeed's BF16_Optimizer keeps the masters (ZeRO's come with the sharding)."""
    from vramlab.core.sources.training import read_training_configs

    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 0}, "bf16": {"enabled": "auto"}}')
    (tmp_path / "sft.json").write_text('{"bf16": true, "deepspeed": "ds.json", "max_length": 256}')
    read = read_training_configs([tmp_path / "sft.json"])
    setup = TrainingSetup().replace(**read.changes)
    assert setup.sharding.value == "none" and setup.has_master_copy
    assert not any(r.status == "not modelled" and r.key == "bf16.enabled" for r in read.rows)


@pytest.mark.parametrize("extra", [dict(), dict(offload="params", grad_accum=2)], ids=["fsdp", "fsdp-offload-accum"])
def test_fsdp_reduces_in_accelerates_dtype_and_casts_to_the_fp32_shards(extra: dict) -> None:
    """accelerate's MixedPrecision policy reduces in bf16 (reduce_dtype = param_dtype), and FSDP2's foreach_reduce
    casts each unit's reduce-scatter output to the fp32 shards: the estimate mirrors the builder's step."""
    import torch

    from vramlab.core.simulation.shard import Sharder
    from vramlab.core.simulation.simulate import simulate

    setup = TrainingSetup(**{**FULL, "method": "freeze", "trainable_layers": 2, "seq_len": 64, **extra},
                          sharding="fsdp", amp=True)
    assert Sharder.for_setup(setup).reduce_dtype is torch.bfloat16
    assert Sharder.for_setup(setup.replace(sharding="zero3", amp=None, weights="fp32")).reduce_dtype is torch.float32
    spec = resolve_model("qwen2.5-0.5b").spec
    est = estimate(spec, setup, match_simulation=True)
    sim = simulate(spec, setup)
    assert est.peak_allocated_bytes == sim.peak_allocated_bytes
    assert {p.key: p.bytes for p in est.phases} == {p.key: p.bytes for p in sim.phases}
