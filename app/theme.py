"""Light and dark themes: a Fusion palette, a small style sheet and the chart colours.

The mode is "system" by default (follow the desktop's colour scheme, and keep following it when it
changes), or a fixed "light" / "dark". The memory-kind colours do not change with the theme (see
:mod:`vramlab.app.palette`); only surfaces, text and lines do.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from string import Template

from vramlab.app.qt import QtCore, QtGui, QtWidgets


class ThemeMode(StrEnum):
    SYSTEM = "system"
    LIGHT = "light"
    DARK = "dark"


@dataclass(frozen=True)
class Theme:
    name: str
    dark: bool
    window: str
    base: str
    alt_base: str
    text: str
    muted: str
    border: str
    accent: str
    highlight_text: str
    chart_bg: str
    chart_fg: str
    good: str
    bad: str
    capacity: str
    reference: str
    error_bg: str
    error_fg: str
    warning_bg: str
    warning_fg: str
    info_bg: str
    info_fg: str

    def color(self, name: str) -> QtGui.QColor:
        return QtGui.QColor(getattr(self, name))


LIGHT = Theme(
    name="light", dark=False,
    window="#F4F5F7", base="#FFFFFF", alt_base="#F0F2F5", text="#1D2026", muted="#5B6270",
    border="#CDD2DA", accent="#1F5FBF", highlight_text="#FFFFFF",
    chart_bg="#FFFFFF", chart_fg="#2F343C",
    good="#1B7A3A", bad="#B3261E", capacity="#B3261E", reference="#6B7280",
    error_bg="#FCEBEA", error_fg="#7F1D1D", warning_bg="#FFF4D6", warning_fg="#5C4100",
    info_bg="#E7EFFC", info_fg="#1E3A8A",
)

DARK = Theme(
    name="dark", dark=True,
    window="#1F2228", base="#17191E", alt_base="#23272E", text="#E6E8EC", muted="#9CA4B2",
    border="#3A3F48", accent="#6AA8FF", highlight_text="#0B1220",
    chart_bg="#17191E", chart_fg="#D6DAE1",
    good="#5BD68A", bad="#FF8A80", capacity="#FF8A80", reference="#A3AAB6",
    error_bg="#3D1F21", error_fg="#FFB4AB", warning_bg="#3A3013", warning_fg="#FFD97A",
    info_bg="#1D2A44", info_fg="#A8C7FA",
)


def system_prefers_dark() -> bool:
    app = QtGui.QGuiApplication.instance()
    if app is None:
        return False
    return QtGui.QGuiApplication.styleHints().colorScheme() == QtCore.Qt.ColorScheme.Dark


def resolve(mode: ThemeMode | str) -> Theme:
    mode = ThemeMode(mode)
    if mode is ThemeMode.SYSTEM:
        return DARK if system_prefers_dark() else LIGHT
    return DARK if mode is ThemeMode.DARK else LIGHT


def palette_for(theme: Theme) -> QtGui.QPalette:
    pal = QtGui.QPalette()
    role = QtGui.QPalette.ColorRole
    group = QtGui.QPalette.ColorGroup
    c = theme.color
    for r, name in (
        (role.Window, "window"), (role.WindowText, "text"), (role.Base, "base"),
        (role.AlternateBase, "alt_base"), (role.Text, "text"), (role.Button, "alt_base"),
        (role.ButtonText, "text"), (role.ToolTipBase, "base"), (role.ToolTipText, "text"),
        (role.Highlight, "accent"), (role.HighlightedText, "highlight_text"), (role.Link, "accent"),
        (role.PlaceholderText, "muted"), (role.Mid, "border"), (role.Dark, "border"),
    ):
        pal.setColor(r, c(name))
    pal.setColor(role.Light, c("base") if not theme.dark else QtGui.QColor("#4A505A"))
    pal.setColor(role.Shadow, QtGui.QColor("#000000") if theme.dark else QtGui.QColor("#9AA0A8"))
    muted = c("muted")
    for r in (role.WindowText, role.Text, role.ButtonText):
        pal.setColor(group.Disabled, r, muted)
    pal.setColor(group.Disabled, role.Base, c("alt_base") if not theme.dark else c("window"))
    return pal


def style_sheet(theme: Theme) -> str:
    template = resources.files("vramlab.resources").joinpath("styles/app.qss").read_text(encoding="utf-8")
    values = {name: getattr(theme, name) for name in Theme.__dataclass_fields__ if name not in ("name", "dark")}
    icons = resources.files("vramlab.resources").joinpath("icons")
    values["icons"] = str(icons).replace("\\", "/")
    return Template(template).safe_substitute(values)


def apply_theme(app: QtWidgets.QApplication, theme: Theme) -> None:
    """Fusion style with the theme's palette and style sheet (Fusion looks the same on every desktop)."""
    if app.style().name().lower() != "fusion":
        app.setStyle("Fusion")
    palette = palette_for(theme)
    if app.palette() != palette:
        app.setPalette(palette)
    sheet = style_sheet(theme)
    if app.styleSheet() != sheet:  # re-polishing every widget is the slow part of a theme change
        app.setStyleSheet(sheet)
