"""The main window: the setup panel on the left; breakdown, comparison, phases and report tabs; menus,
toolbar, shortcuts, status bar; what the app remembers between runs. Hub ids are looked up off the GUI
thread (:mod:`vramlab.app.hub_lookup`); training configs open from the File menu or by dropping them on the
window, and the mapping of their keys is shown in the "Training config" panel."""

from __future__ import annotations

import dataclasses
import logging

from vramlab.app import scenarios_io
from vramlab.app import settings as keys
from vramlab.app.gpus import Detection, detect
from vramlab.app.hub_lookup import HubLookupController
from vramlab.app.profiling import ProfileController
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.simulation import SimulateFn, SimulationController
from vramlab.app.state import AppState, Snapshot, fields_to_json
from vramlab.app.theme import Theme, ThemeMode, apply_theme, resolve
from vramlab.app.views.about import AboutDialog
from vramlab.app.views.advisor import AdvisorView
from vramlab.app.views.banner import Banner
from vramlab.app.views.breakdown import BreakdownView
from vramlab.app.views.comparison import ComparisonView
from vramlab.app.views.config_mapping import ConfigMappingView
from vramlab.app.views.live import LiveView
from vramlab.app.views.phases import PhasesView
from vramlab.app.views.report import ReportView
from vramlab.app.views.setup_panel import SetupPanel
from vramlab.app.window_actions import WindowActions, icon
from vramlab.app.window_files import EXPORT_KINDS, WindowFiles
from vramlab.app.workers import GcPause, settle_collector
from vramlab.core.checks import SetupError
from vramlab.core.report import UNIT_NOTE, gui_message
from vramlab.core.result import MemLevel
from vramlab.core.spec.edits import repair_setup_fields
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.traced import prefetch as prefetch_traces
from vramlab.core.units import Unit

log = logging.getLogger(__name__)

TAB_NAMES = ("Breakdown", "Comparison", "Phases", "Report")
PREFETCH_AFTER_MS = 300  # the traced tapes read once the window is up and idle (see __init__)


def after_start_idle() -> int:
    """What the window does once it is up and idle after start-up (``PREFETCH_AFTER_MS``): the most recently used
    traced tapes read into memory (:func:`~vramlab.core.traced.prefetch`), then the collector settled
    (:func:`.workers.settle_collector`). Returns how many tapes were read."""
    read = prefetch_traces()
    settle_collector()
    return read


class MainWindow(WindowActions, WindowFiles, QtWidgets.QMainWindow):
    """The window; its actions and menus are :class:`.window_actions.WindowActions`, what it opens, saves and
    exports is :class:`.window_files.WindowFiles`."""


    def __init__(self, settings: QtCore.QSettings | None = None, detect_gpus: bool = True,
                 simulate_fn: SimulateFn | None = None, theme_mode: ThemeMode | str | None = None,
                 replay: bool = True) -> None:
        super().__init__()
        self.settings = settings if settings is not None else keys.open_settings()
        self.setWindowTitle("VRAM Lab")
        self.setWindowIcon(icon("vramlab"))
        self.setObjectName("MainWindow")
        mode = theme_mode or keys.read_str(self.settings, keys.THEME, ThemeMode.SYSTEM.value)
        self.theme_mode = ThemeMode(mode) if mode in ThemeMode._value2member_map_ else ThemeMode.SYSTEM
        self.theme: Theme = resolve(self.theme_mode)
        self.state = AppState(self, replay=replay)
        self.sims = SimulationController(self, simulate_fn)
        self.live_ctl = ProfileController(self)
        self.hub = HubLookupController(self)
        self._restore_values()
        self._report_dirty = True
        self._closing = False
        self._build_views()
        self._build_actions()
        self._build_menus_and_toolbar()
        self.apply_theme_mode(self.theme_mode, save=False)
        self._wire()
        self._restore_geometry()
        self._on_computed(self.state.flush())
        if detect_gpus:
            QtCore.QTimer.singleShot(0, self.detect_gpus)
            # once idle after start-up: the recently used traced tapes into memory, so that a traced model picked
            # now answers at once (their first parts, a few ms in all), and the collector settled
            QtCore.QTimer.singleShot(PREFETCH_AFTER_MS, after_start_idle)

    # ---- construction -------------------------------------------------------------------------------------
    def _build_views(self) -> None:
        self.panel = SetupPanel(self.state, self)
        self.dock = QtWidgets.QDockWidget("Setup", self)
        self.dock.setObjectName("SetupDock")
        self.dock.setWidget(self.panel)
        self.dock.setFeatures(QtWidgets.QDockWidget.DockWidgetFeature.DockWidgetMovable
                              | QtWidgets.QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        self.dock.setAllowedAreas(QtCore.Qt.DockWidgetArea.LeftDockWidgetArea
                                  | QtCore.Qt.DockWidgetArea.RightDockWidgetArea)
        self.addDockWidget(QtCore.Qt.DockWidgetArea.LeftDockWidgetArea, self.dock)
        self.mapping = ConfigMappingView(self)
        self._ruled: dict = {}  # what the training configs' own rules set after the window's edits
        self.mapping_dock = QtWidgets.QDockWidget("Training config", self)
        self.mapping_dock.setObjectName("TrainingConfigDock")
        self.mapping_dock.setWidget(self.mapping)
        self.addDockWidget(QtCore.Qt.DockWidgetArea.BottomDockWidgetArea, self.mapping_dock)
        self.mapping_dock.hide()  # shown when a training config is opened
        self.setAcceptDrops(True)

        central = QtWidgets.QWidget(self)
        col = QtWidgets.QVBoxLayout(central)
        col.setContentsMargins(6, 6, 6, 4)
        col.setSpacing(6)
        self.setup_banner = Banner(central, closable=False)
        self.setup_banner.setObjectName("Banner")
        self.message_banner = Banner(central, closable=True)
        col.addWidget(self.setup_banner)
        col.addWidget(self.message_banner)
        self.tabs = QtWidgets.QTabWidget(central)
        self.tabs.setDocumentMode(True)
        self.breakdown = BreakdownView(self.theme, self.tabs)
        self.comparison = ComparisonView(self.state, self.tabs)
        self.phases = PhasesView(self.state, self.sims, self.theme, self.tabs)
        self.report_tab = self._build_report_tab()
        for widget, name in zip((self.breakdown, self.comparison, self.phases, self.report_tab), TAB_NAMES):
            self.tabs.addTab(widget, name)
        self.advisor = AdvisorView(self.state, self.theme, self.tabs)
        self.advisor.message.connect(lambda text: self.statusBar().showMessage(text, 6000))
        self.tabs.addTab(self.advisor, "Advisor")
        self.live = LiveView(self.state, self.live_ctl, self.theme, self.tabs)
        self.live.message.connect(lambda text: self.statusBar().showMessage(text, 6000))
        self.tabs.addTab(self.live, "Live profile")
        col.addWidget(self.tabs, 1)
        self.setCentralWidget(central)
        self.report = ReportView()
        self.status_level = QtWidgets.QLabel(self)
        self.status_level.setObjectName("StatusLevel")
        self.statusBar().addPermanentWidget(self.status_level)
        self._build_trace_status()

    def _build_trace_status(self) -> None:
        """A first trace's progress and its cancel button, in the status bar while it runs."""
        self.trace_label = QtWidgets.QLabel(self)
        self.trace_label.setObjectName("TraceProgress")
        self.trace_bar = QtWidgets.QProgressBar(self)
        self.trace_bar.setRange(0, 100)
        self.trace_bar.setFixedWidth(120)
        self.trace_cancel = QtWidgets.QPushButton("Cancel trace", self)
        self.trace_cancel.setToolTip("Stop tracing transformers' step (this setup then has no estimate)")
        self.trace_cancel.clicked.connect(self.state.tracer.cancel)
        self.trace_label.setMaximumWidth(300)  # the level label beside it stays whole (the full text: tooltip)
        # permanent widgets: a temporary status message (an import, a lookup) would be painted over normal ones
        for i, w in enumerate((self.trace_label, self.trace_bar, self.trace_cancel)):
            self.statusBar().insertPermanentWidget(i, w)
            w.setVisible(False)
        tracer = self.state.tracer
        tracer.started.connect(lambda job: self._on_trace_progress(f"starting ({job[0].name})", 0.0))
        tracer.progress.connect(self._on_trace_progress)
        tracer.runningChanged.connect(self._on_trace_running)
        tracer.succeeded.connect(lambda job: self.statusBar().showMessage(f"Traced {job[0].name}: cached for the "
                                                                          "next estimates.", 6000))

    def _on_trace_progress(self, text: str, done: float) -> None:
        job = self.state.tracer.job
        who = f"Tracing {job[0].name}" if job else "Tracing"
        full = f"{who}: {text}"
        metrics = self.trace_label.fontMetrics()
        self.trace_label.setText(metrics.elidedText(full, QtCore.Qt.TextElideMode.ElideMiddle,
                                                    self.trace_label.maximumWidth()))
        self.trace_label.setToolTip(full)
        self.trace_bar.setValue(round(100 * done))

    def _on_trace_running(self, running: bool) -> None:
        if running:
            self.statusBar().clearMessage()  # the progress takes the bar's room; a message would be cut to a stub
        for w in (self.trace_label, self.trace_bar, self.trace_cancel):
            w.setVisible(running)

    def _build_report_tab(self) -> QtWidgets.QWidget:
        w = QtWidgets.QWidget(self.tabs)
        layout = QtWidgets.QVBoxLayout(w)
        layout.setContentsMargins(0, 4, 0, 0)
        bar = QtWidgets.QHBoxLayout()
        hint = QtWidgets.QLabel("A 16:9 page for slides and documents, always in the light theme.")
        hint.setObjectName("Facts")
        hint.setWordWrap(True)
        bar.addWidget(hint, 1)
        for text, kind in (("Export PNG…", "report-png"), ("Export SVG…", "report-svg")):
            b = QtWidgets.QPushButton(text)
            b.setToolTip(EXPORT_KINDS[kind][0])
            b.clicked.connect(lambda _=False, k=kind: self.export_dialog(k))
            bar.addWidget(b)
        copy = QtWidgets.QPushButton("Copy image")
        copy.setToolTip("Copy the report page to the clipboard")
        copy.clicked.connect(self.copy_report)
        bar.addWidget(copy)
        layout.addLayout(bar)
        self.report_preview = QtWidgets.QLabel(w)
        self.report_preview.setAlignment(QtCore.Qt.AlignmentFlag.AlignCenter)
        self.report_preview.setMinimumSize(320, 180)
        self.report_preview.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored,
                                          QtWidgets.QSizePolicy.Policy.Ignored)
        layout.addWidget(self.report_preview, 1)
        self._preview_timer = QtCore.QTimer(self)
        self._preview_timer.setSingleShot(True)
        self._preview_timer.setInterval(150)
        self._preview_timer.timeout.connect(self.update_report_preview)
        return w

    def _wire(self) -> None:
        st = self.state
        st.computed.connect(self.breakdown.set_snapshot)
        st.computed.connect(self._on_computed)
        st.message.connect(lambda text: self.statusBar().showMessage(text, 5000))
        st.scenariosChanged.connect(self._mark_report_dirty)
        self.panel.openConfigRequested.connect(self.open_config_dialog)
        self.panel.openFolderRequested.connect(self.open_folder_dialog)
        self.panel.errorRaised.connect(self.show_message)
        self.panel.hubLookupRequested.connect(self.lookup_hub)
        self.panel.hubCancelRequested.connect(self.hub.cancel)
        self.hub.progress.connect(self._on_hub_progress)
        self.hub.succeeded.connect(self._on_hub_found)
        self.hub.failed.connect(self._on_hub_failed)
        self.hub.cancelled.connect(self._on_hub_cancelled)
        st.inputsChanged.connect(self.settle_training_rules)
        st.inputsChanged.connect(lambda: self.mapping.mark_edits(dict(self.state.fields)))
        self._offer_hub_ids()
        self.comparison.saveRequested.connect(self.save_scenarios_dialog)
        self.comparison.loadRequested.connect(self.load_scenarios_dialog)
        self.sims.runningChanged.connect(self._on_sim_running)
        self.live_ctl.runningChanged.connect(self._on_profile_running)
        self.sims.failed.connect(lambda text: self.show_message(f"Simulation failed: {text}"))
        self.sims.succeeded.connect(lambda _r: self.statusBar().showMessage("Simulation finished.", 5000))
        self.tabs.currentChanged.connect(self._on_tab)
        QtGui.QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_scheme)
        self.level_actions[st.level].setChecked(True)
        self.unit_actions[st.unit].setChecked(True)
        with QtCore.QSignalBlocker(self.act_sizes):
            self.act_sizes.setChecked(st.common_sizes)

    # ---- settings ----------------------------------------------------------------------------------------------
    def _restore_values(self) -> None:
        """What the last session saved, each value checked with the CLI's rules (the settings file may be old,
        hand-edited or damaged): a bad value is replaced by its default and reported; the window always opens."""
        s, st = self.settings, self.state
        problems: list[str] = []
        ref = keys.read_str(s, keys.MODEL)
        if ref:
            try:
                st.set_model(ref)
            except SetupError as e:
                problems.append(f"the last model could not be loaded again ({e}); using {st.model.spec.name}")
        saved = keys.read_json(s, keys.FIELDS, problems=problems)
        if saved is not None:
            base = TrainingSetup(**st.fields)
            fields, bad = repair_setup_fields(saved, base=base, model=st.model.spec, where="saved setup")
            problems.extend(bad)
            st.set_fields({**st.fields, **fields})
        gpu = keys.read_json(s, keys.GPU, problems=problems)
        if isinstance(gpu, dict):
            try:
                st.set_gpu(GpuSpec.from_dict(gpu))
            except (SetupError, TypeError, ValueError) as e:
                problems.append(f"saved GPU: {e}; using {st.gpu.name if st.gpu else 'none'}")
        level = keys.read_str(s, keys.LEVEL)
        if level in MemLevel._value2member_map_:
            st.set_level(level)
        unit = keys.read_str(s, keys.UNIT)
        if unit in (Unit.GIB.value, Unit.GB.value):
            st.set_unit(unit)
        st.set_common_sizes(keys.read_str(s, keys.COMMON_SIZES) == "true")
        saved = keys.read_json(s, keys.SCENARIOS, problems=problems)
        if saved:
            try:
                items, _gpu = scenarios_io.from_dict(saved, "saved scenarios", problems=problems)
                st.set_scenarios(items)
            except scenarios_io.ScenarioFileError as e:
                problems.append(f"{e}; showing the default comparison")
        if problems:
            for p in problems:
                log.warning("settings: %s", p)
            more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
            text = f"Some saved settings were not valid and were reset: {'; '.join(problems[:2])}{more}."
            QtCore.QTimer.singleShot(0, lambda: self.show_message(text, "warning"))

    def _restore_geometry(self) -> None:
        geo = keys.read_bytes(self.settings, keys.GEOMETRY)
        if geo is None or not self.restoreGeometry(geo):
            screen = self.screen().availableGeometry() if self.screen() else QtCore.QRect(0, 0, 1440, 900)
            self.resize(min(1440, int(screen.width() * 0.92)), min(900, int(screen.height() * 0.92)))
        state = keys.read_bytes(self.settings, keys.WINDOW_STATE)
        if state is not None:
            self.restoreState(state)
        tab = keys.read_str(self.settings, keys.TAB, "0")
        if tab.isdigit() and len(tab) < 4 and int(tab) < self.tabs.count():
            self.tabs.setCurrentIndex(int(tab))

    def save_settings(self) -> None:
        s, st = self.settings, self.state
        st.flush()
        s.setValue(keys.GEOMETRY, self.saveGeometry())
        s.setValue(keys.WINDOW_STATE, self.saveState())
        s.setValue(keys.TAB, str(self.tabs.currentIndex()))
        s.setValue(keys.MODEL, st.model.ref)
        keys.write_json(s, keys.FIELDS, fields_to_json(st.fields))
        keys.write_json(s, keys.GPU, dataclasses.asdict(st.gpu) if st.gpu else None)
        s.setValue(keys.LEVEL, st.level.value)
        s.setValue(keys.UNIT, st.unit.value)
        s.setValue(keys.COMMON_SIZES, "true" if st.common_sizes else "false")
        s.setValue(keys.THEME, self.theme_mode.value)
        keys.write_json(s, keys.SCENARIOS, scenarios_io.to_dict(st.scenarios, st.gpu))
        s.sync()

    # ---- state -> window -------------------------------------------------------------------------------------------
    def _on_computed(self, snapshot: Snapshot) -> None:
        if snapshot.tracing:
            self.setup_banner.show_message(snapshot.error, "info")
        elif snapshot.error:
            self.setup_banner.show_message(
                f"{gui_message(snapshot.error)}\nThe chart keeps the last valid setup until this is fixed.", "error")
        else:
            self.setup_banner.clear()
        timing = snapshot.current.result.timing.get("total") if snapshot.current.result else None
        how = "estimated and allocator replayed" if snapshot.exact else "estimated"
        took = f" · {how} in {timing * 1000:.1f} ms" if timing is not None else ""
        if snapshot.current.result is not None and snapshot.current.result.source:  # which source made the step
            took += f" · step: {snapshot.current.result.source}"
        if snapshot.level is not MemLevel.ALLOCATED:  # how the outer level was made
            if not snapshot.exact:
                took += (" · allocator: fast model, replay running" if self.state.replaying
                         else " · allocator: fast model")
        self.status_level.setText(
            f"Bars: {snapshot.level.label} · {snapshot.unit.value} per GPU ({UNIT_NOTE[snapshot.unit]}){took}")
        self.level_actions[snapshot.level].setChecked(True)
        self.unit_actions[snapshot.unit].setChecked(True)
        self._mark_report_dirty()

    def _mark_report_dirty(self) -> None:
        self._report_dirty = True
        if self.tabs.currentWidget() is self.report_tab:
            self._preview_timer.start()

    def _on_tab(self, index: int) -> None:
        if self.tabs.widget(index) is self.report_tab:
            self._preview_timer.start()

    def refresh_report(self) -> ReportView:
        if self._report_dirty:
            self.report.set_snapshot(self.state.flush())
            self._report_dirty = False
        return self.report

    def update_report_preview(self) -> None:
        self.refresh_report()
        width = max(320, self.report_preview.width() - 8)
        pix = self.report.render_preview(width)
        pix = pix.scaled(self.report_preview.size() - QtCore.QSize(8, 8), QtCore.Qt.AspectRatioMode.KeepAspectRatio,
                         QtCore.Qt.TransformationMode.SmoothTransformation)
        self.report_preview.setPixmap(pix)

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        if hasattr(self, "tabs") and self.tabs.currentWidget() is self.report_tab:
            self._preview_timer.start()

    def show_message(self, text: str, kind: str = "error") -> None:
        self.message_banner.show_message(text, kind)

    # ---- theme ----------------------------------------------------------------------------------------------------
    def apply_theme_mode(self, mode: ThemeMode | str, save: bool = True) -> None:
        self.theme_mode = ThemeMode(mode)
        self.theme_actions[self.theme_mode].setChecked(True)
        self.theme = resolve(self.theme_mode)
        app = QtWidgets.QApplication.instance()
        if isinstance(app, QtWidgets.QApplication):
            # no garbage collection while Qt re-polishes every widget: one collected there (a reference cycle
            # holding a widget Qt is iterating over) crashed the GUI tests now and then (PySide6 6.11.3)
            pause = GcPause.shared()
            pause.acquire()
            try:
                apply_theme(app, self.theme)
            finally:
                pause.release()
        self.breakdown.apply_theme(self.theme)
        self.phases.apply_theme(self.theme)
        self.live.apply_theme(self.theme)
        self.advisor.apply_theme(self.theme)
        if save:
            self.settings.setValue(keys.THEME, self.theme_mode.value)

    def toggle_theme(self) -> None:
        self.apply_theme_mode(ThemeMode.LIGHT if self.theme.dark else ThemeMode.DARK)

    def _on_system_scheme(self, *_: object) -> None:
        if self.theme_mode is ThemeMode.SYSTEM:
            self.apply_theme_mode(ThemeMode.SYSTEM, save=False)

    # ---- GPUs -----------------------------------------------------------------------------------------------------
    def detect_gpus(self) -> Detection:
        detection = detect()
        self.panel.set_detection(detection)
        self.advisor.set_detection(detection, getattr(self, "run_profile", None))
        if detection.gpus and not keys.read_json(self.settings, keys.GPU):
            self.state.set_gpu(detection.gpus[0])
        return detection

    # ---- simulation / about ----------------------------------------------------------------------------------------
    def simulate(self) -> None:
        self.tabs.setCurrentWidget(self.phases)
        self.phases.simulate()

    def _on_sim_running(self, running: bool) -> None:
        self.act_simulate.setEnabled(not running)
        self.act_cancel.setEnabled(running)

    def run_profile(self, setup: TrainingSetup | None = None) -> bool:
        """Show the Live profile tab, load ``setup`` into the editor if given, and start a profile of the
        current setup on this machine. Returns whether a run started (problems are shown in the tab)."""
        self.tabs.setCurrentWidget(self.live)
        if self.live_ctl.running:
            self.statusBar().showMessage("A profile is running: cancel it before starting another.", 6000)
            return False
        if setup is not None:
            self.state.set_setup(setup)
            self.state.flush()
        return self.live.start()

    def _on_profile_running(self, running: bool) -> None:
        self.act_profile.setEnabled(not running)
        self.act_cancel_profile.setEnabled(running)

    def show_about(self) -> AboutDialog:
        dlg = AboutDialog(self, self.windowIcon())
        dlg.setAttribute(QtCore.Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.open()
        return dlg

    # ---- closing --------------------------------------------------------------------------------------------------
    def closeEvent(self, event: QtGui.QCloseEvent) -> None:  # noqa: N802
        if not self._closing:
            self._closing = True
            self.save_settings()
            self.sims.shutdown()
            self.hub.shutdown()
            self.state.shutdown()
            self.live_ctl.shutdown()
            self.live.shutdown()
            self.advisor.shutdown()
            self.report.close()
            self.report.deleteLater()
        event.accept()

