"""The training step that every measurement runs: HF Trainer's loop, instrumented.

``load → (forward → backward) × micro-batches → optimizer step → zero_grad(set_to_none=True)``, for
two optimizer steps: the first creates the optimizer state, the second is the steady state (with
accumulation the second micro-batch's backward runs with all gradients alive, so two micro-batches
per step show every distinct moment; more only repeat them).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vramlab.core.kinds import Kind, Phase
from vramlab.core.objectives import piece
from vramlab.core.objectives.shared.reference import ReferenceStep, build_reference
from vramlab.core.simulation import context
from vramlab.core.simulation.act_offload import offload_context
from vramlab.core.simulation.model import Decoder, build_model
from vramlab.core.simulation.optim import OptimizerBase, make_optimizer
from vramlab.core.simulation.tracker import MemoryTracker
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Objective, Offload, Sharding
from vramlab.core.spec.training import TrainingSetup

PhaseCallback = Callable[[str, int], None]  # (phase key, live bytes)


class Aborted(Exception):
    """The run was cancelled between phases."""


@dataclass
class StepRun:
    """What a measured run leaves behind (the tracker holds the numbers)."""

    tracker: MemoryTracker
    total_params: int
    trainable_params: int
    managed_bytes: int = 0
    timing: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what the model's build chose that people should know (HF path)


def preload(setup: TrainingSetup) -> None:
    """Import, outside the fake-tensor mode, what the step imports on its first use: a module imported inside
    the mode has its import-time tensors (peft's ``torch.tensor(1)`` defaults, host memory in a real run)
    recorded as the run's, and the first run in a process would then not have the form of every later one
    (``simulate --hf`` of a LoRA setup 1,024 B above the same run repeated, and above the trace). A step without
    LoRA never imports peft (a fifth of a second saved on the first trace of full fine-tuning)."""
    if not setup.uses_lora:
        return
    with contextlib.suppress(ImportError):
        import peft.peft_model  # noqa: F401 - peft's tuners, imported by its first get_peft_model


def _make_batch(setup: TrainingSetup, vocab: int, device: torch.device, real: bool) -> dict[str, torch.Tensor]:
    b, s = setup.micro_batch, setup.seq_len
    with context.region(Kind.INPUTS):
        if real:
            ids = torch.randint(0, vocab, (b, s), device=device)
        else:
            ids = torch.empty(b, s, dtype=torch.long, device=device)
        labels = ids.clone()
        mask = torch.ones(b, s, dtype=torch.long, device=device)  # the collator's attention_mask
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def run_steps(
    model: Decoder,
    optimizer: OptimizerBase,
    setup: TrainingSetup,
    tracker: MemoryTracker,
    steps: int = 2,
    on_phase: PhaseCallback | None = None,
    should_abort: Callable[[], bool] | None = None,
    sync: Callable[[], None] | None = None,
    objective: ReferenceStep | None = None,
) -> dict[str, float]:
    """Run ``steps`` optimizer steps of ``setup`` on ``model``; returns wall times per phase (s)."""
    plan = model.plan
    device, real = plan.device, plan.real
    accum = setup.grad_accum
    micro = min(accum, 2)
    timing: dict[str, float] = {}
    trainable = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): name for name, p in model.named_parameters()}
    # a vision-language model files its tower's gradients and optimizer states apart (measure.vlm)
    grad_kind = getattr(model, "gradient_kind", lambda name: Kind.GRADIENTS)
    file_states = getattr(model, "file_optimizer_states", None)
    sharder = plan.sharder
    for p in trainable:
        p.register_post_accumulate_grad_hook(
            lambda p: tracker.reclassify(p.grad, grad_kind(names.get(id(p), "")),
                                         f"grad of {names.get(id(p), 'a parameter')}"))
        if sharder is not None and sharder.mode is Sharding.ZERO2:
            p.register_post_accumulate_grad_hook(sharder.zero2_hook)
    offloaded = sharder is not None and sharder.offload is not Offload.NONE
    in_backward: dict[torch.nn.Parameter, OptimizerBase] = {}
    if setup.optimizer_in_backward:
        for p in trainable:
            in_backward[p] = make_optimizer([p], setup)

        def step_now(p: torch.nn.Parameter) -> None:
            with tracker.region(Kind.OPTIMIZER_TEMPS):
                in_backward[p].step()
                in_backward[p].zero_grad()

        for p in trainable:
            p.register_post_accumulate_grad_hook(step_now)

    def mark(phase: Phase, step: int) -> None:
        if should_abort is not None and should_abort():
            raise Aborted()
        if sync is not None:
            sync()
        tracker.set_phase(phase, step)
        if on_phase is not None:
            on_phase(tracker.phase_name, tracker.current)

    def timed(key: str, t0: float) -> None:
        if sync is not None:
            sync()
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0

    def collate(i: int) -> tuple[dict[str, torch.Tensor], dict | None]:
        """Micro-batch ``i`` as the data loader hands it over (on the device), with the image inputs a
        vision-language model's ``make_batch`` leaves for its forward (``_images``)."""
        if objective is not None:
            return objective.batch(i), None
        make_batch = getattr(model, "make_batch", None)  # a vision-language model adds its images
        if make_batch is None:
            return _make_batch(setup, plan.spec.vocab_size, device, real), None
        return make_batch(setup, device, real), getattr(model, "_images", None)

    # TRL's activation_offloading: its saved-tensors hooks around each micro-batch's forward and backward
    offload = offload_context(model, torch.device(device).type, setup) if setup.offloads_activations else None
    model.train()
    held: list = []  # HF Trainer's batch_samples (transformers/trainer.py get_batch_samples): see holds_batches
    for step in range(1, steps + 1):
        for i in range(micro):
            if objective is not None and objective.prepares_before(i):  # GRPO: generation and scoring
                objective.prepare(functools.partial(lambda step, ph: mark(ph, step), step))
            with offload if offload is not None else contextlib.nullcontext():
                mark(Phase.FORWARD, step)
                t0 = time.perf_counter()
                if i == 0 and holds_batches(objective):  # every micro-batch of the step, before its first forward;
                    held = [collate(j) for j in range(accum)]  # the previous step's go once the list is replaced
                batch, images = held[i] if held else collate(i)
                if images is not None:
                    model._images = dict(images)  # its forward takes them (and lets them go)
                if objective is None:
                    loss = model(batch["input_ids"], batch["labels"])
                else:
                    loss = objective.loss(batch, functools.partial(lambda step, ph: mark(ph, step), step))
                if accum > 1 and (objective is None or setup.objective is not Objective.GRPO):
                    loss = loss / accum  # HF Trainer scales the loss for accumulation (GRPO's loss already is)
                timed(f"forward@{step}", t0)
                mark(Phase.BACKWARD, step)
                t0 = time.perf_counter()
                if sharder is not None:
                    sharder.start_backward()
                loss.backward()
                if sharder is not None and sharder.params_sharded:
                    sharder.finish_backward()
                del loss, batch, images
                timed(f"backward@{step}", t0)
        mark(Phase.OPTIMIZER, step)
        t0 = time.perf_counter()
        if not setup.optimizer_in_backward:
            if sharder is not None:
                sharder.grads_to_partitions()
            with context.host() if offloaded else contextlib.nullcontext():  # ZeRO-Offload: a CPU step
                optimizer.step()
            for t in optimizer.state_tensors():
                tracker.reclassify(t, Kind.OPTIMIZER_STATES)
            if file_states is not None:
                file_states(optimizer, tracker)
            optimizer.zero_grad()
            if sharder is not None:
                sharder.zero_grad()
        timed(f"optimizer@{step}", t0)
    for opt in in_backward.values():
        for t in opt.state_tensors():
            tracker.reclassify(t, Kind.OPTIMIZER_STATES)
    tracker.finish()  # the last step's micro-batches (`held`) go with this frame, after the step's events
    return timing


def holds_batches(objective: ReferenceStep | None) -> bool:
    """Whether the step holds its micro-batches as HF Trainer does: ``get_batch_samples`` takes all
    ``gradient_accumulation_steps`` batches of an optimizer step from the data loader before the first forward
    (accelerate's ``DataLoaderShard`` moves each to the device as it yields it) and the list, and the loop's
    ``inputs``, keep them through the optimizer step until the next step's list replaces it. Not GRPO's: its data
    loader yields prompts (host data); its device batches are its generation buffer's."""
    return objective is None or objective.collates


def classify_parameters(model: Decoder, tracker: MemoryTracker) -> None:
    sh = model.plan.sharder

    def stored(t: torch.Tensor) -> torch.Tensor:
        shard = sh.shard_of(t) if sh is not None else None
        return t if shard is None else shard

    kind_of = getattr(model, "parameter_kind", None)  # a vision-language model's tower and projector
    for name, p in model.named_parameters():
        kind = kind_of(name) if kind_of is not None else None
        tracker.reclassify(stored(p), kind or (Kind.ADAPTERS if "lora_" in name else Kind.WEIGHTS), name)
    for name, b in model.named_buffers():
        kind = kind_of(name) if kind_of is not None else None
        tracker.reclassify(stored(b), kind or Kind.WEIGHTS, name)


def measure(
    spec: ModelSpec,
    setup: TrainingSetup,
    device: torch.device | str,
    real: bool,
    tracker: MemoryTracker,
    steps: int = 2,
    on_phase: PhaseCallback | None = None,
    should_abort: Callable[[], bool] | None = None,
    sync: Callable[[], None] | None = None,
    builder: Callable[..., Decoder] | None = None,
) -> StepRun:
    """Build the model under ``tracker`` and run the steps. The caller enters any FakeTensorMode first.
    ``builder(spec, setup, device=, real=)`` replaces the built-in model (e.g. the HF reference)."""
    timing: dict[str, float] = {}
    with context.active(tracker), tracker:
        tracker.set_phase(Phase.LOAD, 0)
        if on_phase is not None:
            on_phase("load", 0)
        t0 = time.perf_counter()
        model = (builder or build_model)(spec, setup, device=device, real=real)
        if sync is not None:
            sync()
        timing["load"] = time.perf_counter() - t0
        classify_parameters(model, tracker)
        total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
        total += _quantized_numel(model)
        trainable_params = [p for p in model.parameters() if p.requires_grad]
        trainable = sum(p.numel() for p in trainable_params)
        sharder = model.plan.sharder
        if sharder is not None:
            for p in trainable_params:
                sharder.register_trainable(p)
            sharder.optimizer_buffers()
            optimizer = make_optimizer([s for _p, s in sharder.opt_params], setup, release=sharder.release_grads)
        else:
            optimizer = make_optimizer(trainable_params, setup, model)
        objective = None
        if setup.objective is not Objective.SFT:  # DPO / GRPO: the reference model is loaded after the policy
            ref = build_reference(builder or build_model, spec, setup, torch.device(device), real)
            objective = piece(setup.objective, "reference").STEP(model, ref, setup, torch.device(device))
        timing.update(run_steps(model, optimizer, setup, tracker, steps, on_phase, should_abort, sync, objective))
        managed = optimizer.managed_bytes
    return StepRun(tracker, total, trainable, managed, timing, tuple(getattr(model, "notes", ())))


def _quantized_numel(model: torch.nn.Module) -> int:
    """Elements stored quantized (not counted by named_parameters)."""
    from vramlab.core.simulation.quant import QuantWeight

    return sum(m.rows * m.cols for m in model.modules() if isinstance(m, QuantWeight))
