"""Names shared by the estimator, the tracker and the views: memory kinds (what a tensor is for), phases of a
training step (string enums, so they serialise as themselves in JSON), and the record of one live tensor."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """What a live tensor is for. Every byte at the peak belongs to exactly one kind."""

    WEIGHTS = "weights"  # model parameters and buffers in their storage dtype (incl. quantization blocks)
    ADAPTERS = "lora_adapters"  # LoRA A/B matrices
    MASTER_WEIGHTS = "master_weights"  # fp32 copy of 16-bit trainable weights held by the optimizer
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"  # tensors the forward pass keeps for backward
    AMP_COPIES = "amp_weight_copies"  # weight casts made by autocast and saved for backward
    LOGITS = "logits_loss"  # logits, their fp32 upcast, log-probabilities and their gradients
    TEMPORARIES = "temporaries"  # short-lived tensors: dequantised weights, grads in flight, workspaces
    OPTIMIZER_TEMPS = "optimizer_temps"  # foreach / single-tensor intermediates of the optimizer step
    INPUTS = "inputs"  # the batch: token ids, labels, positions
    # a vision-language model's vision side, apart from its language model (core/vision.py)
    VISION_WEIGHTS = "vision_weights"  # the vision tower's parameters (and its LoRA adapters)
    PROJECTOR_WEIGHTS = "projector_weights"  # the projector / merger between the tower and the language model
    VISION_ACTIVATIONS = "vision_activations"  # what the tower and projector keep for backward, and their output
    VISION_TRAINING = "vision_training"  # gradients and optimizer states of the tower and projector
    REFERENCE = "reference_model"  # a second, frozen copy of the model for DPO / KTO / GRPO (issue 15)
    KV_CACHE = "kv_cache"  # the keys and values transformers.generate caches per layer (GRPO)

    @property
    def label(self) -> str:
        return KIND_LABELS[self]

    @property
    def description(self) -> str:
        return KIND_HELP[self]


KIND_ORDER: tuple[Kind, ...] = tuple(Kind)

KIND_LABELS = {
    Kind.WEIGHTS: "Weights",
    Kind.ADAPTERS: "LoRA adapters",
    Kind.MASTER_WEIGHTS: "FP32 master weights",
    Kind.GRADIENTS: "Gradients",
    Kind.OPTIMIZER_STATES: "Optimizer states",
    Kind.ACTIVATIONS: "Activations",
    Kind.AMP_COPIES: "AMP weight copies",
    Kind.LOGITS: "Logits & loss",
    Kind.TEMPORARIES: "Temporaries",
    Kind.OPTIMIZER_TEMPS: "Optimizer temporaries",
    Kind.INPUTS: "Batch inputs",
    Kind.VISION_WEIGHTS: "Vision tower weights",
    Kind.PROJECTOR_WEIGHTS: "Projector weights",
    Kind.VISION_ACTIVATIONS: "Vision activations",
    Kind.VISION_TRAINING: "Vision grads & states",
    Kind.REFERENCE: "Reference model",
    Kind.KV_CACHE: "KV cache (generation)",
}

KIND_HELP = {
    Kind.WEIGHTS: "Model parameters in their storage dtype: 4 bytes each in fp32, 2 in bf16/fp16, 1 in int8 "
                  "plus per-row scales, 0.5 in NF4 plus block scales.",
    Kind.ADAPTERS: "LoRA A and B matrices of every adapted module and DoRA's magnitude vectors (peft keeps them "
                   "in fp32 by default).",
    Kind.MASTER_WEIGHTS: "An fp32 copy of 16-bit trainable weights that the optimizer updates "
                         "(DeepSpeed / Megatron mixed precision).",
    Kind.GRADIENTS: "One gradient per trainable parameter, in the trainable dtype; with accumulation they "
                    "stay alive between micro-batches.",
    Kind.OPTIMIZER_STATES: "AdamW keeps two states per trainable parameter (8-bit optimizers: 1 byte each "
                           "plus block scales); created by the first optimizer step.",
    Kind.ACTIVATIONS: "Tensors the forward pass saves for backward: layer inputs, attention outputs, MLP "
                      "intermediates. Gradient checkpointing keeps only each layer's input.",
    Kind.AMP_COPIES: "Under autocast every fp32 weight is cast to the compute dtype once per forward and "
                     "the copy is kept for backward.",
    Kind.LOGITS: "The lm_head output (tokens x vocabulary), its fp32 upcast and log-softmax for the loss, "
                 "and their gradients: often the largest single item with a 128k+ vocabulary.",
    Kind.TEMPORARIES: "Short-lived tensors inside an operation: dequantised 4-bit weights, gradients in "
                      "flight between layers, attention workspaces.",
    Kind.OPTIMIZER_TEMPS: "Intermediates of the optimizer step: foreach AdamW makes one tensor the size of "
                          "all parameters; fused makes none.",
    Kind.INPUTS: "Token ids, labels and position ids of the micro-batch (8 bytes per token each), and its "
                 "pixel values.",
    Kind.VISION_WEIGHTS: "The vision tower's parameters (a ViT over image patches), and its LoRA adapters when "
                         "the tower is adapted.",
    Kind.PROJECTOR_WEIGHTS: "The projector (merger) that maps vision features to the language model's width.",
    Kind.VISION_ACTIVATIONS: "Tensors the vision tower and projector keep for backward (each block's input, its "
                             "attention over the image's own patches, its MLP), and the image features they "
                             "hand to the language model. A frozen tower keeps none of them.",
    Kind.VISION_TRAINING: "Gradients and optimizer states of the vision tower and projector, when they train.",
    Kind.REFERENCE: "The frozen reference model of DPO / KTO / GRPO when it is a second copy, in its own dtype "
                    "(none with LoRA, whose reference is the policy with its adapters disabled).",
    Kind.KV_CACHE: "Keys and values of every layer for every generated sequence during GRPO's generation: "
                   "transformers' DynamicCache grows them by concatenation, one copy per layer per token.",
}


@dataclass(frozen=True)
class LiveTensor:
    """One storage alive at a moment (the tracker's list of the largest at a peak; a result's ``alive_at_peak``
    from a simulation or a profile): its bytes, kind, label, shape, dtype and the phase it was made in."""

    nbytes: int
    kind: Kind
    label: str
    shape: tuple[int, ...]
    dtype: str
    created_in: str


class Phase(StrEnum):
    LOAD = "load"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    GENERATE = "generate"  # GRPO: completions generated with the model in eval mode, no gradients
    REFERENCE = "reference"  # reference (and old-policy) log-probabilities under no_grad

    @property
    def label(self) -> str:
        if self is Phase.REFERENCE:
            return "Reference forward"
        return self.value.capitalize() if self is not Phase.OPTIMIZER else "Optimizer step"


# what an allocation no region labels is, by the phase it is made in (the tracker's and the estimator's rule)
PHASE_KIND = {
    Phase.LOAD: Kind.WEIGHTS,
    Phase.FORWARD: Kind.ACTIVATIONS,
    Phase.BACKWARD: Kind.TEMPORARIES,
    Phase.OPTIMIZER: Kind.OPTIMIZER_TEMPS,
    Phase.GENERATE: Kind.TEMPORARIES,
    Phase.REFERENCE: Kind.TEMPORARIES,
}


def phase_key(phase: Phase, step: int) -> str:
    """Key of a phase in ``phases`` dicts: 'load', 'forward@1', 'optimizer@2' (steps count from 1)."""
    return phase.value if phase is Phase.LOAD else f"{phase.value}@{step}"


def parse_phase_key(key: str) -> tuple[Phase, int]:
    if "@" in key:
        name, step = key.split("@", 1)
        return Phase(name), int(step)
    return Phase(key), 0
