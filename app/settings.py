"""Where the GUI keeps what it remembers: window geometry, the last setup, scenarios, theme.

``QSettings`` in INI format under the user's config folder (``~/.config/VRAM Lab/VRAM Lab.ini`` on
Linux). ``VRAMLAB_SETTINGS_FILE`` (or ``--settings FILE``) points it at another file: the tests, the
benchmark and the screenshot tool use a temporary one, so they never read or change a user's settings.
Structured values are stored as JSON text so that they read back with their types on every platform.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.core.fileio import FileProblem, parse_json

ORGANIZATION = "VRAM Lab"
APPLICATION = "VRAM Lab"
ENV_SETTINGS_FILE = "VRAMLAB_SETTINGS_FILE"

# Keys
GEOMETRY = "window/geometry"
WINDOW_STATE = "window/state"
TAB = "window/tab"
MODEL = "setup/model"
FIELDS = "setup/fields"
GPU = "setup/gpu"
LEVEL = "view/level"
UNIT = "view/unit"
COMMON_SIZES = "view/common_sizes"
THEME = "view/theme"
SCENARIOS = "scenarios/json"
LAST_DIR = "files/last_dir"
RECENT_HUB = "setup/recent_hub_ids"  # JSON list, newest first


def open_settings(path: str | os.PathLike[str] | None = None) -> QtCore.QSettings:
    """The settings store: ``path``, else ``$VRAMLAB_SETTINGS_FILE``, else the per-user INI file."""
    target = path or os.environ.get(ENV_SETTINGS_FILE)
    if target:
        return QtCore.QSettings(os.fspath(target), QtCore.QSettings.Format.IniFormat)
    return QtCore.QSettings(QtCore.QSettings.Format.IniFormat, QtCore.QSettings.Scope.UserScope,
                            ORGANIZATION, APPLICATION)


def read_json(settings: QtCore.QSettings, key: str, default: Any = None, problems: list[str] | None = None) -> Any:
    """The JSON value stored under ``key``; ``default`` when there is none or it cannot be read (too deep,
    a number of thousands of digits, NaN, broken text), which is then added to ``problems``."""
    raw = settings.value(key)
    if raw is None or raw == "":
        return default
    try:
        return parse_json(str(raw), f"saved {key}")
    except FileProblem as e:
        if problems is not None:
            problems.append(f"{e}; using the default")
        return default


def write_json(settings: QtCore.QSettings, key: str, value: Any) -> None:
    settings.setValue(key, json.dumps(value))


def read_str(settings: QtCore.QSettings, key: str, default: str = "") -> str:
    raw = settings.value(key)
    return default if raw is None else str(raw)


def read_bytes(settings: QtCore.QSettings, key: str) -> QtCore.QByteArray | None:
    raw = settings.value(key)
    return raw if isinstance(raw, QtCore.QByteArray) and not raw.isEmpty() else None
