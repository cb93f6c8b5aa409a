"""The Advisor tab: ranked savings equal the core's and apply through AppState (with undo), the fit search's
suggestion fits and one more sequence per step does not, sweep curves equal direct estimates, the GPU
verification button, exports, and invalid setups."""

from __future__ import annotations

import csv
import xml.etree.ElementTree as ET

import pytest

from tests.gui.conftest import close_and_delete, make_window
from vramlab.app import settings as keys
from vramlab.app.advice import PARTS, AdviceRequest, compute_advice
from vramlab.app.gpus import Detection
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.app.views.advisor import DEBOUNCE_MS
from vramlab.app.views.sweeps import SWEEP_FIELDS, sweep_x
from vramlab.core.advisor import allocator_advice, budget, checklist, fit_search, savings
from vramlab.core.catalog import find_gpu
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate
from vramlab.core.report import gui_message
from vramlab.core.result import MemLevel
from vramlab.core.spec.options import DType, Method
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import GB, GiB, fmt_bytes

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def advisor(window):
    """The Advisor tab shown, for a LoRA run of Llama-2-7B at 2048 tokens that does not fit an RTX 4090."""
    window.state.set_fields({"seq_len": 2048})
    window.tabs.setCurrentWidget(window.advisor)
    window.advisor.flush()
    return window.advisor


def current(window):
    snap = window.state.flush()
    return snap.current.model, snap.current.setup, snap.gpu


def device(spec, setup, gpu) -> int:
    return estimate(spec, setup, gpu).device_used_bytes


# ---- ranked savings ----------------------------------------------------------------------------------------------

def test_savings_rows_equal_the_core(window, advisor):
    window.state.set_field("seq_len", 4096)  # a setup that does not fit the RTX 4090
    advisor.flush()
    spec, setup, gpu = current(window)
    core = savings(spec, setup, gpu)
    shown = advisor.savings_model.savings
    assert [(s.key, s.saves_bytes, s.setup, s.fits) for s in shown] == \
           [(s.key, s.saves_bytes, s.setup, s.fits) for s in core]
    assert len(core) >= 4
    model = advisor.savings_model
    assert model.rowCount() == len(core)
    headers = [model.headerData(c, QtCore.Qt.Orientation.Horizontal) for c in range(model.columnCount())]
    assert headers == ["Change", "Saves [GiB]", "Fits (headroom)", "Trainable", "Cost"]
    assert "device level" in advisor.savings_where.text() and gpu.name in advisor.savings_where.text()
    for row, s in enumerate(core):
        assert model.data(model.index(row, 0)) == s.title
        assert model.data(model.index(row, 1)) == fmt_bytes(s.saves_bytes, "GiB", suffix=False)
        head = gpu.memory_bytes - s.after_bytes
        fits_text = model.data(model.index(row, 2))
        assert fits_text.startswith("✔" if s.fits else "✘") and fmt_bytes(abs(head)) in fits_text
        # the cost's first clause in the narrow column, the whole of it in the tooltip (and under the table)
        shown = model.data(model.index(row, 4))
        assert s.cost.startswith(shown.removesuffix(" …")) and (shown == s.cost) != shown.endswith(" …")
        assert model.data(model.index(row, 4), QtCore.Qt.ItemDataRole.ToolTipRole) == s.cost
    assert "does not fit" in advisor.verdict.text().lower()


def _settle() -> None:
    for _ in range(5):
        QtCore.QCoreApplication.processEvents()
        QtCore.QCoreApplication.sendPostedEvents(None, 0)


@pytest.mark.parametrize("size", [(1177, 736), (1280, 800), (1440, 900), (1920, 1080)])
def test_the_savings_table_reads_without_scrolling_sideways(window, advisor, size):
    """At a 1280x800 screen's first window (92 % of it: 1177x736) and up, all five columns are in view with no
    sideways scroll bar, rows show whole (all of them from 1280x800), and a row is one line (two where a change's
    title wraps at the smallest size). At 1280 px the table sat beside the fit search, clipped its fifth column
    behind a scroll bar and showed one row."""
    window.resize(*size)
    _settle()
    table = advisor.table
    model = advisor.savings_model
    assert model.rowCount() >= 4
    header = table.horizontalHeader()
    widths = [header.sectionSize(c) for c in range(model.columnCount())]
    assert sum(widths) <= table.viewport().width() and table.horizontalScrollBar().maximum() == 0, widths
    one_line = table.fontMetrics().height()
    rows_shown = sum(1 for r in range(model.rowCount())
                     if table.rowViewportPosition(r) + table.rowHeight(r) <= table.viewport().height())
    # at 736 px high the sweep chart below takes what its plots, title and key need (they overlapped before)
    assert rows_shown >= (2 if size[1] < 800 else min(5, model.rowCount())), (rows_shown, table.viewport().height())
    for r in range(model.rowCount()):
        assert table.rowHeight(r) < 3 * one_line + 8  # at most the change's title wraps, to two lines
    if size[0] >= 1440:  # room for every title on one line
        assert all(table.rowHeight(r) < 2 * one_line for r in range(model.rowCount()))


@pytest.mark.parametrize("size", [(1177, 736), (1280, 800), (1440, 900)])
def test_the_sweep_chart_lays_its_parts_one_under_another(window, advisor, size):
    """The title, the memory plot, the trainable plot and the key, each whole and in that order: a layout counts a
    wrapped label as one line, and at 1177x736 the two plots were laid over each other (the memory plot showed
    only its top, without the GPU's line)."""
    window.resize(*size)
    _settle()
    chart = advisor.chart
    parts = [chart.title, chart.mem_plot, chart.par_plot, chart.key]
    for upper, lower in zip(parts, parts[1:]):
        assert upper.geometry().bottom() < lower.geometry().top(), (upper, lower)
    assert chart.mem_plot.height() >= chart.mem_plot.minimumHeight()
    assert chart.par_plot.height() >= chart.par_plot.minimumHeight()
    for label in (chart.title, chart.key):
        assert label.height() >= label.heightForWidth(label.width())
    assert parts[-1].geometry().bottom() <= chart.chart_area.contentsRect().bottom()


def test_double_click_applies_a_saving_through_the_state_and_ctrl_z_undoes_it(window, advisor, qtbot):
    spec, before_setup, gpu = current(window)
    before = device(spec, before_setup, gpu)
    row = advisor.savings_model.row_of("grad_ckpt")
    saving = advisor.savings_model.saving_at(row)
    table = advisor.table
    rect = table.visualRect(advisor.savings_model.index(row, 0))
    # QTest's double click is only the second click's event: press once first, as a mouse does
    qtbot.mouseClick(table.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=rect.center())
    qtbot.mouseDClick(table.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=rect.center())

    after_setup = window.state.current_setup()
    assert after_setup == saving.setup and after_setup.grad_ckpt and not before_setup.grad_ckpt
    after = device(spec, after_setup, gpu)  # an independent estimate of the new setup
    assert after == before - saving.saves_bytes
    # every view follows: the breakdown's current bar and the setup panel
    assert window.breakdown.snapshot.current.setup == after_setup
    assert window.panel.control("grad_ckpt").isChecked()
    advisor.flush()
    assert "grad_ckpt" not in [s.key for s in advisor.savings_model.savings]
    assert advisor.undo_action.isEnabled()

    table.setFocus()
    qtbot.keyClick(table, QtCore.Qt.Key.Key_Z, QtCore.Qt.KeyboardModifier.ControlModifier)
    assert window.state.current_setup() == before_setup
    assert not advisor.undo_action.isEnabled()


def test_apply_button_and_enter_apply_the_selected_row(window, advisor, qtbot):
    spec, base, gpu = current(window)
    row = advisor.savings_model.row_of("qlora")
    advisor.table.selectRow(row)
    qtbot.mouseClick(advisor.apply_button, QtCore.Qt.MouseButton.LeftButton)
    s = window.state.current_setup()
    assert s.method is Method.QLORA and s.weight_dtype is DType.NF4
    assert device(spec, s, gpu) < device(spec, base, gpu)
    advisor.flush()
    advisor.table.selectRow(0)
    first = advisor.savings_model.saving_at(0)
    advisor.table.setFocus()
    qtbot.keyClick(advisor.table, QtCore.Qt.Key.Key_Return)
    assert window.state.current_setup() == first.setup
    assert advisor.undo() and advisor.undo()  # two applies, two undos
    assert window.state.current_setup() == base


def test_an_applied_row_is_recomputed_for_the_setup_as_it_is_now(window, advisor):
    """Typing after the table was drawn: Apply uses the change computed for the latest setup."""
    window.state.set_field("micro_batch", 2)  # pending: the table still shows batch 1
    row = advisor.savings_model.row_of("chunked_loss")
    assert advisor.apply_saving(row)
    s = window.state.current_setup()
    assert s.chunked_loss and s.micro_batch == 2


# ---- fit search --------------------------------------------------------------------------------------------------

def test_fit_search_suggestion_fits_and_the_next_batch_does_not(window, advisor, qtbot):
    window.state.set_field("seq_len", 512)
    advisor.fit.target.setValue(64)
    advisor.flush()
    spec, setup, gpu = current(window)
    ans = advisor.fit_answer
    assert ans == fit_search(spec, setup, gpu, margin=0.1, target_batch=64)
    b = ans.max_micro_batch
    assert b >= 1 and advisor.fit.labels["batch"].text().startswith(f"{b} ")
    assert f"{ans.grad_accum_for_target} for effective batch 64" in advisor.fit.labels["accum"].text()
    qtbot.mouseClick(advisor.fit.use_button, QtCore.Qt.MouseButton.LeftButton)
    new = window.state.current_setup()
    limit = budget(gpu, 0.1)
    m = ans.suggestion.micro_batch  # the largest micro batch that fits and divides the target
    assert m <= b and 64 % m == 0
    assert new.micro_batch == m and new.grad_accum * m >= 64 > (new.grad_accum - 1) * m
    assert estimate(spec, new, gpu).device_used_bytes <= limit
    assert estimate(spec, new.replace(micro_batch=b + 1), gpu).device_used_bytes > limit
    assert advisor.undo() and window.state.current_setup() == setup


def test_fit_search_margin_and_sequence(window, advisor, qtbot):
    spec, setup, gpu = current(window)
    advisor.fit.margin.setValue(25)
    advisor.flush()
    ans = advisor.fit_answer
    assert ans.margin == 0.25 and ans.budget_bytes == budget(gpu, 0.25)
    assert fmt_bytes(ans.budget_bytes) in advisor.fit.labels["budget"].text()
    assert "− 25%" in advisor.fit.labels["budget"].text()
    qtbot.mouseClick(advisor.fit.seq_button, QtCore.Qt.MouseButton.LeftButton)
    new = window.state.current_setup()
    assert new == setup.replace(seq_len=ans.max_seq_len)
    assert device(spec, new, gpu) <= ans.budget_bytes < device(spec, new.replace(seq_len=new.seq_len + 64), gpu)


def test_nothing_fits_says_so(window, advisor):
    window.state.set_model("llama-2-70b")
    window.state.set_fields({"method": "full"})
    advisor.flush()
    assert advisor.fit_answer.max_micro_batch == 0
    assert "none fits" in advisor.fit.labels["batch"].text()
    assert not advisor.fit.use_button.isEnabled()


# ---- sweeps --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "probe"), [("seq_len", (512, 4096)), ("lora_rank", (8, 64)),
                                              ("micro_batch", (1, 8)), ("trainable_layers", (1, 16))])
def test_sweep_curves_equal_direct_estimates(window, advisor, field, probe):
    advisor.set_sweep_field(field)
    advisor.flush()
    spec, setup, gpu = current(window)
    drawn = dict(advisor.sweep_curve_bytes())
    params = {p.value: y for p, (_x, y) in zip(advisor.chart.data.points, advisor.chart.param_points())}
    for value in probe:
        changes = {field: value}
        if field == "trainable_layers":
            changes["method"] = Method.FREEZE
        r = estimate(spec, setup.replace(**changes), gpu)
        assert drawn[value] == pytest.approx(r.peak_allocated_bytes / GiB, rel=1e-12)  # the window's level
        assert params[value] == pytest.approx(r.trainable_params, rel=1e-9)
    assert SWEEP_FIELDS[field][0] == advisor.chart.par_plot.getPlotItem().getAxis("bottom").labelText


def test_sweep_follows_the_level_unit_and_marks_the_current_value(window, advisor):
    spec, setup, gpu = current(window)
    window.state.set_level(MemLevel.DEVICE)
    window.state.set_unit("GB")
    window.state.flush()
    drawn = dict(advisor.sweep_curve_bytes())
    assert drawn[2048] == pytest.approx(device(spec, setup, gpu) / GB, rel=1e-12)
    assert "Device used<br>[GB]" in advisor.chart.mem_plot.getPlotItem().getAxis("left").labelText
    assert advisor.chart.current_lines[0].isVisible()
    assert advisor.chart.current_lines[0].value() == pytest.approx(11.0)  # log2(2048)
    assert advisor.chart.capacity.value() == pytest.approx(gpu.memory_bytes / GB)
    model = advisor.savings_model  # the table follows the unit too, without recomputing
    assert model.headerData(1, QtCore.Qt.Orientation.Horizontal) == "Saves [GB]"
    assert model.data(model.index(0, 1)) == fmt_bytes(model.saving_at(0).saves_bytes, "GB", suffix=False)
    assert "GB per GPU" in advisor.savings_where.text()


def test_weights_sweep_shows_quantization_against_trainable_parameters(window, advisor):
    advisor.set_sweep_field("weights")
    advisor.flush()
    spec, setup, gpu = current(window)
    points = {p.value: p for p in advisor.chart.data.points}
    assert list(points) == [DType.FP32, DType.BF16, DType.INT8, DType.NF4]
    nf4 = estimate(spec, setup.replace(weights=DType.NF4, method=Method.QLORA), gpu)
    assert points[DType.NF4].result.peak_allocated_bytes == nf4.peak_allocated_bytes
    tip = advisor.chart.hover_at(sweep_x(advisor.chart.data, DType.NF4), 5.0)
    assert f"{nf4.device_used_bytes:,} bytes" in tip and "Trainable" in tip


def test_sweep_hover_shows_every_level_in_bytes(window, advisor):
    spec, setup, gpu = current(window)
    tip = advisor.chart.hover_at(sweep_x(advisor.chart.data, 1024), 10.0)
    r = estimate(spec, setup.replace(seq_len=1024), gpu)
    for lv in MemLevel:
        assert f"{r.bytes_at(lv):,} bytes" in tip
    assert "fits" in tip and gpu.name in tip
    assert advisor.chart.hover_lines[0].isVisible()
    assert advisor.chart.hover_at(100.0, 10.0) == ""  # outside the plot: nothing


# ---- GPU verification ----------------------------------------------------------------------------------------------

def test_verify_on_gpu_needs_a_detected_gpu_and_a_profiler(window, advisor, qtbot, monkeypatch):
    button = advisor.fit.verify_button
    assert button.isHidden()  # the test window does not detect GPUs
    gpu = find_gpu("rtx-4090")
    advisor.set_detection(Detection((gpu,), "1 GPU"), None)
    assert button.isHidden()  # no profiler: MainWindow.run_profile does not exist (yet)
    advisor.set_detection(Detection((), "no GPU"), lambda s: None)
    assert button.isHidden()

    calls = []
    monkeypatch.setattr("vramlab.app.main_window.detect", lambda: Detection((gpu,), "1 GPU"))
    window.run_profile = calls.append  # what the Live profile tab provides
    window.state.set_field("seq_len", 512)
    window.detect_gpus()
    advisor.flush()
    assert not button.isHidden() and button.isEnabled()
    qtbot.mouseClick(button, QtCore.Qt.MouseButton.LeftButton)
    assert calls == [advisor.fit_answer.suggestion]


# ---- allocator advice and checklist ---------------------------------------------------------------------------------

def test_allocator_advice_and_checklist_follow_the_setup(window, advisor, qtbot):
    window.state.set_model("mistral-7b-v0.1")
    window.state.set_fields({"method": "full", "seq_len": 4096, "micro_batch": 4, "grad_ckpt": True})
    window.state.set_gpu(find_gpu("a100-80gb"))
    advisor.flush()
    snap = window.state.flush()
    tips = allocator_advice(snap.current.result)
    assert advisor.checks.advice_lines == tips
    if tips:
        text = advisor.checks.advice
        assert "expandable_segments:True" in text.plain_text()
        # identifiers may wrap only at _ = : (zero-width breaks), never mid-word, and copy back whole (issue 27)
        assert "expandable_\u200bsegments:\u200bTrue" in text.toPlainText()
        text.selectAll()
        copied = text.createMimeDataFromSelection().text()
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in copied and "\u200b" not in copied
    core = checklist(snap.current.model, snap.current.setup, snap.current.result)
    assert [(t, d) for t, d, _ in advisor.checks.items()] == core

    label = advisor.checks.labels[0]  # the item's text ticks its box, as a check box's own text would
    qtbot.mouseClick(label, QtCore.Qt.MouseButton.LeftButton)
    assert advisor.checks.items()[0][2]
    box = advisor.checks.boxes[1]
    qtbot.waitUntil(box.isVisible)  # new items are shown by the layout on the next event-loop turn
    opt = QtWidgets.QStyleOptionButton()
    box.initStyleOption(opt)
    indicator = box.style().subElementRect(QtWidgets.QStyle.SubElement.SE_CheckBoxClickRect, opt, box)
    qtbot.mouseClick(box, QtCore.Qt.MouseButton.LeftButton, pos=indicator.center())
    assert advisor.checks.items()[1][2]
    window.state.set_fields({"method": "lora", "grad_ckpt": True})  # adds "Enable input gradients ..."
    advisor.flush()
    items = advisor.checks.items()
    assert any("input gradients" in t for t, _, _ in items)
    assert items[0][2]  # the tick survives the change


# ---- updates, invalid setups, export ------------------------------------------------------------------------------

def test_a_dragged_control_redraws_the_sweep_and_fit_while_it_moves(window, advisor, qtbot):
    """Edits every 30 ms, faster than either interval: a debounce that restarts on each edit would draw
    nothing until the drag stops; the throttle draws setups the drag passes through, then the last one."""
    window.tabs.setCurrentWidget(advisor)
    window.state.set_field("seq_len", 1000)
    window.state.flush()
    qtbot.waitUntil(lambda: not advisor.pending_parts and not advisor.controller.running, timeout=20000)
    assert advisor.chart.data.setup.seq_len == 1000
    steps = list(range(1008, 1488, 8))  # 60 edits, about 1.8 s
    drawn = set()
    for seq in steps:
        window.state.set_field("seq_len", seq)
        qtbot.wait(30)
        drawn.add(advisor.chart.data.setup.seq_len)
        assert advisor.fit_answer is not None
    assert drawn & set(steps[:-1]), "nothing was redrawn while the control moved"
    window.state.flush()
    qtbot.waitUntil(lambda: not advisor.pending_parts and not advisor.controller.running, timeout=20000)
    spec, setup, gpu = current(window)
    assert setup.seq_len == steps[-1] and advisor.chart.data.setup.seq_len == steps[-1]
    assert advisor.fit_answer == fit_search(spec, setup, gpu, margin=0.1, target_batch=setup.effective_batch)


def test_advice_is_computed_on_a_worker_thread_only_while_shown(window, advisor, qtbot):
    window.tabs.setCurrentWidget(window.breakdown)
    window.state.set_field("seq_len", 1024)
    window.state.flush()
    qtbot.wait(DEBOUNCE_MS + 50)
    assert advisor.pending_parts == set(PARTS) and advisor.controller.jobs_started == 0  # hidden: no work
    window.tabs.setCurrentWidget(advisor)  # shown: the worker brings it up to date
    assert advisor.busy.isVisibleTo(advisor)
    qtbot.waitUntil(lambda: not advisor.pending_parts and not advisor.controller.running, timeout=10000)
    assert advisor.chart.data.setup.seq_len == 1024
    assert advisor.controller.jobs_started >= 1

    for seq in (700, 768):  # typing: the first job is superseded, the last one wins
        window.state.set_field("seq_len", seq)
        window.state.flush()
    qtbot.waitUntil(lambda: not advisor.pending_parts and not advisor.controller.running, timeout=10000)
    spec, setup, gpu = current(window)
    assert setup.seq_len == 768 and advisor.chart.data.setup.seq_len == 768
    assert [(s.key, s.saves_bytes) for s in advisor.savings_model.savings] == \
           [(s.key, s.saves_bytes) for s in savings(spec, setup, gpu)]
    assert advisor.fit_answer == fit_search(spec, setup, gpu, margin=0.1, target_batch=setup.effective_batch)
    assert not advisor.busy.isVisibleTo(advisor)


def test_a_window_that_opens_on_the_advisor_fills_it(qtbot, temporary_settings):
    """The window computes its first snapshot while building its views, before the advisor listens."""
    first = make_window(temporary_settings)
    index = first.tabs.indexOf(first.advisor)
    close_and_delete(first)
    settings = QtCore.QSettings(str(temporary_settings), QtCore.QSettings.Format.IniFormat)
    settings.setValue(keys.TAB, str(index))
    keys.write_json(settings, keys.FIELDS, {"seq_len": 2048})  # restored edits: views compute while built
    settings.sync()
    w = make_window(temporary_settings)
    try:
        w.show()
        qtbot.waitExposed(w)
        assert w.tabs.currentWidget() is w.advisor
        qtbot.waitUntil(lambda: not w.advisor.pending_parts and not w.advisor.controller.running, timeout=10000)
        assert w.advisor.chart.data is not None and w.advisor.fit_answer is not None
    finally:
        close_and_delete(w)


def test_compute_advice_without_threads_keeps_core_errors_per_part(window):
    spec, setup, gpu = current(window)
    result = estimate(spec, setup, gpu)
    req = AdviceRequest(spec, setup, result, None, 0.1, None, "weights")
    seen = []
    ans = compute_advice(req, on_part=seen.append)
    assert [sorted(a.done) for a in seen] == [["checks"], ["checks", "savings"], ["checks", "fit", "savings"],
                                              ["checks", "fit", "savings", "sweep"]]
    assert ans.fit is None and "choose a GPU" in ans.errors["fit"]  # no GPU: the reason, not a traceback
    assert ans.savings == tuple(savings(spec, setup, None)) and all(s.fits is None for s in ans.savings)
    assert compute_advice(req, should_abort=lambda: True) is None


def test_an_invalid_setup_shows_the_core_message(window, advisor):
    window.state.set_field("offload", "optimizer")  # CPU offload without sharding
    advisor.flush()
    with pytest.raises(SetupError) as err:
        TrainingSetup(**window.state.fields).validate(window.state.model.spec)
    assert advisor.banner.isVisibleTo(advisor)
    assert gui_message(str(err.value)) in advisor.banner.text()
    assert "Traceback" not in advisor.banner.text()
    assert not advisor.apply_button.isEnabled() and not advisor.fit.use_button.isEnabled()
    assert not advisor.apply_saving(0)
    window.state.set_field("offload", "none")
    advisor.flush()
    assert not advisor.banner.isVisibleTo(advisor) and advisor.apply_button.isEnabled()


def test_sweep_exports_png_svg_and_csv(window, advisor, tmp_path):
    png, svg, csv_path = tmp_path / "sweep.png", tmp_path / "sweep.svg", tmp_path / "sweep.csv"
    assert advisor.export_sweep(png, "png")
    image = QtGui.QImage(str(png))
    area = advisor.chart.chart_area.size()
    assert (image.width(), image.height()) == (area.width() * 2, area.height() * 2)
    assert advisor.export_sweep(svg, "svg")
    root = ET.parse(svg).getroot()
    text = " ".join(t for el in root.iter(f"{SVG}text") for t in el.itertext())
    assert "Sequence length" in text and "GeForce RTX 4090" in text
    assert "<image" not in svg.read_text()
    assert advisor.export_sweep(csv_path, "csv")
    rows = list(csv.reader(csv_path.open()))
    header, body = rows[0], rows[1:]
    spec, setup, gpu = current(window)
    assert len(body) == len(advisor.chart.data.points)
    col = header.index("Device used [bytes]")
    by_value = {int(r[0]): r for r in body}
    assert int(by_value[4096][col]) == device(spec, setup.replace(seq_len=4096), gpu)
    assert by_value[2048][header.index("Current")] == "yes"
    assert not advisor.export_sweep(tmp_path / "missing" / "x.csv", "csv")  # error: reported, not raised
