"""The one place the GUI imports its Qt binding and pyqtgraph, in the order that binds them together.

PySide6 is imported first and ``PYQTGRAPH_QT_LIB`` is set before pyqtgraph loads, so pyqtgraph can never
pick up another binding that happens to be installed (and PyInstaller bundles the right one). Every GUI
module imports ``pg`` from here rather than importing pyqtgraph itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYQTGRAPH_QT_LIB", "PySide6")

from PySide6 import QtCore, QtGui, QtSvg, QtWidgets  # noqa: E402  (binding first, on purpose)

# isort: split
import pyqtgraph as pg  # noqa: E402

pg.setConfigOptions(antialias=True)

__all__ = ["QtCore", "QtGui", "QtSvg", "QtWidgets", "pg"]
