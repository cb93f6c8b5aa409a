"""Shared helpers: machine fingerprint and result recording."""

from __future__ import annotations

import datetime as dt
import json
import os
import pathlib
import platform
import statistics

from vramlab.core.fileio import write_atomic

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


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
