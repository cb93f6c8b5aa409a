"""The chart legend: a colour swatch and a name per memory kind or overhead, with the kind's description
as a tooltip. A wrapping flow of widgets rather than a pyqtgraph LegendItem, so it reflows with the window
and each entry can explain itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vramlab.app.qt import QtCore, QtGui, QtWidgets


@dataclass(frozen=True)
class LegendEntry:
    key: str
    label: str
    color: str  # #RRGGBB
    description: str
    overhead: bool = False


class FlowLayout(QtWidgets.QLayout):
    """Lays children out left to right, wrapping to new lines (Qt's flow layout example)."""

    def __init__(self, parent: QtWidgets.QWidget | None = None, spacing: int = 6) -> None:
        super().__init__(parent)
        self._items: list[QtWidgets.QLayoutItem] = []
        self._spacing = spacing

    def addItem(self, item: QtWidgets.QLayoutItem) -> None:  # noqa: N802 (Qt API)
        self._items.append(item)

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int) -> QtWidgets.QLayoutItem | None:  # noqa: N802
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int) -> QtWidgets.QLayoutItem | None:  # noqa: N802
        return self._items.pop(index) if 0 <= index < len(self._items) else None

    def expandingDirections(self) -> QtCore.Qt.Orientation:  # noqa: N802
        return QtCore.Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:  # noqa: N802
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802
        return self._do_layout(QtCore.QRect(0, 0, width, 0), test=True)

    def setGeometry(self, rect: QtCore.QRect) -> None:  # noqa: N802
        super().setGeometry(rect)
        self._do_layout(rect, test=False)

    def sizeHint(self) -> QtCore.QSize:  # noqa: N802
        return self.minimumSize()

    def minimumSize(self) -> QtCore.QSize:  # noqa: N802
        size = QtCore.QSize()
        for item in self._items:
            size = size.expandedTo(item.minimumSize())
        m = self.contentsMargins()
        return size + QtCore.QSize(m.left() + m.right(), m.top() + m.bottom())

    def _do_layout(self, rect: QtCore.QRect, test: bool) -> int:
        m = self.contentsMargins()
        area = rect.adjusted(m.left(), m.top(), -m.right(), -m.bottom())
        x, y, line = area.x(), area.y(), 0
        for item in self._items:
            hint = item.sizeHint()
            if x + hint.width() > area.right() + 1 and line > 0:
                x, y, line = area.x(), y + line + self._spacing // 2, 0
            if not test:
                item.setGeometry(QtCore.QRect(QtCore.QPoint(x, y), hint))
            x += hint.width() + self._spacing * 2
            line = max(line, hint.height())
        return y + line - rect.y() + m.bottom()


class Swatch(QtWidgets.QWidget):
    def __init__(self, color: str, parent: QtWidgets.QWidget | None = None, size: int = 12) -> None:
        super().__init__(parent)
        self._color = QtGui.QColor(color)
        self.setFixedSize(size, size)

    def paintEvent(self, event: QtGui.QPaintEvent) -> None:  # noqa: N802
        p = QtGui.QPainter(self)
        p.setPen(QtGui.QPen(self.palette().color(QtGui.QPalette.ColorRole.WindowText), 0.6))
        p.setBrush(self._color)
        p.drawRect(self.rect().adjusted(0, 0, -1, -1))
        p.end()


class LegendWidget(QtWidgets.QWidget):
    """Rebuilds its entries only when the set of entries changes (not on every value change)."""

    def __init__(self, parent: QtWidgets.QWidget | None = None, point_size: float | None = None) -> None:
        super().__init__(parent)
        self._layout = FlowLayout(self)
        self._layout.setContentsMargins(4, 2, 4, 2)
        self._entries: tuple[LegendEntry, ...] = ()
        self._point_size = point_size
        self.setSizePolicy(QtWidgets.QSizePolicy.Policy.Preferred, QtWidgets.QSizePolicy.Policy.Minimum)

    def entries(self) -> tuple[LegendEntry, ...]:
        return self._entries

    def set_entries(self, entries: Sequence[LegendEntry]) -> None:
        entries = tuple(entries)
        if entries == self._entries:
            return
        self._entries = entries
        while self._layout.count():
            item = self._layout.takeAt(0)
            if item is not None and item.widget() is not None:
                old = item.widget()
                old.hide()  # deleteLater waits for the event loop; hidden, it cannot overlap the new entries
                old.deleteLater()
        for e in entries:
            box = QtWidgets.QWidget(self)
            row = QtWidgets.QHBoxLayout(box)
            row.setContentsMargins(0, 0, 0, 0)
            row.setSpacing(5)
            size = 12 if self._point_size is None else int(self._point_size * 1.3)
            row.addWidget(Swatch(e.color, box, size))
            text = QtWidgets.QLabel(e.label + (" (overhead)" if e.overhead else ""), box)
            if self._point_size is not None:
                font = text.font()
                font.setPointSizeF(self._point_size)
                text.setFont(font)
            row.addWidget(text)
            box.setToolTip(f"<b>{e.label}</b><br>{e.description}")
            box.setObjectName(f"legend:{e.key}")
            self._layout.addWidget(box)
        self._layout.invalidate()
        self.updateGeometry()
