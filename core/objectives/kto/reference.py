"""KTO as TRL 1.16.0 runs it, on the model the simulation builds: ``DataCollatorForUnpairedPreference`` and
``KTOTrainer._compute_loss`` (loss_type kto, the KL term estimated). The estimator's replay is
:mod:`vramlab.core.objectives.kto.program`; tests hold the two together."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.reference import (
    ReferenceStep,
    adapters_disabled,
    log_probs,
    masked_labels,
    token_ids,
)
from vramlab.core.objectives.shared.trl import KTO_OUTPUTS, REF_OUTPUTS
from vramlab.core.simulation import context
from vramlab.core.simulation.model import Decoder
from vramlab.core.spec.options import Reference
from vramlab.core.spec.training import TrainingSetup


def make_kto_batch(setup: TrainingSetup, model: Decoder, device: torch.device) -> dict[str, torch.Tensor]:
    """DataCollatorForUnpairedPreference: the completions, the mismatched KL completions (each row's
    completion cycled by one), and the desirable / undesirable labels; precomputed reference log-probs."""
    b, s = setup.micro_batch, setup.seq_len
    preference = getattr(model, "preference_batch", None)  # DataCollatorForVisionUnpairedPreference
    if preference is not None:
        batch = preference(setup, b, device)
        with context.region(Kind.INPUTS):
            ids = batch["input_ids"]
            batch.update({"KL_input_ids": ids.clone(), "KL_attention_mask": torch.empty_like(ids),
                          "KL_completion_mask": torch.empty_like(ids),
                          "label": torch.empty(b, dtype=torch.bool, device=device)})
            if "token_type_ids" in batch:  # the KL rows' own (its completions differ from the rows')
                batch["KL_token_type_ids"] = batch["token_type_ids"].clone()
            if setup.reference_mode is Reference.PRECOMPUTED:
                batch["ref_logps"] = torch.empty(b, device=device)
                batch["ref_KL_logps"] = torch.empty(b, device=device)
        return batch
    with context.region(Kind.INPUTS):
        batch = {"input_ids": token_ids(b, s, model, device),
                 "attention_mask": torch.empty(b, s, dtype=torch.long, device=device),
                 "completion_mask": torch.empty(b, s, dtype=torch.long, device=device),
                 "KL_input_ids": token_ids(b, s, model, device),
                 "KL_attention_mask": torch.empty(b, s, dtype=torch.long, device=device),
                 "KL_completion_mask": torch.empty(b, s, dtype=torch.long, device=device),
                 "label": torch.empty(b, dtype=torch.bool, device=device)}
        if setup.reference_mode is Reference.PRECOMPUTED:
            batch["ref_logps"] = torch.empty(b, device=device)
            batch["ref_KL_logps"] = torch.empty(b, device=device)
        return batch


def _kl_logps(model: Decoder, batch: dict[str, torch.Tensor], n_tokens: int,
              outputs: tuple[str, ...]) -> torch.Tensor:
    """KTOTrainer._compute_kl_logps: the KL rows under no_grad, summed per row."""
    kl_labels = masked_labels(batch["KL_input_ids"], batch["KL_completion_mask"])
    images = _images(batch)
    if "KL_token_type_ids" in batch:
        images["token_type_ids"] = batch["KL_token_type_ids"]
    with torch.no_grad():
        per_token = log_probs(model, batch["KL_input_ids"], kl_labels, n_tokens, outputs, grad=False,
                              images=images)[0][0]
    return per_token.sum(-1)


_TEXT_KEYS = ("input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask",
              "KL_completion_mask", "KL_token_type_ids", "label", "ref_logps", "ref_KL_logps")


def _images(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What KTOTrainer hands the model beside the ids: a vision-language model's pixel inputs (none for text)."""
    return {k: v for k, v in batch.items() if k not in _TEXT_KEYS}


def kto_loss(policy: Decoder, ref: Decoder | None, setup: TrainingSetup, batch: dict[str, torch.Tensor],
             mark: Callable[[Phase], None]) -> torch.Tensor:
    """KTOTrainer._compute_loss (loss_type kto, KL estimated): half the rows desirable (the labels decide
    which at run time; the split changes only vectors of the micro batch's size). Its counts of desirable and
    undesirable rows (``labels.sum()``, ``len(labels) - num_chosen``) are 0-dim device tensors held to the end."""
    ids, cmask = batch["input_ids"], batch["completion_mask"]
    b = ids.shape[0]
    n_tokens = b * setup.completion_tokens
    num_chosen = batch["label"].sum()  # on the device until the loss returns (its metrics count them)
    num_rejected = b - num_chosen
    kl_logps = _kl_logps(policy, batch, n_tokens, KTO_OUTPUTS)
    labels = masked_labels(ids, cmask)
    images = _images(batch)
    outputs, _policy_loss = log_probs(policy, ids, labels, n_tokens, KTO_OUTPUTS, grad=True, images=images)
    completion_logps = outputs[0].sum(-1)
    k = b // 2
    chosen_idx = torch.empty(k, dtype=torch.long, device=ids.device)  # nonzero(bool_labels).view(-1)
    flipped = torch.empty(b, dtype=torch.bool, device=ids.device)  # ~bool_labels
    rejected_idx = torch.empty(b - k, dtype=torch.long, device=ids.device)
    del flipped
    chosen_logps = completion_logps.index_select(0, chosen_idx)
    rejected_logps = completion_logps.index_select(0, rejected_idx)
    mode = setup.reference_mode
    mark(Phase.REFERENCE)
    ref_out = None
    if mode is Reference.PRECOMPUTED:
        ref_chosen = batch["ref_logps"].index_select(0, chosen_idx)
        ref_rejected = batch["ref_logps"].index_select(0, rejected_idx)
        ref_kl_logps = batch["ref_KL_logps"]
    else:
        with torch.no_grad():
            if mode is Reference.ADAPTERS:
                with adapters_disabled(policy):
                    ref_kl_logps = _kl_logps(policy, batch, n_tokens, KTO_OUTPUTS)
                    ref_out, _ref_loss = log_probs(policy, ids, labels, n_tokens, KTO_OUTPUTS, grad=False,
                                                   images=images)
            else:
                ref_kl_logps = _kl_logps(ref, batch, n_tokens, REF_OUTPUTS)
                ref_out, _ref_loss = log_probs(ref, ids, labels, n_tokens, REF_OUTPUTS, grad=False, images=images)
            ref_completion_logps = ref_out[0].sum(-1)
            ref_chosen = ref_completion_logps.index_select(0, chosen_idx)
            ref_rejected = ref_completion_logps.index_select(0, rejected_idx)
    mark(Phase.FORWARD)
    beta = setup.beta_value
    kl = (kl_logps - ref_kl_logps).mean().detach()
    kl = kl.mean().clamp(min=0)  # gather_for_metrics(kl).mean() on one process
    chosen_logratios = chosen_logps - ref_chosen
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))
    rejected_logratios = rejected_logps - ref_rejected
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))
    losses = torch.cat((1.0 * chosen_losses, 1.0 * rejected_losses), 0)
    loss = losses.nanmean()
    del num_chosen, num_rejected
    return loss


class KtoStep(ReferenceStep):
    def batch(self, i: int) -> dict[str, torch.Tensor]:
        return make_kto_batch(self.setup, self.policy, self.device)

    def loss(self, batch: dict[str, torch.Tensor], mark: Callable[[Phase], None]) -> torch.Tensor:
        return kto_loss(self.policy, self.ref, self.setup, batch, mark)


STEP = KtoStep
