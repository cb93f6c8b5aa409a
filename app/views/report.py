"""The report layout: one 16:9 page for a slide or a document, always in the light theme.

Title, the current setup in one line, the verdict, the comparison chart with its legend, the three levels
per scenario, and a footer that says what the numbers are (estimate, per GPU, which unit). Exported as PNG
(2x) or SVG by :mod:`vramlab.app.export`; the Report tab shows a preview.
"""

from __future__ import annotations

import datetime as dt
from html import escape

from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.state import Snapshot
from vramlab.app.theme import LIGHT, palette_for, style_sheet
from vramlab.app.views.breakdown import BreakdownView
from vramlab.core import __version__
from vramlab.core.report import UNIT_NOTE, setup_summary, verdict
from vramlab.core.result import MemLevel
from vramlab.core.units import fmt_bytes

REPORT_SIZE = QtCore.QSize(1600, 900)


class ReportView(QtWidgets.QFrame):
    """A fixed-size page; never shown on its own, rendered to images and SVG."""

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        theme = LIGHT
        self.setObjectName("Report")
        self.setFixedSize(REPORT_SIZE)
        self.setAutoFillBackground(True)
        page = palette_for(theme)
        page.setColor(QtGui.QPalette.ColorRole.Window, QtGui.QColor("#FFFFFF"))
        self.setPalette(page)
        self.setStyleSheet(style_sheet(theme) + f"""
            QFrame#Report {{ background: #FFFFFF; }}
            QFrame#Report QLabel {{ color: {theme.text}; background: transparent; }}
            QFrame#Report QLabel#Facts {{ color: {theme.muted}; }}
            QFrame#Report QLabel#Verdict[state="fits"] {{ color: {theme.good}; }}
            QFrame#Report QLabel#Verdict[state="nofit"] {{ color: {theme.bad}; }}
            QFrame#Report QLabel#Title {{ font-size: 26pt; font-weight: 700; }}
            QFrame#Report QLabel#Subtitle {{ font-size: 13pt; color: {theme.muted}; }}
            QFrame#Report QLabel#Footer {{ font-size: 10pt; color: {theme.muted}; }}
        """)
        outer = QtWidgets.QVBoxLayout(self)
        outer.setContentsMargins(48, 36, 48, 24)
        outer.setSpacing(10)
        self.title = QtWidgets.QLabel(self)
        self.title.setObjectName("Title")
        self.subtitle = QtWidgets.QLabel(self)
        self.subtitle.setObjectName("Subtitle")
        self.subtitle.setWordWrap(True)
        outer.addWidget(self.title)
        outer.addWidget(self.subtitle)
        body = QtWidgets.QHBoxLayout()
        body.setSpacing(24)
        self.chart = BreakdownView(theme, self, font_pt=12.0, show_notes=False)
        self.chart.verdict.setStyleSheet("font-size: 15pt;")
        self.chart.subtitle.setStyleSheet("font-size: 11pt;")
        self.chart.plot.setMinimumHeight(400)
        body.addWidget(self.chart, 3)
        self.levels = QtWidgets.QLabel(self)
        self.levels.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.levels.setAlignment(QtCore.Qt.AlignmentFlag.AlignTop | QtCore.Qt.AlignmentFlag.AlignLeft)
        self.levels.setWordWrap(True)
        self.levels.setFixedWidth(470)
        body.addWidget(self.levels)
        outer.addLayout(body, 1)
        self.footer = QtWidgets.QLabel(self)
        self.footer.setObjectName("Footer")
        outer.addWidget(self.footer)
        self._snapshot: Snapshot | None = None

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        cur = snapshot.current
        models = {r.model.name for r in snapshot.rows if r.result is not None}
        self.title.setText(f"GPU memory of fine-tuning {cur.model.name}" if len(models) <= 1
                           else "GPU memory of fine-tuning: scenario comparison")
        if cur.setup is not None:
            self.subtitle.setText("Current setup: " + setup_summary(cur.model, cur.setup, snapshot.gpu))
        else:
            self.subtitle.setText("")
        self.chart.set_snapshot(snapshot)
        self.levels.setText(self._levels_html(snapshot))
        unit = snapshot.unit
        self.footer.setText(
            f"VRAM Lab {__version__} · analytical estimate · bars: {snapshot.level.label}, per GPU · "
            f"{UNIT_NOTE.get(unit, unit.value)} · {dt.date.today().isoformat()}"
        )

    def _levels_html(self, snapshot: Snapshot) -> str:
        unit = snapshot.unit
        theme = LIGHT
        head = "".join(f"<th align='right' style='padding:4px 8px'>{escape(lv.short.capitalize())}</th>"
                       for lv in MemLevel)
        rows = []
        for r in snapshot.rows:
            if r.result is None:
                cells = "<td colspan='4' style='padding:4px 8px'>invalid</td>"
            else:
                v = verdict(r.result, snapshot.gpu, unit)
                mark = {"fits": f"<span style='color:{theme.good}'>✔</span>",
                        "nofit": f"<span style='color:{theme.bad}'>✘</span>"}.get(v.state, "")
                cells = "".join(f"<td align='right' style='padding:4px 8px'>"
                                f"{fmt_bytes(r.result.bytes_at(lv), unit, suffix=False)}</td>" for lv in MemLevel)
                cells += f"<td align='center' style='padding:4px 4px'>{mark}</td>"
            weight = "700" if r.is_current else "400"
            rows.append(f"<tr><td style='padding:4px 8px; font-weight:{weight}'>{escape(r.name)}</td>{cells}</tr>")
        gpu = snapshot.gpu
        cap = f"{escape(gpu.name)}: {fmt_bytes(gpu.memory_bytes, unit)}" if gpu else "no GPU chosen"
        return (
            f"<div style='font-size:13pt'><b>Peak per GPU, {unit.value}</b></div>"
            f"<table style='font-size:12pt; margin-top:6px' cellspacing='0'>"
            f"<tr><th align='left' style='padding:4px 8px'>Scenario</th>{head}"
            f"<th align='center' style='padding:4px 4px'>Fits</th></tr>"
            + "".join(rows) + "</table>"
            f"<p style='font-size:10.5pt; color:{theme.muted}'>Tensors: torch.cuda.max_memory_allocated. "
            f"Reserved: max_memory_reserved (allocator cache). Device: what nvidia-smi shows (adds the CUDA "
            f"context and workspaces). Fits: device level against {cap}.</p>"
        )

    def render_preview(self, width: int) -> QtGui.QPixmap:
        """A scaled picture of the page for the Report tab."""
        from vramlab.app.export import render_widget_image

        image = render_widget_image(self, scale=max(0.25, width / REPORT_SIZE.width()), background="#FFFFFF")
        return QtGui.QPixmap.fromImage(image)
