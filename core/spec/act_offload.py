"""What the two offloading options are modelled for, and what the libraries themselves do not run:
activation offloading (``--offload-activations``: TRL's ``activation_offloading``; core/simulation/act_offload.py)
and offloaded gradient checkpointing (``--grad-ckpt-offload``: LLaMA-Factory's ``use_unsloth_gc``;
core/simulation/offload_ckpt.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import ActivationOffload, Objective
from vramlab.core.spec.unsloth_gc import validate_unsloth_gc

if TYPE_CHECKING:
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

# TRL 1.16.0's configs with an activation_offloading field (SFTConfig, DPOConfig for DPO / IPO, KTOConfig);
# GRPOConfig and the experimental ORPO / CPO configs have none
OFFLOADING_OBJECTIVES = (Objective.SFT, Objective.DPO, Objective.IPO, Objective.KTO)


def validate_offloading(setup: TrainingSetup, model: ModelSpec | None = None) -> None:
    validate_unsloth_gc(setup, model)
    if not setup.offloads_activations:
        return
    if setup.offload_activations is ActivationOffload.AXOLOTL:
        _validate_axolotl(setup)
    if setup.objective not in OFFLOADING_OBJECTIVES:
        raise SetupError(f"TRL 1.16.0's {setup.objective.value} trainer has no activation_offloading (SFTConfig, "
                         "DPOConfig and KTOConfig have it): drop --offload-activations")


def _validate_axolotl(setup: TrainingSetup) -> None:
    """axolotl 0.19.0's ``activation_offloading: true`` is modelled on an adapter run, where its trainer builder turns
    transformers' checkpointing off (``_configure_gradient_checkpointing``: TRL's hooks replace the recompute)."""
    if not setup.uses_lora:
        raise SetupError("axolotl's activation offloading is modelled for LoRA / QLoRA; a full fine-tune wraps its "
                         "layers in torch's checkpoint_wrapper (not modelled yet): use --offload-activations trl or "
                         "drop it")
    if setup.grad_ckpt:
        raise SetupError("axolotl turns gradient checkpointing off under activation_offloading on an adapter run "
                         "(TRL's hooks replace the recompute): drop --grad-ckpt")
    if setup.objective is not Objective.SFT:
        raise SetupError("axolotl's activation offloading is modelled for SFT: drop --offload-activations or "
                         "--objective")
