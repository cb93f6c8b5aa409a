"""Stacked bars on a pyqtgraph plot, updated in place.

Every segment type (a memory kind, or an overhead above the tensor level) is one ``BarGraphItem`` holding
that segment for all bars; an update calls ``setOpts`` on the existing items and moves pooled text items,
so typing in the setup panel never rebuilds the scene (no flicker). Hovering a segment shows its exact
size and what it is.

The numbers are the core's: a :class:`Segment` carries the bytes a
:class:`~vramlab.core.result.MemoryResult` reports; the only arithmetic here is stacking (where a segment
starts) and converting bytes to the display unit.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

import numpy as np

from vramlab.app.palette import KIND_COLORS, OVERHEAD_COLORS, OVERHEAD_FALLBACK, text_color_on
from vramlab.app.qt import QtCore, QtGui, QtWidgets, pg
from vramlab.app.theme import Theme
from vramlab.core.kinds import KIND_ORDER, Kind
from vramlab.core.result import MemLevel, MemoryResult
from vramlab.core.units import Unit, fmt_bytes, to_unit

LEVEL_RANK = {MemLevel.ALLOCATED: 0, MemLevel.RESERVED: 1, MemLevel.DEVICE: 2}


@dataclass(frozen=True)
class Segment:
    key: str  # 'kind:weights' or 'overhead:CUDA context'
    label: str
    description: str
    color: str
    nbytes: int
    start_bytes: int  # bytes stacked below this segment
    overhead: bool = False


@dataclass(frozen=True)
class Stack:
    """One bar: its x position, tick text, segments, and the total the core reports for it."""

    x: float
    tick: str
    title: str  # for tooltips: the scenario / phase this bar shows
    segments: tuple[Segment, ...]
    total_bytes: int
    level: MemLevel = MemLevel.ALLOCATED
    pale: bool = False  # drawn hatched (the simulation beside the estimate)
    highlight: bool = False  # outlined (the current setup; the peak phase)
    caption: str = ""  # text above the bar; default: the total ("-" for none)
    note: str = ""  # extra tooltip line

    @property
    def top_bytes(self) -> int:
        return self.segments[-1].start_bytes + self.segments[-1].nbytes if self.segments else 0


def kind_segments(components: Mapping[Kind, int]) -> list[Segment]:
    out: list[Segment] = []
    start = 0
    for kind in KIND_ORDER:
        n = int(components.get(kind, 0))
        if n <= 0:
            continue
        out.append(Segment(f"kind:{kind.value}", kind.label, kind.description, KIND_COLORS[kind], n, start))
        start += n
    return out


def result_segments(result: MemoryResult, level: MemLevel) -> tuple[Segment, ...]:
    """The components at the peak, then (for the reserved and device levels) the overheads of that level,
    as the core lists them. The segments add up to ``result.bytes_at(level)``."""
    out = kind_segments(result.components)
    start = out[-1].start_bytes + out[-1].nbytes if out else 0
    for o in result.overheads:
        if LEVEL_RANK[o.level] > LEVEL_RANK[level] or o.bytes <= 0:
            continue
        color = OVERHEAD_COLORS.get(o.name, OVERHEAD_FALLBACK)
        out.append(Segment(f"overhead:{o.name}", o.name, f"{o.why} ({o.level.short} level)", color, o.bytes,
                           start, overhead=True))
        start += o.bytes
    return tuple(out)


def wrap_tick(text: str, width: int = 16) -> str:
    lines: list[str] = []
    for part in text.split("\n"):
        lines.extend(textwrap.wrap(part, width, break_long_words=False) or [""])
    return "\n".join(lines)


@dataclass
class _Pool:
    """Reusable text items: shown ones are moved and re-texted, spare ones hidden."""

    make: Callable[[], pg.TextItem]
    items: list[pg.TextItem] = field(default_factory=list)
    used: int = 0

    def reset(self) -> None:
        self.used = 0

    def take(self) -> pg.TextItem:
        if self.used == len(self.items):
            self.items.append(self.make())
        item = self.items[self.used]
        self.used += 1
        item.setVisible(True)
        return item

    def hide_rest(self) -> None:
        for item in self.items[self.used:]:
            item.setVisible(False)


class StackedBarPlot(pg.PlotWidget):
    """A bar chart of :class:`Stack` objects with hover tooltips, value labels and reference lines."""

    hovered = QtCore.Signal(object)  # (Stack, Segment) or None

    def __init__(self, theme: Theme, parent: QtWidgets.QWidget | None = None, font_pt: float = 9.0,
                 bar_width: float = 0.6) -> None:
        super().__init__(parent, background=theme.chart_bg)
        # pyqtgraph caches the background as a pixmap; without the cache, SVG export stays pure vector.
        self.setCacheMode(QtWidgets.QGraphicsView.CacheModeFlag.CacheNone)
        self._theme = theme
        self._unit = Unit.GIB
        self._font_pt = font_pt
        self._bar_width = bar_width
        self._stacks: tuple[Stack, ...] = ()
        self._bars: dict[str, pg.BarGraphItem] = {}
        self._outline = pg.BarGraphItem(x=[], height=[], width=bar_width, brush=None)
        self._outline.setZValue(5)
        self._totals = _Pool(lambda: self._new_text(bold=True, z=10))
        self._inside = _Pool(lambda: self._new_text(bold=False, z=11))
        self._lines: dict[str, pg.InfiniteLine] = {}
        self._line_bytes: dict[str, int] = {}  # where each line sits, in bytes (the axis unit may change)
        self._y_extra: list[float] = []
        self.last_tooltip = ""
        item = self.getPlotItem()
        item.hideButtons()
        item.setMenuEnabled(False)
        item.setMouseEnabled(x=False, y=False)
        item.showGrid(x=False, y=True, alpha=0.25)
        item.getAxis("left").enableAutoSIPrefix(False)
        item.getAxis("bottom").setStyle(tickLength=0)
        item.layout.setContentsMargins(4, 8, 12, 4)
        item.addItem(self._outline)
        self._font = QtGui.QFont()
        self._font.setPointSizeF(font_pt)
        for axis in ("left", "bottom"):
            item.getAxis(axis).setTickFont(self._font)
        item.vb.sigResized.connect(self._place_inside_labels)
        self.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.setMouseTracking(True)
        self.apply_theme(theme)

    # ---- items -------------------------------------------------------------------------------------------------
    def _new_text(self, bold: bool, z: float) -> pg.TextItem:
        t = pg.TextItem("", color=self._theme.chart_fg, anchor=(0.5, 1.0))
        font = QtGui.QFont(self._font)
        font.setBold(bold)
        t.setFont(font)
        t.setZValue(z)
        self.getPlotItem().addItem(t, ignoreBounds=True)
        return t

    def _bar(self, key: str) -> pg.BarGraphItem:
        bar = self._bars.get(key)
        if bar is None:
            bar = pg.BarGraphItem(x=[], height=[], width=self._bar_width)
            bar.setZValue(1 if not key.endswith("|pale") else 0.5)
            self.getPlotItem().addItem(bar)
            self._bars[key] = bar
        return bar

    def set_line(self, key: str, value_bytes: int | None, label: str = "", kind: str = "capacity") -> None:
        """A horizontal line at ``value_bytes`` (None removes it). kind: 'capacity' or 'reference'."""
        line = self._lines.get(key)
        if value_bytes is None:
            if line is not None:
                line.setVisible(False)
            return
        if line is None:
            cap = kind == "capacity"
            line = pg.InfiniteLine(
                angle=0, movable=False, label=label,
                labelOpts={"position": 0.985 if cap else 0.015, "anchors": [(1, 1), (1, 1)] if cap
                           else [(0, 1), (0, 1)], "movable": False},
            )
            line.setZValue(20 if cap else 0.2)
            line.setProperty("vramlab_kind", kind)
            self.getPlotItem().addItem(line, ignoreBounds=True)
            self._lines[key] = line
        line.setVisible(True)
        self._line_bytes[key] = value_bytes
        line.setValue(to_unit(value_bytes, self._unit))
        line.label.setFormat(label)
        self._style_line(line)

    def line_value(self, key: str) -> float | None:
        line = self._lines.get(key)
        return float(line.value()) if line is not None and line.isVisible() else None

    def line_keys(self) -> list[str]:
        return [k for k, line in self._lines.items() if line.isVisible()]

    def _style_line(self, line: pg.InfiniteLine) -> None:
        cap = line.property("vramlab_kind") == "capacity"
        color = self._theme.capacity if cap else self._theme.reference
        style = QtCore.Qt.PenStyle.DashLine if cap else QtCore.Qt.PenStyle.DotLine
        line.setPen(pg.mkPen(color, width=2.5 if cap else 1.2, style=style))
        line.label.setColor(color)
        font = QtGui.QFont(self._font)
        font.setBold(cap)
        line.label.setFont(font)

    # ---- theme ----------------------------------------------------------------------------------------------------
    def apply_theme(self, theme: Theme) -> None:
        self._theme = theme
        self.setBackground(theme.chart_bg)
        item = self.getPlotItem()
        for name in ("left", "bottom"):
            axis = item.getAxis(name)
            axis.setPen(pg.mkPen(theme.chart_fg, width=1))
            axis.setTextPen(pg.mkPen(theme.chart_fg))
            if axis.labelText:
                axis.setLabel(axis.labelText, color=theme.chart_fg, **{"font-size": f"{self._font_pt + 1}pt"})
        for t in self._totals.items:
            t.setColor(theme.chart_fg)
        for line in self._lines.values():
            self._style_line(line)
        self._outline.setOpts(pen=pg.mkPen(theme.chart_fg, width=2, style=QtCore.Qt.PenStyle.DashLine))
        if self._stacks:
            self.set_stacks(self._stacks, self._unit)

    def set_axis_label(self, text: str) -> None:
        self.getPlotItem().setLabel("left", text, color=self._theme.chart_fg,
                                    **{"font-size": f"{self._font_pt + 1}pt"})

    # ---- data -------------------------------------------------------------------------------------------------------
    @property
    def stacks(self) -> tuple[Stack, ...]:
        return self._stacks

    @property
    def unit(self) -> Unit:
        return self._unit

    def bar_items(self) -> Mapping[str, pg.BarGraphItem]:
        return dict(self._bars)

    def set_y_extra(self, values_bytes: Sequence[float]) -> None:
        """Values (bytes) the y range must include besides the bars (capacity and reference lines)."""
        self._y_extra = list(values_bytes)

    def set_stacks(self, stacks: Sequence[Stack], unit: Unit) -> None:
        self._stacks = tuple(stacks)
        if unit != self._unit:  # lines are kept in bytes: place them in the new unit
            self._unit = unit
            for key, line in self._lines.items():
                line.setValue(to_unit(self._line_bytes[key], unit))
        bg = QtGui.QColor(self._theme.chart_bg)
        columns: dict[str, tuple[list[float], list[float], list[float], str, bool, list[float]]] = {}
        for stack in self._stacks:
            width = self._bar_width if not any(s.pale for s in self._stacks) else self._bar_width / 2
            for seg in stack.segments:
                key = seg.key + ("|pale" if stack.pale else "")
                col = columns.setdefault(key, ([], [], [], seg.color, stack.pale, []))
                col[0].append(stack.x)
                col[1].append(to_unit(seg.start_bytes, unit))
                col[2].append(to_unit(seg.nbytes, unit))
                col[5].append(width)
        for key, (xs, y0, hs, color, pale, widths) in columns.items():
            # the simulation beside an estimate: hatched in the kind's colour. Translucent, a weights bar looked
            # like the LoRA adapters' light blue (issue 27: look-alike colours)
            brush = QtGui.QBrush(QtGui.QColor(color), QtCore.Qt.BrushStyle.BDiagPattern) if pale \
                else QtGui.QBrush(QtGui.QColor(color))
            pen = pg.mkPen(color if pale else bg, width=1.5 if pale else 1)
            self._bar(key).setOpts(x=np.array(xs), y0=np.array(y0), height=np.array(hs), width=np.array(widths),
                                   brush=brush, pen=pen)
        for key, bar in self._bars.items():
            if key not in columns:
                bar.setOpts(x=np.array([]), y0=np.array([]), height=np.array([]), width=np.array([]))
        hi = [s for s in self._stacks if s.highlight and s.segments]
        hw = [self._bar_width / 2 if any(s.pale for s in self._stacks) else self._bar_width for _ in hi]
        self._outline.setOpts(x=np.array([s.x for s in hi]), y0=np.zeros(len(hi)),
                              height=np.array([to_unit(s.top_bytes, unit) for s in hi]), width=np.array(hw),
                              brush=None)
        self._place_totals()
        self._set_ticks()
        self._set_range()
        self._place_inside_labels()

    def _place_totals(self) -> None:
        self._totals.reset()
        for stack in self._stacks:
            text = stack.caption or (fmt_bytes(stack.total_bytes, self._unit) if stack.segments else "")
            if not text or text == "-":
                continue
            t = self._totals.take()
            t.setColor(self._theme.chart_fg)
            t.setText(text)
            t.setAnchor((0.5, 1.0))
            t.setPos(stack.x, to_unit(stack.top_bytes, self._unit))
        self._totals.hide_rest()

    def _set_ticks(self) -> None:
        seen: dict[float, str] = {}
        for s in self._stacks:
            if s.tick and not s.pale:
                seen[round(s.x)] = s.tick
        ticks = [(x, t) for x, t in sorted(seen.items())]
        axis = self.getPlotItem().getAxis("bottom")
        axis.setTicks([ticks, []])
        lines = max((t.count("\n") + 1 for _, t in ticks), default=1)
        height = QtGui.QFontMetrics(self._font).lineSpacing() * lines + 14
        axis.setHeight(height)

    def _set_range(self) -> None:
        tops = [to_unit(s.top_bytes, self._unit) for s in self._stacks]
        tops += [to_unit(v, self._unit) for v in self._y_extra]
        ymax = max(tops, default=1.0) or 1.0
        xs = [round(s.x) for s in self._stacks] or [0]
        item = self.getPlotItem()
        item.setXRange(min(xs) - 0.6, max(xs) + 0.6, padding=0)
        item.setYRange(0, ymax * 1.12, padding=0)

    def _place_inside_labels(self) -> None:
        """Sizes inside segments that are tall and wide enough on screen to hold them."""
        self._inside.reset()
        vb = self.getPlotItem().vb
        px = vb.viewPixelSize() if vb.width() > 0 and vb.height() > 0 else None
        if px is not None and px[0] > 0 and px[1] > 0:
            metrics = QtGui.QFontMetrics(self._font)
            need_h = metrics.height() + 2
            paired = any(s.pale for s in self._stacks)
            bar_px = (self._bar_width / (2 if paired else 1)) / px[0]
            for stack in self._stacks:
                for seg in stack.segments:
                    h_px = to_unit(seg.nbytes, self._unit) / px[1]
                    text = fmt_bytes(seg.nbytes, self._unit, 1 if paired else 2)
                    if h_px < need_h or bar_px < metrics.horizontalAdvance(text) + 6:
                        continue
                    t = self._inside.take()
                    color = QtGui.QColor(seg.color)
                    t.setColor(text_color_on(color) if not stack.pale else QtGui.QColor(self._theme.chart_fg))
                    t.setText(text)
                    t.setAnchor((0.5, 0.5))
                    t.setPos(stack.x, to_unit(seg.start_bytes + seg.nbytes / 2, self._unit))
        self._inside.hide_rest()

    def inside_labels(self) -> list[str]:
        return [t.textItem.toPlainText() for t in self._inside.items[: self._inside.used]]

    def total_labels(self) -> list[str]:
        return [t.textItem.toPlainText() for t in self._totals.items[: self._totals.used]]

    # ---- hover -------------------------------------------------------------------------------------------------------
    def segment_at(self, x: float, y: float) -> tuple[Stack, Segment] | None:
        """The segment under the view coordinates (x, y in the display unit)."""
        paired = any(s.pale for s in self._stacks)
        half = (self._bar_width / (2 if paired else 1)) / 2
        for stack in self._stacks:
            if abs(x - stack.x) > half:
                continue
            for seg in stack.segments:
                lo = to_unit(seg.start_bytes, self._unit)
                hi = to_unit(seg.start_bytes + seg.nbytes, self._unit)
                if lo <= y <= hi:
                    return stack, seg
        return None

    def tooltip_html(self, stack: Stack, seg: Segment) -> str:
        where = f"overhead in {stack.level.label}" if seg.overhead else f"live at the peak ({stack.level.label})"
        lines = [
            f"<b>{escape(seg.label)}</b> — {escape(stack.title)}",
            f"{fmt_bytes(seg.nbytes, self._unit)} ({seg.nbytes:,} bytes), {where}",
            f"<i>{escape(seg.description)}</i>",
        ]
        if stack.note:
            lines.append(escape(stack.note))
        return "<br>".join(lines)

    def _on_mouse_moved(self, scene_pos: QtCore.QPointF) -> None:
        vb = self.getPlotItem().vb
        hit = None
        if vb.sceneBoundingRect().contains(scene_pos):
            p = vb.mapSceneToView(scene_pos)
            hit = self.segment_at(p.x(), p.y())
        if hit is None:
            if self.last_tooltip:
                QtWidgets.QToolTip.hideText()
            self.last_tooltip = ""
            self.hovered.emit(None)
            return
        html = self.tooltip_html(*hit)
        self.last_tooltip = html
        global_pos = self.mapToGlobal(self.mapFromScene(scene_pos))
        QtWidgets.QToolTip.showText(global_pos, html, self)
        self.hovered.emit(hit)

    def view_to_scene(self, x: float, y: float) -> QtCore.QPointF:
        return self.getPlotItem().vb.mapViewToScene(QtCore.QPointF(x, y))

    def hover_at(self, x: float, y: float) -> str:
        """Hover the point (x, y) in view coordinates, as the mouse would; returns the tooltip (tests)."""
        self._on_mouse_moved(self.view_to_scene(x, y))
        return self.last_tooltip
