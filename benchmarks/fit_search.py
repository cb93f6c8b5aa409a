"""The fit search (``vramlab fit`` and ``vramlab advise`` with ``--gpu``): CPU time of one answer, in a fresh
process per case, where each new setup structure records its step once (tens of ms each).

* ``fits``: the setup fits; the largest micro batch and the longest sequence are searched.
* ``single``: it does not fit and one change is enough: the ranked savings.
* ``combination``: no single change is enough: the breadth-first search over the savings finds the fewest changes
  that fit together (``changes`` of them).
* ``none``: no combination of up to 4 changes fits: the search ends (the frontier it cannot bring within the budget
  is not expanded).

Each figure is ``time.process_time`` of the fresh process's ``fit_search`` (the machine is shared; wall time would
measure the other users), with ``--fast`` semantics (the slack model), as ``vramlab fit --fast`` runs it.

Run: .venv/bin/python benchmarks/fit_search.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CASES = {
    "fits": ("llama-3.1-8b", "a100-80gb", {"method": "lora"}),
    "single": ("llama-3.1-8b", "rtx-4090", {"method": "lora", "seq_len": 2048}),
    "combination": ("qwen2.5-0.5b", "4GiB", {"method": "full", "seq_len": 2048, "micro_batch": 4}),
    "none": ("llama-2-7b", "2GiB", {"method": "full"}),
}

CHILD = """
import json, sys, time
from vramlab.core.advisor import fit_search
from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.spec.training import TrainingSetup
model, gpu, fields = json.loads(sys.argv[1])
spec, gpu, setup = find_model(model), find_gpu(gpu), TrainingSetup(**fields)
t = time.process_time()
ans = fit_search(spec, setup, gpu)
cpu = time.process_time() - t
c = ans.combination
print(json.dumps({"cpu_s": round(cpu, 3), "fits_now": ans.fits_now, "single_change_fits": ans.single_change_fits,
                  "changes": [k for k, _t, _c in c.steps] if c else None}))
"""


def main() -> None:
    from common import record

    out = {}
    for name, case in CASES.items():
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True,
                              check=True)
        out[name] = {"model": case[0], "gpu": case[1], "setup": case[2], **json.loads(done.stdout)}
        print(name, out[name])
    print(record("fit_search", {"cases": out}))


if __name__ == "__main__":
    main()
