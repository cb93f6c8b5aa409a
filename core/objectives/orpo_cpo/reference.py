"""ORPO, CPO and SimPO as TRL 1.16.0's ``trl.experimental`` ORPOTrainer and CPOTrainer run them, on the model the
simulation builds: ``concatenated_inputs``, ``concatenated_forward`` with the model's full logits and
``get_batch_loss_metrics``; no reference. The estimator's replay is :mod:`vramlab.core.objectives.orpo_cpo.program`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.reference import ReferenceStep, token_ids
from vramlab.core.simulation import context
from vramlab.core.simulation.model import Decoder
from vramlab.core.spec.options import Objective
from vramlab.core.spec.training import TrainingSetup

SIMPO_GAMMA = 0.5  # CPOConfig.simpo_gamma
CPO_ALPHA = 1.0  # CPOConfig.cpo_alpha: the NLL term on the chosen rows (on by default, SimPO included)
class LogProbEntropy(torch.autograd.Function):
    """``trl.kernels.selective_log_softmax_and_entropy`` (``_LogProbEntropyFunction``, the Triton path that
    ``selective_log_softmax`` takes on CUDA for fp32/bf16/fp16 logits): four fp32 vectors of the rows (log-probs
    and entropy returned, log_z and the expected logit saved with the logits); backward writes one
    ``empty_like(logits, contiguous_format)`` gradient."""

    @staticmethod
    def forward(ctx, logits, index):  # noqa: ANN001, ANN205
        shape = logits.shape[:-1]
        logprobs = torch.empty(shape, device=logits.device, dtype=torch.float32)
        entropy = torch.empty_like(logprobs)
        log_z = torch.empty_like(logprobs)
        expected = torch.empty_like(logprobs)
        ctx.save_for_backward(logits, index, log_z, expected)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):  # noqa: ANN001, ANN205
        logits = ctx.saved_tensors[0]
        return torch.empty_like(logits, memory_format=torch.contiguous_format), None


def make_pair_batch(setup: TrainingSetup, model: Decoder, device: torch.device) -> dict[str, torch.Tensor]:
    """``DPODataCollatorWithPadding`` (trl/experimental/utils.py): the prompts' ids and attention mask, and the
    chosen and rejected rows' ids, attention mask and labels, each padded to its longest (every row full length),
    held as the trainer's inputs for the whole micro-step."""
    b, s, p = setup.micro_batch, setup.seq_len, setup.prompt_tokens
    with context.region(Kind.INPUTS):
        batch = {"prompt_input_ids": token_ids(b, p, model, device),
                 "prompt_attention_mask": torch.ones(b, p, dtype=torch.long, device=device)}
        for side in ("chosen", "rejected"):
            batch |= {f"{side}_input_ids": token_ids(b, s, model, device),
                      f"{side}_attention_mask": torch.ones(b, s, dtype=torch.long, device=device),
                      f"{side}_labels": torch.empty(b, s, dtype=torch.long, device=device)}
        return batch


def concatenated_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``concatenated_inputs``: chosen then rejected rows (2 x micro batch) of ids, attention mask and labels
    (``pad_to_length`` of a row already that long is the row itself; ``torch.cat`` copies)."""
    with context.region(Kind.INPUTS):
        return tuple(torch.cat((batch[f"chosen_{k}"], batch[f"rejected_{k}"]), dim=0)
                     for k in ("input_ids", "attention_mask", "labels"))


def full_logits(policy: Decoder, ids: torch.Tensor) -> torch.Tensor:
    """``model(input_ids, attention_mask=..., use_cache=False).logits``: transformers' class runs its own forward
    (``HFModel.logits``); the builder its backbone, head and Gemma 2's softcap."""
    own = getattr(policy, "logits", None)
    if own is not None:
        return own(ids)
    h = policy.backbone(ids)
    with context.region(Kind.LOGITS):
        logits = policy.lm_head(h)  # outputs.logits: the compute dtype (no labels, no upcast)
        cap = policy.plan.spec.final_logit_softcap
        if cap:  # Gemma 2's forward softcaps the logits it returns (each rebinding frees the previous tensor)
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        del h  # the base model's output, held by the forward until it returns
        if policy.plan.autocast and logits.dtype != torch.float32:
            logits = logits.float()  # accelerate's convert_outputs_to_fp32 (the 16-bit logits go)
    return logits


def pair_loss(policy: Decoder, setup: TrainingSetup, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """ORPOTrainer / CPOTrainer ``concatenated_forward`` and ``get_batch_loss_metrics``: the collator's rows
    concatenated (:func:`concatenated_inputs`, gone when ``concatenated_forward`` returns), the model's full
    logits (fp32 under the trainer's autocast: accelerate converts the forward's outputs), the chosen rows' cross
    entropy (``nn.CrossEntropyLoss`` on ``logits[..., :-1, :].contiguous()``), ``get_batch_logps``
    (``selective_log_softmax``, averaged for ORPO and SimPO), the loss."""
    obj = setup.objective
    ids, attn, lab = concatenated_inputs(batch)
    b = ids.shape[0] // 2
    logits = full_logits(policy, ids)
    vocab = logits.shape[-1]
    with context.region(Kind.LOGITS):
        if obj is Objective.ORPO:  # over the full prompt and response
            labels = torch.where(attn == 1, ids.clone(), -100)
        else:
            labels = lab.clone()
        # ORPO's chosen NLL; CPO's with cpo_alpha != 0 (its default 1.0, kept: cpo_alpha 0 is not modelled)
        lg = logits[:b][..., :-1, :].contiguous()  # one row: already contiguous, no copy
        lb = labels[:b][..., 1:].contiguous()
        nll = F.cross_entropy(lg.view(-1, vocab), lb.view(-1))
        del lg, lb, labels
        shifted = lab[:, 1:].clone()
        loss_mask = shifted != -100
        shifted.masked_fill_(~loss_mask, 0)  # labels[labels == -100] = 0
        per_token, _entropy = LogProbEntropy.apply(logits[:, :-1, :], shifted)  # the labels saved as the index
        del _entropy, shifted
        summed = (per_token * loss_mask).sum(-1)
        del per_token
        if obj is Objective.CPO:
            all_logps = summed
        else:
            all_logps = summed / loss_mask.sum(-1)
        del summed, loss_mask, logits
    chosen, rejected = all_logps[:b], all_logps[b:]
    del all_logps, ids, attn, lab  # concatenated_forward returns (the embedding keeps the ids for backward)
    beta = setup.beta_value
    if obj is Objective.ORPO:
        chosen, rejected = chosen.float(), rejected.float()
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        losses = beta * F.logsigmoid(log_odds)
        return nll - losses.mean()
    diff = chosen - rejected
    if obj is Objective.SIMPO:
        diff = diff - SIMPO_GAMMA / beta
    losses = -F.logsigmoid(beta * diff) * 1.0 - F.logsigmoid(-beta * diff) * 0.0
    return losses.mean() + CPO_ALPHA * nll


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """trl/experimental/orpo/orpo_trainer.py ``log1mexp``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PairStep(ReferenceStep):
    def batch(self, i: int) -> dict[str, torch.Tensor]:
        return make_pair_batch(self.setup, self.policy, self.device)

    def loss(self, batch: dict[str, torch.Tensor], mark: Callable[[Phase], None]) -> torch.Tensor:
        return pair_loss(self.policy, self.setup, batch)


STEP = PairStep
