"""A read-only table of text whose cells live in a model: a refresh hands it new rows, and Qt asks the model for
what it draws. No Qt object is made per cell.

Why not ``QTableWidget``: each of its cells is a ``QTableWidgetItem``, which a view filling it from Python makes
(a C++ object with a Python wrapper), and which Qt deletes when the next refresh puts another item in that cell
or drops its row. With PySide6 6.11.3 that deletion now and then crashed in Shiboken's release of the item's
wrapper (``Shiboken::Object::destroy`` -> ``BindingManager::releaseWrapper``, a segmentation fault, seen under
gdb): 3 of 30 runs of the GUI test that drags a control, while the phases view refilled its residuals on every
recompute, and once more in a full ``make test``. The same test did not crash in 40 runs with the items kept
(their text set instead) nor in 40 with this table, which has no items at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from vramlab.app.qt import QtCore, QtGui, QtWidgets

RIGHT = QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter
CENTER = QtCore.Qt.AlignmentFlag.AlignCenter


class Cell(NamedTuple):
    """One cell: its text, and how it is shown."""

    text: str
    align: QtCore.Qt.AlignmentFlag | None = None  # None: the view's default (left)
    tooltip: str = ""
    bold: bool = False
    muted: bool = False  # in the palette's placeholder colour (a default, a setting that does not apply)


def _cell(value: Cell | str) -> Cell:
    return value if isinstance(value, Cell) else Cell(value)


class TextTableModel(QtCore.QAbstractTableModel):
    """Rows of :class:`Cell` under a row of headers."""

    def __init__(self, headers: Sequence[str], parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self._headers = list(headers)
        self._rows: list[list[Cell]] = []
        self.bold_font: QtGui.QFont | None = None
        self.muted_color: QtGui.QColor | None = None
        self.two_line_headers = False  # "Residual [MiB]" drawn as "Residual" over "[MiB]": narrower columns

    def set_rows(self, rows: Sequence[Sequence[Cell | str]], headers: Sequence[str] | None = None) -> None:
        """Show ``rows`` (each as many cells as there are headers; shorter rows are padded with empty cells)."""
        new_headers = self._headers if headers is None else list(headers)
        width = len(new_headers)
        new_rows = [[_cell(v) for v in row[:width]] + [Cell("")] * (width - len(row)) for row in rows]
        if new_headers == self._headers and len(new_rows) == len(self._rows):
            self._rows = new_rows
            if new_rows:
                self.dataChanged.emit(self.index(0, 0), self.index(len(new_rows) - 1, width - 1))
            return
        self.beginResetModel()
        self._headers, self._rows = new_headers, new_rows
        self.endResetModel()

    def set_text(self, row: int, column: int, text: str) -> None:
        """Change one cell's text (its look kept)."""
        self._rows[row][column] = self._rows[row][column]._replace(text=text)
        index = self.index(row, column)
        self.dataChanged.emit(index, index)

    def cell(self, row: int, column: int) -> Cell:
        return self._rows[row][column]

    def header(self, column: int) -> str:
        return self._headers[column]

    # ---- QAbstractTableModel ---------------------------------------------------------------------------------------
    def rowCount(self, parent: QtCore.QModelIndex | None = None) -> int:  # noqa: N802 - Qt's name
        return 0 if parent is not None and parent.isValid() else len(self._rows)

    def columnCount(self, parent: QtCore.QModelIndex | None = None) -> int:  # noqa: N802 - Qt's name
        return 0 if parent is not None and parent.isValid() else len(self._headers)

    def data(self, index: QtCore.QModelIndex, role: int = QtCore.Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not (0 <= index.row() < len(self._rows)):
            return None
        cell = self._rows[index.row()][index.column()]
        if role == QtCore.Qt.ItemDataRole.DisplayRole:
            return cell.text
        if role == QtCore.Qt.ItemDataRole.TextAlignmentRole:
            return None if cell.align is None else int(cell.align)
        if role == QtCore.Qt.ItemDataRole.ToolTipRole:
            return cell.tooltip or None
        if role == QtCore.Qt.ItemDataRole.FontRole and cell.bold:
            return self.bold_font
        if role == QtCore.Qt.ItemDataRole.ForegroundRole and cell.muted:
            return self.muted_color
        return None

    def headerData(self, section: int, orientation: QtCore.Qt.Orientation,  # noqa: N802 - Qt's name
                   role: int = QtCore.Qt.ItemDataRole.DisplayRole) -> Any:
        if role == QtCore.Qt.ItemDataRole.DisplayRole and orientation == QtCore.Qt.Orientation.Horizontal \
                and 0 <= section < len(self._headers):
            text = self._headers[section]
            return text.replace(" [", "\n[") if self.two_line_headers else text
        if role == QtCore.Qt.ItemDataRole.ToolTipRole and orientation == QtCore.Qt.Orientation.Horizontal \
                and 0 <= section < len(self._headers):
            return self._headers[section]
        return None


class TextTable(QtWidgets.QTableView):
    """A read-only :class:`TextTableModel` in a table view without row numbers."""

    def __init__(self, headers: Sequence[str], parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.table_model = TextTableModel(headers, self)
        self._follow_look()
        self.setModel(self.table_model)
        self.verticalHeader().setVisible(False)
        self.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)

    def _follow_look(self) -> None:
        """The bold font and the muted colour from the view's own font and palette (a theme switch changes them)."""
        bold = QtGui.QFont(self.font())
        bold.setBold(True)
        self.table_model.bold_font = bold
        self.table_model.muted_color = self.palette().color(QtGui.QPalette.ColorRole.PlaceholderText)

    def changeEvent(self, event: QtCore.QEvent) -> None:  # noqa: N802 - Qt's name
        super().changeEvent(event)
        if event.type() in (QtCore.QEvent.Type.PaletteChange, QtCore.QEvent.Type.FontChange) and \
                hasattr(self, "table_model"):
            self._follow_look()
            self.viewport().update()

    def set_rows(self, rows: Sequence[Sequence[Cell | str]], headers: Sequence[str] | None = None,
                 spans: Sequence[int] = ()) -> None:
        """Show ``rows``; ``spans``: rows whose first cell spans the whole width (a section's title)."""
        self.clearSpans()
        self.table_model.set_rows(rows, headers)
        for row in spans:
            self.setSpan(row, 0, 1, self.table_model.columnCount())

    def set_text(self, row: int, column: int, text: str) -> None:
        self.table_model.set_text(row, column, text)

    def rowCount(self) -> int:  # noqa: N802 - as QTableWidget names it
        return self.table_model.rowCount()

    def columnCount(self) -> int:  # noqa: N802 - as QTableWidget names it
        return self.table_model.columnCount()

    def text(self, row: int, column: int) -> str:
        return self.table_model.cell(row, column).text

    def cell(self, row: int, column: int) -> Cell:
        return self.table_model.cell(row, column)

    def header(self, column: int) -> str:
        return self.table_model.header(column)
