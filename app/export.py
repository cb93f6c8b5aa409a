"""Exports: widgets to PNG (at 2x for HiDPI and slides) and SVG, the comparison table to CSV and Markdown,
and both to the clipboard.

SVG does not use pyqtgraph's SVGExporter, which fails on every plot in pyqtgraph 0.14.0 (pyqtgraph issue
#3495); instead the widget paints itself into a ``QSvgGenerator`` through ``QPainter``, which keeps
bars, lines and text as vectors.
"""

from __future__ import annotations

from pathlib import Path

from vramlab.app.qt import QtCore, QtGui, QtSvg, QtWidgets
from vramlab.core.fileio import write_atomic

PNG_SCALE = 2.0


def _prepare(widget: QtWidgets.QWidget) -> None:
    """Lay out a widget that may never have been shown, so it renders at its real size."""
    widget.ensurePolished()
    layout = widget.layout()
    if layout is not None:
        layout.activate()
    if not widget.isVisible():
        widget.setAttribute(QtCore.Qt.WidgetAttribute.WA_DontShowOnScreen, True)
        widget.show()
        QtWidgets.QApplication.processEvents()


def render_widget_image(widget: QtWidgets.QWidget, scale: float = PNG_SCALE,
                        background: str | None = None) -> QtGui.QImage:
    """The widget at ``scale`` times its logical size (text and lines are drawn at that resolution)."""
    _prepare(widget)
    size = widget.size()
    image = QtGui.QImage(max(1, round(size.width() * scale)), max(1, round(size.height() * scale)),
                         QtGui.QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(QtGui.QColor(background) if background else widget.palette().color(QtGui.QPalette.ColorRole.Window))
    dots = round(96 * scale / 0.0254)
    image.setDotsPerMeterX(dots)
    image.setDotsPerMeterY(dots)
    painter = QtGui.QPainter(image)
    painter.setRenderHints(QtGui.QPainter.RenderHint.Antialiasing | QtGui.QPainter.RenderHint.TextAntialiasing
                           | QtGui.QPainter.RenderHint.SmoothPixmapTransform)
    painter.scale(scale, scale)
    widget.render(painter, QtCore.QPoint(), QtGui.QRegion(), QtWidgets.QWidget.RenderFlag.DrawChildren
                  | QtWidgets.QWidget.RenderFlag.DrawWindowBackground)
    painter.end()
    return image


def save_png(widget: QtWidgets.QWidget, path: str | Path, scale: float = PNG_SCALE,
             background: str | None = None) -> QtCore.QSize:
    image = render_widget_image(widget, scale, background)
    buf = QtCore.QBuffer()
    buf.open(QtCore.QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buf, "PNG"):
        raise OSError(f"could not encode {Path(path).name} as PNG")
    write_atomic(path, bytes(buf.data()))
    return image.size()


def save_svg(widget: QtWidgets.QWidget, path: str | Path, title: str = "VRAM Lab",
             description: str = "", background: str | None = None) -> None:
    """Vector output via QSvgGenerator + QPainter (the workaround for pyqtgraph issue #3495)."""
    _prepare(widget)
    size = widget.size()
    buf = QtCore.QBuffer()
    buf.open(QtCore.QIODevice.OpenModeFlag.WriteOnly)
    gen = QtSvg.QSvgGenerator()
    gen.setOutputDevice(buf)
    gen.setSize(size)
    gen.setViewBox(QtCore.QRect(QtCore.QPoint(0, 0), size))
    gen.setTitle(title)
    gen.setDescription(description or "Exported from VRAM Lab")
    gen.setResolution(96)
    painter = QtGui.QPainter()
    if not painter.begin(gen):
        raise OSError(f"could not write {path}")
    painter.setRenderHints(QtGui.QPainter.RenderHint.Antialiasing | QtGui.QPainter.RenderHint.TextAntialiasing)
    fill = QtGui.QColor(background) if background else widget.palette().color(QtGui.QPalette.ColorRole.Window)
    painter.fillRect(QtCore.QRect(QtCore.QPoint(0, 0), size), fill)
    widget.render(painter, QtCore.QPoint(), QtGui.QRegion(), QtWidgets.QWidget.RenderFlag.DrawChildren)
    painter.end()
    write_atomic(path, bytes(buf.data()))


# ---- tables --------------------------------------------------------------------------------------------------

def write_text(path: str | Path, text: str) -> None:
    """Written to a temporary file and renamed (a failed export never truncates an older one)."""
    write_atomic(path, text)


def copy_image(image: QtGui.QImage) -> None:
    QtWidgets.QApplication.clipboard().setImage(image)


def copy_table(markdown: str, csv_text: str) -> None:
    """Markdown as plain text (chat, issues, docs) and CSV for spreadsheets that ask for text/csv."""
    mime = QtCore.QMimeData()
    mime.setText(markdown)
    mime.setData("text/csv", QtCore.QByteArray(csv_text.encode("utf-8")))
    QtWidgets.QApplication.clipboard().setMimeData(mime)
    _clear_headless_clipboard_on_quit()


_CLEAR_HOOKED = False


def _clear_headless_clipboard_on_quit() -> None:
    """On the offscreen / minimal platforms Qt keeps clipboard data in a static that outlives Python; a
    QMimeData made in Python then crashes the process at exit (PySide6 6.11). Clearing it on quit avoids
    that. Desktop platforms hand the data to the system clipboard and need nothing."""
    global _CLEAR_HOOKED
    app = QtWidgets.QApplication.instance()
    if _CLEAR_HOOKED or app is None or QtGui.QGuiApplication.platformName() not in ("offscreen", "minimal"):
        return
    app.aboutToQuit.connect(clear_clipboard)
    _CLEAR_HOOKED = True


def clear_clipboard() -> None:
    QtWidgets.QApplication.clipboard().clear()
