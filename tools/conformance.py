"""The readers' answer against the framework's own run (issue 29, `make conformance`): for each dialect, the
framework's own training entry runs a tiny model for two steps on real CPU tensors, counted by VRAM Lab's tracker,
and the estimate of the same config file, read as VRAM Lab reads it, is set beside it.

TRL's SFTTrainer (SFT, full and LoRA), run twice: as it runs on this CPU, and with its fused LM head on its CUDA
path (Triton folds as no-op launches, only valid positions scored, in-place fp32 accumulation), so that the CPU /
CUDA difference is measured by TRL's own code. A row is ``equal`` when the tensor-level peaks agree to the byte;
``unexplained_bytes`` is the estimate against the CUDA-path run. The frameworks that do not install beside
transformers 5.25 (LLaMA-Factory 0.9.5, axolotl 0.19.0, ms-swift 4.6.0: each pins an older transformers) are held
here by their argument classes and freeze code (tests/test_framework_*.py), and run by their own entry points in
venvs of their own by tools/conformance_frameworks.py (``make conformance-frameworks``, minutes: not in CI), which
the result file says.

Run: .venv/bin/python tools/conformance.py [--out benchmarks/results/conformance.json]   (needs .[conformance])
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH, STEPS = 64, 2, 2
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False}
CASES = {
    "trl sft full": {},
    "trl sft lora": {"use_peft": True, "lora_r": 8, "lora_target_modules": ["q_proj", "v_proj"]},
}


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


@contextlib.contextmanager
def _cuda_path() -> Iterator[None]:
    """TRL 1.16's fused LM head taking its CUDA path on CPU tensors: the Triton folds launched as no-ops (they
    write in place), only the valid positions scored, the fp32 accumulation in place (``addmm(out=acc)``)."""
    from trl.kernels import chunked_logprob as kernel
    from trl.trainer import utils

    class _Launch:
        def __getitem__(self, _grid: object):  # noqa: ANN204
            return lambda *a, **k: None

    with (mock.patch.multiple(kernel, _use_triton=lambda device: True, _forward_kernel=_Launch(),
                              _backward_kernel=_Launch(), _addmm_fp32=lambda acc, a, b: None,
                              triton=types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)), create=True),
          mock.patch.object(utils, "_use_triton", lambda device: True)):
        yield


def _hub_kernels(model: object) -> None:
    """transformers >= 5.25's Hub kernels as its ``train()`` kernelizes the model on CUDA (its kernel mapping has
    no CPU entry): kernels-community/liger-kernels' ``LigerRMSNorm`` in every decorated RMSNorm, as the estimate
    models it (``core/simulation/liger.py`` ``kernelize_hub``, held to the kernels library's own ``kernelize``)."""
    from transformers import __version__

    from vramlab.core.simulation.liger import kernelize_hub
    from vramlab.core.spec.hub_kernels import HUB_RMS_NORM, default_on

    if default_on(__version__):
        model.use_kernels = False  # else train() re-kernelizes for the CPU, where the mapping leaves the torch forward
        kernelize_hub(model, HUB_RMS_NORM)


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


def _trl_run(folder: Path, keys: dict, out: Path, cuda_path: bool = False) -> tuple[int, list]:
    """TRL's SFTTrainer for STEPS steps on CPU under the tracker: the tensor-level peak (bytes, CUDA's 512-byte
    rounding, as the estimate's simulation level counts) and what was alive at it. ``cuda_path``: its fused LM
    head as on a GPU."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from vramlab.core.kinds import Kind

    rows = [{"input_ids": [3 + (i * 7 + j) % (CONFIG["vocab_size"] - 3) for j in range(SEQ)]}
            for i in range(BATCH * STEPS)]
    args = SFTConfig(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, max_length=SEQ,
                     bf16=False, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                     gradient_checkpointing=False, dataloader_num_workers=0, seed=0)
    peft = LoraConfig(r=keys["lora_r"], lora_alpha=2 * keys["lora_r"], target_modules=keys["lora_target_modules"],
                      lora_dropout=0.0, task_type="CAUSAL_LM") if keys.get("use_peft") else None
    tracker = _sited_tracker()
    with tracker, (_cuda_path() if cuda_path else contextlib.nullcontext()):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if cuda_path:
            _hub_kernels(model)
        # from_pretrained reads the weights out of the file past the dispatcher (a CUDA run copies them to the
        # device, counted); a weight that is only ever an op's input (the embedding, the norms) would go uncounted
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            tracker.register(t, Kind.WEIGHTS)
            tracker.reclassify(t, Kind.WEIGHTS, name)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft)
        trainer.train()
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


def _tensor_diff(run: list, ref: list) -> dict[str, list]:
    """What is alive at one peak and not at the other, storage by storage: matched by bytes, dtype, element count
    (a weight first seen through its transpose in the run has the transposed shape) and the op that made it, then
    what is left by the first three alone."""

    def key(t) -> tuple:  # noqa: ANN001
        return t.nbytes, t.dtype, math.prod(t.shape)

    def op(t) -> tuple:  # noqa: ANN001
        return (*key(t), t.label.split(" @ ", 1)[0])

    rest_run, rest_ref = _unmatched(run, ref, op), _unmatched(ref, run, op)
    rest_run, rest_ref = _unmatched(rest_run, rest_ref, key), _unmatched(rest_ref, rest_run, key)
    return {name: [{"bytes": t.nbytes, "shape": list(t.shape), "dtype": t.dtype, "made_by": t.label} for t in side]
            for name, side in (("only_in_the_run", rest_run), ("only_in_the_estimate", rest_ref))}


def _unmatched(side: list, other: list, key) -> list:  # noqa: ANN001
    """The storages of ``side`` left once each storage of ``other`` has taken one of the same ``key``."""
    import collections

    extra = collections.Counter(map(key, side)) - collections.Counter(map(key, other))
    out = []
    for t in reversed(side):  # the latest made are the ones left over
        if extra[key(t)] > 0:
            extra[key(t)] -= 1
            out.append(t)
    return out[::-1]


def _estimate(folder: Path, keys: dict, out: Path) -> tuple[int, object, object]:
    """The estimate of the same settings written as TRL's config, read as VRAM Lab reads it: its peak, the setup
    and the model it read."""
    import yaml

    from vramlab.core.estimate import estimate
    from vramlab.core.sources.folder import load_model_source
    from vramlab.core.sources.training import read_training_configs
    from vramlab.core.spec.training import TrainingSetup

    cfg = out / "sft.yaml"
    body = {"max_length": SEQ, "per_device_train_batch_size": BATCH, "bf16": False, "gradient_checkpointing": False,
            "lora_alpha": 2 * keys.get("lora_r", 8), "lora_dropout": 0.0, **keys}
    cfg.write_text(yaml.safe_dump(body))
    src = read_training_configs([cfg])
    setup = TrainingSetup().replace(**src.changes)
    spec = load_model_source(folder).spec
    r = estimate(spec, setup, match_simulation=True)
    return r.peak_allocated_bytes, setup, spec


# where the training loop (not the model, not the loss kernel) makes a tensor
LOOP_SITES = ("transformers/trainer.py", "accelerate/", "trl/trainer/sft_trainer.py")


def _loop_scalars(only_in_run: list[dict]) -> dict | None:
    """The 0-dim tensors the training loop keeps on the device that the estimate's step has no counterpart of."""
    mine = [t for t in only_in_run if not t["shape"] and " @ " in t["made_by"]
            and t["made_by"].split(" @ ", 1)[1].startswith(LOOP_SITES)]
    if not mine:
        return None
    return {"what": "the training loop's own 0-dim device tensors, a 512-byte CUDA block each, which the step "
                    "does not model: Trainer's loss accumulator (_tr_loss), the previous step's loss "
                    "(tr_loss_step) and gradient norm (grad_norm, max_grad_norm > 0), the batch's label count "
                    "(num_items_in_batch), and in backward accelerate's loss / gradient_accumulation_steps "
                    "beside SFTTrainer's loss (sites: " + "; ".join(t["made_by"].split(" @ ", 1)[1] for t in mine)
                    + ")", "bytes": sum(t["bytes"] for t in mine), "kind": "the trainer's own tensors"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conformance.json"))
    a = p.parse_args(argv)
    versions = {d: metadata.version(d) for d in ("torch", "transformers", "peft", "trl")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama"
        _tiny(folder)
        for name, keys in CASES.items():
            t0 = time.perf_counter()
            measured, _ = _trl_run(folder, keys, Path(tmp) / "out")
            on_cuda_path, alive = _trl_run(folder, keys, Path(tmp) / "out", cuda_path=True)
            estimated, setup, spec = _estimate(folder, keys, Path(tmp))
            reference, ref_alive = _reference(spec, setup)
            tensors = _tensor_diff(alive, ref_alive)
            diff = estimated - measured
            named = [{"what": "TRL's CPU fallback of its fused LM head: torch folds of each 32768-wide tile "
                              "(tile-sized fp32 temporaries), every position scored, both operands upcast for the "
                              "fp32 accumulation; on CUDA Triton folds write in place; and transformers' own "
                              "RMSNorm where, on CUDA, train() kernelizes it into the Hub's LigerRMSNorm (measured: "
                              "TRL's own step run both ways)", "bytes": measured - on_cuda_path,
                      "kind": "CPU / CUDA kernel difference"}]
            loop = _loop_scalars(tensors["only_in_the_run"])
            if loop is not None:
                named.append(loop)
            resolved = setup.resolved()
            rows.append({"case": name, "measured_peak_bytes": measured, "measured_on_cuda_path_bytes": on_cuda_path,
                         "estimated_peak_bytes": estimated, "difference_bytes": diff, "equal": diff == 0,
                         "named_differences": named,
                         "unexplained_bytes": estimated - on_cuda_path + (loop["bytes"] if loop else 0),
                         "estimate_equals_its_reference": estimated == reference,
                         "tensors_at_the_peaks": tensors,
                         "seconds": round(time.perf_counter() - t0, 1),
                         "setup": {k: resolved[k] for k in ("method", "weights", "compute", "optimizer",
                                                             "optimizer_impl", "micro_batch", "seq_len", "grad_ckpt",
                                                             "loss_kernel")}})
            print(f"{name}: measured {measured:,} B (CUDA path {on_cuda_path:,} B), estimated {estimated:,} B, "
                  f"unexplained {rows[-1]['unexplained_bytes']:+,} B", flush=True)
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
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
