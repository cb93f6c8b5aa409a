"""The "Live profile" tab: run the current setup for real on this machine and watch it.

Start runs two training steps of the current setup in a child process (``core.profiling.profile``) on the
local GPU, or on the CPU when there is none (tensor numbers from the tracker, the process's resident
memory from psutil). While it runs, the plots show NVML's device readings and psutil's host readings at
20 Hz, the allocator's readings at every phase boundary, and per phase the predicted and the measured
tensor peak; a progress bar counts the phases. When it ends, the result panel lists predicted against
measured per level, per kind and per phase, with the residual in bytes and in % of the measurement, and a
verdict. A failure (out of memory, a crash, a hang past the timeout, a lost GPU) is a message here; the
window keeps working. Results can be saved as JSON with an environment fingerprint, and exported as CSV
or PNG; after a successful GPU run, the measured CUDA context and allocator slack can be saved as this
GPU's calibration.

What a run will be (the request, or why it cannot start) is decided by :func:`vramlab.core.live_plan.plan_run`;
the result panel is :class:`.live_result.LiveResult`; the plots are :class:`.live_plots.LivePlots`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from vramlab.app.export import save_png, write_text
from vramlab.app.profiling import ProfileController
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.state import AppState
from vramlab.app.theme import Theme
from vramlab.app.views.banner import Banner
from vramlab.app.views.live_plots import LivePlots
from vramlab.app.views.live_result import LiveResult
from vramlab.app.workers import Runner
from vramlab.core.checks import SetupError
from vramlab.core.live import (
    DEFAULT_TIMEOUT_S,
    AllocatorReading,
    ComparisonRow,
    FramePacer,
    GpuProbe,
    LiveSample,
    PhaseMark,
    RingBuffer,
    RunRequest,
    RunStarted,
    band_label,
    bands,
    outcome_message,
    phases_done,
    result_document,
    rows_table,
)
from vramlab.core.live_plan import RunRefused, not_profilable, plan_run
from vramlab.core.profiling.outcomes import ProfileOutcome
from vramlab.core.report import setup_summary, to_csv
from vramlab.core.units import fmt_auto, fmt_bytes

log = logging.getLogger(__name__)

REDRAW_MS = 50  # the timer's tick (20 Hz); core.live.FramePacer decides at each tick whether a frame is drawn
MEMORY_SERIES = ("device_used_bytes", "process_used_bytes", "rss_bytes")  # the buffer's memory curves
# what the notice shows (Banner.topic): what the look at the devices found, or the last run's problem
DEVICES_NOTICE, RUN_NOTICE = "devices", "run"


class Readout(QtWidgets.QWidget):
    """One line of text that changes many times a second. A QLabel asks its layout to re-lay the whole tab on
    every change; this widget has a fixed height and only repaints itself. The full text is the tooltip."""

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self._text = ""
        self.setFixedHeight(2 * self.fontMetrics().lineSpacing() + 4)  # two lines: room for every reading
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Fixed)

    def text(self) -> str:
        return self._text

    def setText(self, text: str) -> None:  # noqa: N802 (QLabel's name)
        if text != self._text:
            self._text = text
            self.setToolTip(text)
            self.update()

    def paintEvent(self, event: QtGui.QPaintEvent) -> None:  # noqa: N802
        p = QtGui.QPainter(self)
        p.setPen(self.palette().color(QtGui.QPalette.ColorRole.WindowText))
        p.drawText(self.rect(), int(QtCore.Qt.AlignmentFlag.AlignLeft | QtCore.Qt.AlignmentFlag.AlignTop
                                    | QtCore.Qt.TextFlag.TextWordWrap), self._text)
        p.end()


class LiveView(QtWidgets.QWidget):
    """Controls, live plots and the result panel of one profile run at a time."""

    message = QtCore.Signal(str)  # short status-bar text

    def __init__(self, state: AppState, controller: ProfileController, theme: Theme,
                 parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.controller = controller
        self._theme = theme
        self.buffer = RingBuffer()
        self.marks: list[PhaseMark] = []  # phase boundaries of the run (rank 0's for a sharded run)
        self._shown_unit = state.unit
        self.rank_marks: list[PhaseMark] = []  # those of the other ranks of a sharded run
        self.memory: list[AllocatorReading] = []  # the allocator between boundaries (rank 0's when sharded)
        self._request: RunRequest | None = None
        self._outcome: ProfileOutcome | None = None
        self._t0 = 0.0
        self._started_s: float | None = None
        self._end_s: float | None = None
        self._lost_at_s: float | None = None
        self._dirty = False
        self._forced = True  # the next tick draws whatever the pacer says (a phase boundary, a new unit)
        self._pacer = FramePacer()
        self._probed = False
        self._dir = str(Path.home())
        self._build()
        controller.runningChanged.connect(self._on_running)
        controller.runStarted.connect(self._on_run_started)
        controller.childStarted.connect(self._on_child_started)
        controller.phase.connect(self._on_phase)
        controller.memory.connect(self._on_memory)
        controller.sample.connect(self._on_sample)
        controller.finished.connect(self._on_finished)
        state.computed.connect(self._on_state_computed)
        self._timer = QtCore.QTimer(self)
        self._timer.setInterval(REDRAW_MS)
        self._timer.timeout.connect(self._tick)

    # ---- construction ---------------------------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        layout.setSpacing(4)
        bar = QtWidgets.QHBoxLayout()
        bar.addWidget(QtWidgets.QLabel("Device"))
        self.device_combo = QtWidgets.QComboBox(self)
        self.device_combo.setObjectName("live_device")
        self.device_combo.setToolTip("Where the profile runs: the local NVIDIA GPU (CUDA device 0), or the CPU")
        self.device_combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.device_combo.setSizePolicy(QtWidgets.QSizePolicy.Policy.Minimum, QtWidgets.QSizePolicy.Policy.Fixed)
        self.device_combo.currentIndexChanged.connect(self._on_device)
        bar.addWidget(self.device_combo)
        bar.addSpacing(8)
        bar.addWidget(QtWidgets.QLabel("Timeout"))
        self.timeout_spin = QtWidgets.QDoubleSpinBox(self)
        self.timeout_spin.setObjectName("live_timeout")
        self.timeout_spin.setRange(0.1, 600.0)
        self.timeout_spin.setDecimals(1)
        self.timeout_spin.setSingleStep(5.0)
        self.timeout_spin.setSuffix(" min")
        self.timeout_spin.setValue(DEFAULT_TIMEOUT_S / 60)
        self.timeout_spin.setToolTip("A run without a result after this long is ended (a hang, or a model too "
                                     "large for this machine)")
        bar.addWidget(self.timeout_spin)
        bar.addSpacing(8)
        self.tracked_check = QtWidgets.QCheckBox("Split by kind", self)
        self.tracked_check.setToolTip(
            "GPU runs: also trace every tensor so the measured peak is split by kind (slower; gradients are then "
            "accumulated out of place, as in the simulation). CPU runs always use the tracker.")
        bar.addWidget(self.tracked_check)
        bar.addSpacing(8)
        self.start_button = QtWidgets.QPushButton("Start profile", self)
        self.start_button.setObjectName("live_start")
        self.start_button.setToolTip("Run two real training steps of the current setup in a separate process and "
                                     "compare with the estimate (Ctrl+Shift+R)")
        self.start_button.clicked.connect(lambda _checked=False: self.start())  # not start(fault=checked)
        bar.addWidget(self.start_button)
        self.cancel_button = QtWidgets.QPushButton("Cancel", self)
        self.cancel_button.setObjectName("live_cancel")
        self.cancel_button.setToolTip("End the profiling process now")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.controller.cancel)
        bar.addWidget(self.cancel_button)
        self.progress = QtWidgets.QProgressBar(self)
        self.progress.setObjectName("live_progress")
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setTextVisible(True)
        self.progress.setFormat("Idle")
        self.progress.setToolTip("Phases done of the run: load, then forward, backward and optimizer step of each "
                                 "training step")
        bar.addStretch(1)
        layout.addLayout(bar)
        # on a line of its own: beside a GPU's long name and the buttons it made the tab wider than a 1280 px
        # window (issue 27)
        layout.addWidget(self.progress)

        self.notice = Banner(self, closable=True)
        self.notice.setObjectName("LiveNotice")
        layout.addWidget(self.notice)
        self.summary = QtWidgets.QLabel("Profile the current setup on this machine: Start.", self)
        self.summary.setObjectName("Facts")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        self.readout = Readout(self)
        self.readout.setObjectName("LiveReadout")
        self.readout.setText("The latest readings appear here while a run is on.")
        layout.addWidget(self.readout)

        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical, self)
        self.plots = LivePlots(self._theme, split)
        self.plots.setMinimumHeight(220)
        split.addWidget(self.plots)
        split.addWidget(self._build_result(split))
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        split.setSizes([600, 360])  # in proportion: the plots get the larger share
        split.setChildrenCollapsible(False)
        layout.addWidget(split, 1)

    def _build_result(self, parent: QtWidgets.QWidget) -> QtWidgets.QWidget:
        self.result = LiveResult(self.state.unit, parent)
        r = self.result  # its widgets by their names here too (the window's tests read them)
        self.verdict_label, self.table, self.facts = r.verdict_label, r.table, r.facts
        self.save_button, self.csv_button, self.png_button = r.save_button, r.csv_button, r.png_button
        self.calibrate_button = r.calibrate_button
        self.save_button.clicked.connect(self.save_dialog)
        self.csv_button.clicked.connect(lambda: self.export_dialog("csv"))
        self.png_button.clicked.connect(lambda: self.export_dialog("png"))
        self.calibrate_button.clicked.connect(self.save_calibration)
        self._calibrator = Runner("vramlab-calibrate", self)
        self._calibrator.finished.connect(self._on_calibrated)
        self._calibrator.errored.connect(self._on_calibration_failed)
        self._calibrator.ended.connect(lambda: self.calibrate_button.setEnabled(True))
        return r

    def apply_theme(self, theme: Theme) -> None:
        self._theme = theme
        self.plots.apply_theme(theme)
        if self._request is not None:
            self._dirty = True
            self.redraw()

    # ---- devices ---------------------------------------------------------------------------------------------------
    def showEvent(self, event: QtGui.QShowEvent) -> None:  # noqa: N802
        super().showEvent(event)
        if not self._probed:
            QtCore.QTimer.singleShot(0, self.refresh_devices)
        if self._dirty:
            QtCore.QTimer.singleShot(0, self.redraw)

    def refresh_devices(self) -> GpuProbe:
        """Ask the GPU sampler (NVML) what is here; fills the device selector and says so when nothing is."""
        probe = self.controller.probe(refresh=True)
        self._probed = True
        previous = self.device_combo.currentData()
        with QtCore.QSignalBlocker(self.device_combo):
            self.device_combo.clear()
            if probe.available:
                mem = f", {fmt_bytes(probe.memory_total_bytes)}" if probe.memory_total_bytes else ""
                self.device_combo.addItem(f"{probe.name} (cuda:0{mem})", "cuda")
            else:
                self.device_combo.addItem("GPU: none found", "cuda")
                item = self.device_combo.model().item(0)  # type: ignore[attr-defined]
                item.setEnabled(False)
                item.setToolTip(probe.reason)
            self.device_combo.addItem("CPU (tracker, process RSS)", "cpu")
            wanted = previous if previous in ("cuda", "cpu") else ("cuda" if probe.available else "cpu")
            if wanted == "cuda" and not probe.available:
                wanted = "cpu"
            self.device_combo.setCurrentIndex(self.device_combo.findData(wanted))
        if not probe.available:
            self.notice.show_message(
                f"No NVIDIA GPU found: {probe.reason}. Profiles run on the CPU: tensor numbers from the tracker, "
                "the process's resident memory from psutil; there is no reserved or device level on the CPU.",
                "info", DEVICES_NOTICE)
        elif not probe.order_certain:  # never a silent guess of which GPU cuda:0 is
            self.notice.show_message(
                f"cuda:0 is shown as {probe.name} by PCI order, but CUDA numbers these different GPUs fastest "
                "first (CUDA_DEVICE_ORDER is not PCI_BUS_ID), so it may be another one: a run reports its own "
                "GPU and the NVML readings follow it. Set CUDA_DEVICE_ORDER=PCI_BUS_ID to be sure.", "warning",
                DEVICES_NOTICE)
        elif self.notice.topic() == DEVICES_NOTICE:
            self.notice.clear()  # what an earlier look at the devices said no longer holds
        self._on_device()
        return probe

    def device(self) -> str:
        data = self.device_combo.currentData()
        return data if data in ("cuda", "cpu") else "cpu"

    def set_device(self, device: str) -> bool:
        i = self.device_combo.findData(device)
        item = self.device_combo.model().item(i) if i >= 0 else None  # type: ignore[attr-defined]
        if item is None or not item.isEnabled():
            return False
        self.device_combo.setCurrentIndex(i)
        return True

    def _on_device(self, *_: object) -> None:
        cuda = self.device() == "cuda"
        self.tracked_check.setEnabled(cuda and not self.controller.running)

    def timeout_s(self) -> float:
        return round(self.timeout_spin.value() * 60, 1)

    # ---- running -----------------------------------------------------------------------------------------------------
    def start(self, fault: str | None = None, steps: int = 2) -> bool:
        """Profile the current setup on the chosen device. ``fault`` injects one of the child's fault
        scenarios (tests). Problems are shown in the view; returns whether a run started."""
        if self.controller.running:
            return False
        if self.notice.topic() == RUN_NOTICE:
            self.notice.clear()  # the last attempt's problem (new ones are shown below); not the devices' notice
        if not self._probed:
            self.refresh_devices()
        self.state.flush()
        spec = self.state.model.spec
        try:
            plan = plan_run(spec, self.state.candidate_setup(), self.device(), self.controller.probe(),
                            self.state.gpu, steps=steps, timeout_s=self.timeout_s(), fault=fault,
                            tracked=self.tracked_check.isChecked())
        except RunRefused as e:
            self.notice.show_message(str(e), "error", RUN_NOTICE)
            return False
        except SetupError as e:  # the fields make no setup
            self.notice.show_message(str(not_profilable(e)), "error", RUN_NOTICE)
            return False
        if plan.warning:
            self.notice.show_message(plan.warning, "warning", RUN_NOTICE)
        self._reset_run()
        return self.controller.start(plan.request)

    def _reset_run(self) -> None:
        self.buffer.clear()
        self.marks = []
        self.rank_marks = []
        self.memory = []
        self._outcome = None
        self._started_s = None
        self._end_s = None
        self._lost_at_s = None
        self.plots.clear()
        self._pacer.reset()
        self._forced = True
        self.result.clear()
        self.readout.setText("Waiting for the first readings…")

    @property
    def running(self) -> bool:
        return self.controller.running

    @property
    def outcome(self) -> ProfileOutcome | None:
        return self._outcome

    @property
    def request(self) -> RunRequest | None:
        return self._request

    @property
    def rows(self) -> list[ComparisonRow]:
        return list(self.result.rows)

    @property
    def lost_at_s(self) -> float | None:
        return self._lost_at_s

    # ---- controller signals (GUI thread) -------------------------------------------------------------------------
    def _on_running(self, running: bool) -> None:
        self.start_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        self.device_combo.setEnabled(not running)
        self.timeout_spin.setEnabled(not running)
        self._on_device()
        if running:
            self._timer.start()
        else:
            self._timer.stop()

    def _on_run_started(self, request: RunRequest) -> None:
        self._request = request
        self._t0 = self.controller.t0
        where = ("GPU " + (request.gpu.name if request.gpu else "cuda:0")) if request.device == "cuda" else "the CPU"
        self.summary.setText(f"Profiling on {where}: {setup_summary(request.spec, request.setup)}; "
                             f"{request.steps} training steps, timeout {request.timeout_s:g} s.")
        self.progress.setRange(0, request.phase_count)
        self.progress.setValue(0)
        self.progress.setFormat("Starting the profiling process (importing torch)…")

    def _on_child_started(self, started: RunStarted) -> None:
        self._started_s = started.t_s

    def _on_phase(self, mark: PhaseMark) -> None:
        if not mark.leads:  # a sharded run's other ranks: kept for the result, rank 0 draws the bands
            self.rank_marks.append(mark)
            return
        self.marks.append(mark)
        self._dirty = True
        self._forced = True
        done = phases_done(self.marks)
        total = self.progress.maximum()
        self.progress.setValue(min(done, total))
        if mark.key == "end":
            self.progress.setFormat(f"{done} / {total} phases · finishing")
        else:
            self.progress.setFormat(f"{done} / {total} phases · {band_label(mark.key, short=False).lower()}")

    def _on_memory(self, reading: AllocatorReading) -> None:
        if reading.leads:
            self.memory.append(reading)
            self._dirty = True
            self._pacer.observe("allocated_live", reading.allocated_bytes)
            self._pacer.observe("reserved_live", reading.reserved_bytes)

    def _on_sample(self, sample: LiveSample) -> None:
        self.buffer.append(sample)
        self._dirty = True
        for key in MEMORY_SERIES:
            self._pacer.observe(key, getattr(sample, key))
        if sample.gpu_lost and self._lost_at_s is None:
            self._lost_at_s = sample.t_s
            self.notice.show_message(
                f"NVML lost the GPU {sample.t_s:.1f} s into the run (GPU is lost / fell off the bus): device "
                "readings stopped. The run's own numbers still come from the profiling process.", "warning",
                RUN_NOTICE)

    def _now_s(self) -> float:
        if self._end_s is not None:
            return self._end_s
        return time.monotonic() - self._t0 if self._request is not None else 0.0

    @property
    def frame_reasons(self) -> dict[str, int]:
        """Frames drawn in this run by what made them due (core.live.FramePacer): event, peak, calm."""
        return dict(self._pacer.reasons)

    def _tick(self) -> None:
        """The timer (20 Hz while a run is on): draw a frame when the pacer says one is due."""
        if not self._dirty or not self.isVisible():
            return
        reason = self._pacer.due(time.monotonic(), self._forced)
        if reason is not None:
            self.redraw(reason)

    def redraw(self, reason: str = "event") -> None:
        """Draw the buffer and the phase marks now (the timer's tick calls this when a frame is due)."""
        if not self._dirty and not self.controller.running:
            return
        if not self.isVisible():  # another tab is showing: keep the readings, draw them when this one shows
            self._dirty = True
            return
        self._dirty = False
        r = self._request
        now = self._now_s()
        predicted = r.predicted if r is not None else None
        band_list = bands(self.marks, now, predicted, self._started_s)
        cpu = r is None or r.device != "cuda"
        capacity = None
        if r is not None and r.device == "cuda":
            capacity = (int(self.buffer.last("device_total_bytes") or 0) or
                        (r.gpu.memory_bytes if r.gpu else None))
        self.plots.redraw(self.buffer, self.marks, band_list, now, self.state.unit, cpu,
                          predicted.device_used_bytes if predicted is not None else None, capacity, self.memory)
        self._update_readout(now)
        latest: dict[str, float | None] = {k: self.buffer.last(k) for k in MEMORY_SERIES}
        if self.memory:
            latest.update(allocated_live=self.memory[-1].allocated_bytes, reserved_live=self.memory[-1].reserved_bytes)
        self._pacer.drawn(time.monotonic(), reason, latest)
        self._pacer.set_scale(*self.plots.memory_scale())
        self._forced = False

    def _update_readout(self, now: float) -> None:
        b = self.buffer
        if not len(b):
            return
        u = self.plots.unit
        parts = [f"t = {now:.1f} s"]
        used, total = b.last("device_used_bytes"), b.last("device_total_bytes")
        if used is not None:
            of = f" of {fmt_bytes(total, u)}" if total else ""
            parts.append(f"GPU used {fmt_bytes(used, u)}{of} (NVML, all processes)")
            mine = b.last("process_used_bytes")
            if mine is not None:
                parts.append(f"this run {fmt_bytes(mine, u)} (NVML)")
                if used - mine > 0:
                    parts.append(f"others {fmt_bytes(used - mine, u)}")
            util, power = b.last("util_pct"), b.last("power_w")
            if util is not None:
                parts.append(f"GPU {util:.0f} %")
            parts.append(f"{power:.0f} W" if power is not None else "power: not reported")
        elif self._lost_at_s is not None:
            parts.append("GPU readings lost")
        if self.marks:
            m = self.marks[-1]
            parts.append(f"tensors {fmt_auto(m.allocated_bytes)} at the last phase boundary")
        rss, cpu = b.last("rss_bytes"), b.last("cpu_pct")
        if rss is not None:
            parts.append(f"RSS {fmt_auto(rss)} (host)")
        if cpu is not None:
            parts.append(f"CPU {cpu:.0f} % of the machine")
        self.readout.setText(("Now · " if self.controller.running else "Last reading · ") + " · ".join(parts))

    def _on_finished(self, outcome: ProfileOutcome) -> None:
        self._outcome = outcome
        self._end_s = time.monotonic() - self._t0
        try:
            self._dirty = True
            self.redraw()
            self.plots.fit_x(self._end_s)
            self.show_outcome(outcome)
        except Exception as e:  # showing a result must never take the window down
            log.exception("showing the profile outcome failed")
            self.result.set_verdict("nofit", f"The run ended ({outcome.kind}) but its result could not be shown: "
                                       f"{type(e).__name__}: {e}")
        _kind, text = outcome_message(outcome, self.state.unit, self._request.timeout_s if self._request else None)
        self.message.emit(text)

    # ---- the result -------------------------------------------------------------------------------------------------
    def show_outcome(self, outcome: ProfileOutcome, request: RunRequest | None = None) -> None:
        """Fill the result panel for ``outcome`` (of ``request``, default: the last run)."""
        if request is not None:
            self._request = request
        self._outcome = outcome
        total = self.progress.maximum()
        done = phases_done(self.marks)
        if outcome.ok:
            self.progress.setValue(total)
            self.progress.setFormat(f"{total} / {total} phases · done")
        else:
            self.progress.setValue(min(done, total))
            self.progress.setFormat(f"{min(done, total)} / {total} phases · {outcome.kind}")
        self.result.show_outcome(outcome, self._request, self.state.unit, self._lost_at_s,
                                 self.buffer.max("rss_bytes"))

    def verdict_text(self) -> str:
        return self.result.verdict_text()

    def _on_state_computed(self, _snapshot: object) -> None:
        """The unit may have changed: re-show the result (verdict, table, facts) and the plots in it."""
        unit = self.state.unit
        if unit == self._shown_unit:
            return
        self._shown_unit = unit
        self._dirty = True
        if self._outcome is not None and not self.controller.running:
            self.show_outcome(self._outcome)
        elif self.result.rows:
            self.result.fill_table(unit)
        self.redraw()

    # ---- saving and exporting ---------------------------------------------------------------------------------------
    def _ask_path(self, title: str, name: str, filt: str, suffix: str) -> str | None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, title, str(Path(self._dir) / name), filt)
        if not path:
            return None
        return path if path.lower().endswith(suffix) else path + suffix

    def save_dialog(self) -> None:
        path = self._ask_path("Save profile result", "vram-profile.json", "Profile result (*.json)", ".json")
        if path:
            self.save_result(path)

    def export_dialog(self, fmt: str) -> None:
        if fmt == "csv":
            path = self._ask_path("Export table", "vram-profile.csv", "CSV (*.csv)", ".csv")
            if path:
                self.export_csv(path)
        else:
            path = self._ask_path("Export plots", "vram-profile.png", "PNG at 2x (*.png)", ".png")
            if path:
                self.export_png(path)

    def result_document(self) -> dict | None:
        if self._outcome is None or self._request is None:
            return None
        return result_document(self._request, self._outcome, self.controller.probe(), self.marks, self.buffer,
                               self._lost_at_s)

    def _done(self, path: str, what: str) -> None:
        self._dir = str(Path(path).parent)
        self.message.emit(f"Saved {what} to {path}")

    def _failed(self, path: str, e: OSError) -> None:
        self.notice.show_message(f"Could not write {Path(path).name}: {e.strerror or e}", "error", RUN_NOTICE)

    def save_result(self, path: str) -> bool:
        doc = self.result_document()
        if doc is None:
            return False
        try:
            write_text(path, json.dumps(doc, indent=1))
        except OSError as e:
            self._failed(path, e)
            return False
        self._done(path, "the profile result")
        return True

    def export_csv(self, path: str) -> bool:
        if not self.result.rows:
            return False
        headers, cells = rows_table(self.result.rows, self.state.unit, for_csv=True)
        try:
            write_text(path, to_csv(headers, cells))
        except OSError as e:
            self._failed(path, e)
            return False
        self._done(path, "the table")
        return True

    def export_png(self, path: str) -> bool:
        try:
            save_png(self.plots, path, background=self._theme.chart_bg)
        except OSError as e:
            self._failed(path, e)
            return False
        self._done(path, "the plots")
        return True

    def shutdown(self) -> None:
        """Window closing: wait for a calibration being saved (the run itself is the controller's)."""
        self._calibrator.shutdown()

    def save_calibration(self) -> bool:
        """Save the measured context and allocator slack for this GPU (CUDA runs only). The step's allocator
        replay runs on a worker thread; the notice says where it was saved. Returns whether it started."""
        o, r = self._outcome, self._request
        if o is None or r is None or self._calibrator.running:
            return False
        from vramlab.core.calibration import save
        from vramlab.core.profile_calibration import from_outcome

        driver = self.controller.probe().driver_version or ""

        def job(_worker: Any) -> tuple[Any, Any]:
            cal = from_outcome(r.spec, r.setup, r.gpu, o, driver=driver)
            return (cal, save(cal)) if cal is not None else (None, None)

        self.calibrate_button.setEnabled(False)
        return self._calibrator.start(job)

    @QtCore.Slot(object)
    def _on_calibrated(self, saved: Any) -> None:
        cal, path = saved
        if cal is None:
            return
        self.notice.show_message(f"Saved {cal.label} to {path}: new estimates for this GPU use the measured CUDA "
                                 f"context ({fmt_bytes(cal.context_bytes)}) and allocator slack.", "info")
        self.message.emit(f"Saved {cal.label}.")

    @QtCore.Slot(object)
    def _on_calibration_failed(self, e: Any) -> None:
        self.notice.show_message(f"Could not save the calibration: {e}", "error", RUN_NOTICE)
