"""Child processes of a profile: started in a group of their own, ended with everything they started, on
every platform, and ended too when the caller itself is told to stop (SIGTERM, SIGHUP, Ctrl-C).

* :func:`popen_isolated` starts a child that leads its own process group (POSIX: a new session; Windows: a
  new process group), so a terminal's Ctrl-C reaches only the caller, which then ends the child itself.
* :func:`end_tree` ends a child and its descendants: SIGTERM (Windows: ``TerminateProcess``) to each, then a
  kill for what is left after a grace period. On POSIX the child's process group is signalled as well,
  which reaches a grandchild that was re-parented before it could be listed. ``os.killpg`` does not exist on
  Windows; psutil's process tree works on both.
* :func:`stop_signals_raise` turns SIGTERM and SIGHUP into :class:`Terminated` (a ``KeyboardInterrupt``) in
  the main thread for the duration of a run, so ``finally`` blocks end the children and remove temporary
  folders instead of the interpreter dying with them still running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from vramlab.core.monitor.watch import RunWatch


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by a signal; ``signum`` is the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def popen_isolated(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` with the child leading a process group of its own."""
    if sys.platform == "win32":
        kwargs["creationflags"] = kwargs.get("creationflags", 0) | subprocess.CREATE_NEW_PROCESS_GROUP
    else:
        kwargs["start_new_session"] = True
    return subprocess.Popen(cmd, **kwargs)


def end_tree(proc: subprocess.Popen, extra_pids: Iterable[int] = (), grace_s: float = 5.0) -> None:
    """End ``proc``, its descendants and ``extra_pids``: terminate, wait ``grace_s``, kill what is left."""
    procs: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        procs[root.pid] = root
        for child in root.children(recursive=True):
            procs[child.pid] = child
    for pid in extra_pids:
        with contextlib.suppress(psutil.Error):
            procs.setdefault(pid, psutil.Process(pid))
    _signal_group(proc, "SIGTERM")
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _gone, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    _signal_group(proc, "SIGKILL")
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def _signal_group(proc: subprocess.Popen, name: str) -> None:
    killpg = getattr(os, "killpg", None)  # POSIX only
    sig = getattr(signal, name, None)
    if killpg is None or sig is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        killpg(proc.pid, sig)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise :class:`Terminated` in the main thread (once: a second signal
    during the clean-up is ignored, so the clean-up finishes). Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    old: dict[int, Any] = {}

    def handler(signum: int, _frame: object) -> None:
        for s in signums:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)

    for s in signums:
        with contextlib.suppress(ValueError, OSError):
            old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(s, h)


def settle(watch: RunWatch | None, key: int, event: dict[str, Any], ack: Callable[[], None]) -> None:
    """The child waits at the end of its run (``settle`` event, with its allocator's reserved bytes): read
    its CUDA context now, then let it go on. It is always let go, NVML or not."""
    try:
        if watch is not None:
            watch.settle(key, int(event.get("reserved") or 0))
    finally:
        ack()
