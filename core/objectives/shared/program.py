"""What the objectives' estimator programs share: the program interface the step driver runs, on TRL's fused LM
head and the small ops of its losses (:class:`vramlab.core.estimator.trl_head.TrlHead`, which SFT's ``trl`` loss
kernel uses too), peft's ``disable_adapter`` and the reference copy. Mirrors
:mod:`vramlab.core.objectives.shared.reference` line by line (which follows TRL 1.16.0; see its docstring for the
functions followed and what CUDA allocates).

Sizes are concrete in the objectives' programs (the prompt and completion lengths and the batch), so no
polynomial is needed. No torch here: the estimator-only build runs these."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TypeVar

from vramlab.core.estimator.engine import Engine, Storage
from vramlab.core.estimator.program import Dims, Model
from vramlab.core.estimator.shard import replayed_layers
from vramlab.core.estimator.trl_head import TrlHead
from vramlab.core.kinds import Kind
from vramlab.core.spec.options import Reference
from vramlab.core.spec.training import TrainingSetup

T = TypeVar("T")


class ObjectiveProgram(TrlHead):
    """An objective's step on the symbolic engine, run by :meth:`vramlab.core.estimator.driver.StepModel.run`:
    :meth:`prepare` once per optimizer step, :meth:`loss` per micro-batch. ``sm`` is the policy's step model;
    ``ref_sm`` the reference copy's (a step model over :func:`reference_model`'s model), or None."""

    divides_loss = True  # HF Trainer divides the loss by the accumulation steps (a scalar op in the graph)
    collates = True  # :meth:`collate` is the collator's batch: HF Trainer holds a step's micro-batches (held)

    def __init__(self, sm, ref_sm=None) -> None:  # noqa: ANN001 - StepModels (the driver, above, runs this)
        super().__init__(sm.ops, sm.engine)
        self.sm, self.m = sm, sm.m
        self.ref_sm = ref_sm
        self.ref: Model | None = ref_sm.m if ref_sm is not None else None
        self.setup: TrainingSetup = sm.setup
        self.buffer: dict[str, Storage] | None = None
        # HF Trainer's batch_samples (simulation.step.holds_batches): the step's micro-batches, each its tensors and
        # what the step models' make_inputs set for it (a VLM's pixel inputs); the driver fills and frees it
        self.held: list[tuple[list[Storage], list[dict]]] = []

    def prepare(self, step: int) -> None:
        """Work once per optimizer step, before its micro-batches (GRPO's generation and scoring)."""

    def prepares_before(self, i: int) -> bool:
        """Whether :meth:`prepare` runs again before micro-batch ``i`` (GRPO regenerating inside a step)."""
        return i == 0

    def loss(self, step: int, i: int, d: Dims) -> tuple[Storage, list[Storage]]:
        """Micro-batch ``i`` of optimizer step ``step`` (``d``: the setup's batch and sequence): its loss and the
        batch tensors (:meth:`take`'s, held by the driver where the program :attr:`collates`, else freed after
        backward)."""
        raise NotImplementedError

    def collate(self, d: Dims) -> list[Storage]:
        """One micro-batch as the collator gives it, on the device (a VLM's pixel inputs set on the step model)."""
        raise NotImplementedError

    def collate_held(self, d: Dims) -> tuple[list[Storage], list[dict]]:
        """:meth:`collate`, with what it set on the step models (a VLM's inputs) taken to hand back in :meth:`take`."""
        return inputs_set(self.step_models(), lambda: self.collate(d))

    def take(self, i: int, d: Dims) -> list[Storage]:
        """Micro-batch ``i``'s tensors: the step's held one, its inputs handed back to the step models (or one
        collated now where nothing is held)."""
        if not self.held:
            return self.collate(d)
        batch, inputs = self.held[i]
        hand_back(self.step_models(), inputs)
        return batch

    def step_models(self) -> list:
        """The policy's step model and the reference copy's, where there is one."""
        return [m for m in (self.sm, self.ref_sm) if m is not None]

    def release(self, held: list[tuple[list[Storage], list[dict]]]) -> None:
        """Free a step's held micro-batches, their inputs with them (a reference copy's are the policy's), the
        last first (as CPython frees a list's items)."""
        seen: dict[int, Storage] = {}
        for batch, inputs in reversed(held):
            for v in (*batch, *(v for got in inputs for v in got.values())):
                if isinstance(v, Storage):
                    seen.setdefault(id(v), v)
        self.ops.drop(*seen.values())

    # ---- small ops ----------------------------------------------------------------------------------------
    def sub(self, a: Storage, b: Storage) -> Storage:
        """``a - b`` (same shape): a's gradient passes through, b's is ``-grad`` (allocated)."""
        out = self.ops.new(max(a.numel, b.numel), a.dtype)
        self.engine.node(out, [(a, 0 if a.numel == out.numel else self.ops.gbytes(a)), (b, self.ops.gbytes(b))])
        return out

    def log_probs(self, model: Model, ids: Storage, d: Dims, n_tokens: int, outputs: tuple[str, ...],
                  grad: bool) -> tuple[list[Storage | None], Storage]:
        sm = self.sm if model is self.m else self.ref_sm
        # transformers' class under HF Trainer's autocast (a VLM's reference): one autocast region, and so one
        # weight cache, over the patched forward, backbone and fused head
        opened = model.amp_region_start() if getattr(sm, "autocast_forward", False) else False
        off = getattr(sm, "checkpointing_off", None)  # a VLM's step: tower and language model alike
        with off() if off is not None and not grad else contextlib.nullcontext():
            h = sm.backbone(ids, d, checkpointing=None if grad else False)
        out = self.fused_head(model, h, d, n_tokens, outputs)
        self.ops.drop(h)
        release = getattr(sm, "release_outputs", None)  # a VLM's backbone output (its image features) goes
        if release is not None:  # with add_fused_lm_head's forward
            release()
        model.amp_region_end(opened)
        if model.sh is not None and model.sh.params_sharded and model.sh.reference:  # (reference.log_probs)
            model.sh.reshard(-1)
        return out

    def make_inputs(self, d: Dims) -> None:
        """The batch's inputs beside the ids (a vision-language model's pixels, for ``d.b`` rows), which the
        reference copy's forward reads too."""
        share = getattr(self.sm, "share_inputs", None)
        if share is not None and self.ref_sm is not None:
            share(d, self.ref_sm)
        else:
            self.sm.make_inputs(d)

    def labels(self, ids: Storage) -> Storage:
        """``ids.masked_fill(mask == 0, -100)``."""
        b = self.ops.new(ids.numel, "bool")
        out = self.ops.new(ids.numel, "i64")
        self.ops.drop(b)
        return out

    def no_grad(self):  # noqa: ANN202
        engine = self.engine

        class _Ctx:
            def __enter__(self) -> None:
                self.old = engine.grad_enabled
                engine.grad_enabled = False

            def __exit__(self, *a: object) -> None:
                engine.grad_enabled = self.old

        return _Ctx()

    def adapters_off(self, model: Model):  # noqa: ANN202
        lins = [lin for L in model.layers for group in ("attn", "mlp") for lin in L.get(group, {}).values()
                if lin.lora]
        lins += [lin for L in model.layers for ex in L.get("experts", []) for lin in ex.values() if lin.lora]
        lins += getattr(model, "tower_adapters", list)()  # peft disables a vision tower's adapters too

        class _Ctx:
            def __enter__(self) -> None:
                for lin in lins:
                    lin.lora = False

            def __exit__(self, *a: object) -> None:
                for lin in lins:
                    lin.lora = True

        return _Ctx()


def reference_model(setup: TrainingSetup, model: Model, engine: Engine) -> Model | None:
    """The reference copy of ``model``: the same layers (and layer plan, so its repeated layers repeat too; a
    vision-language model's tower and projector with them: its ``copy_for``), frozen, its weights in their own
    dtype; loaded after the policy."""
    if setup.reference_mode is not Reference.COPY:
        return None
    copy = getattr(model, "copy_for", None)
    ref = copy(setup.reference_setup()) if copy is not None else \
        Model(model.spec, setup.reference_setup(), engine, plan=model.plan)
    ref.training = False
    engine.region, old = Kind.REFERENCE, engine.region
    ref.load()
    engine.region = old
    for h in ref.params:
        h.rg = False
    ref.params = []
    if ref.sh is not None and ref.sh.params_sharded:  # TRL's prepare_fsdp / prepare_deepspeed
        ref.sh.as_reference(replayed_layers(model.plan, model.spec.num_layers))
    return ref



_UNSET = object()  # an attribute a step model did not have


def inputs_set(models: list, call: Callable[[], T], known: Iterable[str] = ()) -> tuple[T, list[dict]]:
    """``call()``, and what it set on each of ``models`` (attributes it added or bound to another value) taken as
    inputs to hand back later (:func:`hand_back`); the ``known`` names are unset first, so that one set again to the
    same value is taken too."""
    for m in models:
        for k in known:
            setattr(m, k, _UNSET)
    before = [dict(vars(m)) for m in models]
    out = call()
    return out, [{k: v for k, v in vars(m).items() if was.get(k, _UNSET) is not v} for m, was in zip(models, before)]


def hand_back(models: list, inputs: list[dict]) -> None:
    """Set each of ``models``'s inputs (:func:`inputs_set`'s) on it again."""
    for m, got in zip(models, inputs):
        for k, v in got.items():
            setattr(m, k, v)
