"""Cold start of the desktop app: process start to the main window's first paint. Goal: under 1.5 s.

Each run is a fresh interpreter (``python -m vramlab.app.main --gui-smoke-test``, QT_QPA_PLATFORM=offscreen,
a temporary settings file), timed from just before the process is spawned to the first paint event of the
main window, which the app reports as a JSON line before it closes itself. The run fails if torch was
imported by then: the window must appear before torch loads (ARCHITECTURE.md).

Run: .venv/bin/python benchmarks/startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, summary  # noqa: E402

GOAL_S = 1.5


def one_run(settings: Path) -> dict:
    # an installed app starts from compiled bytecode: PYTHONDONTWRITEBYTECODE (set to anything, even "0") would
    # make every run compile the project's modules again
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["QT_QPA_PLATFORM"] = "offscreen"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "vramlab.app.main", "--gui-smoke-test", "--settings", str(settings)],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    exited = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"the app failed to start (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    line = next((x for x in proc.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise SystemExit(f"the app printed no start-up report:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    info = json.loads(line)
    if info["torch_loaded"]:
        raise SystemExit("torch was imported before the window was shown")
    return {"first_paint_s": info["wall_time"] - t0, "since_app_import_s": info["since_app_import_s"],
            "process_exit_s": exited - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Path(tmp) / "settings.ini"
        one_run(settings)  # warm-up (bytecode compiled, files in the page cache); not recorded
        settings.unlink(missing_ok=True)
        runs = []
        for _ in range(args.runs):
            runs.append(one_run(settings))
            settings.unlink(missing_ok=True)  # every run is a first start: no saved window or scenarios
    paint = [r["first_paint_s"] for r in runs]
    median = statistics.median(paint)
    data = {
        "what": "process spawn to the main window's first paint (offscreen), fresh process each run",
        "goal_s": GOAL_S,
        "median_s": round(median, 3),
        "first_paint_s": {k: round(v, 4) if isinstance(v, float) else v for k, v in summary(paint).items()},
        "runs": [{k: round(v, 4) for k, v in r.items()} for r in runs],
        "torch_imported_before_window": False,
        "meets_goal": median < GOAL_S,
    }
    path = record("startup", data)
    print(f"cold start to first paint: median {median:.3f} s over {len(runs)} runs "
          f"({'meets' if median < GOAL_S else 'MISSES'} the {GOAL_S} s goal) -> {path}")
    return 0 if median < GOAL_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
