"""The live profile's two plots, redrawn from a ring buffer on the view's timer (never per sample).

*Memory* (top): device used by the whole GPU and by this run's process (NVML, the device level), the
child's resident memory on the host (psutil), the allocator's readings at every phase boundary (tensor and
reserved levels), and per phase band the predicted (dashed) and measured (solid) tensor peak. Horizontal
lines mark the predicted device level and the GPU's memory.

*Activity* (bottom): GPU utilisation and the run's CPU share in % (left axis), GPU power in W (right axis).

The x axis is seconds since Start. Every curve says in the legend (and its tooltip) which memory level it
is. Curves use pyqtgraph's peak downsampling and clip-to-view, so an hour at 20 Hz redraws cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vramlab.app.qt import QtCore, QtGui, QtWidgets, pg
from vramlab.app.theme import Theme
from vramlab.app.views.legend import FlowLayout
from vramlab.core.live import AllocatorReading, Band, PhaseMark, RingBuffer, display_unit
from vramlab.core.units import Unit, fmt_bytes

Dash = QtCore.Qt.PenStyle


@dataclass(frozen=True)
class CurveStyle:
    key: str
    label: str
    color: str  # '' = the theme's foreground
    description: str
    width: float = 2.0
    style: Dash = Dash.SolidLine
    symbol: str | None = None


MEMORY_CURVES: tuple[CurveStyle, ...] = (
    CurveStyle("device_used", "GPU used, all processes (NVML · device)", "#8A93A3",
               "Device level: memory used on the whole GPU as nvidia-smi shows it (every process), read by NVML "
               "at 20 Hz.", 1.0),
    CurveStyle("process_used", "This run on the GPU (NVML · device)", "#1F5FBF",
               "Device level: the profiling process's own memory on the GPU (CUDA context, allocator pools, "
               "library workspaces), from NVML's per-process accounting.", 2.4),
    CurveStyle("rss", "Process RSS (host · psutil)", "#009E73",
               "Host memory: the profiling process's resident set (torch itself, the model and, on the CPU, the "
               "tensors), read by psutil at 20 Hz. Not a GPU level.", 1.8),
    CurveStyle("allocated_live", "Tensors (allocated · 10 Hz)", "",
               "Tensor level over time: torch.cuda.memory_allocated (CPU: the tracker's live bytes), read by the "
               "profiling process itself 10 times a second.", 1.4),
    CurveStyle("reserved_live", "Reserved (allocator · 10 Hz)", "#1F5FBF",
               "Allocator-reserved level over time: torch.cuda.memory_reserved, read by the profiling process 10 "
               "times a second.", 1.4, Dash.DotLine),
    CurveStyle("allocated", "Tensors at phase boundaries (allocated)", "",
               "Tensor level: torch's allocated bytes (CPU: the tracker's live bytes) at the moment each phase "
               "began.", 0, Dash.SolidLine, "o"),
    CurveStyle("reserved", "Reserved at phase boundaries (allocator)", "#1F5FBF",
               "Allocator-reserved level: torch.cuda.memory_reserved at the moment each phase began.", 0,
               Dash.SolidLine, "t1"),
    CurveStyle("measured_peak", "Measured phase peak (tensors)", "",
               "Tensor level: the highest allocated bytes within each phase (max_memory_allocated, reset at every "
               "phase boundary; CPU: the tracker).", 3.0),
    CurveStyle("predicted_peak", "Predicted phase peak (tensors · estimate)", "#D55E00",
               "Tensor level: the estimate's peak for the same phase, drawn over the phase's band.", 2.2,
               Dash.DashLine),
)

ACTIVITY_CURVES: tuple[CurveStyle, ...] = (
    CurveStyle("util", "GPU utilisation [%] (NVML)", "#56B4E9",
               "Share of time a kernel ran on the GPU in the last sample period (left axis).", 1.0),
    CurveStyle("cpu", "Run's CPU share [%] (psutil)", "#44AA99",
               "The profiling process's CPU time as a share of all cores of this machine (left axis).", 1.0),
    CurveStyle("power", "GPU power [W] (NVML)", "#D55E00",
               "Board power draw in watts (right axis).", 1.0, Dash.DashLine),
)

# The memory plot's top grows in steps while a run is on (like the time axis): a change of range repaints
# both plots and their axes, twice (pyqtgraph applies the new transform during the paint), the costliest
# frames there are. It is fitted to the data again when the run ends.
Y_GROWTH = 1.15
Y_SHRINK = 0.6

DENSE = frozenset({"device_used", "process_used", "rss", "util", "cpu", "power"})  # one point per sample
# Pens of those curves: one pixel wide where the curve is background (the whole GPU) or noisy (the activity
# plot): Qt's raster engine draws one-pixel lines on a fast path and strokes wider ones, which made those
# four curves about a third of a frame's paint time (benchmarks/sampling.py).
PHASE_TINTS = {"start": (128, 128, 128), "load": (128, 128, 128), "forward": (31, 95, 191),
               "backward": (213, 94, 0), "optimizer": (0, 158, 115)}


class LineSample(QtWidgets.QWidget):
    """A legend sample: the curve's pen (and symbol) as drawn."""

    def __init__(self, style: CurveStyle, color: str, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self._style = style
        self._color = QtGui.QColor(color)
        self.setFixedSize(26, 12)

    def paintEvent(self, event: QtGui.QPaintEvent) -> None:  # noqa: N802
        p = QtGui.QPainter(self)
        p.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
        y = self.height() / 2
        if self._style.width > 0:
            pen = QtGui.QPen(self._color, self._style.width)
            pen.setStyle(self._style.style)
            p.setPen(pen)
            p.drawLine(QtCore.QPointF(1, y), QtCore.QPointF(self.width() - 1, y))
        if self._style.symbol:
            p.setPen(QtGui.QPen(self._color, 1))
            p.setBrush(self._color)
            c = QtCore.QPointF(self.width() / 2, y)
            if self._style.symbol == "o":
                p.drawEllipse(c, 3.5, 3.5)
            else:
                p.drawPolygon(QtGui.QPolygonF([c + QtCore.QPointF(-4, -3), c + QtCore.QPointF(4, -3),
                                               c + QtCore.QPointF(0, 4)]))
        p.end()


class LineLegend(QtWidgets.QWidget):
    """A reflowing legend of line samples; rebuilt only when the set of shown curves changes."""

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self._layout = FlowLayout(self, spacing=6)
        self._layout.setContentsMargins(4, 0, 4, 0)
        self._shown: tuple[tuple[str, str], ...] = ()
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Preferred, QtWidgets.QSizePolicy.Policy.Minimum)

    def labels(self) -> list[str]:
        return [label for label, _ in self._shown]

    def set_entries(self, entries: Sequence[tuple[CurveStyle, str]]) -> None:
        shown = tuple((s.label, color) for s, color in entries)
        if shown == self._shown:
            return
        self._shown = shown
        while self._layout.count():
            item = self._layout.takeAt(0)
            if item is not None and item.widget() is not None:
                old = item.widget()
                old.hide()
                old.deleteLater()
        for style, color in entries:
            box = QtWidgets.QWidget(self)
            row = QtWidgets.QHBoxLayout(box)
            row.setContentsMargins(0, 0, 0, 0)
            row.setSpacing(4)
            row.addWidget(LineSample(style, color, box))
            label = QtWidgets.QLabel(style.label, box)
            row.addWidget(label)
            box.setToolTip(f"<b>{style.label}</b><br>{style.description}")
            box.setObjectName(f"legend:{style.key}")
            self._layout.addWidget(box)
        self._layout.invalidate()
        self.updateGeometry()


class LivePlots(QtWidgets.QWidget):
    """Both plots and their legend. ``redraw`` takes everything it shows; nothing is kept but the items."""

    def __init__(self, theme: Theme, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self._theme = theme
        self._follow = True
        self._has_power = False
        self._unit = Unit.GIB
        self._cpu_run = False  # the activity axis shows the run's CPU share, not GPU utilisation
        self._font = QtGui.QFont()
        self._font.setPointSizeF(9.0)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        self.canvas = pg.GraphicsLayoutWidget(self)
        # no cached background pixmap: PNG/SVG export paints the live scene
        self.canvas.setCacheMode(QtWidgets.QGraphicsView.CacheModeFlag.CacheNone)
        self.memory = self.canvas.addPlot(row=0, col=0)
        self.activity = self.canvas.addPlot(row=1, col=0)
        self.canvas.ci.layout.setRowStretchFactor(0, 3)
        self.canvas.ci.layout.setRowStretchFactor(1, 1)
        self.activity.setXLink(self.memory)
        for plot in (self.memory, self.activity):
            plot.hideButtons()
            plot.setMenuEnabled(False)
            plot.setMouseEnabled(x=True, y=False)
            plot.setClipToView(True)
            plot.setDownsampling(auto=True, mode="peak")
            plot.getAxis("left").enableAutoSIPrefix(False)
            plot.getAxis("left").setWidth(64)
            for name in ("left", "bottom"):
                plot.getAxis(name).setTickFont(self._font)
            plot.vb.sigRangeChangedManually.connect(self._stop_following)
        self.memory.getAxis("bottom").setStyle(showValues=False)
        self.memory.showAxis("right")  # empty, as wide as the power axis below: both plots share their x pixels
        self.memory.getAxis("right").setStyle(showValues=False)
        self.memory.getAxis("right").setWidth(56)
        self.activity.setLabel("bottom", "Time since Start [s]")
        self.activity.setYRange(0, 105, padding=0)

        # power on a right-hand axis of the activity plot (pyqtgraph's MultiplePlotAxes pattern)
        self.power_vb = pg.ViewBox()
        self.power_vb.setMouseEnabled(x=False, y=False)
        self.activity.showAxis("right")
        self.activity.scene().addItem(self.power_vb)
        self.activity.getAxis("right").linkToView(self.power_vb)
        self.activity.getAxis("right").setWidth(56)
        self.activity.getAxis("right").setTickFont(self._font)
        self.power_vb.setXLink(self.activity)
        self.activity.vb.sigResized.connect(self._sync_power_view)

        # Horizontal grid lines at the major ticks as one path per plot: pyqtgraph's axis grid costs more to
        # paint than every curve together, at 20 frames a second that matters (benchmarks/sampling.py).
        self.grids: dict[str, pg.PlotCurveItem] = {}
        for name, plot in (("memory", self.memory), ("activity", self.activity)):
            grid = pg.PlotCurveItem(connect="pairs", antialias=False)
            grid.setZValue(-8)  # above the (opaque) phase bands, below everything else
            plot.addItem(grid, ignoreBounds=True)
            self.grids[name] = grid
            plot.vb.sigRangeChanged.connect(lambda *_a, n=name: self._update_grid(n))
        self.bands_group: list[tuple[pg.LinearRegionItem, pg.TextItem]] = []
        self._label_widths: dict[str, int] = {}
        self._shown: tuple[str, ...] = ()
        self._band_state: list[tuple] = []
        self._marks_key: tuple = ()
        self._peaks_key: tuple = ()
        self._memory_key: tuple = ()
        self._series_key: tuple = ()
        self._x_max = 0.0
        self._y_top = 0.0
        self._y_fit = 0.0  # the top that fits the data exactly
        self._bands: list[Band] = []  # as last drawn
        self._ended_s: float | None = None
        self.curves: dict[str, pg.PlotDataItem] = {}
        for style in MEMORY_CURVES:
            item = pg.PlotDataItem(connect="pairs" if style.key.endswith("_peak") else "finite")
            item.setZValue(5 if style.key.endswith("_peak") else 3)
            self.memory.addItem(item)
            self.curves[style.key] = item
        for style in ACTIVITY_CURVES:
            item = pg.PlotDataItem(connect="finite")
            (self.power_vb if style.key == "power" else self.activity).addItem(item)
            self.curves[style.key] = item
        for key, item in self.curves.items():
            item.setDownsampling(auto=True, method="peak")
            item.setClipToView(True)
            if key in DENSE:  # thousands of points: antialiasing them is most of their paint time
                item.setData([], [], antialias=False)
        self.lines = {
            "capacity": pg.InfiniteLine(angle=0, movable=False, label="",
                                        labelOpts={"position": 0.985, "anchors": [(1, 1), (1, 1)], "movable": False}),
            "predicted_device": pg.InfiniteLine(angle=0, movable=False, label="",
                                                labelOpts={"position": 0.015, "anchors": [(0, 1), (0, 1)],
                                                           "movable": False}),
        }
        for line in self.lines.values():
            line.setVisible(False)
            line.setZValue(8)
            self.memory.addItem(line, ignoreBounds=True)
        layout.addWidget(self.canvas, 1)
        self.legend = LineLegend(self)
        layout.addWidget(self.legend)
        self.apply_theme(theme)
        self.clear()

    # ---- theme -------------------------------------------------------------------------------------------------
    def _color(self, style: CurveStyle) -> str:
        return style.color or self._theme.chart_fg

    def apply_theme(self, theme: Theme) -> None:
        self._theme = theme
        self.canvas.setBackground(theme.chart_bg)
        for plot in (self.memory, self.activity):
            for name in ("left", "bottom", "right"):
                axis = plot.getAxis(name)
                axis.setPen(pg.mkPen(theme.chart_fg, width=1))
                axis.setTextPen(pg.mkPen(theme.chart_fg))
                if axis.labelText:
                    axis.setLabel(axis.labelText, units=None, color=theme.chart_fg, **{"font-size": "10pt"})
        for style in (*MEMORY_CURVES, *ACTIVITY_CURVES):
            item = self.curves[style.key]
            color = self._color(style)
            if style.width > 0:
                item.setPen(pg.mkPen(color, width=style.width, style=style.style))
            else:
                item.setPen(None)
            if style.symbol:
                item.setSymbol(style.symbol)
                item.setSymbolSize(8)
                item.setSymbolBrush(pg.mkBrush(color))
                item.setSymbolPen(pg.mkPen(theme.chart_bg, width=1))
        cap, pred = self.lines["capacity"], self.lines["predicted_device"]
        cap.setPen(pg.mkPen(theme.capacity, width=2.0, style=Dash.DashLine))
        cap.label.setColor(theme.capacity)
        pred.setPen(pg.mkPen("#D55E00", width=1.4, style=Dash.DotLine))
        pred.label.setColor("#D55E00")
        for line in (cap, pred):
            line.label.setFont(self._font)
        for _region, text in self.bands_group:
            text.setColor(theme.muted)
        grid = QtGui.QColor(theme.border)
        if not theme.dark:
            grid = grid.lighter(112)
        for item in self.grids.values():
            item.setPen(pg.mkPen(grid, width=1))
        self._band_state = []  # re-tint the bands
        self._set_labels()
        self._update_legend(force=True)

    def _set_labels(self) -> None:
        fg = self._theme.chart_fg
        style = {"color": fg, "font-size": "10pt"}
        self.memory.setLabel("left", f"Memory [{self._unit.value}]", **style)
        self.activity.setLabel("left", "CPU [%]" if self._cpu_run else "Util. [%]", **style)
        self.activity.setLabel("right", "Power [W]" if self._has_power else "", **style)
        right = self.activity.getAxis("right")
        right.setStyle(showValues=self._has_power, tickLength=5 if self._has_power else 0)
        right.setPen(pg.mkPen(fg if self._has_power else self._theme.chart_bg, width=1))
        spacer = self.memory.getAxis("right")  # keeps the plots' x pixels aligned; draws nothing
        spacer.setStyle(showValues=False, tickLength=0)
        spacer.setPen(pg.mkPen(self._theme.chart_bg, width=1))
        self.activity.setLabel("bottom", "Time since Start [s]", **style)

    def _sync_power_view(self) -> None:
        self.power_vb.setGeometry(self.activity.vb.sceneBoundingRect())
        self.power_vb.linkedViewChanged(self.activity.vb, self.power_vb.XAxis)

    def _update_grid(self, name: str) -> None:
        plot = self.memory if name == "memory" else self.activity
        (x0, x1), (y0, y1) = plot.vb.viewRange()
        axis = plot.getAxis("left")
        levels = axis.tickValues(y0, y1, max(1.0, plot.vb.height()))
        ys = [v for v in (levels[0][1] if levels else []) if y0 < v < y1]
        xs = np.tile([x0, x1], len(ys))
        self.grids[name].setData(xs, np.repeat(ys, 2))

    def _stop_following(self, *_: object) -> None:
        self._follow = False

    def fit_x(self, end_s: float) -> None:
        """The run ended at ``end_s``: from now on show all of it, 0 to ``end_s`` (unless the user zoomed)."""
        self._ended_s = end_s if end_s > 0 else None
        if self._follow and self._ended_s is not None:
            self._x_max = self._ended_s * 1.02
            self.memory.setXRange(0, self._x_max, padding=0)
            if self._y_fit > 0:
                self._y_top = self._y_fit
                self.memory.setYRange(0, self._y_top, padding=0)
                self._draw_bands(self._bands, self._y_top)  # their labels sit at the top

    def follow(self) -> None:
        """Track the newest data again (a new run, or the user's 'reset zoom')."""
        self._follow = True

    # ---- data ------------------------------------------------------------------------------------------------------
    @property
    def unit(self) -> Unit:
        return self._unit

    def clear(self) -> None:
        for item in self.curves.values():
            item.setData([], [])
        for line in self.lines.values():
            line.setVisible(False)
        for region, text in self.bands_group:
            region.setVisible(False)
            text.setVisible(False)
        self._follow = True
        self._ended_s = None
        self._band_state = []
        self._marks_key = ()
        self._peaks_key = ()
        self._memory_key = ()
        self._series_key = ()
        self._x_max = 0.0
        self._y_top = 0.0
        self._y_fit = 0.0
        self.memory.setXRange(0, 10, padding=0)
        self.memory.setYRange(0, 1, padding=0)
        self.power_vb.setYRange(0, 1, padding=0)
        self._update_legend()

    def redraw(self, buffer: RingBuffer, marks: Sequence[PhaseMark], bands: Sequence[Band], now_s: float,
               unit: Unit, cpu_run: bool, predicted_device_bytes: int | None = None,
               capacity_bytes: int | None = None, memory: Sequence[AllocatorReading] = ()) -> None:
        """Draw everything from the buffer and the marks (bytes in; the axis unit is chosen here). Items whose
        data did not change since the last call are left alone, and the x range grows in steps, so a frame
        repaints as little as it can."""
        t = buffer.column("t_s")
        series = {
            "device_used": buffer.column("device_used_bytes"),
            "process_used": buffer.column("process_used_bytes"),
            "rss": buffer.column("rss_bytes"),
        }
        peaks = [b.predicted_bytes or 0 for b in bands] + [b.measured_bytes or 0 for b in bands]
        peaks += [m.allocated_bytes for m in marks] + [m.reserved_bytes for m in marks]
        peaks += [r.reserved_bytes for r in memory]
        highest = (buffer.max(name) for name in ("device_used_bytes", "process_used_bytes", "rss_bytes"))
        data_max = max([0.0, *peaks, *(v for v in highest if v is not None)])
        if predicted_device_bytes and not cpu_run:
            data_max = max(data_max, float(predicted_device_bytes))
        unit = display_unit(data_max, unit)
        if unit is not self._unit or cpu_run != self._cpu_run:
            self._unit = unit
            self._cpu_run = cpu_run
            self._set_labels()
            self._marks_key = ()
            self._peaks_key = ()
            self._memory_key = ()
            self._series_key = ()
        f = float(unit.factor)

        series_key = (len(buffer), float(t[-1]) if len(t) else None, unit)
        if series_key != self._series_key:
            self._series_key = series_key
            for key, values in series.items():
                self._set_series(key, t, values / f)
            self._set_series("util", t, buffer.column("util_pct"))
            self._set_series("cpu", t, buffer.column("cpu_pct"))
            power = buffer.column("power_w")
            has_power = self._set_series("power", t, power)
            if has_power:
                self.power_vb.setYRange(0, max((buffer.max("power_w") or 1.0) * 1.1, 1.0), padding=0)
            if has_power != self._has_power:
                self._has_power = has_power
                self._set_labels()

        memory_key = (len(memory), cpu_run, unit)
        if memory_key != self._memory_key:
            self._memory_key = memory_key
            rt = np.array([r.t_s for r in memory])
            self.curves["allocated_live"].setData(rt, np.array([r.allocated_bytes for r in memory], dtype=float) / f)
            if cpu_run:  # no caching allocator on the CPU: reserved is the tensor level
                self.curves["reserved_live"].setData([], [])
            else:
                self.curves["reserved_live"].setData(rt, np.array([r.reserved_bytes for r in memory], dtype=float) / f)

        marks_key = (len(marks), cpu_run, unit)
        if marks_key != self._marks_key:
            self._marks_key = marks_key
            ordered = [m for m in marks if m.key != "end"] + [m for m in marks if m.key == "end"]
            mt = np.array([m.t_s for m in ordered])
            self.curves["allocated"].setData(mt, np.array([m.allocated_bytes for m in ordered], dtype=float) / f)
            if cpu_run:
                self.curves["reserved"].setData([], [])
            else:
                self.curves["reserved"].setData(mt, np.array([m.reserved_bytes for m in ordered], dtype=float) / f)
        peaks_key = (unit, tuple((b.t1_s, b.measured_bytes, b.predicted_bytes) for b in bands))
        if peaks_key != self._peaks_key:  # the running phase's predicted peak grows with it
            self._peaks_key = peaks_key
            for key, attr in (("measured_peak", "measured_bytes"), ("predicted_peak", "predicted_bytes")):
                xs: list[float] = []
                ys: list[float] = []
                for b in bands:
                    v = getattr(b, attr)
                    if v is not None:
                        xs += [b.t0_s, b.t1_s]
                        ys += [v / f, v / f]
                self.curves[key].setData(xs, ys)

        y_top = max(data_max / f * 1.12, 1e-9)
        cap, pred = self.lines["capacity"], self.lines["predicted_device"]
        if capacity_bytes and not cpu_run:
            show = capacity_bytes / f <= y_top * 1.6
            if show:
                y_top = max(y_top, capacity_bytes / f * 1.05)
            self._set_line(cap, capacity_bytes / f, f"GPU memory {fmt_bytes(capacity_bytes, unit)}", show)
        else:
            cap.setVisible(False)
        if predicted_device_bytes and not cpu_run:
            self._set_line(pred, predicted_device_bytes / f,
                           f"Predicted device used (estimate) {fmt_bytes(predicted_device_bytes, unit)}", True)
        else:
            pred.setVisible(False)

        if self._follow:
            if self._ended_s is not None:
                if self._x_max != self._ended_s * 1.02:
                    self._x_max = self._ended_s * 1.02
                    self.memory.setXRange(0, self._x_max, padding=0)
            elif now_s > self._x_max * 0.97 or self._x_max == 0.0:
                self._x_max = max(10.0, now_s * 1.25)  # grows in steps of a quarter: the axis rarely moves
                self.memory.setXRange(0, self._x_max, padding=0)
            self._y_fit = y_top
            if self._ended_s is not None:  # the run is over: fit the data
                refit = not (y_top * 0.999 <= self._y_top <= y_top * 1.001)
            else:  # steps, as the time axis: a new range repaints the axes
                refit = y_top > self._y_top or y_top < self._y_top * Y_SHRINK
            if refit:
                self._y_top = y_top * Y_GROWTH if self._ended_s is None else y_top
                self.memory.setYRange(0, self._y_top, padding=0)
        self._bands = list(bands)
        self._draw_bands(bands, self.memory.vb.viewRange()[1][1])
        self._update_legend()
        self._apply_ranges()

    def _apply_ranges(self) -> None:
        """Apply a changed range now rather than during the paint: pyqtgraph moves the items to a new range
        as it paints, and each moved item asks for a second paint of both plots."""
        for vb in (self.memory.vb, self.activity.vb, self.power_vb):
            vb.prepareForPaint()

    def memory_scale(self) -> tuple[float, float]:
        """(bytes per pixel, bytes at the top) of the memory plot as last drawn: what a reading must change by
        to move on screen (core.live.FramePacer)."""
        (_x0, _x1), (y0, y1) = self.memory.vb.viewRange()
        f = float(self._unit.factor)
        return (y1 - y0) * f / max(1.0, self.memory.vb.height()), y1 * f

    def _set_series(self, key: str, t: np.ndarray, values: np.ndarray) -> bool:
        if values.size and np.any(np.isfinite(values)):
            self.curves[key].setData(t, values)
            return True
        if self.curves[key].xData is not None and len(self.curves[key].xData):
            self.curves[key].setData([], [])
        return False

    @staticmethod
    def _set_line(line: pg.InfiniteLine, value: float, label: str, visible: bool) -> None:
        if line.value() != value:
            line.setValue(value)
        if line.label.format != label:
            line.label.setFormat(label)
        if line.isVisible() != visible:
            line.setVisible(visible)

    def _draw_bands(self, bands: Sequence[Band], y_top: float) -> None:
        while len(self.bands_group) < len(bands):
            region = pg.LinearRegionItem(values=(0, 1), movable=False, orientation="vertical")
            region.setZValue(-10)
            for line in region.lines:
                line.setPen(pg.mkPen(None))
                line.setHoverPen(pg.mkPen(None))
            text = pg.TextItem("", color=self._theme.muted, anchor=(0, 0))
            text.setFont(self._font)
            text.setZValue(-5)
            self.memory.addItem(region, ignoreBounds=True)
            self.memory.addItem(text, ignoreBounds=True)
            self.bands_group.append((region, text))
        (x0, x1), _y = self.memory.vb.viewRange()
        x_per_px = (x1 - x0) / max(1.0, self.memory.vb.width())
        state = [(b.key, b.t0_s, b.t1_s, y_top, x_per_px, b.done) for b in bands]
        if state == self._band_state:
            return
        label_end = -np.inf  # a label that would overlap the previous one is left out (the band keeps its tooltip)
        for i, (region, text) in enumerate(self.bands_group):
            if i >= len(bands):
                region.setVisible(False)
                text.setVisible(False)
                continue
            b = bands[i]
            fits = b.t0_s >= label_end
            if fits:
                label_end = b.t0_s + (self._label_width(b.label) + 8) * x_per_px
            same = i < len(self._band_state) and region.isVisible() and text.isVisible() == fits
            if same and self._band_state[i] == state[i]:
                continue
            if same and self._band_state[i][:2] == state[i][:2] and self._band_state[i][3:] == state[i][3:]:
                region.setRegion((b.t0_s, b.t1_s))  # the running phase grew: only its right edge moves
                continue
            tint = self._tint(b.key.split("@")[0], 16 if i % 2 else 30)
            region.setBrush(pg.mkBrush(tint))
            region.setHoverBrush(pg.mkBrush(tint.darker(106) if not self._theme.dark else tint.lighter(115)))
            region.setRegion((b.t0_s, b.t1_s))
            span = f"{b.t0_s:.2f}–{b.t1_s:.2f} s" if b.done else f"from {b.t0_s:.2f} s"  # running: no per-frame text
            region.setToolTip(f"{b.label}: {span}")
            region.setVisible(True)
            text.setText(b.label)
            text.setPos(b.t0_s, y_top)
            text.setVisible(fits)
        self._band_state = state

    def _label_width(self, text: str) -> int:
        width = self._label_widths.get(text)
        if width is None:
            width = self._label_widths[text] = QtGui.QFontMetrics(self._font).horizontalAdvance(text)
        return width

    def _tint(self, phase: str, alpha: int) -> QtGui.QColor:
        """The phase colour at ``alpha`` over the chart background, as an opaque colour: filling opaque
        rectangles is far cheaper than blending translucent ones, and the bands lie under everything."""
        r, g, b = PHASE_TINTS.get(phase, (128, 128, 128))
        bg = QtGui.QColor(self._theme.chart_bg)
        a = alpha / 255
        return QtGui.QColor(round(bg.red() + (r - bg.red()) * a), round(bg.green() + (g - bg.green()) * a),
                            round(bg.blue() + (b - bg.blue()) * a))

    def _update_legend(self, force: bool = False) -> None:
        styles = [s for s in (*MEMORY_CURVES, *ACTIVITY_CURVES)
                  if self.curves[s.key].xData is not None and len(self.curves[s.key].xData)]
        keys = tuple(s.key for s in styles)
        if keys != self._shown or force:
            self._shown = keys
            self.legend.set_entries([(s, self._color(s)) for s in styles])

    # ---- reading back (tests) -----------------------------------------------------------------------------------
    def curve_data(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """The data given to a curve (in the axis unit), before downsampling and clipping."""
        item = self.curves[key]
        x, y = item.xData, item.yData
        return (np.asarray(x if x is not None else []), np.asarray(y if y is not None else []))

    def visible_bands(self) -> list[tuple[str, tuple[float, float]]]:
        """(label, (t0, t1)) of every band drawn (its label may be left out where it would overlap)."""
        return [(text.toPlainText(), tuple(region.getRegion())) for region, text in self.bands_group
                if region.isVisible()]
