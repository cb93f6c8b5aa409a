"""GRPO as TRL 1.16.0 runs it, on the model the simulation builds: ``GRPOTrainer``'s
``_generate_single_turn`` (``model.generate`` with transformers' ``DynamicCache``, or vLLM's token ids),
``_generate_and_score_completions`` and ``_compute_loss`` (see :mod:`vramlab.core.objectives.shared.reference`
for what is followed). The estimator's replay is :mod:`vramlab.core.objectives.grpo.program`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives.shared.reference import ReferenceStep, adapters_disabled, log_probs, token_ids
from vramlab.core.objectives.shared.trl import GRPO_OUTPUTS, REF_OUTPUTS, needs_old_logps
from vramlab.core.simulation import context
from vramlab.core.simulation.model import Decoder
from vramlab.core.spec.options import GenerationBackend, Reference, Sharding
from vramlab.core.spec.training import TrainingSetup

EPSILON_LOW = EPSILON_HIGH = 0.2  # GRPOConfig.epsilon
class GrowingCache:
    """transformers 5 ``DynamicLayer``: ``update`` concatenates the new keys and values to the cached ones."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with context.region(Kind.KV_CACHE):
            if self.keys is None:  # lazy_initialization: empty tensors, then the same cat
                self.keys = torch.tensor([], dtype=k.dtype, device=k.device)
                self.values = torch.tensor([], dtype=v.dtype, device=v.device)
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values


@contextlib.contextmanager
def no_autocast(model: Decoder) -> Iterator[None]:
    """Outside Trainer's autocast context (GRPO's generation runs in ``_prepare_inputs``; transformers' class is
    under autocast only inside its regions, which generation does not enter)."""
    plan = model.plan
    if not hasattr(plan, "autocast"):
        yield
        return
    old = plan.autocast
    object.__setattr__(plan, "autocast", False)
    try:
        yield
    finally:
        object.__setattr__(plan, "autocast", old)


def generate(policy: Decoder, setup: TrainingSetup, rows: int) -> dict[str, torch.Tensor]:
    """``model.generate`` of ``rows`` completions (sampling, temperature 1: no logits processor), as
    ``GenerationMixin._sample`` does it: prefill over the prompts with ``logits_to_keep=1``, then one token at a
    time with the cache; the last token's logits copied to fp32, softmax, multinomial, ids grown by cat. On
    transformers' class each forward is the class's own with transformers' ``DynamicCache`` (``HFModel.decode``);
    the loop around it is written out here, not ``generate`` itself, whose stopping checks read the sampled
    tokens' values (fake tensors have none)."""
    p, c = setup.prompt_tokens, setup.completion_tokens
    dev = policy.plan.device
    with context.region(Kind.INPUTS):
        ids = token_ids(rows, p, policy, dev)
        attn = torch.ones(rows, p, dtype=torch.long, device=dev)
    # TRL's unwrap_model_for_generation under ZeRO-3 (ds3_gather_for_generation, on by default): the whole policy
    # gathered for generate (GatheredParameters(model.parameters())), ZeRO's hooks removed until it ends
    sh = policy.plan.sharder if policy.plan.sharder is not None and policy.plan.sharder.mode is Sharding.ZERO3 \
        else None
    if sh is not None:
        sh.gather_all()
    decode = getattr(policy, "decode", None)  # transformers' class: its own forward and DynamicCache (tracing.hf)
    if decode is None:
        caches = [GrowingCache() for _ in policy.layers]
        for layer, cache in zip(policy.layers, caches):
            layer.attn.kv = cache
    else:
        caches = policy.new_cache()
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), no_autocast(policy):
            step_ids = ids
            start = 0
            next_logits = probs = None
            for _step in range(c):
                if decode is not None:
                    logits = decode(step_ids, caches)
                else:
                    h = policy.backbone(step_ids, checkpointing=False, start=start)
                    logits = policy.lm_head(h[:, -1:, :])  # outputs.logits (logits_to_keep=1)
                    del h
                with context.region(Kind.INPUTS):  # _update_model_kwargs_for_generation
                    attn = torch.cat([attn, attn.new_ones((rows, 1))], dim=-1)
                next_logits = logits[:, -1, :].to(dtype=torch.float32, copy=True)
                probs = F.softmax(next_logits, dim=-1)
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                with context.region(Kind.INPUTS):
                    ids = torch.cat([ids, next_tokens[:, None]], dim=-1)
                del next_tokens
                del logits  # `del outputs` at the end of the iteration
                start += step_ids.shape[1]
                step_ids = ids[:, -1:]
            del next_logits, probs, step_ids
    finally:
        for layer in policy.layers if decode is None else ():
            layer.attn.kv = None
        policy.train(was_training)
    del caches  # generate returns, then the gathered parameters are released
    if sh is not None:
        sh.release_all()
    with context.region(Kind.INPUTS):
        completion = ids[:, p:].contiguous()
        prompt = ids[:, :p].contiguous()
        return {"prompt_ids": prompt, "prompt_mask": attn[:, :p].contiguous(), "completion_ids": completion,
                "completion_mask": torch.ones_like(completion),
                "advantages": torch.empty(rows, device=dev)}


def score(model: Decoder, setup: TrainingSetup, gen: dict[str, torch.Tensor], outputs: tuple[str, ...],
          ) -> torch.Tensor:
    """``_get_per_token_logps_and_entropies`` under no_grad, in chunks of the micro batch."""
    ids = torch.cat([gen["prompt_ids"], gen["completion_ids"]], dim=1)
    attn = torch.cat([gen["prompt_mask"], gen["completion_mask"]], dim=1)
    c = setup.completion_tokens
    b = setup.micro_batch
    all_logps = []
    out = None
    for start in range(0, ids.shape[0], b):
        idb, atb = ids[start:start + b], attn[start:start + b]
        labels = idb.masked_fill(atb == 0, -100)
        labels[:, :-c] = -100
        out, _loss = log_probs(model, idb, labels, idb.shape[0] * c, outputs, grad=False)
        all_logps.append(out[0][:, -c:])
        del labels
    del out
    with context.region(Kind.INPUTS):
        return torch.cat(all_logps, dim=0)


def grpo_loss(policy: Decoder, setup: TrainingSetup, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """GRPOTrainer._compute_loss (loss_type dapo, token-level importance sampling)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    c = inputs["completion_ids"].shape[1]
    mask = inputs["completion_mask"]
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :-c] = -100
    out, _loss = log_probs(policy, ids, labels, ids.shape[0] * c, GRPO_OUTPUTS, grad=True)
    per_token_logps = torch.cat([out[0][:, -c:]], dim=0)
    entropies = torch.cat([out[1][:, -c:]], dim=0)
    del out, labels
    advantages = inputs["advantages"].unsqueeze(1)
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old
    log_ratio = per_token_logps - old
    coef_1 = torch.exp(log_ratio)
    beta = setup.beta_value
    if beta != 0.0:
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - EPSILON_LOW, 1 + EPSILON_HIGH)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    normalizer = mask.sum().clamp(min=1.0)
    loss = (per_token_loss * mask).sum() / normalizer
    del entropies
    return loss


class GrpoStep(ReferenceStep):
    def prepare(self, mark: Callable[[Phase], None]) -> None:
        setup = self.setup
        rows = setup.micro_batch * setup.generation_steps
        if setup.generation_backend is GenerationBackend.TRANSFORMERS:
            mark(Phase.GENERATE)
            gen = generate(self.policy, setup, rows)
        else:  # vLLM returns token ids: nothing of the generation is on the training allocator
            p, c = setup.prompt_tokens, setup.completion_tokens
            with context.region(Kind.INPUTS):
                gen = {"prompt_ids": token_ids(rows, p, self.policy, self.device),
                       "prompt_mask": torch.empty(rows, p, dtype=torch.long, device=self.device),
                       "completion_ids": token_ids(rows, c, self.policy, self.device),
                       "completion_mask": torch.empty(rows, c, dtype=torch.long, device=self.device),
                       "advantages": torch.empty(rows, device=self.device)}
        mode = setup.reference_mode
        if needs_old_logps(setup) or mode is not Reference.NONE:
            mark(Phase.REFERENCE)
        with torch.no_grad():
            if needs_old_logps(setup):
                gen["old_per_token_logps"] = score(self.policy, setup, gen, GRPO_OUTPUTS)
            if mode is Reference.ADAPTERS:
                with adapters_disabled(self.policy):
                    gen["ref_per_token_logps"] = score(self.policy, setup, gen, GRPO_OUTPUTS)
            elif mode is Reference.COPY:
                gen["ref_per_token_logps"] = score(self.ref, setup, gen, REF_OUTPUTS)
        self.buffer = gen

    def batch(self, i: int) -> dict[str, torch.Tensor]:
        b = self.setup.micro_batch
        return {k: v[i * b:(i + 1) * b] for k, v in self.buffer.items()}

    def loss(self, batch: dict[str, torch.Tensor], mark: Callable[[Phase], None]) -> torch.Tensor:
        return grpo_loss(self.policy, self.setup, batch)


STEP = GrpoStep
