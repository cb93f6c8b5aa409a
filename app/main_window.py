"""The main window: the setup panel on the left; breakdown, comparison, phases and report tabs; menus,
toolbar, shortcuts, status bar; what the app remembers between runs. Hub ids are looked up off the GUI
thread (:mod:`vramlab.app.hub_lookup`); training configs open from the File menu or by dropping them on the
window, and the mapping of their keys is shown in the "Training config" panel."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from vramlab.app import scenarios_io
from vramlab.app import settings as keys
from vramlab.app.export import (
    copy_image,
    copy_table,
    render_widget_image,
    save_png,
    save_svg,
    write_text,
)
from vramlab.app.gpus import Detection, detect
from vramlab.app.hub_lookup import HubLookupController
from vramlab.app.profiling import ProfileController
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.simulation import SimulateFn, SimulationController
from vramlab.app.state import AppState, ModelChoice, Snapshot, fields_to_json, load_model
from vramlab.app.theme import Theme, ThemeMode, apply_theme, resolve
from vramlab.app.views.about import AboutDialog
from vramlab.app.views.advisor import AdvisorView
from vramlab.app.views.banner import Banner
from vramlab.app.views.breakdown import BreakdownView
from vramlab.app.views.comparison import EXPORT_ROLE, ComparisonView
from vramlab.app.views.config_mapping import ConfigMappingView
from vramlab.app.views.live import LiveView
from vramlab.app.views.phases import PhasesView
from vramlab.app.views.report import ReportView
from vramlab.app.views.setup_panel import SetupPanel
from vramlab.app.workers import GcPause, settle_collector
from vramlab.core.catalog import ModelEntry, resolve_model
from vramlab.core.checks import SetupError
from vramlab.core.report import UNIT_NOTE, gui_message, to_csv, to_markdown
from vramlab.core.result import MemLevel
from vramlab.core.sources.folder import import_is_slow
from vramlab.core.sources.training import SetupSource, read_training_configs
from vramlab.core.spec import GpuSpec, TrainingSetup, repair_setup_fields
from vramlab.core.traced import prefetch as prefetch_traces
from vramlab.core.units import Unit

log = logging.getLogger(__name__)

# What Ctrl+E can write: (file-dialog filter, what, format)
EXPORT_KINDS: dict[str, tuple[str, str, str]] = {
    "report-png": ("Report page, PNG at 2x (*.png)", "report", "png"),
    "report-svg": ("Report page, SVG (*.svg)", "report", "svg"),
    "chart-png": ("Chart, PNG at 2x (*.png)", "chart", "png"),
    "chart-svg": ("Chart, SVG (*.svg)", "chart", "svg"),
    "table-csv": ("Comparison table, CSV (*.csv)", "table", "csv"),
    "table-md": ("Comparison table, Markdown (*.md)", "table", "md"),
}
TAB_NAMES = ("Breakdown", "Comparison", "Phases", "Report")
RECENT_HUB_MAX = 8
PREFETCH_AFTER_MS = 300  # the traced tapes read once the window is up and idle (see __init__)
# What File -> Export training config writes: format id -> menu text
TRAINING_EXPORTS = {"axolotl": "axolotl YAML…", "llamafactory": "LLaMA-Factory YAML…",
                    "trl": "TRL SFTConfig + LoraConfig…", "deepspeed": "DeepSpeed JSON…"}


def icon(name: str) -> QtGui.QIcon:
    path = resources.files("vramlab.resources").joinpath(f"icons/{name}.svg")
    return QtGui.QIcon(str(path))



def _read_local_model(ref: str, progress: Callable[[str], None], cancelled: Callable[[], bool]) -> ModelEntry:
    """A local config.json / model folder, read on the lookup worker (the lookup's calling convention)."""
    progress("building it on the meta device")
    return resolve_model(ref, network=False)


def after_start_idle() -> int:
    """What the window does once it is up and idle after start-up (``PREFETCH_AFTER_MS``): the most recently used
    traced tapes read into memory (:func:`~vramlab.core.traced.prefetch`), then the collector settled
    (:func:`.workers.settle_collector`). Returns how many tapes were read."""
    read = prefetch_traces()
    settle_collector()
    return read


class MainWindow(QtWidgets.QMainWindow):
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

    def _action(self, text: str, slot: Callable[[], object],
                shortcut: str | QtGui.QKeySequence.StandardKey | None = None, tip: str = "",
                icon_name: str | None = None, checkable: bool = False) -> QtGui.QAction:
        a = QtGui.QAction(text, self)
        if shortcut is not None:
            a.setShortcut(QtGui.QKeySequence(shortcut))
        if tip:
            a.setToolTip(tip + (f" ({a.shortcut().toString(QtGui.QKeySequence.SequenceFormat.NativeText)})"
                                if shortcut is not None else ""))
            a.setStatusTip(tip)
        if icon_name:
            a.setIcon(icon(icon_name))
        a.setCheckable(checkable)
        if checkable:
            a.toggled.connect(lambda _checked: slot())
        else:
            a.triggered.connect(lambda _checked=False: slot())
        self.addAction(a)
        return a

    def _build_actions(self) -> None:
        A = self._action  # noqa: N806
        self.act_open = A("&Open config.json…", self.open_config_dialog, QtGui.QKeySequence.StandardKey.Open,
                          "Import a Hugging Face config.json", "open")
        self.act_open_folder = A("Open model &folder…", self.open_folder_dialog, "Ctrl+Shift+O",
                                 "Import a local model folder (config.json + safetensors headers)")
        self.act_open_training = A("Open &training config…", self.open_training_config_dialog, "Ctrl+Alt+O",
                                   "Read the setup from axolotl, LLaMA-Factory, TRL / TrainingArguments, peft, "
                                   "DeepSpeed or accelerate configs (several at once; or drop them on the window)")
        self.training_export_actions = {k: A(v, lambda k=k: self.export_training_config_dialog(k)) for k, v in
                                        TRAINING_EXPORTS.items()}
        self.act_pin = A("&Pin current setup", self.pin, "Ctrl+P", "Add the current setup to the comparison", "pin")
        self.act_compare = A("Compare &Full / LoRA / QLoRA", self.state.compare_presets, "Ctrl+Shift+P",
                             "Compare the current setup as full fine-tuning, LoRA and QLoRA", "compare")
        self.act_save = A("&Save scenarios…", self.save_scenarios_dialog, QtGui.QKeySequence.StandardKey.Save,
                          "Save the scenarios to a JSON file", "save")
        self.act_load = A("&Load scenarios…", self.load_scenarios_dialog, "Ctrl+L", "Load scenarios from a JSON file")
        self.act_export = A("&Export…", self.export_dialog, "Ctrl+E",
                            "Export the report, the chart of the tab on show (breakdown, phases, sweep or live "
                            "plots) or the table (PNG, SVG, CSV, Markdown)", "export")
        self.export_actions = {k: A(v[0].split(" (")[0], lambda k=k: self.export_dialog(k)) for k, v in
                               EXPORT_KINDS.items()}
        self.act_copy_chart = A("Copy &chart image", self.copy_chart, "Ctrl+Shift+C",
                                "Copy the chart of the tab on show (2x) to the clipboard", "copy")
        self.act_copy_table = A("Copy &table (Markdown)", self.copy_table, "Ctrl+Shift+M",
                                "Copy the comparison table as Markdown (and CSV)")
        self.act_quit = A("&Quit", self.close, QtGui.QKeySequence.StandardKey.Quit, "Quit VRAM Lab")
        self.act_quit.setShortcut(QtGui.QKeySequence("Ctrl+Q"))
        self.act_simulate = A("&Simulate selected scenario", self.simulate, "Ctrl+R",
                              "Run the real architecture on fake tensors and compare with the estimate", "simulate")
        self.act_cancel = A("Cancel simulation", self.sims.cancel, None, "Stop the running simulation")
        self.act_cancel.setEnabled(False)
        self.act_profile = A("&Profile on this machine", self.run_profile, "Ctrl+Shift+R",
                             "Run two real training steps of the current setup on the local GPU (or CPU) and "
                             "compare with the estimate", "profile")
        self.act_cancel_profile = A("Cancel profile", self.live_ctl.cancel, None, "End the running profile")
        self.act_cancel_profile.setEnabled(False)
        self.act_about = A("&About VRAM Lab", self.show_about, QtGui.QKeySequence.StandardKey.HelpContents,
                           "Versions and what the numbers mean", "about")
        self.act_about.setShortcut(QtGui.QKeySequence("F1"))

        self.level_group = QtGui.QActionGroup(self)
        self.level_actions: dict[MemLevel, QtGui.QAction] = {}
        for i, (lv, text) in enumerate(((MemLevel.ALLOCATED, "Tensors"), (MemLevel.RESERVED, "Reserved"),
                                        (MemLevel.DEVICE, "Device")), 1):
            a = A(text, lambda lv=lv: self.state.set_level(lv), f"Ctrl+{i}", f"Show {lv.label}")
            a.setCheckable(True)
            self.level_group.addAction(a)
            self.level_actions[lv] = a
        self.unit_group = QtGui.QActionGroup(self)
        self.unit_actions: dict[Unit, QtGui.QAction] = {}
        for u, tip in ((Unit.GIB, "GiB: 2³⁰ bytes, what nvidia-smi and torch print"),
                       (Unit.GB, "GB: 10⁹ bytes, what vendors print on the box")):
            a = A(u.value, lambda u=u: self.state.set_unit(u), None, tip)
            a.setCheckable(True)
            self.unit_group.addAction(a)
            self.unit_actions[u] = a
        self.act_sizes = A("Common GPU sizes", lambda: self.state.set_common_sizes(self.act_sizes.isChecked()),
                           "Ctrl+Shift+L", "Draw lines at the memory of 16, 24, 40, 48 and 80 GB cards", checkable=True)
        self.theme_group = QtGui.QActionGroup(self)
        self.theme_actions: dict[ThemeMode, QtGui.QAction] = {}
        for m, text in ((ThemeMode.SYSTEM, "Follow system"), (ThemeMode.LIGHT, "Light"), (ThemeMode.DARK, "Dark")):
            a = A(text, lambda m=m: self.apply_theme_mode(m), None, f"{text} theme")
            a.setCheckable(True)
            self.theme_group.addAction(a)
            self.theme_actions[m] = a
        self.act_toggle_theme = A("Toggle light / dark", self.toggle_theme, "Ctrl+Shift+T",
                                  "Switch between the light and the dark theme", "theme")

    def _build_menus_and_toolbar(self) -> None:
        for action, short in ((self.act_open, "Open…"), (self.act_pin, "Pin"),
                              (self.act_compare, "Full / LoRA / QLoRA"), (self.act_export, "Export…"),
                              (self.act_simulate, "Simulate"),
                              (self.act_toggle_theme, "Theme"), (self.act_sizes, "16-80 GB lines")):
            action.setIconText(short)  # the tool bar's label; menus keep the full text
        mb = self.menuBar()
        m = mb.addMenu("&File")
        m.addActions([self.act_open, self.act_open_folder, self.act_open_training])
        m.addSeparator()
        m.addActions([self.act_save, self.act_load])
        m.addSeparator()
        m.addAction(self.act_export)
        sub = m.addMenu("Export as")
        sub.addActions(list(self.export_actions.values()))
        m.addActions([self.act_copy_chart, self.act_copy_table])
        sub = m.addMenu("Export training config")
        sub.addActions(list(self.training_export_actions.values()))
        m.addSeparator()
        m.addAction(self.act_quit)
        m = mb.addMenu("&Scenarios")
        m.addActions([self.act_pin, self.act_compare])
        m = mb.addMenu("&View")
        m.addActions(list(self.level_actions.values()))
        m.addSeparator()
        m.addActions(list(self.unit_actions.values()))
        m.addSeparator()
        m.addAction(self.act_sizes)
        sub = m.addMenu("Theme")
        sub.addActions(list(self.theme_actions.values()))
        sub.addSeparator()
        sub.addAction(self.act_toggle_theme)
        m.addSeparator()
        m.addAction(self.dock.toggleViewAction())
        m.addAction(self.mapping_dock.toggleViewAction())
        m = mb.addMenu("S&imulate")
        m.addActions([self.act_simulate, self.act_cancel])
        m.addSeparator()
        m.addActions([self.act_profile, self.act_cancel_profile])
        m = mb.addMenu("&Help")
        m.addAction(self.act_about)

        tb = self.addToolBar("Main")
        tb.setObjectName("MainToolbar")
        tb.setToolButtonStyle(QtCore.Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        tb.setIconSize(QtCore.QSize(18, 18))
        tb.addActions([self.act_open, self.act_pin, self.act_compare])
        tb.addSeparator()
        label = QtWidgets.QLabel(" Level: ")
        label.setToolTip("Which memory the bars show")
        tb.addWidget(label)
        tb.addActions(list(self.level_actions.values()))
        tb.addSeparator()
        tb.addActions(list(self.unit_actions.values()))
        tb.addAction(self.act_sizes)
        tb.addSeparator()
        tb.addActions([self.act_export, self.act_simulate, self.act_profile, self.act_toggle_theme])

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

    # ---- models ---------------------------------------------------------------------------------------------------
    def _last_dir(self) -> str:
        return keys.read_str(self.settings, keys.LAST_DIR, str(Path.home()))

    def _remember_dir(self, path: str) -> None:
        p = Path(path)
        self.settings.setValue(keys.LAST_DIR, str(p if p.is_dir() else p.parent))

    def open_config_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(
            self, "Open a Hugging Face config.json", self._last_dir(), "Model config (*.json);;All files (*)")
        if path:
            self.open_model(path)

    def open_folder_dialog(self) -> None:
        path = QtWidgets.QFileDialog.getExistingDirectory(self, "Open a local model folder", self._last_dir())
        if path:
            self.open_model(path)

    def open_model(self, path: str) -> ModelChoice | None:
        """Import a config.json or model folder; errors are shown in the window, never raised."""
        self._remember_dir(path)
        if import_is_slow(path):  # transformers builds it once to count it: seconds, off the GUI thread
            if self.hub.running:
                self.statusBar().showMessage(f"Still looking up {self.hub.ref}: cancel it first.", 5000)
                return None
            self.panel.show_lookup(f"Reading {Path(path).name}: transformers builds this architecture once (on "
                                   "the meta device, no weights) to count its parameters…")
            self.hub.start(path, fn=_read_local_model)
            return None
        try:
            choice = load_model(path)
        except SetupError as e:
            self.show_message(f"Could not open {Path(path).name}: {e}")
            return None
        self.state.set_model_choice(choice)
        self.panel.remember_import(choice)
        self.panel.sync()
        self.message_banner.clear()
        note = f" ({'; '.join(choice.warnings)})" if choice.warnings else ""
        if choice.warnings:
            self.show_message(f"Imported {choice.spec.name} with notes: {'; '.join(choice.warnings)}", "warning")
        self.statusBar().showMessage(f"Imported {choice.spec.name} from {path}{note}", 8000)
        return choice

    # ---- Hub ids ----------------------------------------------------------------------------------------------------
    def _offer_hub_ids(self) -> None:
        from vramlab.core.sources.hub import cached_model_ids

        recent = [r for r in keys.read_json(self.settings, keys.RECENT_HUB, []) or [] if isinstance(r, str)]
        self.panel.set_hub_ids(cached_model_ids(), recent)

    def lookup_hub(self, ref: str) -> bool:
        """Look a Hub id up off the GUI thread (the cache first; the network only when it is not there)."""
        if self.hub.running:
            self.statusBar().showMessage(f"Still looking up {self.hub.ref}: cancel it first.", 5000)
            return False
        self.panel.show_lookup(f"Looking up {ref}…")
        return self.hub.start(ref)

    def _on_hub_progress(self, text: str) -> None:
        network = "fetching" in text or "header" in text
        where = "on the Hub: config and safetensors headers only, never weights" if network else ""
        verb = "Reading" if Path(self.hub.ref).exists() else "Looking up"  # a local model read off-thread
        self.panel.show_lookup(f"{verb} {self.hub.ref} {where}\n{text[:1].upper()}{text[1:]}…")

    def _on_hub_found(self, ref: str, entry: ModelEntry) -> None:
        self.panel.show_lookup(None)
        choice = ModelChoice.from_entry(ref, entry)
        self.state.set_model_choice(choice)
        self.panel.remember_import(choice)
        if entry.origin:  # a Hub id (a local model read off-thread has none)
            recent = [ref] + [r for r in keys.read_json(self.settings, keys.RECENT_HUB, []) or [] if r != ref]
            keys.write_json(self.settings, keys.RECENT_HUB, recent[:RECENT_HUB_MAX])
            self._offer_hub_ids()
        self.panel.sync()
        self.message_banner.clear()
        if entry.adapter is not None:  # an adapter repository: its LoRA settings are the setup's
            self.apply_training_source(read_training_configs([], adapter=entry.adapter,
                                                             adapter_source=f"{ref}/adapter_config.json"))
        if choice.warnings:
            self.show_message(f"{choice.spec.name}: {'; '.join(choice.warnings)}", "warning")
        self.statusBar().showMessage(f"{choice.spec.name} from {choice.origin or ref}", 8000)

    def _on_hub_failed(self, ref: str, text: str) -> None:
        self.panel.show_lookup(None)
        self.panel.sync()
        self.show_message(text)

    def _on_hub_cancelled(self, ref: str) -> None:
        self.panel.show_lookup(None)
        self.panel.sync()
        self.statusBar().showMessage(f"Lookup of {ref} cancelled; the model is unchanged.", 5000)

    # ---- training configs ---------------------------------------------------------------------------------------
    def open_training_config_dialog(self) -> None:
        paths, _ = QtWidgets.QFileDialog.getOpenFileNames(
            self, "Open training config(s)", self._last_dir(),
            "Training configs (*.yaml *.yml *.json);;All files (*)")
        if paths:
            self.open_training_configs(paths)

    def open_training_configs(self, paths: list[str]) -> bool:
        """Read training configs (a YAML and its DeepSpeed JSON, say) into the setup and show the mapping.
        Errors are shown in the window; nothing changes then."""
        self._remember_dir(paths[0])
        try:
            source = read_training_configs(paths)
            source.check()
        except SetupError as e:
            self.show_message(f"Could not use {', '.join(Path(p).name for p in paths)}: {e}")
            return False
        return self.apply_training_source(source)

    def apply_training_source(self, source: SetupSource) -> bool:
        """The setup the configs give (from VRAM Lab's defaults, as ``vramlab --config`` builds it; the number
        of GPUs stays unless a config sets it), the model they name, and the mapping panel."""
        changes = dict(source.changes)
        changes.setdefault("gpus", self.state.fields.get("gpus", 1))
        try:
            setup = TrainingSetup().replace(**changes)
        except (SetupError, ValueError) as e:
            self.show_message(f"The training config gives no usable setup: {e}")
            return False
        self.state.set_setup(setup)
        self.mapping.set_source(source)
        self.mapping_dock.show()
        self.mapping_dock.raise_()
        model = _preset_for_hub_id(source.model) or source.model
        if model and model != self.state.model.ref:
            from vramlab.app.views.setup_panel import is_hub_id

            if is_hub_id(model):
                self.lookup_hub(model)
            else:
                try:
                    self.state.set_model(model)
                except SetupError as e:
                    self.show_message(f"The config names the model {model!r}, which cannot be read ({e}); "
                                      f"keeping {self.state.model.spec.name}.", "warning")
        self.panel.sync()
        self.statusBar().showMessage(f"Setup read from {', '.join(Path(f).name for f in source.files)}", 8000)
        return True

    def export_training_config_dialog(self, fmt: str) -> None:
        folder = QtWidgets.QFileDialog.getExistingDirectory(self, f"Export {TRAINING_EXPORTS[fmt].rstrip('…')} "
                                                                  "into a folder", self._last_dir())
        if folder:
            self.export_training_config(fmt, folder)

    def export_training_config(self, fmt: str, folder: str) -> list[Path]:
        from vramlab.core.sources.export import export_setup, model_name_for, write_exported

        st = self.state
        try:
            setup = TrainingSetup(**st.fields)
            preset = None if st.model.imported else st.model.spec.source
            exported = export_setup(setup, fmt, model=model_name_for(st.model.ref, preset_source=preset))
            written = write_exported(exported, folder)
        except (SetupError, ValueError, TypeError) as e:
            self.show_message(f"Could not export: {e}")
            return []
        self._remember_dir(folder)
        self.statusBar().showMessage(f"Wrote {', '.join(p.name for p in written)} to {folder}", 8000)
        return written

    # ---- drag and drop ------------------------------------------------------------------------------------------
    def dragEnterEvent(self, event: QtGui.QDragEnterEvent) -> None:  # noqa: N802
        if any(u.isLocalFile() for u in event.mimeData().urls()):
            event.acceptProposedAction()

    def dropEvent(self, event: QtGui.QDropEvent) -> None:  # noqa: N802
        paths = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if paths:
            event.acceptProposedAction()
            self.open_dropped(paths)

    def open_dropped(self, paths: list[str]) -> None:
        """A model folder or a model's config.json opens as the model; anything else as training configs."""
        models = [p for p in paths if Path(p).is_dir() or _is_model_config(p)]
        configs = [p for p in paths if p not in models]
        for p in models[:1]:
            self.open_model(p)
        if configs:
            self.open_training_configs(configs)

    # ---- scenarios ------------------------------------------------------------------------------------------------
    def pin(self) -> None:
        scenario = self.state.pin_current()
        if scenario is not None:
            self.state.flush()
            self.comparison.select_uid(scenario.uid)

    def save_scenarios_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(
            self, "Save scenarios", str(Path(self._last_dir()) / "scenarios.json"), "Scenarios (*.json)")
        if path:
            self.save_scenarios(path if path.endswith(".json") else path + ".json")

    def save_scenarios(self, path: str) -> bool:
        self._remember_dir(path)
        self.state.flush()  # following scenarios are derived at recompute: bring them up to date first
        try:
            scenarios_io.save(path, self.state.scenarios, self.state.gpu)
        except OSError as e:
            self.show_message(f"Could not save {Path(path).name}: {e.strerror or e}")
            return False
        self.statusBar().showMessage(f"Saved {len(self.state.scenarios)} scenarios to {path}", 5000)
        return True

    def load_scenarios_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(
            self, "Load scenarios", self._last_dir(), "Scenarios (*.json);;All files (*)")
        if path:
            self.load_scenarios(path)

    def load_scenarios(self, path: str) -> bool:
        self._remember_dir(path)
        try:
            items, gpu_id = scenarios_io.load(path)
        except scenarios_io.ScenarioFileError as e:
            self.show_message(f"Could not load scenarios: {e}")
            return False
        self.state.set_scenarios(items)
        if gpu_id:
            from vramlab.core.catalog import find_gpu

            try:
                self.state.set_gpu(find_gpu(gpu_id))
            except SetupError:
                pass
        self.message_banner.clear()
        self.statusBar().showMessage(f"Loaded {len(items)} scenarios from {path}", 5000)
        return True

    # ---- export ---------------------------------------------------------------------------------------------------
    def export_dialog(self, kind: str | None = None) -> None:
        kinds = [kind] if kind else list(EXPORT_KINDS)
        filters = ";;".join(EXPORT_KINDS[k][0] for k in kinds)
        ext = EXPORT_KINDS[kinds[0]][2]
        start = str(Path(self._last_dir()) / f"vram-{EXPORT_KINDS[kinds[0]][1]}.{ext}")
        path, chosen = QtWidgets.QFileDialog.getSaveFileName(self, "Export", start, filters)
        if not path:
            return
        picked = next((k for k in kinds if EXPORT_KINDS[k][0] == chosen), kinds[0])
        suffix = "." + EXPORT_KINDS[picked][2]
        if not path.lower().endswith(suffix):
            path += suffix
        self.export_to(path, picked)

    def export_to(self, path: str, kind: str) -> bool:
        """Write one export (see EXPORT_KINDS). Errors are shown in the window."""
        self._remember_dir(path)
        what, fmt = EXPORT_KINDS[kind][1], EXPORT_KINDS[kind][2]
        try:
            if what == "table":
                headers, rows = self.comparison.model.table(
                    EXPORT_ROLE if fmt == "csv" else QtCore.Qt.ItemDataRole.DisplayRole)
                write_text(path, to_csv(headers, rows) if fmt == "csv" else self.table_markdown())
            else:
                if what == "report":
                    widget, bg = self.refresh_report(), "#FFFFFF"
                else:
                    widget, what = self.current_chart()
                    bg = self.theme.chart_bg
                if fmt == "png":
                    save_png(widget, path, background=bg)
                else:
                    save_svg(widget, path, title=f"VRAM Lab {what}", background=bg)
        except OSError as e:
            self.show_message(f"Could not export {Path(path).name}: {e.strerror or e}")
            return False
        self.statusBar().showMessage(f"Exported {what} to {path}", 5000)
        return True

    def current_chart(self) -> tuple[QtWidgets.QWidget, str]:
        """The chart of the tab on show (the breakdown's from the tabs without one of their own) and its name."""
        current = self.tabs.currentWidget()
        if current is self.phases:
            return self.phases.chart_area, "phases chart"
        if current is self.advisor:
            return self.advisor.chart.chart_area, "sweep chart"
        if current is self.live:
            return self.live.plots, "live plots"
        return self.breakdown.chart_area, "chart"

    def table_markdown(self) -> str:
        headers, rows = self.comparison.model.table(QtCore.Qt.ItemDataRole.DisplayRole)
        numeric = [c.bytes_of is not None for c in self.comparison.model.columns()]
        snap = self.state.flush()
        gpu = snap.gpu.name if snap.gpu else "no GPU"
        note = (f"\nPer GPU, {snap.unit.value} ({UNIT_NOTE[snap.unit]}). Kind columns split the tensor peak; "
                f"fits and headroom are at the device level on {gpu}. Analytical estimate by VRAM Lab.\n")
        return to_markdown(headers, rows, numeric) + note

    def copy_chart(self) -> None:
        widget, what = self.current_chart()
        copy_image(render_widget_image(widget, background=self.theme.chart_bg))
        self.statusBar().showMessage(f"{what.capitalize()} copied to the clipboard.", 4000)

    def copy_report(self) -> None:
        copy_image(render_widget_image(self.refresh_report(), background="#FFFFFF"))
        self.statusBar().showMessage("Report copied to the clipboard.", 4000)

    def copy_table(self) -> None:
        headers, rows = self.comparison.model.table(EXPORT_ROLE)
        copy_table(self.table_markdown(), to_csv(headers, rows))
        self.statusBar().showMessage("Table copied to the clipboard (Markdown; CSV for spreadsheets).", 4000)

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


def _is_model_config(path: str) -> bool:
    """A Hugging Face model config.json (it names a model_type or architectures), not a training config."""
    p = Path(path)
    if p.suffix.lower() != ".json":
        return False
    try:
        import json

        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ("model_type" in data or "architectures" in data)


def _preset_for_hub_id(ref: str | None) -> str | None:
    """The preset whose config is that Hub repository's (``meta-llama/Llama-2-7b-hf`` -> ``llama-2-7b``): a
    config naming a model the catalogue has needs no network."""
    from vramlab.core.catalog import models

    if not ref:
        return None
    for m in models():
        if (m.source or "").startswith(f"{ref} config.json"):
            return m.id
    return None
