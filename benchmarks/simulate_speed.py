"""Simulate time and peak RSS for 1B, 7B and 70B presets, the fast path (meta tensors, ``simulate``'s
default) beside the reference path (FakeTensorMode, ``simulate(fast=False)``) in the same run; torch's
MemTracker on the same 7B step under fake tensors; the dispatch tracker's overhead on a real CPU step.

Each measurement runs in a fresh subprocess (so peak RSS is its own, and the time includes the first
call's imports and caches, as a user's first ``vramlab simulate`` does); old and new alternate, ``REPEATS``
times each, and the medians are recorded with the load average (the machine is shared). Both paths'
results are compared whole (every number of the result but its timing): ``identical`` says they agree.
Run:
    .venv/bin/python benchmarks/simulate_speed.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

REPEATS = 3
MODELS = ("llama-3.2-1b", "llama-2-7b", "llama-2-70b")

CHILD = r'''
import dataclasses, hashlib, json, resource, sys, time
which, mid = sys.argv[1], sys.argv[2]
import torch
from vramlab.core.catalog import find_model
from vramlab.core.spec import TrainingSetup
spec = find_model(mid)
setup = TrainingSetup(method="full", weights="bf16", micro_batch=1, seq_len=512)
t, c = time.perf_counter(), time.process_time()
digest = ""
if which in ("simulate", "simulate_old"):
    from vramlab.core.measure.simulate import simulate
    r = simulate(spec, setup, fast=which == "simulate")
    peak = r.peak_allocated_bytes
    digest = hashlib.sha256(repr(dataclasses.replace(r, timing={})).encode()).hexdigest()[:16]
elif which == "memtracker":
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from vramlab.core.measure.model import build_model
    with FakeTensorMode():
        model = build_model(spec, setup, "cpu", real=False)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        ids = torch.empty(1, 512, dtype=torch.long); labels = torch.empty(1, 512, dtype=torch.long)
        mt = MemTracker(); mt.track_external(model, opt)
        with mt:
            for _ in range(2):
                loss = model(ids, labels); loss.backward(); opt.step(); opt.zero_grad(); mt.reset_mod_stats()
        peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
elif which in ("real", "real_tracked"):
    from vramlab.core.measure.model import build_model
    from vramlab.core.measure.step import measure
    from vramlab.core.measure.tracker import MemoryTracker
    if which == "real_tracked":
        tr = MemoryTracker()
        t = time.perf_counter(); measure(spec, setup.replace(seq_len=128), "cpu", real=True, tracker=tr)
        peak = tr.peak.total_bytes
    else:
        torch.manual_seed(0)
        model = build_model(spec, setup.replace(seq_len=128), "cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        ids = torch.randint(0, spec.vocab_size, (1, 128)); labels = ids.clone()
        t = time.perf_counter()
        for _ in range(2):
            loss = model(ids, labels); loss.backward(); opt.step(); opt.zero_grad()
        peak = 0
elapsed, cpu = time.perf_counter() - t, time.process_time() - c
print(json.dumps({"seconds": elapsed, "cpu_seconds": cpu, "peak_bytes": peak, "result_sha256": digest,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def child(which: str, model: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, which, model], capture_output=True, text=True, timeout=3600,
                       check=False)
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"]}
    return {"seconds": statistics.median(r["seconds"] for r in ok),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in ok),
            "peak_bytes": ok[0]["peak_bytes"], "max_rss_mib": max(r["max_rss_mib"] for r in ok),
            "result_sha256": ok[0]["result_sha256"], "samples_s": [round(r["seconds"], 3) for r in ok]}


if __name__ == "__main__":
    data = {"setup": "full fine-tuning, bf16, AdamW foreach, batch 1 x 512, two steps",
            "note": f"fresh process per run; new (meta tensors) and old (FakeTensorMode) alternate, {REPEATS} runs "
                    "each, medians; the machine is shared: load averages (1, 5, 15 min) before and after",
            "load_average_before": os.getloadavg()}
    new: dict[str, list[dict]] = {m: [] for m in MODELS}
    old: dict[str, list[dict]] = {m: [] for m in MODELS}
    for _ in range(REPEATS):
        for m in MODELS:
            new[m].append(child("simulate", m))
            old[m].append(child("simulate_old", m))
            print(m, new[m][-1], old[m][-1], flush=True)
    data["simulate"] = {m: medians(new[m]) for m in MODELS}
    data["simulate_old"] = {m: medians(old[m]) for m in MODELS}
    data["speedup"] = {m: round(data["simulate_old"][m]["seconds"] / data["simulate"][m]["seconds"], 2)
                       for m in MODELS if "error" not in data["simulate"][m] and "error" not in data["simulate_old"][m]}
    data["identical"] = {m: len({r.get("result_sha256") for r in new[m] + old[m]}) == 1 for m in MODELS}
    data["memtracker_7b_fake"] = child("memtracker", "llama-2-7b")
    data["tracker_overhead_real_cpu"] = {
        "model": "smollm2-135m, seq 128",
        "untracked": child("real", "smollm2-135m"),
        "tracked": child("real_tracked", "smollm2-135m"),
    }
    data["load_average_after"] = os.getloadavg()
    print(record("simulate_speed", data))
    print(json.dumps(data, indent=2))
