"""Estimate vs simulation over the accuracy matrix of tests/test_accuracy.py, as figures: median and worst
|error| on the tensor peak, per category and per phase, for both estimates.

Each setup is held to the simulation the test holds it to (tests/support/accuracy.py, one choice for both): the
built-in builder where the hand-written program answers, transformers' own classes (+ peft) where the estimate
replays their trace; traces are made in a folder of the run's own, as in the tests (a tape in the user's cache is
keyed by the library versions, not by this tree's code).

* ``simulation mode`` (``estimate(..., match_simulation=True)``) predicts the fake-tensor run itself; the test
  holds it to the simulation to the byte.
* ``CUDA mode`` (the default estimate) predicts a CUDA run. It is held to the same simulation with SDPA's math
  kernel forced where CUDA runs that kernel (fp32 grouped-query attention under torch 2.13), and differs from it
  by two mechanisms (in-place gradient accumulation, fp32 LayerNorm statistics); its figures are those
  mechanisms' size, not errors of the estimator.

A setup apart from its reference by more than the test allows is listed, in bytes, under
``beyond_test_tolerance``.

Run: .venv/bin/python benchmarks/accuracy_matrix.py [--full-depth] [--only LABEL]   (3 to 6 minutes on two shared cores)
``--full-depth`` simulates every setup at its preset's full depth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import record  # noqa: E402

from tests.support import matrix  # noqa: E402
from tests.support.accuracy import beyond_tolerance, held  # noqa: E402
from tests.support.trace_cache import isolated_traces  # noqa: E402


def rel(a: int, b: int) -> float:
    return abs(a - b) / b if b else (0.0 if a == b else 1.0)


def stats(xs: list[float]) -> dict:
    return {"median_pct": round(100 * statistics.median(xs), 4), "worst_pct": round(100 * max(xs), 4), "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full-depth", action="store_true", help="every setup at its preset's full depth")
    ap.add_argument("--only", default="", help="the setups whose label holds this (printed, not recorded)")
    args = ap.parse_args()
    if args.full_depth:
        matrix.FULL_DEPTH_EVERY = 1
    cases = [c for c in matrix.setups() if args.only in c[2]]
    modes = ("simulation mode", "CUDA mode")
    peak = {m: [] for m in modes}
    category = {m: [] for m in modes}  # each category's |error| relative to the tensor peak
    phase = {m: [] for m in modes}
    worst = {m: ("", 0.0) for m in modes}
    beyond = []  # setups apart from their reference by more than tests/test_accuracy.py allows
    references: dict[str, int] = {}
    slowest = ("", 0.0)
    t0 = time.perf_counter()
    # traced in a folder of the run's own, as the tests do (tests/conftest.py): a tape in the user's cache is keyed
    # by the library versions, not by this tree's code, and may have been traced by other code
    with tempfile.TemporaryDirectory() as traces, isolated_traces(Path(traces)):
        for spec, setup, label in cases:
            t1 = time.perf_counter()
            h = held(spec, setup)  # the reference tests/test_accuracy.py holds each estimate to
            references[h.reference] = references.get(h.reference, 0) + 1
            for mode, (est, sim) in {"simulation mode": (h.estimate, h.simulation),
                                     "CUDA mode": (h.cuda_estimate, h.cuda_simulation)}.items():
                e = rel(est.peak_allocated_bytes, sim.peak_allocated_bytes)
                peak[mode].append(e)
                if e > worst[mode][1]:
                    worst[mode] = (label, e)
                for k in set(est.components) | set(sim.components):
                    category[mode].append(abs(est.components.get(k, 0) - sim.components.get(k, 0))
                                          / sim.peak_allocated_bytes)
                sp = {p.key: p.bytes for p in sim.phases}
                for p in est.phases:
                    phase[mode].append(rel(p.bytes, sp.get(p.key, 0)))
            apart = beyond_tolerance(spec, setup, h)
            if apart:
                beyond.append({"setup": label, "reference": h.reference, "apart": apart})
            cuda, sim = h.cuda_estimate.peak_allocated_bytes, h.cuda_simulation.peak_allocated_bytes
            took = time.perf_counter() - t1
            slowest = max(slowest, (label, took), key=lambda x: x[1])
            print(f"{label:32s} {h.reference:36s} sim {sim / 2**30:9.3f} GiB  CUDA mode {(cuda - sim) / sim:+.2%}"
                  f"  {took:5.1f} s{'  BEYOND: ' + '; '.join(apart) if apart else ''}", flush=True)
    data = {
        "what": "estimate vs fake-tensor simulation over tests/support/matrix.py (each category's error relative "
                "to the tensor peak)",
        "setups": len(cases), "full_depth": bool(args.full_depth), "seconds": round(time.perf_counter() - t0, 1),
        "modes": {m: {"tensor_peak": stats(peak[m]), "categories": stats(category[m]), "phases": stats(phase[m]),
                      "worst_setup": worst[m][0], "setups_that_differ": sum(1 for e in peak[m] if e > 0)}
                  for m in modes},
        "references": references,
        "beyond_test_tolerance": beyond,
        "slowest_setup": {"setup": slowest[0], "seconds": round(slowest[1], 1)},
        "note": "each estimate against the simulation tests/test_accuracy.py holds it to (tests/support/accuracy.py: "
                "the built-in builder or, where the estimate replays a trace, transformers' classes; in CUDA mode "
                "with SDPA's math kernel forced where CUDA runs it). CUDA mode differs only where a tensor receives "
                "two gradients (tied embeddings): the simulation's out-of-place accumulation adds a transient, "
                "which can also move the peak to another moment, so that setup's breakdown at the peak differs as "
                "a whole",
    }
    path = record("accuracy_matrix", data) if not args.only else "not recorded (--only)"
    for m in modes:
        d = data["modes"][m]
        print(f"{m}: tensor peak median {d['tensor_peak']['median_pct']} % worst {d['tensor_peak']['worst_pct']} % "
              f"({d['worst_setup']}); categories worst {d['categories']['worst_pct']} %; "
              f"phases worst {d['phases']['worst_pct']} %")
    for b in beyond:
        print(f"beyond the test's tolerance: {b['setup']} ({b['reference']}): {'; '.join(b['apart'])}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
