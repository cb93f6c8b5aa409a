"""The readers' answer against the framework's own run (issue 29, `make conformance`): for each dialect, the
framework's own training entry runs a tiny model for two steps on real CPU tensors, counted by VRAM Lab's tracker,
and the estimate of the same config file, read as VRAM Lab reads it, is set beside it.

TRL's SFTTrainer (SFT, full and LoRA), run twice: as it runs on this CPU, and with its fused LM head on its CUDA
path (Triton folds as no-op launches, only valid positions scored, in-place fp32 accumulation), so that the CPU /
CUDA difference is measured by TRL's own code. A row is ``equal`` when the tensor-level peaks agree to the byte;
``unexplained_bytes`` is the estimate against the CUDA-path run. The frameworks that do not run beside
transformers 5.25 (LLaMA-Factory 0.9.5, axolotl 0.19.0, ms-swift 4.6.0: each pins an older transformers) are held
by their argument classes and freeze code instead (tests/test_framework_*.py), which the result file says.

Run: .venv/bin/python tools/conformance.py [--out benchmarks/results/conformance.json]   (needs .[conformance])
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def _trl_run(folder: Path, keys: dict, out: Path, cuda_path: bool = False) -> int:
    """TRL's SFTTrainer for STEPS steps on CPU under the tracker: the tensor-level peak (bytes, CUDA's 512-byte
    rounding, as the estimate's simulation level counts). ``cuda_path``: its fused LM head as on a GPU."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from vramlab.core.kinds import Kind
    from vramlab.core.simulation.tracker import MemoryTracker

    rows = [{"input_ids": [3 + (i * 7 + j) % (CONFIG["vocab_size"] - 3) for j in range(SEQ)]}
            for i in range(BATCH * STEPS)]
    args = SFTConfig(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, max_length=SEQ,
                     bf16=False, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                     gradient_checkpointing=False, dataloader_num_workers=0, seed=0)
    peft = LoraConfig(r=keys["lora_r"], lora_alpha=2 * keys["lora_r"], target_modules=keys["lora_target_modules"],
                      lora_dropout=0.0, task_type="CAUSAL_LM") if keys.get("use_peft") else None
    tracker = MemoryTracker()
    with tracker, (_cuda_path() if cuda_path else contextlib.nullcontext()):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        # from_pretrained reads the weights out of the file past the dispatcher (a CUDA run copies them to the
        # device, counted); a weight that is only ever an op's input (the embedding, the norms) would go uncounted
        for t in (*model.parameters(), *model.buffers()):
            tracker.register(t, Kind.WEIGHTS)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft)
        trainer.train()
    return tracker.peak.total_bytes


def _estimate(folder: Path, keys: dict, out: Path) -> tuple[int, dict]:
    """The estimate of the same settings written as TRL's config, read as VRAM Lab reads it."""
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
    return r.peak_allocated_bytes, setup.resolved()


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
            measured = _trl_run(folder, keys, Path(tmp) / "out")
            on_cuda_path = _trl_run(folder, keys, Path(tmp) / "out", cuda_path=True)
            estimated, setup = _estimate(folder, keys, Path(tmp))
            diff = estimated - measured
            named = [{"what": "TRL's CPU fallback of its fused LM head: torch folds of each 32768-wide tile "
                              "(tile-sized fp32 temporaries), every position scored, both operands upcast for the "
                              "fp32 accumulation; on CUDA Triton folds write in place (measured: TRL's own step run "
                              "both ways)", "bytes": measured - on_cuda_path, "kind": "CPU / CUDA kernel difference"}]
            rows.append({"case": name, "measured_peak_bytes": measured, "measured_on_cuda_path_bytes": on_cuda_path,
                         "estimated_peak_bytes": estimated, "difference_bytes": diff, "equal": diff == 0,
                         "named_differences": named, "unexplained_bytes": estimated - on_cuda_path,
                         "seconds": round(time.perf_counter() - t0, 1),
                         "setup": {k: setup[k] for k in ("method", "weights", "compute", "optimizer",
                                                          "optimizer_impl", "micro_batch", "seq_len", "grad_ckpt",
                                                          "loss_kernel")}})
            print(f"{name}: measured {measured:,} B (CUDA path {on_cuda_path:,} B), estimated {estimated:,} B, "
                  f"unexplained {rows[-1]['unexplained_bytes']:+,} B", flush=True)
    held_elsewhere = {
        "llamafactory 0.9.5": "argument defaults (tests/test_framework_defaults.py), freeze step "
                              "(tests/test_framework_freeze.py); its trainer pins transformers <= 5.6.0",
        "axolotl 0.19.0": "config schema defaults (tests/test_framework_defaults.py); pins transformers 5.16.1",
        "ms-swift 4.6.0": "argument classes read from source (tests/test_framework_defaults.py); pins "
                          "transformers < 5.20 and trl < 1.0",
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
