"""CPU cost of live profiling in the GUI process: sampling at 20 Hz plus drawing, old and new code side by side.

The window runs the Live profile tab offscreen with the fake GPU sampler (core.monitor.FakeSampler, whose
allocation follows the run) and a stand-in profile function that emits the phase events of a two-step run
spread over the whole duration without starting a child, so what is measured is the GUI process alone:
the sampler thread (NVML-shaped readings plus psutil on a process), the queued signals, the ring buffer
and the drawing. The cost is the process's CPU time (all threads) per wall-clock second, first with the
window idle on the same tab (the baseline), then during the run. Goal: at most 3 % of one core above the
baseline (a terminal monitor such as nvitop sits near 2 %).

Each measurement runs in its own process; the older code (``--against``, default the tree before issue #17's
Live tab work: every 20 Hz tick redrew both plots) is measured in the same invocation from ``git archive`` of
its core/, app/ and resources/, alternating with the current tree, on the same (shared, loaded) machine. Every
reading is counted: produced by the sampler, received by the window, held in the ring buffer and drawn.

Run: .venv/bin/python benchmarks/sampling.py [--seconds 60] [--baseline 15] [--rounds 2] [--against REF]
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
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

GOAL_CPU_FRACTION = 0.03  # of one core, above the idle baseline
AGAINST = "d9411f3"  # before the Live tab's frame pacing (issue #17)
HERE = Path(__file__).resolve().parent
PHASES = ("load", "forward@1", "backward@1", "optimizer@1", "forward@2", "backward@2", "optimizer@2")


def stand_in_profile(duration_s: float) -> Callable[..., Any]:
    """A profile function with the core's signature that runs for ``duration_s`` without a child: it
    reports this process as the child, emits every phase of a two-step run (the allocation of each taken
    from the estimate), polls ``should_abort`` every 50 ms as the core does, and returns an ok outcome."""
    from vramlab.core.estimate import estimate
    from vramlab.core.profiling.outcomes import ProfileOutcome
    from vramlab.core.result import Level

    def run(spec, setup, device="cpu", gpu=None, on_event=None, should_abort=None, **_kwargs):  # noqa: ANN001, ANN202
        est = estimate(spec, setup, None, match_simulation=True)
        peaks = {p.key: p.bytes for p in est.phases}
        emit = on_event or (lambda _e: None)
        emit({"event": "started", "pid": os.getpid()})
        t0 = time.monotonic()
        per_phase = duration_s / (len(PHASES) + 0.2)
        shown = -1
        previous = None
        while time.monotonic() - t0 < duration_s:
            i = min(int((time.monotonic() - t0) / per_phase), len(PHASES) - 1)
            if i != shown:
                shown = i
                key = PHASES[i]
                ended = {"ended": previous, "ended_peak_allocated": peaks[previous],
                         "ended_peak_reserved": peaks[previous]} if previous else {}
                emit({"event": "phase", "key": key, "allocated": peaks[key] // 2, "reserved": peaks[key] // 2,
                      **ended})
                previous = key
            if should_abort is not None and should_abort():
                return ProfileOutcome(False, "cancelled", "cancelled by the user", device)
            time.sleep(0.05)
        emit({"event": "phase", "key": "end", "allocated": 0, "reserved": 0, "ended": previous,
              "ended_peak_allocated": peaks[previous], "ended_peak_reserved": peaks[previous]})
        result = replace(est, level=Level.PROFILE, timing={"total": duration_s})
        return ProfileOutcome(True, "ok", "", device, result=result, info={"gpu": "CPU", "device": device})

    return run


class Harness:
    """The main window on the Live tab, offscreen, with the fake sampler and the stand-in profile."""

    def __init__(self, theme: str = "light") -> None:
        tmp = Path(tempfile.mkdtemp(prefix="vramlab-bench-"))
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        os.environ["VRAMLAB_SETTINGS_FILE"] = str(tmp / "settings.ini")
        os.environ["VRAMLAB_CONFIG_DIR"] = str(tmp / "config")
        from vramlab.app.qt import QtCore, QtWidgets

        self.QtCore = QtCore
        self.app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["vramlab-bench"])
        from vramlab.app.main_window import MainWindow
        from vramlab.app.state import ModelChoice
        from vramlab.core.monitor import FakeSampler
        from vramlab.core.spec.model import ModelSpec
        from vramlab.core.spec.training import TrainingSetup

        self.window = w = MainWindow(detect_gpus=False, theme_mode=theme)
        w.resize(1440, 900)
        w.show()
        spec = ModelSpec(id="bench", name="Bench", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=8,
                         intermediate_size=1376, vocab_size=32000)
        w.state.set_model_choice(ModelChoice("bench", spec))
        w.state.set_setup(TrainingSetup(method="lora", seq_len=512))
        w.state.flush()
        self.fake = FakeSampler()
        view = w.live
        self.fake.set_allocation_source(lambda _i: view.marks[-1].allocated_bytes if view.marks else 0)
        w.live_ctl.set_sampler_factory(lambda: self.fake)
        w.live_ctl.childStarted.connect(lambda started: setattr(self.fake, "pid", started.pid))
        w.tabs.setCurrentWidget(view)
        self.frames = 0
        self.redraw_s = 0.0
        original = view.plots.redraw

        def timed_redraw(*args: Any, **kwargs: Any) -> None:  # every frame drawn, whatever the view's pacing
            t = time.perf_counter()
            original(*args, **kwargs)
            self.redraw_s += time.perf_counter() - t
            self.frames += 1

        view.plots.redraw = timed_redraw  # count and time every frame
        self.samples = 0
        w.live_ctl.sample.connect(self._count)
        self.outcomes: list[Any] = []
        w.live_ctl.finished.connect(self.outcomes.append)
        self.settle(1.0)
        view.refresh_devices()
        view.set_device("cpu")

    def _count(self, _sample: object) -> None:
        self.samples += 1

    def settle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.app.processEvents(self.QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 20)
            time.sleep(0.005)

    def run(self, seconds: float, during: Callable[[float], None] | None = None) -> dict[str, float]:
        """One profile of ``seconds`` (stand-in); returns wall s, CPU s, frames, samples and redraw time."""
        w = self.window
        w.live_ctl.set_profile_fn(stand_in_profile(seconds))
        self.frames, self.redraw_s, self.samples = 0, 0.0, 0
        n = len(self.outcomes)
        produced0 = self.fake.samples_taken
        cpu0, t0 = time.process_time(), time.monotonic()
        if not w.live.start():
            raise SystemExit(f"the run did not start: {w.live.notice.text()}")
        next_tick = t0 + 60
        while len(self.outcomes) == n:
            self.app.processEvents(self.QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 20)
            time.sleep(0.005)
            if during is not None and time.monotonic() >= next_tick:
                during(time.monotonic() - t0)
                next_tick += 60
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        outcome = self.outcomes[-1]
        if not outcome.ok:
            raise SystemExit(f"the run ended with {outcome.kind}: {outcome.message}")
        view = w.live
        return {"wall_s": wall, "cpu_s": cpu, "frames": self.frames, "samples": self.samples,
                "redraw_s": self.redraw_s, "produced": self.fake.samples_taken - produced0,
                "buffered": len(view.buffer), "drawn": len(view.plots.curve_data("rss")[0]),
                "frame_reasons": dict(getattr(view, "frame_reasons", {}))}

    def idle(self, seconds: float) -> dict[str, float]:
        cpu0, t0 = time.process_time(), time.monotonic()
        self.settle(seconds)
        return {"wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0}

    def close(self) -> None:
        self.window.close()
        self.settle(0.2)


def measure(seconds: float, baseline: float) -> dict[str, Any]:
    """One measurement in this process (whichever code ``vramlab`` imports): idle, then one run."""
    h = Harness()
    h.run(3.0)  # warm-up: first paint of every item, imports; not recorded
    idle = h.idle(baseline)
    live = h.run(seconds)
    h.close()
    idle_frac = idle["cpu_s"] / idle["wall_s"]
    live_frac = live["cpu_s"] / live["wall_s"]
    return {
        "idle_cpu_fraction": round(idle_frac, 4),
        "live_cpu_fraction": round(live_frac, 4),
        "cpu_fraction_above_idle": round(live_frac - idle_frac, 4),
        "seconds": round(live["wall_s"], 1),
        "sample_hz": round(live["samples"] / live["wall_s"], 2),
        "frames_per_s": round(live["frames"] / live["wall_s"], 2),
        "redraw_ms_mean": round(1000 * live["redraw_s"] / max(1, live["frames"]), 3),
        "frame_reasons": live["frame_reasons"],
        "readings": {k: live[k] for k in ("produced", "samples", "buffered", "drawn")},
    }


def child(old: Path | None, seconds: float, baseline: float) -> dict[str, Any]:
    """``measure`` in a fresh process, over the older tree when ``old`` is given."""
    path = f"sys.path.insert(0, {str(old)!r}); " if old is not None else ""
    code = (f"import sys, json; {path}sys.path.insert(0, {str(HERE)!r}); import sampling; "
            f"print(json.dumps(sampling.measure({seconds}, {baseline})))")
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    from common import old_tree

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each measured run [60]")
    ap.add_argument("--baseline", type=float, default=15.0, help="idle window before each run [15]")
    ap.add_argument("--rounds", type=int, default=2, help="old/new pairs, alternating [2]")
    ap.add_argument("--against", default=AGAINST, help=f"git ref of the older code [{AGAINST}]")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    load0 = os.getloadavg()
    with old_tree(args.against, prefix="vramlab-sampling-", parts=("core", "app", "resources")) as old:
        for i in range(args.rounds):
            for name, tree in (("old", old), ("new", None)) if i % 2 == 0 else (("new", None), ("old", old)):
                r = child(tree, args.seconds, args.baseline)
                runs[name].append(r)
                print(f"{name}: +{r['cpu_fraction_above_idle'] * 100:.2f} % of a core above idle "
                      f"({r['frames_per_s']} frames/s, {r['sample_hz']} readings/s, readings {r['readings']})",
                      flush=True)

    def med(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[name]), 4)

    lost = [r["readings"] for rs in runs.values() for r in rs
            if not r["readings"]["produced"] == r["readings"]["samples"] == r["readings"]["buffered"]
            == r["readings"]["drawn"]]
    data = {
        "what": "GUI process CPU time per wall second (all threads): Live tab idle vs. a run with the fake GPU "
                "sampler at 20 Hz (offscreen, 1440x900, no child process); old and new code alternating in "
                "one invocation on a shared, loaded 2-core machine; medians over rounds",
        "against": args.against,
        "goal_cpu_fraction_above_idle": GOAL_CPU_FRACTION,
        "load_average_start": [round(x, 2) for x in load0],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "old": {k: med("old", k) for k in ("cpu_fraction_above_idle", "idle_cpu_fraction", "live_cpu_fraction",
                                            "frames_per_s", "sample_hz", "redraw_ms_mean")},
        "new": {k: med("new", k) for k in ("cpu_fraction_above_idle", "idle_cpu_fraction", "live_cpu_fraction",
                                            "frames_per_s", "sample_hz", "redraw_ms_mean")},
        "runs": runs,
        "readings_lost": lost,
    }
    extra = data["new"]["cpu_fraction_above_idle"]
    data["meets_goal"] = extra <= GOAL_CPU_FRACTION and not lost
    path = record("sampling", data)
    print(f"above idle: old {data['old']['cpu_fraction_above_idle'] * 100:.2f} %, new {extra * 100:.2f} % of a "
          f"core; readings lost: {len(lost)} -> {path}")
    return 0 if data["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
