"""Unsloth's kernels (``TrainingSetup.unsloth_kernels``), read from unsloth 2026.10.9's source: the fused LoRA
kernels ``FastLlamaModel.patch_peft_model`` (``unsloth/models/llama.py``) swaps in after peft's ``get_peft_model``
(``FastLanguageModel.get_peft_model``, LLaMA-Factory's ``use_unsloth``), and the cross-entropy its
``patch_loss_functions`` puts in transformers' loss's place.

* ``lora_mlp``: ``LoRA_MLP`` (``unsloth/kernels/fast_lora.py``) in place of the MLP's forward, where gate_proj,
  up_proj and down_proj all carry an adapter: the gate and up projections' outputs and the input are saved, the
  activation's output is not (backward recomputes it); SwiGLU for Llama / Mistral / Qwen 2 / Qwen 3, GeGLU (tanh)
  for Gemma 1 / 2, the same tensors;
* ``lora_qkv``: ``LoRA_QKV`` in place of the q, k and v projections, where all three carry an adapter and none a
  bias (Qwen 2's q / k / v have one: peft's own layers run there): the input saved once for the three;
* ``lora_o``: ``LoRA_W`` in place of o_proj;
* ``rms_norm``: ``Fast_RMS_Layernorm`` (``fast_rms_layernorm``, ``unsloth/kernels/rms_layernorm.py``) on every
  decoder norm and the final one, as FastLanguageModel's decoder layers call it: the input, the weight and an fp32
  statistic per row saved; backward writes the input's gradient into the incoming one (``reuse_grad``), into a new
  one for Gemma. With a frozen weight (LoRA) these are Liger's RMSNorm's tensors; a trained one (its
  weight-gradient partials, sized by the GPU's SMs) and Qwen 3's q / k norms (fused with RoPE on CUDA) are refused;
* ``rope``: ``fast_rope_embedding`` (``unsloth/kernels/rope_embedding.py``) as ``LlamaAttention_fast_forward`` calls
  it in training (no position ids from TRL's collator: ``Fast_RoPE_Embedding_QK_Positions``): q and k rotated in place
  (views of the projections' outputs), cos and sin kept on its ctx, nothing saved; backward writes each gradient
  into a fresh tensor, where transformers' RoPE makes new q and k and its products' gradients (core/simulation/
  unsloth_rope.py). Qwen 3's (fused with its q / k norms) is refused;
* ``fused_loss``: the loss FastLanguageModel's own forward computes in training (``CausalLM_fast_forward`` ->
  ``unsloth_fused_ce_loss`` -> unsloth_zoo's ``fused_linear_cross_entropy``): no logits, one chunk of rows at a
  time, the hidden states' gradient made in forward; its chunks depend on the GPU (core/spec/unsloth_loss.py);
* ``cross_entropy``: ``UnslothForCausalLMLoss`` (unsloth_zoo's ``patch_loss_functions``) in transformers'
  ``ForCausalLMLoss``'s place: ``Fast_CrossEntropyLoss`` (``unsloth/kernels/cross_entropy_loss.py``) on the logits
  in their own dtype, no fp32 upcast: FastLanguageModel's loss with ``UNSLOTH_RETURN_LOGITS=1`` (in fused_loss's
  place: "all,cross_entropy") and the loss of transformers' classes once unsloth is loaded.

Each LoRA kernel saves the adapters' weights and its input, never peft's fp32 copy of the input nor the low-rank
intermediates; its backward casts the adapters to the input's dtype and writes the input's gradient into the
saved input (``LoRA_MLP`` / ``LoRA_QKV``: ``inplace`` True). An NF4 base weight is dequantized into one scratch
buffer in forward (``use_global_buffer``) and into a fresh tensor in backward.

The families: ``FastLanguageModel.from_pretrained`` dispatches Llama, Mistral, Gemma 1 / 2, Qwen 2 and Qwen 3 to
its ``Fast*Model`` classes; every other type goes to ``FastModel``, which compiles transformers' own code and puts
none of the LoRA kernels in (refused here, with that reason). Not modelled, refused where they would run:
lora_dropout above 0 (the kernels' own dropout path, ``UNSLOTH_FUSED_LORA_DROPOUT``), an int8 base, LoRA-FA,
sharding. Unsloth falls back to peft's own layers (the option changes nothing) with DoRA or a float32 base.
* ``attention``: the attention kernel ``LlamaAttention_fast_forward`` runs (``run_attention``,
  ``unsloth/utils/attention_dispatch.py``): on unsloth's default install, which requires xformers and not
  flash-attn, ``select_attention_backend`` picks xformers' ``memory_efficient_attention`` (the training forward drops
  the padding mask), fed k and v expanded to every query head and reshaped (a copy, saved by the kernel) where
  grouped-query attention has more than one kv head; the kernel saves its output and an fp32 log-sum-exp, its
  backward makes dq, dk and dv of the expanded size, summed back by the expand's backward
  (core/simulation/unsloth_attention.py, docs/levels.md); its kernel is xformers' dispatch's (:func:`xformers_kernel`:
  torch's FlashAttention-2 from sm80), not SDPA's. Gemma 2's is its own softcapped torch attention, compiled
  (``slow_attention_softcapping``): what inductor's graph keeps and allocates, at a micro batch of one (above it
  named, not modelled: :func:`attention_note`); a sliding window (but Gemma 2's) or attention dropout refused. Its
  rotary module's cached cos / sin tables (up to 32,768 rows kept: 16 MiB on Llama-3.1-8B) are counted as
  transformers' per-step ones.

Its checkpointing is ``TrainingSetup.unsloth_gc`` (core/spec/unsloth_gc.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramlab.core.checks import SetupError, short_repr
from vramlab.core.sdpa import EFFICIENT, FLASH
from vramlab.core.spec.liger import LigerPatch
from vramlab.core.spec.model import ModelSpec, NormKind
from vramlab.core.spec.unsloth_gc import unsloth_gc_runs
from vramlab.core.spec.unsloth_loss import gpu_note, validate_fused_loss
from vramlab.core.versions import UNSLOTH_TRANSFORMERS, modelled_by, release_numbers

UNSLOTH_KERNELS = ("lora_mlp", "lora_qkv", "lora_o", "rms_norm", "rope", "attention", "cross_entropy", "fused_loss")
# what FastLanguageModel.get_peft_model installs
UNSLOTH_LORA = ("lora_mlp", "lora_qkv", "lora_o")
# "all": what FastLanguageModel runs of the kernels modelled (its fused LoRA kernels, its RMSNorm, its attention
# forward's RoPE and xformers' attention and its forward's fused loss; "all,cross_entropy": its loss with
# UNSLOTH_RETURN_LOGITS=1, Fast_CrossEntropyLoss on the logits)
UNSLOTH_DEFAULT = (*UNSLOTH_LORA, "rms_norm", "rope", "attention", "fused_loss")
UNSLOTH_VERSION = "2026.10.9"
# Fast_CrossEntropyLoss does a vocabulary over MAX_FUSED_SIZE (65536) a block at a time, of the size
# _chunked_forward_config gives the GPU: 65536 on the H100 modelled (compute capability 9.0 has no entry; A100 and
# T4 take 16384, B200 8192)
UNSLOTH_CE_BLOCK = 65536


@dataclass(frozen=True)
class UnslothPatch:
    """The kernels unsloth installs on one model (each layer alike)."""

    mlp: bool  # LoRA_MLP on every layer's MLP
    qkv: bool  # LoRA_QKV on every layer's q / k / v
    o: bool  # LoRA_W on every layer's o_proj
    cross_entropy: bool = False  # UnslothForCausalLMLoss in transformers' ForCausalLMLoss's place
    # Fast_RMS_Layernorm on every decoder norm and the final one: the tensors of Liger's RMSNorm with a frozen
    # weight (the input, the weight and an fp32 statistic per row saved; the input's gradient written into the
    # incoming one, into a new one for Gemma): its patch, or None
    rms_norm: LigerPatch | None = None
    # FastLanguageModel's forward's loss, unsloth_zoo's fused_linear_cross_entropy (core/spec/unsloth_loss.py)
    fused_loss: bool = False
    # fast_rope_embedding (Fast_RoPE_Embedding_QK_Positions) on every layer's q and k, in transformers' RoPE's place
    rope: bool = False
    # xformers' memory_efficient_attention as run_attention calls it, k and v repeated to every query head
    # (core/simulation/unsloth_attention.py)
    attention: bool = False
    # Gemma 2's instead: its compiled softcapped torch attention (slow_attention_softcapping), what the compiled
    # graph keeps (core/simulation/unsloth_attention.py softcap_attention)
    softcap: bool = False


def parse_unsloth_kernels(value: Any) -> tuple[str, ...]:
    """``unsloth_kernels`` as a setup holds it: some of :data:`UNSLOTH_KERNELS` in that order (a comma-separated
    string or a list; "all" for :data:`UNSLOTH_DEFAULT`, what FastLanguageModel runs; "none" for none)."""
    if isinstance(value, str):
        text = value.strip().lower()
        value = () if text in ("", "none") else [x.strip() for x in text.split(",") if x.strip()]
    if isinstance(value, (list, tuple)) and "all" in value:  # "all,cross_entropy": UNSLOTH_RETURN_LOGITS=1
        default = [x for x in UNSLOTH_DEFAULT if x != "fused_loss" or "cross_entropy" not in value]
        value = [*default, *(x for x in value if x != "all")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and x in UNSLOTH_KERNELS for x in value):
        raise SetupError(f"Unsloth kernels must be some of {', '.join(UNSLOTH_KERNELS)} (or all / none; got "
                         f"{short_repr(value)})")
    if "cross_entropy" in value and "fused_loss" in value:
        raise SetupError("Unsloth's fused loss (its forward's, the default) and its cross-entropy on the logits "
                         "(UNSLOTH_RETURN_LOGITS=1) are one loss or the other: choose one")
    return tuple(k for k in UNSLOTH_KERNELS if k in value)


def _fast_family(spec: ModelSpec) -> bool:
    """Llama, Mistral, Qwen 2 / 3 and Gemma 1 / 2, told apart by their features (Gemma 3: q / k norms under the
    sandwich norms; Phi-3: fused projections; MoE; LayerNorm or parallel blocks; learned positions)."""
    if spec.is_moe or spec.fused_qkv or spec.fused_gate_up or spec.parallel_block or spec.learned_positions:
        return False
    if spec.norm_kind is NormKind.LAYERNORM or spec.shared_expert_intermediate_size:
        return False
    return not (spec.gemma_norm and spec.qk_norm)


def _refuse_unmodelled(spec: ModelSpec, what: str, kernels: str, *, qk_norm: bool = False,
                       fast_model: str = "transformers' own code, compiled") -> None:
    """Refuses ``kernels`` (as --unsloth-kernels names them) where ``what`` does not run as modelled: a family
    FastLanguageModel loads through ``FastModel`` (``fast_model`` says what runs there) and, with ``qk_norm``, q / k
    norms (fused with RoPE on CUDA)."""
    if not _fast_family(spec):
        raise SetupError(f"{what} comes with Unsloth's Llama, Mistral, Qwen 2 / 3 and Gemma 1 / 2 classes; unsloth "
                         f"{UNSLOTH_VERSION} loads {spec.name} through FastModel ({fast_model}), which is not "
                         f"modelled: drop {kernels} from --unsloth-kernels")
    if qk_norm and spec.qk_norm:
        raise SetupError("Unsloth's q / k norms run fused with RoPE (fast_qk_norm_rope, on by default on CUDA), which "
                         f"is not modelled: drop {kernels} from --unsloth-kernels")


def unsloth_patch(spec: ModelSpec, setup: Any) -> UnslothPatch | None:
    """What unsloth 2026.10.9 installs for ``setup`` on ``spec`` of the kernels asked for; None where it installs
    none (no LoRA, DoRA, a float32 base: peft's own layers run). Refuses what it runs that is not modelled."""
    kernels = setup.unsloth_kernels
    if not kernels:
        return None
    if spec.vision is not None or spec.transformers_config:
        raise SetupError(f"Unsloth's kernels are modelled on the hand-written families' programs, not on "
                         f"{spec.name}'s traced class: drop --unsloth-kernels")
    ce = "cross_entropy" in kernels and _cross_entropy(setup)
    fused = "fused_loss" in kernels and _fused_loss(spec, setup)
    norm = _rms_norm(spec, setup) if "rms_norm" in kernels else None
    rope = "rope" in kernels and _rope(spec)
    attention = "attention" in kernels and _attention(spec, setup)
    # Gemma 2: not xformers (see _attention); its compiled graph for a batch of one (attention_note: above it, named)
    softcap = attention and bool(spec.attn_logit_softcap) and setup.micro_batch == 1
    mlp = qkv = o = False
    if any(k in UNSLOTH_LORA for k in kernels):
        _refuse_unmodelled(spec, "Unsloth's fused LoRA kernels", "lora_mlp, lora_qkv, lora_o")
        mlp, qkv, o = _lora_kernels(spec, setup)
    if not (mlp or qkv or o or ce or norm or fused or rope or attention):
        return None
    return UnslothPatch(mlp=mlp, qkv=qkv, o=o, cross_entropy=ce, rms_norm=norm, fused_loss=fused, rope=rope,
                        attention=attention and not spec.attn_logit_softcap, softcap=softcap)


def _attention(spec: ModelSpec, setup: Any) -> bool:
    """Unsloth's attention forward's kernel in a training step, refusing what it runs that is not modelled:
    xformers' ``memory_efficient_attention`` as ``run_attention`` calls it (no padding mask from TRL's collator;
    causal), or for Gemma 2, without flash-attn >= 2.6.3 (not in unsloth's install), ``slow_attention_softcapping``
    (``unsloth/kernels/flex_attention.py``: flex attention is off in 2026.10.9, ``HAS_FLEX_ATTENTION = False``),
    torch.compile'd; its masks (unsloth's static ones, a sliding window's band included) change no size."""
    _refuse_unmodelled(spec, "Unsloth's attention forward", "attention")
    if spec.attn_logit_softcap and setup.autocast:
        raise SetupError("Unsloth's Gemma 2 softcapped attention under autocast is not modelled: drop attention from "
                         "--unsloth-kernels or autocast")
    if spec.sdpa_mask(setup.seq_len) and not spec.attn_logit_softcap or spec.attention_dropout:
        raise SetupError("Unsloth's xformers attention with a sliding window or attention dropout is not modelled: "
                         "drop attention from --unsloth-kernels")
    if "rope" not in setup.unsloth_kernels:  # its forward hands xformers the kernel's rotated views of q and k
        raise SetupError("Unsloth's attention forward runs its RoPE kernel before xformers' attention: keep rope with "
                         "attention in --unsloth-kernels")
    if setup.attention.value != "sdpa":
        raise SetupError(f"--attention {setup.attention.value}: Unsloth's attention forward runs xformers' attention "
                         "(Gemma 2: its softcapped one) whatever transformers' attn_implementation says; drop "
                         "attention from --unsloth-kernels to model transformers' attention instead")
    # under autocast (HF Trainer's bf16 over LLaMA-Factory's fp32 adapters) q, k and v leave the projections in the
    # compute dtype, and xformers' op, which autocast does not list, takes them as they come: the same tensors
    return True


def _rope(spec: ModelSpec) -> bool:
    """``fast_rope_embedding`` as ``LlamaAttention_fast_forward`` calls it in training (TRL's collator gives no
    position ids: ``Fast_RoPE_Embedding_QK_Positions``), refusing what it runs that is not modelled."""
    _refuse_unmodelled(spec, "Unsloth's RoPE kernel", "rope", qk_norm=True)
    return True


def _fused_loss(spec: ModelSpec, setup: Any) -> bool:
    """Whether FastLanguageModel's forward computes its fused loss (an SFT step: labels given; TRL's objectives
    compute theirs), refusing what it runs that is not modelled."""
    if not _cross_entropy(setup, "Unsloth's fused loss"):
        return False
    _refuse_unmodelled(spec, "Unsloth's fused loss (FastLanguageModel's forward's)", "fused_loss",
                       fast_model="transformers' own code, its loss rewritten")
    validate_fused_loss(setup)
    return True


def _rms_norm(spec: ModelSpec, setup: Any) -> LigerPatch:
    """``fast_rms_layernorm`` as FastLanguageModel's decoder layers and model call it (``reuse_grad`` True but
    for Gemma; the weight frozen under LoRA)."""
    _refuse_unmodelled(spec, "Unsloth's RMSNorm", "rms_norm", qk_norm=True)
    if not setup.uses_lora:
        raise SetupError("Unsloth's RMSNorm with trained norm weights (its weight-gradient partials, sized by the "
                         "GPU's SMs) is not modelled: drop rms_norm from --unsloth-kernels")
    if setup.liger_kernels and "rms_norm" in setup.liger_kernels:
        raise SetupError("Unsloth's RMSNorm and Liger's both replace the norms: choose one")
    gemma = spec.gemma_norm
    return LigerPatch(rms_norm=True, gemma=gemma, in_place=not gemma, glu=False)


def _cross_entropy(setup: Any, name: str = "Unsloth's cross-entropy") -> bool:
    """Whether unsloth's loss runs (transformers' own loss is what it replaces: TRL's objectives compute theirs);
    refuses another loss asked for beside it."""
    if setup.objective.value != "sft":
        return False
    other = ("--loss-kernel " + setup.loss_kernel.value if setup.loss_kernel.value != "hf" else
             "--chunked-loss" if setup.chunked_loss else
             "Liger's cross-entropy" if "cross_entropy" in setup.liger_kernels else None)
    if other is not None:
        raise SetupError(f"{name} and {other} both replace transformers' loss: choose one")
    return True


def _lora_kernels(spec: ModelSpec, setup: Any) -> tuple[bool, bool, bool]:
    kernels = setup.unsloth_kernels
    w = setup.weight_dtype
    # patch_peft_model's float32_base ("the fused kernels assume 16-bit base weights"): peft's layers run
    if not setup.uses_lora or setup.use_dora or w.value == "fp32":
        return False, False, False
    if w.value == "int8":
        raise SetupError("Unsloth's fused LoRA kernels over an int8 base are not modelled: drop --unsloth-kernels")
    if w.is_float and setup.compute != w:
        raise SetupError(f"Unsloth loads and computes in one dtype ({w.value} weights, {setup.compute.value} "
                         "compute asked): set --compute to the weights' dtype")
    if setup.sharding.value != "none":
        raise SetupError("Unsloth's fused LoRA kernels under sharding are not modelled (unsloth declines them under "
                         "FSDP1, keeps them under FSDP2): drop --unsloth-kernels")
    if setup.lora_dropout > 0:
        raise SetupError("Unsloth's fused LoRA kernels with lora_dropout > 0 (their own dropout masks) are not "
                         "modelled: set --lora-dropout 0 or drop --unsloth-kernels")
    if setup.lora_fa:
        raise SetupError("Unsloth's fused LoRA kernels with LoRA-FA are not modelled: drop --unsloth-kernels")
    targets = set(spec.lora_modules(setup.lora_targets))
    mlp = "lora_mlp" in kernels and {"gate_proj", "up_proj", "down_proj"} <= targets and not spec.mlp_bias
    qkv = "lora_qkv" in kernels and {"q_proj", "k_proj", "v_proj"} <= targets and not spec.qkv_bias
    o = "lora_o" in kernels and "o_proj" in targets and not spec.o_bias
    return mlp, qkv, o


def unsloth_note(spec: ModelSpec, setup: Any) -> str | None:
    """A warning where ``--unsloth-kernels`` changes nothing (unsloth falls back to peft's own layers)."""
    patch = unsloth_patch(spec, setup)
    lora = [k for k in setup.unsloth_kernels if k in UNSLOTH_LORA]
    if lora and (patch is None or not (patch.mlp or patch.qkv or patch.o)):
        return (f"unsloth {UNSLOTH_VERSION} installs none of its fused LoRA kernels here (they need LoRA on all of "
                "q / k / v, on o_proj or on all of gate / up / down, without DoRA, a bias or a float32 base): "
                f"{', '.join(lora)} in --unsloth-kernels change nothing, as peft's own layers run")
    for kernel, flag, what in (("cross_entropy", "cross_entropy", "unsloth's cross-entropy (in transformers' loss's "
                                "place)"), ("fused_loss", "fused_loss", "unsloth's fused loss (its forward's)")):
        if kernel in setup.unsloth_kernels and (patch is None or not getattr(patch, flag)):
            return (f"--objective {setup.objective.value}: TRL computes its own loss, so {what} never runs")
    return None


def transformers_note(spec: ModelSpec, setup: Any, source: str) -> str | None:
    """Where an Unsloth kernel or its checkpointing runs and the transformers the result models (its ``source``:
    :func:`vramlab.core.versions.modelled_by`) is newer than unsloth supports: the run modelled is that release's
    classes with Unsloth's code, which unsloth itself would not install beside them."""
    kernels = unsloth_patch(spec, setup) is not None
    gc = unsloth_gc_runs(setup)
    version = modelled_by(source)[0].get("transformers", "")
    if not (kernels or gc) or not version or release_numbers(version) <= release_numbers(UNSLOTH_TRANSFORMERS):
        return None
    what = " and ".join(w for w, on in (("kernels", kernels), ("checkpointing", gc)) if on)
    return (f"transformers {version} is newer than unsloth {UNSLOTH_VERSION} supports (<= {UNSLOTH_TRANSFORMERS}, "
            f"its wheel's requirement): the run modelled is transformers {version}'s classes with Unsloth's {what}; "
            f"a run on transformers {UNSLOTH_TRANSFORMERS} may differ")


def xformers_runs(spec: ModelSpec, setup: Any) -> bool:
    """Whether the step runs xformers' ``memory_efficient_attention`` as Unsloth's attention forward calls it
    (``attention`` in its kernels, installed): its kernel is :func:`xformers_kernel`'s, not SDPA's."""
    if "attention" not in setup.unsloth_kernels:
        return False
    patch = unsloth_patch(spec, setup)
    return patch is not None and patch.attention


# xformers 0.0.35's flash.FwOp / flash.BwOp (xformers/ops/fmha/flash.py): CUDA_MINIMUM_COMPUTE_CAPABILITY
XFORMERS_FLASH_FROM = (8, 0)


def xformers_kernel(capability: tuple[int, int] | None) -> str:
    """The kernel xformers 0.0.35 dispatches Unsloth's training attention to on a GPU of ``capability`` (None: the
    H100 modelled by default). ``_dispatch_fw_priority_list`` / ``_dispatch_bw`` (``xformers/ops/fmha/dispatch.py``)
    try FA3 (``flash3``: only with the ``flash_attn_3`` package, not in unsloth's install), then ``flash`` (without
    the ``flash_attn`` package, torch's own FlashAttention-2, ``aten::_flash_attention_forward`` / ``_backward``:
    ``_USE_PT_FLASH_ATTN``; bf16 / fp16, head_dim <= 256, sm80 and up, LowerTriangularMask), then ``cutlass``."""
    if capability is None or tuple(capability) >= XFORMERS_FLASH_FROM:
        return FLASH
    return EFFICIENT


def attention_note(spec: ModelSpec, setup: Any, capability: tuple[int, int] | None = None) -> str | None:
    """What an Unsloth run's attention is, where FastLanguageModel's attention forward runs (its kernels asked for):
    modelled (``attention`` in its kernels), or named; ``capability``: the GPU's (None: the H100)."""
    if not set(setup.unsloth_kernels) - {"cross_entropy"}:  # its loss alone: transformers' classes, unsloth loaded
        return None
    if spec.attn_logit_softcap:  # Gemma 2 without flash-attn >= 2.6.3 (gemma2.py)
        what = (f"attention: unsloth {UNSLOTH_VERSION}'s Gemma 2 attention runs its own softcapped torch attention, "
                "torch.compile'd (slow_attention_softcapping: flash-attn is not in its default install)")
        if "attention" in setup.unsloth_kernels and setup.micro_batch == 1:
            return what + (" (modelled: inductor's buffers for it, bf16 scores and probabilities of heads x seq² "
                           "kept per layer; on CUDA its fusions may spare the fp32 scores of heads x seq² its forward "
                           "and backward make on the CPU)")
        why = ("its compiled graph for a micro batch above 1 (more copies) is not modelled" if "attention" in
               setup.unsloth_kernels else "attention not in --unsloth-kernels")
        return what + f"; not modelled ({why}): transformers' attention in its place"
    # its default install requires xformers, not flash-attn (select_attention_backend; the padding mask dropped in
    # training)
    what = (f"attention: unsloth {UNSLOTH_VERSION} runs xformers' memory_efficient_attention (its default install "
            "has no flash-attn), k and v repeated to every query head and saved")
    if "attention" in setup.unsloth_kernels and xformers_kernel(capability) == FLASH:
        return what + (" (modelled; it runs torch's FlashAttention-2, whose backward's fp32 dq accumulator is "
                       "counted in the reserved level; its forward's split-KV fp32 accumulators, made only where "
                       "batch x heads x seq / 64 is under 1.6 x the GPU's SMs, are not)")
    if "attention" in setup.unsloth_kernels:
        return what + (" (modelled: below compute capability 8.0 it runs xformers' cutlass kernel, whose backward "
                       "workspace, sized by the C++ kernel's workspace_size, is not counted)")
    return what + "; not modelled (attention not in --unsloth-kernels): torch's SDPA in its place"


def result_notes(spec: ModelSpec, setup: Any, source: str,
                 capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The notes an Unsloth run's result carries, the estimate's and the simulation's alike (``setup`` as
    :func:`vramlab.core.spec.unsloth_loss.with_gpu` filled it, ``source`` the result's): what its fused loss took of
    the GPU, what its attention is (``capability``: the GPU's, None for the H100) and a transformers newer than it
    supports."""
    notes = (gpu_note(setup), attention_note(spec, setup, capability), transformers_note(spec, setup, source))
    return tuple(n for n in notes if n is not None)
