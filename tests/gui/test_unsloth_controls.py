"""The setup panel's Unsloth controls: the kernels' short list (the runs people make, a set it does not offer shown
as it came, never changed) and the fused loss's free memory, which follows the GPU chosen."""

from __future__ import annotations

import itertools
import json

import pytest

from tests.gui.conftest import close_and_delete, make_window
from tests.gui.test_setup_panel import combo_pick
from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.views.setup_controls import kernel_set_label
from vramlab.core.catalog import find_gpu
from vramlab.core.checks import SetupError
from vramlab.core.spec.liger import LIGER_DEFAULT, LIGER_KERNELS, parse_liger_kernels
from vramlab.core.spec.options import Objective
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth import UNSLOTH_DEFAULT, UNSLOTH_KERNELS, parse_unsloth_kernels
from vramlab.core.spec.unsloth_loss import unsloth_gpu_free
from vramlab.core.units import GiB

# a set none of the list's items holds: Unsloth's MLP kernel and its RMSNorm, as the CLI's --unsloth-kernels takes it
OTHER = ("lora_mlp", "rms_norm")


def _items(box) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(box.itemText(i), box.itemData(i)) for i in range(box.count())]


def test_the_kernels_are_the_runs_people_make(window):
    box = window.panel.control("unsloth_kernels")
    items = _items(box)
    assert len(items) == 4, items  # every set of six kernels was 48 items, past the window's bottom
    assert [TrainingSetup(unsloth_kernels=data).unsloth_kernels for _label, data in items] == [
        (), UNSLOTH_DEFAULT, TrainingSetup(unsloth_kernels="all,cross_entropy").unsloth_kernels,
        ("lora_mlp", "lora_qkv", "lora_o")]
    assert items[1][0] == "all (default)" and "CE on the logits" in items[2][0]
    combo_pick(box, items[2][1])
    assert window.state.flush().current.setup.unsloth_kernels == (
        *(k for k in UNSLOTH_DEFAULT if k != "fused_loss"), "cross_entropy")
    liger = window.panel.control("liger_kernels")  # off, the default, + CE, the default less one of its switches
    assert liger.count() == 3 + len(LIGER_DEFAULT) and liger.itemText(1).endswith("(default)")


def test_a_set_the_list_does_not_offer_is_shown_and_kept(window):
    box = window.panel.control("unsloth_kernels")
    window.state.set_setup(TrainingSetup(method="lora", unsloth_kernels=",".join(OTHER)))
    assert box.currentData() == "lora_mlp,rms_norm"
    assert box.currentText() == "MLP + RMSNorm" and box.count() == 5
    assert "not one of the runs listed" in box.itemData(4, QtCore.Qt.ItemDataRole.ToolTipRole)
    window.panel.control("micro_batch").setValue(3)  # another edit: the panel re-reads, and writes nothing back
    assert window.state.flush().current.setup.unsloth_kernels == OTHER
    assert box.currentData() == "lora_mlp,rms_norm"
    window.state.set_field("unsloth_kernels", ("lora_qkv",))  # one more such set: it takes the extra item's place
    assert box.count() == 5 and box.currentText() == "QKV"
    window.state.set_field("unsloth_kernels", "lora_o,rms_norm")  # as the CLI writes a set
    assert box.currentText() == "O + RMSNorm"
    window.state.set_field("unsloth_kernels", "lora_mlp,lora_qkv,rms_norm,rope,fused_loss")  # its default's words
    assert box.currentText() == "all but O, Attn"
    window.state.set_field("unsloth_kernels", "all")
    assert box.currentIndex() == 1 and box.count() == 5
    window.state.set_field("unsloth_kernels", ("lora_qkv",))
    combo_pick(box, "")  # off, then back to the set: it stays in the list while it is the last one given
    assert window.state.flush().current.setup.unsloth_kernels == ()
    combo_pick(box, "lora_qkv")
    assert window.state.flush().current.setup.unsloth_kernels == ("lora_qkv",)


def test_the_set_round_trips_through_scenario_files_and_saved_settings(window, tmp_path):
    window.state.set_setup(TrainingSetup(method="lora", unsloth_kernels=",".join(OTHER)))
    window.state.pin_current("MLP and norm")
    path = tmp_path / "scenarios.json"
    assert window.save_scenarios(str(path))
    saved = next(s for s in json.loads(path.read_text())["scenarios"] if s["name"] == "MLP and norm")
    assert saved["setup"]["unsloth_kernels"] == list(OTHER)
    window.save_settings()

    other = make_window(tmp_path / "other.ini")
    try:
        assert other.load_scenarios(str(path))
        pinned = next(s for s in other.state.scenarios if s.name == "MLP and norm")
        other.state.load_into_editor(pinned.uid)
        assert other.state.candidate_setup().unsloth_kernels == OTHER
        assert other.panel.control("unsloth_kernels").currentText() == "MLP + RMSNorm"
    finally:
        close_and_delete(other)
    again = make_window(window.settings.fileName())  # the window opens as it was left
    try:
        again.state.flush()
        assert again.state.candidate_setup().unsloth_kernels == OTHER
        assert again.panel.control("unsloth_kernels").currentData() == "lora_mlp,rms_norm"
    finally:
        close_and_delete(again)


def test_the_fused_losss_free_memory_follows_the_gpu_and_can_be_given_where_the_loss_runs(window):
    """auto: the chosen GPU's, at least 4 GiB free; a value given is the setup's unsloth_gpu (the CLI's
    --unsloth-free-memory) on the chosen GPU, kept when another GPU is chosen; the control is off where no fused loss
    runs."""
    panel, state = window.panel, window.state
    free = panel.unsloth_free
    state.set_model("llama-3.2-1b")
    state.set_setup(TrainingSetup(method="lora", seq_len=1024))
    state.set_gpu(find_gpu("rtx-4090"))
    assert not free.isEnabled()  # no Unsloth kernel
    combo_pick(panel.control("unsloth_kernels"), ",".join(UNSLOTH_DEFAULT))
    assert free.isEnabled() and free.text() == "auto (≥ 4 GiB)"
    auto = state.flush().current.result
    assert any("at least 4 GiB free" in n for n in auto.notes)
    # the transformers the run models is newer than unsloth installs with: the window's notes say so, in one line
    shown = window.breakdown.notes.toPlainText()
    assert shown.count("transformers 5.25.0 is newer than unsloth 2026.10.9 supports (<= 5.17.0") == 1
    free.setValue(0.1)  # a nearly full GPU: a smaller loss tile
    snap = state.flush()
    assert snap.current.setup.unsloth_gpu == unsloth_gpu_free(find_gpu("rtx-4090"), 0.1)
    assert any("0.10 GiB free" in n for n in snap.current.result.notes)
    assert snap.current.result.peak_allocated_bytes < auto.peak_allocated_bytes
    state.set_gpu(find_gpu("a100-80gb"))  # the GPU's capability and memory follow; the free memory given stays
    assert state.flush().current.setup.unsloth_gpu == unsloth_gpu_free(find_gpu("a100-80gb"), 0.1)
    assert free.value() == 0.1 and free.maximum() == pytest.approx(find_gpu("a100-80gb").memory_bytes / GiB, abs=0.01)
    free.setValue(0)  # auto again: the estimate reads the GPU chosen
    assert state.flush().current.setup.unsloth_gpu == ()
    combo_pick(panel.objective_combo, Objective.DPO)
    state.flush()
    assert not free.isEnabled()  # TRL's DPO computes its own loss: no fused loss runs


@pytest.mark.parametrize("name, kernels, default, parse", [
    ("unsloth_kernels", UNSLOTH_KERNELS, UNSLOTH_DEFAULT, parse_unsloth_kernels),
    ("liger_kernels", LIGER_KERNELS, LIGER_DEFAULT, parse_liger_kernels)])
def test_every_set_a_setup_can_hold_reads_whole_in_its_combo(window, name, kernels, default, parse):
    """The combo shows its text in the panel's width without clipping it, for every set the setup accepts (a real X
    server clipped "LoRA MLP + RMSNorm + fused loss (this setup's)")."""
    box = window.panel.control(name)
    opt = QtWidgets.QStyleOptionComboBox()
    box.initStyleOption(opt)
    room = box.style().subControlRect(QtWidgets.QStyle.ComplexControl.CC_ComboBox, opt,
                                      QtWidgets.QStyle.SubControl.SC_ComboBoxEditField, box).width()
    scroll = box.parent()
    while scroll is not None and not isinstance(scroll, QtWidgets.QScrollArea):
        scroll = scroll.parent()
    if scroll is not None and not scroll.verticalScrollBar().isVisible():  # the panel narrows when its bar shows
        room -= box.style().pixelMetric(QtWidgets.QStyle.PixelMetric.PM_ScrollBarExtent)
    wide = []
    for n in range(len(kernels) + 1):
        for sub in itertools.combinations(kernels, n):
            try:
                parse(sub)
            except SetupError:
                continue  # one the setup refuses (Unsloth's two losses at once)
            label = kernel_set_label(sub, default)
            if box.fontMetrics().horizontalAdvance(label) > room:
                wide.append(label)
    assert room > 100 and wide == []
