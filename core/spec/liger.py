"""Liger Kernel's other kernels (``TrainingSetup.liger_kernels``): what liger-kernel 0.8.5's patch for a model's
family swaps in besides its loss (``apply_liger_kernel_to_<family>`` in ``liger_kernel/transformers/monkey_patch.py``,
which HF Trainer's ``use_liger_kernel``, LLaMA-Factory's ``enable_liger_kernel`` and axolotl's LigerPlugin call).

The families are told apart by the features of their :class:`ModelSpec`, as ``core/tracing/hfconfig.py`` tells
them apart for transformers' classes:

Its plain cross-entropy (off in every family's patch unless asked for) goes with the family's patch too.

* Llama, Mistral, Qwen 2, Qwen 3: ``LigerRMSNorm`` (casting mode "llama", offset 0, ``in_place`` True) on every
  RMSNorm (Qwen 3's q / k norms too) and ``LigerSwiGLUMLP``;
* Gemma 1: ``LigerRMSNormForGemma`` (casting mode "gemma", offset 1, ``in_place`` True) and ``LigerGEGLUMLP``;
* Gemma 2 and Gemma 3's text model: the Gemma norm with ``in_place`` False (their sandwich norms' residual needs the
  incoming gradient whole) on every norm (Gemma 3's q / k norms too) and ``LigerGEGLUMLP``;
* families liger-kernel 0.8.5 does not patch (LayerNorm or parallel blocks: Phi-1/2, GPT-2, StarCoder 2,
  StableLM; Qwen 2 MoE): nothing is swapped in (``_apply_liger_kernel_to_instance`` logs "no Liger kernels
  supported" and goes on), so the option changes nothing there;
* patched, not modelled yet (refused with that reason): Phi-3's fused ``LigerPhi3SwiGLUMLP``, the MoE experts'
  ``LigerExperts``, vision-language models' patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError, short_repr
from vramlab.core.spec.model import ModelSpec, NormKind

# the kernels modelled, by the name of liger's own switch: its RMSNorm, its SwiGLU / GeGLU MLP ("glu": swiglu=
# for the SwiGLU families, geglu= for Gemma's), its plain cross-entropy (transformers' loss with liger's
# cross_entropy in place of torch's, where its fused linear cross-entropy is off)
LIGER_KERNELS = ("rms_norm", "glu", "cross_entropy")
# "all": the ones every family's patch turns on by default (its cross-entropy is off unless asked for)
LIGER_DEFAULT = ("rms_norm", "glu")
# streaming multiprocessors of the GPU modelled (H100 SXM): LigerRMSNorm's backward gathers the weight's gradient in
# an fp32 (multi_processor_count, hidden) buffer (rms_norm_backward's _dW)
LIGER_SM_COUNT = 132


@dataclass(frozen=True)
class LigerPatch:
    """What liger-kernel 0.8.5's patch swaps in for one model, of the kernels asked for."""

    rms_norm: bool  # every RMSNorm is LigerRMSNormFunction's
    # Gemma's norm: casting mode "gemma" and offset 1 (its 1 + weight), else casting mode "llama" and offset 0; both
    # modes keep an fp32 RSTD per row, and the offset is an argument of the kernel: the same tensors
    gemma: bool
    in_place: bool  # backward writes the input's gradient into the incoming one (Gemma 2 / 3: a new zeros_like)
    glu: bool  # the MLP is LigerSiLUMulFunction's (SwiGLU) or LigerGELUMulFunction's (GeGLU): a and b saved
    cross_entropy: bool = False  # transformers' loss calls LigerCrossEntropyFunction in torch's cross_entropy's place


def parse_liger_kernels(value: Any) -> tuple[str, ...]:
    """``liger_kernels`` as a setup holds it: some of :data:`LIGER_KERNELS` in that order (a comma-separated
    string or a list, "all" standing for :data:`LIGER_DEFAULT`; "none")."""
    if isinstance(value, str):
        text = value.strip().lower()
        value = () if text in ("", "none") else [x.strip() for x in text.split(",") if x.strip()]
    if isinstance(value, (list, tuple)) and "all" in value:  # all,cross_entropy: the defaults and its cross-entropy
        value = [*LIGER_DEFAULT, *(x for x in value if x != "all")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and x in LIGER_KERNELS for x in value):
        raise SetupError(f"Liger kernels must be some of {', '.join(LIGER_KERNELS)} (or all / none; got "
                         f"{short_repr(value)})")
    return tuple(k for k in LIGER_KERNELS if k in value)


def liger_patch(spec: ModelSpec, kernels: tuple[str, ...]) -> LigerPatch | None:
    """The kernels of ``kernels`` that liger-kernel 0.8.5's patch for ``spec``'s family swaps in; None where it
    swaps in none of them. Refuses, with that reason, a patch it makes that is not modelled."""
    if not kernels:
        return None
    if spec.vision is not None:
        raise SetupError(f"Liger's kernels on a vision-language model ({spec.name}) are not modelled yet: drop "
                         "--liger-kernels")
    if spec.transformers_config:  # a family only the trace answers: which of its modules liger patches is unread
        raise SetupError(f"Liger's kernels are modelled on the hand-written families (Llama, Mistral, Qwen 2 / 3, "
                         f"Gemma 1 / 2 / 3), not on {spec.name}'s traced class: drop --liger-kernels")
    patched = not (spec.norm_kind is NormKind.LAYERNORM or spec.parallel_block or spec.learned_positions
                   or spec.shared_expert_intermediate_size)
    if not patched:
        return None
    glu = "glu" in kernels
    if glu and spec.is_moe:
        raise SetupError("Liger's SwiGLU kernel on MoE experts (LigerExperts) is not modelled yet: use "
                         "--liger-kernels rms_norm")
    if glu and spec.fused_gate_up:
        raise SetupError("Liger's SwiGLU kernel on a fused gate_up_proj (LigerPhi3SwiGLUMLP) is not modelled yet: "
                         "use --liger-kernels rms_norm")
    gemma = spec.gemma_norm
    return LigerPatch(rms_norm="rms_norm" in kernels, gemma=gemma, in_place=not (gemma and spec.norms_per_layer == 4),
                      glu=glu, cross_entropy="cross_entropy" in kernels)
