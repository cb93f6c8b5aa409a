"""Memory through the training step: the peak of every phase (load, forward, backward, optimizer of steps 1
and 2) for one scenario, split by kind, the overall peak outlined. "Simulate" runs the real architecture
on fake tensors in a worker thread and then shows it beside the estimate, with the per-kind residual and
the largest tensors alive at the simulated peak."""

from __future__ import annotations

from collections.abc import Sequence

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.simulation import SimulationController
from vramlab.app.state import CURRENT_KEY, AppState, Row, Snapshot
from vramlab.app.theme import Theme
from vramlab.app.views.bars import Stack, StackedBarPlot, kind_segments
from vramlab.app.views.breakdown import legend_entries, thin_kinds_note
from vramlab.app.views.legend import LegendEntry, LegendWidget
from vramlab.app.views.text_table import RIGHT, Cell, TextTable
from vramlab.core.kinds import KIND_ORDER
from vramlab.core.report import phase_label, setup_summary
from vramlab.core.result import MemLevel, MemoryResult, PhasePeak
from vramlab.core.units import Unit, fmt_auto, fmt_bytes

PAIR_OFFSET = 0.19


def phase_stacks(estimated: MemoryResult, simulated: MemoryResult | None, unit: Unit = Unit.GIB) -> list[Stack]:
    """One bar per phase of the estimate (and the simulation beside it when there is one)."""
    keys = [p.key for p in estimated.phases]
    if simulated is not None:
        keys += [p.key for p in simulated.phases if p.key not in keys]
    out: list[Stack] = []

    def add(result: MemoryResult, peak: PhasePeak, x: float, pale: bool, what: str) -> None:
        is_peak = peak.key == result.peak_phase
        out.append(Stack(
            x, phase_label(peak.key, multiline=True), f"{phase_label(peak.key)} ({what})",
            tuple(kind_segments(peak.components)), peak.bytes, MemLevel.ALLOCATED, pale=pale, highlight=is_peak,
            # the simulation's bar is labelled only where its peak is not the estimate's (the pair shares a slot)
            caption=(("▲ peak\n" if is_peak else "") + fmt_bytes(peak.bytes, unit, 1 if simulated else 2)) if not pale
            else ("▲ sim. peak" if is_peak and peak.key != estimated.peak_phase else "-"),  # "-": no caption
            note=f"{what}: live tensors at the highest moment of this phase",
        ))

    for i, key in enumerate(keys):
        est = next((p for p in estimated.phases if p.key == key), None)
        sim = next((p for p in simulated.phases if p.key == key), None) if simulated else None
        if est is not None:
            add(estimated, est, i - PAIR_OFFSET if simulated else i, False, "estimate")
        if sim is not None and simulated is not None:
            add(simulated, sim, i + PAIR_OFFSET, True, "simulation")
    return out


class PhasesView(QtWidgets.QWidget):
    def __init__(self, state: AppState, sims: SimulationController, theme: Theme,
                 parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.sims = sims
        self._snapshot: Snapshot | None = None
        self._key = CURRENT_KEY
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        bar = QtWidgets.QHBoxLayout()
        bar.addWidget(QtWidgets.QLabel("Scenario"))
        self.scenario_combo = QtWidgets.QComboBox()
        self.scenario_combo.setObjectName("phase_scenario")
        self.scenario_combo.setToolTip("Which scenario's phases to show")
        self.scenario_combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.scenario_combo.activated.connect(self._on_scenario)
        bar.addWidget(self.scenario_combo)
        self.simulate_button = QtWidgets.QPushButton("Simulate")
        self.simulate_button.setToolTip("Run this scenario's real architecture for two training steps on fake "
                                        "tensors (CPU only, a few seconds) and compare with the estimate "
                                        "(Ctrl+R)")
        self.simulate_button.clicked.connect(self.simulate)
        bar.addWidget(self.simulate_button)
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop the simulation at the next phase boundary")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.sims.cancel)
        bar.addWidget(self.cancel_button)
        self.progress = QtWidgets.QLabel("")
        self.progress.setObjectName("Facts")
        self.progress.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
        bar.addWidget(self.progress, 1)
        layout.addLayout(bar)
        self.summary = QtWidgets.QLabel("")
        self.summary.setObjectName("Facts")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)

        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical, self)
        top = QtWidgets.QWidget()
        self.chart_area = top  # the plot and its legend: what an export of this tab renders
        tl = QtWidgets.QVBoxLayout(top)
        tl.setContentsMargins(0, 0, 0, 0)
        self.plot = StackedBarPlot(theme, top, bar_width=0.76)
        self.plot.setMinimumHeight(200)
        # three short lines: in two, the first ran past the top of the plot at 800 px high (issue 27)
        self.plot.set_axis_label("Tensors at each phase's peak<br>(max_memory_allocated)<br>GiB per GPU")
        tl.addWidget(self.plot, 1)
        self.legend = LegendWidget(top)
        tl.addWidget(self.legend)
        self.thin_note = QtWidgets.QLabel(top)
        self.thin_note.setObjectName("Facts")
        self.thin_note.setWordWrap(True)
        tl.addWidget(self.thin_note)
        split.addWidget(top)

        bottom = QtWidgets.QWidget()
        bl = QtWidgets.QHBoxLayout(bottom)
        bl.setContentsMargins(0, 0, 0, 0)
        self.residuals = TextTable(self._residual_headers(Unit.GIB), bottom)
        self.residuals.setObjectName("Residuals")
        self.residuals.table_model.two_line_headers = True  # the unit under the name: narrower columns
        self.alive = TextTable(["Size", "Kind", "Tensor", "dtype", "Shape", "Created in"], bottom)
        self.alive.setObjectName("AliveAtPeak")
        self.alive.horizontalHeader().setStretchLastSection(True)
        # the residuals as wide as their numbers; the tensors take the rest, and long tensor names may scroll
        # sideways with their size, kind and name kept in view (issue 27)
        self.alive.setProperty("scrollsSideways", 3)
        for table, title, stretch in ((self.residuals, "Estimate vs simulation (tensor level)", 0),
                                      (self.alive, "Largest tensors alive at the simulated peak", 1)):
            box = QtWidgets.QGroupBox(title)
            QtWidgets.QVBoxLayout(box).addWidget(table)
            bl.addWidget(box, stretch)
        split.addWidget(bottom)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        layout.addWidget(split, 1)

        state.computed.connect(self.set_snapshot)
        state.simulationsChanged.connect(self.refresh)
        sims.runningChanged.connect(self._on_running)
        sims.progress.connect(self._on_progress)
        sims.failed.connect(self._on_failed)
        sims.cancelled.connect(self._on_cancelled)
        sims.succeeded.connect(self._on_succeeded)

    def apply_theme(self, theme: Theme) -> None:
        self.plot.apply_theme(theme)

    # ---- selection ----------------------------------------------------------------------------------------------
    def selected_row(self) -> Row | None:
        if self._snapshot is None:
            return None
        return self._snapshot.row(self._key) or self._snapshot.current

    def select(self, key: str) -> None:
        self._key = key
        self.refresh()

    def _on_scenario(self, index: int) -> None:
        key = self.scenario_combo.itemData(index)
        if isinstance(key, str):
            self.select(key)

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        with QtCore.QSignalBlocker(self.scenario_combo):
            self.scenario_combo.clear()
            for r in snapshot.rows:
                self.scenario_combo.addItem(r.name, r.key)
            i = self.scenario_combo.findData(self._key)
            if i < 0:
                self._key = CURRENT_KEY
                i = 0
            self.scenario_combo.setCurrentIndex(i)
        self.refresh()

    # ---- drawing ----------------------------------------------------------------------------------------------------
    def simulated(self) -> MemoryResult | None:
        row = self.selected_row()
        if row is None or row.setup is None:
            return None
        return self.state.simulation_for(row.model, row.setup)

    def refresh(self) -> None:
        row = self.selected_row()
        if row is None or row.result is None:
            self.plot.set_stacks([], Unit.GIB)
            self.summary.setText(row.error if row else "")
            self._fill_residuals(None, None)
            self._fill_alive(None)
            return
        unit = self._snapshot.unit if self._snapshot else Unit.GIB
        sim = self.simulated()
        stacks = phase_stacks(row.result, sim, unit)
        self.plot.set_axis_label(f"Tensors at each phase's peak<br>(max_memory_allocated)<br>{unit.value} per GPU")
        self.plot.set_stacks(stacks, unit)
        self.legend.set_entries(self._legend(stacks))
        thin = thin_kinds_note(stacks)
        self.thin_note.setText(thin)
        self.thin_note.setVisible(bool(thin))
        text = f"{row.name}: {setup_summary(row.model, row.result.setup)}. " \
               f"Estimated peak {fmt_bytes(row.result.peak_allocated_bytes, unit)} in " \
               f"{phase_label(row.result.peak_phase).lower()}."
        if sim is not None:
            text += f" Simulated peak {fmt_bytes(sim.peak_allocated_bytes, unit)} in " \
                    f"{phase_label(sim.peak_phase).lower()} (hatched bars)."
        else:
            text += " Press Simulate to check it against the real architecture on fake tensors."
        self.summary.setText(text)
        self._fill_residuals(row.result, sim)
        self._fill_alive(sim)
        self.simulate_button.setEnabled(not self.sims.running and row.setup is not None)

    @staticmethod
    def _legend(stacks: Sequence[Stack]) -> list[LegendEntry]:
        """The breakdown's rule: a swatch for each kind a bar shows; the too-thin ones are named under it."""
        entries = legend_entries(list(stacks))
        if any(s.pale for s in stacks):
            entries.append(LegendEntry("simulation", "Hatched bar: simulation", "#B8C4CE",
                                       "Right of each estimate bar: the same phase measured by the simulation "
                                       "(the real architecture on fake tensors), in the same colours, hatched"))
        return entries

    @staticmethod
    def _residual_headers(unit: Unit) -> list[str]:
        return ["", f"Estimate [{unit.value}]", f"Simulation [{unit.value}]", f"Difference [{unit.value}]"]

    def _fill_residuals(self, est: MemoryResult | None, sim: MemoryResult | None) -> None:
        unit = self._snapshot.unit if self._snapshot else Unit.GIB
        rows: list[tuple[str, int | None, int | None]] = []
        if est is not None:
            kinds = [k for k in KIND_ORDER if est.components.get(k) or (sim and sim.components.get(k))]
            rows += [(k.label, est.components.get(k, 0), sim.components.get(k, 0) if sim else None) for k in kinds]
            rows += [(f"Peak: {lv.short}", est.bytes_at(lv), sim.bytes_at(lv) if sim else None) for lv in MemLevel]
        cells = [[label, *(Cell(fmt_bytes(v, unit, suffix=False) if v is not None else "—", RIGHT)
                           for v in (e, s, s - e if s is not None and e is not None else None))]
                 for label, e, s in rows]
        self.residuals.set_rows(cells, self._residual_headers(unit))
        self.residuals.resizeColumnsToContents()
        t = self.residuals
        need = sum(t.columnWidth(c) for c in range(t.columnCount())) + 2 * t.frameWidth() + \
            t.verticalScrollBar().sizeHint().width() + 2
        t.setMinimumWidth(need)

    def _fill_alive(self, sim: MemoryResult | None) -> None:
        rows = [[Cell(fmt_auto(a.nbytes), RIGHT, f"{a.nbytes:,} bytes"), a.kind.label, a.label,
                 a.dtype, " × ".join(str(d) for d in a.shape) or "scalar",
                 phase_label(a.created_in) if a.created_in else ""]
                for a in (sim.alive_at_peak if sim else ())]
        self.alive.set_rows(rows)
        self.alive.resizeColumnsToContents()

    # ---- simulation -------------------------------------------------------------------------------------------------
    def simulate(self) -> bool:
        row = self.selected_row()
        if row is None or row.setup is None or row.result is None or self.sims.running:
            return False
        return self.sims.start(row.model, row.setup, self.state.gpu)

    def _on_running(self, running: bool) -> None:
        self.simulate_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        if running:
            self.progress.setText("Simulating: loading torch and building the model on fake tensors…")

    def _on_progress(self, key: str, live: object) -> None:
        self.progress.setText(f"Simulating: {phase_label(key).lower()} — {fmt_bytes(int(live))} live (tensors)")

    def _on_failed(self, message: str) -> None:
        self.progress.setText(f"Simulation failed: {message}")

    def _on_cancelled(self) -> None:
        self.progress.setText("Simulation cancelled.")

    def _on_succeeded(self, result: MemoryResult) -> None:
        secs = result.timing.get("total", 0.0)
        self.progress.setText(f"Simulated in {secs:.1f} s.")
        self.state.add_simulation(result)
