"""The read-only text tables (residuals, tensors alive at the peak, the live comparison, the config mapping):
cells in a model, no Qt item per cell, so a refresh never has Qt delete an object Python made."""

from __future__ import annotations

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.views.text_table import RIGHT, Cell, TextTable

ROLE = QtCore.Qt.ItemDataRole


def test_the_window_has_no_item_based_table(window):
    """QTableWidget's items are made in Python and deleted by Qt at the next refresh, which crashed PySide6
    6.11.3 now and then (see app/views/text_table.py): no view may use one."""
    assert window.findChildren(QtWidgets.QTableWidget) == []
    for name in ("Residuals", "AliveAtPeak", "LiveResult", "ConfigMapping"):
        assert isinstance(window.findChild(QtWidgets.QTableView, name), TextTable), name


def test_rows_show_their_text_and_look_and_a_refresh_of_the_same_shape_keeps_the_model(qtbot):
    table = TextTable(["what", "bytes"])
    qtbot.addWidget(table)
    model = table.model()
    table.set_rows([["a", Cell("1", RIGHT, "1 byte")], [Cell("b", bold=True, muted=True)]])
    assert (table.rowCount(), table.columnCount()) == (2, 2)
    assert [table.text(r, c) for r in range(2) for c in range(2)] == ["a", "1", "b", ""]  # a short row padded
    assert model.data(model.index(0, 1), ROLE.TextAlignmentRole) == int(RIGHT)
    assert model.data(model.index(0, 1), ROLE.ToolTipRole) == "1 byte"
    assert model.data(model.index(0, 0), ROLE.ToolTipRole) is None
    assert model.data(model.index(1, 0), ROLE.FontRole).bold()
    assert model.data(model.index(1, 0), ROLE.ForegroundRole) == table.palette().color(
        table.palette().ColorRole.PlaceholderText)
    assert model.headerData(1, QtCore.Qt.Orientation.Horizontal) == "bytes"

    resets, changes = [], []
    model.modelReset.connect(lambda: resets.append(1))
    model.dataChanged.connect(lambda a, b, roles=(): changes.append((a.row(), a.column(), b.row(), b.column())))
    table.selectRow(1)
    table.set_rows([["c", "2"], ["d", "3"]])  # same shape: the cells change, the selection stays
    assert not resets and changes == [(0, 0, 1, 1)] and table.selectionModel().isRowSelected(1)
    table.set_text(1, 1, "4")
    assert table.text(1, 1) == "4" and changes[-1] == (1, 1, 1, 1)
    table.set_rows([["e", "5"]], headers=["what", "bytes [GiB]"])  # another shape: a reset
    assert resets and table.rowCount() == 1 and table.header(1) == "bytes [GiB]"


def test_a_section_title_spans_the_table_and_a_refresh_clears_old_spans(qtbot):
    table = TextTable(["a", "b", "c"])
    qtbot.addWidget(table)
    table.set_rows([[Cell("Section", bold=True)], ["x", "1", "2"]], spans=[0])
    assert table.columnSpan(0, 0) == 3 and table.columnSpan(1, 0) == 1
    table.set_rows([["x", "1", "2"], [Cell("Section", bold=True)]], spans=[1])
    assert table.columnSpan(0, 0) == 1 and table.columnSpan(1, 0) == 3


def test_the_muted_colour_and_the_bold_font_follow_the_view_s_palette_and_font(qtbot):
    """A theme switch changes the palette: muted cells take the new placeholder colour."""
    from vramlab.app.qt import QtGui

    table = TextTable(["a"])
    qtbot.addWidget(table)
    table.set_rows([[Cell("x", bold=True, muted=True)]])
    model = table.model()
    palette = QtGui.QPalette(table.palette())
    palette.setColor(QtGui.QPalette.ColorRole.PlaceholderText, QtGui.QColor("#123456"))
    table.setPalette(palette)
    assert model.data(model.index(0, 0), ROLE.ForegroundRole) == QtGui.QColor("#123456")
    font = QtGui.QFont(table.font())
    font.setPointSize(font.pointSize() + 5)
    table.setFont(font)
    shown = model.data(model.index(0, 0), ROLE.FontRole)
    assert shown.bold() and shown.pointSize() == font.pointSize()
