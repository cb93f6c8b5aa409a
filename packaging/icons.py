"""Render the app icon (resources/icons/vramlab.svg) into what each platform's packaging wants.

    python packaging/icons.py OUT_DIR

writes ``OUT_DIR/png/vramlab-<N>.png`` (16 … 1024 px; Linux hicolor theme and the .desktop entry),
``OUT_DIR/vramlab.ico`` (Windows: PNG-compressed entries 16 … 256 px) and ``OUT_DIR/vramlab.icns``
(macOS: PNG entries 16 … 1024 px). Both container formats are written by hand (they are a header and a
table of PNGs), so no image library beyond Qt is needed. Qt renders offscreen; no display is used.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SVG = ROOT / "resources" / "icons" / "vramlab.svg"
PNG_SIZES = (16, 24, 32, 48, 64, 128, 256, 512, 1024)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)
# ICNS entry types holding PNG data, by pixel size (Apple's icns type codes)
ICNS_TYPES = {16: b"icp4", 32: b"icp5", 64: b"icp6", 128: b"ic07", 256: b"ic08", 512: b"ic09", 1024: b"ic10"}


def render_pngs(svg: Path = SVG) -> dict[int, bytes]:
    """The SVG rendered at every size of PNG_SIZES, as PNG bytes."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6 import QtCore, QtGui, QtSvg

    _app = QtGui.QGuiApplication.instance() or QtGui.QGuiApplication([sys.argv[0]])
    renderer = QtSvg.QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"cannot render {svg}")
    out: dict[int, bytes] = {}
    for size in PNG_SIZES:
        image = QtGui.QImage(size, size, QtGui.QImage.Format.Format_ARGB32)
        image.fill(QtCore.Qt.GlobalColor.transparent)
        painter = QtGui.QPainter(image)
        painter.setRenderHint(QtGui.QPainter.RenderHint.Antialiasing)
        renderer.render(painter, QtCore.QRectF(0, 0, size, size))
        painter.end()
        buf = QtCore.QBuffer()
        buf.open(QtCore.QIODevice.OpenModeFlag.WriteOnly)
        image.save(buf, "PNG")
        out[size] = bytes(buf.data())
    return out


def ico(pngs: dict[int, bytes]) -> bytes:
    """A Windows .ico: ICONDIR, one 16-byte ICONDIRENTRY per image, then the PNGs (width 0 means 256)."""
    sizes = [s for s in ICO_SIZES if s in pngs]
    head = struct.pack("<HHH", 0, 1, len(sizes))
    offset = len(head) + 16 * len(sizes)
    entries, blobs = b"", b""
    for s in sizes:
        data = pngs[s]
        dim = 0 if s >= 256 else s
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(data), offset)
        blobs += data
        offset += len(data)
    return head + entries + blobs


def icns(pngs: dict[int, bytes]) -> bytes:
    """A macOS .icns: 'icns' and the total length, then (type, length, PNG) per size (big-endian)."""
    body = b"".join(kind + struct.pack(">I", 8 + len(pngs[s])) + pngs[s]
                    for s, kind in ICNS_TYPES.items() if s in pngs)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    (out / "png").mkdir(parents=True, exist_ok=True)
    pngs = render_pngs()
    for size, data in pngs.items():
        (out / "png" / f"vramlab-{size}.png").write_bytes(data)
    (out / "vramlab.ico").write_bytes(ico(pngs))
    (out / "vramlab.icns").write_bytes(icns(pngs))
    print(f"icons written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
