"""`vramlab profile`: real training steps on this machine's GPU (or CPU), measured.

The run happens in a child process (:mod:`.child`) so that running out of memory, a driver fault or a
hang is a result the caller can show, never a crash, and the GPU memory is returned when the child
exits. The caller streams the child's phase events and, on CUDA, samples NVML at a fixed interval for
the device-used level (the whole GPU as ``nvidia-smi`` shows it, and this run's own process share).

On CUDA the allocator's own counters give the tensor and reserved levels per phase
(``max_memory_allocated`` / ``max_memory_reserved``, reset at every phase boundary); the run is not
traced by the dispatch tracker unless asked (tracing changes how torch accumulates gradients, see
``estimator.engine``). On the CPU the tracker is the measurement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.monitor.watch import RunWatch
from vramlab.core.profiling.outcomes import EventCallback, OutcomeKind, ProfileOutcome, read_outcome, with_watch_info
from vramlab.core.profiling.processes import end_tree, popen_isolated, settle
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import fmt_bytes


def child_command() -> list[str]:
    """How to start the child: the frozen app runs itself with a hidden flag."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "--profile-child"]
    return [sys.executable, "-m", "vramlab.core.profiling.child"]


def profile(
    spec: ModelSpec,
    setup: TrainingSetup,
    device: str = "cuda",
    gpu: GpuSpec | None = None,
    steps: int = 2,
    snapshot: str | None = None,
    isolate: bool = True,
    timeout_s: float = 1800.0,
    on_event: EventCallback | None = None,
    should_abort: Callable[[], bool] | None = None,
    fault: str | None = None,
    tracked: bool = False,
    sampler: Any = None,
    launcher: str = "auto",
    watch: RunWatch | None = None,
) -> ProfileOutcome:
    """Run ``steps`` real training steps; returns a :class:`ProfileOutcome` (never raises for a failed
    run). ``on_event`` first gets ``{"event": "started", "pid": ...}`` (the child's process id), then every
    line the child prints (see :mod:`.child`), on a reader thread. ``should_abort`` is polled; ``sampler``
    is a GpuSampler used for NVML readings (a real NvmlSampler by default on CUDA); ``watch`` a
    :class:`~vramlab.core.monitor.watch.RunWatch` the caller drives (its own sampling loop; none is then
    started here: one NVML loop per run). With ``setup.gpus > 1``
    ``launcher`` chooses: ``auto`` runs one process per GPU under torchrun (:mod:`.distributed`, a
    :class:`~.outcomes.DistributedOutcome`) when the setup can run so, else rank 0 emulated in one
    process; ``torchrun`` insists (SetupError when it cannot); ``emulate`` never launches."""
    setup.validate(spec)
    if device == "cpu":
        check_host_memory(spec, setup)
    refusal = bitsandbytes_refusal(setup, device)
    if refusal:
        raise SetupError(refusal)
    emulated = None  # why a sharded setup runs as rank 0 emulated in one process
    if launcher != "emulate" and setup.gpus > 1:
        # several GPUs: one real process per GPU under torchrun (see .distributed) where the setup can run
        # faithfully; otherwise ("emulate", or a refusal under "auto") rank 0 emulated in one process
        from vramlab.core.profiling.distributed import launch_refusal, profile_distributed

        emulated = None if launcher == "torchrun" else launch_refusal(spec, setup, device)
        if emulated is None:
            return profile_distributed(spec, setup, device=device, gpu=gpu, steps=steps, timeout_s=timeout_s,
                                       on_event=on_event, should_abort=should_abort, fault=fault,
                                       tracked=tracked, sampler=sampler, watch=watch)
    elif setup.gpus > 1:
        emulated = "the emulated launcher was asked for"
    outcome = _one_process(spec, setup, device, gpu, steps, snapshot, isolate, timeout_s, on_event, should_abort,
                           fault, tracked, sampler, watch)
    if emulated is not None:
        outcome = dataclasses.replace(outcome, info={**outcome.info, "emulated_rank0": emulated})
    return outcome


def bitsandbytes_refusal(setup: TrainingSetup, device: str, installed: bool | None = None) -> str | None:
    """Why a CUDA profile of ``setup`` cannot run here (None: it can). Quantized weights and 8-bit optimizers
    are bitsandbytes' on a GPU: transformers 5.25 stops without it (``quantizers/quantizer_bnb_4bit.py`` and
    ``_8bit.py`` raise ImportError; ``trainer_optimizer.py``'s ``_get_bitsandbytes_optimizer``: "You need to
    install `bitsandbytes` in order to use bitsandbytes optimizers"), so a user's run cannot take place without it. Its
    plain-torch emulation (:mod:`.quant`, :mod:`.optim`) stays for the simulation and the CPU: on a GPU its own
    scratch (fp32 padded copies of grad, m and v per 8-bit step, about 24 bytes per element; some 100 MiB per NF4
    dequantization and 0.5 GiB per chunk at load) would be measured as if it were the user's. ``installed``:
    whether bitsandbytes is importable (found without importing it, by default)."""
    if device != "cuda" or not (setup.weight_dtype.is_quantized or setup.optimizer.is_8bit):
        return None
    if installed is None:
        import importlib.util

        installed = importlib.util.find_spec("bitsandbytes") is not None
    if installed:
        return None
    what = (f"{setup.weight_dtype.value} weights" if setup.weight_dtype.is_quantized else "") + \
        (" and " if setup.weight_dtype.is_quantized and setup.optimizer.is_8bit else "") + \
        (f"the {setup.optimizer.value} optimizer" if setup.optimizer.is_8bit else "")
    return (f"{what} run on bitsandbytes on a GPU, and it is not installed here (pip install 'vramlab[gpu]'); "
            "`vramlab simulate` or `--device cpu` measure the same step without it")


HOST_PROCESS_BYTES = 768 * 2**20  # torch imported in a process, before any tensor
HOST_SHARE = 0.8  # of the memory available now: the desktop and the caller keep the rest


def check_host_memory(spec: ModelSpec, setup: TrainingSetup, available: int | None = None) -> None:
    """A CPU profile allocates every tensor for real: refuse (SetupError) before starting when the estimate
    of its tensors, per process, does not fit the host's available memory, instead of swapping the machine
    to a halt or being killed by the OOM killer halfway."""
    from vramlab.core.estimate import estimate

    ranks = setup.gpus if setup.gpus > 1 else 1  # torchrun on the CPU: every rank on this host
    need = ranks * (estimate(spec, setup, match_simulation=True).peak_allocated_bytes + HOST_PROCESS_BYTES)
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if need > HOST_SHARE * available:
        raise SetupError(f"a CPU profile of this setup allocates about {fmt_bytes(need)} for real and this machine "
                         f"has {fmt_bytes(available)} available: choose a smaller model, batch or sequence, or "
                         "use `vramlab simulate` (the same step on fake tensors, no memory)")


def _one_process(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None, steps: int,
                 snapshot: str | None, isolate: bool, timeout_s: float, on_event: EventCallback | None,
                 should_abort: Callable[[], bool] | None, fault: str | None, tracked: bool,
                 sampler: Any, watch: RunWatch | None = None) -> ProfileOutcome:
    """The profile in one process: the child, its events, and the outcome (rank 0 of a sharded setup)."""
    request = {"spec": spec.to_dict(), "setup": setup.to_dict(), "device": device, "steps": steps,
               "snapshot": snapshot, "fault": fault, "tracked": tracked}
    if not isolate:
        return _in_process(spec, setup, device, gpu, request, on_event)
    cuda = device == "cuda"
    own_watch = watch is None
    if cuda and watch is None:
        watch = RunWatch(sampler, cuda_indices=(0,))
    if watch is not None and cuda:
        watch.mark_baseline()  # the GPU's used before the child exists: a container's whole-GPU delta starts here
    # on CUDA the child waits at the end of its run until the context has been read (see RunWatch.settle)
    request["settle"] = cuda
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = popen_isolated(child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)
    try:
        return _watch_child(proc, spec, setup, device, gpu, request, timeout_s, on_event, should_abort, watch,
                            own_watch)
    except BaseException:  # an exception, Ctrl-C or SIGTERM in the caller (see stop_signals_raise)
        if watch is not None:
            watch.stop()  # the run's readings end with it (a normal end stops the watch itself)
        raise
    finally:  # leave nothing behind
        if proc.poll() is None:
            terminate(proc)


def _watch_child(proc: subprocess.Popen, spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None,
                 request: dict[str, Any], timeout_s: float, on_event: EventCallback | None,
                 should_abort: Callable[[], bool] | None, watch: RunWatch | None,
                 own_watch: bool) -> ProfileOutcome:
    cuda = device == "cuda"
    if watch is not None:
        watch.watch(0, proc.pid)
        if own_watch:
            watch.start()
    if on_event is not None:  # not from the child: lets a caller watch the process (RSS, NVML share)
        on_event({"event": "started", "pid": proc.pid})
    lines: list[dict[str, Any]] = []
    reader_done = threading.Event()
    stderr_tail: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            raw = line.strip()
            if not raw.startswith("{"):
                continue
            try:
                msg = json.loads(raw)
            except json.JSONDecodeError:
                continue
            lines.append(msg)
            if msg.get("event") == "settle":
                settle(watch if cuda else None, 0, msg, lambda: _ack(proc))
            elif msg.get("event") == "device" and watch is not None and msg.get("uuid"):
                watch.set_uuid(0, str(msg["uuid"]))
            if on_event is not None:
                on_event(msg)
        reader_done.set()

    def read_err() -> None:
        for raw in proc.stderr:  # type: ignore[union-attr]
            stderr_tail.append(raw.rstrip())
            del stderr_tail[:-20]

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=read_err, daemon=True).start()
    proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    t0 = time.monotonic()
    outcome_kind = None
    while proc.poll() is None:
        if should_abort is not None and should_abort():
            outcome_kind = OutcomeKind.CANCELLED
            break
        if time.monotonic() - t0 > timeout_s:
            outcome_kind = OutcomeKind.TIMEOUT
            break
        time.sleep(0.05)
    if outcome_kind is not None:
        terminate(proc)
    proc.wait()
    reader_done.wait(timeout=5)
    # NVML readings describe a CUDA run (a CPU run's window may watch a GPU for show, not for the result)
    readings = watch.stop().get(0, {}) if watch is not None and cuda else {}
    final = next((m for m in reversed(lines) if m.get("event") in ("result", "failure")), None)
    if outcome_kind is OutcomeKind.CANCELLED:
        return ProfileOutcome(False, OutcomeKind.CANCELLED, "cancelled by the user", device, events=lines, **readings)
    if outcome_kind is OutcomeKind.TIMEOUT:
        last = next((m["key"] for m in reversed(lines) if m.get("event") == "phase"), None)
        return ProfileOutcome(False, OutcomeKind.TIMEOUT, f"no result after {timeout_s:.0f} s; the run was ended",
                              device, failed_phase=last, events=lines, **readings)
    if final is None:
        last = next((m["key"] for m in reversed(lines) if m.get("event") == "phase"), None)
        err = stderr_tail[-1] if stderr_tail else ""
        message = f"the run ended with exit code {proc.returncode} {err}".strip()
        return ProfileOutcome(False, OutcomeKind.CRASHED, message, device, failed_phase=last, events=lines, **readings)
    outcome = read_outcome(spec, setup, device, gpu, final, lines, readings)
    return with_watch_info(outcome, watch if cuda else None, 0)


def _ack(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.write("ack\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    except (BrokenPipeError, OSError, ValueError):
        pass  # the child is gone: nothing waits for the acknowledgement


def terminate(proc: subprocess.Popen) -> None:
    """End the child and everything it started, on POSIX and Windows (see :func:`.processes.end_tree`)."""
    end_tree(proc)


def _in_process(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None,
                request: dict[str, Any], on_event: EventCallback | None) -> ProfileOutcome:
    import contextlib
    import io

    from vramlab.core.profiling import child

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        child.run(request, request.get("fault"))
    lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    if on_event is not None:
        for m in lines:
            on_event(m)
    final = next(m for m in reversed(lines) if m.get("event") in ("result", "failure"))
    return read_outcome(spec, setup, device, gpu, final, lines, {})


