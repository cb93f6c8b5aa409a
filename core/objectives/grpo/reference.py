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
from vramlab.core.objectives.shared.trl import GRPO_OUTPUTS, REF_OUTPUTS, generates_before, needs_old_logps
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


def prompts(policy: Decoder, setup: TrainingSetup, rows: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``rows`` prompts as ``_generate_single_turn`` hands them to ``generate``: ids and attention mask, and a
    vision-language model's pixel inputs (its processor's, ``_tokenize_prompts``: the image placeholders in the
    ids, :meth:`~vramlab.core.tracing.vlm.VisionHFModel.prompt_batch`)."""
    vision = getattr(policy, "prompt_batch", None)
    if vision is not None:
        return vision(setup, rows)
    dev = policy.plan.device
    with context.region(Kind.INPUTS):
        return (token_ids(rows, setup.prompt_tokens, policy, dev),
                torch.ones(rows, setup.prompt_tokens, dtype=torch.long, device=dev), {})


def generate(policy: Decoder, setup: TrainingSetup, rows: int) -> dict[str, torch.Tensor]:
    """``model.generate`` of ``rows`` completions (sampling, temperature 1: no logits processor), as
    ``GenerationMixin._sample`` does it: prefill over the prompts with ``logits_to_keep=1``, then one token at a
    time with the cache; the last token's logits copied to fp32, softmax, multinomial, ids grown by cat. On
    transformers' class each forward is the class's own with transformers' ``DynamicCache`` (``HFModel.decode``);
    the loop around it is written out here, not ``generate`` itself, whose stopping checks read the sampled
    tokens' values (fake tensors have none). A vision-language model's images enter the prefill only (its
    ``prepare_inputs_for_generation`` passes the pixels on the first iteration; the decoding reads the cache);
    its outputs (the tower's with them) live until ``del outputs`` ends the iteration."""
    c = setup.completion_tokens
    dev = policy.plan.device
    ids, attn, images = prompts(policy, setup, rows)
    p = ids.shape[1]  # the prompt's text and image tokens
    vision = policy if images else None
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
    release = getattr(policy, "release_outputs", None)
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), no_autocast(policy):
            step_ids = ids
            start = 0
            next_logits = probs = None
            for step in range(c):
                if decode is not None:
                    logits = decode(step_ids, caches, **(images if step == 0 else {}))
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
                if release is not None:
                    release()
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
    del images  # _generate_single_turn's generate_inputs go when it returns
    with context.region(Kind.INPUTS):
        if vision:  # TRL builds the padded tensors from the token lists: the placeholders are values the class reads
            completion = vision.token_rows(rows, c, images=False)
            prompt = vision.token_rows(rows, setup.prompt_tokens)
        else:
            completion = ids[:, p:].contiguous()
            prompt = ids[:, :p].contiguous()
        return {"prompt_ids": prompt, "prompt_mask": attn[:, :p].contiguous(), "completion_ids": completion,
                "completion_mask": torch.ones_like(completion),
                "advantages": torch.empty(rows, device=dev)}


# what unsplit_pixel_values_by_grid concatenates per micro-batch (trl/trainer/utils.py)
UNSPLIT = ("pixel_values", "image_grid_thw", "image_position_ids", "pixel_attention_mask", "spatial_shapes",
           "image_sizes")


def image_inputs(policy: Decoder, setup: TrainingSetup, rows: int) -> tuple[dict[str, torch.Tensor], list]:
    """``_generate_and_score_completions``' ``forward_kwargs``: the processor run again on the prompts and their
    images (``prompt_inputs``, moved to the device; its ids and mask, returned second, live until the function
    returns), per-token types extended with zeros over the completion. Nothing for a text model."""
    vision = getattr(policy, "prompt_batch", None)
    if vision is None:
        return {}, []
    ids, attn, images = vision(setup, rows)
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in images:
            with context.region(Kind.INPUTS):
                t = images[key]
                images[key] = torch.cat([t, t.new_zeros((rows, setup.completion_tokens))], dim=1)
            del t
    return images, [ids, attn]


def sample_rows(images: dict[str, torch.Tensor], start: int, end: int, rows: int) -> dict[str, torch.Tensor]:
    """Samples ``start:end`` of the processor's inputs of ``rows`` samples (views; every sample holds the same
    images, so each tensor's leading dimension is a multiple of the samples)."""
    return {k: v[start * (v.shape[0] // rows):end * (v.shape[0] // rows)] for k, v in images.items()}


def score(model: Decoder, setup: TrainingSetup, gen: dict[str, torch.Tensor], outputs: tuple[str, ...],
          images: dict[str, torch.Tensor]) -> torch.Tensor:
    """``_get_per_token_logps_and_entropies`` under no_grad, in chunks of the micro batch (each with its samples'
    ``images``)."""
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
        out, _loss = log_probs(model, idb, labels, idb.shape[0] * c, outputs, grad=False,
                               images=sample_rows(images, start, start + b, ids.shape[0]))
        all_logps.append(out[0][:, -c:])
        del labels
    del out
    with context.region(Kind.INPUTS):
        return torch.cat(all_logps, dim=0)


def grpo_loss(policy: Decoder, setup: TrainingSetup, inputs: dict[str, torch.Tensor],
              images: dict[str, torch.Tensor]) -> torch.Tensor:
    """GRPOTrainer._compute_loss (loss_type dapo, token-level importance sampling; a vision-language model's
    ``images`` to its forward)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    c = inputs["completion_ids"].shape[1]
    mask = inputs["completion_mask"]
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :-c] = -100
    out, _loss = log_probs(policy, ids, labels, ids.shape[0] * c, GRPO_OUTPUTS, grad=True, images=images)
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
    images: list[dict[str, torch.Tensor]] | None = None  # a vision-language model's, per micro-batch
    collates = False  # its data loader yields prompts (host data): the micro-batches are the generation buffer's

    def prepares_before(self, i: int) -> bool:
        return generates_before(self.setup, i)

    def prepare(self, mark: Callable[[Phase], None]) -> None:
        setup, policy = self.setup, self.policy
        rows = setup.micro_batch * setup.generation_steps
        if setup.generation_backend is GenerationBackend.TRANSFORMERS:
            mark(Phase.GENERATE)
            gen = generate(policy, setup, rows)
        else:  # vLLM returns token ids: nothing of the generation is on the training allocator
            p, c = setup.prompt_tokens, setup.completion_tokens
            vision = getattr(policy, "prompt_batch", None) and policy
            with context.region(Kind.INPUTS):  # a VLM's ids padded from the token lists (the placeholders are
                # values the class reads)
                prompt = vision.token_rows(rows, p) if vision else token_ids(rows, p, policy, self.device)
                gen = {"prompt_ids": prompt,
                       "prompt_mask": torch.empty(rows, prompt.shape[1], dtype=torch.long, device=self.device),
                       "completion_ids": vision.token_rows(rows, c, images=False) if vision else
                       token_ids(rows, c, policy, self.device),
                       "completion_mask": torch.empty(rows, c, dtype=torch.long, device=self.device),
                       "advantages": torch.empty(rows, device=self.device)}
        images, held = image_inputs(policy, setup, rows)
        mode = setup.reference_mode
        if needs_old_logps(setup) or mode is not Reference.NONE:
            mark(Phase.REFERENCE)
        with torch.no_grad():
            if needs_old_logps(setup):
                gen["old_per_token_logps"] = score(policy, setup, gen, GRPO_OUTPUTS, images)
            if mode is Reference.ADAPTERS:
                with adapters_disabled(policy):
                    gen["ref_per_token_logps"] = score(policy, setup, gen, GRPO_OUTPUTS, images)
            elif mode is Reference.COPY:
                gen["ref_per_token_logps"] = score(self.ref, setup, gen, REF_OUTPUTS, images)
        del held  # _generate_and_score_completions returns
        # _prepare_inputs: split_pixel_values_by_grid, shuffle, split_tensor_dict, then unsplit_pixel_values_by_grid
        # concatenates each micro-batch's pixel inputs (a copy); the whole batch's go when it returns
        b = setup.micro_batch
        per = None
        if images:
            with context.region(Kind.INPUTS):
                per = [{k: torch.cat([v]) if k in UNSPLIT else v
                        for k, v in sample_rows(images, i * b, (i + 1) * b, rows).items()}
                       for i in range(setup.generation_steps)]
        self.buffer, self.images = gen, per
        del images

    def batch(self, i: int) -> dict[str, torch.Tensor]:
        """``self._buffered_inputs[self._step % steps_per_generation]``."""
        b, i = self.setup.micro_batch, i % self.setup.generation_steps
        out = {k: v[i * b:(i + 1) * b] for k, v in self.buffer.items()}
        return {**out, **self.images[i]} if self.images else out

    def loss(self, batch: dict[str, torch.Tensor], mark: Callable[[Phase], None]) -> torch.Tensor:
        images = {k: v for k, v in batch.items() if k not in self.buffer}
        return grpo_loss(self.policy, self.setup, batch, images)


STEP = GrpoStep
