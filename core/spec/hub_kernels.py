"""transformers' Hub kernels (``TrainingSetup.hub_kernels``): what ``from_pretrained`` and ``train()`` swap in on
CUDA by default since transformers 5.25.0, read from its source (``modeling_utils.py`` ``set_use_kernels``,
``kernels_mode``, ``train``; ``integrations/hub_kernels.py`` ``_build_kernel_mapping``) and the kernels library
0.19.1 it requires (``kernelize``).

``from_pretrained`` defaults ``use_kernels`` to True (``USE_HUB_KERNELS=NO`` or ``use_kernels=False`` turn it off)
and kernelizes the model for the device its weights are on; the model's ``train()`` kernelizes it again in
``Mode.TRAINING`` for the device it is on then (HF Trainer and TRL call it on the GPU, so a model loaded on the CPU
is kernelized for CUDA when training starts). In training mode on CUDA the mapping puts, in place of the torch
forward of every module whose class is decorated ``use_kernel_forward_from_hub(name)``:

* "RMSNorm": kernels-community/liger-kernels' ``LigerRMSNorm`` layer, ``LigerRMSNormFunction`` with offset 0,
  casting mode "llama", ``in_place`` True: the same function as liger-kernel 0.8.5's ``LigerRMSNorm`` for the Llama
  family (core/spec/liger.py, core/simulation/liger.py), modelled here. The decorated classes are the RMSNorms of
  Llama, Mistral, Mixtral, Qwen 2 / 2-MoE / 3 / 3-MoE (their q / k norms too), Phi-3 and about 120 other families;
  Gemma's offset norms (``1 + weight``) are not decorated, nor any LayerNorm.
* "rotary_pos_emb": kernels-community/rotary (version 2)'s ``apply_rotary_transformers`` layer
  (``torch-ext/rotary/layers.py``), in place of the ``apply_rotary_pos_emb`` of every family that decorates it
  (``use_kernel_forward_from_hub("rotary_pos_emb")`` and ``use_kernelized_func`` on its attention: Llama,
  Mistral, Mixtral, Qwen 2 / 2-MoE / 3 / 3-MoE, Gemma 1 / 2 / 3, Phi-2 and about 100 others, Phi-3 not). It
  clones q and k and rotates the clones' halves in place with ``ops.apply_rotary`` (``torch_binding.cpp``: schema
  ``(..., Tensor! out1, Tensor! out2, bool conj) -> ()``, a CUDA kernel and no autograd kernel). The layer says
  nothing of ``has_backward``, so ``kernelize`` keeps it in training. torch 2.13's autograd fallback for such an
  op (``basicAutogradNotImplementedFallback``, mode "warn") records nothing for an op that returns nothing ("if
  the operator mutates any inputs in-place and does not return them as outputs, we are unable to lazily raise a
  warning"): the clones keep ``CloneBackward``, so the step allocates two clones where the torch path allocated
  its products and ``rotate_half``'s halves, saves nothing more, passes q's and k's gradients on unrotated (the
  gradients of q_proj's and k_proj's inputs and weights skip the rotation's transpose: silently wrong, said in
  the note), and backward allocates nothing there. The binding checks ``x1.dtype() == cos.dtype()``: a run whose
  q / k come out of autocast in another dtype than the rotary table (fp32 weights, bf16 autocast) fails at its
  first step (named in the note, its torch path counted).
* "mamba_split_conv1d_scan_combined": kernels-community/mamba-ssm's fused Mamba-2 mixer (mamba-ssm 2.3.2.post1's
  ``MambaSplitConv1dScanCombinedFn`` over causal-conv1d's conv), which the Mamba-2 mixers of Mamba-2, Bamba,
  GraniteMoeHybrid (Granite 4), Nemotron-H, Falcon-H1 and Zamba 2 call when ``self.training and cache is None``
  (the installed mamba-ssm package runs the same Function where the Hub kernels are off): modelled
  (core/simulation/mamba.py), its out projection inside the Function on ``out_proj.weight``, so a LoRA on
  ``out_proj`` is not applied and gets no gradient (``MAMBA2_OUT_PROJ``, named in the note).
* "chunk_gated_delta_rule" and "RMSNormGated": kernels-community/fla's layers, fla 0.6.0's
  ``ChunkGatedDeltaRuleFunction`` (Qwen3.5 / Qwen3-Next / OLMo-Hybrid linear attention) and
  ``LayerNormGatedFunction`` (``FusedRMSNormGated``: the gated norms of those families and of Kimi Linear,
  Bailing / GLM-5 hybrids), modelled on the traced classes (core/simulation/fla.py).
* "causal_conv1d_fn": kernels-community/mamba-ssm's, causal-conv1d 1.6.1's ``CausalConv1dFn`` (the depthwise conv of
  LFM2, Qwen3.5, Qwen3-Next, Kimi Linear, OLMo-Hybrid and of a Mamba-2 mixer off its fused path), modelled
  (core/simulation/causal_conv1d.py).
* fla's ``chunk_kda`` (Kimi's KDA) and mamba-ssm's other kernels (Mamba-1's ``mamba_inner_fn`` /
  ``selective_scan_fn``, the unfused ``mamba_chunk_scan_combined``): not modelled (``GAPS``, named in the note);
  without the kernel, transformers runs the installed fla / mamba-ssm package on CUDA, else its torch path, which
  is what the trace counts.
* the activation kernels: inference only.

A vision-language model is kernelized whole, as a text model is: the same mapping swaps every decorated module of
its tower, projector and language model. In transformers 5.25.0 the RMSNorms decorated there are the language
model's (as its text family's: Llama's, Qwen 2's, Mistral's... in LLaVA, InternVL, SmolVLM, Qwen2-VL, Qwen3-VL...)
and, where the tower is built of the same RMSNorm class, the tower's and projector's too (Qwen2.5-VL's blocks and
merger, GLM-4V's, Ovis 2's, Mistral 3's projector norm). The towers' LayerNorms are not decorated, and their
decorated activations (GELU, QuickGELU, SiLU) have inference kernels only, so training keeps their torch forward.
Llama 3.2 Vision's ``MllamaTextRMSNorm`` is not decorated, nor Gemma 3's or PaliGemma's offset norms.

On the CPU nothing is swapped in (the mapping has no CPU entry), which is why transformers' classes built here run
their torch forward unless told otherwise (core/tracing/hub_kernels.py).

An Unsloth run (``unsloth_kernels`` or ``unsloth_gc``) has none of them: unsloth 2026.10.9 requires transformers
<= 5.17.0 (its wheel's ``Requires-Dist``), whose ``from_pretrained`` does not kernelize unless asked, and
FastLanguageModel's decoder forward calls its own RMSNorm kernel, not the module's forward (:func:`runs`).
"""

from __future__ import annotations

import dataclasses
import json

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import MAMBA2_FAMILIES
from vramlab.core.spec.liger import LigerPatch, liger_patch
from vramlab.core.spec.model import ModelSpec, NormKind
from vramlab.core.spec.unsloth import UNSLOTH_VERSION
from vramlab.core.versions import UNSLOTH_TRANSFORMERS, release_numbers

# the first transformers release whose from_pretrained turns the Hub kernels on by default (5.24.0: use_kernels
# False unless asked for, kernels an optional extra)
SINCE = "5.25.0"
# what the Hub kernels swap in that is not modelled: counted as the torch path
GAPS = ("fla's chunk_kda (Kimi Linear) and mamba-ssm's mamba_chunk_scan_combined / selective_scan_fn / "
        "mamba_inner_fn (Mamba, FalconMamba, Jamba, Zamba; the Mamba-2 mixers outside training or with a cache) are "
        "counted as their torch path")
# what the note says of kernels-community/fla's layers on a traced class (core/simulation/fla.py)
FLA = ("fla 0.6.0's chunk_gated_delta_rule and FusedRMSNormGated (kernels-community/fla) and causal-conv1d's conv run "
       "in its gated-delta-rule layers (Qwen3.5, Qwen3-Next, OLMo-Hybrid...; packed sequences count the torch path)")
# the layer names of GAPS (transformers 5.25.0's mapping, Mode.TRAINING on CUDA) a training step calls
UNMODELLED = frozenset({"chunk_kda", "mamba_chunk_scan_combined", "selective_scan_fn", "mamba_inner_fn"})
# mamba-ssm's fused Mamba-2 mixer (conv, chunked scan, gated RMSNorm and out projection in one autograd Function),
# which the Mamba-2 mixers of Mamba-2, Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1 and Zamba 2 call in training
# without a cache: modelled (core/simulation/mamba.py)
MAMBA2_FUSED = "mamba_split_conv1d_scan_combined"
# what the note says where peft wraps a Mamba-2 mixer's out_proj: the fused Function multiplies by out_proj.weight
MAMBA2_OUT_PROJ = ("mamba-ssm's fused Mamba-2 mixer multiplies by out_proj.weight, the base layer's (peft's "
                   "BaseTunerLayer.weight): the LoRA on out_proj is not applied and gets no gradient; "
                   "--no-hub-kernels without mamba-ssm installed trains it (the torch path)")
# a bitsandbytes-quantized out_proj under the fused Mamba-2 mixer: F.linear gets the stored codes
QUANTIZED_OUT_PROJ = ("mamba-ssm's fused Mamba-2 mixer (the Hub kernels' mamba_split_conv1d_scan_combined, what "
                      "transformers runs in training on CUDA) multiplies by out_proj.weight with F.linear: a "
                      "bitsandbytes-quantized out_proj hands it its stored codes, which F.linear cannot multiply "
                      "(4-bit: their packed shape; 8-bit: int8 beside the activations' float without autocast), "
                      "so the run fails at its first step; keep out_proj unquantized (llm_int8_skip_modules) or "
                      "use --no-hub-kernels without mamba-ssm installed (the torch path)")
# kernels-community/liger-kernels (version 4)'s LigerRMSNorm: LigerRMSNormFunction(x, w, eps, 0, "llama", True)
HUB_RMS_NORM = LigerPatch(rms_norm=True, gemma=False, in_place=True, glu=False)
LAYER = "RMSNorm"  # the name the decorated norms carry (use_kernel_forward_from_hub("RMSNorm"))
ROPE = "rotary_pos_emb"  # the name the decorated apply_rotary_pos_emb functions carry
ROPE_DTYPE = ("under autocast over weights of another dtype, kernels-community/rotary's dtype check (x1.dtype() == "
              "cos.dtype(), torch_binding.cpp) fails the run at its first step: its torch path is counted")
# what the note says of the Hub's RoPE kernel (kernels-community/rotary): what a run with it trains
ROPE_GRADIENT = ("kernels-community/rotary's RoPE rotates clones of q and k in place with an op that has no "
                 "autograd kernel: their gradients pass on unrotated (q_proj / k_proj train on wrong gradients, "
                 "no warning)")


def hub_norms(spec: ModelSpec) -> bool:
    """Whether a hand-written family's RMSNorm class is decorated ``use_kernel_forward_from_hub("RMSNorm")`` in
    transformers 5.25.0: every RMSNorm but Gemma's (tests/test_hub_kernels.py holds this to the classes). A
    vision-language family's classes say it in its ``vision`` piece (``HUB_NORMS``: which of its RMSNorms, "" for
    none; tests/test_hub_kernels_vlm.py); a traced one's class decides (the trace swaps what is decorated)."""
    if spec.norm_kind is not NormKind.RMSNORM or spec.gemma_norm:
        return False
    rules = spec.vision.rules if spec.vision is not None else None
    return rules is None or bool(rules.HUB_NORMS)




def hub_rope(spec: ModelSpec) -> bool:
    """Whether a hand-written family's program runs the Hub's RoPE kernel (``ROPE``): a text family with a
    rotary table whose ``apply_rotary_pos_emb`` rotates whole heads (Llama, Mistral, Mixtral, Qwen 2 / 3 and their
    MoEs, Gemma 1 / 2 / 3; Phi-1.5 / Phi-2 on the rotary slices their attention concatenates back: all decorated,
    tests/test_hub_rope.py holds this to the classes). Pythia's GPT-NeoX, StableLM and Phi-3 are not decorated. A
    vision-language family's language model is counted as the torch path (named in the note)."""
    # the layer-normed hand-written families are GPT-NeoX's (Pythia) and StableLM's (not decorated), GPT-2's (no
    # rotary table) and Phi's (phi-1.5, phi-2: a parallel block rotating both slices before it concatenates them)
    phi = spec.rope_parts_kept and spec.parallel_block
    return (spec.vision is None and not spec.learned_positions
            and (phi or spec.norm_kind is NormKind.RMSNORM and not spec.rope_pass_cat))


def rope_fails(setup: object) -> bool:
    """Whether q and k leave autocast in another dtype than the rotary table (the embeddings' output, in the
    weights' dtype): kernels-community/rotary's binding checks ``x1.dtype() == cos.dtype()``, so such a run fails
    at its first step. The programs follow the dtypes they meet (the kernel where they agree, else the torch path);
    the note says so (``ROPE_DTYPE``)."""
    w = getattr(setup, "weight_dtype", None)
    return bool(getattr(setup, "autocast", False)) and getattr(w, "is_float", False) and w != setup.compute


def _unsloth_run(setup: object) -> bool:
    # unsloth_gc asks for Unsloth only with checkpointing (without it the CLI says the flag is ignored)
    return bool(getattr(setup, "unsloth_kernels", ())) or bool(getattr(setup, "unsloth_gc", False)
                                                               and getattr(setup, "grad_ckpt", False))


def runs(setup: object) -> bool:
    """Whether the Hub kernels are in the run: asked for (the default), and not an Unsloth run (whose transformers
    is at most 5.17.0, before the default)."""
    return bool(getattr(setup, "hub_kernels", False)) and not _unsloth_run(setup)


def rope_runs(spec: ModelSpec, setup: object) -> bool:
    """Whether the hand-written program rotates q and k with the Hub's RoPE kernel: the Hub kernels in the run,
    a decorated RoPE (:func:`hub_rope`), and not liger's RoPE (its patch rebinds the modeling module's
    ``apply_rotary_pos_emb``, so the decorated function the kernel replaces is never called)."""
    if not runs(setup) or not hub_rope(spec):
        return False
    patch = liger_patch(spec, getattr(setup, "liger_kernels", ()))
    return patch is None or not patch.rope


def kernel_patch(spec: ModelSpec, setup: object) -> LigerPatch | None:
    """The kernels the step runs in place of transformers' torch norms and MLPs: liger's patch for the family
    (``--liger-kernels``) and the Hub's RMSNorm (``hub_kernels``). Where both swap a norm, the Hub's is the one
    that runs (kernelized at ``train()``, after liger's patch): the same function in the Llama casting mode."""
    patch = liger_patch(spec, getattr(setup, "liger_kernels", ()))
    if patch is not None and patch.glu and spec.is_moe:  # LigerExperts: transformers' fused experts (the trace)
        raise SetupError("liger's SwiGLU on a mixture of experts (LigerExperts: LigerFusedMoEFunction on "
                         "transformers 5's fused expert tensors) is estimated from a trace of transformers' own "
                         "classes, not the hand-written program: use --source auto (an SFT recipe) with torch, "
                         "transformers and peft installed (pip install 'vramlab[hf]'), or drop glu from "
                         "--liger-kernels")
    if not runs(setup) or not hub_norms(spec):
        return patch
    return HUB_RMS_NORM if patch is None else dataclasses.replace(patch, rms_norm=True, in_place=True)


def note(spec: ModelSpec, setup: object, lora_modules: tuple[str, ...] | list[str] = ()) -> str:
    """What the estimate says of the Hub kernels for ``spec`` (empty where they are off); ``lora_modules``: the
    module names peft wrapped (a traced tape's)."""
    if not getattr(setup, "hub_kernels", False):
        return ""
    if not runs(setup):
        return (f"Hub kernels off in an Unsloth run: unsloth {UNSLOTH_VERSION} requires transformers <= "
                f"{UNSLOTH_TRANSFORMERS}, whose from_pretrained does not kernelize by default")
    rules = spec.vision.rules if spec.vision is not None else None
    which = ("the RMSNorms it decorates" if spec.transformers_config else "" if not hub_norms(spec)
             else rules.HUB_NORMS if rules is not None else "its RMSNorms")
    norms = f"{which} run liger's LigerRMSNorm (kernels-community/liger-kernels); " if which else ""
    traced = bool(spec.transformers_config)
    rope = (f"{ROPE_DTYPE}; " if (traced or rope_runs(spec, setup)) and rope_fails(setup) else
            f"{ROPE_GRADIENT}; " if traced or rope_runs(spec, setup) else
            "its language model's RoPE, where decorated, is counted as the torch path here; "
            if runs(setup) and spec.vision is not None else "")
    gaps = f"where its class has them, {FLA}; {GAPS}; " if traced else ""
    mamba2 = traced and runs(setup) and json.loads(spec.transformers_config).get("model_type") in MAMBA2_FAMILIES
    gaps += (f"its Mamba-2 mixers run mamba-ssm's fused {MAMBA2_FUSED} (conv, scan, gated norm and out projection "
             "in one Function); " if mamba2 else "")
    gaps += f"{MAMBA2_OUT_PROJ}; " if mamba2 and "out_proj" in lora_modules else ""
    return (f"Hub kernels (transformers >= {SINCE} kernelizes the model for CUDA at train()): {norms}{rope}{gaps}"
            "off with --no-hub-kernels (use_kernels=False)")


def default_on(transformers_version: str) -> bool:
    """Whether ``from_pretrained`` kernelizes by default in this transformers release (``SINCE`` on; a dev or
    release-candidate build of 5.25.0 counts as 5.25.0)."""
    return bool(transformers_version) and release_numbers(transformers_version) >= release_numbers(SINCE)
