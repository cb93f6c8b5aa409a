"""DPO and IPO as TRL 1.16.0 runs them, on the model the simulation builds: ``DataCollatorForPreference`` and
``DPOTrainer._compute_loss`` (loss_type sigmoid or ipo). The estimator's replay is
:mod:`vramlab.core.objectives.dpo.program`; tests hold the two together."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.reference import (
    ReferenceStep,
    adapters_disabled,
    log_probs,
    masked_labels,
    token_ids,
)
from vramlab.core.objectives.shared.trl import DPO_OUTPUTS, REF_OUTPUTS
from vramlab.core.simulation import context
from vramlab.core.simulation.model import Decoder
from vramlab.core.spec.options import Objective, Reference
from vramlab.core.spec.training import TrainingSetup


def make_dpo_batch(setup: TrainingSetup, model: Decoder, device: torch.device) -> dict[str, torch.Tensor]:
    """DataCollatorForPreference: chosen then rejected rows (2 x micro batch), prompt + completion long (a
    vision-language model's: DataCollatorForVisionPreference, every prompt's images repeated for its rejected
    row, its pixel inputs beside the ids)."""
    rows, s = 2 * setup.micro_batch, setup.seq_len
    preference = getattr(model, "preference_batch", None)
    if preference is not None:
        return preference(setup, rows, device)
    with context.region(Kind.INPUTS):
        return {"input_ids": token_ids(rows, s, model, device),
                "attention_mask": torch.empty(rows, s, dtype=torch.long, device=device),
                "completion_mask": torch.empty(rows, s, dtype=torch.long, device=device)}


def dpo_loss(policy: Decoder, ref: Decoder | None, setup: TrainingSetup, batch: dict[str, torch.Tensor],
             mark: Callable[[Phase], None]) -> torch.Tensor:
    """DPOTrainer._compute_loss (loss_type sigmoid, or ipo)."""
    ids, cmask = batch["input_ids"], batch["completion_mask"]
    images = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "completion_mask")}
    rows = ids.shape[0]
    b = rows // 2
    n_tokens = rows * setup.completion_tokens
    labels = masked_labels(ids, cmask)
    outputs, _policy_loss = log_probs(policy, ids, labels, n_tokens, DPO_OUTPUTS, grad=True, images=images)
    logps = outputs[0].sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    mode = setup.reference_mode
    mark(Phase.REFERENCE)
    ref_out = None
    if mode is Reference.PRECOMPUTED:
        with context.region(Kind.INPUTS):
            ref_chosen, ref_rejected = (torch.empty(b, device=ids.device), torch.empty(b, device=ids.device))
    else:
        with torch.no_grad():
            if mode is Reference.ADAPTERS:
                with adapters_disabled(policy):
                    ref_out, _ref_loss = log_probs(policy, ids, labels, n_tokens, DPO_OUTPUTS, grad=False,
                                                   images=images)
            else:
                ref_out, _ref_loss = log_probs(ref, ids, labels, n_tokens, REF_OUTPUTS, grad=False, images=images)
            ref_logps = ref_out[0].sum(dim=1)
            ref_chosen, ref_rejected = ref_logps.chunk(2, dim=0)
    mark(Phase.FORWARD)
    chosen = chosen_logps - ref_chosen
    rejected = rejected_logps - ref_rejected
    delta = chosen - rejected
    if setup.objective is Objective.IPO:
        chosen_mask, rejected_mask = cmask.chunk(2, dim=0)
        chosen_avg = chosen / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg = rejected / rejected_mask.sum(dim=1).clamp(min=1.0)
        ipo_delta = chosen_avg - rejected_avg
        per_sequence = (ipo_delta - 1 / (2 * setup.beta_value)) ** 2
    else:
        per_sequence = -F.logsigmoid(setup.beta_value * delta)
    loss = 0.0
    loss += per_sequence.mean() * 1.0
    return loss


class DpoStep(ReferenceStep):
    def batch(self, i: int) -> dict[str, torch.Tensor]:
        return make_dpo_batch(self.setup, self.policy, self.device)

    def loss(self, batch: dict[str, torch.Tensor], mark: Callable[[Phase], None]) -> torch.Tensor:
        return dpo_loss(self.policy, self.ref, self.setup, batch, mark)


STEP = DpoStep
