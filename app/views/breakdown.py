"""The breakdown chart: one stacked bar per scenario (the current setup first), split by memory kind at
the peak, at the memory level the user picked; the GPU's capacity as a line, a fits / does-not-fit
verdict with the headroom, a legend, and the core's notes and warnings underneath."""

from __future__ import annotations

from html import escape

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.state import Row, Snapshot
from vramlab.app.theme import Theme
from vramlab.app.views.bars import Segment, Stack, StackedBarPlot, result_segments, wrap_tick
from vramlab.app.views.legend import LegendEntry, LegendWidget
from vramlab.core.catalog import common_sizes
from vramlab.core.report import capacity_label, level_axis_label, phase_label, verdict
from vramlab.core.units import fmt_count


def row_tick(row: Row, show_model: bool) -> str:
    name = wrap_tick(row.name)
    if row.result is None:
        return f"{name}\n(invalid)"
    if show_model:
        return f"{name}\n{wrap_tick(row.model.name, 20)}"
    return name


def stacks_for(snapshot: Snapshot) -> list[Stack]:
    """The chart's bars for a snapshot: the core's components (and overheads) per row."""
    models = {r.model.id for r in snapshot.rows if r.result is not None}
    show_model = len(models) > 1
    out: list[Stack] = []
    for i, row in enumerate(snapshot.rows):
        res = row.result
        if res is None:
            out.append(Stack(i, row_tick(row, show_model), row.name, (), 0, snapshot.level, note=row.error))
            continue
        segs = result_segments(res, snapshot.level)
        note = f"Peak in {phase_label(res.peak_phase).lower()}; {res.setup.precision_label()}"
        if row.error:
            note += f" — showing the last valid setup ({row.error})"
        out.append(Stack(i, row_tick(row, show_model), row.name, segs, res.bytes_at(snapshot.level),
                         snapshot.level, highlight=row.is_current and len(snapshot.rows) > 1, note=note))
    return out


def legend_entries(stacks: list[Stack]) -> list[LegendEntry]:
    seen: dict[str, Segment] = {}
    for s in stacks:
        for seg in s.segments:
            seen.setdefault(seg.key, seg)
    kinds = [seg for seg in seen.values() if not seg.overhead]
    overheads = [seg for seg in seen.values() if seg.overhead]
    order = {f"kind:{k}": i for i, k in enumerate(
        ("weights", "lora_adapters", "master_weights", "gradients", "optimizer_states", "activations",
         "amp_weight_copies", "logits_loss", "temporaries", "optimizer_temps", "inputs"))}
    kinds.sort(key=lambda s: order.get(s.key, 99))
    return [LegendEntry(s.key, s.label, s.color, s.description, s.overhead) for s in (*kinds, *overheads)]


class BreakdownView(QtWidgets.QWidget):
    """Verdict, chart and legend for a :class:`Snapshot`; also used (light, larger) in the report."""

    def __init__(self, theme: Theme, parent: QtWidgets.QWidget | None = None, font_pt: float = 9.0,
                 show_notes: bool = True) -> None:
        super().__init__(parent)
        self._snapshot: Snapshot | None = None
        outer = QtWidgets.QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(4)
        # Verdict, chart and legend: what "export chart" renders (the notes stay on screen only).
        self.chart_area = QtWidgets.QWidget(self)
        self.chart_area.setAutoFillBackground(True)
        layout = QtWidgets.QVBoxLayout(self.chart_area)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.setSpacing(4)
        outer.addWidget(self.chart_area, 1)
        self.verdict = QtWidgets.QLabel(self.chart_area)
        self.verdict.setObjectName("Verdict")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.subtitle = QtWidgets.QLabel(self.chart_area)
        self.subtitle.setObjectName("Facts")
        self.subtitle.setWordWrap(True)
        self.plot = StackedBarPlot(theme, self.chart_area, font_pt=font_pt)
        self.plot.setMinimumHeight(220)
        self.plot.setToolTip("")
        self.legend = LegendWidget(self.chart_area, None if font_pt == 9.0 else font_pt)
        layout.addWidget(self.verdict)
        layout.addWidget(self.subtitle)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.legend)
        self.notes: QtWidgets.QTextBrowser | None = None
        if show_notes:
            self.notes = QtWidgets.QTextBrowser(self)
            self.notes.setObjectName("Notes")
            self.notes.setOpenLinks(False)
            self.notes.setMaximumHeight(120)
            self.notes.setVerticalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAsNeeded)
            outer.addWidget(self.notes)
        self._theme = theme

    def apply_theme(self, theme: Theme) -> None:
        self._theme = theme
        self.plot.apply_theme(theme)
        if self._snapshot is not None:
            self.set_snapshot(self._snapshot)

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        unit, level, gpu = snapshot.unit, snapshot.level, snapshot.gpu
        stacks = stacks_for(snapshot)
        extra: list[float] = []
        if gpu is not None:
            extra.append(gpu.memory_bytes)
        self.plot.set_line("capacity", gpu.memory_bytes if gpu else None,
                           capacity_label(gpu, unit) if gpu else "", kind="capacity")
        for label, size in common_sizes():
            self.plot.set_line(f"ref:{label}", size if snapshot.common_sizes else None, label, kind="reference")
            if snapshot.common_sizes:
                extra.append(size)
        self.plot.set_y_extra(extra)
        self.plot.set_axis_label(level_axis_label(level, unit))
        self.plot.set_stacks(stacks, unit)
        self.legend.set_entries(legend_entries(stacks))

        current = snapshot.current
        v = verdict(current.result, gpu, unit)
        self.verdict.setText(v.text)
        if self.verdict.property("state") != v.state:
            self.verdict.setProperty("state", v.state)
            self.verdict.style().unpolish(self.verdict)
            self.verdict.style().polish(self.verdict)
        res = current.result
        if res is not None:
            self.subtitle.setText(
                f"Current setup: peak in {phase_label(res.peak_phase).lower()} · "
                f"{fmt_count(res.total_params)} parameters, {fmt_count(res.trainable_params)} trainable · "
                f"analytical estimate, per GPU"
            )
        else:
            self.subtitle.setText("")
        if self.notes is not None:
            self.notes.setHtml(self._notes_html(snapshot))

    def _notes_html(self, snapshot: Snapshot) -> str:
        res = snapshot.current.result
        parts: list[str] = []
        for w in snapshot.warnings:
            parts.append(f"<div style='color:{self._theme.warning_fg}'>⚠ {escape(w)}</div>")
        if res is not None:
            parts.extend(f"<div>• {escape(n)}</div>" for n in res.notes)
        return "".join(parts)
