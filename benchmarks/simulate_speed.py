"""Simulate time and peak RSS for 1B, 7B and 70B presets: the fast path (meta tensors, ``simulate``'s default)
as a user meets it twice, the same fast path of an older commit, and the reference path (FakeTensorMode,
``simulate(fast=False)``), all in the same run; torch's MemTracker on the same 7B step under fake tensors; the
dispatch tracker's overhead on a real CPU step.

The fast path asks FakeTensorMode for the layouts of each new op key and for the attention's ATen ops, and
keeps the answers on disk (``core/simulation/fakeref.py``, in ``VRAMLAB_CACHE_DIR``). So it is measured twice:

* ``simulate``: a later run of the setup on this machine (the answers are on disk: a throw-away run of each
  setup wrote them before the timed runs), what the goal is about;
* ``simulate_first_run``: the first run of the setup on this machine and torch build (an empty cache folder
  for every run): FakeTensorMode is asked, which imports ``torch._dynamo`` (about 1.5 s);
* ``simulate_before``: the fast path of ``--old`` (default a0590c8, before the answers were kept), which paid
  the first run's cost every time;
* ``simulate_old``: the reference, FakeTensorMode throughout.

``fake_reference_imports`` (once per round): a fresh process that imports ``torch._dynamo`` after ``torch``,
which is what asking FakeTensorMode first costs in imports (``FakeTensorMode.__init__`` imports
``torch._dynamo.config``, which runs the package; that brings in ``torch.fx.experimental.symbolic_shapes`` with
sympy and ``torch.distributed.tensor``, which FakeTensorMode's dispatch imports too). A first run that asks
FakeTensorMode pays this on top of the later run's work (``first_run_floor_s``: the two added).

Each measurement runs in a fresh subprocess (so peak RSS is its own, and the time includes the first call's
imports, as a user's ``vramlab simulate`` does; ``import torch`` is done before the timer). An installed
package runs from compiled bytecode: the children run without ``PYTHONDONTWRITEBYTECODE``, and a throw-away
run of each tree compiles its modules first. The columns alternate, ``REPEATS`` times each, and the medians
of wall and CPU time (``time.process_time`` of the child) are recorded with the load average (the machine is
shared). Every column's results are compared whole (every number of the result but its timing):
``identical`` says they all agree. ``dynamo_imported`` says whether ``torch._dynamo`` was in the process.
Run:
    .venv/bin/python benchmarks/simulate_speed.py [--old REF]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import old_tree, record  # noqa: E402

REPEATS = 3
MODELS = ("llama-3.2-1b", "llama-2-7b", "llama-2-70b")
OLD = "a0590c8"  # the fast path before FakeTensorMode's answers were kept on disk
COLUMNS = ("simulate", "simulate_first_run", "simulate_before", "simulate_old")

CHILD = r'''
import dataclasses, hashlib, json, resource, sys, time
which, mid = sys.argv[1], sys.argv[2]
import torch
from vramlab.core.catalog import find_model
from vramlab.core.spec.training import TrainingSetup
spec = find_model(mid)
setup = TrainingSetup(method="full", weights="bf16", micro_batch=1, seq_len=512)
t, c = time.perf_counter(), time.process_time()
digest = ""
if which in ("simulate", "simulate_old"):
    from vramlab.core.simulation.simulate import simulate
    r = simulate(spec, setup, fast=which == "simulate")
    peak = r.peak_allocated_bytes
    digest = hashlib.sha256(repr(dataclasses.replace(r, timing={})).encode()).hexdigest()[:16]
elif which == "fake_imports":  # what FakeTensorMode's first use imports (its __init__: torch._dynamo.config)
    import torch._dynamo
    peak = 0
elif which == "memtracker":
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from vramlab.core.simulation.model import build_model
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
    from vramlab.core.simulation.model import build_model
    from vramlab.core.simulation.step import measure
    from vramlab.core.simulation.tracker import MemoryTracker
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
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "dynamo_imported": "torch._dynamo" in sys.modules}))
'''


def child(which: str, model: str, cache: str | None = None, code: Path | None = None) -> dict:
    """One fresh process; ``cache``: its VRAMLAB_CACHE_DIR (None: a new empty folder); ``code``: an old tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="vramlab-simulate-cache-") as empty:
        env["VRAMLAB_CACHE_DIR"] = cache or empty
        p = subprocess.run([sys.executable, "-c", CHILD, which, model], capture_output=True, text=True,
                           timeout=3600, env=env, check=False)
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
            "result_sha256": ok[0]["result_sha256"], "dynamo_imported": any(r["dynamo_imported"] for r in ok),
            "samples_s": [round(r["seconds"], 3) for r in ok],
            "samples_cpu_s": [round(r["cpu_seconds"], 3) for r in ok]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default=OLD, help="the commit whose fast path runs beside (default %(default)s)")
    args = parser.parse_args()
    data = {"setup": "full fine-tuning, bf16, AdamW foreach, batch 1 x 512, two steps",
            "note": f"fresh process per run, compiled bytecode; the columns alternate, {REPEATS} runs each, medians "
                    "of wall and CPU time; simulate: FakeTensorMode's answers for the setup on disk (a later run on "
                    "this machine); simulate_first_run: an empty cache folder (the first run of the setup on this "
                    f"machine and torch build); simulate_before: the fast path of {args.old}; simulate_old: "
                    "FakeTensorMode throughout; the machine is shared: load averages (1, 5, 15 min) before and after",
            "old_commit": args.old, "load_average_before": os.getloadavg()}
    runs: dict[str, dict[str, list[dict]]] = {c: {m: [] for m in MODELS} for c in COLUMNS}
    imports: list[dict] = []
    with old_tree(args.old, prefix="vramlab-simulate-old-") as before, \
            tempfile.TemporaryDirectory(prefix="vramlab-simulate-warm-") as warm:
        child("simulate", MODELS[0], code=before)  # compiles the old tree's modules
        for m in MODELS:  # compiles this tree's modules; keeps each setup's answers in ``warm``
            child("simulate", m, cache=warm)
        for _ in range(REPEATS):
            imports.append(child("fake_imports", MODELS[0]))
            for m in MODELS:
                runs["simulate"][m].append(child("simulate", m, cache=warm))
                runs["simulate_first_run"][m].append(child("simulate", m))
                runs["simulate_before"][m].append(child("simulate", m, code=before))
                runs["simulate_old"][m].append(child("simulate_old", m))
                print(m, {c: runs[c][m][-1] for c in COLUMNS}, flush=True)
    for c in COLUMNS:
        data[c] = {m: medians(runs[c][m]) for m in MODELS}
    fake = data["fake_reference_imports"] = {k: v for k, v in medians(imports).items()
                                             if k not in ("peak_bytes", "result_sha256")}
    data["first_run_floor_s"] = {m: round(data["simulate"][m]["seconds"] + fake["seconds"], 3)
                                 for m in MODELS if "error" not in data["simulate"][m]
                                 and "error" not in fake}
    data["speedup"] = {f"{c}_vs_simulate": {m: round(data[c][m]["seconds"] / data["simulate"][m]["seconds"], 2)
                                            for m in MODELS if "error" not in data[c][m]
                                            and "error" not in data["simulate"][m]}
                       for c in COLUMNS[1:]}
    data["identical"] = {m: len({r.get("result_sha256") for c in COLUMNS for r in runs[c][m]}) == 1 for m in MODELS}
    data["memtracker_7b_fake"] = child("memtracker", "llama-2-7b")
    data["tracker_overhead_real_cpu"] = {
        "model": "smollm2-135m, seq 128",
        "untracked": child("real", "smollm2-135m"),
        "tracked": child("real_tracked", "smollm2-135m"),
    }
    data["load_average_after"] = os.getloadavg()
    print(record("simulate_speed", data))
    print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
