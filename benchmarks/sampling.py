"""CPU cost of live profiling in the GUI process: sampling at 20 Hz plus plotting at 20 Hz.

The window runs the Live profile tab offscreen with the fake GPU sampler (core.monitor.FakeSampler, whose
allocation follows the run) and a stand-in profile function that emits the phase events of a two-step run
spread over the whole duration without starting a child, so what is measured is the GUI process alone:
the sampler thread (NVML-shaped readings plus psutil on a process), the queued signals, the ring buffer
and the 20 Hz redraw of both plots. The cost is the process's CPU time (all threads) per wall-clock
second, first with the window idle on the same tab (the baseline), then during the run. Goal: at most
30 % of one core above the baseline (the run itself keeps the GPU, or a whole CPU core, busy).

Run: .venv/bin/python benchmarks/sampling.py [--seconds 60] [--baseline 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

GOAL_CPU_FRACTION = 0.30  # of one core, above the idle baseline
PHASES = ("load", "forward@1", "backward@1", "optimizer@1", "forward@2", "backward@2", "optimizer@2")


def stand_in_profile(duration_s: float) -> Callable[..., Any]:
    """A profile function with the core's signature that runs for ``duration_s`` without a child: it
    reports this process as the child, emits every phase of a two-step run (the allocation of each taken
    from the estimate), polls ``should_abort`` every 50 ms as the core does, and returns an ok outcome."""
    from vramlab.core.estimate import estimate
    from vramlab.core.measure.profile import ProfileOutcome
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
        from vramlab.core.spec import ModelSpec, TrainingSetup

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
        return {"wall_s": wall, "cpu_s": cpu, "frames": self.frames, "samples": self.samples,
                "redraw_s": self.redraw_s}

    def idle(self, seconds: float) -> dict[str, float]:
        cpu0, t0 = time.process_time(), time.monotonic()
        self.settle(seconds)
        return {"wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0}

    def close(self) -> None:
        self.window.close()
        self.settle(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the measured run [60]")
    ap.add_argument("--baseline", type=float, default=15.0, help="idle window before the run [15]")
    args = ap.parse_args()
    h = Harness()
    h.run(3.0)  # warm-up: first paint of every item, imports; not recorded
    idle = h.idle(args.baseline)
    live = h.run(args.seconds)
    points = len(h.window.live.buffer)
    h.close()
    idle_frac = idle["cpu_s"] / idle["wall_s"]
    live_frac = live["cpu_s"] / live["wall_s"]
    extra = live_frac - idle_frac
    data = {
        "what": "GUI process CPU time per wall second: Live tab idle vs. a run with the fake GPU sampler at 20 Hz "
                "and both plots redrawn at 20 Hz (offscreen, 1440x900, no child process)",
        "goal_cpu_fraction_above_idle": GOAL_CPU_FRACTION,
        "idle": {"seconds": round(idle["wall_s"], 1), "cpu_fraction_of_one_core": round(idle_frac, 4)},
        "live": {
            "seconds": round(live["wall_s"], 1),
            "cpu_fraction_of_one_core": round(live_frac, 4),
            "samples": live["samples"], "sample_hz": round(live["samples"] / live["wall_s"], 2),
            "frames": live["frames"], "redraw_hz": round(live["frames"] / live["wall_s"], 2),
            "redraw_ms_mean": round(1000 * live["redraw_s"] / max(1, live["frames"]), 3),
            "points_at_end": points,
        },
        "cpu_fraction_above_idle": round(extra, 4),
        "meets_goal": extra <= GOAL_CPU_FRACTION,
    }
    path = record("sampling", data)
    print(f"idle {idle_frac * 100:.2f} % of a core; live {live_frac * 100:.2f} % "
          f"({live['samples'] / live['wall_s']:.1f} samples/s, {live['frames'] / live['wall_s']:.1f} frames/s, "
          f"{data['live']['redraw_ms_mean']:.2f} ms/frame); +{extra * 100:.2f} % -> {path}")
    return 0 if data["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
