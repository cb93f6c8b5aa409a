"""Before the window opens: can Qt's platform plugin load here? Imports no Qt.

On Linux, Qt's xcb plugin needs system libraries that a minimal desktop install may lack (``libxcb-cursor0``
is the usual one since Qt 6.5). Without them Qt prints a paragraph about plugins and aborts the process.
:func:`problem` instead loads the plugin the way Qt will (``dlopen``); when that fails it reads the plugin's
own list of needed libraries (the ELF ``DT_NEEDED`` entries of the plugin and of Qt's ``libQt6XcbQpa``),
tries each, and returns one line naming the missing libraries, their packages and the command that installs
them on Debian / Ubuntu, Fedora and Arch. It also says when there is no display to open a window on.

Any failure of the check itself lets Qt start as before: the check may only ever add a clearer message.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

# soname -> (Debian / Ubuntu, Fedora, Arch) package. What PySide6's xcb and wayland plugins link against
# (readelf -d), beyond Qt's own libraries and glibc / libstdc++.
PACKAGES: dict[str, tuple[str, str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm", "xcb-util-wm"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util", "xcb-util"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms", "xcb-util-keysyms"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil", "xcb-util-renderutil"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb", "libxcb"),
    "libxcb-xinput.so.0": ("libxcb-xinput0", "libxcb", "libxcb"),
    "libxcb-glx.so.0": ("libxcb-glx0", "libxcb", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb", "libxcb"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11", "libxkbcommon-x11"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb", "libx11"),
    "libX11.so.6": ("libx11-6", "libX11", "libx11"),
    "libGL.so.1": ("libgl1", "libglvnd-glx", "libglvnd"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl", "libglvnd"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl", "libglvnd"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype", "freetype2"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2", "glib2"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs", "dbus"),
    "libwayland-client.so.0": ("libwayland-client0", "libwayland-client", "wayland"),
    "libwayland-cursor.so.0": ("libwayland-cursor0", "libwayland-cursor", "wayland"),
    "libwayland-egl.so.1": ("libwayland-egl1", "libwayland-egl", "wayland"),
}
INSTALLERS = (("Debian/Ubuntu", "sudo apt install"), ("Fedora", "sudo dnf install"), ("Arch", "sudo pacman -S"))
_MISSING = re.compile(r"([^\s:/]+\.so[.\d]*): cannot open shared object file")

Loader = Callable[[str], object]


def _dlopen(path: str) -> object:
    return ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)


def needed(path: str | Path) -> list[str]:
    """The ``DT_NEEDED`` sonames of an ELF shared object (its dynamic section, read from the section headers)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    is64, end = data[4] == 2, "<" if data[5] == 1 else ">"
    if is64:
        shoff, = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
    else:
        shoff, = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)

    def section(i: int) -> tuple[int, int, int, int]:  # type, offset, size, link
        base = shoff + i * shentsize
        if is64:
            _, kind, _, _, off, size, link = struct.unpack_from(end + "IIQQQQI", data, base)
        else:
            _, kind, _, _, off, size, link = struct.unpack_from(end + "IIIIIII", data, base)
        return kind, off, size, link

    names: list[str] = []
    for i in range(shnum):
        kind, off, size, link = section(i)
        if kind != 6:  # SHT_DYNAMIC
            continue
        _, stroff, _, _ = section(link)
        fmt, step = (end + "qQ", 16) if is64 else (end + "iI", 8)
        for pos in range(off, off + size, step):
            tag, val = struct.unpack_from(fmt, data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                names.append(data[stroff + val:data.index(b"\0", stroff + val)].decode())
    return names


def missing_libraries(plugin: str | Path, load: Loader = _dlopen) -> list[str]:
    """The libraries that keep ``plugin`` from loading (empty when it loads). Those of Qt's own libraries next
    to the plugin are followed one level down (``libqxcb.so`` -> ``libQt6XcbQpa.so.6`` -> ``libxcb-cursor``)."""
    try:
        load(str(plugin))
        return []
    except OSError as e:
        first = _missing_name(str(e))
    qt_lib = Path(plugin).resolve().parents[2] / "lib"
    names: list[str] = []
    for soname in needed(plugin):
        if soname.startswith("libQt6") and (qt_lib / soname).is_file():
            names += [n for n in needed(qt_lib / soname) if not n.startswith("libQt6")]
        else:
            names.append(soname)
    missing: list[str] = []
    for soname in dict.fromkeys(names):
        bundled = qt_lib / soname  # Qt's own ICU and the like, found through Qt's RUNPATH, not the system's paths
        try:
            load(str(bundled) if bundled.is_file() else soname)
        except OSError as e:
            name = _missing_name(str(e)) or soname
            if name not in missing:
                missing.append(name)
    if not missing and first:
        missing.append(first)
    return missing


def _missing_name(message: str) -> str | None:
    m = _MISSING.search(message)
    return m.group(1) if m else None


def install_line(platform: str, missing: list[str]) -> str:
    """One line: what is missing, which packages hold it, the command per distribution."""
    known = [PACKAGES[n] for n in missing if n in PACKAGES]
    unknown = [n for n in missing if n not in PACKAGES]
    text = (f"error: the window cannot open: Qt's {platform} platform plugin needs {', '.join(missing)}, "
            "not installed on this system.")
    if known:
        commands = []
        for i, (distro, command) in enumerate(INSTALLERS):
            packages = " ".join(dict.fromkeys(k[i] for k in known))
            commands.append(f"{distro}: {command} {packages}")
        text += " Install " + ("it" if len(known) == 1 else "them") + " with " + "; ".join(commands) + "."
    if unknown:
        text += f" Install the package that provides {', '.join(unknown)} with your distribution's package manager."
    return text + " The command line (vramlab --help) works without them."


def candidates(env: Mapping[str, str]) -> list[str]:
    """The platform plugins Qt will try, in order (QT_QPA_PLATFORM, else the session type)."""
    chosen = env.get("QT_QPA_PLATFORM", "").strip()
    if chosen:
        return [p.split(":")[0].strip() for p in chosen.split(";") if p.strip()]
    if env.get("XDG_SESSION_TYPE") == "wayland" or env.get("WAYLAND_DISPLAY"):
        return ["wayland", "xcb"]
    return ["xcb"]


def plugin_dir(env: Mapping[str, str]) -> Path | None:
    if env.get("QT_QPA_PLATFORM_PLUGIN_PATH"):
        return Path(env["QT_QPA_PLATFORM_PLUGIN_PATH"])
    try:
        spec = importlib.util.find_spec("PySide6")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "Qt" / "plugins" / "platforms"


def problem(env: Mapping[str, str] | None = None, load: Loader = _dlopen, plugins: Path | None = None,
            system: str = sys.platform) -> str | None:
    """One line saying why the window cannot open here, or None (including when the check cannot tell)."""
    env = os.environ if env is None else env
    if not system.startswith("linux"):
        return None
    tried = [p for p in candidates(env) if p in ("xcb", "wayland")]
    if not tried or len(tried) < len(candidates(env)):
        return None  # offscreen, vnc, eglfs ... or a list with one of them: Qt's own message is the clearer one
    if not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY"):
        return ("error: no display to open the window on (neither DISPLAY nor WAYLAND_DISPLAY is set): start "
                "VRAM Lab from a desktop session, or use the command line (vramlab --help)")
    plugins = plugins or plugin_dir(env)
    if plugins is None:
        return None
    report: tuple[str, list[str]] | None = None
    for name in tried:
        path = plugins / f"libq{name}.so"
        if not path.is_file():
            continue
        missing = missing_libraries(path, load)
        if not missing:
            return None
        if report is None or name == "xcb":  # xcb is the fallback every X11 and XWayland desktop can use
            report = (name, missing)
    return install_line(*report) if report else None


def check() -> str | None:
    """:func:`problem`, never raising: a failure of the check itself lets Qt start and speak for itself."""
    try:
        return problem()
    except Exception:
        return None
