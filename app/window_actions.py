"""The main window's actions, menus and tool bar: every command the window offers, with its shortcut, tooltip
and icon, and where it sits in the menus and on the tool bar. A part of :class:`~.main_window.MainWindow`
(which provides the views, the controllers and the slots the actions call)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING

from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.theme import ThemeMode
from vramlab.app.window_files import EXPORT_KINDS, TRAINING_EXPORTS
from vramlab.core.result import MemLevel
from vramlab.core.units import Unit

if TYPE_CHECKING:
    from vramlab.app.profiling import ProfileController
    from vramlab.app.simulation import SimulationController
    from vramlab.app.state import AppState


def icon(name: str) -> QtGui.QIcon:
    path = resources.files("vramlab.resources").joinpath(f"icons/{name}.svg")
    return QtGui.QIcon(str(path))


class WindowActions:
    """Builds the window's actions (``act_*`` and the level, unit, theme, export groups) and its menus and tool
    bar; mixed into the main window, whose methods the actions trigger."""

    # what the main window provides (and the slots below the actions call)
    state: AppState
    sims: SimulationController
    live_ctl: ProfileController
    dock: QtWidgets.QDockWidget
    mapping_dock: QtWidgets.QDockWidget

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
