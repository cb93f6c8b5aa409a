"""Render every view of the desktop app to PNG files, to look at them.

    .venv/bin/python tools/render_views.py OUTDIR [--no-simulate] [--no-profile] [--docs DIR]

Writes, for the default comparison of Llama-2-7B (Full AMP BF16 / LoRA BF16 / QLoRA NF4, batch 1 × 512):

    01-breakdown.png         setup panel + breakdown chart (tensor level)
    02-breakdown-device.png  device level with the overheads, common GPU sizes, GB
    03-comparison.png        the scenario table
    04-phases.png            phases with a real simulation beside the estimate (torch, a few seconds)
    05-report-tab.png        the report preview tab
    06-report.png / .svg     the exported report page (PNG at 2x, SVG)
    07-chart.svg             the exported chart
    08-about.png             the About box
    09-invalid-setup.png     an invalid setup: the message inline, the last chart kept
    10-dark.png, 11-dark-phases.png   the dark theme
    12-live-profile.png      a real profile of SmolLM2-135M (LoRA, seq 128) on this machine's GPU or CPU
    13-live-profile-dark.png the same in the dark theme
    14-advisor.png, 15-advisor-dark.png   the Advisor at 2048 tokens (does not fit an RTX 4090)
    16-sweep.svg             the exported sweep chart

Runs offscreen when there is no display (QT_QPA_PLATFORM=offscreen), or on a real X server when DISPLAY
is set. ``--docs DIR`` also writes the README screenshots (main window, comparison, report, live profile)
there, sized to stay small, and the Advisor (advisor.png); and every view in the light and the dark theme at
1280x800 (``views-<view>-<theme>.png``: breakdown, comparison of SFT / DPO / GRPO, phases with a simulation,
report, advisor, live profile, the training-config dock, a vision-language model whose Full and QLoRA bars
say why they have no estimate, an invalid setup), as 256-colour PNGs to stay small. Settings go to a
temporary file, never the user's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def _setup_env(tmp: Path) -> None:
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["VRAMLAB_SETTINGS_FILE"] = str(tmp / "settings.ini")


DOCS_SIZE = (1280, 800)
TRAINING_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "training" / "llamafactory_qlora.yaml"


def save_small(widget, path: Path) -> Path:  # noqa: ANN001 - a QWidget
    """The widget as a 256-colour PNG (a screenshot has few colours: a quarter of the size of RGB). Pillow (the
    dev extra) picks the palette from the image itself; Qt's own 8-bit conversion maps to a fixed colour cube,
    which turned the dark theme's grey tables navy. Without Pillow: RGB."""
    import io

    from vramlab.app.qt import QtCore, QtGui

    image = widget.grab().toImage().convertToFormat(QtGui.QImage.Format.Format_RGB888)
    try:
        from PIL import Image
    except ImportError:
        image.save(str(path), "PNG", 9)
        return path
    buf = QtCore.QBuffer()
    buf.open(QtCore.QIODevice.OpenModeFlag.WriteOnly)
    image.save(buf, "PNG", 0)
    rgb = Image.open(io.BytesIO(bytes(buf.data()))).convert("RGB")
    rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render every VRAM Lab view to PNG.")
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--no-simulate", action="store_true", help="skip the real simulation (no torch import)")
    ap.add_argument("--no-profile", action="store_true", help="skip the live profile (a real run, ~30 s on a CPU)")
    ap.add_argument("--docs", type=Path, help="also write the README screenshots to this folder")
    ap.add_argument("--size", default="1440x900", help="window size, WIDTHxHEIGHT [1440x900]")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vramlab-shots-"))
    _setup_env(tmp)

    from vramlab.app.qt import QtCore, QtGui, QtWidgets

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["vramlab-render"])
    assert isinstance(app, QtWidgets.QApplication)
    app.setApplicationName("VRAM Lab")
    from vramlab.app.export import save_png, save_svg
    from vramlab.app.main_window import MainWindow
    from vramlab.core.result import MemLevel

    out: Path = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    width, height = (int(v) for v in args.size.lower().split("x"))
    written: list[Path] = []

    def settle(ms: int = 150) -> None:
        deadline = time.monotonic() + ms / 1000
        while time.monotonic() < deadline:
            app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 20)
            time.sleep(0.01)

    def replayed(timeout_s: float = 30.0) -> None:
        """Wait for the allocator replay's snapshot (what a user sees a moment after an edit)."""
        deadline = time.monotonic() + timeout_s
        settle(50)
        while w.state.replaying and time.monotonic() < deadline:
            settle(50)
        settle(100)

    def grab(widget: QtWidgets.QWidget, name: str) -> Path:
        replayed()
        path = out / name
        widget.grab().save(str(path))
        written.append(path)
        return path

    w = MainWindow(theme_mode="light")
    w.resize(width, height)
    w.show()
    settle(300)
    w.state.flush()

    w.tabs.setCurrentWidget(w.breakdown)
    grab(w, "01-breakdown.png")

    w.state.set_level(MemLevel.DEVICE)
    w.state.set_common_sizes(True)
    w.state.set_unit("GB")
    w.state.flush()
    grab(w, "02-breakdown-device.png")
    w.state.set_level(MemLevel.ALLOCATED)
    w.state.set_common_sizes(False)
    w.state.set_unit("GiB")
    w.state.flush()

    w.state.pin_current("LoRA r8, seq 512 (pinned)")
    w.state.flush()
    w.tabs.setCurrentWidget(w.comparison)
    w.comparison.table.selectRow(4)
    grab(w, "03-comparison.png")

    w.tabs.setCurrentWidget(w.phases)
    if not args.no_simulate:
        done: list[object] = []
        w.sims.succeeded.connect(done.append)
        w.sims.failed.connect(done.append)
        w.phases.simulate()
        deadline = time.monotonic() + 300
        while (w.sims.running or not done) and time.monotonic() < deadline:
            settle(100)
    grab(w, "04-phases.png")

    w.tabs.setCurrentWidget(w.report_tab)
    settle(400)
    grab(w, "05-report-tab.png")
    report = w.refresh_report()
    save_png(report, out / "06-report.png", background="#FFFFFF")
    save_svg(report, out / "06-report.svg", title="VRAM Lab report", background="#FFFFFF")
    save_svg(w.breakdown.chart_area, out / "07-chart.svg", title="VRAM Lab chart", background=w.theme.chart_bg)
    written += [out / "06-report.png", out / "06-report.svg", out / "07-chart.svg"]

    about = w.show_about()
    settle(200)
    grab(about, "08-about.png")
    about.close()

    w.tabs.setCurrentWidget(w.breakdown)
    w.state.set_field("offload", "optimizer")
    w.state.flush()
    grab(w, "09-invalid-setup.png")
    w.state.set_field("offload", "none")

    w.apply_theme_mode("dark", save=False)
    w.state.flush()
    grab(w, "10-dark.png")
    w.tabs.setCurrentWidget(w.phases)
    grab(w, "11-dark-phases.png")
    w.apply_theme_mode("light", save=False)

    if args.docs:
        docs: Path = args.docs
        docs.mkdir(parents=True, exist_ok=True)
        w.tabs.setCurrentWidget(w.breakdown)
        w.resize(1280, 800)
        settle(300)
        for name, tab in (("main-window.png", w.breakdown), ("comparison.png", w.comparison)):
            w.tabs.setCurrentWidget(tab)
            replayed()
            image = w.grab().toImage().convertToFormat(QtGui.QImage.Format.Format_RGB888)
            image.save(str(docs / name), "PNG", 9)
            written.append(docs / name)
        save_png(report, docs / "report.png", scale=1.0, background="#FFFFFF")
        written.append(docs / "report.png")

    if args.docs:
        written += docs_views(w, args.docs, replayed, settle, simulate=not args.no_simulate)

    # the advisor: Llama-2-7B LoRA at 2048 tokens, which does not fit an RTX 4090 (device level)
    w.apply_theme_mode("light", save=False)
    w.resize(width, height)
    w.state.set_field("seq_len", 2048)
    w.state.set_level(MemLevel.DEVICE)
    w.tabs.setCurrentWidget(w.advisor)
    replayed()
    w.advisor.flush()
    grab(w, "14-advisor.png")
    w.apply_theme_mode("dark", save=False)
    grab(w, "15-advisor-dark.png")
    w.apply_theme_mode("light", save=False)
    if args.docs:
        w.resize(1280, 800)
        replayed()
        w.advisor.flush()
        image = w.grab().toImage().convertToFormat(QtGui.QImage.Format.Format_RGB888)
        image.save(str(args.docs / "advisor.png"), "PNG", 9)
        written.append(args.docs / "advisor.png")
    w.advisor.export_sweep(out / "16-sweep.svg", "svg")
    written.append(out / "16-sweep.svg")
    w.state.set_field("seq_len", 512)
    w.state.set_level(MemLevel.ALLOCATED)
    w.state.flush()

    if not args.no_profile:
        # a real profile on this machine (its GPU, or the CPU without one) of a small model: LoRA, seq 128
        from vramlab.core.spec.training import TrainingSetup

        w.apply_theme_mode("light", save=False)
        w.state.set_model("smollm2-135m")
        w.state.set_setup(TrainingSetup(method="lora", seq_len=128))
        w.state.flush()
        w.resize(width, height)
        done_runs: list[object] = []
        w.live_ctl.finished.connect(done_runs.append)
        w.run_profile()
        deadline = time.monotonic() + 600
        while (w.live_ctl.running or not done_runs) and time.monotonic() < deadline:
            settle(100)
        grab(w, "12-live-profile.png")
        w.apply_theme_mode("dark", save=False)
        grab(w, "13-live-profile-dark.png")
        w.apply_theme_mode("light", save=False)
        settle(200)
        if args.docs:
            w.resize(*DOCS_SIZE)
            for theme in ("light", "dark"):
                w.apply_theme_mode(theme, save=False)
                settle(300)
                written.append(save_small(w, args.docs / f"views-live-{theme}.png"))
            w.apply_theme_mode("light", save=False)
            w.resize(width, height)
            settle(300)
        if args.docs:  # at the full window size: the tab needs the room
            settle(300)
            image = w.grab().toImage().convertToFormat(QtGui.QImage.Format.Format_RGB888)
            image.save(str(args.docs / "live.png"), "PNG", 9)
            written.append(args.docs / "live.png")

    w.close()
    settle(100)
    for p in written:
        print(f"{p}  ({p.stat().st_size // 1024} KiB)")
    return 0


def docs_views(w, docs: Path, replayed, settle, simulate: bool = True) -> list[Path]:  # noqa: ANN001
    """Every view but the live profile in both themes at DOCS_SIZE (see the module's docstring)."""
    from vramlab.core.result import MemLevel
    from vramlab.core.spec.training import TrainingSetup

    st = w.state
    out: list[Path] = []
    w.resize(*DOCS_SIZE)

    def shoot(name: str) -> None:
        for theme in ("light", "dark"):
            w.apply_theme_mode(theme, save=False)
            replayed()
            if w.tabs.currentWidget() is w.advisor:
                w.advisor.flush()
            if w.tabs.currentWidget() is w.report_tab:
                w.update_report_preview()
            settle(200)
            out.append(save_small(w, docs / f"views-{name}-{theme}.png"))
        w.apply_theme_mode("light", save=False)

    st.set_model("llama-2-7b")
    st.set_setup(TrainingSetup(method="lora", seq_len=512))
    st.set_level(MemLevel.DEVICE)
    st.compare_presets()
    st.flush()
    w.tabs.setCurrentWidget(w.breakdown)
    shoot("breakdown")
    w.tabs.setCurrentWidget(w.comparison)
    shoot("comparison")
    st.compare_objectives()
    st.flush()
    shoot("comparison-objectives")
    w.tabs.setCurrentWidget(w.breakdown)
    shoot("breakdown-objectives")
    st.compare_presets()
    st.set_level(MemLevel.ALLOCATED)
    st.flush()
    w.tabs.setCurrentWidget(w.phases)
    if simulate:
        done: list[object] = []
        w.sims.succeeded.connect(done.append)
        w.sims.failed.connect(done.append)
        w.phases.simulate()
        deadline = time.monotonic() + 300
        while (w.sims.running or not done) and time.monotonic() < deadline:
            settle(100)
    shoot("phases")
    w.tabs.setCurrentWidget(w.report_tab)
    shoot("report")
    st.set_field("seq_len", 2048)
    st.set_level(MemLevel.DEVICE)
    w.tabs.setCurrentWidget(w.advisor)
    shoot("advisor")
    st.set_field("seq_len", 512)
    w.tabs.setCurrentWidget(w.breakdown)
    if w.open_training_configs([str(TRAINING_CONFIG)]):
        st.flush()
        shoot("training-config")
        w.mapping_dock.hide()
    st.set_model("qwen2.5-vl-3b")
    st.set_setup(TrainingSetup(method="lora", seq_len=512, images=1))
    st.flush()
    shoot("vlm-breakdown")
    st.set_model("llama-2-7b")
    st.set_setup(TrainingSetup(method="lora", seq_len=512))
    st.flush()  # the last valid setup, which the chart keeps under the error
    st.set_field("offload", "optimizer")
    st.flush()
    shoot("invalid-setup")
    st.set_setup(TrainingSetup(method="lora", seq_len=512))
    st.set_level(MemLevel.ALLOCATED)
    st.flush()
    return out


if __name__ == "__main__":
    sys.exit(main())
