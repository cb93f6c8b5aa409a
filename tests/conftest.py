"""Shared test fixtures. GUI tests run offscreen; a test that leaves a QThread or child process running
fails (see tests/gui/conftest.py)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("PYQTGRAPH_QT_LIB", "PySide6")
