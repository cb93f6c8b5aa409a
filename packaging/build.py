"""Build the packaged VRAM Lab app from the current environment, check it, and archive it.

    python packaging/build.py [--variant full|estimator|all] [--dist DIR]       (or: make package)

For each variant: render the icons, run PyInstaller on packaging/vramlab.spec (one folder, the `vramlab`
executable: GUI without arguments, CLI with), then check what was built, from the built folder:
``vramlab --self-test`` (GUI offscreen, estimate, simulate and profile child), ``vramlab estimate``,
``estimate --list-models``, and for the estimator-only variant that ``simulate`` says the build lacks torch.
A failed check fails the build (exit 1). Then the platform's packages:

* Linux: ``dist/vramlab-<version>-linux-<arch>-<variant>.tar.gz`` (the folder, with a .desktop entry,
  icons and ``install-desktop-entry.sh``) and, where ``dpkg-deb`` exists, ``dist/vramlab[-estimator]_<version>_
  <arch>.deb`` (/opt/vramlab, /usr/bin/vramlab, the menu entry and icons).
* Windows: a .zip, and the Inno Setup installer when ``ISCC.exe`` is found (windows/vramlab.iss).
* macOS: ``VRAM Lab.app`` in the folder, and a .dmg when ``hdiutil`` exists (macos/make_dmg.sh).

Variants: ``full`` bundles whatever torch is installed (a CUDA torch gives a GPU-capable build);
``estimator`` leaves torch out (estimate and GUI only). ``--summary FILE`` writes what was built and how
long it took as JSON (benchmarks/build.py reads it). Needs PyInstaller: ``pip install -e '.[package]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPEC = HERE / "vramlab.spec"
VARIANTS = ("full", "estimator")
PRESET_MODEL, PRESET_GPU = "llama-3.1-8b", "rtx-4090"
DEB_NAMES = {"full": "vramlab", "estimator": "vramlab-estimator"}
MAINTAINER = os.environ.get("VRAMLAB_DEB_MAINTAINER", "VRAM Lab maintainers <packaging@vramlab.invalid>")


class BuildError(Exception):
    """A step failed; the message says which and why."""


# ---- facts of this machine and environment -------------------------------------------------------------

def version() -> str:
    match = re.search(r'__version__ = "([^"]+)"', (ROOT / "core" / "__init__.py").read_text(encoding="utf-8"))
    if match is None:
        raise BuildError("no __version__ in core/__init__.py")
    return match.group(1)


def os_name() -> str:
    return {"win32": "windows", "darwin": "macos"}.get(sys.platform, "linux")


def arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def deb_arch() -> str:
    return {"x86_64": "amd64", "arm64": "arm64"}.get(arch(), arch())


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def folder_bytes(path: Path) -> int:
    """Apparent size of the regular files under ``path`` (links are not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def log(msg: str) -> None:
    print(f"[package] {msg}", flush=True)


# ---- steps -------------------------------------------------------------------------------------------------

def render_icons(work: Path) -> Path:
    out = work / "assets"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    run([sys.executable, str(HERE / "icons.py"), str(out)], env=env, what="rendering the icons")
    return out


def write_build_info(assets: Path, variant: str) -> dict[str, Any]:
    torch = dist_version("torch") if variant == "full" else None
    info = {
        "variant": variant, "version": version(), "torch": torch,
        "python": platform.python_version(), "pyside6": dist_version("PySide6-Essentials") or dist_version("PySide6"),
        "pyinstaller": dist_version("pyinstaller"), "built": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "platform": f"{os_name()}-{arch()}", "commit": git_commit(),
    }
    (assets / "vramlab-build.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def run(cmd: list[str], what: str, env: dict[str, str] | None = None, timeout: float = 3600,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc


def pyinstaller(variant: str, assets: Path, work: Path) -> Path:
    """Run PyInstaller; returns the built folder (``.../vramlab``)."""
    vwork = work / variant
    shutil.rmtree(vwork, ignore_errors=True)
    distpath, workpath = vwork / "dist", vwork / "pyinstaller"
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN", "--distpath", str(distpath),
           "--workpath", str(workpath), str(SPEC), "--", "--variant", variant, "--assets", str(assets)]
    proc = run(cmd, what=f"PyInstaller ({variant})", cwd=ROOT)
    (vwork / "pyinstaller.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    return distpath / "vramlab"


def executable(folder: Path) -> Path:
    if sys.platform == "win32":
        return folder / "vramlab.exe"
    if sys.platform == "darwin":
        return folder / "VRAM Lab.app" / "Contents" / "MacOS" / "vramlab"
    return folder / "vramlab"


def arrange(built: Path, variant: str, assets: Path, dist: Path) -> Path:
    """Move the built folder to ``dist/vramlab-<version>-<os>-<arch>-<variant>`` and add desktop files."""
    name = f"vramlab-{version()}-{os_name()}-{arch()}-{variant}"
    folder = dist / name
    shutil.rmtree(folder, ignore_errors=True)
    dist.mkdir(parents=True, exist_ok=True)
    if sys.platform == "darwin":  # the .app is what users get; the bare folder stays in the work dir
        folder.mkdir()
        shutil.move(str(built.parent / "VRAM Lab.app"), str(folder / "VRAM Lab.app"))
        return folder
    shutil.move(str(built), str(folder))
    if sys.platform == "win32":
        shutil.copy2(assets / "vramlab.ico", folder / "vramlab.ico")
        return folder
    apps = folder / "share" / "applications"
    apps.mkdir(parents=True)
    shutil.copy2(HERE / "linux" / "vramlab.desktop", apps / "vramlab.desktop")
    for png in sorted((assets / "png").glob("vramlab-*.png")):
        size = int(png.stem.split("-")[1])
        if size <= 512:
            target = folder / "share" / "icons" / "hicolor" / f"{size}x{size}" / "apps"
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(png, target / "vramlab.png")
    scalable = folder / "share" / "icons" / "hicolor" / "scalable" / "apps"
    scalable.mkdir(parents=True)
    shutil.copy2(ROOT / "resources" / "icons" / "vramlab.svg", scalable / "vramlab.svg")
    shutil.copy2(HERE / "linux" / "install-desktop-entry.sh", folder / "install-desktop-entry.sh")
    (folder / "install-desktop-entry.sh").chmod(0o755)
    return folder


def app_env(tmp: Path) -> dict[str, str]:
    """The environment the checks run the built app in: offscreen Qt, no user settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(QT_QPA_PLATFORM="offscreen", VRAMLAB_CONFIG_DIR=str(tmp), PYTHONDONTWRITEBYTECODE="1")
    return env


def check(folder: Path, variant: str) -> dict[str, Any]:
    """Run the built app the way users and the GUI do; raise BuildError on any failure."""
    exe = executable(folder)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vramlab-check-") as tmp:
        env = app_env(Path(tmp))

        t0 = time.perf_counter()
        proc = subprocess.run([str(exe), "--self-test", "--json", "--timeout", "240"], capture_output=True,
                              text=True, env=env, timeout=300, check=False)
        seconds = time.perf_counter() - t0
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
        report = json.loads(line) if line else None
        if proc.returncode != 0 or report is None or not report["ok"]:
            raise BuildError(f"the self-test of the {variant} build failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        for c in report["checks"]:
            log(f"  self-test {c['status']:<4} {c['name']:<10} {c['detail']}")
        statuses = {c["name"]: c["status"] for c in report["checks"]}
        results["self_test"] = {"exit_s": round(seconds, 2), "checks": statuses}

        t0 = time.perf_counter()
        proc = subprocess.run([str(exe), "estimate", "--model", PRESET_MODEL, "--gpu", PRESET_GPU, "--json"],
                              capture_output=True, text=True, env=env, timeout=120, check=False)
        seconds = time.perf_counter() - t0
        try:
            data = json.loads(proc.stdout)
            ok = proc.returncode == 0 and sum(data["components"].values()) == data["peak_allocated_bytes"]
        except (ValueError, KeyError):
            ok = False
        if not ok:
            raise BuildError(f"`vramlab estimate` failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-2000:]}")
        log(f"  estimate --model {PRESET_MODEL} --gpu {PRESET_GPU}: "
            f"{data['device_used_bytes'] / 2**30:.2f} GiB device used, {seconds:.2f} s")
        results["estimate_s"] = round(seconds, 2)

        proc = subprocess.run([str(exe), "estimate", "--list-models"], capture_output=True, text=True, env=env,
                              timeout=120, check=False)
        if proc.returncode != 0 or PRESET_MODEL not in proc.stdout:
            raise BuildError(f"`vramlab estimate --list-models` failed:\n{proc.stdout[-1000:]}{proc.stderr[-1000:]}")

        if variant == "estimator":
            proc = subprocess.run([str(exe), "simulate", "--model", "qwen2.5-0.5b"], capture_output=True, text=True,
                                  env=env, timeout=120, check=False)
            if proc.returncode != 2 or "no torch" not in proc.stderr or "Traceback" in proc.stderr:
                raise BuildError(f"`vramlab simulate` in the estimator-only build should exit 2 with one line "
                                 f"saying that torch is missing; got exit {proc.returncode}:\n{proc.stderr[-2000:]}")
            log(f"  simulate says: {proc.stderr.strip()}")

        if sys.platform.startswith("linux"):  # /usr/bin/vramlab in the .deb is a link to the folder's executable
            link = Path(tmp) / "vramlab-link"
            link.symlink_to(exe)
            proc = subprocess.run([str(link), "--version"], capture_output=True, text=True, env=env,
                                  timeout=60, check=False)
            if proc.returncode != 0 or version() not in proc.stdout:
                raise BuildError(f"the executable does not run through a symbolic link:\n{proc.stderr[-2000:]}")
    return results


def make_tarball(folder: Path) -> Path:
    out = folder.parent / f"{folder.name}.tar.gz"
    with tarfile.open(out, "w:gz", compresslevel=6) as tar:
        tar.add(folder, arcname=folder.name)
    return out


def make_zip(folder: Path) -> Path:
    out = folder.parent / f"{folder.name}.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        for path in sorted(folder.rglob("*")):
            z.write(path, Path(folder.name) / path.relative_to(folder))
    return out


def make_deb(folder: Path, variant: str, work: Path, compression: str) -> Path:
    """A .deb: the folder as /opt/vramlab, /usr/bin/vramlab, and the menu entry and icons under /usr/share."""
    root = work / variant / "deb"
    shutil.rmtree(root, ignore_errors=True)
    opt = root / "opt" / "vramlab"
    opt.parent.mkdir(parents=True)
    shutil.copytree(folder, opt, symlinks=True, copy_function=_link_or_copy)
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "vramlab").symlink_to("/opt/vramlab/vramlab")
    shutil.move(str(opt / "share"), str(root / "usr" / "share"))  # the menu entry and icons, system-wide
    (opt / "install-desktop-entry.sh").unlink()  # (the tarball's per-user way of doing the same)
    name, other = DEB_NAMES[variant], DEB_NAMES["estimator" if variant == "full" else "full"]
    libc = platform.libc_ver()[1] or "2.28"
    what = ("Estimate, simulate and profile (torch included)" if variant == "full"
            else "Estimator-only build: no torch, so simulate and profile are not available")
    control = {
        "Package": name,
        "Version": version(),
        "Section": "science",
        "Priority": "optional",
        "Architecture": deb_arch(),
        "Maintainer": MAINTAINER,
        "Installed-Size": str(folder_bytes(root) // 1024),
        # what the bundled Qt and Python need from the system; everything else is in /opt/vramlab
        "Depends": f"libc6 (>= {libc}), libgl1, libegl1, libxcb1, libfontconfig1",
        "Recommends": "fonts-dejavu-core | fonts-liberation2",
        "Conflicts": other,
        "Replaces": other,
        "Description": "GPU memory of LLM fine-tuning runs: predict, simulate, measure\n"
                       " VRAM Lab answers how much GPU memory a fine-tuning run will take, where it\n"
                       " goes and whether it fits: a desktop app and the `vramlab` command line.\n"
                       f" {what}.",
    }
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text("".join(f"{k}: {v}\n" for k, v in control.items()), encoding="utf-8")
    for path in [root, *root.rglob("*")]:  # dpkg wants 0755 folders and no group/other write bits
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)
    out = folder.parent / f"{name}_{version()}_{deb_arch()}.deb"
    level = ["-z6"] if compression in ("gzip", "xz") else []  # dpkg-deb's default gzip -9 is twice as slow
    run(["dpkg-deb", "--root-owner-group", f"-Z{compression}", *level, "--build", str(root), str(out)],
        what="dpkg-deb")
    shutil.rmtree(root, ignore_errors=True)
    return out


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def make_installer_windows(folder: Path, variant: str, dist: Path) -> Path | None:
    iscc = shutil.which("iscc") or next((str(p) for p in (
        Path(os.environ.get("ProgramFiles(x86)", r"C:\Program Files (x86)")) / "Inno Setup 6" / "ISCC.exe",
        Path(os.environ.get("ProgramFiles", r"C:\Program Files")) / "Inno Setup 6" / "ISCC.exe") if p.is_file()), None)
    if iscc is None:
        log("  Inno Setup (ISCC.exe) not found: no installer (see packaging/windows/vramlab.iss)")
        return None
    run([iscc, f"/DAppVersion={version()}", f"/DVariant={variant}", f"/DSourceDir={folder}", f"/DOutputDir={dist}",
         str(HERE / "windows" / "vramlab.iss")], what="Inno Setup")
    return dist / f"vramlab-{version()}-windows-amd64-{variant}-setup.exe"


def make_dmg(folder: Path) -> Path | None:
    if shutil.which("hdiutil") is None:
        return None
    out = folder.parent / f"{folder.name}.dmg"
    run(["sh", str(HERE / "macos" / "make_dmg.sh"), str(folder / "VRAM Lab.app"), str(out)], what="make_dmg.sh")
    return out


def timed(fn, *args, **kwargs) -> tuple[Any, float]:  # noqa: ANN001
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def build(variant: str, dist: Path, work: Path, archives: bool, deb_compression: str) -> dict[str, Any]:
    log(f"building the {variant} app, VRAM Lab {version()}, {os_name()}-{arch()}, Python {platform.python_version()}")
    t_all = time.perf_counter()
    assets = render_icons(work)
    info = write_build_info(assets, variant)
    built, pyi_s = timed(pyinstaller, variant, assets, work)
    folder = arrange(built, variant, assets, dist)
    size = folder_bytes(folder)
    log(f"  {folder} ({mib(size)}), PyInstaller {pyi_s:.0f} s")
    checks, check_s = timed(check, folder, variant)
    build_s = time.perf_counter() - t_all - check_s
    summary: dict[str, Any] = {
        "variant": variant, "version": version(), "platform": f"{os_name()}-{arch()}", "torch": info["torch"],
        "folder": str(folder), "executable": str(executable(folder)), "folder_bytes": size,
        "pyinstaller_s": round(pyi_s, 1), "build_s": round(build_s, 1), "checks_s": round(check_s, 1),
        **checks, "packages": {},
    }
    if archives:
        makers: list[tuple[str, Any]] = []
        if sys.platform.startswith("linux"):
            makers.append(("tar.gz", lambda: make_tarball(folder)))
            if shutil.which("dpkg-deb"):
                makers.append(("deb", lambda: make_deb(folder, variant, work, deb_compression)))
            else:
                log("  dpkg-deb not found: no .deb")
        elif sys.platform == "win32":
            makers += [("zip", lambda: make_zip(folder)),
                       ("setup.exe", lambda: make_installer_windows(folder, variant, dist))]
        elif sys.platform == "darwin":
            makers.append(("dmg", lambda: make_dmg(folder)))
        for kind, maker in makers:
            path, seconds = timed(maker)
            if path is not None:
                summary["packages"][kind] = {"path": str(path), "bytes": path.stat().st_size, "s": round(seconds, 1)}
                log(f"  {path.name}: {mib(path.stat().st_size)} in {seconds:.0f} s")
    log(f"{variant} build done in {time.perf_counter() - t_all:.0f} s")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=[*VARIANTS, "all"], default="full",
                    help="full: with torch [default]; estimator: without; all: both")
    ap.add_argument("--dist", type=Path, default=ROOT / "dist", help="where the app and packages go [dist/]")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "packaging", help="PyInstaller's work folder")
    ap.add_argument("--no-archives", action="store_true", help="build and check the folder only")
    ap.add_argument("--deb-compression", choices=["gzip", "xz", "zstd", "none"], default="gzip",
                    help="dpkg-deb compression [gzip: fast, readable by every dpkg]")
    ap.add_argument("--summary", type=Path, help="write the build summary (sizes, times) as JSON here")
    args = ap.parse_args(argv)

    if importlib.util.find_spec("PyInstaller") is None:
        print("error: PyInstaller is not installed in this environment: pip install -e '.[package]'", file=sys.stderr)
        return 2
    variants = list(VARIANTS) if args.variant == "all" else [args.variant]
    if "full" in variants and importlib.util.find_spec("torch") is None:
        print("error: the full build bundles torch, which this environment lacks (or use --variant estimator)",
              file=sys.stderr)
        return 2
    summaries = []
    try:
        for variant in variants:
            summaries.append(build(variant, args.dist.resolve(), args.work.resolve(), not args.no_archives,
                                   args.deb_compression))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if args.summary:
            with contextlib.suppress(OSError):
                args.summary.parent.mkdir(parents=True, exist_ok=True)
            args.summary.write_text(json.dumps({"builds": summaries}, indent=2) + "\n", encoding="utf-8")
    for s in summaries:
        extra = ", ".join(f"{k} {mib(p['bytes'])}" for k, p in s["packages"].items())
        log(f"{s['variant']}: {s['folder']} {mib(s['folder_bytes'])}{', ' + extra if extra else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
