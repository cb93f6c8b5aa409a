"""The fast simulation with FakeTensorMode's answers taken from disk against the same simulation asking them,
event by event, over every setup of ``benchmarks/simulate_identity.py`` (the accuracy matrix, the published
comparison, the objectives).

Two fresh processes share one empty cache folder (``VRAMLAB_CACHE_DIR``, the file's bounds lifted so that every
answer stays): the first runs the fast path of every setup asking FakeTensorMode (``core/simulation/fakeref.py``
keeps each answer), the second runs them again taking the answers from the file. For each setup the digest
of everything the tracker recorded (every allocation and free, the timeline, the phase marks and peaks, what
was alive at the peak, the parameter counts) must be the same, and the second process must start
FakeTensorMode for none of the setups the meta path runs (``simulate_identity`` holds the first process's
records to the reference). Setups the meta path does not run (fused AdamW, SDPA with a mask) are listed.
Run (about 10 minutes on two loaded cores):
    .venv/bin/python benchmarks/simulate_stored.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import hashlib, json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from simulate_identity import cases
from torch._subclasses.fake_tensor import FakeTensorMode
from tests.support import simulate_paths
from vramlab.core.simulation import fakeref
from vramlab.core.simulation import metasim
fakeref.MAX_ENTRIES, fakeref.MAX_BYTES = 10**7, 2**31
started = [0]
init = FakeTensorMode.__init__
def counted(self, *args, **kwargs):
    started[0] += 1
    init(self, *args, **kwargs)
FakeTensorMode.__init__ = counted
rows, t = {}, time.process_time()
for label, spec, setup in cases():
    before = started[0]
    try:
        rec = simulate_paths.fast(spec, setup)
    except Exception as e:  # the setups simulate() runs on fake tensors instead
        rows[label] = {"result": "fake tensors", "reason": type(e).__name__}
        continue
    rows[label] = {"digest": hashlib.sha256(repr(sorted(rec.items())).encode()).hexdigest(),
                   "fake_tensor_modes": started[0] - before}
print(json.dumps({"cpu_s": time.process_time() - t, "answers_from_disk": metasim.STORE.hits,
                  "answers_asked": metasim.STORE.misses, "rows": rows}))
'''


def run(cache: str) -> dict:
    env = {**os.environ, "VRAMLAB_CACHE_DIR": cache, "VRAMLAB_BLOCK_QT": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(Path(__file__).resolve().parent)],
                          capture_output=True, text=True, env=env, timeout=7200, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="vramlab-simulate-stored-") as cache:
        asked, stored = run(cache), run(cache)
    rows, counts = {}, {}
    for label, a in asked["rows"].items():
        b = stored["rows"][label]
        if "digest" not in a:
            row = a
        elif a["digest"] != b.get("digest"):
            row = {"result": "DIFFERS"}
        else:
            row = {"result": "identical" if b["fake_tensor_modes"] == 0 else "identical, FakeTensorMode asked",
                   "fake_tensor_modes_first": a["fake_tensor_modes"], "fake_tensor_modes_later": b["fake_tensor_modes"]}
        rows[label] = row
        counts[row["result"]] = counts.get(row["result"], 0) + 1
    data = {"note": "two fresh processes on one cache folder: the first asks FakeTensorMode and keeps its answers, "
                    "the second takes them from disk; digests of every recorded event compared; CPU seconds on a "
                    "shared machine (load average below)",
            "load_average": load, "counts": counts,
            "first": {k: asked[k] for k in ("cpu_s", "answers_from_disk", "answers_asked")},
            "later": {k: stored[k] for k in ("cpu_s", "answers_from_disk", "answers_asked")}, "setups": rows}
    print(record("simulate_stored", data))
    print(json.dumps({k: data[k] for k in ("counts", "first", "later")}))
    return 0 if set(counts) <= {"identical", "fake tensors"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
