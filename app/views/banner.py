"""An inline message strip (error / warning / info) that never blocks: the window keeps working."""

from __future__ import annotations

from vramlab.app.qt import QtCore, QtWidgets


class Banner(QtWidgets.QFrame):
    """Shows one message; ``kind`` picks the colours from the style sheet. Hidden when empty. ``topic`` (the
    owner's tag) says what the message is about, so that the owner can replace or clear its own kind of
    message without reading the text."""

    dismissed = QtCore.Signal()

    def __init__(self, parent: QtWidgets.QWidget | None = None, closable: bool = True) -> None:
        super().__init__(parent)
        self.setObjectName("Banner")
        self.setProperty("kind", "info")
        self._topic: str | None = None
        layout = QtWidgets.QHBoxLayout(self)
        layout.setContentsMargins(8, 4, 4, 4)
        self._icon = QtWidgets.QLabel(self)
        self._icon.setFixedWidth(18)
        self._icon.setAlignment(QtCore.Qt.AlignmentFlag.AlignTop | QtCore.Qt.AlignmentFlag.AlignHCenter)
        self._text = QtWidgets.QLabel(self)
        self._text.setWordWrap(True)
        self._text.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self._text.setSizePolicy(QtWidgets.QSizePolicy.Policy.Expanding, QtWidgets.QSizePolicy.Policy.Preferred)
        layout.addWidget(self._icon)
        layout.addWidget(self._text, 1)
        self._close = QtWidgets.QToolButton(self)
        self._close.setText("✕")
        self._close.setToolTip("Dismiss this message")
        self._close.setAutoRaise(True)
        self._close.clicked.connect(self._dismiss)
        self._close.setVisible(closable)
        layout.addWidget(self._close, 0, QtCore.Qt.AlignmentFlag.AlignTop)
        self.setVisible(False)

    def text(self) -> str:
        return self._text.text()

    def kind(self) -> str:
        return str(self.property("kind"))

    def topic(self) -> str | None:
        """The tag of the message on show (None when hidden or untagged)."""
        return self._topic

    def show_message(self, text: str, kind: str = "error", topic: str | None = None) -> None:
        if not text:
            self.clear()
            return
        self._topic = topic
        pixmap = {"error": QtWidgets.QStyle.StandardPixmap.SP_MessageBoxCritical,
                  "warning": QtWidgets.QStyle.StandardPixmap.SP_MessageBoxWarning,
                  "info": QtWidgets.QStyle.StandardPixmap.SP_MessageBoxInformation}.get(kind)
        if pixmap is not None:
            self._icon.setPixmap(self.style().standardIcon(pixmap).pixmap(16, 16))
        self._text.setText(text)
        if self.property("kind") != kind:
            self.setProperty("kind", kind)
            self.style().unpolish(self)
            self.style().polish(self)
            for child in self.findChildren(QtWidgets.QWidget):
                child.style().unpolish(child)
                child.style().polish(child)
        self.setVisible(True)

    def clear(self) -> None:
        self._topic = None
        self._text.setText("")
        self.setVisible(False)

    def _dismiss(self) -> None:
        self.clear()
        self.dismissed.emit()
