"""The profile child process: one real run, isolated so that an out-of-memory error, a driver fault or a
hang never takes the caller down and the GPU memory is fully returned when it exits.

Protocol: one JSON request on stdin; JSON lines on stdout — ``{"event": "phase", ...}`` at every phase
boundary (the phase entered, the allocator's current readings, and for the phase that just ended its
peaks: ``ended``, ``ended_peak_allocated``, ``ended_peak_reserved``), ``{"event": "mem", "allocated",
"reserved", "t"}`` every ``MEM_INTERVAL_S`` in between (the allocator's current bytes on CUDA, the
tracker's live bytes on the CPU), then exactly one ``{"event": "result", ...}`` or
``{"event": "failure", ...}``. Started as
``python -m vramlab.core.profiling.child`` or, in the frozen app, ``vramlab --profile-child``.

A sharded run (:mod:`.distributed`) has no stdin request: in the frozen app ``--profile-child --torchrun
ARGS`` runs torchrun and ``--profile-child --dist-rank RUN_DIR`` one rank (:mod:`.dist_child`).

Fault injection for tests (request ``"fault"``): ``oom`` raises an out-of-memory error in the first
backward, ``crash`` kills the process, ``hang`` never returns, ``slow`` sleeps between phases.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

MEM_INTERVAL_S = 0.1  # allocator readings between phase boundaries, for the live curves
_EMIT = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    line = json.dumps(obj) + "\n"
    with _EMIT:  # the reading thread and the run share stdout: whole lines only
        sys.stdout.write(line)
        sys.stdout.flush()


class MemReadings:
    """A daemon thread that emits ``{"event": "mem"}`` lines from ``read()`` -> (allocated, reserved)."""

    def __init__(self, read: Callable[[], tuple[int, int]], t0: float, interval_s: float = MEM_INTERVAL_S) -> None:
        self._read, self._t0, self._interval = read, t0, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vramlab-mem", daemon=True)

    def __enter__(self) -> MemReadings:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sample()  # the last reading: a run shorter than one interval still has its first and last

    def _loop(self) -> None:
        self._sample()
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        try:
            allocated, reserved = self._read()
        except Exception:  # noqa: BLE001 - a reading is not worth the run
            return
        emit({"event": "mem", "allocated": int(allocated), "reserved": int(reserved),
              "t": time.perf_counter() - self._t0})


def main() -> int:
    # the frozen app has no `python -m`: a sharded run starts torchrun and its ranks through this entry
    if sys.argv[1:2] == ["--torchrun"]:
        from torch.distributed.run import main as torchrun

        torchrun(sys.argv[2:])
        return 0
    if sys.argv[1:2] == ["--dist-rank"]:
        from vramlab.core.profiling.dist_child import main as rank_main

        return rank_main(sys.argv[2:])
    req = _request() if sys.stdout is not None else f"{USAGE}; its stdout, where it writes the events, is closed"
    if isinstance(req, str):  # not a request VRAM Lab's parent wrote: one line, exit 2, nothing on stdout
        print(f"error: {req}", file=sys.stderr)
        return 2
    fault = req.get("fault")
    try:
        return run(req, fault)
    except BaseException as e:  # noqa: BLE001 - every failure becomes a result line
        emit({"event": "failure", "kind": "error", "message": f"{type(e).__name__}: {e}",
              "trace": traceback.format_exc(limit=8)})
        return 1


USAGE = ("this is VRAM Lab's internal profile process: it reads one JSON request on stdin from `vramlab profile` "
         "(run that instead)")


def _request() -> dict[str, Any] | str:
    """The request on stdin, its model and setup checked, or why it is not one."""
    try:
        line = sys.stdin.readline() if sys.stdin is not None else ""
        req = json.loads(line)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"{USAGE}; stdin held no JSON request ({type(e).__name__})"
    if not isinstance(req, dict) or not isinstance(req.get("spec"), dict) or not isinstance(req.get("setup"), dict):
        return f"{USAGE}; the request has no \"spec\" and \"setup\" objects"
    from vramlab.core.checks import SetupError
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    try:
        ModelSpec.from_dict(req["spec"])
        TrainingSetup.from_dict(req["setup"])
    except (SetupError, ValueError, TypeError, KeyError) as e:
        return f"{USAGE}; the request's model or setup is not valid ({str(e).splitlines()[0] if str(e) else e!r})"
    return req


def run(req: dict[str, Any], fault: str | None) -> int:
    import torch

    from vramlab.core.kinds import Phase
    from vramlab.core.profiling.readings import (
        PhaseMeter,
        allocator_env,
        device_uuid,
        quantization_info,
        sdpa_info,
        settle_and_wait,
        tracked_json,
        wait_for_line,
    )
    from vramlab.core.simulation.step import Aborted, measure
    from vramlab.core.simulation.tracker import MemoryTracker, NullTracker
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    spec = ModelSpec.from_dict(req["spec"])
    setup = TrainingSetup.from_dict(req["setup"])
    device = req.get("device", "cuda")
    steps = int(req.get("steps", 2))
    cuda = device == "cuda"
    info: dict[str, Any] = {"device": device, "pid": os.getpid(), "torch": torch.__version__}
    if cuda:
        if not torch.cuda.is_available():
            emit({"event": "failure", "kind": "no_gpu", "message": "CUDA is not available to torch here"})
            return 2
        torch.cuda.init()
        torch.empty(1, device="cuda")  # creates the context
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        info["capability"] = list(torch.cuda.get_device_capability(0))
        free, total = torch.cuda.mem_get_info()
        info["device_total_bytes"] = total
        info["device_free_after_context_bytes"] = free
        uuid = device_uuid(torch, 0)
        if uuid:  # which GPU this is, in CUDA's own numbering: the parent's NVML watch maps it by UUID
            info["gpu_uuid"] = uuid
            emit({"event": "device", "uuid": uuid})
        torch.cuda.reset_peak_memory_stats()
        if req.get("snapshot"):
            torch.cuda.memory._record_memory_history(max_entries=200_000)
    else:
        info["gpu"] = "CPU"
    info.update(allocator_env())
    try:
        import bitsandbytes  # noqa: F401  (only its version is recorded)

        info["bitsandbytes"] = bitsandbytes.__version__
    except Exception:  # noqa: BLE001 - optional
        info["bitsandbytes"] = None

    if cuda and not req.get("tracked"):
        tracker = NullTracker()
    else:
        tracker = MemoryTracker(counts=(lambda t: t.is_cuda) if cuda else None)
    t_start = time.perf_counter()
    meter = PhaseMeter(torch, cuda, None, tracker, emit, t_start, requested=True)
    phases = meter.phases

    def on_phase(key: str, live: int) -> None:
        meter(key, live)
        if fault == "slow":
            time.sleep(0.2)
        if fault == "oom" and key == "backward@1":
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault scenario 'oom')")
        if fault == "crash" and key == "backward@1":
            os._exit(139)
        if fault == "hang" and key == "backward@1":
            while True:
                time.sleep(1)

    sync = torch.cuda.synchronize if cuda else None

    def read() -> tuple[int, int]:
        if cuda:
            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        live = int(getattr(tracker, "current", 0))
        return live, live  # no caching allocator on the CPU

    try:
        with MemReadings(read, t_start):
            run_ = measure(spec, setup, device, real=True, tracker=tracker, steps=steps, on_phase=on_phase,
                           sync=sync)
        on_phase("end", getattr(tracker, "current", 0))
        if cuda and req.get("settle"):
            info["context_settled"] = settle_and_wait(torch, lambda t: wait_for_line(sys.stdin, t), emit)
    except torch.OutOfMemoryError as e:
        failure = {"event": "failure", "kind": "oom", "phase": meter.key, "message": str(e).splitlines()[0],
                   "phases": phases, "info": info}
        if cuda:
            failure["allocated_at_failure"] = torch.cuda.memory_allocated()
            failure["reserved_at_failure"] = torch.cuda.memory_reserved()
            failure["max_allocated"] = max([p["allocated"] for p in phases.values()]
                                           + [torch.cuda.max_memory_allocated()])
        emit(failure)
        return 0
    except Aborted:
        emit({"event": "failure", "kind": "cancelled", "message": "cancelled"})
        return 0
    info.update(sdpa_info(torch, device, spec, setup))
    info.update(quantization_info(device, setup))
    out: dict[str, Any] = {"event": "result", "info": info, "phases": phases, "timing": run_.timing,
                           "total_params": run_.total_params, "trainable_params": run_.trainable_params,
                           "managed_bytes": run_.managed_bytes}
    if cuda:
        out["peak_allocated_bytes"] = max(p["allocated"] for p in phases.values())
        out["peak_reserved_bytes"] = max(p["reserved"] for p in phases.values())
        if any("requested" in p for p in phases.values()):
            out["peak_requested_bytes"] = max(p.get("requested", 0) for p in phases.values())
        if req.get("snapshot"):
            import pickle

            from vramlab.core.fileio import write_atomic

            # what torch.cuda.memory._dump_snapshot writes (a pickle for memory_viz), renamed into place
            write_atomic(req["snapshot"], lambda f: pickle.dump(torch.cuda.memory._snapshot(), f))
            out["snapshot"] = req["snapshot"]
    if isinstance(tracker, MemoryTracker):
        peak = tracker.peak
        out["tracked"] = tracked_json(tracker)
        if not cuda:
            out["peak_allocated_bytes"] = peak.total_bytes
            out["peak_reserved_bytes"] = peak.total_bytes
    if not cuda:
        import resource

        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del Phase
    emit(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
