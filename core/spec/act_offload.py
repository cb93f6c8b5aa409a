"""What activation offloading (``--offload-activations``: TRL's ``activation_offloading``) is modelled for, and
what TRL itself does not run (its transformation of the step: core/simulation/act_offload.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import Objective, Sharding

if TYPE_CHECKING:
    from vramlab.core.spec.training import TrainingSetup

# TRL 1.16.0's configs with an activation_offloading field (SFTConfig, DPOConfig for DPO / IPO, KTOConfig);
# GRPOConfig and the experimental ORPO / CPO configs have none
OFFLOADING_OBJECTIVES = (Objective.SFT, Objective.DPO, Objective.IPO, Objective.KTO)


def validate_offload_activations(setup: TrainingSetup) -> None:
    if not setup.offload_activations:
        return
    if setup.objective not in OFFLOADING_OBJECTIVES:
        raise SetupError(f"TRL 1.16.0's {setup.objective.value} trainer has no activation_offloading (SFTConfig, "
                         "DPOConfig and KTOConfig have it): drop --offload-activations")
    if setup.sharding is not Sharding.NONE:
        raise SetupError("activation offloading under ZeRO / FSDP is not modelled yet (which gathered weights TRL's "
                         "hooks keep on the GPU): drop --offload-activations or --sharding")
