"""`vramlab profile --gpus N --sharding fsdp`: a sharded run profiled for real, one process per GPU.

The launcher starts ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node N``)
with :mod:`.dist_child` as the per-rank program: each rank builds the model, shards it with FSDP2
(``torch.distributed.fsdp.fully_shard``), runs the usual steps on ``cuda:LOCAL_RANK`` with NCCL (or on
the CPU with gloo) and measures its own memory. The ranks write JSON lines to one file each in a run
folder; this process tails them (events are passed on tagged with ``rank``), and when torchrun ends
turns each rank's result into a :class:`~vramlab.core.result.MemoryResult`.

The outcome is a :class:`DistributedOutcome`: a :class:`~.outcomes.ProfileOutcome` whose ``result`` is
the rank with the highest tensor peak (the GPU that decides whether the run fits), with every rank's
own outcome in ``ranks``. Failures name the rank: ``oom`` / ``error`` on the rank that raised first,
``crashed`` on a rank that died without a word (torchrun's summary gives its exit code or signal), and
``timeout`` / ``cancelled`` end torchrun and every rank process (they run in sessions of their own, so
each is ended by its id).

What runs faithfully, and so what is accepted (:func:`check_supported`): ``fsdp`` and ``zero3`` (FSDP2
full sharding; FSDP mixed precision for fp32 weights with 16-bit compute), full / freeze / LoRA on float
weights, AdamW (foreach / fused / single), SGD, Lion, fp32 master weights, checkpointing, accumulation.
Refused, with the reason:
``zero1`` (torch's ZeroRedundancyOptimizer gives each rank whole parameters and DDP adds gradient
buckets), ``zero2`` (FSDP2's SHARD_GRAD_OP shards parameters between steps, DeepSpeed's ZeRO-2 does
not: measured on the tiny test model its load and optimizer peaks are 50 % and 17 % below the modelled
ZeRO-2, its forward 39 % above), CPU offload, quantized bases, bitsandbytes optimizers and Adafactor
(whose factored update does not run on DTensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.fileio import write_atomic
from vramlab.core.monitor.watch import RunWatch
from vramlab.core.profiling.outcomes import (
    DistributedOutcome,
    EventCallback,
    OutcomeKind,
    ProfileOutcome,
    read_outcome,
    with_watch_info,
)
from vramlab.core.profiling.processes import end_tree, popen_isolated, settle
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Method, Offload, Optimizer, Sharding
from vramlab.core.spec.training import TrainingSetup

CHILD_MODULE = "vramlab.core.profiling.dist_child"
POLL_S = 0.05


def dist_command(nproc: int, run_dir: str | os.PathLike[str]) -> list[str]:
    """torchrun with one rank per GPU, each running :mod:`.dist_child` on ``run_dir``. The frozen app has
    no ``python -m``: it runs torchrun, and torchrun runs the ranks, through ``--profile-child`` (see
    :func:`.child.main`)."""
    torchrun = ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if getattr(sys, "frozen", False):
        exe = sys.executable
        return [exe, "--profile-child", "--torchrun", *torchrun, "--no-python", exe, "--profile-child",
                "--dist-rank", str(run_dir)]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", CHILD_MODULE, str(run_dir)]


def check_supported(spec: ModelSpec, setup: TrainingSetup, device: str) -> None:
    """Raise :class:`SetupError` for a setup a real multi-process run cannot reproduce faithfully."""
    setup.validate(spec)
    if setup.gpus < 2:
        raise SetupError("a distributed profile needs --gpus 2 or more")
    if setup.sharding is Sharding.NONE:
        raise SetupError(f"--gpus {setup.gpus} without sharding is plain data parallel (every GPU holds the "
                         "same as one GPU): profile it with --gpus 1, or choose --sharding fsdp, zero3 or zero2")
    if setup.sharding is Sharding.ZERO1:
        raise SetupError("ZeRO-1 is not profiled for real: torch's ZeroRedundancyOptimizer gives each rank "
                         "whole parameters (uneven states) and DDP adds gradient buckets, which is not the "
                         "ZeRO-1 that estimate and simulate model; use --sharding zero3 or fsdp, or "
                         "`vramlab simulate` for zero1")
    if setup.sharding is Sharding.ZERO2:
        raise SetupError("ZeRO-2 is not profiled for real: torch's nearest, FSDP2 with reshard_after_forward="
                         "False (SHARD_GRAD_OP), shards the parameters between steps and gathers them whole "
                         "from forward to the end of backward, which is not DeepSpeed's ZeRO-2 (replicated "
                         "parameters) that estimate and simulate model; use --sharding fsdp or zero3, or "
                         "`vramlab simulate` for zero2")
    if setup.offload is not Offload.NONE:
        raise SetupError("CPU offload is not profiled for real yet (FSDP2 offloads parameters, gradients and "
                         "optimizer together; DeepSpeed's optimizer-only offload has no torch equivalent): use "
                         "--offload none, or `vramlab simulate` for offload")
    if setup.weight_dtype.is_quantized or setup.method is Method.QLORA:
        raise SetupError("a quantized base (nf4 / int8) cannot be sharded with FSDP2 here: use --method lora "
                         "with --weights bf16, or `vramlab simulate` for QLoRA + FSDP")
    if not setup.optimizer.has_impl_choice or setup.optimizer is Optimizer.ADAFACTOR:
        what = setup.optimizer.library if not setup.optimizer.has_impl_choice else "its factored second moment"
        raise SetupError(f"{setup.optimizer.value} ({what}) does not step FSDP2's sharded DTensor parameters "
                         "here: use adamw, sgd, sgd_momentum or lion, or `vramlab simulate`")
    if device == "cuda":
        count = _cuda_count()
        if count is not None and count < setup.gpus:
            raise SetupError(f"--gpus {setup.gpus} needs {setup.gpus} visible GPUs; torch sees {count}")
    elif device == "cpu":
        try:
            import torch.distributed as dist
        except ImportError as e:  # pragma: no cover - torch is a dependency
            raise SetupError(f"torch.distributed is not available: {e}") from e
        if not (dist.is_available() and dist.is_gloo_available()):
            raise SetupError("this torch build has no gloo backend, so ranks cannot run on the CPU")
    else:
        raise SetupError(f"unknown device {device!r}: cuda or cpu")
    try:
        from vramlab.core.profiling.dist_child import fsdp2

        fsdp2()
    except ImportError as e:
        raise SetupError(f"this torch has no FSDP2 (fully_shard): {e}") from e


def launch_refusal(spec: ModelSpec, setup: TrainingSetup, device: str) -> str | None:
    """Why ``setup`` is not profiled under torchrun (None: it is): one GPU, no sharding, or a setup
    :func:`check_supported` refuses. :func:`.profile.profile` then measures rank 0 emulated in one process."""
    if setup.gpus < 2 or setup.sharding is Sharding.NONE:
        return "one process" if setup.gpus < 2 else "no sharding"
    try:
        check_supported(spec, setup, device)
    except SetupError as e:
        return str(e)
    return None


def _cuda_count() -> int | None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    return torch.cuda.device_count() if torch.cuda.is_available() else 0



class _Tail:
    """New complete JSON lines of one rank's event file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.buf = ""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        self.buf += chunk
        *complete, self.buf = self.buf.split("\n")
        out = []
        for line in complete:
            text = line.strip()
            if text.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(text))
        return out


@dataclass
class _Rank:
    events: list[dict[str, Any]] = field(default_factory=list)
    pid: int | None = None
    final: dict[str, Any] | None = None
    died_at: float | None = None  # wall time this process was first seen gone without a final line

    @property
    def last_phase(self) -> str | None:
        return next((m["key"] for m in reversed(self.events) if m.get("event") == "phase"), None)


def profile_distributed(
    spec: ModelSpec,
    setup: TrainingSetup,
    device: str = "cuda",
    gpu: GpuSpec | None = None,
    steps: int = 2,
    timeout_s: float = 1800.0,
    on_event: EventCallback | None = None,
    should_abort: Callable[[], bool] | None = None,
    fault: str | None = None,
    tracked: bool = False,
    sampler: Any = None,
    collective_timeout_s: float | None = None,
    watch: RunWatch | None = None,
) -> DistributedOutcome:
    """Run ``steps`` real sharded training steps on ``setup.gpus`` ranks; never raises for a failed run
    (an unsupported setup raises :class:`SetupError` before anything starts). ``fault`` is a rank fault
    (``crash@1``, ``oom@0``, ``hang@1``, ``error@1``, ``slow``; see :mod:`.dist_child`)."""
    check_supported(spec, setup, device)
    world = setup.gpus
    backend = "nccl" if device == "cuda" else "gloo"
    run_dir = Path(tempfile.mkdtemp(prefix="vramlab-dist-"))
    request = {"spec": spec.to_dict(), "setup": setup.to_dict(), "device": device, "steps": steps,
               "fault": fault, "tracked": tracked, "collective_timeout_s": collective_timeout_s}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    env.setdefault("LOGLEVEL", "WARNING")
    # torchrun's own temporary folders (torchelastic_*) inside the run's, so that they go with it even when
    # torchrun is ended before it could remove them
    scratch = run_dir / "tmp"
    scratch.mkdir()
    env.update(TMPDIR=str(scratch), TEMP=str(scratch), TMP=str(scratch))
    ranks = [_Rank() for _ in range(world)]
    tails = [_Tail(run_dir / f"rank{r}.jsonl") for r in range(world)]
    stderr_tail: list[str] = []
    cuda = device == "cuda"
    request["settle"] = cuda  # each rank waits at its end until its context was read (RunWatch.settle)
    write_atomic(run_dir / "request.json", json.dumps(request))  # the ranks read it whole or not at all
    own_watch = watch is None
    if cuda and watch is None:
        watch = RunWatch(sampler, cuda_indices=range(world))
    if watch is not None and own_watch:
        watch.start()  # before torchrun starts: NVML's start-up must not open a gap before the try that ends it
    try:
        proc = popen_isolated(dist_command(world, run_dir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    except OSError as e:
        if watch is not None and own_watch:
            watch.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        return DistributedOutcome(False, OutcomeKind.ERROR, f"could not start torchrun: {e}", device, world_size=world,
                                  backend=backend)
    except BaseException:  # Ctrl-C or SIGTERM (see .processes.stop_signals_raise) while starting
        if watch is not None and own_watch:
            watch.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    try:
        if on_event is not None:
            on_event({"event": "started", "pid": proc.pid, "world_size": world})
    except BaseException:  # the caller's callback, or a stop signal, before the run's own try below
        end_all(proc, [])
        if watch is not None and own_watch:
            watch.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise

    def drain(stream: Any, keep: list[str] | None) -> None:
        for raw in stream:
            if keep is not None:
                keep.append(raw.rstrip())
                del keep[:-80]

    threading.Thread(target=drain, args=(proc.stdout, None), daemon=True).start()
    err_thread = threading.Thread(target=drain, args=(proc.stderr, stderr_tail), daemon=True)
    err_thread.start()

    def poll_events() -> None:
        for r, tail in enumerate(tails):
            for msg in tail.read():
                rk = ranks[r]
                rk.events.append(msg)
                if msg.get("event") == "start":
                    rk.pid = int(msg["pid"])
                    if watch is not None:
                        watch.watch(r, rk.pid)
                elif msg.get("event") == "device" and watch is not None and msg.get("uuid"):
                    watch.set_uuid(r, str(msg["uuid"]))
                elif msg.get("event") == "settle":
                    ack = run_dir / f"ack{r}"
                    settle(watch if cuda else None, r, msg, lambda a=ack: a.touch())
                elif msg.get("event") in ("result", "failure"):
                    rk.final = msg
                if on_event is not None:
                    on_event(msg)

    def note_deaths() -> None:
        now = time.time()
        for rk in ranks:
            if rk.pid is not None and rk.final is None and rk.died_at is None and not _alive(rk.pid):
                rk.died_at = now

    t0 = time.monotonic()
    ended_by: str | None = None
    try:
        while proc.poll() is None:
            poll_events()
            note_deaths()
            if should_abort is not None and should_abort():
                ended_by = "cancelled"
                break
            if time.monotonic() - t0 > timeout_s:
                ended_by = "timeout"
                break
            time.sleep(POLL_S)
        if ended_by is not None:
            end_all(proc, [rk.pid for rk in ranks if rk.pid is not None])
        proc.wait()
        err_thread.join(timeout=5)
        poll_events()
        note_deaths()
    finally:
        if proc.poll() is None:  # an exception in a callback: leave nothing behind
            end_all(proc, [rk.pid for rk in ranks if rk.pid is not None])
        readings = watch.stop() if watch is not None and cuda else {}
        shutil.rmtree(run_dir, ignore_errors=True)
    events = [m for rk in ranks for m in rk.events]
    base = {"world_size": world, "backend": backend, "events": events, "stderr_tail": list(stderr_tail)}
    if ended_by == "cancelled":
        return DistributedOutcome(False, OutcomeKind.CANCELLED, "cancelled by the user", device, **base)
    if ended_by == "timeout":
        last = max(ranks, key=lambda rk: len(rk.events)).last_phase
        stuck = [r for r, rk in enumerate(ranks) if rk.final is None]
        # the rank behind the others, when one is (a rank waiting in a collective for it is not the cause)
        behind = [r for r in stuck if len(ranks[r].events) < max(len(rk.events) for rk in ranks)]
        return DistributedOutcome(False, OutcomeKind.TIMEOUT, f"no result after {timeout_s:.0f} s (rank(s) "
                                  f"{', '.join(map(str, stuck))} still running); every rank was ended", device,
                                  failed_phase=last, failed_rank=behind[0] if len(behind) == 1 else None, **base)
    if all(rk.final is not None and rk.final.get("event") == "result" for rk in ranks):
        return _success(spec, setup, device, gpu, ranks, readings, base, watch if cuda else None)
    return _failure(device, ranks, proc.returncode, stderr_tail, base)


def _success(spec: ModelSpec, setup: TrainingSetup, device: str, gpu: GpuSpec | None, ranks: list[_Rank],
             readings: dict[int, dict[str, Any]], base: dict[str, Any], watch: RunWatch | None = None
             ) -> DistributedOutcome:
    world = len(ranks)
    outs: list[ProfileOutcome] = []
    for r, rk in enumerate(ranks):
        o = with_watch_info(read_outcome(spec, setup, device, gpu, rk.final, rk.events, readings.get(r, {})), watch, r)
        info = rk.final.get("info", {})
        fsdp = info.get("fsdp", {})
        note = (f"rank {r} of {world} ({info.get('backend', '')}), FSDP2 fully_shard per layer and root"
                + (f", {fsdp.get('param_dtype')} gather / {fsdp.get('reduce_dtype')} reduce"
                   if fsdp.get("mixed_precision") else "")
                + ("" if fsdp.get("reshard_after_forward", True) else ", reshard_after_forward=False"))
        if o.context_bytes is not None:
            note += ("; its measured context includes NCCL's buffers (cudaMalloc'd by NCCL, outside torch's "
                     "allocator)")
        if o.result is not None:
            o.result = dataclasses.replace(o.result, notes=(*o.result.notes, note))
        outs.append(o)
    worst = max(range(world), key=lambda i: (outs[i].result.peak_allocated_bytes, -i))
    top = outs[worst]
    return DistributedOutcome(True, OutcomeKind.OK, "", device, result=top.result, info=top.info,
                              device_used_peak_bytes=top.device_used_peak_bytes,
                              process_used_peak_bytes=top.process_used_peak_bytes, context_bytes=top.context_bytes,
                              tokens_per_s=top.tokens_per_s, step_time_s=top.step_time_s, ranks=outs, **base)


_SUMMARY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_AGENT_SIGNALS = {-15, -2, -1}  # SIGTERM / SIGINT / SIGHUP: torchrun ending the other ranks


def exit_codes(stderr_lines: list[str]) -> dict[int, int]:
    """Rank → exit code from torchrun's failure summary (``rank : 1 (local_rank: 1)`` / ``exitcode : 139``)."""
    return {int(r): int(c) for r, c in _SUMMARY.findall("\n".join(stderr_lines))}


def _failure(device: str, ranks: list[_Rank], returncode: int | None, stderr_tail: list[str],
             base: dict[str, Any]) -> DistributedOutcome:
    """Which rank the failure started on, and what it was."""
    failures = {r: rk.final for r, rk in enumerate(ranks)
                if rk.final is not None and rk.final.get("event") == "failure"}
    codes = exit_codes(stderr_tail)

    def failed(r: int, kind: Any, message: str) -> DistributedOutcome:
        rk = ranks[r]
        final = failures.get(r, {})
        return DistributedOutcome(False, kind, message, device, info=final.get("info", {}),
                                  failed_phase=final.get("phase") or rk.last_phase,
                                  memory_at_failure=final.get("allocated_at_failure"), failed_rank=r, **base)

    ooms = sorted(r for r, f in failures.items() if OutcomeKind.read(f.get("kind")) is OutcomeKind.OOM)
    if ooms:
        r = ooms[0]
        return failed(r, "oom", f"rank {r}: {failures[r].get('message', '')}")
    # a rank that died without a word: its exit code (torchrun's summary) is not the SIGTERM torchrun sends
    # the survivors; a peer-loss error on another rank is a consequence, not the cause
    silent = [r for r, rk in enumerate(ranks) if rk.final is None]
    crashed = [r for r in silent if codes.get(r) is not None and codes[r] not in _AGENT_SIGNALS]
    if not crashed and silent and not failures:
        crashed = silent
    if not crashed and silent and not codes:
        first_error = min((f.get("t_wall", float("inf")) for f in failures.values()), default=float("inf"))
        crashed = [r for r in silent if ranks[r].died_at is not None and ranks[r].died_at <= first_error]
    if crashed:
        r = min(crashed, key=lambda i: (ranks[i].died_at or float("inf"), i))
        code = codes.get(r)
        how = _describe_exit(code) if code is not None else "ended without a result"
        if ranks[r].pid is None:
            how = "never started" + (f" ({stderr_tail[-1]})" if stderr_tail else "")
        return failed(r, "crashed", f"rank {r} {how}")
    if failures:
        r = min(failures, key=lambda i: (failures[i].get("t_wall", float("inf")), i))
        f = failures[r]
        return failed(r, f.get("kind", "error"), f"rank {r}: {f.get('message', '')}")
    err = next((line for line in reversed(stderr_tail) if line.strip()), "")
    message = f"torchrun ended with exit code {returncode} {err}".strip()
    return DistributedOutcome(False, OutcomeKind.CRASHED, message, device, **base)


def _describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (" (out of host memory?)" if code == -9 else "")
    if code > 128:
        import signal

        try:
            return f"exited with code {code} (128 + {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def end_all(proc: subprocess.Popen, pids: list[int], grace_s: float = 3.0) -> None:
    """End torchrun and every rank (each rank leads a session of its own, so a process-group signal to
    torchrun does not reach it): terminate each by id, then kill what is left after ``grace_s``."""
    end_tree(proc, pids, grace_s)
