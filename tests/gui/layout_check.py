"""Finds text the window does not show whole: a label, button, check box, combo box, group box, tab or table cell
whose text is wider (or, wrapped, taller) than the room it has, or that its parents cut off.

A text that elides on purpose is allowed when the widget (or the cell) carries the full text in its tooltip.
A scroll area may scroll vertically, never sideways (a horizontal scroll bar in a side panel is the clipping
the user sees); a table may scroll sideways only when it says so (``setProperty("scrollsSideways", n)``: its
first n columns stay in view), and then each cell must still fit its column.

Used by tests/gui/test_layout.py, in process and, at a 2x device-pixel ratio, in a subprocess
(``python -m tests.gui.layout_check``).
"""

from __future__ import annotations

import re
from html import unescape

from vramlab.app.qt import QtCore, QtGui, QtWidgets

SLACK = 1  # px: rounding of font metrics
WORD = re.compile(r"[^\s\u200b]+")  # a zero-width space is a place to break


def _name(w: QtWidgets.QWidget) -> str:
    parts = []
    p: QtWidgets.QWidget | None = w
    while p is not None and len(parts) < 4:
        parts.append(p.objectName() or type(p).__name__)
        p = p.parentWidget()
    return "/".join(reversed(parts))


def _plain(text: str) -> str:
    if "<" in text and ">" in text:
        doc = QtGui.QTextDocument()
        doc.setHtml(text)
        return doc.toPlainText()
    return unescape(text)


def _elides_on_purpose(text: str, tooltip: str) -> bool:
    return "…" in text and bool(tooltip.strip()) and text.replace("…", "").strip()[:8] in tooltip + "…"


def _clipped_by_parents(w: QtWidgets.QWidget) -> str:
    """How the widget's rectangle is cut by its ancestors (a vertical scroll is fine)."""
    rect = QtCore.QRect(w.mapTo(w.window(), QtCore.QPoint(0, 0)), w.size())
    p = w.parentWidget()
    while p is not None and not p.isWindow():
        area = QtCore.QRect(p.mapTo(p.window(), QtCore.QPoint(0, 0)), p.size())
        scroll = p.parentWidget() if isinstance(p.parentWidget(), QtWidgets.QAbstractScrollArea) else None
        seen = QtCore.QRect(area)
        if scroll is not None and p is scroll.viewport():
            if scroll.verticalScrollBar().maximum() > 0:  # scrolled vertically: only the sides count
                area.setTop(-10**6)
                area.setBottom(10**6)
        if not area.contains(rect):
            cut = rect.intersected(area)
            if cut.isEmpty() and scroll is not None:  # scrolled out of sight
                return ""
            return (f"cut by {_name(p)}: needs {rect.width()}x{rect.height()} at "
                    f"({rect.x()},{rect.y()}), shown {cut.width()}x{cut.height()}")
        if scroll is not None and p is scroll.viewport():
            rect = rect.intersected(QtCore.QRect(rect.x(), seen.y(), rect.width(), seen.height()))
            if rect.isEmpty():
                return ""
            p = scroll  # the scroll area's frame holds the viewport: nothing more to cut
        p = p.parentWidget()
    return ""


def _label(w: QtWidgets.QLabel) -> str:
    text = _plain(w.text())
    if not text.strip() or w.pixmap() is not None and not w.pixmap().isNull():
        return ""
    if _elides_on_purpose(text, w.toolTip()):
        return ""
    cr = w.contentsRect()
    margin = 2 * w.margin() + 2 * max(w.indent(), 0)
    fm = w.fontMetrics()
    if w.wordWrap():
        bold = QtGui.QFont(w.font())
        bold.setBold(True)
        fmb = QtGui.QFontMetrics(bold)
        rich = w.textFormat() != QtCore.Qt.TextFormat.PlainText and "<" in w.text()
        for word in set(WORD.findall(text)):
            need = (fmb if rich and f"<b>{word}" in w.text() else fm).horizontalAdvance(word)
            if need > cr.width() - margin + SLACK:
                return f"breaks the word {word!r} ({need} px) in {cr.width()} px"
        need_h = w.heightForWidth(w.width())
        if need_h > w.height() + SLACK:
            return f"wrapped text needs {need_h} px of height, has {w.height()}"
        return ""
    hint = w.sizeHint()
    if hint.width() > w.width() + SLACK:
        return f"needs {hint.width()} px, has {w.width()}"
    if "\n" not in text and fm.height() > cr.height() + SLACK:
        return f"needs {fm.height()} px of height, has {cr.height()}"
    return ""


def _button(w: QtWidgets.QAbstractButton) -> str:
    if not w.text().strip():
        return ""
    if isinstance(w, QtWidgets.QToolButton) and w.toolButtonStyle() == QtCore.Qt.ToolButtonStyle.ToolButtonIconOnly:
        return ""
    if _elides_on_purpose(w.text(), w.toolTip()):
        return ""
    hint = w.sizeHint()
    if hint.width() > w.width() + SLACK:
        return f"needs {hint.width()} px, has {w.width()}"
    return ""


def _combo(w: QtWidgets.QComboBox) -> str:
    text = w.currentText()
    if not text or w.isEditable():
        return ""
    opt = QtWidgets.QStyleOptionComboBox()
    opt.initFrom(w)
    opt.editable = False
    opt.currentText = text
    field = w.style().subControlRect(QtWidgets.QStyle.ComplexControl.CC_ComboBox, opt,
                                     QtWidgets.QStyle.SubControl.SC_ComboBoxEditField, w)
    need = w.fontMetrics().horizontalAdvance(text)
    if need > field.width() + SLACK:
        return f"shows {text!r} ({need} px) in {field.width()} px"
    return ""


def _group(w: QtWidgets.QGroupBox) -> str:
    if not w.title():
        return ""
    bold = QtGui.QFont(w.font())
    need = QtGui.QFontMetrics(bold).horizontalAdvance(w.title().replace("&", "")) + 16
    return f"title needs {need} px, has {w.width()}" if need > w.width() + SLACK else ""


def _tabs(w: QtWidgets.QTabBar) -> str:
    for i in range(w.count()):
        need = w.fontMetrics().horizontalAdvance(w.tabText(i).replace("&", ""))
        if need > w.tabRect(i).width() + SLACK:
            return f"tab {w.tabText(i)!r} needs {need} px, has {w.tabRect(i).width()}"
    return ""


def _view_item_option(view: QtWidgets.QAbstractItemView) -> QtWidgets.QStyleOptionViewItem:
    opt = QtWidgets.QStyleOptionViewItem()
    opt.initFrom(view)
    opt.font = view.font()
    opt.fontMetrics = view.fontMetrics()
    opt.widget = view
    opt.decorationSize = view.iconSize() if view.iconSize().isValid() else QtCore.QSize(16, 16)
    opt.textElideMode = view.textElideMode()
    opt.features = QtWidgets.QStyleOptionViewItem.ViewItemFeature.None_
    opt.showDecorationSelected = True
    return opt


def _table(view: QtWidgets.QTableView) -> list[str]:
    out: list[str] = []
    model = view.model()
    if model is None:
        return out
    header = view.horizontalHeader()
    viewport_w = view.viewport().width()
    # scrollsSideways = n: the table may scroll sideways, but its first n shown columns must be in view
    keep = view.property("scrollsSideways")
    by_place = [header.logicalIndex(v) for v in range(header.count())]
    in_view = set(range(model.columnCount())) if keep is None else \
        set([c for c in by_place if not view.isColumnHidden(c)][:int(keep)])
    opt = _view_item_option(view)
    role = QtCore.Qt.ItemDataRole
    viewport_h = view.viewport().height()
    for r in range(model.rowCount()):
        if not view.isRowHidden(r) and view.rowHeight(r) > viewport_h + SLACK and viewport_h > 0:
            out.append(f"{_name(view)}: row {r} is {view.rowHeight(r)} px high, taller than the table's "
                       f"{viewport_h} px")
    for c in range(model.columnCount()):
        if view.isColumnHidden(c):
            continue
        width = view.columnWidth(c)
        title = str(model.headerData(c, QtCore.Qt.Orientation.Horizontal, role.DisplayRole) or "")
        left = view.columnViewportPosition(c) + view.horizontalScrollBar().value()
        if c in in_view and left + width > viewport_w + SLACK and (title or model.rowCount()):
            out.append(f"{_name(view)}: column {title!r} ends at {left + width} px, past the table's "
                       f"{viewport_w} px")
        if header.isVisible() and title:
            hopt = QtWidgets.QStyleOptionHeader()
            hopt.initFrom(header)
            hopt.text = title
            hopt.section = c
            hopt.fontMetrics = header.fontMetrics()
            need = header.style().sizeFromContents(QtWidgets.QStyle.ContentsType.CT_HeaderSection, hopt,
                                                   QtCore.QSize(), header).width()
            if need > header.sectionSize(c) + SLACK:
                tip = str(model.headerData(c, QtCore.Qt.Orientation.Horizontal, role.ToolTipRole) or "")
                if title not in tip:
                    out.append(f"{_name(view)}: header {title!r} needs {need} px, has {header.sectionSize(c)}")
        for r in range(model.rowCount()):
            if view.isRowHidden(r):
                continue
            index = model.index(r, c)
            text = str(model.data(index, role.DisplayRole) or "")
            if not text.strip():
                continue
            span = view.columnSpan(r, c)
            room = sum(view.columnWidth(c + i) for i in range(span)) - (1 if view.showGrid() else 0)
            tip = str(model.data(index, role.ToolTipRole) or "")
            if text.rstrip(" …") in tip and len(tip) >= len(text.rstrip(" …")):  # the tooltip shows it whole
                continue
            where = f"{_name(view)}: cell ({r}, {title!r}) {text[:40]!r}"
            opt.rect = QtCore.QRect()
            opt.features = QtWidgets.QStyleOptionViewItem.ViewItemFeature.None_
            one_line = view.itemDelegateForIndex(index).sizeHint(opt, index)
            if view.wordWrap() and one_line.width() > room + SLACK:
                # wrapped at the column's width: every word fits it, and the row holds the lines
                font = model.data(index, role.FontRole) or view.font()
                fm = QtGui.QFontMetrics(font)
                pad = one_line.width() - fm.horizontalAdvance(text)
                opt.rect = QtCore.QRect(0, 0, room, view.rowHeight(r))
                opt.features = QtWidgets.QStyleOptionViewItem.ViewItemFeature.WrapText
                need = view.itemDelegateForIndex(index).sizeHint(opt, index)
                wide = [w for w in WORD.findall(text) if fm.horizontalAdvance(w) + pad > room + SLACK]
                if wide:
                    out.append(f"{where}: the word {wide[0]!r} does not fit {room} px")
                elif need.height() > view.rowHeight(r) + SLACK:
                    out.append(f"{where} needs {need.height()} px of height, has {view.rowHeight(r)}")
                continue
            if one_line.width() > room + SLACK and not view.wordWrap():
                out.append(f"{where} needs {one_line.width()} px, has {room}")
    return out


def _text_view(w: QtWidgets.QTextEdit) -> str:
    """Rich text in a text view that wraps to its width and is as tall as its text (no scroll bar)."""
    doc = w.document()
    text = doc.toPlainText()
    if not text.strip():
        return ""
    room = w.viewport().width() - 2 * doc.documentMargin()
    bold = QtGui.QFont(w.font())
    bold.setBold(True)
    fm = QtGui.QFontMetrics(bold)  # the widest a word can be drawn here
    for word in set(WORD.findall(text)):
        if fm.horizontalAdvance(word) > room + SLACK:
            return f"breaks the word {word!r} ({fm.horizontalAdvance(word)} px) in {room:.0f} px"
    if w.verticalScrollBarPolicy() == QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff:
        need = doc.size().height()
        if need > w.viewport().height() + SLACK:
            return f"text needs {need:.0f} px of height, has {w.viewport().height()}"
    return ""


def _scroll_area(w: QtWidgets.QScrollArea) -> str:
    inner = w.widget()
    if inner is None:
        return ""
    bar = w.horizontalScrollBar()
    if bar.isVisible() and bar.maximum() > 0:
        return f"scrolls sideways by {bar.maximum()} px (content {inner.width()} px in {w.viewport().width()})"
    need = inner.minimumSizeHint().width()
    if need > w.viewport().width() + SLACK:
        return f"content needs {need} px, shown in {w.viewport().width()} px"
    return ""


def clipped_text(window: QtWidgets.QWidget) -> list[str]:
    """Every place in ``window`` (and its visible docks) where text is not shown whole."""
    problems: list[str] = []
    for w in window.findChildren(QtWidgets.QWidget):
        if not w.isVisible() or w.width() <= 0 or w.height() <= 0:
            continue
        if isinstance(w, QtWidgets.QTableView):
            problems += _table(w)
            continue
        what = ""
        if isinstance(w, QtWidgets.QLabel):
            what = _label(w)
        elif isinstance(w, QtWidgets.QAbstractButton):
            what = _button(w)
        elif isinstance(w, QtWidgets.QComboBox):
            what = _combo(w)
        elif isinstance(w, QtWidgets.QGroupBox):
            what = _group(w)
        elif isinstance(w, QtWidgets.QTabBar):
            what = _tabs(w)
        elif isinstance(w, QtWidgets.QTextEdit) and w.lineWrapMode() != QtWidgets.QTextEdit.LineWrapMode.NoWrap:
            what = _text_view(w)
        elif isinstance(w, QtWidgets.QScrollArea):
            what = _scroll_area(w)
        if not what and isinstance(w, (QtWidgets.QLabel, QtWidgets.QAbstractButton, QtWidgets.QComboBox)):
            text = w.text() if hasattr(w, "text") else w.currentText()
            if text and text.strip() and not (isinstance(w, QtWidgets.QLabel) and w.pixmap() is not None
                                              and not w.pixmap().isNull()):
                what = _clipped_by_parents(w)
        if what:
            label = w.text() if hasattr(w, "text") else getattr(w, "title", lambda: "")()
            problems.append(f"{_name(w)} {_plain(str(label))[:50]!r}: {what}")
    return problems
