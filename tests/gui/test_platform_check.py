"""The start-up check of Qt's platform plugin (app/platform_check.py): a missing system library gives one line
naming its package and the install command, instead of Qt's abort."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vramlab.app import platform_check as pc

PLUGINS = pc.plugin_dir({})
XCB = PLUGINS / "libqxcb.so" if PLUGINS else None
needs_xcb_plugin = pytest.mark.skipif(XCB is None or not XCB.is_file() or not sys.platform.startswith("linux"),
                                      reason="PySide6's xcb plugin (Linux) is not installed")
needs_cc = pytest.mark.skipif(shutil.which("cc") is None or not sys.platform.startswith("linux"),
                              reason="no C compiler to build a plugin with a missing library")


def _absent(*names: str):
    """A loader that behaves like dlopen on a system without ``names`` (glibc's messages)."""

    def load(path: str) -> object:
        for name in names:
            if path == name:
                raise OSError(f"{name}: cannot open shared object file: No such file or directory")
            if path.endswith("libqxcb.so"):  # the plugin: dlopen names the first library it misses
                raise OSError(f"{path}: {name}: cannot open shared object file: No such file or directory")
        return object()

    return load


@needs_xcb_plugin
def test_the_xcb_plugin_needs_libxcb_cursor_through_qts_xcb_library() -> None:
    direct = pc.needed(XCB)
    assert "libQt6XcbQpa.so.6" in direct and "libxcb.so.1" in direct
    assert "libxcb-cursor.so.0" in pc.needed(XCB.parents[2] / "lib" / "libQt6XcbQpa.so.6")


@needs_xcb_plugin
def test_a_missing_libxcb_cursor_is_named_with_the_package_and_command_of_each_distribution() -> None:
    line = pc.problem({"DISPLAY": ":0"}, load=_absent("libxcb-cursor.so.0"), plugins=PLUGINS, system="linux")
    assert line is not None and "\n" not in line
    assert "libxcb-cursor.so.0" in line
    assert "sudo apt install libxcb-cursor0" in line
    assert "sudo dnf install xcb-util-cursor" in line
    assert "sudo pacman -S xcb-util-cursor" in line


@needs_xcb_plugin
def test_every_missing_library_is_listed_once_with_its_package() -> None:
    load = _absent("libxcb-icccm.so.4", "libxkbcommon-x11.so.0")
    missing = pc.missing_libraries(XCB, load)
    assert sorted(missing) == ["libxcb-icccm.so.4", "libxkbcommon-x11.so.0"]
    line = pc.install_line("xcb", missing)
    apt = line.split("sudo apt install ")[1].split(";")[0].split()
    dnf = line.split("sudo dnf install ")[1].split(";")[0].split()
    assert sorted(apt) == ["libxcb-icccm4", "libxkbcommon-x11-0"]
    assert sorted(dnf) == ["libxkbcommon-x11", "xcb-util-wm"]


@needs_xcb_plugin
def test_libraries_qt_bundles_are_loaded_from_qts_folder_not_reported_missing() -> None:
    """In a fresh process (Qt not loaded yet, as at start-up), with the plugin failing on libxcb-cursor and every
    other library as this system has it, only libxcb-cursor is missing (not Qt's own ICU, which only Qt's RUNPATH
    finds)."""
    code = """if True:
        import json, sys
        from vramlab.app import platform_check as pc
        def load(path):
            if path.endswith("libqxcb.so"):
                raise OSError(path + ": libxcb-cursor.so.0: cannot open shared object file: No such file or directory")
            return pc._dlopen(path)
        assert "PySide6.QtCore" not in sys.modules
        print(json.dumps(pc.missing_libraries(pc.plugin_dir({}) / "libqxcb.so", load)))
    """
    env = {k: v for k, v in os.environ.items() if k != "VRAMLAB_BLOCK_QT"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(r.stdout) == ["libxcb-cursor.so.0"]


@needs_xcb_plugin
def test_nothing_is_reported_when_the_plugin_loads_or_qt_is_not_asked_for_a_window() -> None:
    loads = _absent()
    assert pc.problem({"DISPLAY": ":0"}, load=loads, plugins=PLUGINS, system="linux") is None
    broken = _absent("libxcb-cursor.so.0")
    for platform in ("offscreen", "minimal", "vnc"):
        assert pc.problem({"QT_QPA_PLATFORM": platform}, load=broken, plugins=PLUGINS, system="linux") is None
    assert pc.problem({"DISPLAY": ":0"}, load=broken, plugins=PLUGINS, system="darwin") is None


@needs_xcb_plugin
def test_a_wayland_session_starts_when_the_wayland_plugin_loads_even_without_the_xcb_libraries() -> None:
    env = {"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland"}
    assert pc.candidates(env) == ["wayland", "xcb"]
    assert pc.problem(env, load=_absent("libxcb-cursor.so.0"), plugins=PLUGINS, system="linux") is None


def test_no_display_is_one_line() -> None:
    line = pc.problem({}, plugins=Path("/nonexistent"), system="linux")
    assert line is not None and "DISPLAY" in line and "\n" not in line


@pytest.fixture(scope="module")
def broken_plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A platforms folder whose libqxcb.so needs a library that is not on this system (built, then deleted)."""
    root = tmp_path_factory.mktemp("qtplugins")
    (root / "dep.c").write_text("int vramlab_absent(void) { return 1; }\n")
    (root / "plugin.c").write_text("int vramlab_absent(void);\nint vramlab_plugin(void) { return vramlab_absent(); }\n")
    dep = root / "libvramlab-absent.so.0"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libvramlab-absent.so.0", "-o", str(dep),
                    str(root / "dep.c")], check=True)
    platforms = root / "platforms"
    platforms.mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(platforms / "libqxcb.so"), str(root / "plugin.c"),
                    str(dep)], check=True)
    dep.unlink()
    return platforms


@needs_cc
def test_a_plugin_whose_library_is_absent_is_reported_by_the_real_loader(broken_plugins: Path) -> None:
    assert pc.needed(broken_plugins / "libqxcb.so")[0] == "libvramlab-absent.so.0"
    line = pc.problem({"DISPLAY": ":0"}, plugins=broken_plugins, system="linux")
    assert line is not None
    assert "needs libvramlab-absent.so.0" in line and "the package that provides libvramlab-absent.so.0" in line


@needs_cc
def test_vramlab_prints_one_line_and_exits_instead_of_qts_abort(broken_plugins: Path, tmp_path: Path) -> None:
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb", "DISPLAY": ":99", "QT_QPA_PLATFORM_PLUGIN_PATH": str(broken_plugins),
           "VRAMLAB_SETTINGS_FILE": str(tmp_path / "settings.ini")}
    env.pop("VRAMLAB_BLOCK_QT", None)
    r = subprocess.run([sys.executable, "-c", "import sys; from vramlab.app.entry import main; sys.exit(main([]))"],
                       check=False, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the window cannot open"), r.stderr
    assert "libvramlab-absent.so.0" in lines[0]


def _hide_library_works() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    r = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    return r.returncode == 0


@needs_xcb_plugin
@pytest.mark.skipif(not _hide_library_works(), reason="needs root and unshare --mount to hide a system library")
def test_with_the_systems_libxcb_cursor_hidden_vramlab_names_its_package(tmp_path: Path) -> None:
    """The issue's case on this machine: libxcb-cursor.so.0 hidden (an empty file bound over it, in a mount
    namespace of the test's own), the real plugin, the real loader, the real entry point."""
    lib = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    found = [line.split("=>")[-1].strip() for line in lib.splitlines() if "libxcb-cursor.so.0 " in line]
    if not found:
        pytest.skip("libxcb-cursor.so.0 is not installed here")
    real = os.path.realpath(found[0])
    code = "import sys; from vramlab.app.entry import main; sys.exit(main([]))"
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb", "DISPLAY": ":99", "VRAMLAB_SETTINGS_FILE": str(tmp_path / "s.ini")}
    env.pop("VRAMLAB_BLOCK_QT", None)
    r = subprocess.run(["unshare", "--mount", "sh", "-c", f'mount --bind /dev/null "{real}" && exec "$@"', "sh",
                        sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "needs libxcb-cursor.so.0, not installed" in lines[0]
    assert "sudo apt install libxcb-cursor0;" in lines[0]
