"""No clipped text (issue 27): every view and dock of the window, at 1280x800, 1440x900 and 1920x1080 and at a
2x device-pixel ratio, shows each label, button, check box, combo box, group title, tab and table cell whole
(or elides it on purpose with the full text in its tooltip). The rules are in tests/gui/layout_check.py.

The walk: the breakdown with the setup panel (SFT, DPO and GRPO: their settings widen the panel), the
comparison of SFT / DPO / GRPO, the phases with a simulation's tables, the report, the Advisor of a setup that
does not fit, the Live profile after a real run of a tiny model on the CPU, the training-config dock, and an
invalid setup's banner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.gui.layout_check import clipped_text
from vramlab.app.qt import QtCore, QtWidgets
from vramlab.core.result import MemLevel
from vramlab.core.spec.options import Objective
from vramlab.core.spec.training import TrainingSetup

SIZES = ((1280, 800), (1440, 900), (1920, 1080))
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "training"
ROOT = Path(__file__).resolve().parents[2]


def _settle(ms: int = 60) -> None:
    deadline = time.monotonic() + ms / 1000
    while time.monotonic() < deadline:
        QtCore.QCoreApplication.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 20)
        QtCore.QCoreApplication.sendPostedEvents(None, 0)
    QtCore.QCoreApplication.processEvents()


def _run_profile(w) -> bool:  # noqa: ANN001
    """A real CPU profile of a tiny model (a few seconds), as tests/gui/test_live.py runs it."""
    from vramlab.app.state import ModelChoice
    from vramlab.core.monitor import FakeSampler
    from vramlab.core.spec.model import ModelSpec

    tiny = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                     intermediate_size=256, vocab_size=300)
    w.state.set_model_choice(ModelChoice("tiny", tiny))
    w.state.set_setup(TrainingSetup(method="lora", seq_len=64))
    w.state.flush()
    fake = FakeSampler()
    w.live_ctl.set_sampler_factory(lambda: fake)
    w.tabs.setCurrentWidget(w.live)
    w.live.refresh_devices()
    w.live.set_device("cpu")
    done: list[object] = []
    w.live_ctl.finished.connect(done.append)
    if not w.live.start():
        return False
    deadline = time.monotonic() + 120
    while (not done or w.live_ctl.running) and time.monotonic() < deadline:
        _settle(100)
    return bool(done)


def views(w) -> Iterator[tuple[str, Callable[[], None]]]:  # noqa: ANN001
    """(name, how to get there) for each state the walk looks at, in order (each builds on the last)."""
    from tests.gui.test_phases import fake_simulate

    st = w.state

    def breakdown() -> None:
        w.tabs.setCurrentWidget(w.breakdown)

    def device_level() -> None:
        st.set_level(MemLevel.DEVICE)
        st.set_common_sizes(True)
        st.set_unit("GB")
        st.flush()

    def objective(obj: Objective) -> Callable[[], None]:
        def go() -> None:
            st.set_level(MemLevel.ALLOCATED)
            st.set_common_sizes(False)
            st.set_unit("GiB")
            st.set_field("objective", obj)
            st.flush()
            w.panel.sync()
        return go

    def comparison() -> None:
        st.set_field("objective", Objective.SFT)
        st.flush()
        w.panel.sync()
        st.compare_objectives()
        st.flush()
        w.tabs.setCurrentWidget(w.comparison)

    def phases() -> None:
        st.compare_presets()
        st.flush()
        w.sims.set_simulate_fn(fake_simulate)
        w.tabs.setCurrentWidget(w.phases)
        done: list[object] = []
        w.sims.succeeded.connect(done.append)
        w.phases.simulate()
        deadline = time.monotonic() + 30
        while (not done or w.sims.running) and time.monotonic() < deadline:
            _settle(50)

    def report() -> None:
        w.tabs.setCurrentWidget(w.report_tab)
        w.update_report_preview()

    def advisor() -> None:
        st.set_field("seq_len", 2048)
        st.set_level(MemLevel.DEVICE)
        w.tabs.setCurrentWidget(w.advisor)
        w.advisor.flush()

    def mapping() -> None:
        assert w.open_training_configs([str(FIX / "llamafactory_qlora.yaml")])
        st.flush()
        w.tabs.setCurrentWidget(w.breakdown)

    def invalid() -> None:
        w.mapping_dock.hide()
        st.set_field("offload", "optimizer")
        st.flush()

    def live() -> None:
        st.set_field("offload", "none")
        assert _run_profile(w)

    yield "breakdown (SFT)", breakdown
    yield "breakdown at the device level, GB, 16-80 GB lines", device_level
    yield "setup panel with DPO", objective(Objective.DPO)
    yield "setup panel with GRPO", objective(Objective.GRPO)
    yield "comparison of SFT / DPO / GRPO", comparison
    yield "phases with a simulation", phases
    yield "report", report
    yield "advisor", advisor
    yield "training config dock", mapping
    yield "invalid setup", invalid
    yield "live profile after a run", live


def walk(w, sizes=SIZES, only: set[str] | None = None) -> list[str]:  # noqa: ANN001
    """Every view at every size; returns the problems, each prefixed with the view and the size."""
    problems: list[str] = []
    for name, go in views(w):
        if only is not None and name not in only:
            continue
        go()
        for width, height in sizes:
            w.resize(width, height)
            _settle()
            if w.tabs.currentWidget() is w.advisor:
                w.advisor.flush()
                _settle()
            if w.width() > width or w.height() > height:  # the content forced the window past the screen
                problems.append(f"[{name} @ {width}x{height}] the window cannot be this small: its content needs "
                                f"{w.width()}x{w.height()}")
            problems += [f"[{name} @ {width}x{height}] {p}" for p in clipped_text(w)]
    return problems


@pytest.mark.slow
def test_every_view_shows_its_whole_text(window, qtbot):
    window.showNormal()
    problems = walk(window)
    assert not problems, "text not shown whole:\n" + "\n".join(problems)


@pytest.mark.slow
def test_at_a_2x_device_pixel_ratio(tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "QT_SCALE_FACTOR": "2",
           "VRAMLAB_SETTINGS_FILE": str(tmp_path / "settings.ini")}
    out = subprocess.run([sys.executable, "-m", "tests.gui.test_layout", "1440x900"], check=False, cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ratio"] == 2.0
    assert not report["problems"], "text not shown whole at 2x:\n" + "\n".join(report["problems"])


def _main(argv: list[str]) -> int:
    """The walk in this process (the 2x test runs it in a child with QT_SCALE_FACTOR=2); prints JSON."""
    sizes = [tuple(int(v) for v in a.split("x")) for a in argv] or list(SIZES)
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["vramlab-layout"])
    from vramlab.app.main_window import MainWindow

    settings = QtCore.QSettings(os.environ["VRAMLAB_SETTINGS_FILE"], QtCore.QSettings.Format.IniFormat)
    w = MainWindow(settings=settings, detect_gpus=False, theme_mode="light", replay=False)
    w.show()
    _settle(200)
    problems = walk(w, sizes)  # type: ignore[arg-type]
    ratio = w.devicePixelRatioF()
    w.close()
    app.processEvents()
    print(json.dumps({"ratio": ratio, "problems": problems}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
