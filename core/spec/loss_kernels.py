"""What each loss kernel's library refuses (``TrainingSetup.validate`` asks): a kernel's own limits beside the
kernels (``LossKernel`` in :mod:`.options`), not in the setup model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import DType, LossKernel, Objective, Sharding

if TYPE_CHECKING:
    from vramlab.core.spec.training import TrainingSetup


def validate_loss_kernel(setup: TrainingSetup) -> None:
    """What each loss kernel's library itself refuses of a setup (a setup's validation calls it)."""
    if "cross_entropy" in setup.liger_kernels:
        _validate_liger_cross_entropy(setup)
    if setup.loss_kernel is LossKernel.HF:
        return
    if setup.loss_kernel is LossKernel.CCE and setup.objective is not Objective.SFT:
        return  # TRL's trainers never run its patched forward's loss (TrainingSetup.warnings)
    if setup.loss_kernel is LossKernel.LIGER and setup.objective is not Objective.SFT:
        return  # TRL's own refusal (TrainingSetup._validate_objective) says what to do
    if setup.loss_kernel is LossKernel.TRL:
        if setup.chunked_loss:
            raise SetupError("TRL's fused LM head computes the loss in its own tiles (4096 tokens x 32768 "
                             "vocabulary entries): drop --chunked-loss")
        if not setup.loss_fp32:
            raise SetupError("TRL's fused LM head never makes the logits (its statistics are fp32): drop "
                             "--loss-bf16")
        if setup.uses_lora and "lm_head" in setup.lora_targets:
            raise SetupError("TRL's fused LM head projects with lm_head.weight alone (an adapter on lm_head "
                             "would be skipped): drop lm_head from --lora-targets")
        return
    if setup.loss_kernel is LossKernel.LIGER:
        _validate_liger(setup)
        return
    if setup.chunked_loss:
        raise SetupError("Cut Cross Entropy replaces lm_head and the whole loss (it never makes the logits): "
                         "drop --chunked-loss")
    if not setup.loss_fp32:
        raise SetupError("Cut Cross Entropy never makes the logits (its log-sum-exp is fp32): drop --loss-bf16")
    _refuse_zero3_head(setup, "Cut Cross Entropy")
    if setup.hidden_dtype not in (DType.BF16, DType.FP16):
        # cut_cross_entropy.cce_backward.cce_backward_kernel's assertion, on the hidden states ("embeddings")
        raise SetupError(f"Cut Cross Entropy cannot train on {setup.hidden_dtype.value} hidden states (its "
                         "backward: \"Backwards requires embeddings to be bf16 or fp16\"): use --weights bf16")


def _validate_liger(setup: TrainingSetup) -> None:
    name = "Liger's fused linear cross-entropy"
    if setup.chunked_loss:
        raise SetupError(f"{name} replaces lm_head and the whole loss (its own tiles): drop --chunked-loss")
    if not setup.loss_fp32:
        raise SetupError(f"{name} computes the loss in fp32 inside its kernel: drop --loss-bf16")
    _refuse_zero3_head(setup, name)


def _validate_liger_cross_entropy(setup: TrainingSetup) -> None:
    """Liger's plain cross-entropy (``--liger-kernels cross_entropy``) inside transformers' loss."""
    if setup.loss_kernel is LossKernel.LIGER:  # every apply_liger_kernel_to_<family>'s own assertion
        raise SetupError("Liger's cross-entropy with its fused linear cross-entropy: liger refuses it "
                         "(\"cross_entropy and fused_linear_cross_entropy cannot both be True.\")")
    if setup.loss_kernel is not LossKernel.HF or setup.chunked_loss or setup.objective.value != "sft":
        raise SetupError("Liger's cross-entropy is modelled inside transformers' own loss of an SFT step (one "
                         "pass, --loss-kernel hf): drop cross_entropy from --liger-kernels")


def _refuse_zero3_head(setup: TrainingSetup, name: str) -> None:
    """A fused loss reads lm_head.weight inside the causal LM's own forward, outside lm_head's. FSDP gathers the
    root unit (embeddings, final norm, head) around that whole forward, so the weight is whole there (held to
    transformers' classes, tests/test_loss_kernel_paths.py). DeepSpeed ZeRO-3 gathers a module's parameters around
    that module's own forward only: the weight the fused loss reads is the rank's empty partition, and the step
    fails (Liger 0.8.5: a ZeroDivisionError in its chunk sizing, Liger-Kernel issue 767; Cut Cross Entropy 25.1.1's
    patch gathers nothing either). TRL's own head gathers it (GatheredParameters) and is answered."""
    if setup.sharding is Sharding.ZERO3:
        raise SetupError(f"{name} cannot run under DeepSpeed ZeRO-3: it reads lm_head.weight outside lm_head's "
                         "forward, where ZeRO-3 leaves the weight partitioned (empty on the rank), and the step "
                         "fails; use FSDP (--sharding fsdp), --sharding zero1 / zero2, or --loss-kernel trl")
