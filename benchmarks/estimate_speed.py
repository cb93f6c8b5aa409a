"""Time per estimate (structure cached and not), a 10,000-setup sweep, and the allocator replay, for the code
in this tree and, side by side in the same run, for an older commit (``--baseline REF``, default the last
commit before the tape's array evaluation). Goals (issue #17): a warm estimate <= 0.2 ms, 10,000 setups
<= 1 s, the allocator replay warm <= 20 ms and <= 100 ms for a new structure; any real model < 1 s.

The older code runs from ``git archive REF`` in a child process with the same Python; both measure CPU
time of this process (``time.process_time``), the best of a few repeats, because the machine is shared:
wall-clock figures on a loaded machine measure the other users. The load average is recorded.

* ``per_estimate``: ``estimate(spec, setup)`` for 200 distinct (batch, sequence) pairs, every structure recorded
  beforehand (an MoE model's concrete sizes make each pair a structure of its own, evaluated once when it was
  recorded: its warm figure is that tape's kept answer plus the rest of the estimate).
* ``sweep_10k``: 10,000 random setups over 5 models x 4 methods (40 structures) x batch, sequence, rank,
  with every tape recorded beforehand (``record_s`` is that recording): one ``estimate`` per setup (both
  trees), and ``estimate_points`` per structure (this tree only: the array evaluation).
* ``per_replay``: ``estimate(..., allocator=True)``, first with the full-depth tape not yet recorded, then
  for 20 new (batch, sequence) pairs.
* ``real_models``: ``estimate(..., allocator=True)`` of the largest presets from a cold cache.

Run: .venv/bin/python benchmarks/estimate_speed.py [--baseline REF | --no-baseline]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

BASELINE = "e03f9b1"  # before the array evaluation of tapes and the replay budget (issue #17)
CASES = [("llama-2-7b", dict(method="lora")),
         ("llama-3.1-8b", dict(method="qlora", lora_targets="all-linear", grad_ckpt=True)),
         ("llama-3.1-70b", dict(sharding="fsdp", gpus=8, weights="fp32", compute="bf16")),
         ("mixtral-8x7b", dict(method="qlora"))]
REAL = [("qwen3-235b-a22b", dict()), ("qwen3-30b-a3b", dict(method="qlora")), ("llama-3.1-405b", dict(method="qlora")),
        ("mixtral-8x7b", dict())]


def best_of(repeats: int, run) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        run()
        best = min(best, time.process_time() - t)
    return best


def measure(new: bool) -> dict:
    """Everything, with whichever ``vramlab`` is first on sys.path."""
    from vramlab.core import estimate as est_mod
    from vramlab.core.catalog import find_model
    from vramlab.core.estimate import estimate
    from vramlab.core.spec.training import TrainingSetup

    out: dict = {"code": est_mod.__file__}
    per = {}
    for mid, kw in CASES:
        spec, setup = find_model(mid), TrainingSetup(**kw)
        est_mod._CACHE._d.clear()
        t = time.process_time()
        estimate(spec, setup)
        cold = time.process_time() - t
        # 200 distinct (batch, sequence) points, as a dragged control makes them: none is evaluated twice in a
        # round (an MoE model's concrete sizes make each point its own structure, recorded here first)
        setups = [setup.replace(micro_batch=1 + i % 8, seq_len=128 * (2 + i // 8)) for i in range(200)]
        for s in setups:  # every structure recorded
            estimate(spec, s)
        warm = best_of(5, lambda setups=setups, spec=spec: [estimate(spec, s) for s in setups]) / len(setups)
        per[f"{mid}/{setup.method.value}"] = {"first_ms": cold * 1e3, "warm_ms": warm * 1e3}
    out["per_estimate"] = per

    rng = random.Random(0)
    models = [find_model(m) for m in ("llama-3.2-1b", "llama-2-7b", "mistral-7b-v0.1", "qwen2.5-7b", "llama-3.1-8b")]
    methods = [dict(method="full"), dict(method="lora"), dict(method="qlora", lora_targets="all-linear"),
               dict(method="lora", grad_ckpt=True)]
    combos = list(itertools.product(range(len(models)), range(len(methods))))
    draws = []
    for _ in range(10_000):
        mi, me = rng.choice(combos)
        draws.append((mi, me, rng.choice([1, 2, 4, 8, 16]), rng.choice([256, 512, 1024, 2048, 4096, 8192]),
                      rng.choice([4, 8, 16, 32, 64])))
    est_mod._CACHE._d.clear()
    t = time.process_time()
    for mi, me in combos:
        for b in (1, 2):
            estimate(models[mi], TrainingSetup(**methods[me], micro_batch=b))
    record_s = time.process_time() - t

    def one_by_one() -> None:
        for mi, me, b, s, r in draws:
            estimate(models[mi], TrainingSetup(**methods[me], micro_batch=b, seq_len=s, lora_rank=r))

    sweep = {"setups": len(draws), "structures": 2 * len(combos), "record_s": record_s,
             "one_by_one_s": best_of(2, one_by_one)}
    if new:
        from vramlab.core.estimate import estimate_points

        groups: dict = {}
        for mi, me, b, s, r in draws:
            groups.setdefault((mi, me), []).append((b, s, r))

        def as_arrays() -> None:
            for (mi, me), points in groups.items():
                estimate_points(models[mi], TrainingSetup(**methods[me]), points)

        sweep["arrays_s"] = best_of(3, as_arrays)
    out["sweep_10k"] = sweep

    replay = {}
    for mid, kw in CASES:
        spec, setup = find_model(mid), TrainingSetup(**kw)
        est_mod._FULL_CACHE._d.clear()
        t = time.process_time()
        estimate(spec, setup, allocator=True)
        cold = time.process_time() - t
        warm = []
        for b in range(1, 21):
            s = setup.replace(micro_batch=1 + b % 4, seq_len=256 * (1 + b % 8) + 64 * (b // 8))
            t = time.process_time()
            estimate(spec, s, allocator=True)
            warm.append(time.process_time() - t)
        replay[f"{mid}/{setup.method.value}"] = {"first_ms": cold * 1e3, "warm_ms_median": sorted(warm)[10] * 1e3}
    out["per_replay"] = replay

    real = {}
    for mid, kw in REAL:
        spec, setup = find_model(mid), TrainingSetup(**kw)
        est_mod._CACHE._d.clear()
        est_mod._FULL_CACHE._d.clear()
        t = time.process_time()
        r = estimate(spec, setup, allocator=True)
        real[f"{mid}/{setup.method.value}"] = {"cpu_s": time.process_time() - t,
                                               "peak_reserved_bytes": r.peak_reserved_bytes}
    out["real_models"] = real
    return out


def baseline(ref: str) -> dict:
    """``measure`` in a child process over ``git archive ref`` of core/ and resources/."""
    from common import measure_old

    return measure_old(ref, "estimate_speed", "measure(False)")


def main() -> int:
    from common import record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="git ref of the older code measured alongside")
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    data: dict = {"note": "CPU seconds of the benchmark process (best of repeats), old and new in one run on a "
                          "shared, loaded 2-core machine", "load_average_start": os.getloadavg()}
    if not args.no_baseline:
        data["baseline_ref"] = args.baseline
        data["old"] = baseline(args.baseline)
    data["new"] = measure(True)
    data["load_average_end"] = os.getloadavg()
    print(record("estimate_speed", data))
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
