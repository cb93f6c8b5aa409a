"""The estimator: the training step replayed in bytes (see :mod:`.engine`), recorded once per model and
setup structure as a tape with symbolic sizes and evaluated for any batch, sequence and rank.

``record_tape`` replays a model (optionally reduced: each run of identical layers replayed as its first,
one middle layer standing for the rest, and its last); ``TapeCache`` keeps tapes by structure.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass

from vramlab.core.estimator import unsloth_gc
from vramlab.core.estimator.driver import StepModel
from vramlab.core.estimator.engine import Engine
from vramlab.core.estimator.poly import Poly
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.estimator.tape import Evaluation, Evaluations, Tape
from vramlab.core.families import piece
from vramlab.core.sdpa import MATH, tape_kernel
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import LossKernel, Method, Objective, Sharding
from vramlab.core.spec.sharded_precision import deepspeed_splits
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.vision import vision_tokens

__all__ = ["Recorded", "TapeCache", "Evaluation", "Evaluations", "layer_plan", "record_tape", "structure_key",
           "symbolic_sizes"]


@dataclass(frozen=True)
class Recorded:
    tape: Tape
    managed_bytes: Poly  # paged optimizer states in CUDA managed memory (not in the tape)
    symbolic: tuple[bool, bool, bool]  # which of (b, s, r) are symbolic


def layer_plan(spec: ModelSpec, setup: TrainingSetup) -> tuple[list[int], dict[int, int]]:
    """Layers to replay and how many times each tag stands: runs of layers with the same trainability
    are shortened to first, middle (standing for all but first and last) and last."""
    n = spec.num_layers
    first = n - int(setup.trainable_layers or n) if setup.method is Method.FREEZE else 0
    text = not _has_images(spec, setup)
    # Gemma 3's full-attention layers keep their own RoPE tables alive, and past the window hold less (no mask,
    # no repeated k and v): replayed apart from the sliding-window ones
    kinds = [(i >= first, text and spec.takes_window_mask(i)) for i in range(n)]
    plan: list[int] = []
    mult: dict[int, int] = {}
    i = 0
    while i < n:
        j = i
        while j + 1 < n and kinds[j + 1] == kinds[i]:
            j += 1
        length = j - i + 1
        if length <= 3:
            plan.extend(range(i, j + 1))
        else:
            plan.append(i)
            mult[len(plan)] = length - 2
            plan.append(i + 1)
            plan.append(j)
        i = j + 1
    return plan, mult


def symbolic_sizes(spec: ModelSpec, setup: TrainingSetup) -> tuple[bool, bool, bool]:
    """Which sizes can stay symbolic: loss chunks and a sliding-window mask need concrete
    sequence lengths (and the mask exists only from seq_len == window on); 8-bit
    optimizers decide per tensor size, so LoRA ranks are concrete there. Where a CUDA run takes SDPA's math
    kernel (its (s, s) causal mask), the sequence length is concrete in both modes."""
    if _has_images(spec, setup):  # the tower's windows and tokens follow the image size: all sizes concrete
        return False, False, False
    sym_b = True  # an MoE's grouped experts: every size a multiple of the routed tokens, whatever the routing
    # a sliding-window mask is (1, 1, s, s) before it is expanded over the batch: s² is outside the basis
    sym_s = not setup.chunked_loss and not spec.sdpa_mask(setup.seq_len)
    # Cut Cross Entropy's lock arrays, ceil(b (s - 1) / 128); Liger's logits tile, a power of two of tokens
    if setup.loss_kernel is not LossKernel.HF:
        sym_b = sym_s = False
    # SDPA's math kernel builds an (s, s) causal mask on CUDA: s² without the batch is outside the basis too
    sym_s = sym_s and tape_kernel(spec, setup, simulation=False) != MATH
    sym_r = (setup.uses_lora and not setup.optimizer.size_dependent_state and setup.sharding is Sharding.NONE
             and not setup.lora_fa)  # LoRA-FA: rank x rank projections (r squared)
    if setup.objective is not Objective.SFT:  # prompt, completion and generation loops: concrete sizes
        sym_b = sym_s = False
    if setup.unsloth_gc and setup.grad_ckpt:  # Unsloth's checkpointing offloads a layer input over 2 MiB only
        sym_b = sym_s = False
    if "fused_loss" in setup.unsloth_kernels:  # Unsloth's fused loss: a power of two of rows per chunk
        sym_b = sym_s = False
    return sym_b, sym_s, sym_r


def _has_images(spec: ModelSpec, setup: TrainingSetup) -> bool:
    """A vision-language model (core/families/*/program.py): its tower is loaded even for a batch without images."""
    return spec.vision is not None


_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingSetup))
_AT = {name: i for i, name in enumerate(_FIELDS)}
_VALUES = operator.attrgetter(*_FIELDS)  # every field's value in one call (a warm estimate takes microseconds)


def structure_key(spec: ModelSpec, setup: TrainingSetup) -> tuple:
    """What decides a tape: the model and every setting, with the sizes that stay symbolic left out (a
    batch of one differs from a larger one: a view instead of a copy of the labels)."""
    sym_b, sym_s, sym_r = symbolic_sizes(spec, setup)
    values = list(_VALUES(setup))
    if sym_b:
        values[_AT["micro_batch"]] = 1 if setup.micro_batch == 1 else 2
    if sym_s:
        values[_AT["seq_len"]] = 1
    if sym_r or not setup.uses_lora:
        values[_AT["lora_rank"]] = 1
    if not setup.uses_lora:
        values[_AT["lora_alpha"]] = None
        values[_AT["lora_dropout"]] = 0.0
        values[_AT["lora_targets"]] = ("q_proj", "v_proj")
    return spec, tuple(values)


def record_tape(spec: ModelSpec, setup: TrainingSetup, reduced: bool = True, match_simulation: bool = False,
                symbolic: bool = True) -> Recorded:
    sym = symbolic_sizes(spec, setup) if symbolic else (False, False, False)
    b = Poly.var("b") if sym[0] else setup.micro_batch
    s = Poly.var("s") if sym[1] else setup.seq_len
    r = Poly.var("r") if sym[2] else setup.lora_rank
    reduced = reduced and not deepspeed_splits(spec.param_count, setup)  # its sub-groups cut across layers
    plan, mult = layer_plan(spec, setup) if reduced else (list(range(spec.num_layers)), {})
    e = Engine(match_simulation=match_simulation)
    e.ckpt_reentrant = setup.ckpt_reentrant or setup.ckpt_offload  # the offloaded one is a reentrant-style function
    e.ckpt_offload = setup.ckpt_offload
    unsloth_gc.attach(e, setup)
    if _has_images(spec, setup):
        tokens = vision_tokens(spec.vision.processor, setup.vision_input())
        program = piece(spec.vision.model_type, "program")  # the family's (core/families/<family>/program.py)
        sm, mult = program.step_model(spec, setup, e, tokens, r, plan, mult, reduced)
        total = setup.seq_len + tokens.llm_tokens  # the text and the processor's vision tokens
        sm.run(Dims(b, total, setup.micro_batch > 1, spec.sdpa_mask(total)))
    else:
        sm = StepModel(Model(spec, setup, e, rank=r, plan=plan))
        sm.run(Dims(b, s, setup.micro_batch > 1, spec.sdpa_mask(setup.seq_len)))
    # a replayed middle layer stands for ``mult`` layers: so do its paged optimizer states
    managed = Poly.of(0)
    for tag, nbytes in sm.managed_bytes.items():
        managed = managed + nbytes * mult.get(tag, 1)
    return Recorded(Tape(e.tape, e.phases, mult, e.hids), managed, sym)


def evaluate(rec: Recorded, setup: TrainingSetup) -> tuple[Evaluation, int]:
    b, s, r = setup.micro_batch, setup.seq_len, setup.lora_rank
    return rec.tape.evaluate(b, s, r), rec.managed_bytes.value(b, s, r)


class TapeCache:
    """Tapes by structure (thread-safe, least recently used first out)."""

    def __init__(self, size: int = 256, match_simulation: bool = False, reduced: bool = True) -> None:
        self.size = size
        self.match_simulation = match_simulation
        self.reduced = reduced
        self._d: OrderedDict[tuple, Recorded] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, spec: ModelSpec, setup: TrainingSetup) -> Recorded:
        key = structure_key(spec, setup)
        sym = symbolic_sizes(spec, setup)
        if not all(sym[:2]):  # concrete sizes are part of the structure
            key = (*key, setup.micro_batch, setup.seq_len, setup.lora_rank)
        elif not sym[2] and setup.uses_lora:
            key = (*key, setup.lora_rank)
        with self._lock:
            rec = self._d.get(key)
            if rec is not None:
                self._d.move_to_end(key)
                self.hits += 1
                return rec
        rec = record_tape(spec, setup, reduced=self.reduced, match_simulation=self.match_simulation)
        with self._lock:
            self.misses += 1
            self._d[key] = rec
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        return rec

