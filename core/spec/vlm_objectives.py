"""Which training objectives a vision-language model's estimate models (``TrainingSetup.validate`` asks): TRL 1.16.0's
DPOTrainer and KTOTrainer run a VLM on its processor's batch (their vision collators call the processor on the
prompts with their images: DPO's repeats them for the rejected rows, KTO's KL rows share them) and
``add_fused_lm_head`` scores the completions after the model's own backbone (tower, projector, language model); the
hand-written families' steps replay that (``core/objectives/dpo/``, ``kto/``), held to transformers' classes under
fake tensors, and a traced family's trace records the same steps run on its own class. GRPOTrainer runs the
processor over the prompts and their images, generates with the pixel inputs in the prefill, and scores and trains
on prompt + completion with them (``core/objectives/grpo/``: the hand-written families' programs and a traced
family's class alike). What TRL cannot run on a VLM is refused with its reason; what is not modelled yet is refused
as such, never answered with a text model's number."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import Objective, Reference

if TYPE_CHECKING:
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

VLM_OBJECTIVES = (Objective.DPO, Objective.IPO, Objective.KTO, Objective.GRPO)
# trl.experimental's ORPOTrainer and CPOTrainer (CPO, SimPO) tokenize text and their concatenated_forward passes the
# model the ids and the attention mask only: a VLM's images never reach it
TEXT_ONLY_TRAINERS = (Objective.ORPO, Objective.CPO, Objective.SIMPO)


def vlm_objective(model: ModelSpec, setup: TrainingSetup) -> None:
    """Refuse a preference / RL objective that is not modelled on this vision-language model, with the reason."""
    name = setup.objective.value
    if setup.objective in TEXT_ONLY_TRAINERS:
        raise SetupError(f"--objective {name}: TRL 1.16's {'ORPO' if name == 'orpo' else 'CPO'}Trainer passes the "
                         "model token ids only (concatenated_forward): the images never reach a vision-language "
                         "model: use --objective dpo")
    if setup.objective not in VLM_OBJECTIVES:
        raise SetupError(f"{model.name} (a vision-language model): --objective {name} is not modelled on a "
                         "vision-language model yet (SFT, DPO, IPO, KTO and GRPO are): use --objective sft or dpo")
    refused = getattr(model.vision.rules, "GRPO_REFUSED" if setup.objective is Objective.GRPO  # what TRL cannot
                      else "PREFERENCE_REFUSED", None)  # run on the family
    if refused:
        raise SetupError(f"{model.name}: --objective {name}: {refused}: use --objective sft")
    if setup.frames and setup.objective is Objective.GRPO:  # _tokenize_prompts keeps a prompt's "image" parts only
        raise SetupError("--objective grpo: TRL 1.16's GRPOTrainer takes images, not video (_tokenize_prompts "
                         "passes a prompt's image parts to the processor, no videos): drop --frames")
    if setup.frames:  # DataCollatorForVisionPreference calls the processor with images= only
        raise SetupError(f"--objective {name}: TRL 1.16's {name.upper() if name == 'kto' else 'DPO'}Trainer "
                         "collates images, not video (its vision collator passes no videos to the processor): drop "
                         "--frames")
    if setup.grad_ckpt and not setup.vision_ckpt and setup.reference_mode is not Reference.PRECOMPUTED:
        # DPOTrainer wraps the reference forward in disable_gradient_checkpointing, whose exit turns checkpointing
        # on again on every module that supports it: the tower's too, from the first step on
        raise SetupError(f"--objective {name} with checkpointing: TRL's reference forward turns checkpointing off and "
                         "on again on every module, the vision tower's too: drop --no-vision-ckpt")
