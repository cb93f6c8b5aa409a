"""Trade-off sweeps: memory against one setting (sequence length, micro batch, LoRA rank, trainable layers,
weight storage), with the trainable parameter count underneath.

The numbers are :func:`vramlab.core.advisor.sweep`'s: one :class:`~vramlab.core.result.MemoryResult` per
value. This module only picks the memory level to draw, places the values on the x axis and formats.
The upper plot shows memory at the window's level (Ctrl+1/2/3) with the GPU's capacity as a dashed line;
a filled point fits the GPU at the device level, a hollow one does not. The lower plot shares the x axis
and shows the trainable parameters on a log scale, so "quantization vs trainable parameters", "depth vs
memory" and "rank vs size" read off one chart. Hovering either plot shows every level of the nearest
point in exact bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

import numpy as np

from vramlab.app.qt import QtCore, QtGui, QtWidgets, pg
from vramlab.app.theme import Theme
from vramlab.core.advisor import SWEEPS, Sweep, sweep_values
from vramlab.core.report import capacity_label
from vramlab.core.result import MemLevel
from vramlab.core.spec.options import DType, Method
from vramlab.core.units import Unit, fmt_bytes, fmt_count, to_unit

# field -> (label for people, axis scale: 'log2' | 'linear' | 'category')
SWEEP_FIELDS: dict[str, tuple[str, str]] = {
    "seq_len": ("Sequence length (tokens)", "log2"),
    "micro_batch": ("Micro batch (sequences per GPU)", "log2"),
    "lora_rank": ("LoRA rank", "log2"),
    "trainable_layers": ("Trainable layers (last N, rest frozen)", "linear"),
    "weights": ("Weight storage (quantization)", "category"),
}
SWEEP_NOUNS = {"seq_len": "sequence length", "micro_batch": "micro batch", "lora_rank": "LoRA rank",
               "trainable_layers": "trainable layers", "weights": "weight storage"}
assert tuple(SWEEP_FIELDS) == SWEEPS

LEVEL_NAMES = {MemLevel.ALLOCATED: "Tensor peak", MemLevel.RESERVED: "Allocator reserved",
               MemLevel.DEVICE: "Device used"}


def value_text(field: str, value: Any) -> str:
    if field == "weights":
        return DType(value).value
    return f"{int(value):,}"


def tick_text(field: str, value: Any) -> str:
    if field == "weights":
        return DType(value).value
    v = int(value)
    if field == "seq_len" and v >= 1024 and v % 1024 == 0:
        return f"{v // 1024}k"
    return str(v)


def sweep_label(data: Sweep) -> str:
    return SWEEP_FIELDS[data.field][0]


def sweep_x(data: Sweep, value: Any) -> float:
    """Where ``value`` sits on the x axis: its index (categories), log2 or itself, by the field's scale."""
    scale = SWEEP_FIELDS[data.field][1]
    if scale == "category":
        return float([p.value for p in data.points].index(value))
    if scale == "log2":
        return math.log2(float(value))
    return float(value)


def sweep_xs(data: Sweep) -> list[float]:
    return [sweep_x(data, p.value) for p in data.points]


def sweep_ticks(data: Sweep) -> list[tuple[float, str]]:
    standard = set(sweep_values(data.model, data.setup, data.field))
    return [(sweep_x(data, p.value), tick_text(data.field, p.value)) for p in data.points
            if p.value in standard or data.field == "weights"]


def sweep_table(data: Sweep, unit: Unit) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) for CSV: every level in the unit and in bytes, the fit, trainable parameters."""
    gpu = data.gpu.name if data.gpu else "GPU"
    headers = [sweep_label(data)]
    headers += [f"{LEVEL_NAMES[lv]} [{unit.value}]" for lv in MemLevel]
    headers += [f"{LEVEL_NAMES[lv]} [bytes]" for lv in MemLevel]
    headers += [f"Fits {gpu} (device level)", f"Headroom (device level) [{unit.value}]", "Trainable params",
                "Current", "Note"]
    rows: list[list[str]] = []
    for p in data.points:
        r = p.result
        row = [value_text(data.field, p.value).replace(",", "")]
        if r is None:
            row += [""] * 8 + ["", "yes" if p.value == data.current else "", p.error]
        else:
            row += [f"{to_unit(r.bytes_at(lv), unit):.3f}" for lv in MemLevel]
            row += [str(r.bytes_at(lv)) for lv in MemLevel]
            fits = r.fits(data.gpu, MemLevel.DEVICE) if data.gpu else None
            head = r.headroom_bytes(data.gpu, MemLevel.DEVICE) if data.gpu else None
            row += ["" if fits is None else ("yes" if fits else "no"),
                    "" if head is None else f"{to_unit(head, unit):.3f}",
                    str(r.trainable_params), "yes" if p.value == data.current else "",
                    r.setup.precision_label()]
        rows.append(row)
    return headers, rows


def count_tick(n: float) -> str:
    """A parameter count for an axis: 2M, 50M, 1B, 1.5K (two significant digits, no trailing zeros)."""
    for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= factor * 0.999:
            return f"{float(f'{n / factor:.2g}'):g}{suffix}"
    return f"{float(f'{n:.2g}'):g}"


class _CountAxis(pg.AxisItem):
    """Ticks of a log10 axis written as parameter counts (1M, 10M, 1B)."""

    def tickStrings(self, values: Sequence[float], scale: float, spacing: float) -> list[str]:  # noqa: N802
        return [count_tick(10 ** v) for v in values]

    def tickValues(self, minVal: float, maxVal: float, size: float) -> list[tuple[float, list[float]]]:  # noqa: N802, N803
        """Powers of ten, and 2x / 5x between them when the range spans few decades."""
        def ticks(steps: tuple[float, ...]) -> list[float]:
            values = [d + s for d in range(math.floor(minVal), math.ceil(maxVal) + 1) for s in steps]
            return [v for v in values if minVal <= v <= maxVal]

        chosen = ticks((0.0,))
        for steps in ((0.0, math.log10(5)), (0.0, math.log10(2), math.log10(5))):
            finer = ticks(steps)
            if len(chosen) >= 3 or size / max(1, len(finer)) < 22:  # enough labels, or no room for more
                break
            chosen = finer
        return [(1.0, chosen)]


class SweepChart(QtWidgets.QWidget):
    """Title, the memory plot over the parameter plot, and a key. ``chart_area`` is what exports render."""

    hovered = QtCore.Signal(object)  # index of the hovered point, or None

    def __init__(self, theme: Theme, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self._theme = theme
        self._data: Sweep | None = None
        self._level = MemLevel.DEVICE
        self._unit = Unit.GIB
        self.last_tooltip = ""
        outer = QtWidgets.QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.chart_area = QtWidgets.QWidget(self)
        self.chart_area.setAutoFillBackground(True)
        outer.addWidget(self.chart_area)
        layout = QtWidgets.QVBoxLayout(self.chart_area)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(2)
        self.title = QtWidgets.QLabel(self.chart_area)
        self.title.setObjectName("SweepTitle")
        self.title.setWordWrap(True)
        layout.addWidget(self.title)

        self.mem_plot = pg.PlotWidget(self.chart_area, background=theme.chart_bg)
        self.par_plot = pg.PlotWidget(self.chart_area, background=theme.chart_bg,
                                      axisItems={"left": _CountAxis("left")})
        for plot in (self.mem_plot, self.par_plot):
            plot.setCacheMode(QtWidgets.QGraphicsView.CacheModeFlag.CacheNone)  # vector SVG export
            item = plot.getPlotItem()
            item.hideButtons()
            item.setMenuEnabled(False)
            item.setMouseEnabled(x=False, y=False)
            item.showGrid(x=True, y=True, alpha=0.2)
            item.getAxis("left").enableAutoSIPrefix(False)
            item.getAxis("left").setWidth(78)
            item.layout.setContentsMargins(4, 6, 14, 2)
            plot.scene().sigMouseMoved.connect(lambda pos, p=plot: self._on_mouse_moved(p, pos))
            plot.setMouseTracking(True)
        self.par_plot.setXLink(self.mem_plot)
        self.mem_plot.getPlotItem().getAxis("bottom").setStyle(showValues=False)  # the lower plot's labels serve both
        self.mem_plot.setMinimumHeight(140)
        self.par_plot.setMinimumHeight(80)
        layout.addWidget(self.mem_plot, 3)
        layout.addWidget(self.par_plot, 2)
        self.key = QtWidgets.QLabel(self.chart_area)
        self.key.setObjectName("Facts")
        self.key.setWordWrap(True)
        layout.addWidget(self.key)

        # useCache=False: each symbol is drawn as a path, not copied from pyqtgraph's pixmap atlas, so the
        # SVG export stays vector (a dozen points: no measurable cost)
        self.mem_curve = pg.PlotDataItem([], [], connect="finite", useCache=False)
        self.mem_curve.setZValue(10)
        self.mem_plot.addItem(self.mem_curve)
        self.par_curve = pg.PlotDataItem([], [], connect="finite", useCache=False)
        self.par_curve.setZValue(10)
        self.par_plot.addItem(self.par_curve)
        self.capacity = pg.InfiniteLine(angle=0, movable=False, label="",
                                        labelOpts={"position": 0.02, "anchors": [(0, 1), (0, 1)], "movable": False})
        self.capacity.setZValue(5)
        self.mem_plot.addItem(self.capacity, ignoreBounds=True)
        self.current_lines = [
            pg.InfiniteLine(angle=90, movable=False, label="",
                            labelOpts={"position": 0.97, "anchors": [(0, 0), (0, 0)], "movable": False}),
            pg.InfiniteLine(angle=90, movable=False)]
        self.hover_lines = [pg.InfiniteLine(angle=90, movable=False) for _ in range(2)]
        for plot, cur, hov in zip((self.mem_plot, self.par_plot), self.current_lines, self.hover_lines):
            plot.addItem(cur, ignoreBounds=True)
            plot.addItem(hov, ignoreBounds=True)
            hov.setVisible(False)
            cur.setZValue(4)
        self.apply_theme(theme)

    # ---- theme ------------------------------------------------------------------------------------------------
    def apply_theme(self, theme: Theme) -> None:
        self._theme = theme
        pal = self.chart_area.palette()
        pal.setColor(QtGui.QPalette.ColorRole.Window, QtGui.QColor(theme.chart_bg))
        pal.setColor(QtGui.QPalette.ColorRole.WindowText, QtGui.QColor(theme.chart_fg))
        self.chart_area.setPalette(pal)
        for plot in (self.mem_plot, self.par_plot):
            plot.setBackground(theme.chart_bg)
            item = plot.getPlotItem()
            for name in ("left", "bottom"):
                axis = item.getAxis(name)
                axis.setPen(pg.mkPen(theme.chart_fg, width=1))
                axis.setTextPen(pg.mkPen(theme.chart_fg))
                if axis.labelText:
                    axis.setLabel(axis.labelText, color=theme.chart_fg)
        self.capacity.setPen(pg.mkPen(theme.capacity, width=2, style=QtCore.Qt.PenStyle.DashLine))
        self.capacity.label.setColor(theme.capacity)
        for line in self.current_lines:
            line.setPen(pg.mkPen(theme.accent, width=1.5, style=QtCore.Qt.PenStyle.DashLine))
        self.current_lines[0].label.setColor(theme.accent)
        for line in self.hover_lines:
            line.setPen(pg.mkPen(theme.reference, width=1, style=QtCore.Qt.PenStyle.DotLine))
        if self._data is not None:
            self.set_data(self._data, self._level, self._unit)

    # ---- data -------------------------------------------------------------------------------------------------
    @property
    def data(self) -> Sweep | None:
        return self._data

    @property
    def level(self) -> MemLevel:
        return self._level

    @property
    def unit(self) -> Unit:
        return self._unit

    def set_data(self, data: Sweep, level: MemLevel, unit: Unit) -> None:
        self._data, self._level, self._unit = data, level, unit
        th = self._theme
        xs = np.array(sweep_xs(data), dtype=float)
        mem = data.bytes_at(level)
        ys = np.array([to_unit(b, unit) if b is not None else np.nan for b in mem], dtype=float)
        fits = data.fits()
        line = QtGui.QColor(th.accent)
        brushes = [pg.mkBrush(th.chart_bg if f is False else th.accent) for f in fits]
        pens = [pg.mkPen(th.bad if f is False else th.accent, width=1.6) for f in fits]
        self.mem_curve.setData(xs, ys, pen=pg.mkPen(line, width=2.2), symbol="o", symbolSize=8,
                               symbolBrush=brushes, symbolPen=pens)
        params = [p.trainable_params if p.result and p.trainable_params > 0 else None for p in data.points]
        pys = np.array([math.log10(v) if v else np.nan for v in params], dtype=float)
        self.par_curve.setData(xs, pys, pen=pg.mkPen(th.good, width=2), symbol="s", symbolSize=7,
                               symbolBrush=pg.mkBrush(th.good), symbolPen=pg.mkPen(th.good))

        gpu = data.gpu
        if gpu is not None:
            self.capacity.setValue(to_unit(gpu.memory_bytes, unit))
            self.capacity.label.setFormat(capacity_label(gpu, unit))
        self.capacity.setVisible(gpu is not None)

        if data.current is not None and data.current in [p.value for p in data.points]:
            cx = sweep_x(data, data.current)
            for cur in self.current_lines:
                cur.setValue(cx)
                cur.setVisible(True)
            self.current_lines[0].label.setFormat(f"now: {value_text(data.field, data.current)}")
        else:
            for cur in self.current_lines:
                cur.setVisible(False)
        self._set_axes(xs, ys, pys)
        level_text = LEVEL_NAMES[level].lower()
        self.title.setText(
            f"<b>Memory against {escape(SWEEP_NOUNS[data.field])}</b> · {escape(level.label)}, "
            f"{unit.value} per GPU · trainable parameters below")
        fit_note = (f"Filled points fit {escape(gpu.name)} at the device level; hollow red ones do not. "
                    if gpu is not None else "Choose a GPU to see which points fit. ")
        method_note = {"weights": " fp32/bf16/fp16 keep the method; int8/nf4 switch to QLoRA.",
                       "lora_rank": "" if data.setup.uses_lora else " The sweep trains LoRA adapters (the setup is "
                                                                     "not LoRA, so there is no current value).",
                       "trainable_layers": "" if data.setup.method is Method.FREEZE else
                       " The sweep freezes all but the last N layers (the setup trains "
                       f"{'all layers' if data.setup.method is Method.FULL else 'adapters'}, so no current value)."
                       }.get(data.field, "")
        self.key.setText(f"{fit_note}Curve: {level_text}; the dashed vertical line is the current setup. "
                         f"Hover a point for every level.{method_note}")
        errors = [p for p in data.points if p.result is None]
        if errors:
            self.key.setText(self.key.text() + " Gaps: "
                             + "; ".join(f"{value_text(data.field, p.value)}: {p.error}" for p in errors[:2]))

    def _set_axes(self, xs: np.ndarray, ys: np.ndarray, pys: np.ndarray) -> None:
        assert self._data is not None
        data, unit, level = self._data, self._unit, self._level
        ticks = sweep_ticks(data)
        for plot in (self.mem_plot, self.par_plot):
            plot.getPlotItem().getAxis("bottom").setTicks([ticks, []])
        self.par_plot.getPlotItem().setLabel("bottom", sweep_label(data), color=self._theme.chart_fg)
        # two lines: in one, at 800 px high, it ran past its short plot into the label of the one below
        self.mem_plot.getPlotItem().setLabel("left", f"{LEVEL_NAMES[level]}<br>[{unit.value}]",
                                             color=self._theme.chart_fg)
        self.par_plot.getPlotItem().setLabel("left", "Trainable<br>(log scale)", color=self._theme.chart_fg)
        if len(xs):
            pad = 0.35 if SWEEP_FIELDS[data.field][1] != "linear" else max(0.5, (xs.max() - xs.min()) * 0.04)
            self.mem_plot.getPlotItem().setXRange(float(xs.min()) - pad, float(xs.max()) + pad, padding=0)
        finite = ys[np.isfinite(ys)]
        top = float(finite.max()) if finite.size else 1.0
        top *= 1.08
        if data.gpu is not None:  # room above the capacity line for its label
            top = max(top, to_unit(data.gpu.memory_bytes, unit) * 1.18)
        self.mem_plot.getPlotItem().setYRange(0, top or 1.0, padding=0)
        pf = pys[np.isfinite(pys)]
        if pf.size:
            lo, hi = float(pf.min()), float(pf.max())
            if hi - lo < 1:  # at least one decade, centred on the data
                mid = (lo + hi) / 2
                lo, hi = mid - 0.5, mid + 0.5
            self.par_plot.getPlotItem().setYRange(lo - 0.15, hi + 0.15, padding=0)

    # ---- size ------------------------------------------------------------------------------------------------------
    def minimumSizeHint(self) -> QtCore.QSize:  # noqa: N802
        """Tall enough for the title and the key as wrapped at this width: a layout counts a wrapped label as one
        line, so at 1280x800 the plots were laid over each other (the memory plot cut to its top half)."""
        hint = super().minimumSizeHint()
        width = self.chart_area.contentsRect().width() - 12  # the chart area's margins
        if width <= 0:
            return hint
        extra = sum(max(0, label.heightForWidth(width) - label.minimumSizeHint().height())
                    for label in (self.title, self.key) if label.text())
        return QtCore.QSize(hint.width(), hint.height() + extra)

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self.updateGeometry()  # the labels wrap anew: the minimum height above follows

    # ---- reading back (tests, export) ----------------------------------------------------------------------------
    def curve_points(self) -> list[tuple[float, float]]:
        """The memory curve as drawn: (x, y in the unit); NaN for points the core could not estimate."""
        x, y = self.mem_curve.getData()
        if x is None or y is None:
            return []
        return [(float(a), float(b)) for a, b in zip(x, y)]

    def param_points(self) -> list[tuple[float, float]]:
        x, y = self.par_curve.getData()
        if x is None or y is None:
            return []
        return [(float(a), float(10 ** b) if np.isfinite(b) else float("nan")) for a, b in zip(x, y)]

    # ---- hover ---------------------------------------------------------------------------------------------------
    def nearest(self, x: float) -> int | None:
        if self._data is None or not self._data.points:
            return None
        xs = sweep_xs(self._data)
        i = min(range(len(xs)), key=lambda k: abs(xs[k] - x))
        half = (max(xs) - min(xs)) / max(1, len(xs) - 1) / 2 if len(xs) > 1 else 1.0
        return i if abs(xs[i] - x) <= max(half, 0.5) else None

    def tooltip_html(self, index: int) -> str:
        assert self._data is not None
        data, unit = self._data, self._unit
        p = data.points[index]
        lines = [f"<b>{escape(sweep_label(data).split(' (')[0])}: {escape(value_text(data.field, p.value))}</b>"
                 + (" (current setup)" if p.value == data.current else "")]
        if p.result is None:
            lines.append(escape(p.error))
            return "<br>".join(lines)
        r = p.result
        for lv in MemLevel:
            text = f"{LEVEL_NAMES[lv]}: {fmt_bytes(r.bytes_at(lv), unit)} ({r.bytes_at(lv):,} bytes)"
            lines.append(f"<b>{escape(text)}</b>" if lv is self._level else escape(text))
        if data.gpu is not None:
            head = r.headroom_bytes(data.gpu, MemLevel.DEVICE)
            assert head is not None
            lines.append(f"{'✔ fits' if head >= 0 else '✘ does not fit'} {escape(data.gpu.name)}: "
                         f"{fmt_bytes(abs(head), unit)} {'headroom' if head >= 0 else 'short'} (device level)")
        share = r.trainable_params / r.total_params if r.total_params else 0
        lines.append(f"Trainable: {fmt_count(r.trainable_params)} of {fmt_count(r.total_params)} parameters "
                     f"({share:.2%})")
        lines.append(f"<i>{escape(r.setup.precision_label())}</i>")
        return "<br>".join(lines)

    def _on_mouse_moved(self, plot: pg.PlotWidget, scene_pos: QtCore.QPointF) -> None:
        vb = plot.getPlotItem().vb
        index = None
        if vb.sceneBoundingRect().contains(scene_pos):
            index = self.nearest(vb.mapSceneToView(scene_pos).x())
        if index is None or self._data is None:
            for line in self.hover_lines:
                line.setVisible(False)
            if self.last_tooltip:
                QtWidgets.QToolTip.hideText()
            self.last_tooltip = ""
            self.hovered.emit(None)
            return
        x = sweep_xs(self._data)[index]
        for line in self.hover_lines:
            line.setValue(x)
            line.setVisible(True)
        html = self.tooltip_html(index)
        self.last_tooltip = html
        QtWidgets.QToolTip.showText(plot.mapToGlobal(plot.mapFromScene(scene_pos)), html, plot)
        self.hovered.emit(index)

    def hover_at(self, x: float, y: float = 0.0, plot: pg.PlotWidget | None = None) -> str:
        """Hover view point (x, y) as the mouse would; returns the tooltip (tests)."""
        plot = plot or self.mem_plot
        self._on_mouse_moved(plot, plot.getPlotItem().vb.mapViewToScene(QtCore.QPointF(x, y)))
        return self.last_tooltip
