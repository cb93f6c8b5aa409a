"""The Advisor tab: what to change to fit, the largest batch and sequence, trade-off sweeps, and the checks to
run before training.

Every number comes from :mod:`vramlab.core.advisor` (each an estimate of a changed setup):

* **Ranked savings** — :func:`~vramlab.core.advisor.savings`: each applicable change with the memory it saves
  at the device level, its cost, and whether the changed setup fits the chosen GPU. Apply (double-click,
  Enter or the button) sets the changed setup through :class:`~vramlab.app.state.AppState`, so every view
  follows; *Undo apply* (Ctrl+Z in this tab) brings back the setup before the last apply.
* **Fit search** — :func:`~vramlab.core.advisor.fit_search` with a margin and a target effective batch.
* **Sweeps** — :func:`~vramlab.core.advisor.sweep`, drawn by :class:`~vramlab.app.views.sweeps.SweepChart`.
* **Before you train** — :func:`~vramlab.core.advisor.allocator_advice` and
  :func:`~vramlab.core.advisor.checklist`.

The table model and the panels are in :mod:`vramlab.app.views.advisor_parts`, the chart in
:mod:`vramlab.app.views.sweeps`, the worker in :mod:`vramlab.app.advice`; this module owns
when to compute, what is stale, Apply and Undo, and the exports.

Timing: the advice is computed on a worker thread (:mod:`vramlab.app.advice`), only while
the tab is shown, 120 ms after the last change; the parts appear as they are ready (checklist, savings, fit
search, sweep) and the old advice stays on screen until then, so typing never waits for it. Measured on
the default Llama-2-7B LoRA setup once the estimator knows the setup's structure: savings 5-25 ms, fit
search 5-15 ms, a sweep 3-15 ms; setups with chunked loss or MoE models take 0.1-1 s per part (see the
worker module).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from vramlab.app.advice import PARTS, AdviceAnswer, AdviceController, AdviceRequest, compute_advice
from vramlab.app.export import save_png, save_svg, write_text
from vramlab.app.gpus import Detection
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.state import AppState, Snapshot
from vramlab.app.theme import Theme
from vramlab.app.views.advisor_parts import ChecklistPanel, FitPanel, SavingsModel, SavingsTable
from vramlab.app.views.banner import Banner
from vramlab.app.views.sweeps import SWEEP_FIELDS, SWEEP_NOUNS, SweepChart, sweep_label, sweep_table
from vramlab.core.advisor import FitAnswer, Saving, Sweep
from vramlab.core.report import gui_message, to_csv, verdict
from vramlab.core.result import MemLevel, MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import Unit, fmt_bytes, fmt_count

DEBOUNCE_MS = 120
Verifier = Callable[[TrainingSetup], object]  # MainWindow.run_profile(setup)


# ---- the tab ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Undo:
    model: ModelSpec
    setup: TrainingSetup
    what: str


@dataclass(frozen=True)
class _Context:
    """What one round of advice is computed for (the snapshot's current row)."""

    model: ModelSpec
    setup: TrainingSetup
    result: MemoryResult
    gpu: GpuSpec | None


class AdvisorView(QtWidgets.QWidget):
    message = QtCore.Signal(str)  # status-bar text

    def __init__(self, state: AppState, theme: Theme, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self._theme = theme
        self._snapshot: Snapshot | None = None
        self._context: _Context | None = None  # the setup the advice is for (the snapshot's current row)
        self._stale: set[str] = set(PARTS)  # parts not yet computed for the context and the inputs
        self._generation = 0
        self._undo: list[_Undo] = []
        self._detection: Detection | None = None
        self._verifier: Verifier | None = None
        self.fit_answer: FitAnswer | None = None
        self._suggestion: MemoryResult | None = None
        self._fit_error = ""
        self._savings_error = ""
        self._checks: tuple[tuple[str, ...], tuple[tuple[str, str], ...], str] | None = None
        self._sweeps: OrderedDict[tuple[Any, ...], Sweep] = OrderedDict()
        self.timings: dict[str, float] = {}  # seconds of the last computation of each part
        self._ctl = AdviceController(self)
        self._ctl.answered.connect(self._on_answer)
        self._ctl.failed.connect(self._on_failed)
        self._ctl.runningChanged.connect(self._update_busy)
        self._build()
        self._timer = QtCore.QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(DEBOUNCE_MS)
        self._timer.timeout.connect(self._send)
        state.computed.connect(self._on_computed)
        self.apply_theme(theme)

    # ---- construction ------------------------------------------------------------------------------------------
    def _build(self) -> None:
        outer = QtWidgets.QVBoxLayout(self)
        outer.setContentsMargins(0, 4, 0, 0)
        outer.setSpacing(4)
        self.banner = Banner(self, closable=False)
        outer.addWidget(self.banner)
        self.verdict = QtWidgets.QLabel(self)
        self.verdict.setObjectName("Verdict")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        top = QtWidgets.QHBoxLayout()
        top.addWidget(self.verdict, 1)
        self.busy = QtWidgets.QLabel(self)
        self.busy.setObjectName("Facts")
        self.busy.setVisible(False)
        top.addWidget(self.busy, 0, QtCore.Qt.AlignmentFlag.AlignTop)
        outer.addLayout(top)

        # the ranked savings across the whole tab (five columns need it: beside the fit search, at 1280 px, the
        # table scrolled sideways), the sweeps and the fit search side by side below
        self.vsplit = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical, self)
        self.hsplit = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal, self.vsplit)
        # ranked savings
        box = QtWidgets.QGroupBox("Ranked savings", self.vsplit)
        self.savings_box = box
        bl = QtWidgets.QVBoxLayout(box)
        # what the numbers are, with the buttons beside it: the rows keep the height (at 1280x800, four show)
        row = QtWidgets.QHBoxLayout()
        self.savings_where = QtWidgets.QLabel("Device level (nvidia-smi), per GPU", box)
        self.savings_where.setObjectName("Facts")
        self.savings_where.setWordWrap(True)
        # wrapping beside the buttons, without widening the tab's minimum
        self.savings_where.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred)
        row.addWidget(self.savings_where, 1)
        self.apply_button = QtWidgets.QPushButton("Apply", box)
        self.apply_button.setToolTip("Apply the selected change to the current setup (double-click or Enter); "
                                     "every view follows")
        self.apply_button.clicked.connect(lambda: self.apply_saving(self.selected_row()))
        self.undo_action = QtGui.QAction("Undo apply", self)
        self.undo_action.setShortcut(QtGui.QKeySequence("Ctrl+Z"))
        self.undo_action.setShortcutContext(QtCore.Qt.ShortcutContext.WidgetWithChildrenShortcut)
        self.undo_action.triggered.connect(lambda _=False: self.undo())
        self.addAction(self.undo_action)
        self.undo_button = QtWidgets.QToolButton(box)
        self.undo_button.setDefaultAction(self.undo_action)
        self.undo_button.setToolButtonStyle(QtCore.Qt.ToolButtonStyle.ToolButtonTextOnly)
        row.addWidget(self.apply_button)
        row.addWidget(self.undo_button)
        bl.addLayout(row)
        self.savings_model = SavingsModel(self)
        self.table = SavingsTable(self.savings_model, box)  # as wide as the tab: no sideways scrolling at 1280 px
        self.table.doubleClicked.connect(lambda index: self.apply_saving(index.row()))
        bl.addWidget(self.table, 1)
        self.saving_detail = QtWidgets.QLabel(box)
        self.saving_detail.setObjectName("SavingDetail")
        self.saving_detail.setWordWrap(True)
        self.saving_detail.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        bl.addWidget(self.saving_detail)
        self.savings_hint = QtWidgets.QLabel(box)  # why there are no rows, when there are none
        self.savings_hint.setObjectName("Facts")
        self.savings_hint.setWordWrap(True)
        bl.addWidget(self.savings_hint)
        enter = QtGui.QShortcut(QtGui.QKeySequence(QtCore.Qt.Key.Key_Return), self.table)
        enter.setContext(QtCore.Qt.ShortcutContext.WidgetShortcut)
        enter.activated.connect(lambda: self.apply_saving(self.selected_row()))
        self.table.selectionModel().selectionChanged.connect(self._update_actions)
        self.table.selectionModel().selectionChanged.connect(self._show_detail)
        self.vsplit.addWidget(box)

        # sweeps
        sbox = QtWidgets.QGroupBox("Trade-off sweeps", self.hsplit)
        sl = QtWidgets.QVBoxLayout(sbox)
        bar = QtWidgets.QHBoxLayout()
        bar.addWidget(QtWidgets.QLabel("Sweep", sbox))
        self.sweep_combo = QtWidgets.QComboBox(sbox)
        self.sweep_combo.setObjectName("sweep_field")
        self.sweep_combo.setToolTip("Which setting to vary; everything else stays as in the current setup")
        for key, (label, _scale) in SWEEP_FIELDS.items():
            self.sweep_combo.addItem(label, key)
        self.sweep_combo.currentIndexChanged.connect(lambda _i: self._sweep_changed())
        self.sweep_combo.setMinimumContentsLength(12)
        self.sweep_combo.setSizeAdjustPolicy(
            QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        bar.addWidget(self.sweep_combo, 1)  # the bar's whole width: its longest choice shows whole
        self.export_button = QtWidgets.QToolButton(sbox)
        self.export_button.setText("Export")
        self.export_button.setToolTip("Export the sweep chart (PNG, SVG) or its numbers (CSV)")
        self.export_button.setPopupMode(QtWidgets.QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QtWidgets.QMenu(self.export_button)
        self.sweep_actions: dict[str, QtGui.QAction] = {}
        for fmt, text in (("png", "Chart as PNG (2x)…"), ("svg", "Chart as SVG…"),
                          ("csv", "Numbers as CSV (every level, in bytes too)…")):
            act = menu.addAction(text)
            act.triggered.connect(lambda _=False, f=fmt: self.export_sweep_dialog(f))
            self.sweep_actions[fmt] = act
        self.export_button.setMenu(menu)
        bar.addWidget(self.export_button)
        sl.addLayout(bar)
        self.chart = SweepChart(self._theme, sbox)
        sl.addWidget(self.chart, 1)
        self.vsplit.setChildrenCollapsible(False)  # never squeeze the table or the plots below their minimum
        self.hsplit.setChildrenCollapsible(False)

        # right column: fit search and checklist, scrollable
        right = QtWidgets.QWidget()
        rl = QtWidgets.QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 4, 0)
        self.fit = FitPanel(right)
        self.fit.changed.connect(self._fit_inputs_changed)
        self.fit.use_button.clicked.connect(self.use_fit)
        self.fit.seq_button.clicked.connect(self.use_fit_sequence)
        self.fit.verify_button.clicked.connect(self.verify_on_gpu)
        rl.addWidget(self.fit)
        self.checks = ChecklistPanel(right)
        rl.addWidget(self.checks)
        rl.addStretch(1)
        scroll = QtWidgets.QScrollArea(self.hsplit)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(right)
        scroll.setMinimumWidth(300)  # the fit search's answers wrap less beside the sweeps
        self.hsplit.addWidget(sbox)
        self.hsplit.addWidget(scroll)
        self.hsplit.setStretchFactor(0, 3)
        self.hsplit.setStretchFactor(1, 1)
        self.hsplit.setSizes([640, 340])
        self.vsplit.addWidget(self.hsplit)
        self.vsplit.setStretchFactor(0, 1)
        self.vsplit.setStretchFactor(1, 1)
        self.vsplit.setSizes([350, 410])
        outer.addWidget(self.vsplit, 1)
        self._update_actions()

    def apply_theme(self, theme: Theme) -> None:
        self._theme = theme
        self.chart.apply_theme(theme)
        self.savings_model.set_colors(theme)
        self.checks.set_muted(theme.muted)

    # ---- GPU verification ---------------------------------------------------------------------------------------
    def set_detection(self, detection: Detection | None, verifier: Verifier | None) -> None:
        """The window's GPU detection and its profiler (``MainWindow.run_profile`` when it exists). "Verify
        on GPU" shows only with both: a CUDA GPU on this machine and something that can profile on it."""
        self._detection = detection
        self._verifier = verifier
        self._update_actions()

    @property
    def can_verify(self) -> bool:
        return bool(self._detection and self._detection.gpus) and callable(self._verifier)

    def verify_on_gpu(self) -> bool:
        self.flush()
        ans = self.fit_answer
        if not self.can_verify or ans is None or ans.suggestion is None or self._verifier is None:
            return False
        ctx = self._context
        self._verifier(ans.suggestion)  # MainWindow.run_profile loads the setup into the editor and profiles it
        if ctx is not None and self.state.current_setup() != ctx.setup:
            self._undo.append(_Undo(ctx.model, ctx.setup, "the fit search's suggestion (loaded to verify it)"))
        self._update_actions()
        self.message.emit("Profiling the suggested setup on this machine's GPU…")
        return True

    # ---- state -> advice -------------------------------------------------------------------------------------------
    @property
    def invalid(self) -> bool:
        return bool(self._snapshot and self._snapshot.error)

    @property
    def pending_parts(self) -> frozenset[str]:
        """Parts of the advice not yet computed for the current setup and inputs."""
        return frozenset(self._stale)

    @property
    def controller(self) -> AdviceController:
        return self._ctl

    def _context_of(self, snapshot: Snapshot) -> _Context | None:
        cur = snapshot.current
        if cur.setup is None or cur.result is None:
            return None
        return _Context(cur.model, cur.setup, cur.result, snapshot.gpu)

    def _on_computed(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self._show_banner()
        ctx = self._context_of(snapshot)
        if ctx == self._context:  # level, unit or names changed: redraw what is there
            self._redisplay()
            return
        old = self._context
        if ctx is not None and old is not None and (ctx.model, ctx.setup, ctx.gpu) == (old.model, old.setup, old.gpu):
            # the same setup with its allocator replay done: savings, fit and sweep already use the replay;
            # only the allocator advice reads the snapshot's result
            self._context = ctx
            if "savings" not in self._stale:  # the verdict reads the (now replayed) device level
                self._set_verdict(ctx, self.savings_model.savings, self._savings_error)
            self._stale.add("checks")
            self._schedule()
            return
        self._context = ctx
        self._stale = set(PARTS)
        if ctx is None:
            self._clear()
            return
        self._use_cached_sweep()
        self._schedule()

    def _schedule(self, delay_ms: int = DEBOUNCE_MS) -> None:
        """Ask the worker for the stale parts ``delay_ms`` after the last change, if the tab is shown."""
        if self._stale and self._context is not None and self.isVisible():
            # a throttle, not a debounce: while edits keep coming (a dragged slider) the advice is asked at
            # most every DEBOUNCE_MS, for the setup of that moment, instead of only once the edits stop
            if not self._timer.isActive() or delay_ms < self._timer.remainingTime():
                self._timer.start(delay_ms)
        self._update_busy()

    def showEvent(self, event: QtGui.QShowEvent) -> None:  # noqa: N802
        super().showEvent(event)
        snapshot = self.state.snapshot  # the window may have computed one before this view listened
        if snapshot is not self._snapshot:
            self._on_computed(snapshot)
        self._schedule(0)

    def _request(self) -> AdviceRequest | None:
        ctx = self._context
        if ctx is None or not self._stale:
            return None
        self._generation += 1
        return AdviceRequest(ctx.model, ctx.setup, ctx.result, ctx.gpu, self.fit.margin.value() / 100,
                             self.fit.target_batch(ctx.setup), self.sweep_field(), frozenset(self._stale),
                             self._generation, allocator=self.state.replay)

    def _send(self) -> None:
        if not self.isVisible():  # hidden since: showing the tab asks again
            return
        req = self._request()
        if req is not None:
            self._ctl.request(req)

    def flush(self) -> None:
        """Bring every part of the advice up to date now, on this thread (tests, exports, Apply)."""
        self._timer.stop()
        snapshot = self.state.flush()
        if snapshot is not self._snapshot:
            self._on_computed(snapshot)
        self._timer.stop()  # the state's flush may have scheduled a request: everything is computed here
        req = self._request()
        if req is not None:
            self._ctl.cancel()
            ans = compute_advice(req)
            if ans is not None:
                self._on_answer(ans)

    def _on_answer(self, ans: AdviceAnswer) -> None:
        """Show the parts of ``ans`` that are still wanted: for the current setup and the current inputs."""
        ctx, req = self._context, ans.request
        if ctx is None or (req.model, req.gpu) != (ctx.model, ctx.gpu):
            return
        if (req.setup, req.result) != (ctx.setup, ctx.result):
            self._show_interim(ans)
            return
        for part in PARTS:
            if part not in ans.done or part not in self._stale:
                continue
            if part == "fit" and (req.margin, req.target_batch) != (self.fit.margin.value() / 100,
                                                                    self.fit.target_batch(ctx.setup)):
                continue
            if part == "sweep" and req.sweep_field != self.sweep_field():
                continue
            self._stale.discard(part)
            error = ans.errors.get(part, "")
            if part == "checks":
                self._show_checks(ans.advice or (), ans.checklist or (), error)
            elif part == "savings":
                self._show_savings(ans.savings or (), error)
            elif part == "fit":
                self._show_fit(ans.fit, ans.suggestion, error)
            elif ans.sweep is not None:
                self._sweeps[(ctx.model, ctx.setup, ctx.gpu, req.sweep_field)] = ans.sweep
                if len(self._sweeps) > 32:
                    self._sweeps.popitem(last=False)
                self.chart.set_data(ans.sweep, self._level, self._unit)
            else:
                self.chart.title.setText(escape(error))
        self.timings.update(ans.seconds)
        self._update_busy()
        self._update_actions()

    def _show_interim(self, ans: AdviceAnswer) -> None:
        """While a control is dragged, draw the sweep and the fit search of the setup just passed (same model and
        GPU): they follow the drag a round behind instead of waiting for it to end. The parts stay stale, so the
        answer for the setup the drag ends on replaces them; Apply and "Use" flush to that answer first."""
        req = ans.request
        if "sweep" in ans.done and ans.sweep is not None and req.sweep_field == self.sweep_field():
            self._sweeps[(req.model, req.setup, req.gpu, req.sweep_field)] = ans.sweep
            if len(self._sweeps) > 32:
                self._sweeps.popitem(last=False)
            self.chart.set_data(ans.sweep, self._level, self._unit)
        if "fit" in ans.done and req.margin == self.fit.margin.value() / 100:
            self._show_fit(ans.fit, ans.suggestion, ans.errors.get("fit", ""))
        self._update_busy()

    def _on_failed(self, text: str) -> None:
        self.message.emit(text)
        self._update_busy()

    @property
    def _unit(self) -> Unit:
        return self._snapshot.unit if self._snapshot else Unit.GIB

    @property
    def _level(self) -> MemLevel:
        return self._snapshot.level if self._snapshot else MemLevel.DEVICE

    def _update_busy(self, *_: object) -> None:
        busy = bool(self._stale) and self._context is not None
        self.busy.setVisible(busy)
        if busy:
            self.busy.setText("Updating the advice for the changed setup…" if self._ctl.running
                              else "The advice will update when the setup settles…")

    def _show_banner(self) -> None:
        snap = self._snapshot
        if snap is not None and snap.error:
            kept = " The advice below is for the last valid setup; Apply is off until the setup is valid." \
                if snap.current.result is not None else ""
            self.banner.show_message(f"{gui_message(snap.error)}{kept}", "info" if snap.tracing else "error")
        else:
            self.banner.clear()
        self._update_actions()

    def _clear(self) -> None:
        self._ctl.cancel()
        self.savings_model.set_savings([], None, self._unit, None)
        self.fit_answer = None
        self._suggestion = None
        self.fit.show_answer(None, "", self._unit, None, None)
        self.verdict.setText("")
        self._update_busy()
        self._update_actions()

    def _show_savings(self, items: Sequence[Saving], error: str = "") -> None:
        ctx = self._context
        assert ctx is not None
        selected = self.savings_model.saving_at(self.selected_row())
        self.savings_model.set_savings(items, ctx.gpu, self._unit, ctx.model)
        if selected is not None and (i := self.savings_model.row_of(selected.key)) >= 0:
            self.table.selectRow(i)
        elif self.savings_model.rowCount():
            self.table.selectRow(0)
        self._savings_error = error
        self._set_verdict(ctx, items, error)
        self._show_detail()

    def _set_verdict(self, ctx: _Context, items: Sequence[Saving], error: str = "") -> None:
        unit = self._unit
        v = verdict(ctx.result, ctx.gpu, unit)
        text = v.text
        if ctx.gpu is not None and v.state == "nofit" and "savings" not in self._stale:
            making = sum(1 for s in items if s.fits)
            text += (f" — {making} of the changes below make it fit on their own" if making
                     else " — no single change below makes it fit; combine them, or choose a larger GPU")
        if self.verdict.property("state") != v.state:
            self.verdict.setProperty("state", v.state)
            self.verdict.style().unpolish(self.verdict)
            self.verdict.style().polish(self.verdict)
        self.verdict.setText(text)
        on = f"On {ctx.gpu.name}" if ctx.gpu else "No GPU chosen"
        self.savings_where.setText(f"{on} · saved at the device level (nvidia-smi), {unit.value} per GPU, "
                                   "largest first")
        if error:
            self.savings_hint.setText(error)
        elif not items:
            self.savings_hint.setText("No change the advisor knows saves memory for this setup.")
        else:  # how to apply a row: the Apply button beside the table says it (its tooltip)
            self.savings_hint.setText("")
        self.savings_hint.setVisible(bool(self.savings_hint.text()))

    def _show_fit(self, ans: FitAnswer | None, suggestion: MemoryResult | None, error: str = "") -> None:
        ctx = self._context
        self.fit_answer, self._suggestion, self._fit_error = ans, suggestion, error
        self.fit.show_answer(ans, error, self._unit, ctx.setup if ctx else None, suggestion)

    def _fit_inputs_changed(self) -> None:
        if self._context is not None:
            self._stale.add("fit")
            self._schedule()

    def _show_checks(self, advice: Sequence[str], items: Sequence[tuple[str, str]], error: str = "") -> None:
        ctx = self._context
        assert ctx is not None
        self._checks = (tuple(advice), tuple(items), error)
        self.checks.set_advice(advice, ctx.result, self._unit)
        self.checks.set_items(items if not error else [("Checklist unavailable", error)])

    def _use_cached_sweep(self) -> bool:
        ctx = self._context
        data = self._sweeps.get((ctx.model, ctx.setup, ctx.gpu, self.sweep_field())) if ctx else None
        if data is None:
            return False
        self._sweeps.move_to_end((data.model, data.setup, data.gpu, data.field))
        self.chart.set_data(data, self._level, self._unit)
        self._stale.discard("sweep")
        return True

    def _sweep_changed(self) -> None:
        if self._context is None:
            return
        if not self._use_cached_sweep():
            self._stale.add("sweep")
            self._schedule(0)
        self._update_busy()

    def _redisplay(self) -> None:
        ctx = self._context
        if ctx is None:
            return
        self.savings_model.set_unit(self._unit)
        self._set_verdict(ctx, self.savings_model.savings, self._savings_error)
        self._show_detail()
        if "fit" not in self._stale:
            self.fit.show_answer(self.fit_answer, self._fit_error, self._unit, ctx.setup, self._suggestion)
        if self.chart.data is not None:
            self.chart.set_data(self.chart.data, self._level, self._unit)
        if self._checks is not None:
            self.checks.set_advice(self._checks[0], ctx.result, self._unit)

    def sweep_field(self) -> str:
        return str(self.sweep_combo.currentData())

    def set_sweep_field(self, field: str) -> None:
        self.sweep_combo.setCurrentIndex(self.sweep_combo.findData(field))

    def shutdown(self) -> bool:
        """Stop the worker (window closing)."""
        self._timer.stop()
        return self._ctl.shutdown()

    # ---- actions ----------------------------------------------------------------------------------------------------
    def selected_row(self) -> int:
        rows = self.table.selectionModel().selectedRows()
        return rows[0].row() if rows else -1

    def _show_detail(self, *_: object) -> None:
        s = self.savings_model.saving_at(self.selected_row())
        ctx = self._context
        if s is None or ctx is None:
            self.saving_detail.setText("")
            return
        u = self._unit
        parts = [f"<b>{escape(s.title)}</b>: saves {fmt_bytes(s.saves_bytes, u)} device used per GPU "
                 f"({fmt_bytes(s.before_bytes, u)} → {fmt_bytes(s.after_bytes, u)})"]
        if ctx.gpu is not None:
            head = ctx.gpu.memory_bytes - s.after_bytes
            parts.append(f"{'fits' if head >= 0 else 'still does not fit'} {escape(ctx.gpu.name)}, "
                         f"{fmt_bytes(abs(head), u)} {'headroom' if head >= 0 else 'short'}")
        if s.trainable_after != s.trainable_before:
            parts.append(f"trainable parameters {fmt_count(s.trainable_before)} → {fmt_count(s.trainable_after)}")
        self.saving_detail.setText("; ".join(parts) + f".<br>Cost: {escape(s.cost)}.")

    def _update_actions(self, *_: object) -> None:
        valid = not self.invalid and self._context is not None
        self.apply_button.setEnabled(valid and self.selected_row() >= 0)
        self.undo_action.setEnabled(bool(self._undo))
        if self._undo:
            self.undo_action.setToolTip(f"Back to the setup before {self._undo[-1].what} (Ctrl+Z)")
        else:
            self.undo_action.setToolTip("Nothing applied yet (Ctrl+Z)")
        ans = self.fit_answer
        has = valid and ans is not None and ans.suggestion is not None
        self.fit.use_button.setEnabled(has)
        self.fit.seq_button.setEnabled(valid and ans is not None and ans.max_seq_len > 0)
        self.fit.verify_button.setVisible(self.can_verify)
        self.fit.verify_button.setEnabled(has)
        self.table.setEnabled(self._context is not None)

    def _apply(self, setup: TrainingSetup, what: str, detail: str = "") -> bool:
        ctx = self._context
        if ctx is None or self.invalid:
            self.message.emit("Fix the setup first: the advice is for the last valid setup.")
            return False
        self._undo.append(_Undo(ctx.model, ctx.setup, what))
        del self._undo[:-20]
        self.state.set_setup(setup)
        self.state.flush()
        self.message.emit(f"Applied {what}{detail}. Undo with “Undo apply” (Ctrl+Z in the Advisor).")
        self._update_actions()
        return True

    def apply_saving(self, row: int) -> bool:
        """Apply the saving shown in ``row`` (up to date: the advice is refreshed first)."""
        chosen = self.savings_model.saving_at(row)
        self.flush()
        if chosen is None:
            return False
        row = self.savings_model.row_of(chosen.key)  # the same change, computed for the setup as it is now
        s = self.savings_model.saving_at(row)
        if s is None:
            self.message.emit(f"“{chosen.title}” no longer applies to the current setup.")
            return False
        return self._apply(s.setup, f"“{s.title}”", f": saves {fmt_bytes(s.saves_bytes, self._unit)} (device level)")

    def use_fit(self) -> bool:
        self.flush()
        ans = self.fit_answer
        if ans is None or ans.suggestion is None:
            return False
        return self._apply(ans.suggestion, f"micro batch {ans.suggestion.micro_batch} × accumulation "
                                           f"{ans.suggestion.grad_accum}")

    def use_fit_sequence(self) -> bool:
        self.flush()
        ans, ctx = self.fit_answer, self._context
        if ans is None or ctx is None or not ans.max_seq_len:
            return False
        return self._apply(ctx.setup.replace(seq_len=ans.max_seq_len), f"sequence length {ans.max_seq_len:,}")

    def undo(self) -> bool:
        if not self._undo:
            return False
        last = self._undo.pop()
        if last.model != self.state.model.spec:
            self._undo.clear()
            self.message.emit("The model changed since the last apply; there is nothing to undo.")
            self._update_actions()
            return False
        self.state.set_setup(last.setup)
        self.state.flush()
        self.message.emit(f"Undid {last.what}.")
        self._update_actions()
        return True

    # ---- export ---------------------------------------------------------------------------------------------------
    def export_sweep(self, path: str | Path, fmt: str) -> bool:
        """Write the sweep chart (png / svg) or its numbers (csv). Errors go to the status bar."""
        self.flush()
        data = self.chart.data
        if data is None:
            self.message.emit("There is no sweep to export (the setup is invalid).")
            return False
        try:
            if fmt == "csv":
                write_text(path, to_csv(*sweep_table(data, self._unit)))
            elif fmt == "png":
                save_png(self.chart.chart_area, path, background=self._theme.chart_bg)
            elif fmt == "svg":
                save_svg(self.chart.chart_area, path, title=f"VRAM Lab sweep: {sweep_label(data)}",
                         background=self._theme.chart_bg)
            else:
                raise ValueError(f"unknown export format {fmt!r}")
        except OSError as e:
            self.message.emit(f"Could not export {Path(path).name}: {e.strerror or e}")
            return False
        self.message.emit(f"Exported the {SWEEP_NOUNS[data.field]} sweep to {path}")
        return True

    def export_sweep_dialog(self, fmt: str) -> None:
        names = {"png": "PNG at 2x (*.png)", "svg": "SVG (*.svg)", "csv": "CSV (*.csv)"}
        path, _ = QtWidgets.QFileDialog.getSaveFileName(
            self, "Export sweep", str(Path.home() / f"vram-sweep-{self.sweep_field()}.{fmt}"), names[fmt])
        if path:
            self.export_sweep(path if path.lower().endswith("." + fmt) else f"{path}.{fmt}", fmt)

    # ---- reading back (tests) ----------------------------------------------------------------------------------------
    def sweep_curve_bytes(self) -> list[tuple[Any, float]]:
        """(value, memory in the unit) as drawn."""
        data = self.chart.data
        if data is None:
            return []
        return [(p.value, y) for p, (_x, y) in zip(data.points, self.chart.curve_points())]
