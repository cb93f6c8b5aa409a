"""Preference training (DPO, IPO) and GRPO as TRL 1.16.0 runs them, on the model the measurement builds.

What is followed (``trl`` 1.16.0, installed with ``pip install vramlab[trl]``):

* ``trl/trainer/utils.py`` ``add_fused_lm_head``: DPOTrainer and GRPOTrainer never materialise the
  (batch x sequence x vocabulary) logits. The backbone's last hidden states are shifted by one, the
  positions whose label is not -100 selected (``hidden_states[mask]``: only completion tokens), and
  ``ChunkedLogProbFunction`` (``trl/kernels/chunked_logprob.py``) projects them through the LM head in tiles
  of 4096 tokens x 32768 vocabulary entries (``mm_buf``, in the autocast dtype), folding each tile into fp32
  running statistics (a Triton kernel on CUDA, in place). Backward recomputes each tile and accumulates the
  hidden-state and LM-head gradients in fp32 (``torch.addmm(..., out_dtype=float32, out=acc)`` on CUDA with
  torch >= 2.8: in place), then casts them to the inputs' dtypes. The per-token outputs are scattered back
  to (batch, sequence - 1) with ``new_zeros(...).masked_scatter(mask, x)``.
* ``DPOTrainer._compute_loss``: chosen and rejected rows concatenated by the collator (2 x micro batch),
  the policy forward, then the reference forward under ``torch.no_grad()`` with gradient checkpointing
  disabled: a second model (``ref_model``), or the policy inside peft's ``disable_adapter`` (``use_adapter``),
  or nothing (``precompute_ref_log_probs``); per-sequence sums, the sigmoid (DPO) or IPO loss.
* ``GRPOTrainer``: ``_generate_single_turn`` (``unwrap_model_for_generation``: eval mode, no_grad, no
  autocast, checkpointing off) with ``model.generate``, whose ``DynamicCache`` (transformers
  ``cache_utils.DynamicLayer.update``) grows every layer's keys and values by ``torch.cat`` once per token;
  ``_generate_and_score_completions`` (old-policy and reference log-probabilities under no_grad, in chunks
  of the micro batch, ``_get_per_token_logps_and_entropies``); ``_compute_loss`` (policy log-probabilities
  and entropies over the completion tokens only, the clipped ratio loss, the KL term when beta > 0).

CUDA, not the CPU, is modelled where the two allocate differently: the Triton kernels allocate nothing
(the CPU fallback ``_forward_tile`` makes tile-sized temporaries), ``masked_scatter`` allocates its prefix
sums (``maskPrefixSum``), ``masked_select`` and boolean indexing their ``nonzero`` indices. Data-dependent
shapes (the number of completion tokens) cannot run under fake tensors, so those ops are written here as
autograd functions that allocate what CUDA allocates, with every row full (no padding). The estimator
(:mod:`vramlab.core.estimator.objective`) replays the same step; tests hold the two together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from vramlab.core.kinds import Kind, Phase
from vramlab.core.simulation import context
from vramlab.core.simulation.model import Decoder, Linear
from vramlab.core.spec import NO_REFERENCE_OBJECTIVES, GenerationBackend, Objective, Reference, TrainingSetup

TOKEN_CHUNK_SIZE = 4096  # trl/kernels/chunked_logprob.py
VOCAB_CHUNK_SIZE = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
# the per-token outputs each trainer asks add_fused_lm_head for (a ref_model gets the default, log_probs only)
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
GRPO_OUTPUTS = ("log_probs", "entropy")
REF_OUTPUTS = ("log_probs",)
EPSILON_LOW = EPSILON_HIGH = 0.2  # GRPOConfig.epsilon


def _tile(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) tile inside ``buf``. TRL slices ``mm_buf[:rows, :cols]``, a strided view that cuBLAS
    writes in place (its leading dimension is the buffer's); the CPU's ``mm(out=)`` would copy a strided
    output, so the simulation takes a contiguous view of the same storage instead: the same bytes."""
    return buf.view(-1)[: rows * cols].view(rows, cols)


class ChunkedLogProb(torch.autograd.Function):
    """``trl.kernels.ChunkedLogProbFunction`` with the allocations of its CUDA path (see the module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype, outputs):  # noqa: ANN001, ANN205
        ctx.set_materialize_grads(False)
        dev, f32 = hidden.device, torch.float32
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        running_max = torch.full((n_tok,), float("-inf"), device=dev, dtype=f32)
        sum_exp = torch.zeros((n_tok,), device=dev, dtype=f32)
        x_sum_exp = torch.zeros((n_tok,), device=dev, dtype=f32)
        sq_sum_exp = torch.zeros((n_tok,), device=dev, dtype=f32)  # noqa: F841 - TRL's statistic, alive as long
        z_sum = torch.zeros((n_tok,), device=dev, dtype=f32)
        max_before_target = torch.full((n_tok,), float("-inf"), device=dev, dtype=f32)
        target_logit = torch.zeros((n_tok,), device=dev, dtype=f32)
        mm_buf = torch.empty((min(n_tok, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), device=dev, dtype=compute_dtype)
        for token_start in range(0, n_tok, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, n_tok)
            hidden_chunk = hidden[token_start:token_end].to(compute_dtype)
            for start in range(0, vocab, VOCAB_CHUNK_SIZE):
                end = min(start + VOCAB_CHUNK_SIZE, vocab)
                tile = _tile(mm_buf, token_end - token_start, end - start)
                torch.mm(hidden_chunk, weight[start:end].to(compute_dtype).t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(compute_dtype))
                # _forward_kernel (Triton) folds the tile into the statistics in place: nothing allocated
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
        mean_logits = z_sum / vocab if "mean_logits" in outputs else None
        is_top1 = (target_logit >= running_max) & (target_logit > max_before_target) if "is_top1" in outputs else None
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z if entropy is None else entropy)
        ctx.compute_dtype = compute_dtype
        ctx.mark_non_differentiable(*(x for x in (mean_logits, is_top1) if x is not None))
        return logprobs, entropy, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):  # noqa: ANN001, ANN205
        hidden, weight, bias, _targets, _log_z, _entropy = ctx.saved_tensors
        cd = ctx.compute_dtype
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        f32 = torch.float32
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=f32) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=f32) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=f32) if needs_bias else None
        mm_buf = torch.empty((min(n_tok, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), device=hidden.device, dtype=cd)
        for token_start in range(0, n_tok, TOKEN_CHUNK_SIZE):
            token_end = min(token_start + TOKEN_CHUNK_SIZE, n_tok)
            hidden_chunk = hidden[token_start:token_end].to(cd)
            for start in range(0, vocab, VOCAB_CHUNK_SIZE):
                end = min(start + VOCAB_CHUNK_SIZE, vocab)
                w_chunk = weight[start:end].to(cd)
                tile = _tile(mm_buf, token_end - token_start, end - start)
                torch.mm(hidden_chunk, w_chunk.t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(cd))
                # _backward_kernel writes the logits' gradient into the tile; _addmm_fp32 accumulates into
                # grad_hidden / grad_weight with torch.addmm(out_dtype=float32, out=acc): nothing allocated
        # mm_buf and the last chunks are TRL's locals: alive while the gradients are cast
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None)


class SelectRows(torch.autograd.Function):
    """``hidden_states[mask]`` with ``n`` true positions: ``nonzero`` (n x 2 int64, kept as the saved
    indices) and the (n, hidden) rows; backward makes zeros of the input's shape and puts the rows in."""

    @staticmethod
    def forward(ctx, x, n):  # noqa: ANN001, ANN205
        nz = torch.empty((n, x.dim() - 1), dtype=torch.long, device=x.device)
        out = torch.empty((n, x.shape[-1]), dtype=x.dtype, device=x.device)
        ctx.save_for_backward(nz)
        ctx.shape = x.shape
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g.new_zeros(ctx.shape), None


class Compact(torch.autograd.Function):
    """``x.new_zeros(mask.shape).masked_scatter(mask, x)`` on CUDA: the zeros, their clone, the int64 prefix
    sums of the mask; backward is ``masked_select`` (``nonzero`` indices, then the selected gradient)."""

    @staticmethod
    def forward(ctx, x, shape):  # noqa: ANN001, ANN205
        zeros = x.new_zeros(shape)
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        prefix = torch.empty(shape, dtype=torch.long, device=x.device)
        del prefix, zeros
        ctx.n = x.shape[0]
        ctx.ndim = len(shape)
        if not x.dtype.is_floating_point:
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        nz = torch.empty((ctx.n, ctx.ndim), dtype=torch.long, device=g.device)
        out = torch.empty((ctx.n,), dtype=g.dtype, device=g.device)
        del nz
        return out, None


def head_dtype(model: Decoder, hidden: torch.Tensor) -> torch.dtype:
    """ChunkedLogProbFunction's compute dtype: autocast's when it is on (HF Trainer with bf16/fp16), else the
    hidden states' (the builder emulates autocast with explicit casts)."""
    plan = model.plan
    return plan.compute_dtype if plan.autocast else hidden.dtype


def fused_head(model: Decoder, h: torch.Tensor, labels: torch.Tensor, n_tokens: int,
               outputs: tuple[str, ...]) -> tuple[list, torch.Tensor]:
    """``add_fused_lm_head``'s forward after the backbone: (per-token outputs (batch, seq - 1), loss)."""
    with context.region(Kind.LOGITS):
        hs = h[:, :-1]
        lab = labels[:, 1:]
        mask = lab != -100
        sel = SelectRows.apply(hs, n_tokens)
        nz = torch.empty((n_tokens, 2), dtype=torch.long, device=h.device)  # labels[mask]
        targets = torch.empty((n_tokens,), dtype=torch.long, device=h.device)
        del nz
        head = model.lm_head.weight
        bias = model.lm_head.bias
        per_token = ChunkedLogProb.apply(sel, head, bias, targets, head_dtype(model, h), outputs)
        del sel, targets
        shape = tuple(mask.shape)
        scattered = [None if x is None else Compact.apply(x, shape) for x in per_token]
        del per_token
        log_probs = scattered[0]
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        return [*scattered, mask], loss


@contextlib.contextmanager
def adapters_disabled(model: Decoder) -> Iterator[None]:
    """peft's ``disable_adapter``: every LoRA layer runs its base layer only."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.lora]
    for m in layers:
        m.lora = False
    try:
        yield
    finally:
        for m in layers:
            m.lora = True


@contextlib.contextmanager
def no_autocast(model: Decoder) -> Iterator[None]:
    """Outside Trainer's autocast context (GRPO's generation runs in ``_prepare_inputs``)."""
    plan = model.plan
    old = plan.autocast
    object.__setattr__(plan, "autocast", False)
    try:
        yield
    finally:
        object.__setattr__(plan, "autocast", old)


def token_ids(rows: int, cols: int, model: Decoder, device: torch.device) -> torch.Tensor:
    """A batch of token ids: random valid ids on real tensors (a profile embeds them), empty on fake ones."""
    if model.plan.real:
        return torch.randint(0, model.plan.spec.vocab_size, (rows, cols), device=device)
    return torch.empty(rows, cols, dtype=torch.long, device=device)


def _labels(ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``input_ids.masked_fill(completion_mask == 0, -100)``."""
    return ids.masked_fill(keep == 0, -100)


def log_probs(model: Decoder, ids: torch.Tensor, labels: torch.Tensor, n_tokens: int, outputs: tuple[str, ...],
              grad: bool) -> tuple[list, torch.Tensor]:
    """``model(**inputs, labels=labels, fused_lm_head=True)``: backbone, then the fused head."""
    h = model.backbone(ids, checkpointing=None if grad else False)
    out = fused_head(model, h, labels, n_tokens, outputs)
    del h
    return out


# ---- DPO / IPO -----------------------------------------------------------------------------------------------

def make_dpo_batch(setup: TrainingSetup, model: Decoder, device: torch.device) -> dict[str, torch.Tensor]:
    """DataCollatorForPreference: chosen then rejected rows (2 x micro batch), prompt + completion long."""
    rows, s = 2 * setup.micro_batch, setup.seq_len
    with context.region(Kind.INPUTS):
        return {"input_ids": token_ids(rows, s, model, device),
                "attention_mask": torch.empty(rows, s, dtype=torch.long, device=device),
                "completion_mask": torch.empty(rows, s, dtype=torch.long, device=device)}


def dpo_loss(policy: Decoder, ref: Decoder | None, setup: TrainingSetup, batch: dict[str, torch.Tensor],
             mark: Callable[[Phase], None]) -> torch.Tensor:
    """DPOTrainer._compute_loss (loss_type sigmoid, or ipo)."""
    ids, cmask = batch["input_ids"], batch["completion_mask"]
    rows = ids.shape[0]
    b = rows // 2
    n_tokens = rows * setup.completion_tokens
    labels = _labels(ids, cmask)
    outputs, _policy_loss = log_probs(policy, ids, labels, n_tokens, DPO_OUTPUTS, grad=True)
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
                    ref_out, _ref_loss = log_probs(policy, ids, labels, n_tokens, DPO_OUTPUTS, grad=False)
            else:
                ref_out, _ref_loss = log_probs(ref, ids, labels, n_tokens, REF_OUTPUTS, grad=False)
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


# ---- KTO ------------------------------------------------------------------------------------------------------

KTO_OUTPUTS = ("log_probs", "entropy", "mean_logits")


def make_kto_batch(setup: TrainingSetup, model: Decoder, device: torch.device) -> dict[str, torch.Tensor]:
    """DataCollatorForUnpairedPreference: the completions, the mismatched KL completions (each row's
    completion cycled by one), and the desirable / undesirable labels; precomputed reference log-probs."""
    b, s = setup.micro_batch, setup.seq_len
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
    kl_labels = _labels(batch["KL_input_ids"], batch["KL_completion_mask"])
    with torch.no_grad():
        per_token = log_probs(model, batch["KL_input_ids"], kl_labels, n_tokens, outputs, grad=False)[0][0]
    return per_token.sum(-1)


def kto_loss(policy: Decoder, ref: Decoder | None, setup: TrainingSetup, batch: dict[str, torch.Tensor],
             mark: Callable[[Phase], None]) -> torch.Tensor:
    """KTOTrainer._compute_loss (loss_type kto, KL estimated): half the rows desirable (the labels decide
    which at run time; the split changes only vectors of the micro batch's size)."""
    ids, cmask = batch["input_ids"], batch["completion_mask"]
    b = ids.shape[0]
    n_tokens = b * setup.completion_tokens
    kl_logps = _kl_logps(policy, batch, n_tokens, KTO_OUTPUTS)
    labels = _labels(ids, cmask)
    outputs, _policy_loss = log_probs(policy, ids, labels, n_tokens, KTO_OUTPUTS, grad=True)
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
                    ref_out, _ref_loss = log_probs(policy, ids, labels, n_tokens, KTO_OUTPUTS, grad=False)
            else:
                ref_kl_logps = _kl_logps(ref, batch, n_tokens, REF_OUTPUTS)
                ref_out, _ref_loss = log_probs(ref, ids, labels, n_tokens, REF_OUTPUTS, grad=False)
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
    return losses.nanmean()


# ---- GRPO -----------------------------------------------------------------------------------------------------

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


def generate(policy: Decoder, setup: TrainingSetup, rows: int) -> dict[str, torch.Tensor]:
    """``model.generate`` of ``rows`` completions (sampling, temperature 1: no logits processor), as
    ``GenerationMixin._sample`` does it: prefill over the prompts with ``logits_to_keep=1``, then one token at a
    time with the cache; the last token's logits copied to fp32, softmax, multinomial, ids grown by cat."""
    p, c = setup.prompt_tokens, setup.completion_tokens
    dev = policy.embed.device
    with context.region(Kind.INPUTS):
        ids = token_ids(rows, p, policy, dev)
        attn = torch.ones(rows, p, dtype=torch.long, device=dev)
    caches = [GrowingCache() for _ in policy.layers]
    for layer, cache in zip(policy.layers, caches):
        layer.attn.kv = cache
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), no_autocast(policy):
            step_ids = ids
            start = 0
            next_logits = probs = None
            for _step in range(c):
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
        for layer in policy.layers:
            layer.attn.kv = None
        policy.train(was_training)
    del caches
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


def needs_old_logps(setup: TrainingSetup) -> bool:
    """_generate_and_score_completions: old-policy log-probs when generation and optimisation are misaligned,
    and always with vLLM (vllm_importance_sampling_correction, on by default)."""
    every = setup.generation_steps * setup.num_iterations
    return setup.grad_accum % every != 0 or setup.generation_backend is not GenerationBackend.TRANSFORMERS


# ---- ORPO / CPO / SimPO (trl.experimental, no reference) ---------------------------------------------------

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
    """``concatenated_inputs``: chosen then rejected rows (2 x micro batch) of ids, attention mask, labels."""
    rows, s = 2 * setup.micro_batch, setup.seq_len
    with context.region(Kind.INPUTS):
        return {"input_ids": token_ids(rows, s, model, device),
                "attention_mask": torch.ones(rows, s, dtype=torch.long, device=device),
                "labels": torch.empty(rows, s, dtype=torch.long, device=device)}


def pair_loss(policy: Decoder, setup: TrainingSetup, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """ORPOTrainer / CPOTrainer ``concatenated_forward`` and ``get_batch_loss_metrics``: the model's full
    logits, the chosen rows' cross entropy (``nn.CrossEntropyLoss`` on ``logits[..., :-1, :].contiguous()``, fp32
    under autocast), ``get_batch_logps`` (``selective_log_softmax``, averaged for ORPO and SimPO), the loss."""
    obj = setup.objective
    ids, attn, lab = batch["input_ids"], batch["attention_mask"], batch["labels"]
    b = ids.shape[0] // 2
    vocab = policy.plan.spec.vocab_size
    h = policy.backbone(ids)
    with context.region(Kind.LOGITS):
        logits = policy.lm_head(h)  # outputs.logits: the compute dtype (no labels, no upcast)
        del h
        cap = policy.plan.spec.final_logit_softcap
        if cap:  # Gemma 2's forward softcaps the logits it returns (each rebinding frees the previous tensor)
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        if obj is Objective.ORPO:  # over the full prompt and response
            labels = torch.where(attn == 1, ids.clone(), -100)
        else:
            labels = lab.clone()
        # ORPO's chosen NLL; CPO's with cpo_alpha != 0 (its default 1.0, kept: cpo_alpha 0 is not modelled)
        lg = logits[:b][..., :-1, :].contiguous()  # one row: already contiguous, no copy
        lb = labels[:b][..., 1:].contiguous()
        if policy.plan.autocast:  # cross_entropy is on autocast's fp32 list
            lg = lg.float()
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


# ---- the step loop ------------------------------------------------------------------------------------------

class ObjectiveStep:
    """One objective's micro-steps inside ``step.run_steps``: ``prepare`` once per optimizer step (GRPO's
    generation and scoring), ``loss`` per micro-batch."""

    def __init__(self, policy: Decoder, ref: Decoder | None, setup: TrainingSetup, device: torch.device) -> None:
        self.policy, self.ref, self.setup, self.device = policy, ref, setup, device
        self.buffer: dict[str, torch.Tensor] | None = None

    def prepare(self, mark: Callable[[Phase], None]) -> None:
        setup = self.setup
        if setup.objective is not Objective.GRPO:
            return
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
        if self.setup.objective is Objective.GRPO:
            b = self.setup.micro_batch
            return {k: v[i * b:(i + 1) * b] for k, v in self.buffer.items()}
        if self.setup.objective is Objective.KTO:
            return make_kto_batch(self.setup, self.policy, self.device)
        if self.setup.objective in NO_REFERENCE_OBJECTIVES:
            return make_pair_batch(self.setup, self.policy, self.device)
        return make_dpo_batch(self.setup, self.policy, self.device)

    def loss(self, batch: dict[str, torch.Tensor], mark: Callable[[Phase], None]) -> torch.Tensor:
        if self.setup.objective is Objective.GRPO:
            return grpo_loss(self.policy, self.setup, batch)
        if self.setup.objective is Objective.KTO:
            return kto_loss(self.policy, self.ref, self.setup, batch, mark)
        if self.setup.objective in NO_REFERENCE_OBJECTIVES:
            return pair_loss(self.policy, self.setup, batch)
        return dpo_loss(self.policy, self.ref, self.setup, batch, mark)


def build_reference(build: Callable[..., Decoder], spec, setup: TrainingSetup, device: torch.device,  # noqa: ANN001
                    real: bool) -> Decoder | None:
    """DPOTrainer / GRPOTrainer's ``ref_model``: the same architecture from the same checkpoint, frozen, in
    its own dtype (``model_init_kwargs`` dtype: the policy's unless set)."""
    if setup.reference_mode is not Reference.COPY:
        return None
    with context.region(Kind.REFERENCE):
        ref = build(spec, setup.reference_setup(), device=device, real=real)
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.eval()
    return ref
