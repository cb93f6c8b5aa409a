"""The frameworks that pin an older transformers than this project's, each run by its own training entry point in
a virtual environment of its own (``make conformance-frameworks``): ms-swift 4.6.0's ``sft_main``, axolotl
0.19.0's ``axolotl.cli.train``, LLaMA-Factory 0.9.5's ``run_exp``, two steps of a tiny Llama on real CPU tensors
under VRAM Lab's tracker; beside it the estimate of the same YAML, read by ``core/sources/training.py`` in this
project's venv (transformers 5.25), and what is alive at both peaks, storage by storage (tools/conformance.py).

The framework's venv holds the framework with its own pinned dependencies and this project installed with
``--no-deps`` (the tracker needs torch alone); torch stays the 2.13.0+cpu build the project's venv has.

Run (in this project's venv):  python tools/conformance_frameworks.py [--out ...] [--only swift]
In a framework's venv (the child): python tools/conformance_frameworks.py --child swift CONFIG RESULT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import conformance as C  # noqa: E402

VERSIONS = {"swift": "ms-swift==4.6.0", "axolotl": "axolotl==0.19.0", "llamafactory": "llamafactory==0.9.5"}
SEQ, BATCH, STEPS = C.SEQ, C.BATCH, C.STEPS
_WORDS = " ".join(f"t{3 + i % 500}" for i in range(4 * SEQ))  # longer than SEQ: truncated to SEQ tokens


def _swift_case(work: Path, lora: bool) -> dict:
    rows = [{"messages": [{"role": "user", "content": _WORDS}, {"role": "assistant", "content": _WORDS}]}
            for _ in range(BATCH * STEPS)]
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = {"model": str(work / "tiny-llama"), "model_type": "llama", "template": "default",
            "dataset": [str(work / "data.jsonl")], "tuner_type": "lora" if lora else "full",
            "torch_dtype": "float32", "max_length": SEQ, "truncation_strategy": "right",
            "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "max_steps": STEPS,
            "output_dir": str(work / "out"), "save_strategy": "no", "report_to": ["none"], "logging_steps": 100,
            "dataloader_num_workers": 0, "dataset_num_proc": 1, "split_dataset_ratio": 0, "use_cpu": True,
            "fp16": False,  # accelerate autocasts fp16 only off the CPU (Accelerator: native_amp)
            "seed": 0}
    if lora:
        body |= {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    return body


def _axolotl_case(work: Path, lora: bool) -> dict:
    (work / "data.jsonl").write_text("".join(json.dumps({"text": _WORDS}) + "\n" for _ in range(BATCH * STEPS)))
    body = {"base_model": str(work / "tiny-llama"), "datasets": [{"path": str(work / "data.jsonl"), "ds_type": "json",
            "type": "completion"}], "dataset_prepared_path": str(work / "prepared"), "val_set_size": 0,
            "sequence_len": SEQ, "excess_length_strategy": "truncate", "micro_batch_size": BATCH,
            "gradient_accumulation_steps": 1, "max_steps": STEPS, "num_epochs": 1, "learning_rate": 1e-4,
            "output_dir": str(work / "out"), "save_strategy": "no", "bf16": False, "fp16": False, "tf32": False,
            "dataloader_num_workers": 0, "dataset_processes": 1, "seed": 0}
    if lora:
        body |= {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                 "lora_target_modules": ["q_proj", "v_proj"]}
    return body


def _llamafactory_case(work: Path, lora: bool) -> dict:
    rows = [{"instruction": _WORDS, "input": "", "output": _WORDS} for _ in range(BATCH * STEPS)]
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "data.jsonl"}}))
    body = {"model_name_or_path": str(work / "tiny-llama"), "stage": "sft", "do_train": True,
            "finetuning_type": "lora" if lora else "full", "dataset": "tiny", "dataset_dir": str(work),
            "template": "default", "cutoff_len": SEQ, "overwrite_cache": True, "output_dir": str(work / "out"),
            "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "max_steps": STEPS,
            "save_strategy": "no", "report_to": "none", "logging_steps": 100, "use_cpu": True,
            "dataloader_num_workers": 0, "seed": 0}
    if lora:
        body |= {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target": "q_proj,v_proj"}
    return body


CASES = {
    "swift sft full": ("swift", _swift_case, False),
    "swift sft lora": ("swift", _swift_case, True),
    "axolotl sft full": ("axolotl", _axolotl_case, False),
    "axolotl sft lora": ("axolotl", _axolotl_case, True),
    "llamafactory sft full": ("llamafactory", _llamafactory_case, False),
    "llamafactory sft lora": ("llamafactory", _llamafactory_case, True),
}


# ---- the child: in the framework's venv -------------------------------------------------------------------------

@contextlib.contextmanager
def _weights_counted(tracker) -> Iterator[None]:  # noqa: ANN001
    """Every model the framework loads has its parameters and buffers counted as weights (``from_pretrained`` reads
    them out of the file past the dispatcher, tools/conformance.py ``_trl_run``)."""
    from transformers import PreTrainedModel

    from vramlab.core.kinds import Kind

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        model = original(cls, *a, **k)
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            tracker.register(t, Kind.WEIGHTS)
            tracker.reclassify(t, Kind.WEIGHTS, name)
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = classmethod(original)


def _run_swift(config: Path) -> None:
    from swift import sft_main
    from swift.cli.main import parse_yaml_args

    argv = [str(config)]
    parse_yaml_args(argv)
    sft_main(argv)


def _run_axolotl(config: Path) -> None:
    from axolotl.cli.train import do_cli

    sys.argv = sys.argv[:1]  # do_cli parses its TrainerCliArgs from the command line
    do_cli(config=str(config))


def _run_llamafactory(config: Path) -> None:
    import importlib.machinery
    import types

    import yaml

    # llamafactory/data/mm_plugin.py imports torchaudio at the top for audio inputs; the index has no torchaudio
    # for torch 2.13 (2.11.1's library does not load over it), and a text run never calls it
    audio = types.ModuleType("torchaudio")
    audio.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    sys.modules.setdefault("torchaudio", audio)
    from llamafactory.train.tuner import run_exp

    run_exp(yaml.safe_load(config.read_text()))


def child(framework: str, config: Path, result: Path) -> int:
    from importlib import metadata

    runner = {"swift": _run_swift, "axolotl": _run_axolotl, "llamafactory": _run_llamafactory}[framework]
    tracker = C._sited_tracker()
    with tracker, _weights_counted(tracker):
        runner(config)
    alive = [{"bytes": t.nbytes, "shape": list(t.shape), "dtype": t.dtype, "label": t.label}
             for t in tracker.peak.top]
    pkgs = ("torch", "transformers", "peft", "trl", "accelerate", VERSIONS[framework].split("==")[0])
    versions = {d: metadata.version(d) for d in pkgs if _installed(d)}
    result.write_text(json.dumps({"peak": tracker.peak.total_bytes, "alive": alive, "versions": versions}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # axolotl's telemetry and logging threads hold the interpreter's exit for minutes


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


# ---- the parent: in this project's venv -------------------------------------------------------------------------

def _venv(framework: str) -> Path:
    return ROOT / f".venv-{framework}"


def _run_in_venv(framework: str, config: Path, work: Path) -> dict:
    result = work / "run.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true",
           "CUDA_VISIBLE_DEVICES": "", "DO_NOT_TRACK": "1"}
    proc = subprocess.run([str(_venv(framework) / "bin" / "python"), __file__, "--child", framework, str(config),
                           str(result)], check=False, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{framework}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def _estimate(folder: Path, config: Path) -> tuple[int, object, object, list]:
    from vramlab.core.estimate import estimate
    from vramlab.core.sources.folder import load_model_source
    from vramlab.core.sources.training import read_training_configs
    from vramlab.core.spec.training import TrainingSetup

    src = read_training_configs([config])
    setup = TrainingSetup().replace(**src.changes)
    spec = load_model_source(folder).spec
    r = estimate(spec, setup, match_simulation=True)
    mapped = [f"{m.key} -> {m.field} = {m.setting} ({m.status})" for m in src.rows if m.field]
    return r.peak_allocated_bytes, setup, spec, mapped


# what is alive at the run's peak and not at the estimate's, by the code that made it: (test, what, kind)
_HOST = "CPU run only: host memory on CUDA"
_NEXT_BATCH = (
    "the next batch, collated already (input_ids, attention_mask, labels from DataCollatorForSeq2Seq's "
    "BatchEncoding.as_tensor, each [batch, seq] int64): accelerate's DataLoaderShard.__iter__ (data_loader.py) "
    "iterates one batch ahead to know the last and moves a batch to the device only when it becomes the current "
    "one, so on CUDA it waits in host memory; axolotl's completion strategy cuts each text into sequence_len "
    "chunks, so its dataset outlasts the two steps, where the others' ends with them (the current batch, on the "
    "device, is the step's own)")
_NAMED = [
    (lambda t: t["site"].startswith(("peft/tuners/loha/layer.py", "bitsandbytes/backends/utils.py")),
     "tensors made at import: peft's LoHa autograd functions' default argument scale=torch.tensor(1) (the "
     "framework imports every peft tuner) and bitsandbytes' NF4 / FP4 code tables; a CUDA run keeps them on the "
     "host", _HOST),
    (lambda t: t["site"].startswith("axolotl/core/trainers/base.py") and "compute_loss" in t["site"],
     "axolotl's token counters (state.tokens, summed on the host with .cpu())", _HOST),
    (lambda t: t["shape"] == [] and t["site"].startswith(("transformers/trainer.py", "accelerate/",
                                                           "transformers/loss/", "swift/")),
     "the training loop's own 0-dim device tensors, a 512-byte CUDA block each, which the step does not model: "
     "the loss scaled by num_items_in_batch (transformers' fixed_cross_entropy, ms-swift's compute_sft_loss), "
     "the label count, the gradient norm, accelerate's loss / gradient_accumulation_steps (as in "
     "conformance.json)", "the trainer's own tensors"),
    (lambda t: t["shape"] == [BATCH, SEQ] and t["site"].startswith("transformers/tokenization_utils_base.py"),
     _NEXT_BATCH, _HOST),
]


def _named(tensors: dict) -> tuple[list[dict], int]:
    """The run-only storages named by :data:`_NAMED`, summed by rule, and the bytes they account for."""
    out: dict[str, dict] = {}
    for t in tensors["only_in_the_run"]:
        site = t["made_by"].split(" @ ", 1)[1] if " @ " in t["made_by"] else ""
        for test, what, kind in _NAMED:
            if test({**t, "site": site}):
                row = out.setdefault(what, {"what": what, "bytes": 0, "kind": kind})
                row["bytes"] -= t["bytes"]
                break
    return list(out.values()), sum(r["bytes"] for r in out.values())


def main(argv: list[str] | None = None) -> int:
    import yaml

    from vramlab.core.kinds import LiveTensor

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conformance_frameworks.json"))
    p.add_argument("--only", action="append", help="a framework (swift, axolotl, llamafactory)")
    a = p.parse_args(argv)
    rows, versions = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (framework, make, lora) in CASES.items():
            if a.only and framework not in a.only:
                continue
            work = Path(tmp) / name.replace(" ", "-")
            work.mkdir()
            C._tiny(work / "tiny-llama")
            config = work / f"{framework}.yaml"
            config.write_text(yaml.safe_dump(make(work, lora)))
            t0 = time.perf_counter()
            run = _run_in_venv(framework, config, work)
            versions[framework] = run["versions"]
            estimated, setup, spec, mapped = _estimate(work / "tiny-llama", config)
            reference, ref_alive = C._reference(spec, setup)
            alive = [LiveTensor(t["bytes"], None, t["label"], tuple(t["shape"]), t["dtype"], "")
                     for t in run["alive"]]
            tensors = C._tensor_diff(alive, ref_alive, C.LOOP_SITES)
            resolved = setup.resolved()
            named, named_bytes = _named(tensors)
            rows.append({"case": name, "measured_peak_bytes": run["peak"], "estimated_peak_bytes": estimated,
                         "difference_bytes": estimated - run["peak"], "equal": estimated == run["peak"],
                         "named_differences": named, "unexplained_bytes": estimated - run["peak"] - named_bytes,
                         "estimate_equals_its_reference": estimated == reference,
                         "tensors_at_the_peaks": tensors, "read": mapped,
                         "seconds": round(time.perf_counter() - t0, 1),
                         "setup": {k: resolved[k] for k in ("method", "weights", "compute", "optimizer",
                                                             "optimizer_impl", "micro_batch", "seq_len",
                                                             "grad_ckpt", "loss_kernel")}})
            print(f"{name}: measured {run['peak']:,} B, estimated {estimated:,} B, difference "
                  f"{estimated - run['peak']:+,} B, unexplained {rows[-1]['unexplained_bytes']:+,} B", flush=True)
    result = {"benchmark": "conformance_frameworks", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "versions": versions, "model": C.CONFIG, "batch": BATCH, "seq": SEQ, "steps": STEPS, "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])))
    sys.exit(main())
