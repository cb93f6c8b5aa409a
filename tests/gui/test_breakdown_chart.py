"""The breakdown chart draws exactly what the core computes, updates in place, and explains itself."""

from __future__ import annotations

import pytest

from tests.gui.helpers import drawn_bottoms, drawn_heights, expected
from vramlab.app.qt import QtCore, QtWidgets
from vramlab.core.catalog import common_sizes, find_gpu, find_model
from vramlab.core.estimate import estimate
from vramlab.core.result import MemLevel
from vramlab.core.units import GB, GiB, fmt_bytes


def _core(row, gpu):
    return estimate(row.model, row.setup, gpu)


def test_bar_heights_equal_the_core_components(window):
    snap = window.state.flush()
    heights = drawn_heights(window.breakdown.plot)
    assert [r.name for r in snap.rows] == ["Current setup", "Full - AMP BF16", "LoRA - BF16", "QLoRA - NF4"]
    for x, row in enumerate(snap.rows):
        core = _core(row, snap.gpu)
        assert heights[float(x)] == pytest.approx(expected(core.components, GiB), rel=1e-12)
        assert sum(core.components.values()) == core.peak_allocated_bytes
    labels = window.breakdown.plot.total_labels()
    assert labels == [fmt_bytes(_core(r, snap.gpu).peak_allocated_bytes) for r in snap.rows]


def test_segments_stack_without_gaps(window):
    heights = drawn_heights(window.breakdown.plot)
    bottoms = drawn_bottoms(window.breakdown.plot)
    for x, segs in heights.items():
        order = sorted(segs, key=lambda k: bottoms[x][k])
        top = 0.0
        for key in order:
            assert bottoms[x][key] == pytest.approx(top, abs=1e-9)
            top += segs[key]


def test_typing_updates_the_chart_in_place_after_the_debounce(window, qtbot):
    plot = window.breakdown.plot
    items_before = dict(plot.bar_items())
    seq = window.panel.control("seq_len")
    for value in (600, 1000, 2048):  # as if typed: several edits inside the debounce interval
        seq.setValue(value)
    assert window.state.pending
    qtbot.waitUntil(lambda: not window.state.pending, timeout=2000)
    snap = window.state.snapshot
    assert snap.current.setup.seq_len == 2048
    core = estimate(snap.current.model, snap.current.setup, snap.gpu)
    assert drawn_heights(plot)[0.0] == pytest.approx(expected(core.components, GiB), rel=1e-12)
    for key, item in items_before.items():  # the same graphics items, updated with setOpts
        assert plot.bar_items()[key] is item
    # the preset scenarios follow the edit
    assert all(r.setup.seq_len == 2048 for r in snap.rows)


@pytest.mark.parametrize("level", [MemLevel.RESERVED, MemLevel.DEVICE])
def test_outer_levels_add_the_overheads_as_segments(window, level):
    window.level_actions[level].trigger()
    snap = window.state.flush()
    assert snap.level is level
    heights = drawn_heights(window.breakdown.plot)
    for x, row in enumerate(snap.rows):
        core = _core(row, snap.gpu)
        overheads = {f"overhead:{o.name}": o.bytes / GiB for o in core.overheads
                     if o.bytes and (o.level is MemLevel.RESERVED or level is MemLevel.DEVICE)}
        assert overheads
        assert heights[float(x)] == pytest.approx({**expected(core.components, GiB), **overheads}, rel=1e-12)
        assert sum(heights[float(x)].values()) == pytest.approx(core.bytes_at(level) / GiB, rel=1e-12)
    axis = window.breakdown.plot.getPlotItem().getAxis("left").labelText
    assert level.label in axis and "GiB" in axis
    assert level.label in window.status_level.text()
    # a swatch, or named under the legend as too thin to see
    legend = " | ".join(e.label for e in window.breakdown.legend.entries()) + window.breakdown.thin_note.text()
    assert "CUDA context" in legend if level is MemLevel.DEVICE else "Allocator cache & fragmentation" in legend
    window.level_actions[MemLevel.ALLOCATED].trigger()
    window.state.flush()
    QtWidgets.QApplication.processEvents()  # new child widgets are shown by a queued call
    shown = [c for c in window.breakdown.legend.findChildren(QtWidgets.QWidget)
             if c.objectName().startswith("legend:") and c.isVisible()]
    assert len(shown) == len(window.breakdown.legend.entries())  # old entries never linger on screen
    assert not any("overhead" in c.objectName() for c in shown)


def test_units_switch_to_gb(window):
    window.state.set_common_sizes(True)
    window.unit_actions[window.state.unit.__class__("GB")].trigger()
    snap = window.state.flush()
    core = _core(snap.rows[0], snap.gpu)
    plot = window.breakdown.plot
    assert drawn_heights(plot)[0.0] == pytest.approx(expected(core.components, GB), rel=1e-12)
    # the capacity and reference lines move with the axis (they were left at their GiB values)
    assert plot.line_value("capacity") == pytest.approx(snap.gpu.memory_bytes / GB)
    assert plot.line_value("ref:16 GB") == pytest.approx(16 * GiB / GB)
    assert "GB per GPU" in window.breakdown.plot.getPlotItem().getAxis("left").labelText
    assert "1 GB = 10⁹ bytes" in window.status_level.text()


def test_capacity_line_and_verdict_follow_the_gpu(window):
    panel = window.panel
    small = find_gpu("rtx-3060-12gb")
    index = panel._gpu_specs.index(small)
    panel.gpu_combo.setCurrentIndex(panel.gpu_combo.findData(index))
    panel.gpu_combo.activated.emit(panel.gpu_combo.currentIndex())
    snap = window.state.flush()
    assert snap.gpu == small
    assert window.breakdown.plot.line_value("capacity") == pytest.approx(small.memory_bytes / GiB)
    core = _core(snap.rows[0], small)
    verdict = window.breakdown.verdict.text()
    fits = core.fits(small)
    assert verdict.startswith("✔ Fits" if fits else "✘ Does not fit")
    assert fmt_bytes(abs(core.headroom_bytes(small))) in verdict
    assert "nvidia-smi" in verdict  # the level the verdict is judged at is named

    window.state.set_gpu(find_gpu("h100-sxm"))
    window.state.flush()
    assert window.breakdown.verdict.property("state") == "fits"
    window.state.apply_preset("full-amp-bf16")
    window.state.flush()
    assert window.breakdown.verdict.property("state") == "nofit"
    assert "short by" in window.breakdown.verdict.text()


def test_common_gpu_sizes_on_request(window):
    plot = window.breakdown.plot
    assert [k for k in plot.line_keys() if k.startswith("ref:")] == []
    window.act_sizes.trigger()
    window.state.flush()
    values = {k: plot.line_value(k) for k in plot.line_keys() if k.startswith("ref:")}
    assert values == pytest.approx({f"ref:{label}": size / GiB for label, size in common_sizes()})


def test_hovering_a_segment_shows_its_size_and_description(window):
    snap = window.state.flush()
    core = _core(snap.rows[0], snap.gpu)
    weights = core.components[next(k for k in core.components if k.value == "weights")]
    text = window.breakdown.plot.hover_at(0.0, weights / GiB / 2)
    assert "Weights" in text and f"{weights:,} bytes" in text and fmt_bytes(weights) in text
    assert "storage dtype" in text  # Kind.WEIGHTS.description
    assert window.breakdown.plot.hover_at(0.5, 1.0) == ""  # between bars: nothing


def test_notes_and_warnings_come_from_the_core(window):
    window.state.set_model(find_model("llama-2-7b").id)
    window.state.set_field("seq_len", 8192)
    snap = window.state.flush()
    notes = window.breakdown.notes.toPlainText()
    assert any(n in notes for n in snap.current.result.notes)
    assert "positions" in notes  # the core's warning: longer than max_position_embeddings


def test_current_bar_is_outlined(window):
    outline = window.breakdown.plot._outline
    assert list(outline.opts["x"]) == [0]
    assert window.breakdown.plot.stacks[0].highlight
    assert QtCore.Qt.PenStyle.DashLine == outline.opts["pen"].style()
