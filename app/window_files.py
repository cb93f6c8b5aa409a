"""What the main window reads and writes: models (a config.json, a model folder, a Hub id looked up off the GUI
thread), training configs (opened, dropped, exported), scenario files, and exports of the report, charts and
table (files and clipboard). A part of :class:`~.main_window.MainWindow`; every problem is shown in the window,
never raised."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

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
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.state import AppState, ModelChoice, load_model
from vramlab.app.views.comparison import EXPORT_ROLE
from vramlab.core.catalog import ModelEntry, resolve_model
from vramlab.core.checks import SetupError
from vramlab.core.report import UNIT_NOTE, to_csv, to_markdown
from vramlab.core.sources.folder import import_is_slow
from vramlab.core.sources.hub import LookupStep
from vramlab.core.sources.training import SetupSource, read_training_configs
from vramlab.core.spec.training import TrainingSetup

# What Ctrl+E can write: (file-dialog filter, what, format)
EXPORT_KINDS: dict[str, tuple[str, str, str]] = {
    "report-png": ("Report page, PNG at 2x (*.png)", "report", "png"),
    "report-svg": ("Report page, SVG (*.svg)", "report", "svg"),
    "chart-png": ("Chart, PNG at 2x (*.png)", "chart", "png"),
    "chart-svg": ("Chart, SVG (*.svg)", "chart", "svg"),
    "table-csv": ("Comparison table, CSV (*.csv)", "table", "csv"),
    "table-md": ("Comparison table, Markdown (*.md)", "table", "md"),
}
# What File -> Export training config writes: format id -> menu text
TRAINING_EXPORTS = {"axolotl": "axolotl YAML…", "llamafactory": "LLaMA-Factory YAML…",
                    "trl": "TRL SFTConfig + LoraConfig…", "deepspeed": "DeepSpeed JSON…"}
RECENT_HUB_MAX = 8

if TYPE_CHECKING:
    from vramlab.app.hub_lookup import HubLookupController
    from vramlab.app.theme import Theme
    from vramlab.app.views.advisor import AdvisorView
    from vramlab.app.views.banner import Banner
    from vramlab.app.views.breakdown import BreakdownView
    from vramlab.app.views.comparison import ComparisonView
    from vramlab.app.views.config_mapping import ConfigMappingView
    from vramlab.app.views.live import LiveView
    from vramlab.app.views.phases import PhasesView
    from vramlab.app.views.report import ReportView
    from vramlab.app.views.setup_panel import SetupPanel


def _read_local_model(ref: str, progress: Callable[[LookupStep], None], cancelled: Callable[[], bool]) -> ModelEntry:
    """A local config.json / model folder, read on the lookup worker (the lookup's calling convention)."""
    progress(LookupStep("building it on the meta device", network=False))
    return resolve_model(ref, network=False)


class WindowFiles:
    """Opening, importing, saving and exporting; mixed into the main window (its views, state, settings,
    status bar and message banner)."""

    # what the main window provides
    settings: QtCore.QSettings
    state: AppState
    theme: Theme
    panel: SetupPanel
    hub: HubLookupController
    mapping: ConfigMappingView
    mapping_dock: QtWidgets.QDockWidget
    message_banner: Banner
    tabs: QtWidgets.QTabWidget
    breakdown: BreakdownView
    comparison: ComparisonView
    phases: PhasesView
    advisor: AdvisorView
    live: LiveView
    statusBar: Callable[[], QtWidgets.QStatusBar]  # noqa: N815 (Qt's name)
    show_message: Callable[..., None]
    refresh_report: Callable[[], ReportView]

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

    def _on_hub_progress(self, step: LookupStep) -> None:
        text = step.text
        where = "on the Hub: config and safetensors headers only, never weights" if step.network else ""
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
        self._ruled = {}  # a new source: its rules have set nothing yet
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

    def settle_training_rules(self) -> None:
        """The training configs' own rules on the window's edits, as ``--sharding`` on the command line settles them:
        Sharding set to ZeRO-3 after a LLaMA-Factory full config drops the fp32 upcast LLaMA-Factory skips there."""
        from vramlab.core.sources.training import settled_edits

        source = self.mapping.source
        if source is None:
            return
        change = settled_edits(source, dict(self.state.fields), self._ruled)
        if change:
            self._ruled = {**self._ruled, **change}
            self.state.set_fields(change)

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
