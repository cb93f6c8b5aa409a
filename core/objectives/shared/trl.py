"""What TRL 1.16.0 fixes that both sides of an objective read (its estimator program and its reference): the
fused LM head's tile sizes, the per-token outputs each trainer asks it for, and when GRPO scores the old policy.
Plain data (no torch, nothing of the estimator), so a reference never imports a program."""

from __future__ import annotations

from vramlab.core.spec.options import GenerationBackend
from vramlab.core.spec.training import TrainingSetup

TOKEN_CHUNK_SIZE = 4096  # trl/kernels/chunked_logprob.py
VOCAB_CHUNK_SIZE = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
# the per-token outputs each trainer asks add_fused_lm_head for (a ref_model gets the default, log_probs only)
REF_OUTPUTS = ("log_probs",)
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")  # SFTTrainer: its loss, and its entropy / accuracy metrics
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
KTO_OUTPUTS = ("log_probs", "entropy", "mean_logits")
GRPO_OUTPUTS = ("log_probs", "entropy")


def needs_old_logps(setup: TrainingSetup) -> bool:
    """GRPOTrainer ``_generate_and_score_completions``: old-policy log-probs when generation and optimisation are
    misaligned, and always with vLLM (vllm_importance_sampling_correction, on by default)."""
    every = setup.generation_steps * setup.num_iterations
    return setup.grad_accum % every != 0 or setup.generation_backend is not GenerationBackend.TRANSFORMERS


def generates_before(setup: TrainingSetup, i: int) -> bool:
    """Whether GRPOTrainer (TRL 1.16.0 ``_prepare_inputs``) generates before simulated micro-batch ``i`` of an
    optimizer step: it generates when its micro-step counter is a multiple of ``steps_per_generation x
    num_iterations``. The step runs micro-batch 0 (an optimizer step's first, where a generation falls in the
    steps that generate) and micro-batch 1 for every later one: that one generates, the earlier micro-batches'
    gradients alive, where some micro-step other than an optimizer step's first is such a multiple (the period not
    a multiple of the accumulation: ``steps_per_generation x num_iterations < gradient_accumulation_steps``, or
    misaligned)."""
    return i == 0 or (setup.generation_steps * setup.num_iterations) % setup.grad_accum != 0

