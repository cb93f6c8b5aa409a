"""The readers' answer against the framework's own run (issue 29, `make conformance`): for each dialect, the
framework's own training entry runs a tiny model for two steps on real CPU tensors, counted by VRAM Lab's tracker,
and the estimate of the same config file, read as VRAM Lab reads it, is set beside it.

The objective axis is TRL 1.16's own trainers, full and LoRA: SFTTrainer, DPOTrainer (full: its reference copy,
loaded from the folder; LoRA: the policy with its adapters off), KTOTrainer, trl.experimental's ORPOTrainer and
CPOTrainer, and GRPOTrainer (transformers' generate, a reward function of the completion's length, two
generations of 8 tokens). One mechanism serves every row (:class:`Objective`: a config class, a trainer class,
the keys of its YAML, a dataset row): the row's YAML is written as its user writes it for TRL's own script, parsed
by TRL's ``TrlParser`` (with ``ModelConfig``, whose ``get_peft_config`` makes the adapter) for the run and read by
VRAM Lab's reader for the estimate; where the config has no key for what the estimate needs, the command-line flag
that says it is named in the row (``flags``: ORPOConfig has no key of its own; GRPOConfig no prompt length).

Each trainer runs twice: as it runs on this CPU, and with TRL's loss kernels on their CUDA paths (the fused LM
head: Triton folds as no-op launches, only valid positions scored, in-place fp32 accumulation; the full-logits
``selective_log_softmax`` kernel of ORPO / CPO; transformers' Hub RMSNorm as train() kernelizes it on CUDA), so
that the CPU / CUDA difference is measured by TRL's own code. A row is ``equal`` when the tensor-level peaks agree
to the byte; ``unexplained_bytes`` is the estimate against the CUDA-path run less what is named: the training
loop's own 0-dim tensors and the trainer's host tensors, listed with the code that made them (the tensors alive at
each peak that only one side has are in ``tensors_at_the_peaks``). The tool exits 1 when a row is neither equal
nor explained. The frameworks that do not install beside transformers 5.25 (LLaMA-Factory 0.9.5, axolotl 0.19.0,
ms-swift 4.6.0: each pins an older transformers) are held here by their argument classes and freeze code
(tests/test_framework_*.py), and run by their own entry points in venvs of their own by
tools/conformance_frameworks.py (``make conformance-frameworks``, minutes: not in CI), which the result file says.

Run: .venv/bin/python tools/conformance.py [--out benchmarks/results/conformance.json] [--only 'trl dpo full' ...]
(needs .[conformance]; about 30 s of CPU for the fourteen rows, on one torch thread)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH, STEPS = 64, 2, 2
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False}
LORA = {"use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"]}
# what every row's YAML says: the batch, no bf16 on this CPU, no checkpointing (TRL's configs turn it on)
COMMON = {"per_device_train_batch_size": BATCH, "bf16": False, "gradient_checkpointing": False}
# what the command line adds to run it here (nothing of it changes the step's memory)
RUN_ARGS = ("--max_steps", str(STEPS), "--use_cpu", "true", "--report_to", "none", "--save_strategy", "no",
            "--logging_strategy", "no", "--dataloader_num_workers", "0", "--seed", "0")
HALF, COMPLETION = SEQ // 2, 8  # the DPO family's completion (VRAM Lab: half of max_length); GRPO's completion


def _words(start: int, n: int, lead: str = "") -> str:
    """``n`` tokens of the tiny tokenizer as text (one word each); ``lead``: a space, so that a completion appended
    to its prompt does not merge with the prompt's last word."""
    return lead + " ".join(f"t{3 + (start + j) % (CONFIG['vocab_size'] - 3)}" for j in range(n))


def _pair(i: int) -> dict:
    """A preference row: prompt and completions each half of max_length (the trainer appends the EOS token)."""
    return {"prompt": _words(i, HALF), "chosen": _words(i + 100, HALF - 1, " "),
            "rejected": _words(i + 200, HALF - 1, " ")}


@dataclasses.dataclass(frozen=True)
class Objective:
    """A TRL trainer as its user runs it: its config and trainer class (``module:Name``), the keys of its YAML,
    a dataset row, and what the command line must add to VRAM Lab's reading where the config has no key for it
    (``flags``: flag -> (setup field, value))."""

    config: str
    trainer: str
    keys: dict
    example: Callable[[int], dict]
    flags: dict = dataclasses.field(default_factory=dict)
    fused_head: bool = True  # scores through TRL's fused LM head (add_fused_lm_head); else the whole logits
    reward: bool = False  # GRPOTrainer's reward_funcs


OBJECTIVES = {
    "sft": Objective("trl:SFTConfig", "trl:SFTTrainer", {"max_length": SEQ},
                     lambda i: {"input_ids": [3 + (i * 7 + j) % (CONFIG["vocab_size"] - 3) for j in range(SEQ)]}),
    "dpo": Objective("trl:DPOConfig", "trl:DPOTrainer", {"max_length": SEQ, "loss_type": "sigmoid", "beta": 0.1},
                     _pair),
    "kto": Objective("trl:KTOConfig", "trl:KTOTrainer", {"max_length": SEQ, "loss_type": "kto", "beta": 0.1},
                     lambda i: {"prompt": _words(i, HALF), "completion": _words(i + 100, HALF - 1, " "),
                                "label": i % 2 == 0}),
    "orpo": Objective("trl.experimental.orpo:ORPOConfig", "trl.experimental.orpo:ORPOTrainer",
                      {"max_length": SEQ, "beta": 0.1}, _pair, fused_head=False,
                      flags={"--objective orpo (ORPOConfig has no key of its own)": ("objective", "orpo")}),
    "cpo": Objective("trl.experimental.cpo:CPOConfig", "trl.experimental.cpo:CPOTrainer",
                     {"max_length": SEQ, "loss_type": "sigmoid", "cpo_alpha": 1.0, "beta": 0.1}, _pair,
                     fused_head=False),
    "grpo": Objective("trl:GRPOConfig", "trl:GRPOTrainer",
                      {"max_completion_length": COMPLETION, "num_generations": 2},
                      lambda i: {"prompt": _words(i, SEQ - COMPLETION)}, reward=True,
                      flags={f"--prompt-len {SEQ - COMPLETION} --completion-len {COMPLETION} (GRPOConfig does "
                             "not truncate prompts)": ("seq_len", SEQ)}),
}
CASES = {f"trl {o} {m}": (o, keys) for o in OBJECTIVES for m, keys in (("full", {}), ("lora", LORA))}
# HF Trainer's accumulation (get_batch_samples: every micro-batch of an optimizer step collated and on the device
# before its first forward, held to the next step): SFT full, DPO LoRA (the collator's doubled rows)
ACCUM = {"gradient_accumulation_steps": 2}
CASES |= {"trl sft full accum 2": ("sft", ACCUM), "trl dpo lora accum 2": ("dpo", {**LORA, **ACCUM})}


def _tiny(folder: Path):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG, dtype="float32")).save_pretrained(folder)
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


class _Launch:
    """``kernel[grid](...)`` of a Triton kernel as a no-op: it writes into tensors allocated before the launch."""

    def __getitem__(self, _grid: object):  # noqa: ANN204
        return lambda *a, **k: None


@contextlib.contextmanager
def _cuda_path() -> Iterator[None]:
    """TRL 1.16's loss kernels taking their CUDA paths on CPU tensors, their Triton launches as no-ops. The fused LM
    head (SFT, DPO, KTO, GRPO: ``trl/kernels/chunked_logprob.py``): only the valid positions scored, the fp32
    accumulation in place (``addmm(out=acc)``). ``selective_log_softmax`` over whole logits (ORPO, CPO:
    ``trl/kernels/logprob_entropy.py``, which ``trl/trainer/utils.py`` calls where Triton imports and the logits
    are on CUDA): the module imported with Triton stubbed when it is not installed.

    The kernels' outputs are then not numbers (so GRPO's sampling is handed finite probabilities, made so in place:
    no allocation)."""
    import torch
    from trl.kernels import chunked_logprob as kernel
    from trl.trainer import utils

    multinomial = torch.multinomial

    def sample(probs, *args, **kwargs):  # noqa: ANN001, ANN202
        return multinomial(probs.nan_to_num_(0.0, 0.0, 0.0).clamp_(min=0.0).add_(1.0), *args, **kwargs)

    stub = () if importlib.util.find_spec("triton") else ("triton", "triton.language")
    with contextlib.ExitStack() as stack:
        for name in (*stub, "trl.kernels.logprob_entropy"):  # the kernel module imported under the stub, all dropped
            stack.callback(sys.modules.pop, name, None)  # after (not patch.dict: it drops every module imported since)
        sys.modules.pop("trl.kernels.logprob_entropy", None)
        sys.modules.update({name: mock.MagicMock() for name in stub})
        full = importlib.import_module("trl.kernels.logprob_entropy")
        stack.enter_context(mock.patch.multiple(full, _forward_kernel=_Launch(), _backward_kernel=_Launch()))
        stack.enter_context(mock.patch.multiple(
            kernel, _use_triton=lambda device: True, _forward_kernel=_Launch(), _backward_kernel=_Launch(),
            _addmm_fp32=lambda acc, a, b: None, triton=types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)),
            create=True))
        # the logits these trainers hand it pass its other checks (fp32, contiguous rows, an index of their shape)
        stack.enter_context(mock.patch.multiple(
            utils, _use_triton=lambda device: True, is_triton_available=lambda: True,
            _supports_trl_loss_kernel=lambda *a, **k: True,
            _fused_logprob_entropy=full.selective_log_softmax_and_entropy, create=True))
        stack.enter_context(mock.patch.object(torch, "multinomial", sample))
        yield


def _hub_kernels(model: object) -> None:
    """transformers >= 5.25's Hub kernels as its ``train()`` kernelizes the model on CUDA (its kernel mapping has
    no CPU entry): kernels-community/liger-kernels' ``LigerRMSNorm`` in every decorated RMSNorm and
    kernels-community/rotary's RoPE on every decorated ``apply_rotary_pos_emb`` (clones of q and k), as the estimate
    models them (``core/simulation/liger.py`` ``kernelize_hub``, ``core/simulation/rope.py`` ``kernelize_rope``,
    held to the kernels library's own ``kernelize``)."""
    from transformers import __version__

    from vramlab.core.simulation.liger import kernelize_hub
    from vramlab.core.simulation.rope import kernelize_rope
    from vramlab.core.spec.hub_kernels import HUB_RMS_NORM, default_on

    if default_on(__version__):
        model.use_kernels = False  # else train() re-kernelizes for the CPU, where the mapping leaves the torch forward
        kernelize_hub(model, HUB_RMS_NORM)
        kernelize_rope(model)


def _site() -> str:
    """The innermost caller outside torch and this file: where a storage was made (``trl/trainer/...:line fn``)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith(("conformance.py", "conformance_frameworks.py", "tracker.py")):
            return f"{name.rsplit('site-packages/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def _sited_tracker():  # noqa: ANN202
    """The tracker, listing every storage alive at the peak with the code that made it (``label`` ends with it)."""
    from vramlab.core.simulation.tracker import MemoryTracker

    class Sited(MemoryTracker):
        def _track(self, t, func=None, kind=None) -> None:  # noqa: ANN001
            before = len(self._live)
            super()._track(t, func, kind)
            if len(self._live) > before:  # a new storage: the last entry
                entry = next(reversed(self._live.values()))
                entry.label = f"{entry.label} @ {_site()}"

    return Sited(top_n=1 << 30)


def _class(path: str):  # noqa: ANN202
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _yaml(case: str, out: Path) -> Path:
    """The row's config as its user writes it for TRL's own script (``trl dpo --config dpo.yaml``)."""
    import yaml

    objective, keys = CASES[case]
    path = out / f"{case.replace(' ', '-')}.yaml"
    path.write_text(yaml.safe_dump({**OBJECTIVES[objective].keys, **COMMON, **keys}))
    return path


def _register(tracker, module, kind) -> None:  # noqa: ANN001
    """from_pretrained reads the weights out of the file past the dispatcher (a CUDA run copies them to the device,
    counted); a weight that is only ever an op's input (the embedding, the norms) would go uncounted."""
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        tracker.register(t, kind)
        tracker.reclassify(t, kind, name)


def _trl_run(folder: Path, case: str, out: Path, cuda_path: bool = False) -> tuple[int, list]:
    """The row's TRL trainer for STEPS steps on CPU under the tracker, its config parsed from the row's YAML by TRL's
    own parser (as its scripts do): the tensor-level peak (bytes, CUDA's 512-byte rounding, as the estimate's
    simulation level counts) and what was alive at it. ``cuda_path``: its loss kernels as on a GPU."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import ModelConfig, TrlParser, get_peft_config

    from vramlab.core.kinds import Kind

    objective = OBJECTIVES[CASES[case][0]]
    args, model_args = TrlParser((_class(objective.config), ModelConfig)).parse_args_and_config(
        ["--config", str(_yaml(case, out)), "--output_dir", str(out / "run"), *RUN_ARGS])
    rows = [objective.example(i) for i in range(BATCH * STEPS * CASES[case][1].get("gradient_accumulation_steps", 1))]
    extra = {"reward_funcs": lambda completions, **_: [float(len(c)) for c in completions]} if objective.reward \
        else {}
    tracker = _sited_tracker()
    with tracker, (_cuda_path() if cuda_path else contextlib.nullcontext()):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if cuda_path:
            _hub_kernels(model)
        _register(tracker, model, Kind.WEIGHTS)
        trainer = _class(objective.trainer)(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                            processing_class=AutoTokenizer.from_pretrained(folder),
                                            peft_config=get_peft_config(model_args), **extra)
        ref = getattr(trainer, "ref_model", None)  # DPOTrainer's / KTOTrainer's copy, loaded from the folder
        if ref is not None:
            if cuda_path:  # loaded with device_map "auto" on CUDA: its norms kernelized too (the Hub's mapping has
                _hub_kernels(ref)  # LigerRMSNorm for training and inference alike)
            _register(tracker, ref, Kind.REFERENCE)
        trainer.train()
    shortest = trainer.state.log_history[-1].get("completions/min_length", COMPLETION)
    if shortest != COMPLETION:  # GRPO sampled an EOS: a shorter step than the estimate's (full-length completions)
        raise RuntimeError(f"{case}: a completion of {shortest} tokens, not {COMPLETION}: change the seed")
    return tracker.peak.total_bytes, list(tracker.peak.top)


def _reference(spec, setup) -> tuple[int, list]:  # noqa: ANN001
    """The estimate's reference, ``vramlab simulate`` of the same setup (the built-in builder under fake
    tensors): its peak and what was alive at it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramlab.core.simulation.step import measure
    from vramlab.core.simulation.tracker import MemoryTracker

    tracker = MemoryTracker(top_n=1 << 30)
    with FakeTensorMode(allow_non_fake_inputs=False):
        measure(spec, setup, torch.device("cpu"), real=False, tracker=tracker, steps=STEPS)
    return tracker.peak.total_bytes, list(tracker.peak.top)


def _tensor_diff(run: list, ref: list, loop: tuple[str, ...]) -> dict[str, list]:
    """What is alive at one peak and not at the other, storage by storage: matched by bytes, dtype, element count
    (a weight first seen through its transpose in the run has the transposed shape) and the op that made it, then
    what is left by the first three alone. Of a run's storages alike, one the training loop made (``loop``: its
    sites) is left over first: the step has no counterpart of it."""

    def key(t) -> tuple:  # noqa: ANN001
        return t.nbytes, t.dtype, math.prod(t.shape)

    def op(t) -> tuple:  # noqa: ANN001
        return (*key(t), t.label.split(" @ ", 1)[0])

    def looped(t) -> bool:  # noqa: ANN001
        return _site_of(t.label).startswith(loop)

    rest_run, rest_ref = _unmatched(run, ref, op, looped), _unmatched(ref, run, op)
    rest_run, rest_ref = _unmatched(rest_run, rest_ref, key, looped), _unmatched(rest_ref, rest_run, key)
    return {name: [{"bytes": t.nbytes, "shape": list(t.shape), "dtype": t.dtype, "made_by": t.label} for t in side]
            for name, side in (("only_in_the_run", rest_run), ("only_in_the_estimate", rest_ref))}


def _site_of(label: str) -> str:
    return label.split(" @ ", 1)[1] if " @ " in label else ""


def _unmatched(side: list, other: list, key, first=lambda t: False) -> list:  # noqa: ANN001
    """The storages of ``side`` left once each storage of ``other`` has taken one of the same ``key``: those
    ``first`` says, then the latest made."""
    import collections

    extra = collections.Counter(map(key, side)) - collections.Counter(map(key, other))
    left = set()
    for i in sorted(reversed(range(len(side))), key=lambda i: not first(side[i])):
        if extra[key(side[i])] > 0:
            extra[key(side[i])] -= 1
            left.add(i)
    return [t for i, t in enumerate(side) if i in left]


def _estimate(folder: Path, case: str, out: Path) -> tuple[int, object, object]:
    """The estimate of the row's YAML, read as VRAM Lab reads it (the command line's ``flags`` over it, where the
    config has no key): its peak, the setup and the model it read."""
    from vramlab.core.estimate import estimate
    from vramlab.core.sources.folder import load_model_source
    from vramlab.core.sources.training import read_training_configs, with_flags
    from vramlab.core.spec.training import TrainingSetup

    flags = OBJECTIVES[CASES[case][0]].flags
    values = dict(flags.values())
    src = with_flags(read_training_configs([_yaml(case, out)]), {f: flag for flag, (f, _) in flags.items()}, values)
    src.check()  # what the file refuses, the flags settle (as the command line does)
    setup = TrainingSetup().replace(**{**src.changes, **values})
    spec = load_model_source(folder).spec
    r = estimate(spec, setup, match_simulation=True)
    return r.peak_allocated_bytes, setup, spec


# where the training loop (not the model, not the loss kernel) makes a tensor; the row's trainer module beside them
LOOP_SITES = ("transformers/trainer.py", "accelerate/")


def _loop_sites(trainer: str) -> tuple[str, ...]:
    module = sys.modules[_class(trainer).__module__].__file__.replace("\\", "/")
    return (*LOOP_SITES, module.rsplit("site-packages/", 1)[-1])


def _loop_scalars(only_in_run: list[dict], trainer: str) -> dict | None:
    """The 0-dim tensors the training loop keeps on the device that the estimate's step has no counterpart of."""
    mine = [t for t in only_in_run if not t["shape"] and _site_of(t["made_by"]).startswith(_loop_sites(trainer))
            and not _site_of(t["made_by"]).endswith(" __init__")]
    if not mine:
        return None
    return {"what": "the training loop's own 0-dim device tensors, a 512-byte CUDA block each, which the step "
                    "does not model: Trainer's loss accumulator (_tr_loss), the previous step's loss "
                    "(tr_loss_step) and gradient norm (grad_norm, max_grad_norm > 0), the batch's label count "
                    "(num_items_in_batch), and in backward accelerate's loss / gradient_accumulation_steps beside "
                    f"{trainer.rsplit(':', 1)[1]}'s loss (sites: " + "; ".join(_site_of(t["made_by"]) for t in mine)
                    + ")", "bytes": sum(t["bytes"] for t in mine), "kind": "the trainer's own tensors"}


def _host_tensors(only_in_run: list[dict], trainer: str) -> dict | None:
    """What the trainer makes in its ``__init__`` and never moves to the device: counted on this CPU, host memory on
    CUDA (GRPOTrainer's ``reward_weights``, ``torch.ones(len(reward_funcs))``, copied to the device for each scoring
    as ``self.reward_weights.to(device)``)."""
    module = _loop_sites(trainer)[-1]
    mine = [t for t in only_in_run if _site_of(t["made_by"]).startswith(module)
            and _site_of(t["made_by"]).endswith(" __init__")]
    if not mine:
        return None
    return {"what": f"{trainer.rsplit(':', 1)[1]}.__init__'s tensors, left on the host (the model alone goes to the "
                    "device): on this CPU the tracker counts them, on CUDA they are not device memory (sites: "
                    + "; ".join(_site_of(t["made_by"]) for t in mine) + ")",
            "bytes": sum(t["bytes"] for t in mine), "kind": "host tensors"}


KERNELS = {  # where TRL's loss runs a kernel of its own on CUDA: what its CPU path does instead
    True: "TRL's CPU fallback of its fused LM head: torch folds of each 32768-wide tile (tile-sized fp32 "
          "temporaries), every position scored, both operands upcast for the fp32 accumulation; on CUDA Triton folds "
          "write in place",
    False: "TRL's selective_log_softmax over the whole logits: on this CPU its torch path (a gather and a logsumexp "
           "per row, stacked; in backward logits-sized buffers of the gather's scatter_add and of the stack), on CUDA "
           "its Triton kernel (four fp32 vectors of the rows, one logits-sized gradient)",
}


def _kernel_difference(objective: Objective, bytes_: int) -> dict:
    """What TRL's own step run both ways measured: its CPU path against its CUDA path."""
    return {"what": KERNELS[objective.fused_head] + "; and transformers' own RMSNorm where, on CUDA, train() "
                    "kernelizes it into the Hub's LigerRMSNorm (measured: TRL's own step run both ways)",
            "bytes": bytes_, "kind": "CPU / CUDA kernel difference"}


def against_the_estimate(folder: Path, case: str, tmp: Path) -> dict:
    """The row's trainer on its CUDA path beside the estimate of its YAML and the estimate's reference: the peaks,
    the tensors alive at them that only one side has, the loop's own tensors among them, and what is left
    unexplained (0 when the estimate models the trainer's step to the byte)."""
    objective = OBJECTIVES[CASES[case][0]]
    on_cuda_path, alive = _trl_run(folder, case, tmp, cuda_path=True)
    estimated, setup, spec = _estimate(folder, case, tmp)
    reference, ref_alive = _reference(spec, setup)
    tensors = _tensor_diff(alive, ref_alive, _loop_sites(objective.trainer))
    named = [n for n in (_loop_scalars(tensors["only_in_the_run"], objective.trainer),
                         _host_tensors(tensors["only_in_the_run"], objective.trainer)) if n is not None]
    return {"measured_on_cuda_path_bytes": on_cuda_path, "estimated_peak_bytes": estimated, "named": named,
            "unexplained_bytes": estimated - on_cuda_path + sum(n["bytes"] for n in named),
            "estimate_equals_its_reference": estimated == reference, "tensors_at_the_peaks": tensors,
            "setup": setup.resolved()}


def _row(folder: Path, case: str, tmp: Path) -> dict:
    """One row: the trainer's own run on this CPU beside :func:`against_the_estimate`; the named differences are
    the CPU / CUDA one (TRL's step run both ways) and the loop's own tensors."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    objective = OBJECTIVES[CASES[case][0]]
    measured, _ = _trl_run(folder, case, tmp)
    c = against_the_estimate(folder, case, tmp)
    on_cuda_path, estimated, named, resolved = (c.pop(k) for k in ("measured_on_cuda_path_bytes",
                                                                    "estimated_peak_bytes", "named", "setup"))
    return {"case": case, "config": {**objective.keys, **COMMON, **CASES[case][1]}, "flags": list(objective.flags),
            "measured_peak_bytes": measured, "measured_on_cuda_path_bytes": on_cuda_path,
            "estimated_peak_bytes": estimated, "difference_bytes": estimated - measured, "equal": estimated == measured,
            "named_differences": [_kernel_difference(objective, measured - on_cuda_path), *named],
            **c, "seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - cpu0, 1),
            "setup": {k: resolved[k] for k in ("objective", "reference", "method", "weights", "compute", "optimizer",
                                                "optimizer_impl", "micro_batch", "seq_len", "grad_ckpt",
                                                "loss_kernel") if k in resolved}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conformance.json"))
    p.add_argument("--only", nargs="*", default=None, help="these rows only (e.g. 'trl dpo full')")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tensors of a few KB: more threads only cost time (the bytes are the same)
    versions = {d: metadata.version(d) for d in ("torch", "transformers", "peft", "trl", "accelerate")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama"
        _tiny(folder)
        for case in a.only or CASES:
            rows.append(_row(folder, case, Path(tmp)))
            r = rows[-1]
            print(f"{case}: measured {r['measured_peak_bytes']:,} B (CUDA path {r['measured_on_cuda_path_bytes']:,} "
                  f"B), estimated {r['estimated_peak_bytes']:,} B, unexplained {r['unexplained_bytes']:+,} B "
                  f"({r['seconds']} s, {r['cpu_seconds']} s of CPU)", flush=True)
    held_elsewhere = {  # beside transformers 5.25; each runs in its own venv: tools/conformance_frameworks.py
        "llamafactory 0.9.5": "argument defaults (tests/test_framework_defaults.py), freeze step "
                              "(tests/test_framework_freeze.py); run_exp, full and LoRA, in its own venv "
                              "(transformers 5.6.0; make conformance-frameworks, conformance_frameworks.json)",
        "axolotl 0.19.0": "config schema defaults (tests/test_framework_defaults.py); axolotl.cli.train, full and "
                          "LoRA, in its own venv (transformers 5.16.1; conformance_frameworks.json)",
        "ms-swift 4.6.0": "argument classes read from source (tests/test_framework_defaults.py); sft_main, full and "
                          "LoRA, in its own venv (transformers 5.19.0, trl 0.29.1; conformance_frameworks.json)",
    }
    result = {"benchmark": "conformance", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions,
              "model": CONFIG, "batch": BATCH, "seq": SEQ, "steps": STEPS, "rows": rows,
              "held_by_their_code_not_run": held_elsewhere}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    off = [r["case"] for r in rows if r["unexplained_bytes"] or not r["estimate_equals_its_reference"]]
    if off:
        print(f"not equal and not explained: {', '.join(off)}", file=sys.stderr)
    return 1 if off else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
