"""What a profile process reads about its own run (the allocator's settings and peaks, the device, the SDPA
kernel and quantization that ran, the tracker's live tensors) and the end-of-run handshake with the parent:
shared by the one-process child (:mod:`.child`) and the ranks of a sharded run (:mod:`.dist_child`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

SETTLE_TIMEOUT_S = 10.0


def sdpa_info(torch: Any, device: str, spec: Any, setup: Any) -> dict[str, Any]:
    """Which SDPA kernel the run chose (torch's own choice, recorded at the first call of each kind) and
    which one :mod:`vramlab.core.sdpa` predicted for the same inputs."""
    from vramlab.core.sdpa import predict
    from vramlab.core.simulation.model import SDPA_CHOICES
    from vramlab.core.spec.options import Attention

    if setup.attention is not Attention.SDPA or not SDPA_CHOICES:
        return {}
    (backend, dtype, gqa, head_dim), _n = max(SDPA_CHOICES.items(), key=lambda kv: kv[1])
    capability = cudnn = None
    if device == "cuda":
        try:
            capability = tuple(torch.cuda.get_device_capability(0))
            cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        except Exception:  # noqa: BLE001
            capability = None
    predicted = predict(torch.__version__, device, dtype, gqa, head_dim, capability, cudnn_version=cudnn)
    return {"sdpa_backend": backend, "sdpa_inputs": f"{dtype}, head_dim {head_dim}{', GQA' if gqa else ''}",
            "sdpa_predicted": predicted.backend, "sdpa_predicted_reason": predicted.reason,
            "sdpa_backends_seen": sorted({k[0] for k in SDPA_CHOICES})}


def quantization_info(device: str, setup: Any) -> dict[str, Any]:
    """Which implementation ran the quantized layers and 8-bit optimizers: bitsandbytes' own (on CUDA,
    where it is installed) or the plain-torch emulation with its storage layout."""
    from vramlab.core.simulation.quant import bitsandbytes_version

    if not (setup.weight_dtype.is_quantized or setup.optimizer.is_bitsandbytes):
        return {}
    from vramlab.core.spec.options import Sharding

    version = bitsandbytes_version() if device == "cuda" else None
    why = ("not on CUDA" if device != "cuda" else "bitsandbytes is not installed" if version is None else
           "a sharded rank is emulated" if setup.sharding is not Sharding.NONE and setup.weight_dtype.is_quantized
           else "")
    if not why:
        return {"quantization": f"bitsandbytes {version}"}
    return {"quantization": f"emulated (plain torch with bitsandbytes' storage layout; {why})"}


def allocator_env() -> dict[str, str]:
    """The allocator settings the run ran with (they change the reserved level): PYTORCH_CUDA_ALLOC_CONF
    and its newer device-neutral name PYTORCH_ALLOC_CONF, where set."""
    return {key.lower(): os.environ[key] for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
            if os.environ.get(key)}


def device_uuid(torch: Any, index: int) -> str:
    """The UUID of ``cuda:<index>`` as the driver names it (torch's device properties), or ""."""
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - older torch / other platforms: the parent keeps NVML's order
        return ""


def settle_and_wait(torch: Any, wait: Callable[[float], bool], emit_fn: Callable[[dict[str, Any]], None],
                    timeout_s: float = SETTLE_TIMEOUT_S, index: Any = None) -> bool:
    """At the end of the run, with nothing left to move: report the allocator's reserved bytes and wait
    until the parent has read this process's NVML memory (``wait(timeout_s)``: a line on stdin, or a
    rank's acknowledgement file). The parent takes the CUDA context as NVML's figure less these reserved
    bytes. True when acknowledged; a parent that never answers costs ``timeout_s``, nothing more."""
    dev = () if index is None else (index,)
    torch.cuda.synchronize(*dev)
    emit_fn({"event": "settle", "reserved": int(torch.cuda.memory_reserved(*dev)),
                       "allocated": int(torch.cuda.memory_allocated(*dev))})
    return wait(timeout_s)


def wait_for_file(path: Any, timeout_s: float, poll_s: float = 0.02) -> bool:
    """True once ``path`` exists, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def wait_for_line(stream: Any, timeout_s: float) -> bool:
    """True once a line arrives on ``stream`` within ``timeout_s`` (a daemon thread reads it, so this works
    on pipes everywhere, Windows included; the thread dies with the process)."""
    got = threading.Event()

    def read() -> None:
        try:
            if stream.readline():
                got.set()
        except (OSError, ValueError):
            pass

    threading.Thread(target=read, name="vramlab-settle", daemon=True).start()
    return got.wait(timeout_s)


def tracked_json(tracker) -> dict[str, Any]:  # noqa: ANN001 - a MemoryTracker
    """The tracker's peak, phase peaks and largest live tensors, as the result line carries them."""
    peak = tracker.peak
    return {"peak": peak.total_bytes, "phase": peak.phase,
            "kinds": {k.value: v for k, v in peak.kinds.items() if v},
            "phases": {k: r.total_bytes for k, r in tracker.phase_peaks.items()},
            "phase_kinds": {k: {kk.value: v for kk, v in r.kinds.items() if v}
                            for k, r in tracker.phase_peaks.items()},
            "top": [[t.nbytes, t.kind.value, t.label, list(t.shape), t.dtype, t.created_in] for t in peak.top]}


def tensor_level_peak(stats: dict[str, Any]) -> int | None:
    """The measured counterpart of the estimate's tensor level, from ``torch.cuda.memory_stats()``: the bytes
    the allocator was asked for (``requested_bytes.all.peak``), not ``max_memory_allocated``
    (``allocated_bytes.all.peak``), which counts each block rounded up (512 bytes; large sizes to 2 MiB
    multiples when split). Both include what torch's libraries take from the caching allocator (the cuBLAS
    workspaces, cuDNN's and flash attention's backward scratch), which the estimate holds as overheads beside the
    tensor level (``tools/gpu_check.py`` adds them to the prediction it compares). None where this torch does not
    count requested bytes."""
    value = stats.get("requested_bytes.all.peak")
    return int(value) if value is not None else None


class PhaseMeter:
    """The allocator's peaks of each phase of a profiled run, and the phase line emitted as each phase begins:
    shared by the one-process child and the ranks of a sharded run. ``phases`` maps a phase key to its peak
    ``allocated`` and ``reserved`` bytes (and ``requested``, the tensor level, with ``requested=True``) on CUDA;
    ``key`` is the phase in progress. On the CPU there is no caching allocator: the tracker's phase peak (its
    tensor level) stands for both."""

    def __init__(self, torch: Any, cuda: bool, device: Any, tracker: Any, emit_fn: Callable[[dict[str, Any]], None],
                 t_start: float, requested: bool = False) -> None:
        self.torch, self.cuda, self.device, self.tracker, self.emit = torch, cuda, device, tracker, emit_fn
        self.t_start, self.requested = t_start, requested
        self.phases: dict[str, dict[str, int]] = {}
        self.key = "load"

    def __call__(self, key: str, live: int) -> None:
        """Phase ``key`` begins (``live``: the tracker's live bytes): close the one in progress, emit the line."""
        prev = self.key
        ended: dict[str, Any] = {}
        if self.cuda:
            cuda, device = self.torch.cuda, self.device
            cuda.synchronize(device)
            rec = self.phases.setdefault(prev, {"allocated": 0, "reserved": 0})
            rec["allocated"] = max(rec["allocated"], cuda.max_memory_allocated(device))
            rec["reserved"] = max(rec["reserved"], cuda.max_memory_reserved(device))
            if self.requested:
                level = tensor_level_peak(cuda.memory_stats(device))  # the estimate's tensor level
                if level is not None:
                    rec["requested"] = max(rec.get("requested", 0), level)
            cuda.reset_peak_memory_stats(device)
            alloc, resv = cuda.memory_allocated(device), cuda.memory_reserved(device)
            if prev != key:
                ended = {"ended": prev, "ended_peak_allocated": rec["allocated"],
                         "ended_peak_reserved": rec["reserved"]}
        else:
            alloc, resv = live, live
            peak = getattr(self.tracker, "phase_peaks", {}).get(prev) if prev != key else None
            if peak is not None:  # no caching allocator on the CPU: reserved is the tensor level
                ended = {"ended": prev, "ended_peak_allocated": peak.total_bytes,
                         "ended_peak_reserved": peak.total_bytes}
        self.key = key
        self.emit({"event": "phase", "key": key, "allocated": alloc, "reserved": resv,
                   "t": time.perf_counter() - self.t_start, **ended})
