"""Shared helpers: machine fingerprint, result recording, and an older commit's code to measure beside this one."""

from __future__ import annotations

import datetime as dt
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from vramlab.core.fileio import write_atomic

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def machine() -> dict:
    import psutil

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
    }


def record(name: str, data: dict) -> pathlib.Path:
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": name, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
           **data}
    path = RESULTS / f"{name}.json"
    return write_atomic(path, json.dumps(out, indent=2) + "\n")


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p95": xs[int(0.95 * (len(xs) - 1))], "min": xs[0], "n": len(xs)}


@contextmanager
def old_tree(ref: str, prefix: str = "vramlab-old-",
             parts: tuple[str, ...] = ("core", "resources")) -> Iterator[pathlib.Path]:
    """``git archive ref`` of core/ and resources/ (and any other top-level ``parts``, e.g. app/) in a temporary
    folder, laid out as the ``vramlab`` package: yields the folder to put first on ``sys.path`` of a child
    process, so that it imports the old code."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        tree, shim = pathlib.Path(tmp, "tree"), pathlib.Path(tmp, "shim", "vramlab")
        tree.mkdir()
        shim.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, *parts], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for name in parts:
            (shim / name).symlink_to(tree / name)
        yield shim.parent


def measure_old(ref: str, module: str, call: str) -> dict:
    """``module.call`` (a benchmark's measuring function, e.g. ``measure()``) in a child process that imports
    ``ref``'s code (:func:`old_tree`), with the benchmarks folder on its path; what it returns, through JSON."""
    here = pathlib.Path(__file__).resolve().parent
    with old_tree(ref, prefix=f"vramlab-{module}-") as path:
        code = (f"import sys, json; sys.path.insert(0, {str(path)!r}); sys.path.insert(0, {str(here)!r});"
                f"import {module}; print(json.dumps({module}.{call}))")
        done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
