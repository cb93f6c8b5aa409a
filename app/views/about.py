"""The About box: what VRAM Lab is and the versions it runs on (torch only when it is already loaded:
opening this box must not import it)."""

from __future__ import annotations

import platform
import sys

from vramlab.app.qt import QtCore, QtGui, QtWidgets, pg
from vramlab.core import __version__


def versions() -> dict[str, str]:
    import PySide6

    out = {
        "VRAM Lab": __version__,
        "Qt": QtCore.qVersion(),
        "PySide6": PySide6.__version__,
        "pyqtgraph": pg.__version__,
        "Python": platform.python_version(),
        "Platform": f"{platform.system()} {platform.release()} ({platform.machine()})",
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = str(getattr(torch, "__version__", "loaded"))
    return out


class AboutDialog(QtWidgets.QDialog):
    def __init__(self, parent: QtWidgets.QWidget | None = None, icon: QtGui.QIcon | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("About VRAM Lab")
        layout = QtWidgets.QVBoxLayout(self)
        head = QtWidgets.QHBoxLayout()
        if icon is not None and not icon.isNull():
            pic = QtWidgets.QLabel()
            pic.setPixmap(icon.pixmap(64, 64))
            head.addWidget(pic, 0, QtCore.Qt.AlignmentFlag.AlignTop)
        text = QtWidgets.QLabel(
            f"<h2 style='margin:0'>VRAM Lab {__version__}</h2>"
            "<p>How much GPU memory a fine-tuning run takes, where every byte goes, and whether it fits.</p>"
            "<p>Three answers, from instant to certain: the <b>estimate</b> (analytical, under a millisecond), "
            "the <b>simulation</b> (the real architecture on fake tensors, CPU only) and the <b>measurement</b> "
            "(a real step on your GPU, from the command line: <code>vramlab profile</code>).</p>"
            "<p>Numbers are per GPU. GiB = 2<sup>30</sup> bytes (what nvidia-smi and torch print); GB = "
            "10<sup>9</sup> bytes.</p>"
        )
        text.setWordWrap(True)
        text.setTextFormat(QtCore.Qt.TextFormat.RichText)
        text.setMinimumWidth(420)
        head.addWidget(text, 1)
        layout.addLayout(head)
        self.versions = versions()
        grid = QtWidgets.QFormLayout()
        for name, value in self.versions.items():
            label = QtWidgets.QLabel(value)
            label.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
            grid.addRow(f"{name}:", label)
        box = QtWidgets.QGroupBox("Versions")
        box.setLayout(grid)
        layout.addWidget(box)
        buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.StandardButton.Close)
        copy = buttons.addButton("Copy versions", QtWidgets.QDialogButtonBox.ButtonRole.ActionRole)
        copy.clicked.connect(self.copy_versions)
        buttons.rejected.connect(self.reject)
        buttons.accepted.connect(self.accept)
        layout.addWidget(buttons)

    def text(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.versions.items())

    def copy_versions(self) -> None:
        QtWidgets.QApplication.clipboard().setText(self.text())
