"""Run every benchmark in turn and record each one's results under benchmarks/results/.

Run: .venv/bin/python benchmarks/run_all.py [name ...]   (names: estimate_speed simulate_speed published startup ...)
Benchmarks that need something this machine lacks (a GPU, PyInstaller) say so and are skipped.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["estimate_speed", "simulate_speed", "accuracy_matrix", "published", "startup", "sampling", "soak", "build",
         "fuzz"]


def main(argv: list[str]) -> int:
    names = argv or [n for n in ORDER if (HERE / f"{n}.py").exists()]
    failed = []
    for name in names:
        script = HERE / f"{name}.py"
        if not script.exists():
            print(f"{name}: no such benchmark", file=sys.stderr)
            failed.append(name)
            continue
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(script)])
        print(f"== {name}: exit {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
