"""`make gpu-check`: what one NVIDIA GPU can tell about VRAM Lab's CUDA paths in a short device slot.

    python tools/gpu_check.py [--no-venv] [--out benchmarks/results/gpu_check.json] [--budget 480] [--only a,b]

It runs a plan in priority order, every step in a process of its own under its own timeout (a hang or a crash
ends that step, never the check), within one overall budget (8 minutes by default): a step that no longer fits
is recorded as not run. The plan:

 1. ``nvml_probe``: NVML per-process memory against the whole GPU's used delta for a process that holds 1 GiB
    (does NVML list this process by its PID here, or is it a container's PID namespace?);
 2. ``context``: the CUDA context after init, after the first cuBLAS matmul, after an SDPA forward and backward,
    after a bitsandbytes op (NVML's figure less the allocator's reserved bytes at each stage);
 3. ``cublas_workspace``: what the first matmul in forward and in backward adds to memory_allocated, against
    ``core.levels.cublas_bytes`` for this GPU, and torch's own cuBLAS / cuBLASLt workspace sizes;
 4. ``attention_kernel``: ``torch._fused_sdp_choice`` for bf16 and fp32, with and without GQA, against
    ``core.sdpa.predict`` (the pure function the estimator uses);
 5. ``attention_scratch``: the backward of one SDPA call beyond its gradients, against
    ``core.levels.attention_backward_scratch`` for the kernel torch chose;
 6. profiles against estimates (tensor level: ``requested_bytes.all.peak``, with ``max_memory_allocated`` shown
    beside it; allocator reserved; device used, per process or whole-GPU delta; context): QLoRA NF4, LoRA int8
    with and without checkpointing, fp32 LoRA on a GQA model (SDPA's math kernel), paged 8-bit AdamW, and 50
    steps of LoRA (fragmentation);
 7. ``pytest -m gpu`` with what time is left.

Steps that need bitsandbytes (QLoRA, int8, paged 8-bit) are recorded as skipped, with the reason, where it is
not installed; the result names bitsandbytes' version or its absence. A level that deviates from its
prediction beyond :data:`TOLERANCE_PCT` fails the check (exit 1), as does a kernel predicted wrongly or a step
that crashed or timed out. One JSON file is written whatever happens (after every step, atomically, and on
SIGTERM): without CUDA it says so and ran nothing (exit 0).

``--no-venv`` runs in the interpreter it was started with and installs nothing: in an existing environment
with a CUDA torch and no network, the source tree is made importable as ``vramlab`` where it is not installed.
Where this interpreter's torch is missing or a CPU build (this project's venv on a GPU machine) and a
``python3`` / ``python`` on PATH has a CUDA torch, the check runs again there, once.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
MiB = 2**20
BUDGET_S = 480.0  # 8 minutes on one GPU, all steps together
MIN_STEP_S = 15.0  # a step that would get less than this is not started
MODEL = "qwen2.5-0.5b"  # small, grouped-query attention (14 query heads, 2 kv heads): every profile in seconds

# A prediction's error in % of the measured value beyond which the check fails, by level. The tensor level is
# the estimator's own (exact against the simulation); the outer levels are models of the allocator and the driver.
TOLERANCE_PCT = {"tensor": 5.0, "reserved": 15.0, "device": 20.0}


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: float
    needs_bnb: bool = False
    what: str = ""


def plan(gpus: int = 1) -> list[Step]:
    """The steps in priority order (most telling first, for a short device slot)."""
    steps = [
        Step("nvml_probe", 40, what="NVML per-process vs whole-GPU used for a 1 GiB process"),
        Step("context", 60, what="CUDA context after init, cuBLAS, attention, bitsandbytes"),
        Step("cublas_workspace", 40, what="cuBLAS workspaces in forward and backward vs the model"),
        Step("attention_kernel", 30, what="SDPA kernel chosen for bf16/fp32 with and without GQA vs predicted"),
        Step("attention_scratch", 40, what="SDPA backward scratch vs the modelled kernel's"),
        Step("profile:qlora_nf4", 60, needs_bnb=True, what="QLoRA NF4 (bitsandbytes)"),
        Step("profile:lora_int8", 60, needs_bnb=True, what="LoRA on int8 weights (MatMul8bitLt keeps its input)"),
        Step("profile:lora_int8_ckpt", 60, needs_bnb=True, what="the same with gradient checkpointing"),
        Step("profile:fp32_lora_gqa", 60, what="fp32 LoRA on a GQA model (SDPA's math kernel)"),
        Step("profile:paged_adamw8bit", 60, needs_bnb=True, what="full fine-tuning, paged 8-bit AdamW"),
        Step("profile:lora_50_steps", 90, what="50 steps of LoRA: the allocator's fragmentation"),
        Step("pytest", 120, what="pytest -m gpu"),
    ]
    if gpus < 2:
        return steps
    return [*steps[:-1], Step("profile:fsdp2", 90, what="two-GPU FSDP (NCCL's share of the device level)"), steps[-1]]


# ---- the plan's runner (pure: tested on the CPU with fake steps) ----------------------------------------------

def run_plan(steps: list[Step], run_step: Callable[[Step, float], dict[str, Any]], budget_s: float,
             write: Callable[[dict[str, Any]], None], doc: dict[str, Any], bnb: str | None,
             clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Run ``steps`` in order, each through ``run_step(step, timeout_s)`` (which returns the step's result
    dict and never raises for the step's own failure), within ``budget_s`` overall; ``doc["steps"]`` gets one
    entry per step (run, skipped, or not run for want of time) and ``write(doc)`` is called after each."""
    t0 = clock()
    doc.setdefault("steps", {})
    for step in steps:
        left = budget_s - (clock() - t0)
        if step.needs_bnb and bnb is None:
            entry: dict[str, Any] = {"status": "skipped", "reason": "bitsandbytes is not installed "
                                     "(pip install 'vramlab[gpu]')"}
        elif left < MIN_STEP_S:
            entry = {"status": "not_run", "reason": f"out of time ({left:.0f} s of the {budget_s:.0f} s budget left)"}
        else:
            timeout = min(step.timeout_s, left)
            started = clock()
            try:
                entry = run_step(step, timeout)
            except Exception as e:  # noqa: BLE001 - the check's own fault in one step is that step's result
                entry = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
            entry.setdefault("status", "ok")
            entry["seconds"] = round(clock() - started, 1)
            entry["timeout_s"] = round(timeout, 1)
        entry["what"] = step.what
        doc["steps"][step.name] = entry
        doc["seconds"] = round(clock() - t0, 1)
        doc["failed"] = failures(doc)
        write(doc)
    return doc


def failures(doc: dict[str, Any]) -> list[str]:
    """What fails the check: a step that errored, crashed or timed out, a level beyond its tolerance, a
    kernel predicted wrongly. Skipped steps (no bitsandbytes) and steps left for want of time do not."""
    out = []
    for name, entry in doc.get("steps", {}).items():
        status = entry.get("status")
        if status in ("error", "timeout", "crashed"):
            out.append(f"{name}: {status} ({entry.get('reason', '')})")
        for level in entry.get("beyond_tolerance", []):
            out.append(f"{name}: {level}")
        for miss in entry.get("mispredicted", []):
            out.append(f"{name}: {miss}")
    return out


def pct(measured: int | None, predicted: int | None) -> float | None:
    if not measured or predicted is None:
        return None
    return round(100.0 * (predicted - measured) / measured, 2)


def judge(levels: dict[str, dict[str, Any]], tolerance: dict[str, float] | None = None) -> list[str]:
    """The levels whose estimate error is beyond tolerance ('tensor: +7.1 % > 5 %'); a level without both
    figures is not judged."""
    tol = TOLERANCE_PCT if tolerance is None else tolerance
    out = []
    for level, row in levels.items():
        limit = tol.get(row.get("judged_as", level))
        err = row.get("estimate_error_pct")
        if limit is not None and err is not None and abs(err) > limit:
            out.append(f"{level}: estimate {err:+.1f} % of measured, beyond {limit:g} %")
    return out


def write_atomic(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gpu_check-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def run_in_process(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one step's command in a session of its own; its last stdout line is its JSON result. On timeout
    the whole session (the step and any child it started) is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    RUNNING.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, err = proc.communicate()
        return {"status": "timeout", "reason": f"no result within {timeout_s:.0f} s; ended",
                "stderr_tail": err.strip().splitlines()[-5:]}
    finally:
        RUNNING.remove(proc)
    lines = [x for x in out.strip().splitlines() if x.startswith("{")]
    if not lines:
        return {"status": "crashed", "reason": f"exit code {proc.returncode}, no result",
                "stderr_tail": err.strip().splitlines()[-8:]}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as e:
        return {"status": "crashed", "reason": f"unreadable result: {e}"}


RUNNING: list[subprocess.Popen] = []  # the step now running (ended with the check on SIGTERM)


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill the step's session and every descendant (a profile's child leads a session of its own)."""
    descendants = []
    try:
        import psutil

        descendants = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the step already gone: the session kill below remains
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    for p in descendants:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass


# ---- importing vramlab without installing it ------------------------------------------------------------------

def ensure_importable() -> dict[str, str]:
    """Make ``import vramlab`` work in this interpreter and in the processes it starts: where vramlab is not
    installed, a one-file package in a temporary folder points ``vramlab`` at the source tree (the same mapping
    as pyproject's package-dir). Returns the environment for child processes."""
    env = dict(os.environ)
    try:
        import vramlab  # noqa: F401

        return env
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="vramlab-shim-"))
    (shim / "vramlab").mkdir()
    (shim / "vramlab" / "__init__.py").write_text(f"__path__ = [{str(ROOT)!r}]\n", encoding="utf-8")
    sys.path.insert(0, str(shim))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    return env


def cuda_reason() -> str | None:
    """Why there is no CUDA GPU here (None: there is one). No CUDA context is made in this process."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


REEXEC_ENV = "VRAMLAB_GPU_CHECK_REEXEC"  # set in a re-executed check: never re-executed twice


def cuda_python(candidates: list[str] | None = None) -> str | None:
    """Another interpreter on PATH whose torch is a CUDA build (a GPU machine's own, where this project's venv
    has the CPU build), or None. Nothing is imported here: each candidate is asked in a process of its own."""
    import shutil

    if candidates is None:
        candidates = [p for p in (shutil.which("python3"), shutil.which("python")) if p]
    here = Path(sys.executable).resolve()
    for py in dict.fromkeys(candidates):
        if Path(py).resolve() == here:
            continue
        try:
            done = subprocess.run([py, "-c", "import torch; print(torch.version.cuda or '')"], capture_output=True,
                                  text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        out = done.stdout.strip().splitlines()
        if done.returncode == 0 and out and out[-1]:
            return py
    return None


def module_versions() -> dict[str, str | None]:
    """What this environment has of what the steps import (None: missing; a step needing it then fails with
    the import error in its result, the others run)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("numpy", "psutil", "nvidia-ml-py", "transformers", "peft", "safetensors", "bitsandbytes", "pytest"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def bnb_version() -> str | None:
    """bitsandbytes' version, read from its metadata (no import in the parent)."""
    from importlib import metadata

    try:
        return metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        return None


# ---- the steps (each runs in its own process: ``--step NAME``) ------------------------------------------------

def _gpu_spec() -> Any:
    from vramlab.core.catalog import detected_gpu
    from vramlab.core.monitor import NvmlSampler
    from vramlab.core.monitor.detect import cuda_device

    sampler = NvmlSampler()
    try:
        dev = cuda_device(sampler, 0)
    finally:
        sampler.close()
    if dev is None or not dev.memory_total_bytes:
        return None
    return detected_gpu(dev.name, dev.memory_total_bytes, 0, dev.compute_capability)


def _nvml_now() -> tuple[int | None, int | None]:
    """(this process's NVML memory, the GPU's used) for CUDA device 0."""
    from vramlab.core.monitor import NvmlSampler
    from vramlab.core.monitor.detect import cuda_device

    sampler = NvmlSampler()
    try:
        dev = cuda_device(sampler, 0)
        if dev is None:
            return None, None
        reading = sampler.sample([dev.nvml_index]).get(dev.nvml_index)
        if reading is None:
            return None, None
        proc = reading.process(os.getpid())
        return (proc.used_bytes if proc is not None else None), reading.memory_used_bytes
    finally:
        sampler.close()


def step_nvml_probe() -> dict[str, Any]:
    _, before = _nvml_now()
    import torch

    x = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    own, used = _nvml_now()
    reserved = torch.cuda.memory_reserved()
    del x
    delta = used - before if used is not None and before is not None else None
    return {"pid_matched": own is not None, "process_used_bytes": own, "whole_gpu_delta_bytes": delta,
            "reserved_bytes": reserved,
            "context_by_process_bytes": own - reserved if own is not None else None,
            "context_by_delta_bytes": delta - reserved if delta is not None else None}


def step_context() -> dict[str, Any]:
    _, before = _nvml_now()
    import torch
    import torch.nn.functional as F

    stages: dict[str, Any] = {}

    def stage(name: str) -> None:
        torch.cuda.synchronize()
        own, used = _nvml_now()
        total = own if own is not None else (used - before if used is not None and before is not None else None)
        reserved = torch.cuda.memory_reserved()
        stages[name] = {"nvml_bytes": total, "reserved_bytes": reserved,
                        "context_bytes": total - reserved if total is not None else None,
                        "source": "process" if own is not None else "whole-GPU delta"}

    torch.cuda.init()
    torch.empty(1, device="cuda")
    stage("init")
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    stage("cublas")
    q = torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    stage("attention")
    try:
        import bitsandbytes as bnb

        w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        qw, state = bnb.functional.quantize_4bit(w, quant_type="nf4")
        bnb.functional.dequantize_4bit(qw, state)
        stage("bitsandbytes")
    except ImportError:
        stages["bitsandbytes"] = {"skipped": "bitsandbytes is not installed"}
    from vramlab.core.levels import context_bytes

    return {"stages": stages, "modelled_context_bytes": context_bytes(_gpu_spec())}


def step_cublas_workspace() -> dict[str, Any]:
    import torch

    from vramlab.core.levels import cublas_bytes

    a = torch.randn(256, 256, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    y = a @ a  # the forward thread's handle and workspace
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_allocated()
    y.sum().backward()  # the autograd engine's device thread: a second handle
    torch.cuda.synchronize()
    m2 = torch.cuda.memory_allocated()
    grads = a.grad.numel() * a.grad.element_size()
    measured = (m1 - m0 - y.numel() * y.element_size()) + (m2 - m1 - grads)
    predicted = cublas_bytes(_gpu_spec())
    sizes = {}
    for name in ("cublas_workspace_size", "cublaslt_workspace_size"):
        fn = getattr(torch.backends.cuda, name, None)
        sizes[name] = fn() if fn is not None else None
    levels = {"cublas_workspaces": {"measured": measured, "estimate": predicted,
                                    "estimate_error_pct": pct(measured, predicted), "judged_as": "reserved"}}
    return {"levels": levels, "torch_sizes": sizes, "beyond_tolerance": judge(levels)}


def _dtypes() -> dict[str, Any]:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def step_attention_kernel() -> dict[str, Any]:
    import torch

    from vramlab.core.sdpa import backend_name, predict

    cc = tuple(torch.cuda.get_device_capability(0))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    rows, wrong = {}, []
    for dtype in ("bf16", "fp32"):
        for gqa in (False, True):
            for head_dim in (64, 128):
                q = torch.zeros(1, 8, 256, head_dim, dtype=_dtypes()[dtype], device="cuda", requires_grad=True)
                kv = torch.zeros(1, 2 if gqa else 8, 256, head_dim, dtype=q.dtype, device="cuda", requires_grad=True)
                chosen = backend_name(torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=gqa))
                predicted = predict(torch.__version__, "cuda", dtype, gqa, head_dim, cc, cudnn_version=cudnn)
                key = f"{dtype}{' gqa' if gqa else ''} d{head_dim}"
                rows[key] = {"chosen": chosen, "predicted": predicted.backend, "reason": predicted.reason}
                if chosen != predicted.backend:
                    wrong.append(f"{key}: torch chose {chosen}, predicted {predicted.backend}")
    return {"capability": list(cc), "cudnn": cudnn, "kernels": rows, "mispredicted": wrong,
            "cudnn_deprioritized_env": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED")}


def step_attention_scratch() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from vramlab.core.catalog import find_model
    from vramlab.core.levels import attention_backward_scratch
    from vramlab.core.sdpa import backend_name
    from vramlab.core.spec.training import TrainingSetup

    spec = find_model("llama-3.1-8b")  # one layer's attention: 32 query heads, 8 kv heads, head_dim 128
    b, h, kv, s, d = 1, spec.num_heads, spec.num_kv_heads, 2048, spec.head_dim
    setup = TrainingSetup(method="lora", seq_len=s, micro_batch=b)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kernel = backend_name(torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=None, enable_gqa=True))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.ones_like(out)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
    measured = torch.cuda.max_memory_allocated() - base - grads
    predicted = attention_backward_scratch(spec, setup, kernel)
    levels = {"attention_backward_scratch": {"measured": measured, "estimate": predicted,
                                             "estimate_error_pct": pct(measured, predicted), "judged_as": "reserved"}}
    return {"kernel": kernel, "shape": [b, h, kv, s, d], "levels": levels}


def _profile_setups() -> dict[str, Any]:
    from vramlab.core.spec.training import TrainingSetup

    lora = TrainingSetup(method="lora", seq_len=1024)
    return {
        "qlora_nf4": (TrainingSetup(method="qlora", seq_len=1024), 2),
        "lora_int8": (TrainingSetup(method="qlora", weights="int8", double_quant=False, seq_len=1024), 2),
        "lora_int8_ckpt": (TrainingSetup(method="qlora", weights="int8", double_quant=False, seq_len=1024,
                                         grad_ckpt=True), 2),
        "fp32_lora_gqa": (TrainingSetup(method="lora", weights="fp32", compute="fp32", seq_len=1024), 2),
        "paged_adamw8bit": (TrainingSetup(seq_len=512, optimizer="paged_adamw8bit"), 2),
        "lora_50_steps": (lora, 50),
        "fsdp2": (TrainingSetup(seq_len=512, gpus=2, sharding="fsdp"), 2),
    }


def profile_levels(out: Any, est: Any) -> dict[str, dict[str, Any]]:
    """Measured against predicted at each level. The tensor level is ``requested_bytes.all.peak`` (what the
    estimate's tensor level predicts, plus the cuBLAS workspaces the allocator also serves), with
    ``max_memory_allocated`` shown beside it; device used is NVML's per-process peak, or the whole GPU's delta
    where NVML matched no PID."""
    r = out.result
    over = {o.name: o.bytes for o in est.overheads}
    cublas = over.get("cuBLAS workspace", 0)
    requested = out.requested_peak_bytes
    device = out.process_used_peak_bytes or out.device_delta_peak_bytes
    rows = {
        "tensor": (requested if requested is not None else r.peak_allocated_bytes, est.peak_allocated_bytes + cublas),
        "reserved": (r.peak_reserved_bytes, est.peak_reserved_bytes),
        "device": (device, est.device_used_bytes),
        "context": (out.context_bytes, over.get("CUDA context")),
    }
    levels = {k: {"measured": m, "estimate": p, "estimate_error_pct": pct(m, p)} for k, (m, p) in rows.items()}
    levels["tensor"]["counter"] = "requested_bytes.all.peak" if requested is not None else "max_memory_allocated"
    levels["tensor"]["max_memory_allocated"] = r.peak_allocated_bytes
    levels["tensor"]["estimate_tensors_only"] = est.peak_allocated_bytes
    levels["device"]["source"] = "process" if out.process_used_peak_bytes else (
        "whole-GPU delta" if out.device_delta_peak_bytes else None)
    levels["device"]["whole_gpu_peak"] = out.device_used_peak_bytes
    levels["context"]["source"] = out.context_source
    levels["context"]["judged_as"] = "none"
    return levels


def step_profile(name: str, model: str, timeout_s: float) -> dict[str, Any]:
    from vramlab.core.catalog import find_model
    from vramlab.core.estimate import estimate
    from vramlab.core.profiling.profile import profile

    setup, steps = _profile_setups()[name]
    spec = find_model(model)
    gpu = _gpu_spec()
    # the profile ends its own child a little before the step's timeout, so that the step can still report
    out = profile(spec, setup, device="cuda", gpu=gpu, steps=steps, timeout_s=max(10.0, timeout_s - 15.0))
    entry: dict[str, Any] = {"setup": setup.to_dict(), "steps_run": steps, "kind": out.kind.value,
                             "message": out.message, "environment": out.info}
    if not out.ok:
        entry["status"] = "error"
        entry["reason"] = f"{out.kind.value}: {out.message}"
        return entry
    est = estimate(spec, setup, gpu, allocator=True, calibration=None)
    entry["levels"] = profile_levels(out, est)
    entry["beyond_tolerance"] = judge(entry["levels"])
    entry["notes"] = list(out.result.notes)
    entry["estimate_notes"] = list(est.notes)
    return entry


def run_named_step(name: str, model: str, timeout_s: float) -> dict[str, Any]:
    if name.startswith("profile:"):
        return step_profile(name.split(":", 1)[1], model, timeout_s)
    fn = {"nvml_probe": step_nvml_probe, "context": step_context, "cublas_workspace": step_cublas_workspace,
          "attention_kernel": step_attention_kernel, "attention_scratch": step_attention_scratch}.get(name)
    if fn is None:
        return {"status": "error", "reason": f"unknown step {name!r}"}
    return fn()


def subprocess_runner(model: str, env: dict[str, str]) -> Callable[[Step, float], dict[str, Any]]:
    def run(step: Step, timeout_s: float) -> dict[str, Any]:
        if step.name == "pytest":
            return _pytest_step(timeout_s, env)
        return run_in_process([sys.executable, str(Path(__file__).resolve()), "--step", step.name, "--model", model,
                               "--step-timeout", str(timeout_s)], timeout_s, env)
    return run


def _pytest_step(timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "skipped", "reason": "pytest is not installed here"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:pytest-qt", "-p", "no:xdist",
           "--ignore=tests/gui", "tests"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=dict(env, VRAMLAB_BLOCK_QT="1"), start_new_session=True)
    RUNNING.append(proc)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, _ = proc.communicate()
        return {"status": "timeout", "reason": f"pytest -m gpu ran past {timeout_s:.0f} s; ended",
                "tail": out.strip().splitlines()[-15:]}
    finally:
        RUNNING.remove(proc)
    tail = out.strip().splitlines()[-15:]
    ok = proc.returncode in (0, 5)  # 5: no test collected
    return {"status": "ok" if ok else "error", "returncode": proc.returncode, "tail": tail,
            **({} if ok else {"reason": f"pytest -m gpu exit code {proc.returncode}"})}


# ---- the parent -----------------------------------------------------------------------------------------------

def show(name: str, entry: dict[str, Any]) -> None:
    def mib(b: int | None) -> str:
        return "-" if b is None else f"{b / MiB:,.0f} MiB"

    status = entry.get("status", "ok")
    print(f"  {name}: {status}{' - ' + entry['reason'] if entry.get('reason') else ''}")
    for level, row in (entry.get("levels") or {}).items():
        err = row.get("estimate_error_pct")
        print(f"    {level:<28} measured {mib(row.get('measured'))}, estimate {mib(row.get('estimate'))} "
              f"({'-' if err is None else f'{err:+.1f} %'})")
    for miss in entry.get("mispredicted", []) + entry.get("beyond_tolerance", []):
        print(f"    FAIL {miss}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL, help="a preset id (small: every setup runs in seconds)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole plan (default 480)")
    ap.add_argument("--only", help="comma-separated step names (default: the whole plan)")
    ap.add_argument("--no-venv", action="store_true",
                    help="run in this interpreter, install nothing (an existing environment, no network)")
    ap.add_argument("--step", help=argparse.SUPPRESS)  # one step, in its own process
    ap.add_argument("--step-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    env = ensure_importable()

    if args.step:
        try:
            result = run_named_step(args.step, args.model, args.step_timeout)
        except Exception as e:  # noqa: BLE001 - reported as the step's result
            import traceback

            result = {"status": "error", "reason": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc().splitlines()[-6:]}
        print(json.dumps(result, default=str))
        return 0

    doc: dict[str, Any] = {
        "benchmark": "gpu_check", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tolerance_pct": TOLERANCE_PCT, "budget_s": args.budget, "model": args.model,
        "bitsandbytes": bnb_version() or "not installed: QLoRA, int8 and 8-bit optimizer steps skipped",
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "interpreter": sys.executable, "no_venv": args.no_venv,
                    "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
        "steps": {}, "failed": [],
    }
    out_path: Path = args.out

    def write(d: dict[str, Any]) -> None:
        write_atomic(out_path, d)

    def on_term(signum: int, _frame: object) -> None:
        for proc in list(RUNNING):  # the step running now, and everything it started
            _kill_session(proc)
        doc["interrupted"] = f"signal {signum}"
        write(doc)
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, on_term)
    reason = cuda_reason()
    no_cuda_torch = reason is not None and reason.startswith(("torch is not installed", "this torch"))
    if no_cuda_torch and not os.environ.get(REEXEC_ENV):
        other = cuda_python()
        if other is not None:  # this interpreter's torch cannot see the GPU, the machine's own can: run there
            print(f"gpu-check: {reason}; running in {other}, whose torch is a CUDA build")
            sys.stdout.flush()
            os.environ[REEXEC_ENV] = "1"
            os.execv(other, [other, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)])
    if reason is not None:
        doc["status"] = "no_gpu"
        doc["reason"] = reason
        write(doc)
        print(f"gpu-check: no CUDA GPU here ({reason}); nothing was run (result: {out_path}).")
        return 0
    import torch

    doc["machine"] |= {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
                       "modules": module_versions()}
    steps = plan(torch.cuda.device_count())
    if args.only:
        wanted = set(args.only.split(","))
        steps = [s for s in steps if s.name in wanted or s.name.removeprefix("profile:") in wanted]
    print(f"gpu-check: torch {torch.__version__}, {doc['machine']['gpus']} GPU(s), bitsandbytes "
          f"{doc['bitsandbytes']}, {len(steps)} steps within {args.budget:.0f} s")
    doc["status"] = "running"
    try:
        run_plan(steps, _printing(subprocess_runner(args.model, env)), args.budget, write, doc, bnb_version())
        doc["status"] = "failed" if doc["failed"] else "passed"
    finally:
        if doc.get("status") == "running":
            doc["status"] = "interrupted"
        write(doc)
    print(f"{'FAILED: ' + '; '.join(doc['failed']) if doc['failed'] else 'passed'} in {doc.get('seconds', 0):.0f} s; "
          f"wrote {out_path}")
    return 1 if doc["failed"] else 0


def _printing(run: Callable[[Step, float], dict[str, Any]]) -> Callable[[Step, float], dict[str, Any]]:
    def wrapped(step: Step, timeout_s: float) -> dict[str, Any]:
        entry = run(step, timeout_s)
        show(step.name, entry)
        return entry
    return wrapped


if __name__ == "__main__":
    raise SystemExit(main())
