"""The tracker the running model reports regions to (none outside a measurement), and the lock that keeps a
process to one measured step at a time.

A step's context belongs to the process, not to its thread: the tracker here, the patches a step's guard enters
(autocast's and dropout's CUDA rules, a traced VLM's constant sizes, peft's and TRL's stand-ins) and the trace's
collector settings are module-level. The window runs a simulation and a trace on two worker threads
(app/simulation.py, app/tracing.py); two steps interleaved read each other's tracker and patches, and each number
came out a few KiB off, silently. Every measured step holds :func:`exclusive` from before its guard is entered
until it is left; a second one waits for it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vramlab.core.kinds import Kind
    from vramlab.core.simulation.tracker import MemoryTracker

_current: MemoryTracker | None = None
_STEP = threading.RLock()  # reentrant: a trace's guard and the step it measures both take it, in one thread


def exclusive() -> contextlib.AbstractContextManager[bool]:
    """Held around a measured step and its guard: one step at a time in the process (the module's note)."""
    return _STEP


def current() -> MemoryTracker | None:
    return _current


@contextlib.contextmanager
def active(tracker: MemoryTracker | None) -> Iterator[None]:
    global _current
    with _STEP:
        old, _current = _current, tracker
        try:
            yield
        finally:
            _current = old


def host() -> contextlib.AbstractContextManager[None]:
    """Allocations inside are host / managed memory, not counted at the tensor level."""
    t = _current
    return t.host() if t is not None else contextlib.nullcontext()


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage was made in a host region (a fake or meta tensor standing for a CPU one)."""
    tracker = _current
    return tracker is not None and tracker.is_host(t)


def region(kind: Kind) -> contextlib.AbstractContextManager[None]:
    """Label allocations made inside with ``kind`` (a no-op when nothing is measuring)."""
    t = _current
    return t.region(kind) if t is not None else contextlib.nullcontext()


def label_backward(out: torch.Tensor, stop: torch.Tensor | object, kind: Kind) -> None:
    """Give the gradients computed by the autograd nodes between ``out`` and ``stop`` the kind ``kind``
    (the loss's backward: gradients of log-probabilities and logits). ``stop``: a tensor, or its autograd node
    (``grad_fn``, None for none): holding the node does not hold the tensor, which a model frees as it goes."""
    tracker = _current
    if tracker is None or out.grad_fn is None:
        return
    stop_fn = stop.grad_fn if isinstance(stop, torch.Tensor) else stop
    seen: set[int] = set()
    todo = [out.grad_fn]
    regions: list = []

    def pre(_grad_outputs):  # noqa: ANN001, ANN202
        cm = tracker.region(kind)
        cm.__enter__()
        regions.append(cm)

    def post(_grad_inputs, _grad_outputs):  # noqa: ANN001, ANN202
        if regions:
            regions.pop().__exit__(None, None, None)

    while todo:
        fn = todo.pop()
        if fn is None or fn is stop_fn or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ == "AccumulateGrad":
            continue
        fn.register_prehook(pre)
        fn.register_hook(post)
        todo.extend(nxt for nxt, _ in fn.next_functions)
