"""Shared test fixtures. GUI tests run offscreen; a test that leaves a QThread or child process running
fails (see tests/gui/conftest.py)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# never read or write the developer's own settings and calibration
os.environ["VRAMLAB_CONFIG_DIR"] = tempfile.mkdtemp(prefix="vramlab-test-config-")
os.environ.setdefault("PYQTGRAPH_QT_LIB", "PySide6")
