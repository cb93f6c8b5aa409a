"""The setup panel's controls and texts: the factories of its combo boxes and spin boxes, and what each control
says (tooltips, labels). Shared by the panel's sections (:mod:`.setup_panel`, :mod:`.setup_objective`)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.core.spec.options import Objective

TIPS = {
    "model": "The model to train: a preset from the catalogue (type to search), a Hugging Face Hub id "
             "(org/name or org/name@revision: its config.json and safetensors headers are fetched, never the "
             "weights; ids in the local cache need no network), or open a config.json or a local model folder "
             "(safetensors headers give exact dtypes and counts).",
    "preset": "A named bundle of method and precision settings. The settings it fills in stay visible and "
              "editable below; after an edit this shows “Custom”.",
    "method": "Full: train every weight. LoRA: train small adapters on a frozen base. QLoRA: LoRA on a "
              "4-bit (or 8-bit) quantized base. Freeze: train only the last N layers.",
    "weights": "Storage dtype of the base weights: fp32 (4 bytes per parameter), bf16/fp16 (2), int8 (1 plus "
               "row scales) or nf4 (0.5 plus block scales; QLoRA only).",
    "compute": "The dtype matmuls run in. With fp32 weights and bf16 compute, torch autocast (AMP) casts "
               "each weight per forward and keeps the copy for backward.",
    "amp": "Autocast (torch AMP). Auto: on exactly when the weights are wider than the compute dtype. On with "
           "16-bit weights is HF Trainer's bf16=True: fp32 LoRA adapters then run (and save inputs) in bf16.",
    "master_weights": "Keep an fp32 master copy of 16-bit trainable weights in the optimizer "
                      "(DeepSpeed / Megatron mixed precision): +4 bytes per trainable parameter, fp32 states.",
    "trainable_fp32": "The parameters that train upcast to fp32, the frozen ones left in the weight dtype, under "
                      "autocast: LLaMA-Factory's default for full and freeze runs (unless pure_bf16 or ZeRO-3).",
    "double_quant": "NF4 only: quantize the block scales too (QLoRA's default), saving about 0.37 bits per "
                    "parameter.",
    "adapter_dtype": "dtype of the LoRA A/B matrices, their gradients and optimizer states. peft keeps them in "
                     "fp32 by default, which also makes adapted layers save fp32 copies of their inputs.",
    "trainable_layers": "Freeze: train only the last N transformer layers (and the final norm); the rest is "
                        "frozen.",
    "optimizer": "AdamW keeps two states per trainable parameter; 8-bit AdamW (bitsandbytes) keeps them in "
                 "1 byte each; SGD keeps none (momentum: one); Adafactor factorises them; Lion keeps one.",
    "optimizer_impl": "torch's implementation: foreach (default on CUDA) makes temporaries the size of all "
                      "parameters in the step; fused makes none; single-tensor needs one tensor's worth. "
                      "8-bit optimizers use bitsandbytes' kernels.",
    "optimizer_in_backward": "Step each parameter as soon as its gradient is ready and free the gradient "
                             "(no gradient accumulation; single GPU).",
    "lora_rank": "LoRA rank r: each adapted d_out × d_in layer gains r × (d_in + d_out) parameters.",
    "lora_alpha": "LoRA scaling alpha (alpha / r multiplies the update). Does not change memory; "
                  "auto = 2 × rank.",
    "lora_dropout": "Dropout on the adapter input. Above 0 every adapted layer keeps a dropped copy of its "
                    "input for backward.",
    "lora_targets": "Which linear layers get adapters (Hugging Face module names). lm_head adapts the output "
                    "layer, whose input is large for big vocabularies.",
    "micro_batch": "Sequences per forward/backward on each GPU (per_device_train_batch_size).",
    "seq_len": "Tokens per sequence. Activations and the loss grow with batch × sequence (eager attention: "
               "with its square).",
    "grad_accum": "Micro-batches per optimizer step. Gradients stay alive between micro-batches; activation "
                  "memory does not grow.",
    "grad_ckpt": "Gradient (activation) checkpointing: keep only each layer's input and recompute the rest "
                 "in backward (about a third more compute).",
    "ckpt_offload": "With gradient checkpointing, each checkpointed layer's input kept in host memory and copied "
                    "back for its backward (LLaMA-Factory's use_unsloth_gc, axolotl's CPU-offloaded checkpointer).",
    "unsloth_gc": "With gradient checkpointing, Unsloth's own (use_gradient_checkpointing=\"unsloth\", its default "
                  "and LLaMA-Factory's use_unsloth; unsloth_zoo 2026.10.9): each layer input over 2 MiB kept in host "
                  "memory, the last layer's on the GPU, and two staging buffers of one layer input on the GPU that "
                  "the inputs come back into. Below 512 tokens Unsloth checkpoints as usual.",
    "offload_activations": "Activation offloading: saved tensors of 1 KiB and more go to host memory in forward and "
                           "come back in backward; the output head's and the last few of the forward stay on the "
                           "GPU. TRL: trl 1.16.0's activation_offloading; axolotl: axolotl 0.19.0's on a LoRA run "
                           "(the weights' transposes offloaded too). Estimated from a trace of transformers' classes "
                           "at these sizes (seconds).",
    "attention": "sdpa: torch scaled_dot_product_attention (flash / memory-efficient kernels) saves only the "
                 "output and an fp32 log-sum-exp. eager: materialises heads × seq × seq scores per layer.",
    "chunked_loss": "Compute lm_head and the loss in chunks, recomputed in backward, so the fp32 logits of the "
                    "whole batch never exist at once.",
    "loss_chunks": "Number of chunks for the chunked loss (2-64).",
    "loss_kernel": "The kernel that turns the last hidden states into the loss, as the training framework patches "
                   "it in. Each entry's own tip says what it keeps alive.",
    "loss_fp32": "fp32: transformers upcasts the logits to fp32 for the cross entropy (batch × sequence × "
                 "vocabulary × 4 bytes, and its gradient). Compute dtype: the cross entropy on the logits as the "
                 "matmul made them, as LitGPT and torchtune run it (the CLI's --loss-bf16).",
    "unsloth_kernels": "Unsloth's kernels, from unsloth 2026.10.9's source. “all” is FastLanguageModel's run (its "
                       "default, LLaMA-Factory's use_unsloth): its fused LoRA kernels (on Llama, Mistral, Qwen 2 / 3 "
                       "and Gemma 1 / 2 with LoRA on every projection of the block) keep each block's input (the MLP "
                       "its gate and up outputs too), not peft's fp32 input copies; its RMSNorm keeps its input and an "
                       "fp32 statistic per row; its RoPE rotates q and k in place; its forward's fused loss "
                       "(unsloth_zoo 2026.10.9) never makes the "
                       "logits: chunks of rows sized by the GPU's free memory, the hidden states' gradient made in "
                       "forward. “CE on the logits”: UNSLOTH_RETURN_LOGITS=1, its cross-entropy on the logits in "
                       "their own dtype (no fp32 upcast) in the fused loss's place. Another set (the CLI's "
                       "--unsloth-kernels, a saved scenario) is shown as it is, as one more item.",
    "unsloth_free_memory": "Unsloth's fused loss sizes its chunks of rows from half the GPU's free memory when "
                           "it first runs (torch.cuda.mem_get_info), capped at 2 GiB: below 4 GiB free its chunks "
                           "shrink. auto: the GPU chosen, with at least 4 GiB free (a warning says when the run "
                           "leaves less); give the free memory you see there to model it. Only where the fused loss "
                           "runs (fused loss in the kernels, an SFT step).",
    "liger_kernels": "Liger Kernel's layer kernels, as liger-kernel 0.8.5's patch swaps them in for the model's "
                     "family (HF Trainer's use_liger_kernel, LLaMA-Factory's enable_liger_kernel, axolotl's "
                     "LigerPlugin; “all (default)” is what they turn on): RMSNorm keeps the input and an fp32 "
                     "statistic per row; GLU, its SwiGLU / GeGLU MLP, keeps the two projections and recomputes the "
                     "activation in backward; CE, its cross-entropy, replaces torch's under transformers' loss; "
                     "LayerNorm, a vision tower's (Gemma 3, PaliGemma, Llama 3.2 Vision); RoPE rotates q and k in "
                     "place. Its fused loss is the Loss kernel's “Liger fused CE”.",
    "hub_kernels": "transformers 5.25 and later load a model with use_kernels on: when training starts on the GPU "
                   "its RMSNorms run liger's kernel from the Hub (kernels-community/liger-kernels), which keeps the "
                   "input and an fp32 statistic per row. Off: use_kernels=False or USE_HUB_KERNELS=NO (and "
                   "transformers 5.24 or older, axolotl 0.19, LLaMA-Factory 0.9.5).",
    "use_dora": "peft's DoRA (use_dora): a trainable magnitude vector per adapted layer; each forward also makes "
                "the adapter's full weight and the base weight's norm. Modelled on a float base on one GPU.",
    "use_rslora": "peft's rsLoRA (use_rslora): the update is scaled by alpha / √rank instead of alpha / rank. No "
                  "tensor changes size, so memory is the same.",
    "lora_fa": "LoRA-FA (peft's create_lorafa_optimizer): every lora_A frozen, each lora_B stepped by peft's "
               "LoraFAOptimizer (AdamW with B's gradient projected). No gradients or optimizer states for A; one "
               "GPU, peft's own optimizer.",
    "gpu": "The GPU to fit: detected GPUs first (via NVML, without creating a CUDA context), then the "
           "catalogue. Its memory is drawn as a line; the verdict uses the device level.",
    "gpus": "Data-parallel GPUs. Every number in the chart is per GPU.",
    "sharding": "ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 / FSDP also parameters, "
                "across the GPUs.",
    "offload": "DeepSpeed / FSDP CPU offload: optimizer states (ZeRO-2/3) or parameters too (ZeRO-3 / FSDP) "
               "live in host memory.",
}

TIPS.update({
    "objective": "What the step optimises, as TRL 1.16.0 runs it. SFT: next-token loss. DPO / IPO: chosen and "
                 "rejected completions in one concatenated forward (twice the micro batch) plus a reference "
                 "forward under no_grad. GRPO: completions generated first (KV cache), then the policy step over "
                 "prompt + completion. KTO: unpaired completions plus mismatched KL completions, both forwarded by the "
                 "policy and the reference. ORPO / SimPO / CPO (TRL's trl.experimental trainers): no reference, "
                 "chosen and rejected in one forward with their full logits over the vocabulary, plus an NLL term on "
                 "the chosen rows.",
    "reference": "Where the reference log-probabilities come from: a second frozen copy of the model, the policy "
                 "with its LoRA adapters disabled (no second copy: TRL's default with peft), or precomputed "
                 "before training (nothing on the GPU during the step).",
    "reference_dtype": "The reference copy's weight dtype (TRL loads it like the policy unless told otherwise).",
    "completion_len": "Completion tokens (GRPO's max_completion_length; for DPO the completion part of the "
                      "sequence). The prompt is the sequence length minus this. Auto: 256 for GRPO, half the "
                      "sequence for DPO.",
    "num_generations": "GRPO: completions per prompt. They must divide the generation batch (micro batch × "
                       "steps per generation × GPUs); per-GPU memory follows the micro batch.",
    "generation_backend": "GRPO: transformers.generate on the training GPU (a KV cache for every sequence), vLLM "
                          "colocated (its memory share of the GPU beside training), or a vLLM server on other GPUs.",
    "vllm_memory_fraction": "vLLM's gpu_memory_utilization: the share of the whole GPU it takes (weights, "
                            "activations and KV cache) — on the device level.",
    "vllm_sleep": "vllm_enable_sleep_mode: vLLM releases its share between generations, so it adds to the "
                  "training step only while it generates.",
    "beta": "KL coefficient. Auto: 0.1 for DPO; 0 for GRPO, which then loads no reference model. ORPO: the "
            "odds-ratio weight (lambda); SimPO / CPO: the preference loss's temperature (memory does not depend "
            "on it there).",
    "num_iterations": "GRPO: passes over each generated batch; above 1 the old policy's log-probabilities are "
                      "computed after generation.",
})
# The loss kernels' names and tips by the enum's value: the combo lists every LossKernel member, and one this table
# does not know yet is shown by its value (the CLI's --loss-kernel word); a label fits the panel's narrowest combo
LOSS_KERNEL_TEXTS: dict[str, tuple[str, str]] = {
    "hf": ("transformers' loss",
           "lm_head makes the whole logits and transformers' ForCausalLMLoss takes the cross entropy (upcast to "
           "fp32 unless “Loss logits” says otherwise); “Chunked loss” computes both a chunk at a time."),
    "cce": ("Cut Cross Entropy",
            "Cut Cross Entropy (axolotl's cut_cross_entropy: true): the loss straight from the hidden states and "
            "lm_head's weight, never the logits; an fp32 log-sum-exp per token. Needs bf16 or fp16 hidden states; "
            "it replaces the chunked loss."),
    "trl": ("TRL fused LM head",
            "TRL's SFTTrainer (TRL 1.16): lm_head and the loss in tiles of 4096 tokens x 32768 vocabulary entries, "
            "never the whole logits; fp32 statistics and fp32 gradient accumulators. What a TRL SFT config reads "
            "as."),
    "liger": ("Liger fused CE",
              "Liger Kernel's fused linear cross entropy: lm_head and the loss in chunks, the gradient computed in "
              "the forward; never the whole logits."),
}


KERNEL_NAMES = {"rms_norm": "RMSNorm", "glu": "GLU", "cross_entropy": "CE", "layer_norm": "LayerNorm",
                "fused_loss": "fused loss", "rope": "RoPE", "attention": "Attn", "lora_mlp": "MLP", "lora_qkv": "QKV",
                "lora_o": "O"}  # the tip says each
COMPACT = {"RMSNorm": "RMS", "LayerNorm": "LN", "fused loss": "fused"}  # the last resort of a long set's label
KERNEL_GROUPS = {("lora_mlp", "lora_qkv", "lora_o"): "LoRA"}  # Unsloth's three LoRA kernels, one word together
MAX_LABEL = 19  # characters a kernels combo shows at the panel's width (tests/gui/test_unsloth_controls.py)
DEFAULT_PROPERTY = "kernels_default"  # a kernels combo's library default (kernel_combo)
EXTRA_ROLE = QtCore.Qt.ItemDataRole.UserRole + 1  # marks the item of a set the list does not offer (select_data)


def _kernel_words(kernels: list[str]) -> list[str]:
    rest, words = list(kernels), []
    for group, word in KERNEL_GROUPS.items():
        if set(group) <= set(rest):
            rest = [k for k in rest if k not in group]
            words.append(word)
    return words + [KERNEL_NAMES.get(k, k) for k in rest]


def kernel_set_label(kernels: tuple[str, ...], default: tuple[str, ...] = ()) -> str:
    """A set of layer kernels in a few words (the combo shows about 24 characters at the panel's narrowest): "off";
    "all (default)" for the library's default (the CLI's word "all"), "all + CE" for more, "all but O, RoPE" for
    less; else the kernels' short names, those names without spaces, or shorter ones ("RMS"): the first form that
    fits, else the shortest (the item's tip lists the kernels)."""
    if not kernels:
        return "off"
    missing = [k for k in default if k not in kernels]
    extra = [k for k in kernels if k not in default]
    if default and not missing and not extra:
        return "all (default)"
    plain = _kernel_words(list(kernels))
    relative = tight = None
    if default and len(missing) < len(default) - len(missing):  # most of the default: said from it
        head = "all" if not missing else "all but " + ", ".join(_kernel_words(missing))
        relative = " + ".join([head, *_kernel_words(extra)])
        if missing:  # "all but O,fused+CE"
            tight = "+".join(["all but " + ",".join(COMPACT.get(w, w) for w in _kernel_words(missing)),
                              *(COMPACT.get(w, w) for w in _kernel_words(extra))])
    compact = "+".join(COMPACT.get(w, w) for w in plain)
    forms = [f for f in (relative if not missing else None, " + ".join(plain), relative, "+".join(plain), tight,
                         compact) if f]
    return next((f for f in forms if len(f) <= MAX_LABEL), min(forms, key=len))


def kernel_items(sets: list[tuple[str, ...]], default: tuple[str, ...],
                 labels: dict[tuple[str, ...], str] | None = None) -> list[tuple[str, str, str]]:
    """(label, kernels, tip) for each set: the data is the CLI's comma-separated word (Qt keeps no tuple; the setup
    reads the word, :func:`select_data` finds it), the tip the kernels' words."""
    labels = labels or {}
    return [(labels.get(sub) or kernel_set_label(sub, default), ",".join(sub), ", ".join(sub) or "none")
            for sub in sets]


def liger_kernel_items(kernels: tuple[str, ...], default: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """The sets people run with Liger (every set of its five kernels, 32, ran past the window's bottom): off; the
    frameworks' default ("all"); the default with its cross-entropy too; the default with one of its switches off
    (axolotl's liger_rope / liger_rms_norm ..., LLaMA-Factory's liger_kernel_config), each in the setup's order. Any
    other set a setup holds is shown as one more item (:func:`select_data`), never changed."""
    def ordered(names: set[str]) -> tuple[str, ...]:
        return tuple(k for k in kernels if k in names)

    but = {ordered(set(default) - {k}): f"all but {KERNEL_NAMES.get(k, k)}" for k in default}
    sets = [(), default, ordered({*default, "cross_entropy"}), *but]
    return kernel_items(list(dict.fromkeys(sets)), default, but)


def unsloth_kernel_items(lora: tuple[str, ...], default: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """The runs people make with Unsloth (every set of its six kernels, 48, ran past the window's bottom): off;
    FastLanguageModel's run ("all", the default); the same with UNSLOTH_RETURN_LOGITS=1 ("all,cross_entropy": its
    cross-entropy on the logits in the fused loss's place); its LoRA kernels alone. Any other set a setup holds is
    shown as one more item (:func:`select_data`), never changed."""
    logits = tuple(k for k in default if k != "fused_loss") + ("cross_entropy",)
    return kernel_items([(), default, logits, lora], default,
                        {logits: "all, CE on the logits", lora: "LoRA kernels only"})


def kernel_combo(items: list[tuple[str, str, str]], default: tuple[str, ...], tip: str) -> QtWidgets.QComboBox:
    box = combo([(label, data) for label, data, _tip in items], tip)
    box.setProperty(DEFAULT_PROPERTY, ",".join(default))  # for the label of a set the list does not offer
    for i, (_label, _data, words) in enumerate(items):
        box.setItemData(i, words, QtCore.Qt.ItemDataRole.ToolTipRole)
    return box


def loss_kernel_items(kernels: Iterable[Enum]) -> list[tuple[str, Any, str]]:
    """(label, member, tip) for each loss kernel; a member the table does not know is shown by its value."""
    out = []
    for k in kernels:
        value = str(getattr(k, "value", k))
        label, tip = LOSS_KERNEL_TEXTS.get(value, (value, f"The loss kernel the CLI calls --loss-kernel {value}."))
        out.append((label, k, tip))
    return out


OBJECTIVE_LABELS = {Objective.SFT: "SFT", Objective.DPO: "DPO", Objective.IPO: "IPO", Objective.KTO: "KTO",
                    Objective.ORPO: "ORPO", Objective.SIMPO: "SimPO", Objective.CPO: "CPO",
                    Objective.GRPO: "GRPO"}

TARGET_LABELS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
                 "up_proj": "up", "down_proj": "down", "qkv_proj": "qkv", "gate_up_proj": "gate_up",
                 "lm_head": "lm_head"}


def combo(items: Iterable[tuple[str, Any]], tip: str) -> QtWidgets.QComboBox:
    box = QtWidgets.QComboBox()
    for text, data in items:
        box.addItem(text, data)
    box.setToolTip(tip)
    box.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
    box.setMinimumContentsLength(10)
    return box


def enum_items(enum: Iterable[Enum], labels: dict[Any, str] | None = None) -> list[tuple[str, Any]]:
    labels = labels or {}
    return [(labels.get(e, str(e.value)), e) for e in enum]


def spin(lo: int, hi: int, tip: str, step: int = 1, suffix: str = "") -> QtWidgets.QSpinBox:
    s = QtWidgets.QSpinBox()
    s.setRange(lo, hi)
    s.setSingleStep(step)
    s.setToolTip(tip)
    s.setSuffix(suffix)
    s.setGroupSeparatorShown(True)
    s.setAccelerated(True)
    return s


def select_data(box: QtWidgets.QComboBox, data: Any) -> None:
    """Show ``data`` in ``box``. A set of words (liger_kernels, unsloth_kernels) is its comma-separated word; one
    the list does not offer is added as one last item (the previous one of those replaced) and shown, so that the
    control never shows another set than the setup's."""
    words = isinstance(data, tuple)
    if words:
        data = ",".join(data)
    for i in range(box.count()):
        if box.itemData(i) == data:
            box.setCurrentIndex(i)
            return
    if words:
        last = box.count() - 1
        if last >= 0 and box.itemData(last, EXTRA_ROLE):
            box.removeItem(last)
        default = tuple(k for k in str(box.property(DEFAULT_PROPERTY) or "").split(",") if k)
        box.addItem(kernel_set_label(tuple(data.split(",")), default), data)
        box.setItemData(box.count() - 1, True, EXTRA_ROLE)
        box.setItemData(box.count() - 1, f"{data.replace(',', ', ')}: this setup's (a saved scenario, a training "
                        "config, the command line), not one of the runs listed", QtCore.Qt.ItemDataRole.ToolTipRole)
        box.setCurrentIndex(box.count() - 1)
