"""What the sharding frameworks do to a setup's precision (``TrainingSetup`` asks): DeepSpeed's ZeRO optimizers
and accelerate's FSDP preparation, read from their source at the versions named, beside the setup model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import DType, Method, Offload, Sharding

if TYPE_CHECKING:
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

ZERO = (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3)


def fsdp_upcasts(setup: TrainingSetup, w: DType) -> bool:
    """accelerate 1.16 under FSDP with mixed precision (Trainer's bf16 / fp16 = True: ``--amp``) upcasts every
    trainable parameter that is not fp32 to fp32 (FSDP1's flat parameters in ``Accelerator.prepare_model``,
    FSDP2's in ``fsdp2_prepare_model``: "FSDP2 requires uniform orig_dtype"; not beside bitsandbytes' 4-bit
    parameters), and its MixedPrecision policy gathers them in the compute dtype. ``w``: the load dtype."""
    return (setup.sharding is Sharding.FSDP and (setup.amp is True or setup.trainable_fp32)
            and w in (DType.BF16, DType.FP16) and setup.compute is not DType.FP32)


def mixed_reduce_dtype(setup: TrainingSetup) -> DType:
    """The dtype a sharded mixed-precision run reduce-scatters its gradients in: accelerate's FSDP policy reduces in
    the compute dtype (``FullyShardedDataParallelPlugin.set_mixed_precision``: ``reduce_dtype`` = ``param_dtype``),
    then FSDP2 casts each unit's output to the fp32 shards; ZeRO-3 here reduces in fp32."""
    return setup.compute if setup.sharding is Sharding.FSDP else DType.FP32


def deepspeed_masters(setup: TrainingSetup) -> bool:
    """DeepSpeed's ZeRO optimizers (0.19: stage 1 / 2's ``single_partition_of_fp32_groups``, stage 3's
    ``fp32_partitioned_groups_flat``) always keep fp32 master partitions of 16-bit trainable parameters."""
    return setup.sharding in ZERO


# DeepSpeed 0.19.8 zero/config.py ``sub_group_size`` (its default; a config's own value is not read)
SUB_GROUP_SIZE = 1_000_000_000


def deepspeed_sub_groups(sizes: list[int], setup: TrainingSetup) -> list[list[int]]:
    """The groups DeepSpeed's ZeRO steps one after the other, as indices into ``sizes`` (each trainable parameter's
    partition elements, in order): stage 3's sub-groups (``_create_fp16_sub_groups``: one while the partition holds
    no more than ``sub_group_size`` elements, else parameters in order, a sub-group closed once it holds that many);
    stage 1 / 2 step the parameter group whole."""
    if setup.sharding is not Sharding.ZERO3 or sum(sizes) <= SUB_GROUP_SIZE:
        return [list(range(len(sizes)))]
    groups: list[list[int]] = [[]]
    held = 0
    for i, n in enumerate(sizes):
        groups[-1].append(i)
        held += n
        if held >= SUB_GROUP_SIZE and i < len(sizes) - 1:
            groups.append([])
            held = 0
    return groups


def deepspeed_splits(param_count: int, setup: TrainingSetup) -> bool:
    """Whether stage 3 may step the device's partition in several sub-groups (``param_count``: the model's
    parameters, about the trainable ones; 2 % of margin for each partition's rounding up and a published count): the
    estimator then replays every layer."""
    return (setup.sharding is Sharding.ZERO3 and setup.has_master_copy and setup.offload is Offload.NONE
            and param_count / setup.gpus > 0.98 * SUB_GROUP_SIZE)


def validate_sharded_precision(setup: TrainingSetup) -> None:
    """The precisions the sharding frameworks change that VRAM Lab does not model."""
    if setup.trainable_fp32 and setup._upcasts_base and setup.sharding is Sharding.ZERO3:
        raise SetupError("fp32 trainable parameters beside 16-bit frozen ones are not modelled under zero3 "
                         "(LLaMA-Factory does not upcast under ZeRO-3): drop --trainable-fp32 or use --sharding "
                         "zero1 / zero2 / fsdp")


def validate_vlm_precision(setup: TrainingSetup, model: ModelSpec) -> None:
    """accelerate's FSDP upcast of what trains on a vision-language model (text models only are modelled)."""
    if (setup.method is not Method.FULL and fsdp_upcasts(setup, setup.load_dtype)
            and (setup.method is Method.FREEZE or setup.vision_tuning in ("projector", "full"))):
        raise SetupError(f"{model.name} (a vision-language model): accelerate upcasts the trained parameters to fp32 "
                         "under FSDP with mixed precision (--amp), beside 16-bit frozen ones: modelled for text "
                         "models; for a vision-language model drop --amp or use --sharding zero3")
