"""Scenarios: the default Full / LoRA / QLoRA comparison, pinning, renaming, reordering, removing, the table,
and saving to / loading from JSON files (with clear messages for bad files)."""

from __future__ import annotations

import json

import pytest

from tests.gui.conftest import close_and_delete, make_window
from vramlab.app.qt import QtCore
from vramlab.app.views.comparison import BYTES_ROLE
from vramlab.core.estimate import estimate
from vramlab.core.result import MemLevel
from vramlab.core.units import GiB, fmt_bytes


def names(window) -> list[str]:
    return [r.name for r in window.state.flush().rows]


def test_default_view_compares_full_lora_qlora_for_the_chosen_model(window):
    snap = window.state.flush()
    assert names(window) == ["Current setup", "Full - AMP BF16", "LoRA - BF16", "QLoRA - NF4"]
    full, lora, qlora = snap.rows[1:]
    assert full.setup.precision_label() == "AMP bf16 (fp32 weights)"
    assert lora.setup.method.value == "lora" and qlora.setup.weight_dtype.value == "nf4"
    assert full.result.peak_allocated_bytes > lora.result.peak_allocated_bytes > qlora.result.peak_allocated_bytes
    assert {r.model.id for r in snap.rows} == {"llama-2-7b"}


def test_pin_rename_move_remove(window, qtbot):
    window.panel.control("seq_len").setValue(1024)
    qtbot.keyClick(window, QtCore.Qt.Key.Key_P, QtCore.Qt.KeyboardModifier.ControlModifier)  # Ctrl+P pins
    assert names(window)[-1] == "LoRA - BF16 #2"
    pinned = window.state.scenarios[-1]
    assert pinned.follows is None and pinned.setup.seq_len == 1024

    window.panel.control("seq_len").setValue(4096)  # a pinned scenario is a snapshot: it does not follow
    window.state.flush()
    assert window.state.scenario(pinned.uid).setup.seq_len == 1024

    model = window.comparison.model
    row = names(window).index("LoRA - BF16 #2")
    assert model.setData(model.index(row, 0), "My run", QtCore.Qt.ItemDataRole.EditRole)
    assert names(window)[row] == "My run"
    assert not model.flags(model.index(0, 0)) & QtCore.Qt.ItemFlag.ItemIsEditable  # the current row

    window.tabs.setCurrentWidget(window.comparison)
    window.comparison.select_uid(pinned.uid)
    window.comparison.actions["up"].trigger()
    assert names(window) == ["Current setup", "Full - AMP BF16", "LoRA - BF16", "My run", "QLoRA - NF4"]
    window.comparison.table.setFocus()
    qtbot.keyClick(window.comparison.table, QtCore.Qt.Key.Key_Up, QtCore.Qt.KeyboardModifier.ControlModifier)
    assert names(window)[2] == "My run"
    assert window.breakdown.plot.stacks[2].title == "My run"  # the chart follows the order

    qtbot.keyClick(window.comparison.table, QtCore.Qt.Key.Key_Delete)
    assert "My run" not in names(window)


def test_pinning_an_invalid_setup_is_refused(window):
    window.state.set_field("lora_targets", ())
    assert window.state.pin_current() is None
    assert len(window.state.scenarios) == 3


def test_load_into_editor(window):
    full = next(s for s in window.state.scenarios if s.name == "Full - AMP BF16")
    window.comparison.select_uid(full.uid)
    window.comparison.actions["edit"].trigger()
    assert window.panel.preset_combo.currentData() == "full-amp-bf16"
    assert window.state.flush().current.setup == full.setup


def test_table_rows_and_columns_come_from_the_core(window):
    snap = window.state.flush()
    model = window.comparison.model
    headers, _rows = model.table()
    # on screen the unit sits under the column's name (narrower columns); the exports keep one line
    shown = [model.headerData(c, QtCore.Qt.Orientation.Horizontal) for c in range(model.columnCount())]
    assert shown[headers.index("Device [GiB]")] == "Device\n[GiB]"
    assert headers[:4] == ["Scenario", "Model", "Method", "Precision"]  # the exports' order
    # on screen the answer comes first: the columns that stay in view beside the scenario's name (issue 27)
    header = window.comparison.table.horizontalHeader()
    first = [headers[header.logicalIndex(v)] for v in range(4)]
    assert first == ["Scenario", f"Fits {snap.gpu.name}", "Device [GiB]", "Headroom [GiB]"]
    assert {"Tensors [GiB]", "Reserved [GiB]", "Device [GiB]", "Headroom [GiB]", "Weights [GiB]"} <= set(headers)
    for r, row in enumerate(snap.rows):
        core = estimate(row.model, row.setup, snap.gpu)
        for level, title in zip(MemLevel, ("Tensors [GiB]", "Reserved [GiB]", "Device [GiB]")):
            index = model.index(r, headers.index(title))
            assert model.data(index, BYTES_ROLE) == core.bytes_at(level)
            assert model.data(index) == fmt_bytes(core.bytes_at(level), suffix=False)
        fits = model.data(model.index(r, headers.index(f"Fits {snap.gpu.name}")))
        assert fits == ("yes" if core.fits(snap.gpu) else "no")


def test_save_and_load_round_trip(window, tmp_path, qtbot, temporary_settings):
    window.panel.control("grad_accum").setValue(16)
    window.state.pin_current("Accumulated")
    window.state.set_model("qwen2.5-0.5b")
    window.state.pin_current("Small model")
    path = tmp_path / "scenarios.json"
    assert window.save_scenarios(str(path))
    saved = json.loads(path.read_text())
    assert saved["format"] == "vramlab-scenarios" and len(saved["scenarios"]) == 5

    window.state.flush()
    # TrainingSetup.from_dict(resolved()) fills in defaults (amp, optimizer_impl, lora_alpha), so the round
    # trip is compared on the resolved settings and on the estimates, which must be identical.
    before = [(s.name, s.model.ref, s.setup.resolved(), s.follows) for s in window.state.scenarios]
    other = make_window(tmp_path / "other.ini")
    try:
        assert names(other) == ["Current setup", "Full - AMP BF16", "LoRA - BF16", "QLoRA - NF4"]
        assert other.load_scenarios(str(path))
        other.state.set_setup(window.state.candidate_setup())  # same current setup: followers derive alike
        other.state.set_model(window.state.model.ref)
        other.state.flush()
        after = [(s.name, s.model.ref, s.setup.resolved(), s.follows) for s in other.state.scenarios]
        assert after == before
        peaks = [r.result.bytes_at(MemLevel.DEVICE) for r in window.state.flush().rows]
        assert [r.result.bytes_at(MemLevel.DEVICE) for r in other.state.flush().rows] == peaks
        assert other.state.gpu == window.state.gpu
    finally:
        close_and_delete(other)


@pytest.mark.parametrize("content, message", [
    ("{oops", "not valid JSON"),
    (json.dumps({"hello": 1}), "not a VRAM Lab scenario file"),
    (json.dumps({"format": "vramlab-scenarios", "version": 99, "scenarios": []}), "version 99"),
    (json.dumps({"format": "vramlab-scenarios", "version": 1, "scenarios": []}), "holds no scenarios"),
    (json.dumps({"format": "vramlab-scenarios", "version": 1,
                 "scenarios": [{"name": "x", "model": "gpt-17", "setup": {}}]}), "unknown model 'gpt-17'"),
    (json.dumps({"format": "vramlab-scenarios", "version": 1,
                 "scenarios": [{"name": "x", "model": "llama-2-7b", "setup": {"method": "qlora", "weights": "bf16"}}]}),
     "QLoRA quantizes the base weights"),
    (json.dumps({"format": "vramlab-scenarios", "version": 1,
                 "scenarios": [{"name": "x", "model": "llama-2-7b", "setup": {"method": "sideways"}}]}),
     "method must be one of full, lora, qlora, freeze (got 'sideways')"),
])
def test_loading_a_bad_file_shows_a_clear_message(window, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert not window.load_scenarios(str(path))
    assert window.message_banner.isVisible()
    assert message in window.message_banner.text()
    assert "bad.json" in window.message_banner.text()
    assert len(window.state.scenarios) == 3  # nothing changed


def test_compare_presets_resets_the_comparison(window):
    window.state.pin_current("Mine")
    window.act_compare.trigger()
    assert names(window) == ["Current setup", "Full - AMP BF16", "LoRA - BF16", "QLoRA - NF4"]


def test_scenario_rows_show_model_names_when_models_differ(window):
    window.state.pin_current("Llama")
    window.state.set_model("qwen2.5-0.5b")
    window.state.flush()
    ticks = [s.tick for s in window.breakdown.plot.stacks]
    assert any("Llama-2-7B" in t for t in ticks) and any("Qwen2.5-0.5B" in t for t in ticks)
    heights = window.breakdown.plot.stacks
    assert heights[-1].total_bytes == estimate(window.state.scenarios[-1].model.spec, window.state.scenarios[-1].setup,
                                               window.state.gpu).peak_allocated_bytes
    assert heights[-1].total_bytes / GiB > heights[0].total_bytes / GiB


def test_the_windows_full_lora_qlora_are_the_clis(window, capsys):
    """Issue 27: "Full" gave 62.76 GiB in the CLI and 125.51 GiB in the window for the same 7B. Both now take the
    comparison from core.compare: the window's rows and `vramlab compare` give the same setups and bytes."""
    from vramlab.core.cli import main

    window.state.set_fields({"micro_batch": 2, "seq_len": 1024, "grad_ckpt": True})
    rows = window.state.flush().rows[1:]
    assert main(["compare", "-m", "llama-2-7b", "--batch", "2", "--seq", "1024", "--grad-ckpt", "--json"]) == 0
    cli = json.loads(capsys.readouterr()[0])["rows"]
    assert [r["name"] for r in cli] == [r.name for r in rows]
    for mine, theirs in zip(rows, cli, strict=True):
        assert theirs["setup"] == mine.setup.resolved()
        assert theirs["result"]["peak_allocated_bytes"] == mine.result.peak_allocated_bytes
