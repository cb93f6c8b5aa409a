"""Simulate time and peak RSS for 1B, 7B and 70B presets; torch's MemTracker on the same 7B step under
fake tensors; the dispatch tracker's overhead on a real CPU step.

Each measurement runs in a fresh subprocess so peak RSS is its own. Run:
    .venv/bin/python benchmarks/simulate_speed.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

CHILD = r'''
import json, resource, sys, time
which, mid = sys.argv[1], sys.argv[2]
import torch
from vramlab.core.catalog import find_model
from vramlab.core.spec import TrainingSetup
spec = find_model(mid)
setup = TrainingSetup(method="full", weights="bf16", micro_batch=1, seq_len=512)
t = time.perf_counter()
if which == "simulate":
    from vramlab.core.measure.simulate import simulate
    peak = simulate(spec, setup).peak_allocated_bytes
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
elapsed = time.perf_counter() - t
print(json.dumps({"seconds": elapsed, "peak_bytes": peak,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def child(which: str, model: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, which, model], capture_output=True, text=True, timeout=3600,
                       check=False)
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    data = {"setup": "full fine-tuning, bf16, AdamW foreach, batch 1 x 512, two steps"}
    data["simulate"] = {m: child("simulate", m) for m in ("llama-3.2-1b", "llama-2-7b", "llama-2-70b")}
    data["memtracker_7b_fake"] = child("memtracker", "llama-2-7b")
    data["tracker_overhead_real_cpu"] = {
        "model": "smollm2-135m, seq 128",
        "untracked": child("real", "smollm2-135m"),
        "tracked": child("real_tracked", "smollm2-135m"),
    }
    print(record("simulate_speed", data))
    print(json.dumps(data, indent=2))
