"""The result panel of the "Live profile" tab: the verdict, the predicted-vs-measured table, the facts of the
run, and the buttons that save, export and calibrate (their actions are the tab's, :mod:`.live`)."""

from __future__ import annotations

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.views.text_table import CENTER, RIGHT, Cell, TextTable
from vramlab.core.live import (
    ComparisonRow,
    RunRequest,
    band_label,
    comparison_rows,
    display_unit,
    outcome_message,
    prediction_note,
    rank_lines,
    rows_table,
    rows_unit,
    verdict,
)
from vramlab.core.profiling.profile import ProfileOutcome
from vramlab.core.units import Unit, fmt_bytes

LABEL_COLUMN_PX = 160  # the result table's row names wrap beyond this


class LiveResult(QtWidgets.QGroupBox):
    """Predicted against measured for one run: per level, per kind and per phase, and a verdict."""

    def __init__(self, unit: Unit, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__("Result: predicted vs measured", parent)
        self.rows: list[ComparisonRow] = []
        col = QtWidgets.QVBoxLayout(self)
        col.setContentsMargins(6, 4, 6, 6)
        self.verdict_label = QtWidgets.QLabel("No run yet.", self)
        self.verdict_label.setObjectName("Verdict")
        self.verdict_label.setProperty("state", "unknown")
        self.verdict_label.setWordWrap(True)
        self.verdict_label.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        col.addWidget(self.verdict_label)
        row = QtWidgets.QHBoxLayout()
        row.addWidget(self._build_table(unit), 3)
        side = QtWidgets.QVBoxLayout()
        side.addWidget(self._build_facts(), 1)
        side.addLayout(self._build_buttons())
        row.addLayout(side, 1)
        col.addLayout(row, 1)
        self.set_buttons(None, None)

    def _build_table(self, unit: Unit) -> TextTable:
        headers, _ = rows_table([], unit)
        self.table = TextTable(headers, self)
        self.table.setObjectName("LiveResult")
        self.table.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.horizontalHeader().setStretchLastSection(True)
        # narrow enough for every column to show whole beside the facts at 1280 px (issue 27): the unit under
        # each number column's name, and the row names wrapped in a column of their own width
        self.table.table_model.two_line_headers = True
        self.table.setWordWrap(True)
        self.table.verticalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.table.setAlternatingRowColors(True)
        self.table.resizeColumnsToContents()
        return self.table

    def _build_facts(self) -> QtWidgets.QScrollArea:
        self.facts = QtWidgets.QLabel("", self)
        self.facts.setObjectName("Facts")
        self.facts.setWordWrap(True)
        self.facts.setAlignment(QtCore.Qt.AlignmentFlag.AlignTop | QtCore.Qt.AlignmentFlag.AlignLeft)
        self.facts.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        scroll = QtWidgets.QScrollArea(self)
        scroll.setWidget(self.facts)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setMinimumWidth(230)
        scroll.viewport().setAutoFillBackground(False)
        self.facts.setAutoFillBackground(False)
        return scroll

    def _build_buttons(self) -> QtWidgets.QGridLayout:
        grid = QtWidgets.QGridLayout()
        self.save_button = QtWidgets.QPushButton("Save result…", self)
        self.save_button.setToolTip("Save setup, outcome, prediction, comparison, live readings and an environment "
                                    "fingerprint (GPU, driver, CUDA, torch, bitsandbytes) as JSON")
        self.csv_button = QtWidgets.QPushButton("Export CSV…", self)
        self.csv_button.setToolTip("The predicted-vs-measured table as CSV (bytes)")
        self.png_button = QtWidgets.QPushButton("Export PNG…", self)
        self.png_button.setToolTip("The live plots and their legend as PNG at 2x")
        self.calibrate_button = QtWidgets.QPushButton("Save calibration", self)
        self.calibrate_button.setToolTip("Keep the measured CUDA context and allocator slack for this GPU; later "
                                         "estimates on it use them and say 'calibrated on <GPU>'")
        self.calibrate_button.setVisible(False)
        grid.addWidget(self.save_button, 0, 0)
        grid.addWidget(self.csv_button, 0, 1)
        grid.addWidget(self.png_button, 1, 0)
        grid.addWidget(self.calibrate_button, 1, 1)
        return grid

    # ---- filling it ---------------------------------------------------------------------------------------------
    def show_outcome(self, outcome: ProfileOutcome, request: RunRequest | None, unit: Unit,
                     lost_at_s: float | None, peak_rss: float | None) -> None:
        """The verdict, table, facts and buttons of ``outcome`` (of ``request``); ``lost_at_s`` is when NVML
        lost the GPU during the run, ``peak_rss`` the highest resident memory sampled."""
        predicted = request.predicted if request is not None else None
        gpu_mem = None
        if outcome.device == "cuda":
            gpu_mem = outcome.info.get("device_total_bytes") or (
                request.gpu.memory_bytes if request and request.gpu else None)
        v = verdict(outcome, predicted, gpu_mem, unit)
        text = v.text
        if outcome.ok and lost_at_s is not None:
            text += f" NVML lost the GPU at {lost_at_s:.1f} s: device-level readings after that are missing."
        if not outcome.ok:
            kind, text = outcome_message(outcome, unit, request.timeout_s if request else None)
            text = ("✘ " if kind == "error" else "") + text
        self.set_verdict(v.state, text)
        self.rows = comparison_rows(outcome, predicted)
        self.fill_table(unit)
        self._fill_facts(outcome, request, unit, peak_rss)
        self.set_buttons(outcome, request)

    def clear(self) -> None:
        self.rows = []
        self.table.set_rows([])
        self.facts.setText("")
        self.set_verdict("unknown", "Running…")
        self.set_buttons(None, None)

    def set_verdict(self, state: str, text: str) -> None:
        self.verdict_label.setText(text)
        if self.verdict_label.property("state") != state:
            self.verdict_label.setProperty("state", state)
            self.verdict_label.style().unpolish(self.verdict_label)
            self.verdict_label.style().polish(self.verdict_label)

    def verdict_text(self) -> str:
        return self.verdict_label.text()

    def fill_table(self, unit: Unit) -> None:
        unit = rows_unit(self.rows, unit)
        headers, cells = rows_table(self.rows, unit)
        rows: list[list[Cell]] = []
        spans: list[int] = []
        section = None
        for row, texts in zip(self.rows, cells):
            if row.section != section:  # a section's title, bold, across the table
                section = row.section
                spans.append(len(rows))
                rows.append([Cell(section, bold=True)])
            line = []
            for j, shown in enumerate(texts):
                text, align, tip = shown, (RIGHT if 1 <= j <= 4 else None), ""
                if j in (1, 2, 3):
                    v = (row.predicted_bytes, row.measured_bytes, row.residual_bytes)[j - 1]
                    if v is not None:
                        tip = f"{v:,} bytes ({row.level} level)" if row.level != "host" \
                            else f"{v:,} bytes (host memory)"
                if j == 5:  # the note as a marker, its text in the tooltip (and the CSV)
                    text, align = ("…" if row.note else ""), CENTER  # a glyph every font has
                if j in (0, 5) and row.note:
                    tip = row.note
                line.append(Cell(text, align, tip))
            rows.append(line)
        self.table.set_rows(rows, headers, spans)
        self.table.resizeColumnsToContents()
        names = self.table.horizontalHeader()
        names.resizeSection(0, min(names.sectionSize(0), LABEL_COLUMN_PX))  # longer names wrap

    def _fill_facts(self, outcome: ProfileOutcome, request: RunRequest | None, unit: Unit,
                    peak_rss: float | None) -> None:
        unit = rows_unit(self.rows, unit)
        lines: list[str] = []
        if outcome.context_bytes is not None:
            lines.append(f"Measured CUDA context: <b>{fmt_bytes(outcome.context_bytes, unit)}</b> (NVML, device level)")
        if outcome.device_used_peak_bytes is not None:
            lines.append(f"Whole GPU at its peak: {fmt_bytes(outcome.device_used_peak_bytes, unit)} (NVML, all "
                         "processes)")
        if peak_rss is not None:
            lines.append(f"Process RSS, highest sample: {fmt_bytes(peak_rss, display_unit(peak_rss, unit))} "
                         "(host, psutil)")
        if outcome.step_time_s:
            lines.append(f"Step 2: {outcome.step_time_s:.3f} s, {outcome.tokens_per_s:,.0f} tokens/s")
        if outcome.result is not None:
            res = outcome.result
            lines.append(f"Peak in {band_label(res.peak_phase, short=False).lower()}; "
                         f"{res.trainable_params:,} of {res.total_params:,} parameters trained")
        lines.extend(rank_lines(outcome, unit))
        if request is not None:
            lines.append(prediction_note(request.device))
        env = outcome.info or {}
        bits = [f"{k} {env[k]}" for k in ("cuda", "torch", "bitsandbytes") if env.get(k)]
        if bits:
            lines.append(f"Ran on {env.get('gpu') or outcome.device} with {', '.join(bits)}")
        if env.get("quantization"):  # bitsandbytes' own kernels, or the emulation: never left unsaid
            lines.append(f"Quantized layers and 8-bit optimizer: {env['quantization']}")
        if env.get("sdpa_backend"):
            lines.append(f"Attention kernel (SDPA): {env['sdpa_backend']}")
        self.facts.setText("<br>".join(lines))

    def set_buttons(self, outcome: ProfileOutcome | None, request: RunRequest | None) -> None:
        o = outcome
        has = o is not None and request is not None
        self.save_button.setEnabled(has)
        self.csv_button.setEnabled(bool(self.rows))
        self.png_button.setEnabled(has)
        can_calibrate = bool(o is not None and o.ok and o.device == "cuda" and o.context_bytes)
        if can_calibrate and o is not None:
            self.calibrate_button.setText(f"Save calibration for {o.info.get('gpu', 'this GPU')}")
        self.calibrate_button.setVisible(can_calibrate)
