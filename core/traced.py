"""Which tape an estimate replays, and the traced one: its keys, its pieces and its fallbacks.

Two sources write the estimator's tape: the hand-written program (:mod:`.estimator.program`, no torch,
the fast path for the families written by hand) and the trace of transformers' own classes
(:mod:`.measure.trace`, any architecture transformers builds; torch, transformers and peft needed).
``ModelSpec.tape`` chooses: ``auto`` (hand-written where there is a program, else traced), ``hand-written``
or ``traced``. An architecture only traced (``ModelSpec.transformers_config``) has no program.

A traced tape is keyed by the model (its canonical transformers config, or the hand-written spec), the
recipe's structure (every setting but the batch, sequence and rank it is fitted in), the sequence piece,
and the versions of torch, transformers, peft and VRAM Lab; it is kept in memory and in the user's cache
folder (:class:`~.estimator.stored.TraceStore`). The sequence range is cut where the config says the step
changes form (a sliding window, an attention chunk); when a piece still cannot be fitted, the tape is
traced for the one sequence length asked, and when that fails too, the full model at exactly the point
asked (a direct simulation). Each answer says which.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import operator
from collections.abc import Callable
from enum import Enum

import numpy as np

from vramlab.core.cache import key_digest
from vramlab.core.checks import SetupError
from vramlab.core.estimator.stored import FITTED, FORMAT, SEQUENCE_FIXED, TracedTape, TraceStore
from vramlab.core.objectives import unit
from vramlab.core.objectives.shared.trl import TOKEN_CHUNK_SIZE
from vramlab.core.spec.liger import experts_note
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import LossKernel, Method, Objective, Sharding
from vramlab.core.spec.targets import MLP_TARGETS
from vramlab.core.spec.training import SETUP_BOUNDS, TrainingSetup
from vramlab.core.spec.unsloth_gc import unsloth_gc_runs
from vramlab.core.tracing.requirements import check_available, installed, missing
from vramlab.core.versions import trace_versions

Progress = Callable[[str, float], None]

STORE = TraceStore()
_SIZES = ("micro_batch", "seq_len", "lora_rank")
_LENGTH_KEYS = ("sliding_window", "attention_chunk_size")  # config keys at which the step changes form


def uses_trace(spec: ModelSpec, setup: TrainingSetup | None = None) -> bool:
    """Whether the estimate of ``spec`` (under ``setup``, when given) replays the traced tape: asked for, an
    architecture only traced, or ``auto`` on a recipe the hand-written program does not model where the
    trace can run (:func:`adapts_experts`)."""
    if spec.tape == "traced" or spec.transformers_config:
        return True
    if setup is not None and setup.offloads_activations:  # the hand-written program does not model it
        return True
    return (spec.tape == "auto" and setup is not None and (adapts_experts(spec, setup) or liger_experts(spec, setup))
            and installed() and setup.objective is Objective.SFT)


def check_offloading(spec: ModelSpec, setup: TrainingSetup) -> None:
    """Activation offloading is answered by transformers' own classes traced at the sizes asked (its 1,024-byte
    threshold decides per tensor): refused, with the reason, where that cannot run."""
    if not setup.offloads_activations:
        return
    if spec.tape == "hand-written":
        raise SetupError("the hand-written program does not model activation offloading (--offload-activations): "
                         "use --source auto or traced")
    if missing():
        raise SetupError(f"activation offloading is estimated from a trace of transformers' own classes, which needs "
                         f"{', '.join(missing())} (pip install 'vramlab[hf]')")


def adapts_experts(spec: ModelSpec, setup: TrainingSetup) -> bool:
    """LoRA on the MLP of a mixture of experts: peft adapts transformers 5's fused expert tensors for some
    families (Mixtral, Qwen3-MoE: ``target_parameters``, a full-size delta weight in the forward) and none for
    others (Qwen1.5/2-MoE), which the hand-written program does not model; ``auto`` traces it."""
    return spec.is_moe and setup.uses_lora and any(t in MLP_TARGETS for t in setup.lora_targets)


def liger_experts(spec: ModelSpec, setup: TrainingSetup) -> bool:
    """Liger's ``LigerExperts`` on a hand-written mixture of experts (``--liger-kernels glu``): it reads
    transformers 5's fused expert tensors, which the hand-written program does not hold; ``auto`` traces it."""
    return spec.is_moe and experts_note(spec, setup.liger_kernels) is not None


# The revision of the traced step beyond the library versions (a tape cached under another is a miss): 2 since
# a hand-written MoE spec is traced as its own family (core/tracing/hf.py's hf_config; Mixtral's shape before)
# and dropout runs as CUDA dispatches it (core/simulation/cuda_dropout.py); 3 since a tape names the modules peft
# adapted (its meta's lora_modules, for the note); 4 since the head's output is freed where the model's forward
# post-processes its logits (a softcap, a logit scale: core/tracing/hf.py's head hook keeps only its node); 5 since
# the step holds every micro-batch of an optimizer step as HF Trainer's get_batch_samples does (each accumulation
# its own tape); 6 since a vision-language model runs transformers' Hub kernels as a text model does (its tower's
# decorated norms too: core/spec/hub_kernels.py), and a hand-written one is traced as its family's classes (its
# text model alone before); 7 since the Mamba-2 mixers run mamba-ssm's fused mamba_split_conv1d_scan_combined in
# training, the gated-delta-rule families fla's chunk_gated_delta_rule and FusedRMSNormGated, and causal-conv1d's
# causal_conv1d_fn runs where the conv is called (LFM2, Qwen3.5...: core/simulation/mamba.py, fla.py,
# causal_conv1d.py), their torch path before
TRACE_REVISION = 7


def model_key(spec: ModelSpec) -> object:
    if spec.transformers_config:
        return {"transformers_config": spec.transformers_config}
    d = spec.to_dict()
    for name in ("id", "name", "source", "notes", "published_params", "tape"):
        d.pop(name, None)
    return d


_RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingSetup) if f.name not in _SIZES)
_recipe_values = operator.attrgetter(*_RECIPE_FIELDS)
_KEYS: dict[tuple, str] = {}  # traced_tape's cache keys by what decides them (a digest costs 0.05-0.1 ms)
_LORA_ONLY = tuple(_RECIPE_FIELDS.index(name) for name in ("lora_alpha", "lora_dropout", "lora_targets"))
_FIELDS = key_digest(_RECIPE_FIELDS)  # the names of the recipe's settings, in the order a key lists them
_KEY_TEXT = json.JSONEncoder(sort_keys=True, separators=(",", ":"))  # a key's canonical JSON, the encoder made once


@functools.lru_cache(maxsize=64)
def _config_digest(config: str) -> str:
    """A transformers config's digest: what a tape's key holds of it (the config itself, escaped as JSON inside
    the key, took most of the first look-up's key). BLAKE2b, Python's own: hashlib's SHA-256 asks OpenSSL 3 for
    the algorithm by name on every call (10 us)."""
    return hashlib.blake2b(config.encode(), digest_size=32).hexdigest()


def tape_key(spec: ModelSpec, setup: TrainingSetup, where: dict, cuda: bool) -> str:
    """The file name of a traced tape: a digest of the model (its transformers config, else the spec), every
    setting of the recipe but its sizes (what :func:`recipe_key` holds, as a list in the order of
    :data:`_RECIPE_FIELDS`, whose names the key holds too), whether the batch is one, the versions, the piece
    (``where``) and ``cuda``. Made once per process for each (:data:`_KEYS`): 20-40 us, the first time."""
    model = _config_digest(spec.transformers_config) if spec.transformers_config else key_digest(model_key(spec))
    values = list(_recipe_values(setup))  # its enums are StrEnums, which JSON writes as their values
    if not setup.uses_lora:
        for i in _LORA_ONLY:
            values[i] = None
    text = _KEY_TEXT.encode([FORMAT, TRACE_REVISION, _FIELDS, model, values, setup.micro_batch == 1, trace_versions(),
                            where, cuda])
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


def recipe_key(setup: TrainingSetup) -> dict:
    """Every setting that decides the step's form (the sizes it is fitted in left out)."""
    out = {}
    for name, v in zip(_RECIPE_FIELDS, _recipe_values(setup)):
        out[name] = v.value if isinstance(v, Enum) else list(v) if isinstance(v, tuple) else v
    if not setup.uses_lora:
        for name in ("lora_alpha", "lora_dropout", "lora_targets"):
            out.pop(name)
    return out


def breakpoints(spec: ModelSpec) -> list[int]:
    """Sequence lengths from which the step changes form (transformers builds a sliding-window mask once
    the sequence reaches the window), from the spec and its transformers config."""
    found = {spec.sliding_window} if spec.sliding_window else set()
    return sorted(found.union(_config_lengths(spec.transformers_config)))


@functools.lru_cache(maxsize=64)
def _config_lengths(config: str) -> tuple[int, ...]:
    """:func:`breakpoints` of a transformers config (JSON), read once per config: every look-up asks."""
    if not any(k in config for k in _LENGTH_KEYS):  # most configs have neither (parsing one costs 30-50 us)
        return ()
    cfg = json.loads(config)
    found = []
    for part in (cfg, cfg.get("text_config") or {}):
        for k in _LENGTH_KEYS:
            v = part.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                found.append(v)
    return tuple(found)


def piece(spec: ModelSpec, s: int) -> tuple[int, int]:
    """The sequence range [lo, hi) holding ``s`` in which the step keeps one form (hi: the largest length):
    between two breakpoints, and within one chunk of a chunked kernel, which pads the sequence to a multiple of
    its chunk (Qwen3.5's gated delta rule, Mamba-2's scan in Granite 4, Falcon-H1, Nemotron-H...)."""
    lo, hi = 1, SETUP_BOUNDS["seq_len"][1] + 1
    for bp in breakpoints(spec):
        if bp <= s:
            lo = bp
        else:
            hi = bp
            break
    for period in _chunk_periods(spec.transformers_config):
        start = (s - 1) // period * period + 1  # lengths start + 0 .. start + period - 1 pad to the same size
        lo, hi = max(lo, start), min(hi, start + period)
    return lo, hi


@functools.lru_cache(maxsize=64)
def _chunk_periods(config: str) -> tuple[int, ...]:
    """The chunk lengths of a transformers config's chunked kernels (:func:`chunk_periods`), read once."""
    if not config:
        return ()
    from vramlab.core.tracing.hfconfig import chunk_periods

    return chunk_periods(json.loads(config))


def length_stride(setup: TrainingSetup) -> int:
    """2 where the step's sizes follow half the sequence rounded down (a DPO / KTO completion left at its default,
    ``seq_len // 2`` tokens: the tokens TRL's fused LM head scores, its 32,768-wide tile a row each), which a
    polynomial in the length follows over lengths of one parity only; else 1."""
    return 2 if setup.completion_len is None and unit(setup.objective).half_sequence else 1


def head_tokens(setup: TrainingSetup) -> int:
    """The tokens one call of TRL's fused LM head scores in ``setup``'s step (0: its objective does not call it)."""
    return unit(setup.objective).head_rows * setup.micro_batch * setup.completion_tokens


def fit_lengths(lo: int, hi: int, stride: int = 1, s: int = 0) -> tuple[tuple[int, ...], int] | None:
    """Three sequence lengths to fit at and one to verify at, inside [lo, hi) and congruent to ``s`` modulo
    ``stride`` (:func:`length_stride`) (None: too narrow)."""
    if hi - lo > 4096:  # an open range: lengths near its start (fake tensors cost the same at any length)
        base = max(lo, 2)
        fit, check = (base + 39, base + 62, base + 87), base + 50
    elif hi - lo < 16:
        return None
    else:
        span = hi - lo
        fit = tuple(lo + span * k // 16 for k in (4, 8, 13))
        check = lo + span * 11 // 16
    fit = tuple(sorted({x + (s - x) % stride for x in fit}))  # the next length of s's residue (still below hi)
    check += (s - check) % stride
    if len(fit) < 3 or check in fit or min(fit) < 2 or max(fit + (check,)) >= hi:
        return None
    return fit, check


def _marker(note: str) -> TracedTape:
    """No tape here, and why (kept like a tape, so that a fresh process need not find out again)."""
    z = np.zeros((0,), dtype=np.int64)
    return TracedTape(np.zeros((0, 8), dtype=np.int64), z, z, z, z, z, z, (), {}, (False, False, False), 0, 0, 0,
                      "", note, trace_versions()["transformers"], 0.0, {"marker": True})


def prefetch(most: int = 8) -> int:
    """Read the most recently used traced tapes from the disk cache into memory (the window does this once it
    is idle after start-up): a traced model picked after a restart then answers from memory. Nothing where the
    trace is not available (the estimator-only build). Returns how many tapes were read."""
    if missing():
        return 0
    return STORE.prefetch(most)


def cached_tape(spec: ModelSpec, setup: TrainingSetup, cuda: bool = True) -> TracedTape | None:
    """The traced tape when it is in memory or on disk (None: a trace is needed), without tracing."""
    try:
        return traced_tape(spec, setup, cuda=cuda, trace=False)
    except SetupError:
        return None


def traced_tape(spec: ModelSpec, setup: TrainingSetup, progress: Progress | None = None,
                should_abort: Callable[[], bool] | None = None, cuda: bool = True,
                store: TraceStore | None = None, trace: bool = True) -> TracedTape | None:
    """The traced tape for ``setup`` on ``spec`` (from memory, the disk cache, or a new trace).

    ``cuda``: with CUDA's in-place gradient accumulation and fp32 LayerNorm statistics (else the tape of the
    fake-tensor simulation itself, which ``simulate --hf`` measures). A trace writes both."""
    check_available()
    store = store or STORE
    b, s, r = setup.micro_batch, setup.seq_len, setup.lora_rank
    # what decides the key, as one tuple: the model (its config, else the spec), the recipe's settings but the
    # sizes, and whether the batch is one
    ident = (spec.transformers_config or spec, _recipe_values(setup), b == 1)

    def key(where: dict, c: bool) -> str:  # a digest per model, recipe structure and piece, made once
        memo = (ident, repr(where), c)
        found = _KEYS.get(memo)
        if found is None:
            found = tape_key(spec, setup, where, c)
            if len(_KEYS) >= 4096:
                _KEYS.clear()
            _KEYS[memo] = found
        return found

    lo, hi = piece(spec, s)
    if setup.completion_len and lo <= setup.completion_len < s:  # every fitted length keeps a prompt beside the
        lo = setup.completion_len + 1  # completion asked (the setup refuses a sequence no longer than it)
    stride = length_stride(setup)
    lengths = fit_lengths(lo, hi, stride, s)
    span = {"piece": [lo, hi], **({"parity": s % 2} if stride == 2 else {})}
    within = f"{'odd' if s % 2 else 'even'} sequences" if stride == 2 else "sequence"
    # a sharded tensor's partition is ceil(numel / N) elements, which has no polynomial form in the LoRA rank: the
    # rank is fitted at the one asked, and part of the key
    rank = {"lora_rank": r} if setup.uses_lora and setup.sharding is not Sharding.NONE else {}
    halves = unit(setup.objective).half_batch
    # every size fixed at the one asked, the layers alone fitted: for activation offloading's 1,024-byte threshold,
    # and past the 4,096 rows where TRL's fused LM head's tile stops growing (a tile per call of the head, after the
    # layers: the layers' events do not depend on it)
    # (a fused loss kernel, whose sizes have no polynomial form in batch or length, is such a head too)
    layers_only = ({"seq_len": s, "micro_batch": b, "lora_rank": r, "layers": "fitted"},
                   lambda why: _fitted(spec, setup, progress, should_abort, ((s,), s), f"batch {b}, sequence {s}", why,
                                       point=True))
    tries = [
        *([] if halves else [({**span, **rank}, lambda why: _fitted(spec, setup, progress, should_abort, lengths,
                                                                    f"{within} {lo} to {hi - 1}", why))]),
        # a vision-language step whose form changes with the batch (a loop over its images: Qwen-VL's attention
        # per image), or an objective that halves the batch, fitted in sequence and rank for this batch
        *([({**span, "micro_batch": b, **rank},
            lambda why: _fitted(spec, setup, progress, should_abort, lengths, f"{within} {lo} to {hi - 1}",
                                why, batch_fixed=True))] if b > 1 and (spec.vision is not None or halves) else []),
        ({"seq_len": s}, lambda why: _fitted(spec, setup, progress, should_abort, ((s,), s), f"sequence {s}", why)),
        *([layers_only] if setup.offloads_activations or unsloth_gc_runs(setup) or setup.loss_kernel in _HEAD_KERNELS
          else []),
        ({"seq_len": s, "micro_batch": b, "lora_rank": r},
         lambda why: _direct(spec, setup, progress, should_abort, why)),
    ]
    why = f"{setup.objective.value.upper()} halves the batch, rounded down" if halves else ""
    if head_tokens(setup) > TOKEN_CHUNK_SIZE:  # its tile stops growing there: the sizes asked, the layers fitted
        tries = [layers_only, tries[-1]]
        why = (f"TRL's fused LM head scores {head_tokens(setup):,} tokens a call, past the {TOKEN_CHUNK_SIZE:,} rows "
               "its tile stops growing at, which has no polynomial form in batch or length")
    for where, make in tries:
        rec = store.get(key(where, cuda))
        if rec is None:
            if not trace:
                return None
            made = make(why)
            for c in (True, False):
                store.put(key(where, c), made[c])
            rec = made[cuda]
        if not rec.meta.get("marker"):
            return rec
        why = rec.note
    raise SetupError(f"{spec.name}: transformers' step cannot be traced here ({why})")


# loss kernels of the head alone (one call after the layers), whose sizes no polynomial in batch or length follows
_HEAD_KERNELS = {
    LossKernel.CCE: ("Cut Cross Entropy's lock arrays (a lock per 128 tokens) have no polynomial form in batch or "
                     "length"),
    LossKernel.TRL: "TRL's fused LM head (a tile of min(tokens, 4096) rows) has no polynomial form in batch or length",
    LossKernel.LIGER: ("Liger's fused linear cross-entropy makes its logits a power of two of tokens at a time, which "
                       "has no polynomial form in batch or length"),
}


def _fitted(spec: ModelSpec, setup: TrainingSetup, progress: Progress | None,
            should_abort: Callable[[], bool] | None, lengths: tuple[tuple[int, ...], int] | None, where: str,
            why_fixed: str, batch_fixed: bool = False, point: bool = False) -> dict[bool, TracedTape]:
    """Fitted tapes (CUDA's and the simulation's), or markers saying why there are none (``point``: every size
    fixed at the one asked, the layers alone fitted)."""
    from vramlab.core.tracing.capture import TraceFailed
    from vramlab.core.tracing.trace import Plan, supported, trace_fitted

    fixed = bool(lengths) and len(lengths[0]) == 1
    reason = supported(setup) or (None if lengths else f"the {where} range is too narrow to fit")
    if reason is None and setup.chunked_loss and not fixed:  # torch.chunk: ceil(s / n) tokens a chunk
        reason = f"a loss in {setup.loss_chunks} chunks of the sequence has no polynomial form in its length"
    if reason is None and not point:
        reason = _HEAD_KERNELS.get(setup.loss_kernel)
    if reason is None and setup.offloads_activations and not point:
        reason = ("TRL's activation offloading moves a saved tensor only from 1,024 bytes on, which has no polynomial "
                  "form in batch or length")
    if reason is None and unsloth_gc_runs(setup) and not point:
        reason = ("Unsloth's checkpointing offloads a layer input only over 2 MiB, which has no polynomial form in "
                  "batch or length")
    if reason is None and setup.unsloth_kernels:
        reason = "Unsloth's fused LoRA kernels are modelled on the hand-written families' programs, not traced"
    if reason is not None:
        return dict.fromkeys((True, False), _marker(reason))
    kept = 0
    if setup.method is Method.FREEZE:  # the trained last layers at their full count, the frozen ones repeated
        if task_note(spec):
            return dict.fromkeys((True, False), _marker("freezing the last layers of an encoder-decoder (which "
                                                        "stack's?) is not traced"))
        kept = min(int(setup.trainable_layers or 0), spec.num_layers)
    # a vision-language class's build validates the setup, and GRPO's generation batch must be a multiple of its
    # completions per prompt (TRL's check): its batch is not fitted (a batch of 3 would fail that check)
    grpo = setup.objective is Objective.GRPO and spec.vision is not None
    plan = Plan(spec, setup, spec.transformers_config, spec.num_layers,
                (setup.micro_batch > 1 and not batch_fixed and not point and not grpo, not fixed,
                 setup.uses_lora and setup.sharding is Sharding.NONE and not point), *lengths, kept=kept)
    try:
        made = trace_fitted(plan, progress, should_abort)
    except TraceFailed as e:
        return dict.fromkeys((True, False), _marker(str(e)))
    out = {}
    for cuda, rec in made.items():
        if isinstance(rec, TraceFailed):
            out[cuda] = _marker(str(rec))
        elif fixed:
            out[cuda] = dataclasses.replace(rec, mode=SEQUENCE_FIXED, note=f"{why_fixed}; {rec.note}")
        elif batch_fixed:
            out[cuda] = dataclasses.replace(rec, note=f"for batch {setup.micro_batch} only ({why_fixed}); {rec.note}")
        else:
            out[cuda] = rec
    return _with_task_note(spec, out)


def task_note(spec: ModelSpec) -> str:
    """What a traced encoder-decoder assumes of its decoder (the setup has no decoder length of its own):
    transformers trains it with the labels as the decoder's input, shifted right, so the decoder reads as
    many tokens as the labels hold; VRAM Lab's labels are the input's ids, so ``--seq`` is both lengths."""
    if spec.transformers_config and '"is_encoder_decoder":true' in spec.transformers_config:
        return "encoder-decoder: decoder labels as long as the input (the sequence length is both the encoder's and " \
               "the decoder's)"
    return ""


def _with_task_note(spec: ModelSpec, made: dict[bool, TracedTape]) -> dict[bool, TracedTape]:
    note = task_note(spec)
    if not note:
        return made
    return {c: rec if rec.meta.get("marker") else dataclasses.replace(rec, note=f"{rec.note}; {note}")
            for c, rec in made.items()}


def _direct(spec: ModelSpec, setup: TrainingSetup, progress: Progress | None,
            should_abort: Callable[[], bool] | None, why: str) -> dict[bool, TracedTape]:
    from vramlab.core.tracing.capture import TraceFailed
    from vramlab.core.tracing.trace import trace_direct

    try:
        return _with_task_note(spec, trace_direct(spec, setup, spec.transformers_config, why, progress, should_abort))
    except TraceFailed as e:
        return dict.fromkeys((True, False), _marker(f"{why}; {e}"))


def describe(rec: TracedTape) -> str:
    """One line for the result's notes: how the traced tape was obtained (and what the step ran without)."""
    extra = "".join(f"; {n}" for n in rec.meta.get("notes", ()))
    if rec.mode == FITTED:
        return f"traced from transformers {rec.transformers_version} in {rec.seconds:.1f} s: {rec.note}{extra}"
    if rec.mode == SEQUENCE_FIXED:
        return (f"traced from transformers {rec.transformers_version} for this sequence length only "
                f"({rec.note}){extra}")
    return f"simulated directly (transformers {rec.transformers_version}): {rec.note}{extra}"


__all__ = ["STORE", "adapts_experts", "cached_tape", "check_offloading", "describe", "prefetch", "traced_tape",
           "uses_trace"]
