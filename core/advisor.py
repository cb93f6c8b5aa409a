"""Advice with numbers: what to change to fit, the largest batch and sequence, and trade-off sweeps.

Every figure here is an estimate of the changed setup (:func:`vramlab.core.estimate.estimate`), so the
advice is as good as the estimator and each saving can be checked against a simulation or a profile.
Savings are compared at the device level (what must fit on the GPU). ``allocator=True`` takes the
allocator-reserved part of that level from the replay of each step through the caching-allocator model
(what ``vramlab estimate`` prints) rather than the sub-millisecond slack model; the fit search then
searches with the fast model and settles the boundary with the replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vramlab.core.checks import SetupError, check_int
from vramlab.core.estimate import estimate
from vramlab.core.result import MemLevel, MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import (
    Attention,
    DType,
    GenerationBackend,
    LossKernel,
    Method,
    Objective,
    Offload,
    Optimizer,
    OptimizerImpl,
    Reference,
    Sharding,
)
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.traced import Progress
from vramlab.core.units import GiB, MiB, fmt_bytes
from vramlab.core.vision import vision_tokens

if TYPE_CHECKING:
    from vramlab.core.traced import Progress

LEVEL = MemLevel.DEVICE


@dataclass(frozen=True)
class Saving:
    """One change to the setup and what it does."""

    key: str
    title: str
    setup: TrainingSetup
    before_bytes: int
    after_bytes: int
    cost: str
    trainable_before: int
    trainable_after: int
    fits: bool | None

    @property
    def saves_bytes(self) -> int:
        return self.before_bytes - self.after_bytes

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "saves_bytes": self.saves_bytes,
                "device_used_after_bytes": self.after_bytes, "fits": self.fits, "cost": self.cost,
                "trainable_params_after": self.trainable_after, "setup": self.setup.resolved()}


def _candidates(spec: ModelSpec, s: TrainingSetup) -> Iterable[tuple[str, str, dict[str, Any], str]]:
    """(key, title, changes, cost) for every change that applies to ``s``."""
    if not s.grad_ckpt:
        yield ("grad_ckpt", "Turn on gradient checkpointing", {"grad_ckpt": True},
               "about 30 % slower steps: each layer's forward runs again in backward")
    if s.optimizer in (Optimizer.ADAMW, Optimizer.LION, Optimizer.ADAFACTOR, Optimizer.SGD_MOMENTUM):
        yield ("adamw8bit", "8-bit AdamW (bitsandbytes)", {"optimizer": Optimizer.ADAMW_8BIT, "optimizer_impl": None},
               "states quantized block-wise; usually no loss in quality")
    if s.optimizer is not Optimizer.PAGED_ADAMW_8BIT and s.optimizer in (Optimizer.ADAMW, Optimizer.ADAMW_8BIT):
        yield ("paged", "Paged 8-bit AdamW", {"optimizer": Optimizer.PAGED_ADAMW_8BIT, "optimizer_impl": None},
               "large states live in CUDA managed memory and page to the host under pressure (slower when they do)")
    if s.optimizer.has_impl_choice and s.impl is not OptimizerImpl.FUSED and s.optimizer in (
            Optimizer.ADAMW, Optimizer.SGD, Optimizer.SGD_MOMENTUM):
        yield ("fused", "Fused optimizer step", {"optimizer_impl": OptimizerImpl.FUSED},
               "none on CUDA (torch's fused kernel); not available for every dtype/device")
    if s.method is Method.LORA:
        yield ("qlora", "QLoRA: 4-bit NF4 base", {"method": Method.QLORA, "weights": DType.NF4},
               "about 20-40 % slower matmuls (dequantization); small quantization error in the base")
    if s.method in (Method.FULL, Method.FREEZE):
        yield ("lora", "LoRA r16 on all linear layers instead", {"method": Method.LORA, "lora_rank": 16,
               "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
               "weights": DType.BF16 if s.weight_dtype is DType.FP32 else s.weights, "master_weights": False},
               "trains low-rank adapters only: fewer trainable parameters, usually a little lower quality")
    if s.method is Method.FULL:
        n = max(1, spec.num_layers // 4)
        yield ("freeze", f"Train only the last {n} layers", {"method": Method.FREEZE, "trainable_layers": n},
               "the frozen layers do not adapt")
    if s.uses_lora and s.lora_rank > 4:
        yield ("rank", f"LoRA rank {s.lora_rank // 2}", {"lora_rank": s.lora_rank // 2},
               "fewer adapter parameters; lower capacity")
    if s.uses_lora and len(s.lora_targets) > 2:
        yield ("targets", "LoRA on q_proj and v_proj only", {"lora_targets": ("q_proj", "v_proj")},
               "adapts attention only; usually lower quality than all-linear")
    if s.method is Method.FREEZE and s.trainable_layers and s.trainable_layers > 1:
        yield ("fewer_layers", f"Train {s.trainable_layers // 2} layers", {"trainable_layers": s.trainable_layers // 2},
               "fewer layers adapt")
    if s.attention is Attention.EAGER:
        yield ("sdpa", "SDPA / flash attention", {"attention": Attention.SDPA},
               "none: same math, no materialised score matrix")
    if not s.chunked_loss:
        yield ("chunked_loss", "Chunked loss (lm_head + cross entropy in 8 chunks)", {"chunked_loss": True},
               "a few % slower (lm_head recomputed per chunk); needs a trainer that supports it")
    if s.loss_kernel is LossKernel.HF and not s.chunked_loss and s.objective is Objective.SFT:
        yield ("trl_head", "TRL's fused LM head (SFTTrainer's loss)", {"loss_kernel": LossKernel.TRL},
               "no logits; the head runs again in backward, in tiles (TRL 1.x SFTTrainer's own loss)")
    if s.micro_batch > 1:  # the effective batch stays: halve an even micro batch, split an odd one into 1s
        smaller = s.micro_batch // 2 if s.micro_batch % 2 == 0 else 1
        accum = s.grad_accum * (s.micro_batch // smaller)
        yield ("accumulate", f"Micro batch {smaller} with accumulation x{accum}",
               {"micro_batch": smaller, "grad_accum": accum},
               "same effective batch, more, smaller steps (lower GPU utilisation)")
    if s.weight_dtype is DType.FP32 and s.compute is DType.FP32:
        yield ("bf16", "Pure bf16 instead of fp32", {"weights": DType.BF16, "compute": DType.BF16},
               "bf16 updates lose precision on small learning rates")
    if s.weight_dtype is DType.FP32 and s.autocast and s.method in (Method.FULL, Method.FREEZE):
        yield ("pure_bf16", "Pure bf16 weights (no fp32 copy)", {"weights": DType.BF16, "amp": None},
               "bf16 updates lose precision; keep an fp32 master (DeepSpeed) if quality suffers")
    if s.trainable_fp32 and s.weight_dtype in (DType.BF16, DType.FP16) and s.method in (Method.FULL, Method.FREEZE):
        yield ("trained_16bit", f"Trained layers in {s.weight_dtype.value} (LLaMA-Factory's pure_bf16: no fp32 upcast)",
               {"trainable_fp32": False}, "16-bit updates lose precision on small learning rates")
    if s.gpus > 1:
        for mode in (Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3):
            if _rank(mode) > _rank(s.sharding):
                yield (f"shard_{mode.value}", f"ZeRO stage {mode.value[-1]} across {s.gpus} GPUs",
                       {"sharding": mode}, "more communication per step (all-gathers / reduce-scatters)")
    if s.sharding is not Sharding.NONE and s.offload is Offload.NONE:
        yield ("offload", "Offload the optimizer to the CPU", {"offload": Offload.OPTIMIZER},
               "the optimizer step runs on the CPU: much slower steps, needs host RAM")
    yield from _vision_candidates(spec, s)
    if s.grad_accum == 1 and s.sharding is Sharding.NONE and not s.optimizer_in_backward:
        yield ("opt_in_bwd", "Optimizer step in backward", {"optimizer_in_backward": True},
               "no gradient accumulation or global gradient clipping")
    yield from _objective_candidates(s)


def _objective_candidates(s: TrainingSetup) -> Iterable[tuple[str, str, dict[str, Any], str]]:
    """The levers of preference training and GRPO (TRL 1.16.0's settings)."""
    obj = s.objective
    if obj is Objective.SFT:
        return
    ref = s.reference_mode
    if obj.no_reference:  # ORPO / SimPO / CPO: no reference to move; their logits follow batch and sequence
        return
    if obj is not Objective.GRPO and ref is not Reference.PRECOMPUTED:
        yield ("ref_precomputed", "Precompute the reference log-probabilities", {"reference": Reference.PRECOMPUTED},
               "one pass of the reference over the dataset before training (precompute_ref_log_probs); the "
               "reference stays fixed")
    if s.uses_lora and ref is Reference.COPY:
        yield ("ref_adapters", "LoRA as its own reference (adapters disabled)", {"reference": Reference.ADAPTERS},
               "none: the base with the adapters disabled is the initial policy (TRL's default with peft)")
    if obj is Objective.GRPO:
        if s.num_generations >= 4 and s.micro_batch % 2 == 0:
            yield ("fewer_generations", f"{s.num_generations // 2} generations per prompt, micro batch "
                   f"{s.micro_batch // 2}", {"num_generations": s.num_generations // 2,
                                             "micro_batch": s.micro_batch // 2},
                   "the same prompts per step with half the completions each: noisier group advantages")
        if s.generation_steps > 1:
            yield ("steps_per_generation", "Generate one micro-batch at a time", {"steps_per_generation": 1},
                   "more, smaller generate calls (slower generation); completions no longer reused across steps")
        if s.completion_tokens >= 128:
            half = s.completion_tokens // 2
            yield ("shorter_completions", f"Completions of {half} tokens", {"completion_len": half,
                                                                            "seq_len": s.prompt_tokens + half},
                   "longer answers are cut off (max_completion_length), which can hurt reasoning rewards")
        if s.generation_backend is GenerationBackend.VLLM_COLOCATE:
            if s.vllm_memory_fraction > 0.15:
                low = round(s.vllm_memory_fraction / 2, 2)
                yield ("vllm_fraction", f"vLLM memory fraction {low:g}", {"vllm_memory_fraction": low},
                       "a smaller KV cache for vLLM: fewer sequences generate at once (slower generation); it "
                       "must still hold the weights")
            if not s.vllm_sleep:
                yield ("vllm_sleep", "vLLM sleep mode", {"vllm_sleep": True},
                       "vLLM reloads its weights before every generation (slower steps)")
            yield ("vllm_server", "vLLM on a separate server", {"generation_backend": GenerationBackend.VLLM_SERVER},
                   "needs other GPUs for `trl vllm-serve`; weights are synced over the network each step")
        elif s.generation_backend is GenerationBackend.TRANSFORMERS:
            yield ("vllm_colocate_sleep", "vLLM colocated with sleep mode",
                   {"generation_backend": GenerationBackend.VLLM_COLOCATE, "vllm_sleep": True},
                   "vLLM's share (vllm_gpu_memory_utilization) is taken while it generates; much faster generation")


def _vision_candidates(spec: ModelSpec, s: TrainingSetup) -> Iterable[tuple[str, str, dict[str, Any], str]]:
    """A vision-language model's own levers: fewer pixels, a frozen tower, fewer frames, the tower checkpointed."""
    v = spec.vision
    if v is None:
        return
    tokens = vision_tokens(v.processor, s.vision_input())
    if v.processor.kind == "qwen_vl" and tokens.units:
        h, w = tokens.units[0].resized
        cap = (h * w) // 2
        factor = (v.processor.patch_size * v.processor.merge_size) ** 2
        cap -= cap % factor
        if cap >= max(v.processor.min_pixels, factor * 4):
            yield ("max_pixels", f"Max pixels {cap:,} (half the image's pixels)", {"max_pixels": cap},
                   "less image detail: the processor resizes each image to about half the vision tokens")
    if s.vision_tuning != "frozen":
        yield ("freeze_tower", "Freeze the vision tower and projector", {"vision_tuning": "frozen"},
               "the tower does not adapt (LLaMA-Factory's and ms-swift's default)")
    if s.pan_and_scan and tokens.units and tokens.units[0].tiles > 1:
        yield ("no_pan_and_scan", "Pan-and-scan off", {"pan_and_scan": False},
               "the model sees each image once at the tile size: no crops with finer detail")
    if s.frames > 2:
        yield ("fewer_frames", f"{s.frames // 2} video frames", {"frames": s.frames // 2},
               "half the frames sampled per video: less temporal detail")
    if s.grad_ckpt and not s.vision_ckpt:
        yield ("vision_ckpt", "Checkpoint the vision tower's blocks too", {"vision_ckpt": True},
               "the tower's forward runs again in backward (a few % slower)")


def _rank(mode: Sharding) -> int:
    return {Sharding.NONE: 0, Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3, Sharding.FSDP: 3}[mode]


def savings(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None = None,
            limit_bytes: int | None = None, allocator: bool = False,
            progress: Progress | None = None) -> list[Saving]:
    """Each applicable change with the memory it saves, ranked (largest first; changes that save nothing
    are left out). ``fits`` compares the changed setup's device level with ``limit_bytes`` (the fit
    search's budget: the GPU less a margin), or with the whole GPU when no limit is given. ``progress``: where a
    first trace reports (:func:`~vramlab.core.estimate.estimate`'s)."""
    base = estimate(spec, setup, gpu, allocator=allocator, progress=progress)
    if limit_bytes is None and gpu is not None:
        limit_bytes = gpu.memory_bytes
    out: list[Saving] = []
    for key, title, changes, cost in _candidates(spec, setup):
        try:
            changed = setup.replace(**changes)
            changed.validate(spec)  # a setup the estimate does not model is skipped
            r = estimate(spec, changed, gpu, allocator=allocator, progress=progress)
        except (SetupError, ValueError):
            continue
        if r.device_used_bytes >= base.device_used_bytes:
            continue
        out.append(Saving(key, title, changed, base.device_used_bytes, r.device_used_bytes, cost,
                          base.trainable_params, r.trainable_params,
                          None if limit_bytes is None else r.device_used_bytes <= limit_bytes))
    out.sort(key=lambda x: x.saves_bytes, reverse=True)
    return out


# ---- fit search -------------------------------------------------------------------------------------------

COMBINATION_DEPTH = 4  # the most changes a combination may make


@dataclass(frozen=True)
class FitAnswer:
    gpu: GpuSpec
    margin: float
    budget_bytes: int
    fits_now: bool
    device_used_now: int
    max_micro_batch: int  # 0: not even batch 1 fits
    max_seq_len: int  # at the setup's micro batch; 0: not even the shortest fits
    grad_accum_for_target: int | None
    target_batch: int | None
    suggestion: TrainingSetup | None
    savings: tuple[Saving, ...] = field(default_factory=tuple)
    seq_limit: int = 0  # the longest sequence searched: the model's positions (or the current length)
    seq_len: int = 0  # the sequence the largest micro batch was searched at (the setup's)
    micro_batch: int = 0  # the micro batch the longest sequence was searched at (the setup's)
    # when the setup does not fit and no single saving is enough: the fewest savings together that fit (None
    # when a single one is enough, the setup fits, or none of up to combination_depth changes does)
    combination: Combination | None = None
    combination_depth: int = COMBINATION_DEPTH  # the most changes together the combination search tried

    @property
    def single_change_fits(self) -> bool:
        return any(s.fits for s in self.savings)

    @property
    def seq_capped(self) -> bool:
        """The longest sequence is the model's position limit, not the memory's: longer would fit too."""
        return bool(self.seq_limit) and self.max_seq_len >= self.seq_limit

    @property
    def effective_batch(self) -> int | None:
        """The effective batch of the suggestion (micro batch x accumulation x GPUs)."""
        s = self.suggestion
        return s.micro_batch * s.grad_accum * s.gpus if s is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.name, "gpu_memory_bytes": self.gpu.memory_bytes, "margin": self.margin,
            "budget_bytes": self.budget_bytes, "fits_now": self.fits_now, "device_used_now_bytes": self.device_used_now,
            "max_micro_batch": self.max_micro_batch, "max_seq_len": self.max_seq_len,
            "max_seq_len_is_position_limit": self.seq_capped,
            "target_batch": self.target_batch, "grad_accum_for_target": self.grad_accum_for_target,
            "effective_batch": self.effective_batch,
            "suggestion": self.suggestion.resolved() if self.suggestion else None,
            "max_micro_batch_at_seq_len": self.seq_len, "max_seq_len_at_micro_batch": self.micro_batch,
            "savings": [s.to_json() for s in self.savings],
            "single_change_fits": self.single_change_fits,
            "combination": self.combination.to_json() if self.combination is not None else None,
        }


@dataclass(frozen=True)
class Combination:
    """Several savings applied one after another (each one offered by the setup the previous ones made)."""

    steps: tuple[tuple[str, str, str], ...]  # (key, title, cost)
    setup: TrainingSetup
    device_used_bytes: int
    trainable_params: int

    def to_json(self) -> dict[str, Any]:
        return {"changes": [{"key": k, "title": t, "cost": c} for k, t, c in self.steps],
                "device_used_bytes": self.device_used_bytes, "trainable_params": self.trainable_params,
                "setup": self.setup.resolved()}


def smallest_combination(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec | None, limit_bytes: int,
                         depth: int = COMBINATION_DEPTH, allocator: bool = False,
                         progress: Progress | None = None) -> Combination | None:
    """The fewest changes that together bring the device level within ``limit_bytes``: a breadth-first search
    over the savings, each level offering what the setup made so far allows (after LoRA, QLoRA and a smaller
    rank; after halving the micro batch, halving it again). A change that saves nothing where it is applied is
    not taken. Among the combinations of the fewest changes, the one that keeps the most trainable parameters
    wins, then the one with the most room left. None when no combination of up to ``depth`` changes fits.
    The search judges with the fast slack model; with ``allocator`` a combination is taken only when the
    replay through the allocator model fits too."""
    memo: dict[TrainingSetup, MemoryResult] = {}

    def used(s: TrainingSetup) -> MemoryResult:
        if s not in memo:
            memo[s] = estimate(spec, s, gpu, allocator=False, progress=progress)
        return memo[s]

    def settle(found: list[Combination]) -> Combination | None:
        for c in sorted(found, key=lambda c: (c.trainable_params, -c.device_used_bytes), reverse=True):
            if not allocator:
                return c
            exact = estimate(spec, c.setup, gpu, allocator=True, progress=progress).device_used_bytes
            if exact <= limit_bytes:
                return dataclasses.replace(c, device_used_bytes=exact)
        return None

    frontier: list[tuple[tuple[tuple[str, str, str], ...], TrainingSetup, int]] = \
        [((), setup, used(setup).device_used_bytes)]
    seen = {setup}
    largest = 0  # the largest saving one change has made anywhere so far
    for level in range(1, depth + 1):
        nxt: list[tuple[tuple[tuple[str, str, str], ...], TrainingSetup, int]] = []
        found: list[Combination] = []
        for steps, state, before in frontier:
            # alternatives for the same settings (8-bit or paged 8-bit AdamW) go on with the better one only
            best_of: dict[frozenset[str], tuple[tuple[str, str, str], TrainingSetup, MemoryResult]] = {}
            for key, title, changes, cost in _candidates(spec, state):
                try:
                    changed = state.replace(**changes)
                    changed.validate(spec)
                except (SetupError, ValueError):
                    continue
                if changed in seen:  # reached already by fewer or as many changes
                    continue
                r = used(changed)
                if r.device_used_bytes >= before:  # saves nothing here (it may from another state)
                    continue
                largest = max(largest, before - r.device_used_bytes)
                fields = frozenset(changes)
                if fields not in best_of or r.device_used_bytes < best_of[fields][2].device_used_bytes:
                    best_of[fields] = ((key, title, cost), changed, r)
            for step, changed, r in best_of.values():
                seen.add(changed)
                path = (*steps, step)
                if r.device_used_bytes <= limit_bytes:
                    found.append(Combination(path, changed, r.device_used_bytes, r.trainable_params))
                else:
                    nxt.append((path, changed, r.device_used_bytes))
        best = settle(found)
        if best is not None:
            return best
        # a state the remaining changes cannot bring within the limit, each saving at most the largest single
        # saving seen, is not expanded (it is recorded once: a tape per new structure costs tens of ms)
        frontier = [f for f in nxt if f[2] - (depth - level) * largest <= limit_bytes]
    return None


def budget(gpu: GpuSpec, margin: float) -> int:
    return int(gpu.memory_bytes * (1.0 - margin))


def _largest(fits: Callable[[int], bool], lo: int, hi: int, step: int = 1, guess: int | None = None) -> int:
    """The largest multiple of ``step`` in [lo, hi] for which the monotone ``fits`` holds (0 if none):
    galloping outwards from ``guess`` (default ``lo``; a close answer of a cheaper model takes a few
    calls), then bisecting."""
    guess = min(max(lo if guess is None else guess, lo), hi)
    guess -= guess % step
    guess = max(guess, lo)
    if fits(guess):
        good, d = guess, step
        while good + d <= hi and fits(good + d):
            good, d = good + d, d * 2
        bad = min(good + d, hi + step)
    else:
        bad, d = guess, step
        while bad - d >= lo and not fits(bad - d):
            bad, d = bad - d, d * 2
        if bad - d < lo:
            if bad == lo or not fits(lo):
                return 0
            good = lo
        else:
            good = bad - d
    while bad - good > step:  # fits(good), not fits(bad) (or bad past hi)
        mid = (good + bad) // 2
        mid -= mid % step
        if mid <= good:
            break
        if mid <= hi and fits(mid):
            good = mid
        else:
            bad = mid
    return good


MAX_TARGET_BATCH = 2**30  # samples per optimizer step; the largest real runs use a few thousand


def batch_for_target(target: int, gpus: int, max_micro: int) -> tuple[int, int]:
    """(micro batch, accumulation) reaching ``target`` samples per step on ``gpus`` GPUs with a micro
    batch of at most ``max_micro``: exactly where a micro batch of at least half the largest divides the
    per-GPU share, otherwise the largest micro batch and the accumulation that first reaches the target."""
    per_gpu = -(-target // gpus)  # integer ceiling: exact for any size
    top = min(max_micro, per_gpu)
    for b in range(top, max(1, (top + 1) // 2) - 1, -1):
        if per_gpu % b == 0:
            return b, per_gpu // b
    return top, -(-per_gpu // top)


def _objective_steps(setup: TrainingSetup, seq_step: int) -> tuple[int, int]:
    """(micro-batch step, shortest sequence) the search may try: GRPO's generation batch must stay divisible by
    its completions per prompt, and its sequence must hold the completion and a prompt."""
    if setup.objective is not Objective.GRPO:
        return 1, seq_step
    import math

    per_batch = setup.generation_steps * setup.gpus
    b_step = setup.num_generations // math.gcd(setup.num_generations, per_batch)
    return b_step, (setup.completion_tokens // seq_step + 1) * seq_step


def fit_search(spec: ModelSpec, setup: TrainingSetup, gpu: GpuSpec, margin: float = 0.1,
               target_batch: int | None = None, max_batch: int = 4096, seq_step: int = 64,
               allocator: bool = False, progress: Progress | None = None) -> FitAnswer:
    """The largest micro batch and the longest sequence (in ``seq_step`` tokens, up to the model's
    positions) whose device level stays within the GPU less ``margin``, and the micro batch and
    accumulation that reach ``target_batch``."""
    if not 0.0 <= margin < 0.9:
        raise SetupError("--margin must be between 0 and 0.9 (a fraction of the GPU's memory kept free)")
    if target_batch is not None:
        check_int("target_batch", target_batch, 1, MAX_TARGET_BATCH,
                  "--target-batch (samples per optimizer step, over all GPUs)")
    limit = budget(gpu, margin)
    now = estimate(spec, setup, gpu, allocator=allocator, progress=progress).device_used_bytes

    def fits(changes: str, exact: bool) -> Callable[[int], bool]:
        def check(v: int) -> bool:
            s = setup.replace(**{changes: v})
            return estimate(spec, s, gpu, allocator=exact, progress=progress).device_used_bytes <= limit
        return check

    # RoPE scaling can go past the positions a model was trained for; the search stops there and says so
    seq_limit = max(spec.max_position_embeddings, setup.seq_len, seq_step)
    seq_limit -= seq_limit % seq_step
    b_step, s_low = _objective_steps(setup, seq_step)
    max_b = _largest(fits("micro_batch", False), b_step, max_batch, b_step)
    max_s = _largest(fits("seq_len", False), s_low, seq_limit, seq_step) if s_low <= seq_limit else 0
    if allocator:  # the replayed allocator moves the boundary a little: settle it from the fast answer
        max_b = _largest(fits("micro_batch", True), b_step, max_batch, b_step, guess=max_b)
        max_s = _largest(fits("seq_len", True), s_low, seq_limit, seq_step, guess=max_s) if s_low <= seq_limit \
            else 0
    accum = None
    suggestion = None
    if max_b:
        suggestion = setup.replace(micro_batch=max_b)
        if target_batch:
            micro, accum = batch_for_target(target_batch, setup.gpus, max_b)
            suggestion = setup.replace(micro_batch=micro, grad_accum=accum)
    saves = () if now <= limit else tuple(savings(spec, setup, gpu, limit_bytes=limit, allocator=allocator,
                                                  progress=progress))
    combination = None
    if saves and not any(s.fits for s in saves):
        combination = smallest_combination(spec, setup, gpu, limit, allocator=allocator, progress=progress)
    return FitAnswer(gpu, margin, limit, now <= limit, now, max_b, max_s, accum, target_batch, suggestion, saves,
                     seq_limit, seq_len=setup.seq_len, micro_batch=setup.micro_batch, combination=combination)


# ---- sweeps ---------------------------------------------------------------------------------------------------

SWEEPS = ("seq_len", "micro_batch", "lora_rank", "trainable_layers", "weights")


@dataclass(frozen=True)
class SweepPoint:
    value: Any
    result: MemoryResult | None
    error: str = ""

    @property
    def trainable_params(self) -> int:
        return self.result.trainable_params if self.result else 0


def sweep_values(spec: ModelSpec, setup: TrainingSetup, field_name: str) -> list[Any]:
    if field_name == "seq_len":
        return [2**k for k in range(7, 16)]
    if field_name == "micro_batch":
        return [1, 2, 4, 8, 16, 32, 64]
    if field_name == "lora_rank":
        return [1, 2, 4, 8, 16, 32, 64, 128, 256]
    if field_name == "trainable_layers":
        n = spec.num_layers
        return sorted({1, 2, 4, 8, n // 4, n // 2, 3 * n // 4, n} - {0})
    if field_name == "weights":
        return [DType.FP32, DType.BF16, DType.INT8, DType.NF4]
    raise SetupError(f"no sweep over {field_name!r}; choose one of {', '.join(SWEEPS)}")


def sweep(spec: ModelSpec, setup: TrainingSetup, field_name: str, values: Iterable[Any] | None = None,
          gpu: GpuSpec | None = None, allocator: bool = False) -> list[SweepPoint]:
    """Memory against one setting, with the trainable parameter count alongside. The weights sweep moves
    the method with the storage (fp32/bf16: full or LoRA as set; int8/nf4: QLoRA)."""
    out = []
    for v in values if values is not None else sweep_values(spec, setup, field_name):
        changes: dict[str, Any] = {field_name: v}
        if field_name == "lora_rank" and not setup.uses_lora:
            changes["method"] = Method.LORA
        if field_name == "trainable_layers":
            changes["method"] = Method.FREEZE
        if field_name == "weights":
            if DType(v).is_quantized:
                changes["method"] = Method.QLORA
            elif setup.method is Method.QLORA:
                changes["method"] = Method.LORA
            if DType(v) is DType.FP32 and setup.compute is not DType.FP32:
                changes["amp"] = None
        try:
            s = setup.replace(**changes)
            s.validate(spec)
            out.append(SweepPoint(v, estimate(spec, s, gpu, allocator=allocator)))
        except (SetupError, ValueError) as e:
            out.append(SweepPoint(v, None, str(e)))
    return out


def sweep_current(setup: TrainingSetup, field_name: str) -> Any | None:
    """The setup's own value of the swept setting, or None when the sweep changes the method (a LoRA-rank
    sweep of a full fine-tune, a trainable-layers sweep of a LoRA run)."""
    if field_name == "lora_rank":
        return setup.lora_rank if setup.uses_lora else None
    if field_name == "trainable_layers":
        return setup.trainable_layers if setup.method is Method.FREEZE else None
    if field_name == "weights":
        return setup.weight_dtype
    return getattr(setup, field_name)


def sweep_values_with_current(spec: ModelSpec, setup: TrainingSetup, field_name: str) -> list[Any]:
    """The standard values of ``field_name`` plus the setup's own value (so it is always a point)."""
    values = list(sweep_values(spec, setup, field_name))
    now = sweep_current(setup, field_name)
    if now is not None and now not in values:
        if field_name == "weights":
            order = list(DType)
            values.append(now)
            values.sort(key=order.index)
        else:
            values = sorted([*values, now])
    return values


@dataclass(frozen=True)
class Sweep:
    """A computed sweep and what it was computed for (``current``: the setup's own value, or None)."""

    field: str
    points: tuple[SweepPoint, ...]
    model: ModelSpec
    setup: TrainingSetup
    gpu: GpuSpec | None
    current: Any | None

    def bytes_at(self, level: MemLevel) -> list[int | None]:
        return [p.result.bytes_at(level) if p.result else None for p in self.points]

    def fits(self) -> list[bool | None]:
        return [p.result.fits(self.gpu, MemLevel.DEVICE) if p.result and self.gpu else None for p in self.points]


def sweep_around(spec: ModelSpec, setup: TrainingSetup, field_name: str, gpu: GpuSpec | None = None,
                 allocator: bool = False) -> Sweep:
    """:func:`sweep` over the standard values and the setup's own, with what it was computed for."""
    points = sweep(spec, setup, field_name, sweep_values_with_current(spec, setup, field_name), gpu=gpu,
                   allocator=allocator)
    return Sweep(field_name, tuple(points), spec, setup, gpu, sweep_current(setup, field_name))


# ---- allocator advice and checklist ----------------------------------------------------------------------------

FRAGMENTATION_NOTICE = 512 * MiB


def allocator_advice(result: MemoryResult) -> list[str]:
    """When the caching allocator's slack matters, what PYTORCH_CUDA_ALLOC_CONF can do about it."""
    slack = result.peak_reserved_bytes - result.peak_allocated_bytes
    tips: list[str] = []
    tight = result.gpu is not None and result.headroom_bytes() is not None and \
        result.headroom_bytes() < max(slack, 1 * GiB)
    if slack >= FRAGMENTATION_NOTICE or tight:
        tips.append(
            f"The allocator is predicted to hold {fmt_bytes(slack)} more than the tensors need at the peak "
            "(cached blocks that do not fit the next request). Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "so segments grow in place instead of fragmenting; it is the most effective single setting for "
            "training with changing sequence lengths.")
        tips.append(
            "If expandable segments are not available (older torch, some platforms), "
            "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 stops large blocks from being split for small "
            "requests, at the cost of more cudaMalloc calls.")
        tips.append(
            "torch.cuda.empty_cache() returns cached blocks to the driver (nvidia-smi drops) but does not make "
            "more memory available to torch itself; call it only between phases (e.g. after evaluation), "
            "never inside the training step.")
    return tips


def checklist(spec: ModelSpec, setup: TrainingSetup, result: MemoryResult) -> list[tuple[str, str]]:
    """Pre-training checks tied to this setup: (item, why)."""
    items = [
        ("Run a baseline with live NVML monitoring",
         "Profile two steps on the target GPU (VRAM Lab's Profile view) before the long run: it measures "
         "the CUDA context and allocator overhead this estimate can only model."),
        ("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
         "Reduces fragmentation; the reserved level moves towards the tensor level."),
        ("Leave torch.backends.cudnn.benchmark off for transformer fine-tuning",
         "cuDNN autotuning helps convolutions, not attention/matmul-bound models, and its trial workspaces "
         "add transient memory."),
    ]
    if setup.seq_len > spec.max_position_embeddings:
        items.append(("Configure RoPE scaling", f"The sequence ({setup.seq_len}) exceeds the model's "
                                                f"{spec.max_position_embeddings} positions."))
    if setup.grad_ckpt and setup.method in (Method.LORA, Method.QLORA, Method.FREEZE):
        items.append(("Enable input gradients with checkpointing",
                      "With frozen embeddings and reentrant checkpointing, call model.enable_input_require_grads() "
                      "(HF does it for peft models) or the trainable layers receive no gradient."))
    if setup.optimizer.is_paged:
        items.append(("Watch nvidia-smi, not only torch's counters",
                      "Paged optimizer states live in CUDA managed memory, outside torch.cuda.memory_allocated()."))
    if setup.objective.no_reference:
        items.append(("These trainers keep the full logits",
                      "TRL 1.16's ORPOTrainer / CPOTrainer (trl.experimental; SimPO is CPO's loss_type simpo) run "
                      "chosen and rejected through one forward and keep their logits over the whole vocabulary "
                      "(2 x micro batch x sequence x vocabulary), copy the chosen rows for their NLL term (in fp32 "
                      "under autocast) and write a logits-sized gradient: the micro batch and the sequence are the "
                      "levers (gradient accumulation keeps the effective batch). DPO with precomputed reference "
                      "log-probabilities scores only completion tokens, in tiles."))
    elif setup.objective is not Objective.SFT:
        items.append(("Log-probabilities are already computed in chunks",
                      "TRL 1.16's DPOTrainer and GRPOTrainer score completion tokens through add_fused_lm_head "
                      "(tiles of 4096 tokens x 32768 vocabulary entries): no batch x sequence x vocabulary logits "
                      "exist, so a chunked loss has nothing left to save. Older TRL still materialises the logits."))
    if setup.objective is Objective.GRPO and setup.generation_backend is GenerationBackend.VLLM_COLOCATE:
        items.append(("Leave vLLM's share free",
                      f"vLLM takes {setup.vllm_memory_fraction:g} of the whole GPU (gpu_memory_utilization) and "
                      "refuses to start when less is free: the training step must fit in the rest."))
    if result.gpu is not None and not result.fits():
        items.append(("It does not fit yet", "See the ranked savings: each change lists the memory it saves."))
    return items

