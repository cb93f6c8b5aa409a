"""The comparison: scenarios × components and the three memory levels, as a table model and its view.

Rows are the current setup and the scenarios in chart order; columns are the scenario, its model and
precision, the three levels, the fit verdict and headroom on the chosen GPU (device level), the peak
phase, trainable parameters, then every memory kind present at any row's peak (tensor level). Every
header names its unit; the CSV / Markdown exports read the same model, so they match the screen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.state import AppState, Row, Snapshot
from vramlab.core.kinds import KIND_ORDER, Kind
from vramlab.core.report import method_label, phase_label
from vramlab.core.result import MemLevel
from vramlab.core.spec.options import Objective
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import Unit, fmt_bytes, fmt_count, to_unit

EXPORT_ROLE = QtCore.Qt.ItemDataRole.UserRole + 1  # plain text for CSV: numbers without separators
BYTES_ROLE = QtCore.Qt.ItemDataRole.UserRole + 2  # the exact byte count behind a cell (or None)
ItemFlag = QtCore.Qt.ItemFlag
KEY_COLUMNS = 4  # scenario, fits, device level, headroom: always in view
SHOWN_FIRST = ("name", "fits", MemLevel.DEVICE.value, "headroom", MemLevel.ALLOCATED.value, MemLevel.RESERVED.value)


@dataclass(frozen=True)
class Column:
    key: str
    header: Callable[[Unit], str]
    tip: str
    bytes_of: Callable[[Row], int | None] | None = None  # byte columns
    text_of: Callable[[Row], str] | None = None  # text columns


def _level_column(level: MemLevel) -> Column:
    return Column(level.value, lambda u, lv=level: f"{lv.short.capitalize()} [{u.value}]",
                  f"{level.label}: the peak per GPU at this memory level.",
                  bytes_of=lambda r, lv=level: r.result.bytes_at(lv) if r.result else None)


def _kind_column(kind: Kind) -> Column:
    return Column(f"kind:{kind.value}", lambda u, k=kind: f"{k.label} [{u.value}]",
                  f"{kind.label} at the peak (tensor level). {kind.description}",
                  bytes_of=lambda r, k=kind: (r.result.components.get(k, 0) if r.result else None))


def _fits(row: Row, snapshot: Snapshot) -> str:
    if row.result is None:
        return "invalid"
    fits = row.result.fits(snapshot.gpu, MemLevel.DEVICE)
    return "—" if fits is None else ("yes" if fits else "no")


def objective_label(setup: TrainingSetup | None) -> str:
    if setup is None:
        return "—"
    obj = setup.objective
    if obj is Objective.SFT:
        return "SFT"
    ref = {"copy": "ref copy", "adapters": "ref: adapters off", "precomputed": "ref precomputed",
           "none": "no ref"}[setup.reference_mode.value]
    if obj is Objective.GRPO:
        gen = {"transformers": "generate", "vllm-colocate": "vLLM", "vllm-server": "vLLM server"}[
            setup.generation_backend.value]
        return f"GRPO · {setup.num_generations}×{setup.completion_tokens} tok · {gen} · {ref}"
    return f"{obj.value.upper()} · {ref}"


class ScenarioTableModel(QtCore.QAbstractTableModel):
    """Read-only numbers; the scenario name is editable (renames the scenario)."""

    def __init__(self, state: AppState, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self._state = state
        self._snapshot: Snapshot | None = None
        self._columns: list[Column] = []
        self._bold = QtGui.QFont()
        self._bold.setBold(True)
        state.computed.connect(self.set_snapshot)

    # ---- structure ---------------------------------------------------------------------------------------------
    def _build_columns(self, snapshot: Snapshot) -> list[Column]:
        gpu_name = snapshot.gpu.name if snapshot.gpu else "GPU"
        cols = [
            Column("name", lambda u: "Scenario", "Name (double-click or F2 to rename a pinned scenario)",
                   text_of=lambda r: r.name),
            Column("model", lambda u: "Model", "Model being trained", text_of=lambda r: r.model.name),
            Column("method", lambda u: "Method", "Training method",
                   text_of=lambda r: method_label(r.setup) if r.setup else "—"),
            Column("precision", lambda u: "Precision", "Precision facts (TrainingSetup.precision_label())",
                   text_of=lambda r: r.setup.precision_label() if r.setup else "—"),
            Column("objective", lambda u: "Objective", "What the step optimises (TRL 1.16.0's trainers) and "
                   "where its reference and generation live", text_of=lambda r: objective_label(r.setup)),
            *(_level_column(lv) for lv in MemLevel),
            Column("fits", lambda u, g=gpu_name: f"Fits {g}", "Device level at most the GPU's memory",
                   text_of=lambda r, s=snapshot: _fits(r, s)),
            Column("headroom", lambda u: f"Headroom [{u.value}]",
                   "GPU memory minus the device-level peak (negative: short by)",
                   bytes_of=lambda r, s=snapshot: (r.result.headroom_bytes(s.gpu, MemLevel.DEVICE)
                                                    if r.result and s.gpu else None)),
            Column("peak_phase", lambda u: "Peak phase", "Where the tensor peak sits",
                   text_of=lambda r: phase_label(r.result.peak_phase) if r.result else "—"),
            Column("trainable", lambda u: "Trainable params", "Trainable parameters (LoRA: adapter parameters)",
                   text_of=lambda r: fmt_count(r.result.trainable_params) if r.result else "—"),
        ]
        present = {k for r in snapshot.rows if r.result for k, v in r.result.components.items() if v}
        cols += [_kind_column(k) for k in KIND_ORDER if k in present]
        return cols

    def set_snapshot(self, snapshot: Snapshot) -> None:
        columns = self._build_columns(snapshot)
        same_shape = (self._snapshot is not None and len(snapshot.rows) == len(self._snapshot.rows)
                      and [c.key for c in columns] == [c.key for c in self._columns]
                      and [r.key for r in snapshot.rows] == [r.key for r in self._snapshot.rows])
        if same_shape:
            self._snapshot, self._columns = snapshot, columns
            if self.rowCount() and self.columnCount():
                self.dataChanged.emit(self.index(0, 0), self.index(self.rowCount() - 1, self.columnCount() - 1))
            self.headerDataChanged.emit(QtCore.Qt.Orientation.Horizontal, 0, self.columnCount() - 1)
            return
        self.beginResetModel()
        self._snapshot, self._columns = snapshot, columns
        self.endResetModel()

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def columns(self) -> Sequence[Column]:
        return tuple(self._columns)

    def row_at(self, index: int) -> Row | None:
        if self._snapshot is None or not 0 <= index < len(self._snapshot.rows):
            return None
        return self._snapshot.rows[index]

    # ---- Qt model API -------------------------------------------------------------------------------------------
    def rowCount(self, parent: QtCore.QModelIndex | None = None) -> int:  # noqa: N802
        if parent is not None and parent.isValid():
            return 0
        return len(self._snapshot.rows) if self._snapshot else 0

    def columnCount(self, parent: QtCore.QModelIndex | None = None) -> int:  # noqa: N802
        if parent is not None and parent.isValid():
            return 0
        return len(self._columns)

    def headerData(self, section: int, orientation: QtCore.Qt.Orientation,  # noqa: N802
                   role: int = QtCore.Qt.ItemDataRole.DisplayRole) -> object:
        if orientation != QtCore.Qt.Orientation.Horizontal or not 0 <= section < len(self._columns):
            return None
        col = self._columns[section]
        unit = self._snapshot.unit if self._snapshot else Unit.GIB
        if role == EXPORT_ROLE:
            return col.header(unit)
        if role == QtCore.Qt.ItemDataRole.DisplayRole:  # on screen, the unit (or the GPU) under the name
            return col.header(unit).replace(" [", "\n[").replace("Fits ", "Fits\n", 1)
        if role == QtCore.Qt.ItemDataRole.ToolTipRole:
            return col.tip
        return None

    def data(self, index: QtCore.QModelIndex, role: int = QtCore.Qt.ItemDataRole.DisplayRole) -> object:
        if not index.isValid() or self._snapshot is None:
            return None
        row = self._snapshot.rows[index.row()]
        col = self._columns[index.column()]
        unit = self._snapshot.unit
        if col.bytes_of is not None:
            value = col.bytes_of(row)
            if role == BYTES_ROLE:
                return value
            if role == QtCore.Qt.ItemDataRole.DisplayRole:
                return "—" if value is None else fmt_bytes(value, unit, suffix=False)
            if role == EXPORT_ROLE:
                return "" if value is None else f"{to_unit(value, unit):.3f}"
            if role == QtCore.Qt.ItemDataRole.ToolTipRole and value is not None:
                return f"{fmt_bytes(value, unit)} ({value:,} bytes)"
            if role == QtCore.Qt.ItemDataRole.TextAlignmentRole:
                return QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter
        else:
            assert col.text_of is not None
            if role in (QtCore.Qt.ItemDataRole.DisplayRole, QtCore.Qt.ItemDataRole.EditRole, EXPORT_ROLE):
                return col.text_of(row)
            if role == QtCore.Qt.ItemDataRole.ToolTipRole:
                if row.error:
                    return row.error
                if col.key == "name" and row.follows:
                    return f"{row.name}: follows the current setup with this preset's precision"
                if col.key == "name" and row.is_current:
                    return "The setup in the panel on the left"
                return None
        if role == QtCore.Qt.ItemDataRole.FontRole and row.is_current:
            return self._bold
        if role == QtCore.Qt.ItemDataRole.ForegroundRole and row.result is None:
            return QtGui.QBrush(QtGui.QColor("#B3261E"))
        return None

    def flags(self, index: QtCore.QModelIndex) -> ItemFlag:
        if not index.isValid():
            return ItemFlag.NoItemFlags
        base = ItemFlag.ItemIsEnabled | ItemFlag.ItemIsSelectable
        row = self.row_at(index.row())
        if self._columns[index.column()].key == "name" and row is not None and not row.is_current:
            base |= ItemFlag.ItemIsEditable
        return base

    def setData(self, index: QtCore.QModelIndex, value: object,  # noqa: N802
                role: int = QtCore.Qt.ItemDataRole.EditRole) -> bool:
        row = self.row_at(index.row())
        if role != QtCore.Qt.ItemDataRole.EditRole or row is None or row.uid is None:
            return False
        return self._state.rename_scenario(row.uid, str(value))

    # ---- export ----------------------------------------------------------------------------------------------------
    def table(self, role: int = EXPORT_ROLE) -> tuple[list[str], list[list[str]]]:
        """(headers, rows) as text, for CSV (EXPORT_ROLE) or Markdown (DisplayRole)."""
        headers = [str(self.headerData(c, QtCore.Qt.Orientation.Horizontal, EXPORT_ROLE))
                   for c in range(self.columnCount())]
        rows = [[str(self.data(self.index(r, c), role) or "") for c in range(self.columnCount())]
                for r in range(self.rowCount())]
        return headers, rows


class ComparisonView(QtWidgets.QWidget):
    """Scenario actions and the table."""

    loadRequested = QtCore.Signal()
    saveRequested = QtCore.Signal()

    def __init__(self, state: AppState, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        bar = QtWidgets.QToolBar(self)  # a tool bar rather than a row of buttons: it folds when narrow
        bar.setObjectName("ScenarioActions")
        bar.setToolButtonStyle(QtCore.Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.actions: dict[str, QtGui.QAction] = {}

        def button(key: str, text: str, tip: str, slot: Callable[[], object]) -> None:
            a = QtGui.QAction(text, self)
            a.setToolTip(tip)
            a.triggered.connect(lambda _=False: slot())
            bar.addAction(a)
            self.actions[key] = a

        button("pin", "Pin current", "Add the current setup as a scenario (Ctrl+P)", self.state.pin_current)
        button("compare", "Full / LoRA / QLoRA", "Compare the current setup as full fine-tuning (AMP bf16), LoRA "
               "(bf16) and QLoRA (nf4); these scenarios follow your later edits", self.state.compare_presets)
        button("objectives", "SFT / DPO / GRPO", "Compare the current setup trained as SFT, DPO (reference "
               "as TRL sets it up) and GRPO (generation with transformers); pinned snapshots",
               self.state.compare_objectives)
        button("edit", "Load into editor", "Make the selected scenario the current setup", self._load_selected)
        button("rename", "Rename", "Rename the selected scenario (F2)", self._rename_selected)
        button("up", "Move up", "Move the selected scenario left in the chart (Ctrl+Up)", lambda: self._move(-1))
        button("down", "Move down", "Move the selected scenario right in the chart (Ctrl+Down)",
               lambda: self._move(1))
        button("remove", "Remove", "Remove the selected scenario (Delete)", self._remove_selected)
        bar.addSeparator()
        button("save", "Save…", "Save the scenarios to a JSON file (Ctrl+S)", self.saveRequested.emit)
        button("load", "Load…", "Load scenarios from a JSON file (Ctrl+L)", self.loadRequested.emit)
        layout.addWidget(bar)

        self.model = ScenarioTableModel(state, self)
        self.table = QtWidgets.QTableView(self)
        self.table.setObjectName("ScenarioTable")
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.DoubleClicked
                                   | QtWidgets.QAbstractItemView.EditTrigger.EditKeyPressed)
        self.table.setAlternatingRowColors(True)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setStretchLastSection(False)
        self.table.horizontalHeader().setDefaultAlignment(QtCore.Qt.AlignmentFlag.AlignLeft
                                                          | QtCore.Qt.AlignmentFlag.AlignVCenter)
        self.table.setWordWrap(False)
        # the first four columns (scenario, fits, device level, headroom) stay in view; the rest may scroll
        self.table.setProperty("scrollsSideways", KEY_COLUMNS)
        # the tensor peak by kind, in a table of its own below: the summary above stays narrow enough to read
        # whole, and the tab's height is used instead of one wide table over an empty area
        self.kinds_title = QtWidgets.QLabel("Where the tensor peak goes, by kind (per GPU)", self)
        self.kinds_title.setObjectName("SectionTitle")
        self.kinds_table = QtWidgets.QTableView(self)
        self.kinds_table.setObjectName("ScenarioKinds")
        self.kinds_table.setModel(self.model)
        # read only, its own selection off: sharing the table's selection model left this view a dangling
        # pointer when the table (its owner) was destroyed first, and a later window crashed in Qt
        self.kinds_table.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.NoSelection)
        self.kinds_table.setFocusPolicy(QtCore.Qt.FocusPolicy.NoFocus)
        self.kinds_table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.kinds_table.setAlternatingRowColors(True)
        self.kinds_table.verticalHeader().setVisible(False)
        self.kinds_table.horizontalHeader().setDefaultAlignment(QtCore.Qt.AlignmentFlag.AlignLeft
                                                                | QtCore.Qt.AlignmentFlag.AlignVCenter)
        self.kinds_table.setWordWrap(False)
        self.kinds_table.setProperty("scrollsSideways", 1)
        self.model.modelReset.connect(self._resize)
        self.model.headerDataChanged.connect(lambda *_: self._resize())
        layout.addWidget(self.table, 1)
        layout.addWidget(self.kinds_title)
        layout.addWidget(self.kinds_table, 1)
        self.hint = QtWidgets.QLabel(
            "Numbers are per GPU. The level columns are the peaks at each memory level; the kind table splits the "
            "tensor peak. “Fits” and headroom use the device level (what nvidia-smi shows).")
        self.hint.setObjectName("Facts")
        self.hint.setWordWrap(True)
        layout.addWidget(self.hint)
        # SFT / DPO / GRPO side by side: what each step holds, in words (why DPO can sit below SFT, GRPO's tokens)
        self.objective_notes = QtWidgets.QLabel(self)
        self.objective_notes.setObjectName("ObjectiveNotes")
        self.objective_notes.setWordWrap(True)
        self.objective_notes.setVisible(False)
        layout.addWidget(self.objective_notes)
        for key, seq, slot in (("remove", QtGui.QKeySequence.StandardKey.Delete, self._remove_selected),
                               ("up", QtGui.QKeySequence("Ctrl+Up"), lambda: self._move(-1)),
                               ("down", QtGui.QKeySequence("Ctrl+Down"), lambda: self._move(1))):
            sc = QtGui.QShortcut(QtGui.QKeySequence(seq), self.table)
            sc.setContext(QtCore.Qt.ShortcutContext.WidgetWithChildrenShortcut)
            sc.activated.connect(slot)
            sc.setObjectName(f"shortcut:{key}")
        self.table.selectionModel().selectionChanged.connect(self._update_buttons)
        self._update_buttons()

    def _resize(self) -> None:
        """Each table shows its own columns (the kinds below, the rest above; the scenario name in both), each
        column as wide as its widest text: no cell is cut."""
        columns = self.model.columns()
        kinds = [c.key.startswith("kind:") for c in columns]
        # on screen the answer comes first (fits, device level, headroom, the other levels), then what the setup
        # is: the columns a user reads first stay in view at 1280 px; the exports keep the model's order
        header = self.table.horizontalHeader()
        keys = [c.key for c in columns]
        for visual, key in enumerate(SHOWN_FIRST):
            if key in keys:
                header.moveSection(header.visualIndex(keys.index(key)), visual)
        for view, shown in ((self.table, [not k for k in kinds]), (self.kinds_table, kinds)):
            for c, on in enumerate(shown):
                view.setColumnHidden(c, not on and c != 0)
            view.resizeColumnsToContents()
            header = view.horizontalHeader()
            for c in range(self.model.columnCount()):
                header.resizeSection(c, max(header.sectionSize(c), 70))
        self._update_buttons()
        self._explain()

    def _explain(self) -> None:
        from vramlab.app.views.breakdown import objective_explanation

        snapshot = self.model.snapshot
        text = objective_explanation(snapshot) if snapshot is not None else ""
        self.objective_notes.setText(text)
        self.objective_notes.setVisible(bool(text))

    def selected_uid(self) -> int | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows:
            return None
        row = self.model.row_at(rows[0].row())
        return row.uid if row is not None else None

    def select_uid(self, uid: int) -> None:
        snap = self.model.snapshot
        if snap is None:
            return
        for i, r in enumerate(snap.rows):
            if r.uid == uid:
                self.table.selectRow(i)
                return

    def _update_buttons(self, *_: object) -> None:
        has = self.selected_uid() is not None
        for key in ("edit", "rename", "up", "down", "remove"):
            self.actions[key].setEnabled(has)

    def _load_selected(self) -> None:
        uid = self.selected_uid()
        if uid is not None:
            self.state.load_into_editor(uid)

    def _rename_selected(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        if rows and self.selected_uid() is not None:
            self.table.edit(self.model.index(rows[0].row(), 0))

    def _move(self, delta: int) -> None:
        uid = self.selected_uid()
        if uid is not None and self.state.move_scenario(uid, delta):
            self.state.flush()
            self.select_uid(uid)

    def _remove_selected(self) -> None:
        uid = self.selected_uid()
        if uid is not None:
            self.state.remove_scenario(uid)
