"""Unsloth's own gradient checkpointing (``TrainingSetup.unsloth_gc``, ``--unsloth-gc``): what
``FastLanguageModel.from_pretrained(use_gradient_checkpointing="unsloth")`` installs, read from unsloth 2026.10.9
(``unsloth/models/_utils.py`` ``apply_unsloth_gradient_checkpointing``) and unsloth_zoo 2026.10.9
(``unsloth_zoo/gradient_checkpointing.py``: ``patch_unsloth_smart_gradient_checkpointing``,
``UnslothCheckpointFunction``). The step's transformation is core/simulation/unsloth_gc.py (the built-in builder
and transformers' classes) and core/estimator/unsloth_gc.py (the estimate).

The figures below are unsloth_zoo's module constants; the mechanism is in docs/levels.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import Sharding
from vramlab.core.versions import UNSLOTH_ZOO

if TYPE_CHECKING:
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

UNSLOTH_ZOO_VERSION = UNSLOTH_ZOO[1]
# a layer input is offloaded when its stored bytes exceed MINIMUM_SIZE (2 MiB); smaller ones stay on the GPU
MINIMUM_SIZE = 2 * 1024 * 1024
# each GPU staging buffer starts as INITIAL_GPU_BUFFER_SIZE elements of the buffer dtype (16-bit) and grows to the
# largest offloaded input (resize_)
INITIAL_GPU_BUFFER_BYTES = 2 * 256 * 2048 * 2
# the host pool: INITIAL_CPU_BUFFER_COUNT pinned buffers of INITIAL_CPU_BUFFER_SIZE elements, grown per slot
INITIAL_CPU_BUFFER_BYTES = 128 * 1024 * 2
INITIAL_CPU_BUFFER_COUNT = 200
# the second staging buffer (double buffering) is kept from the second pass on where the GPU has more free
DOUBLE_BUFFER_HEADROOM = 512 * 1024 * 1024
# apply_unsloth_gradient_checkpointing: below this max_seq_length "unsloth" becomes plain checkpointing
MIN_SEQ_LEN = 512


def unsloth_gc_runs(setup: TrainingSetup) -> bool:
    """Whether Unsloth's function replaces the checkpoint function in this setup (it needs checkpointing, and
    below 512 tokens unsloth turns it into plain checkpointing)."""
    return setup.unsloth_gc and setup.grad_ckpt and setup.seq_len >= MIN_SEQ_LEN


def validate_unsloth_gc(setup: TrainingSetup, model: ModelSpec | None = None) -> None:
    if not (setup.unsloth_gc and setup.grad_ckpt):
        return
    if setup.ckpt_offload:
        raise SetupError("Unsloth's checkpointing and LLaMA-Factory's offloaded one both replace the checkpoint "
                         "function: choose one of --unsloth-gc and --grad-ckpt-offload")
    if (setup.sharding is not Sharding.NONE or setup.gpus > 1) and model is not None and model.vision is not None:
        raise SetupError(f"unsloth {UNSLOTH_ZOO_VERSION}'s FastVisionModel on several GPUs is not modelled yet (under "
                         "DDP it offloads through saved-tensor hooks, under FSDP2 / ZeRO over sharded units): drop "
                         "--unsloth-gc")
    if setup.sharding is not Sharding.NONE or setup.gpus > 1:
        raise SetupError(f"unsloth {UNSLOTH_ZOO_VERSION} runs its offloaded checkpointing on one GPU "
                         "(models/decision.py turns it off when distributed): drop --unsloth-gc")
    if setup.offloads_activations:
        raise SetupError("Unsloth's checkpointing beside activation offloading is not modelled: drop one of "
                         "--unsloth-gc and --offload-activations")


def unsloth_gc_note(setup: TrainingSetup) -> str | None:
    """A warning where ``--unsloth-gc`` is on with checkpointing but changes nothing."""
    if setup.unsloth_gc and setup.grad_ckpt and setup.seq_len < MIN_SEQ_LEN:
        return (f"unsloth {UNSLOTH_ZOO_VERSION} runs plain checkpointing below {MIN_SEQ_LEN} tokens "
                f"(max_seq_length {setup.seq_len}): --unsloth-gc changes nothing")
    return None
