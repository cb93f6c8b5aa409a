"""The Advisor's panels: the ranked-savings table model, the fit-search form and the "Before you train" box
(allocator advice and checklist). They show what :mod:`vramlab.core.advisor` computed; the Advisor tab
(:mod:`vramlab.app.views.advisor`) decides when to compute it and wires the buttons."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.theme import Theme
from vramlab.core.advisor import FitAnswer, Saving
from vramlab.core.report import setup_summary
from vramlab.core.result import MemoryResult
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import Unit, fmt_bytes, fmt_count

BYTES_ROLE = QtCore.Qt.ItemDataRole.UserRole + 2
ItemFlag = QtCore.Qt.ItemFlag


# ---- ranked savings -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Col:
    key: str
    header: Callable[[Unit, str], str]
    tip: str


SAVING_COLUMNS = (
    _Col("change", lambda u, g: "Change", "What changes in the setup (the tooltip shows the whole changed setup)"),
    _Col("saves", lambda u, g: f"Saves [{u.value}]",
         "Device-level memory (nvidia-smi) the change saves per GPU"),
    _Col("fits", lambda u, g: "Fits (headroom)", "Whether the changed setup fits the chosen GPU at the device "
         "level, with the headroom left (or how much is missing); the tooltip has the device-level peak"),
    _Col("trainable", lambda u, g: "Trainable", "Trainable parameters before → after the change"),
    _Col("cost", lambda u, g: "Cost", "What the change costs: speed, quality or flexibility"),
)


class SavingsModel(QtCore.QAbstractTableModel):
    """The core's ranked savings, one row each, in the core's order."""

    def __init__(self, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self._savings: tuple[Saving, ...] = ()
        self._gpu: GpuSpec | None = None
        self._unit = Unit.GIB
        self._model: ModelSpec | None = None
        self._good, self._bad = QtGui.QColor("#1B7A3A"), QtGui.QColor("#B3261E")

    def set_colors(self, theme: Theme) -> None:
        self._good, self._bad = QtGui.QColor(theme.good), QtGui.QColor(theme.bad)
        if self._savings:
            self.dataChanged.emit(self.index(0, 0), self.index(self.rowCount() - 1, self.columnCount() - 1))

    def set_savings(self, items: Sequence[Saving], gpu: GpuSpec | None, unit: Unit, model: ModelSpec | None) -> None:
        items = tuple(items)
        same_keys = [s.key for s in items] == [s.key for s in self._savings]
        if same_keys and gpu == self._gpu and model == self._model:  # update in place: no reset, no flicker
            self._savings, self._unit = items, unit
            if items:
                self.dataChanged.emit(self.index(0, 0), self.index(len(items) - 1, self.columnCount() - 1))
            self.headerDataChanged.emit(QtCore.Qt.Orientation.Horizontal, 0, self.columnCount() - 1)
            return
        self.beginResetModel()
        self._savings, self._gpu, self._unit, self._model = items, gpu, unit, model
        self.endResetModel()

    def set_unit(self, unit: Unit) -> None:
        if unit is not self._unit:
            self.set_savings(self._savings, self._gpu, unit, self._model)

    @property
    def savings(self) -> tuple[Saving, ...]:
        return self._savings

    def saving_at(self, row: int) -> Saving | None:
        return self._savings[row] if 0 <= row < len(self._savings) else None

    def row_of(self, key: str) -> int:
        return next((i for i, s in enumerate(self._savings) if s.key == key), -1)

    # Qt model API
    def rowCount(self, parent: QtCore.QModelIndex | None = None) -> int:  # noqa: N802
        return 0 if parent is not None and parent.isValid() else len(self._savings)

    def columnCount(self, parent: QtCore.QModelIndex | None = None) -> int:  # noqa: N802
        return 0 if parent is not None and parent.isValid() else len(SAVING_COLUMNS)

    def headerData(self, section: int, orientation: QtCore.Qt.Orientation,  # noqa: N802
                   role: int = QtCore.Qt.ItemDataRole.DisplayRole) -> object:
        if orientation != QtCore.Qt.Orientation.Horizontal or not 0 <= section < len(SAVING_COLUMNS):
            return None
        col = SAVING_COLUMNS[section]
        if role == QtCore.Qt.ItemDataRole.DisplayRole:
            return col.header(self._unit, self._gpu.name if self._gpu else "GPU")
        if role == QtCore.Qt.ItemDataRole.ToolTipRole:
            return col.tip
        return None

    def flags(self, index: QtCore.QModelIndex) -> ItemFlag:
        return ItemFlag.ItemIsEnabled | ItemFlag.ItemIsSelectable if index.isValid() else ItemFlag.NoItemFlags

    def data(self, index: QtCore.QModelIndex, role: int = QtCore.Qt.ItemDataRole.DisplayRole) -> object:
        s = self.saving_at(index.row()) if index.isValid() else None
        if s is None:
            return None
        key, u, R = SAVING_COLUMNS[index.column()].key, self._unit, QtCore.Qt.ItemDataRole  # noqa: N806
        head = self._gpu.memory_bytes - s.after_bytes if self._gpu else None
        if role == R.DisplayRole:
            if key == "change":
                return s.title
            if key == "saves":
                return fmt_bytes(s.saves_bytes, u, suffix=False)
            if key == "fits":
                if head is None:
                    return "— (no GPU)"
                return f"✔ {fmt_bytes(head, u)} free" if head >= 0 else f"✘ {fmt_bytes(-head, u)} short"
            if key == "trainable":
                if s.trainable_after == s.trainable_before:
                    return f"same ({fmt_count(s.trainable_after)})"
                return f"{fmt_count(s.trainable_before)} → {fmt_count(s.trainable_after)}"
            if key == "cost":
                return cost_headline(s.cost)
        if role == BYTES_ROLE:
            return {"saves": s.saves_bytes, "fits": head}.get(key)
        if role == R.TextAlignmentRole and key == "saves":
            return QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter
        if role == R.ForegroundRole and key == "fits" and head is not None:
            return QtGui.QBrush(self._good if head >= 0 else self._bad)
        if role == R.ToolTipRole:
            if key == "saves":
                return f"{fmt_bytes(s.saves_bytes, u)} ({s.saves_bytes:,} bytes), device level (nvidia-smi), per GPU"
            if key == "fits":
                gpu = self._gpu.name if self._gpu else "no GPU chosen"
                return f"{fmt_bytes(s.after_bytes, u)} device used after the change, per GPU ({gpu})"
            if key == "cost":
                return s.cost
            if self._model is not None:
                return f"{s.title}. After the change: {setup_summary(self._model, s.setup)}"
        return None


class _OneLine(QtWidgets.QStyledItemDelegate):
    """A cell drawn on one line, elided, in a view that wraps its other cells."""

    def initStyleOption(self, option: QtWidgets.QStyleOptionViewItem, index: QtCore.QModelIndex) -> None:  # noqa: N802
        super().initStyleOption(option, index)
        option.features &= ~QtWidgets.QStyleOptionViewItem.ViewItemFeature.WrapText


class SavingsTable(QtWidgets.QTableView):
    """The ranked savings, as wide as the view: the numbers each on one line at their own width, the change's
    title at its own width too (wrapped when the table is too narrow for it), and the cost's headline on one line
    in the rest (elided past it: the whole cost is in its tooltip and under the table). Fitted again whenever
    the rows or the table's width change, so the table never scrolls sideways at the window's sizes."""

    COST_SHARE = 0.45  # where the two texts do not both fit, the most of their room the cost's headline keeps
    MIN_TEXT_PX = 110  # the least the change's title gets

    def __init__(self, model: SavingsModel, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("SavingsTable")
        self.setModel(model)
        self.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setAlternatingRowColors(True)
        self.setWordWrap(True)  # the change's title only: the cost's column draws one line (its delegate)
        self.verticalHeader().setVisible(False)
        self.verticalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        header = self.horizontalHeader()
        header.setDefaultAlignment(QtCore.Qt.AlignmentFlag.AlignLeft | QtCore.Qt.AlignmentFlag.AlignVCenter)
        header.setStretchLastSection(False)
        keys = [c.key for c in SAVING_COLUMNS]
        self._change, self._cost = keys.index("change"), keys.index("cost")
        self._one_line = _OneLine(self)
        self.setItemDelegateForColumn(self._cost, self._one_line)
        for c in range(len(SAVING_COLUMNS)):
            header.setSectionResizeMode(c, QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(self._change, QtWidgets.QHeaderView.ResizeMode.Interactive)
        header.setSectionResizeMode(self._cost, QtWidgets.QHeaderView.ResizeMode.Stretch)
        model.modelReset.connect(self.fit_columns)
        model.dataChanged.connect(lambda *_: self.fit_columns())
        model.headerDataChanged.connect(lambda *_: self.fit_columns())

    def fit_columns(self) -> None:
        """The change's column: its widest title, less where the cost's headline would keep under COST_SHARE of
        the room the two texts share (never under MIN_TEXT_PX); the stretching cost's column takes the rest."""
        header = self.horizontalHeader()
        numbers = sum(header.sectionSize(c) for c in range(header.count()) if c not in (self._change, self._cost))
        room = self.viewport().width() - numbers

        def want(c: int) -> int:
            return max(self.sizeHintForColumn(c), header.sectionSizeHint(c))

        cost = min(want(self._cost), int(room * self.COST_SHARE))
        change = max(self.MIN_TEXT_PX, min(want(self._change), room - cost))
        if header.sectionSize(self._change) != change:
            header.resizeSection(self._change, change)

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        self.fit_columns()


def cost_headline(cost: str) -> str:
    """The cost's first clause ("about 30 % slower steps"), with "…" when there is more: the table's column
    takes at most a share of the table's width, and the whole text is in the cell's tooltip and in the line under
    the table (issue 27: wrapped in full, one cost filled the table's height)."""
    cut = min((i for i in (cost.find(": "), cost.find("; "), cost.find(" (")) if i > 0), default=len(cost))
    return cost if cut == len(cost) else cost[:cut] + " …"


# ---- fit search ----------------------------------------------------------------------------------------------

class FitPanel(QtWidgets.QGroupBox):
    """Margin and target effective batch in; the largest micro batch and sequence, the accumulation out."""

    changed = QtCore.Signal()  # an input changed: search again

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__("Fit search", parent)
        form = QtWidgets.QFormLayout(self)
        form.setFieldGrowthPolicy(QtWidgets.QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.setLabelAlignment(QtCore.Qt.AlignmentFlag.AlignRight)
        self.margin = QtWidgets.QSpinBox(self)
        self.margin.setObjectName("fit_margin")
        self.margin.setRange(0, 89)
        self.margin.setValue(10)
        self.margin.setSuffix(" % free")
        self.margin.setToolTip("Share of the GPU's memory kept free for what an estimate cannot see (other "
                               "processes, allocator spikes). The budget is the rest, at the device level.")
        self.target = QtWidgets.QSpinBox(self)
        self.target.setObjectName("fit_target")
        self.target.setRange(0, 1_000_000)
        self.target.setSpecialValueText("same as now")
        self.target.setToolTip("Effective batch to reach with gradient accumulation (micro batch × accumulation "
                               "× GPUs); “same as now” keeps the current effective batch.")
        self.margin.valueChanged.connect(lambda _v: self.changed.emit())
        self.target.valueChanged.connect(lambda _v: self.changed.emit())
        form.addRow("Keep", self.margin)
        form.addRow("Effective batch", self.target)
        self.labels: dict[str, QtWidgets.QLabel] = {}
        for key, text in (("budget", "Budget"), ("now", "Now"), ("batch", "Largest micro batch"),
                          ("seq", "Longest sequence"), ("accum", "Accumulation"), ("suggest", "Suggestion")):
            lab = QtWidgets.QLabel("—", self)
            lab.setObjectName(f"fit_{key}")
            lab.setWordWrap(True)
            lab.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
            self.labels[key] = lab
            form.addRow(text, lab)
        row = QtWidgets.QHBoxLayout()
        self.use_button = QtWidgets.QPushButton("Use this", self)
        self.use_button.setToolTip("Set the suggested micro batch and accumulation (undo with “Undo apply”)")
        self.seq_button = QtWidgets.QPushButton("Use sequence", self)
        self.seq_button.setToolTip("Set the longest sequence that fits at the current micro batch")
        self.verify_button = QtWidgets.QPushButton("Verify on GPU", self)
        self.verify_button.setToolTip("Profile the suggested setup on this machine's GPU (Live profile tab)")
        self.verify_button.setVisible(False)
        for b in (self.use_button, self.seq_button):
            row.addWidget(b)
        row.addStretch(1)
        form.addRow(row)
        form.addRow(self.verify_button)

    def target_batch(self, setup: TrainingSetup) -> int:
        return self.target.value() or setup.effective_batch

    def show_answer(self, ans: FitAnswer | None, error: str, unit: Unit, setup: TrainingSetup | None,
                    suggestion_result: MemoryResult | None) -> None:
        lab = self.labels
        if ans is None or setup is None:
            for key, label in lab.items():
                label.setText(error if key == "budget" else "—")
            return
        cap = fmt_bytes(ans.gpu.memory_bytes, unit)
        lab["budget"].setText(f"{fmt_bytes(ans.budget_bytes, unit)} device used "
                              f"({escape(ans.gpu.name)}: {cap} − {ans.margin:.0%})")
        state = "within the budget" if ans.fits_now else "over the budget"
        lab["now"].setText(f"{fmt_bytes(ans.device_used_now, unit)} device used, {state}")
        lab["batch"].setText(f"{ans.max_micro_batch} (at sequence {setup.seq_len:,})" if ans.max_micro_batch
                             else "none fits, not even 1: see the ranked savings")
        if ans.seq_capped:
            seq = (f"{ans.max_seq_len:,} tokens: the model's maximum positions (memory allows more; "
                   "beyond it needs RoPE scaling)")
        elif ans.max_seq_len:
            seq = f"{ans.max_seq_len:,} tokens (at micro batch {setup.micro_batch}, in steps of 64)"
        else:
            seq = "none fits, not even 64 tokens"
        lab["seq"].setText(seq)
        sug = ans.suggestion
        if ans.grad_accum_for_target and sug is not None:
            gpus = f" × {sug.gpus} GPUs" if sug.gpus > 1 else ""
            lab["accum"].setText(f"{ans.grad_accum_for_target} for effective batch {ans.target_batch} "
                                 f"({sug.micro_batch} × {ans.grad_accum_for_target}{gpus} = {ans.effective_batch})")
        else:
            lab["accum"].setText("—")
        if ans.suggestion is not None and suggestion_result is not None:
            used = suggestion_result.device_used_bytes
            lab["suggest"].setText(
                f"micro batch {ans.suggestion.micro_batch} × accumulation {ans.suggestion.grad_accum}: "
                f"{fmt_bytes(used, unit)} device used, {fmt_bytes(ans.budget_bytes - used, unit)} under the budget")
        else:
            lab["suggest"].setText("nothing fits the budget")


# ---- before you train ------------------------------------------------------------------------------------------

def _breakable(text: str) -> str:
    """HTML for a label that must wrap inside a narrow column: long tokens such as
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True get zero-width break opportunities after = _ : and ."""
    out = []
    for word in text.split(" "):
        broken = word
        if len(word) > 24:
            for ch in "=_:.":
                broken = broken.replace(ch, ch + "\u200b")
        out.append(broken)
    return escape(" ".join(out))


class _FitText(QtWidgets.QTextBrowser):
    """Selectable rich text that wraps to the column (breaking long tokens only where it must, so copying
    gives the text unchanged) and is exactly as tall as its text."""

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        self.setOpenLinks(False)
        self.setVerticalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWordWrapMode(QtGui.QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)  # anywhere: last resort
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Fixed)
        self.viewport().setAutoFillBackground(False)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.document().setDocumentMargin(0)

    def set_html(self, html: str) -> None:
        if html != getattr(self, "_html", None):
            self._html = html
            self.setHtml(html)
            self._fit_height()

    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._fit_height()

    def plain_text(self) -> str:
        """The text as written: without the zero-width break opportunities :func:`_breakable` adds."""
        return self.toPlainText().replace("\u200b", "")

    def createMimeDataFromSelection(self) -> QtCore.QMimeData:  # noqa: N802 - Qt's name
        """A copy gives identifiers whole (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, pasted into a shell)."""
        data = QtCore.QMimeData()
        data.setText(self.textCursor().selection().toPlainText().replace("\u200b", ""))
        return data

    def _fit_height(self) -> None:
        self.document().setTextWidth(max(50, self.viewport().width()))
        h = int(self.document().size().height()) + 2
        if h != self.height():
            self.setFixedHeight(h)


class _ClickLabel(QtWidgets.QLabel):
    """A wrapping label that toggles its check box when clicked, as a check box's own text would."""

    def __init__(self, text: str, box: QtWidgets.QCheckBox, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(text, parent)
        self._box = box
        self.setWordWrap(True)
        self.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.setBuddy(box)

    def mouseReleaseEvent(self, event: QtGui.QMouseEvent) -> None:  # noqa: N802
        if event.button() == QtCore.Qt.MouseButton.LeftButton:
            self._box.toggle()
        super().mouseReleaseEvent(event)


class ChecklistPanel(QtWidgets.QGroupBox):
    """Allocator advice (when fragmentation is predicted to matter) and checkable pre-training items. Ticks
    are kept for the session, by item, across setup changes."""

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__("Before you train", parent)
        self._layout = QtWidgets.QVBoxLayout(self)
        self.advice = _FitText(self)
        self.advice.setObjectName("AllocatorAdvice")
        self._layout.addWidget(self.advice)
        self._items_box = QtWidgets.QWidget(self)
        self._items_layout = QtWidgets.QVBoxLayout(self._items_box)
        self._items_layout.setContentsMargins(0, 4, 0, 0)
        self._items_layout.setSpacing(2)
        self._layout.addWidget(self._items_box)
        self._items: tuple[tuple[str, str], ...] = ()
        self._lines: list[tuple[QtWidgets.QHBoxLayout, QtWidgets.QCheckBox, QtWidgets.QLabel]] = []
        self._muted = "#5B6270"
        self.boxes: list[QtWidgets.QCheckBox] = []
        self._checked: set[str] = set()
        self.advice_lines: list[str] = []

    def set_muted(self, color: str) -> None:
        if color != self._muted:
            self._muted = color
            items, self._items = self._items, ()
            self.set_items(items)

    def set_advice(self, tips: Sequence[str], result: MemoryResult, unit: Unit) -> None:
        self.advice_lines = list(tips)
        slack = result.peak_reserved_bytes - result.peak_allocated_bytes
        if tips:
            body = "".join(f"<li>{_breakable(t)}</li>" for t in tips)  # break identifiers at _ = : only
            self.advice.set_html(f"<b>Allocator: fragmentation is predicted to matter</b> (reserved − tensors = "
                                 f"{fmt_bytes(slack, unit)} at the peak)<ul style='margin-left:-24px'>{body}</ul>")
        else:
            self.advice.set_html(f"Allocator: the predicted cache slack is {fmt_bytes(slack, unit)} (reserved − "
                                 "tensors at the peak); no allocator settings are needed.")

    def set_items(self, items: Sequence[tuple[str, str]]) -> None:
        items = tuple(items)
        if items == self._items:
            return
        self._items = items
        for line, box, text in self._lines:
            self._items_layout.removeItem(line)
            box.deleteLater()
            text.deleteLater()
            line.deleteLater()
        self._lines = []
        self.boxes = []
        for title, detail in items:
            # A check box without text beside a wrapping label: QCheckBox text never wraps, and long items
            # would make the column wider than the window.
            box = QtWidgets.QCheckBox(self._items_box)
            box.setAccessibleName(title)
            box.setToolTip(detail)
            box.setChecked(title in self._checked)
            box.toggled.connect(lambda on, t=title: self._on_toggled(t, on))
            text = _ClickLabel(f"<b>{_breakable(title)}</b><br>"
                               f"<span style='color:{self._muted}'>{_breakable(detail)}</span>", box, self._items_box)
            line = QtWidgets.QHBoxLayout()
            line.setContentsMargins(0, 0, 0, 4)
            line.addWidget(box, 0, QtCore.Qt.AlignmentFlag.AlignTop)
            line.addWidget(text, 1)
            self._items_layout.addLayout(line)
            self._lines.append((line, box, text))
            self.boxes.append(box)

    def _on_toggled(self, title: str, on: bool) -> None:
        if on:
            self._checked.add(title)
        else:
            self._checked.discard(title)

    @property
    def labels(self) -> list[QtWidgets.QLabel]:
        return [text for _line, _box, text in self._lines]

    def items(self) -> list[tuple[str, str, bool]]:
        return [(t, d, b.isChecked()) for (t, d), b in zip(self._items, self.boxes)]
