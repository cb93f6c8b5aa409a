"""`make gpu-check`: what any machine with an NVIDIA GPU can check of VRAM Lab's CUDA paths, in minutes.

    python tools/gpu_check.py [--model qwen2.5-0.5b] [--out benchmarks/results/gpu_check.json] [--no-simulate]

It runs the GPU tests (``pytest -m gpu``), then real profiles of a small model: full fine-tuning, LoRA,
QLoRA (bitsandbytes' own kernels when bitsandbytes is installed, the emulation otherwise: the result says
which), an 8-bit and a paged 8-bit optimizer, a forced out-of-memory, a cancel, a calibration, and a
two-GPU FSDP run where two GPUs exist. During each run one NVML watch samples the run's GPU. For every
profile it prints the predicted (estimate, and simulation for the tensor level) against the measured value
at each level: tensor peak, allocator reserved, device used, CUDA context. Everything lands in one JSON file
(written to a temporary file and renamed).

Without CUDA it says so in one line and exits 0 having run nothing: the check is for machines that have a
GPU, and a machine without one is not a failure of it. Budget: under 5 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
MiB = 2**20


def cuda_reason() -> str | None:
    """Why there is no CUDA GPU here (None: there is one). No CUDA context is made in this process: the
    profiles run in children and NVML must see only theirs."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    if not torch.cuda.is_available():
        from vramlab.core.monitor import describe_gpus

        listing = describe_gpus()
        return listing.reason or "torch sees no CUDA device"
    return None


def pct(measured: int | None, predicted: int | None) -> float | None:
    if not measured or predicted is None:
        return None
    return round(100.0 * (predicted - measured) / measured, 2)


def deviations(out: Any, est: Any, sim: Any) -> dict[str, Any]:
    """Predicted against measured at each level (bytes, and the prediction's error in % of measured)."""
    r = out.result
    ctx_pred = next((o.bytes for o in est.overheads if o.name == "CUDA context"), None)
    rows = {
        "tensor_peak": (r.peak_allocated_bytes, est.peak_allocated_bytes),
        "allocator_reserved": (r.peak_reserved_bytes, est.peak_reserved_bytes),
        "device_used_process": (out.process_used_peak_bytes, est.device_used_bytes),
        "cuda_context": (out.context_bytes, ctx_pred),
    }
    levels = {k: {"measured": m, "estimate": p, "estimate_error_pct": pct(m, p)} for k, (m, p) in rows.items()}
    if sim is not None:
        levels["tensor_peak"]["simulate"] = sim.peak_allocated_bytes
        levels["tensor_peak"]["simulate_error_pct"] = pct(r.peak_allocated_bytes, sim.peak_allocated_bytes)
    levels["device_used_whole_gpu"] = {"measured": out.device_used_peak_bytes}
    return levels


def show(name: str, levels: dict[str, Any]) -> None:
    def mib(b: int | None) -> str:
        return "-" if b is None else f"{b / MiB:,.0f} MiB"

    print(f"  {name}")
    for level, row in levels.items():
        parts = [f"measured {mib(row.get('measured'))}"]
        if "estimate" in row:
            err = row.get("estimate_error_pct")
            parts.append(f"estimate {mib(row['estimate'])} ({'-' if err is None else f'{err:+.1f} %'})")
        if "simulate" in row:
            parts.append(f"simulate {mib(row['simulate'])} ({row['simulate_error_pct']:+.1f} %)")
        print(f"    {level:<24}" + ", ".join(parts))


def run_pytest() -> dict[str, Any]:
    t0 = time.monotonic()
    env = dict(os.environ, VRAMLAB_BLOCK_QT="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:pytest-qt", "-p", "no:xdist",
                           "--ignore=tests/gui", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    print("\n".join("  " + line for line in tail))
    return {"returncode": proc.returncode, "tail": tail, "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a preset id (small: every setup runs in seconds)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-simulate", action="store_true", help="skip the CPU simulation of each setup")
    ap.add_argument("--no-tests", action="store_true", help="skip `pytest -m gpu`")
    ap.add_argument("--seq", type=int, help="every setup's sequence length (default: 512, LoRA/QLoRA 1024)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of this script's own flow on the CPU (no NVML, no device level)")
    args = ap.parse_args(argv)

    reason = cuda_reason() if args.device == "cuda" else None
    if reason is not None:
        print(f"gpu-check: no CUDA GPU here ({reason}); nothing was run and no result was written.")
        return 0

    import torch

    from vramlab.core.calibration import from_profile
    from vramlab.core.catalog import detected_gpu, find_model
    from vramlab.core.estimate import estimate
    from vramlab.core.levels import allocator_slack
    from vramlab.core.measure.profile import profile
    from vramlab.core.measure.quant import bnb_status
    from vramlab.core.monitor import NvmlSampler
    from vramlab.core.monitor.detect import cuda_device
    from vramlab.core.monitor.watch import RunWatch
    from vramlab.core.spec import TrainingSetup

    t_start = time.monotonic()
    spec = find_model(args.model)
    if spec is None:
        print(f"gpu-check: unknown model preset {args.model!r}", file=sys.stderr)
        return 2
    sampler = NvmlSampler()
    dev = cuda_device(sampler, 0)
    gpu = (detected_gpu(dev.name, dev.memory_total_bytes or 0, 0, dev.compute_capability)
           if dev is not None and dev.memory_total_bytes else None)
    count = torch.cuda.device_count() if args.device == "cuda" else 0
    doc: dict[str, Any] = {
        "benchmark": "gpu_check", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "gpus": count, "gpu": dev.name if dev else None,
                    "driver": dev.driver_version if dev else None,
                    "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
        "model": args.model, "bitsandbytes": bnb_status(), "runs": {},
    }
    print(f"gpu-check on {doc['machine']['gpu']} x{count}, torch {torch.__version__}, model {args.model}, "
          f"bitsandbytes: {doc['bitsandbytes']}")
    if not args.no_tests:
        print("GPU tests (pytest -m gpu):")
        doc["pytest"] = run_pytest()

    base = TrainingSetup(seq_len=512)
    setups = {
        "full": base.replace(optimizer_impl="fused"),
        "lora": base.replace(method="lora", seq_len=1024),
        "qlora": base.replace(method="qlora", seq_len=1024),
        "adamw8bit": base.replace(optimizer="adamw8bit"),
        "paged_adamw8bit": base.replace(optimizer="paged_adamw8bit"),
    }
    if count >= 2:
        setups["fsdp2"] = base.replace(gpus=2, sharding="fsdp")
    if args.seq:
        setups = {name: setup.replace(seq_len=args.seq) for name, setup in setups.items()}
    print("Profiles (predicted vs measured; error in % of measured):")
    for name, setup in setups.items():
        samples: list[int] = []
        watch = RunWatch(sampler, cuda_indices=range(setup.gpus),
                         on_sample=lambda s, samples=samples: samples.append(len(s.readings)))
        watch.start()
        t0 = time.monotonic()
        out = profile(spec, setup, device=args.device, gpu=gpu, sampler=sampler, watch=watch, timeout_s=240)
        watch.stop()
        entry: dict[str, Any] = {"ok": out.ok, "kind": out.kind, "message": out.message,
                                 "seconds": round(time.monotonic() - t0, 1), "nvml_samples": len(samples),
                                 "environment": out.info}
        if out.ok:
            est = estimate(spec, setup, gpu, allocator=True, calibration=None)
            sim = None
            if not args.no_simulate:
                from vramlab.core.measure.simulate import simulate

                sim = simulate(spec, setup)
            entry["levels"] = deviations(out, est, sim)
            entry["notes"] = list(out.result.notes)
            show(f"{name} ({out.info.get('quantization', '')} sdpa {out.info.get('sdpa_backend', '?')}, "
                 f"{len(samples)} NVML samples)", entry["levels"])
            if name == "lora" and out.context_bytes and args.device == "cuda":
                cal = from_profile(out.info.get("gpu", "GPU"), out.context_bytes, out.result.peak_allocated_bytes,
                                   out.result.peak_reserved_bytes, allocator_slack(est),
                                   torch=out.info.get("torch", ""), driver=out.info.get("driver", ""))
                doc["calibration"] = {"gpu": cal.gpu_name, "context_bytes": cal.context_bytes,
                                      "slack_ratio": cal.slack_ratio, "torch": cal.torch, "driver": cal.driver}
                print(f"  calibration: context {cal.context_bytes / MiB:,.0f} MiB, slack x{cal.slack_ratio:.2f}, "
                      f"driver {cal.driver or '?'} (not saved to your settings)")
        else:
            print(f"  {name}: {out.kind}: {out.message}")
        doc["runs"][name] = entry

    # a forced out-of-memory and a cancel: each must come back as a result, with nothing left running
    oom = profile(spec, setups["lora"], device=args.device, gpu=gpu, fault="oom", timeout_s=120)
    doc["runs"]["forced_oom"] = {"kind": oom.kind, "phase": oom.failed_phase, "ok": oom.kind == "oom"}
    print(f"  forced OOM: {oom.kind} in {oom.failed_phase}")
    seen: list[str] = []
    cancelled = profile(spec, setups["lora"], device=args.device, gpu=gpu, timeout_s=120,
                        on_event=lambda e: seen.append(e.get("key", "")) if e.get("event") == "phase" else None,
                        should_abort=lambda: "backward@1" in seen)
    doc["runs"]["cancel"] = {"kind": cancelled.kind, "ok": cancelled.kind == "cancelled"}
    print(f"  cancel at backward@1: {cancelled.kind}")
    sampler.close()

    doc["seconds"] = round(time.monotonic() - t_start, 1)
    failed = [n for n, e in doc["runs"].items() if not e.get("ok")]
    if doc.get("pytest", {}).get("returncode", 0) not in (0, 5):  # 5: no test collected
        failed.append("pytest -m gpu")
    doc["failed"] = failed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=".gpu_check-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks ran'} in {doc['seconds']:.0f} s; "
          f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
