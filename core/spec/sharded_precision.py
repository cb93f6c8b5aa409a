"""What the sharding frameworks do to a setup's precision (``TrainingSetup`` asks): DeepSpeed's ZeRO optimizers
and accelerate's FSDP preparation, read from their source at the versions named, beside the setup model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import DType, Method, Sharding

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


def deepspeed_masters(setup: TrainingSetup) -> bool:
    """DeepSpeed's ZeRO optimizers (0.19: stage 1 / 2's ``single_partition_of_fp32_groups``, stage 3's
    ``fp32_partitioned_groups_flat``) always keep fp32 master partitions of 16-bit trainable parameters."""
    return setup.sharding in ZERO


def validate_sharded_precision(setup: TrainingSetup, model: ModelSpec | None = None) -> None:
    """The precisions the sharding frameworks change that VRAM Lab does not model."""
    if setup.trainable_fp32 and setup._upcasts_base and setup.sharding is Sharding.ZERO3:
        raise SetupError("fp32 trainable parameters beside 16-bit frozen ones are not modelled under zero3 "
                         "(LLaMA-Factory does not upcast under ZeRO-3): drop --trainable-fp32 or use --sharding "
                         "zero1 / zero2 / fsdp")
    if (model is not None and model.vision is not None and setup.method is not Method.FULL
            and fsdp_upcasts(setup, setup.load_dtype)
            and (setup.method is Method.FREEZE or setup.vision_tuning in ("projector", "full"))):
        raise SetupError(f"{model.name} (a vision-language model): accelerate upcasts the trained parameters to fp32 "
                         "under FSDP with mixed precision (--amp), beside 16-bit frozen ones: modelled for text "
                         "models; for a vision-language model drop --amp or use --sharding zero3")
