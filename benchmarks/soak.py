"""Soak test of the Live profile tab: the window sampling and plotting at 20 Hz for a long time.

Back-to-back runs (``--run-minutes`` each, 5 by default) of the stand-in profile from ``sampling.py``
(fake GPU sampler, no child process) fill the whole ``--minutes`` (30 by default), so both a long run (its
ring buffer and curves growing to thousands of points) and the start and end of many runs (threads,
workers, plots cleared) are exercised. Every minute the process's resident memory, its OS thread count,
Python's object count and the CPU share since the last minute are recorded; the result says how much the
resident memory grew from the end of the first run to the end. Every reading is counted per run: produced by
the (fake) GPU sampler, received by the window, held in the ring buffer and drawn in the plot. Before the
runs, the window sits idle on the tab for ``--idle-minutes`` (the CPU baseline). Goals: CPU mean at most 3 %
of one core above idle, under 20 MiB of growth, no reading dropped and no thread left behind.

Run (30 minutes, low CPU by design; in the background):
    nohup .venv/bin/python benchmarks/soak.py > /tmp/soak.log 2>&1 &
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402
from sampling import Harness  # noqa: E402

GOAL_GROWTH_MIB = 20.0
GOAL_CPU_FRACTION = 0.03  # of one core, above idle
BEFORE = {"recorded": "2026-12-01, the code before issue #17's frame pacing (every 20 Hz tick redrew both plots)",
          "cpu_fraction_mean": 0.482, "frames_per_s_mean": 18.31, "rss_growth_after_first_run_mib": 1.1}
MiB = 1024**2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="total length [30]")
    ap.add_argument("--run-minutes", type=float, default=5.0, help="length of each profile run [5]")
    ap.add_argument("--idle-minutes", type=float, default=1.0, help="idle baseline before the runs [1]")
    args = ap.parse_args()
    proc = psutil.Process()
    h = Harness()
    h.run(3.0)  # warm-up: imports and the first paint of every item
    gc.collect()
    idle = h.idle(args.idle_minutes * 60)  # also lets the warm-up's idle threads go (see the end)
    idle_frac = idle["cpu_s"] / idle["wall_s"]
    t_start = time.monotonic()
    state = {"cpu": time.process_time(), "t": t_start}
    points: list[dict] = []

    def point(label: str) -> dict:
        now, cpu = time.monotonic(), time.process_time()
        p = {"minute": round((now - t_start) / 60, 2), "label": label,
             "rss_mib": round(proc.memory_info().rss / MiB, 1), "os_threads": proc.num_threads(),
             "python_objects": len(gc.get_objects()),
             "cpu_fraction_of_one_core": round((cpu - state["cpu"]) / max(1e-9, now - state["t"]), 4),
             "buffer_points": len(h.window.live.buffer)}
        state["cpu"], state["t"] = cpu, now
        points.append(p)
        print(f"{p['minute']:6.2f} min  rss {p['rss_mib']:7.1f} MiB  threads {p['os_threads']:3d}  "
              f"objects {p['python_objects']:7d}  cpu {p['cpu_fraction_of_one_core'] * 100:5.1f} %  "
              f"points {p['buffer_points']}  {label}", flush=True)
        return p

    start = point("start (after warm-up)")
    runs = []
    run_s = args.run_minutes * 60
    while time.monotonic() - t_start < args.minutes * 60 - 5:
        left = args.minutes * 60 - (time.monotonic() - t_start)
        r = h.run(min(run_s, left), during=lambda _t: point("during a run"))
        runs.append({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
        point(f"end of run {len(runs)}")
    h.close()
    h.settle(40)  # Qt lets an idle pool thread go after 30 s: count the threads that stay, as at the start
    gc.collect()
    end = point("end (window closed, 40 s later)")
    first_run_end = next(p for p in points if p["label"].startswith("end of run"))
    last_run_end = [p for p in points if p["label"].startswith("end of run")][-1]
    growth = last_run_end["rss_mib"] - first_run_end["rss_mib"]
    cpu_mean = sum(r["cpu_s"] for r in runs) / sum(r["wall_s"] for r in runs)
    lost = [i + 1 for i, r in enumerate(runs) if not r["produced"] == r["samples"] == r["buffered"] == r["drawn"]]
    data = {
        "what": "Live tab offscreen: fake GPU sampler and stand-in profile runs back to back, sampling and redraw at "
                "20 Hz; resident memory and threads recorded every minute",
        "minutes": round((time.monotonic() - t_start) / 60, 2),
        "run_minutes": args.run_minutes,
        "runs": len(runs),
        "rss_start_mib": start["rss_mib"],
        "rss_end_of_first_run_mib": first_run_end["rss_mib"],
        "rss_end_of_last_run_mib": last_run_end["rss_mib"],
        "rss_end_mib": end["rss_mib"],
        "rss_growth_after_first_run_mib": round(growth, 1),
        "goal_growth_mib": GOAL_GROWTH_MIB,
        "os_threads_start": start["os_threads"],
        "os_threads_end": end["os_threads"],
        "samples_per_s_mean": round(sum(r["samples"] for r in runs) / sum(r["wall_s"] for r in runs), 2),
        "frames_per_s_mean": round(sum(r["frames"] for r in runs) / sum(r["wall_s"] for r in runs), 2),
        "idle_cpu_fraction": round(idle_frac, 4),
        "cpu_fraction_mean": round(cpu_mean, 4),
        "cpu_fraction_above_idle": round(cpu_mean - idle_frac, 4),
        "goal_cpu_fraction_above_idle": GOAL_CPU_FRACTION,
        "readings_produced": sum(r["produced"] for r in runs),
        "readings_drawn": sum(r["drawn"] for r in runs),
        "runs_with_readings_lost": lost,
        "before": BEFORE,
        "meets_goal": (growth <= GOAL_GROWTH_MIB and end["os_threads"] <= start["os_threads"] and not lost
                       and cpu_mean - idle_frac <= GOAL_CPU_FRACTION),
        "points": points,
        "run_details": runs,
    }
    path = record("soak", data)
    print(f"RSS {start['rss_mib']} -> {end['rss_mib']} MiB (growth after the first run {growth:+.1f} MiB), "
          f"threads {start['os_threads']} -> {end['os_threads']}, CPU {cpu_mean * 100:.2f} % of a core "
          f"({(cpu_mean - idle_frac) * 100:+.2f} % above idle), runs with readings lost: {lost} -> {path}")
    return 0 if data["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
