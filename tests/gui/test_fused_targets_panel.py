"""The LoRA target boxes show the model's own modules: Phi-3's fused qkv_proj and gate_up_proj."""

from __future__ import annotations

from vramlab.app.qt import QtCore, QtWidgets


def _pick_model(window, qtbot, model_id: str) -> None:
    combo = window.panel.model_combo
    combo.lineEdit().clear()
    qtbot.keyClicks(combo.lineEdit(), model_id)
    qtbot.keyClick(combo.lineEdit(), QtCore.Qt.Key.Key_Return)
    assert window.state.model.spec.id == model_id


def test_target_boxes_are_the_models_own_modules(window, qtbot):
    panel = window.panel
    _pick_model(window, qtbot, "phi-3-mini-4k")
    i = panel.preset_combo.findData("lora-bf16")
    panel.preset_combo.setCurrentIndex(i)
    panel.preset_combo.activated.emit(i)
    boxes = panel.target_boxes
    qtbot.waitUntil(lambda: not window.state.pending, timeout=5000)
    # the default q_proj, v_proj adapt Phi-3's qkv_proj: that is the box shown checked
    assert boxes["qkv_proj"].isChecked() and boxes["qkv_proj"].isEnabled()
    assert not boxes["q_proj"].isEnabled() and not boxes["gate_proj"].isEnabled()
    all_linear = next(b for b in panel.findChildren(QtWidgets.QPushButton) if b.text() == "All linear")
    all_linear.click()
    qtbot.waitUntil(lambda: not window.state.pending, timeout=5000)
    checked = {n for n, b in boxes.items() if b.isChecked()}
    assert checked == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    snap = window.state.flush()
    assert snap.error in (None, "")
    boxes["gate_up_proj"].setChecked(False)  # a click writes the model's own names
    qtbot.waitUntil(lambda: not window.state.pending, timeout=5000)
    assert window.state.snapshot.current.setup.lora_targets == ("o_proj", "down_proj", "qkv_proj")
    _pick_model(window, qtbot, "llama-2-7b")  # a model without fused modules cannot tick them
    assert not window.panel.target_boxes["qkv_proj"].isEnabled()
    assert not window.panel.target_boxes["gate_up_proj"].isEnabled()
