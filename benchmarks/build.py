"""The packaged app: build time, folder and archive sizes, and how fast the frozen app starts, per variant.

Builds both variants with packaging/build.py (PyInstaller, the checks, tarball and .deb on Linux), then times
the frozen executable from its folder, each run a fresh process (QT_QPA_PLATFORM=offscreen):

* ``self_test_s``   ``vramlab --self-test`` to its exit (GUI first paint, estimate, and with torch a tiny
                    simulation and a profile child process)
* ``estimate_s``    ``vramlab estimate --model llama-3.1-8b --gpu rtx-4090`` to its exit, output printed
* ``first_paint_s`` ``vramlab --gui-smoke-test``: process spawn to the main window's first paint

The first run after the build is reported apart (``first``); the others give the median. Goal: the
estimator-only folder under 250 MB.

Run: .venv/bin/python benchmarks/build.py [--runs 5] [--variant all|full|estimator] [--no-archives]
     .venv/bin/python benchmarks/build.py --time-only   (re-time the folders of the last recorded build)
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
from common import RESULTS, record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOAL_ESTIMATOR_BYTES = 250 * 10**6


def timed_run(cmd: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    return time.perf_counter() - t0, proc


def first_paint(exe: str, env: dict[str, str], settings: Path) -> float:
    t0 = time.time()
    proc = subprocess.run([exe, "--gui-smoke-test", "--settings", str(settings)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    settings.unlink(missing_ok=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{exe} --gui-smoke-test failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(line)["wall_time"] - t0


def start_times(exe: str, runs: int) -> dict:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vramlab-bench-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(QT_QPA_PLATFORM="offscreen", VRAMLAB_CONFIG_DIR=tmp)
        cases = {
            "self_test_s": lambda: timed_run([exe, "--self-test"], env),
            "estimate_s": lambda: timed_run([exe, "estimate", "--model", "llama-3.1-8b", "--gpu", "rtx-4090"], env),
        }
        for name, fn in cases.items():
            times = []
            for _ in range(runs + 1):
                seconds, proc = fn()
                if proc.returncode != 0 or not proc.stdout.strip():
                    raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                times.append(seconds)
            out[name] = {"first": round(times[0], 3), "median": round(statistics.median(times[1:]), 3),
                         "min": round(min(times[1:]), 3), "n": runs}
        paints = [first_paint(exe, env, Path(tmp) / "settings.ini") for _ in range(runs + 1)]
        out["first_paint_s"] = {"first": round(paints[0], 3), "median": round(statistics.median(paints[1:]), 3),
                                "min": round(min(paints[1:]), 3), "n": runs}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--variant", choices=["all", "full", "estimator"], default="all")
    ap.add_argument("--no-archives", action="store_true", help="skip the tarball and .deb")
    ap.add_argument("--time-only", action="store_true",
                    help="no build: time the folders of benchmarks/results/build.json again and update it")
    args = ap.parse_args()
    if args.time_only:
        return retime(args.runs)
    with tempfile.TemporaryDirectory(prefix="vramlab-build-bench-") as tmp:
        summary_file = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(ROOT / "packaging" / "build.py"), "--variant", args.variant,
               "--summary", str(summary_file)]
        if args.no_archives:
            cmd.append("--no-archives")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"packaging/build.py failed (exit {proc.returncode})")
        builds = json.loads(summary_file.read_text())["builds"]

    variants = {}
    for b in builds:
        print(f"timing the {b['variant']} build's start ({args.runs} runs after a first one)...", flush=True)
        variants[b["variant"]] = {
            "torch": b["torch"],
            "folder_bytes": b["folder_bytes"],
            "folder_mib": round(b["folder_bytes"] / 2**20, 1),
            "pyinstaller_s": b["pyinstaller_s"],
            "build_s": b["build_s"],
            "checks_s": b["checks_s"],
            "executable": str(Path(b["executable"]).relative_to(ROOT)),
            "packages": {k: {"bytes": p["bytes"], "mib": round(p["bytes"] / 2**20, 1), "s": p["s"],
                             "file": Path(p["path"]).name} for k, p in b["packages"].items()},
            "start": start_times(b["executable"], args.runs),
        }
    data = {
        "load_average_at_timing": [round(x, 2) for x in os.getloadavg()],  # other work on the machine
        "what": "PyInstaller one-folder builds of packaging/vramlab.spec from this environment: build time "
                "(icons + PyInstaller + arranging; checks apart), sizes, and start times of the frozen app "
                "(offscreen, fresh process per run; 'first' is the first run after the build)",
        "build_command": f"python packaging/build.py --variant {args.variant}",
        "wall_s": round(wall, 1),
        "goal": {"estimator_folder_bytes_below": GOAL_ESTIMATOR_BYTES},
        "variants": variants,
    }
    if "estimator" in variants:
        data["goal"]["estimator_met"] = variants["estimator"]["folder_bytes"] < GOAL_ESTIMATOR_BYTES
    path = record("build", data)
    report(variants)
    print(f"recorded in {path}")
    return 0


def retime(runs: int) -> int:
    path = RESULTS / "build.json"
    data = json.loads(path.read_text())
    for name, v in data["variants"].items():
        print(f"timing the {name} build's start ({runs} runs after a first one)...", flush=True)
        v["start"] = start_times(str(ROOT / v["executable"]), runs)
    data["load_average_at_timing"] = [round(x, 2) for x in os.getloadavg()]  # other work on the machine
    data = {k: v for k, v in data.items() if k not in ("benchmark", "date", "machine")}
    data["built"] = json.loads(path.read_text())["date"]
    record("build", data)
    report(data["variants"])
    print(f"updated {path}")
    return 0


def report(variants: dict) -> None:
    for name, v in variants.items():
        s = v["start"]
        pk = ", ".join(f"{k} {p['mib']} MiB" for k, p in v["packages"].items())
        print(f"{name:<10} folder {v['folder_mib']} MiB ({pk}); build {v['build_s']} s; self-test "
              f"{s['self_test_s']['median']} s, estimate {s['estimate_s']['median']} s, first paint "
              f"{s['first_paint_s']['median']} s")


if __name__ == "__main__":
    raise SystemExit(main())
