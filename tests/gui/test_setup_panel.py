"""Driving the setup panel: presets stay visible and editable, invalid setups are explained inline and the
last valid chart stays, model files that cannot be read are reported in the window."""

from __future__ import annotations

import json

import pytest

from tests.gui.helpers import drawn_heights, expected
from vramlab.app.qt import QtCore, QtWidgets
from vramlab.core.catalog import find_gpu
from vramlab.core.estimate import estimate
from vramlab.core.spec.options import DType, Method, Optimizer
from vramlab.core.spec.presets import matching_preset, precision_preset
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import GiB

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 2048, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
}


def combo_pick(combo: QtWidgets.QComboBox, data: object) -> None:
    """Choose an entry as a user would (the currentIndexChanged / activated signals fire)."""
    i = combo.findData(data)
    assert i >= 0, data
    combo.setCurrentIndex(i)
    combo.activated.emit(i)


def test_preset_fills_in_visible_settings_and_edits_show_custom(window):
    panel = window.panel
    combo_pick(panel.preset_combo, "qlora-nf4")
    setup = window.state.candidate_setup()
    assert matching_preset(setup).id == "qlora-nf4"
    assert panel.control("method").currentData() == Method.QLORA
    assert panel.control("weights").currentData() == DType.NF4
    assert panel.control("double_quant").isChecked() and panel.control("double_quant").isEnabled()
    assert panel.preset_info.text() == precision_preset("qlora-nf4").description

    panel.control("double_quant").setChecked(False)  # an edit of a preset-owned setting
    assert panel.preset_combo.currentText() == "Custom"
    assert window.state.candidate_setup().double_quant is False
    assert "Custom" in panel.preset_info.text()

    combo_pick(panel.preset_combo, "full-amp-bf16")
    assert panel.control("weights").currentData() == DType.FP32
    assert panel.control("compute").currentData() == DType.BF16
    assert "AMP bf16" in panel.facts.text()  # derived facts come from TrainingSetup.resolved()


def test_method_change_completes_the_weights_like_the_cli(window):
    panel = window.panel
    combo_pick(panel.control("method"), Method.QLORA)
    assert window.state.fields["weights"] == DType.NF4
    combo_pick(panel.control("method"), Method.FREEZE)
    assert window.state.fields["weights"] == DType.BF16
    assert window.state.fields["trainable_layers"] == 4
    assert panel.control("trainable_layers").isEnabled() and not panel.lora_box.isEnabled()
    snap = window.state.flush()
    assert snap.error == ""


def test_optimizer_implementation_is_disabled_for_8bit(window):
    panel = window.panel
    impl = panel.control("optimizer_impl")
    combo_pick(impl, "fused")
    assert impl.isEnabled()
    combo_pick(panel.control("optimizer"), Optimizer.ADAMW_8BIT)
    assert not impl.isEnabled()
    assert window.state.flush().error == ""
    assert window.state.candidate_setup().resolved()["optimizer_impl"] == "bitsandbytes"


def test_lora_controls_write_the_setup(window, qtbot):
    panel = window.panel
    panel.control("lora_rank").setValue(64)
    panel.control("lora_dropout").setValue(0.1)
    for name in ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        panel.target_boxes[name].setChecked(True)
    qtbot.waitUntil(lambda: not window.state.pending, timeout=2000)
    setup = window.state.snapshot.current.setup
    assert setup.lora_rank == 64 and setup.lora_dropout == pytest.approx(0.1)
    assert setup.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                  "lm_head")
    core = estimate(window.state.model.spec, setup, window.state.gpu)
    assert drawn_heights(window.breakdown.plot)[0.0] == pytest.approx(expected(core.components, GiB))


def test_batch_controls_and_effective_batch(window):
    panel = window.panel
    panel.control("micro_batch").setValue(4)
    panel.control("grad_accum").setValue(8)
    panel.control("gpus").setValue(2)
    combo_pick(panel.control("sharding"), "zero2")
    panel.control("grad_ckpt").setChecked(True)
    combo_pick(panel.control("attention"), "eager")
    panel.control("chunked_loss").setChecked(True)
    snap = window.state.flush()
    s = snap.current.setup
    assert (s.micro_batch, s.grad_accum, s.gpus, s.sharding.value, s.grad_ckpt, s.attention.value,
            s.chunked_loss) == (4, 8, 2, "zero2", True, "eager", True)
    assert panel.effective.text().startswith(f"{s.effective_batch:,} sequences")
    assert s.effective_batch == 64


def test_invalid_setup_shows_the_core_message_and_keeps_the_last_chart(window, qtbot):
    before = drawn_heights(window.breakdown.plot)
    for box in window.panel.target_boxes.values():
        box.setChecked(False)
    snap = window.state.flush()
    assert "LoRA needs at least one target module" in snap.error
    assert window.setup_banner.isVisible()
    assert "LoRA needs at least one target module" in window.setup_banner.text()
    assert drawn_heights(window.breakdown.plot) == before  # the last valid chart stays
    assert "invalid" in window.panel.facts.text()

    window.panel.target_boxes["q_proj"].setChecked(True)  # still running: fixing it clears the banner
    window.state.flush()
    assert not window.setup_banner.isVisible()


def test_offload_without_sharding_is_explained(window):
    combo_pick(window.panel.control("offload"), "optimizer")
    snap = window.state.flush()
    assert "CPU offload is a ZeRO / FSDP feature" in snap.error
    shown = window.setup_banner.text()  # the core's CLI flags are shown as the names of the controls
    assert "“Sharding” zero2, zero3 or fsdp" in shown and "--" not in shown
    assert snap.current.result is not None  # the chart keeps the previous valid setup
    combo_pick(window.panel.control("sharding"), "zero2")
    assert window.state.flush().error == ""


def test_model_search_and_switch(window, qtbot):
    combo = window.panel.model_combo
    combo.lineEdit().clear()
    qtbot.keyClicks(combo.lineEdit(), "qwen2.5-7b")
    qtbot.keyClick(combo.lineEdit(), QtCore.Qt.Key.Key_Return)
    assert window.state.model.spec.id == "qwen2.5-7b"
    snap = window.state.flush()
    assert snap.current.model.id == "qwen2.5-7b"
    assert all(r.model.id == "qwen2.5-7b" for r in snap.rows)  # the preset comparison follows the model
    assert window.refresh_report().title.text().endswith("Qwen2.5-7B")


def test_unknown_model_name_is_reported_not_raised(window, qtbot):
    combo = window.panel.model_combo
    combo.lineEdit().clear()
    qtbot.keyClicks(combo.lineEdit(), "llama-9000")
    qtbot.keyClick(combo.lineEdit(), QtCore.Qt.Key.Key_Return)
    assert window.message_banner.isVisible()
    assert "unknown model 'llama-9000'" in window.message_banner.text()
    assert window.state.model.spec.id == "llama-2-7b"


def test_open_config_json(window, tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_CONFIG))
    choice = window.open_model(str(path))
    assert choice is not None and choice.imported
    snap = window.state.flush()
    assert snap.current.model.hidden_size == 2048 and snap.current.model.num_layers == 22
    assert window.panel.model_combo.itemData(0) == str(path)
    assert str(path) in window.panel.model_info.text()


@pytest.mark.parametrize("content, message", [
    ("{not json", "config.json"),
    (json.dumps({"model_type": "llama"}), "config.json"),
    (json.dumps([1, 2, 3]), "config.json"),
])
def test_broken_config_is_shown_in_the_window(window, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert window.open_model(str(path)) is None
    assert window.message_banner.isVisible()
    assert message in window.message_banner.text()
    assert window.state.model.spec.id == "llama-2-7b"


def test_missing_folder_is_shown_in_the_window(window, tmp_path):
    assert window.open_model(str(tmp_path / "nowhere")) is None
    assert window.message_banner.isVisible()


def test_open_action_goes_through_the_file_dialog(window, tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CONFIG))
    monkeypatch.setattr(QtWidgets.QFileDialog, "getOpenFileName", lambda *a, **k: (str(path), ""))
    window.act_open.trigger()
    assert window.state.model.imported and window.state.model.ref == str(path)


def test_custom_gpu_size(window, monkeypatch):
    monkeypatch.setattr(QtWidgets.QInputDialog, "getText", lambda *a, **k: ("20GiB", True))
    combo = window.panel.gpu_combo
    combo_pick(combo, "custom")
    gpu = window.state.gpu
    assert gpu.memory_bytes == 20 * GiB
    assert window.panel.gpu_combo.currentText().startswith(gpu.name)
    monkeypatch.setattr(QtWidgets.QInputDialog, "getText", lambda *a, **k: ("lots", True))
    combo_pick(combo, "custom")
    assert "unknown GPU 'lots'" in window.message_banner.text()
    assert window.state.gpu == gpu


def test_detected_gpus_come_first(window, monkeypatch):
    from vramlab.app import gpus as gpus_module
    from vramlab.app.gpus import Detection

    fake = find_gpu("rtx-4090")
    import dataclasses

    det = dataclasses.replace(fake, id="detected-0", name="NVIDIA GeForce RTX 4090 (cuda:0)")
    monkeypatch.setattr(gpus_module, "detect", lambda: Detection((det,), "cuda:0 ..."))
    monkeypatch.setattr("vramlab.app.main_window.detect", lambda: Detection((det,), "cuda:0 ..."))
    window.detect_gpus()
    assert window.panel.gpu_combo.itemText(0).startswith("NVIDIA GeForce RTX 4090 (cuda:0)")
    assert window.state.gpu == det  # no GPU was saved: the detected one is chosen


def test_no_driver_detection_is_quiet(window):
    detection = window.detect_gpus()  # this machine: no NVIDIA driver
    assert detection.gpus == () or all(g.id.startswith("detected-") for g in detection.gpus)
    assert window.panel.detected.text()


def test_setup_fields_round_trip_through_the_panel(window):
    setup = TrainingSetup(method="lora", lora_rank=32, lora_alpha=16.0, lora_targets="all-linear", micro_batch=2,
                          seq_len=1024, grad_accum=4, optimizer="sgd_momentum", optimizer_impl="single")
    window.state.set_setup(setup)
    panel = window.panel
    assert panel.control("lora_rank").value() == 32
    assert panel.control("lora_alpha").value() == 16.0
    assert panel.control("optimizer").currentData() == Optimizer.SGD_MOMENTUM
    assert panel.control("optimizer_impl").currentData() == "single"
    assert window.state.flush().current.setup == setup.replace(weights=setup.weight_dtype)


def test_typing_in_a_spin_box_is_not_rewritten(window, qtbot):
    seq = window.panel.control("seq_len")
    seq.setFocus()
    seq.lineEdit().selectAll()
    qtbot.keyClicks(seq.lineEdit(), "3000")
    assert seq.value() == 3000
    qtbot.waitUntil(lambda: not window.state.pending, timeout=2000)
    assert window.state.snapshot.current.setup.seq_len == 3000
    assert seq.lineEdit().text().replace(",", "").startswith("3000")


def test_the_panel_is_wide_enough_for_its_controls(window):
    """The panel scrolls vertically only: narrower than its controls' minimum, it clips them (a real X server
    showed the model row's Open... button and the last LoRA target cut off at the old 330 px)."""
    assert window.panel.viewport().width() >= window.panel.widget().minimumSizeHint().width()


def test_images_group_shows_only_for_a_vision_language_model_and_writes_the_setup(window):
    panel = window.panel
    assert panel.vision_box.isHidden()  # the default model is a text model
    window.state.set_model("qwen2.5-vl-7b")
    window.state.flush()
    assert not panel.vision_box.isHidden()
    combo_pick(panel.control("method"), "lora")
    panel.control("images").setValue(2)
    panel.control("image_width").setValue(1280)
    panel.control("image_height").setValue(720)
    combo_pick(panel.control("vision_tuning"), "lora")
    snap = window.state.flush()
    s = snap.current.setup
    assert (s.images, s.image_width, s.image_height, s.vision_tuning) == (2, 1280, 720, "lora")
    assert "2,392 vision" in panel.vision_tokens.text()  # 2 x 1,196 tokens at 1288x728
    assert snap.current.result.components.get("vision_activations", 0) > 0
    tower_ckpt = panel.control("vision_ckpt")  # it checkpoints the tower only where checkpointing is on
    panel.control("grad_ckpt").setChecked(True)
    window.state.flush()
    assert tower_ckpt.isEnabled()
    panel.control("grad_ckpt").setChecked(False)
    window.state.flush()
    assert not tower_ckpt.isEnabled()
    window.state.set_model("llama-2-7b")
    window.state.flush()
    assert panel.vision_box.isHidden()


def test_deepspeed_zero_shows_its_fp32_masters(window):
    """DeepSpeed's ZeRO optimizer keeps fp32 masters at every stage: the switch shows them, fixed, and the estimate
    counts them; FSDP leaves the switch to the user."""
    panel = window.panel
    master = panel.control("master_weights")
    combo_pick(panel.control("method"), Method.FULL)
    panel.control("gpus").setValue(4)
    combo_pick(panel.control("sharding"), "zero3")
    snap = window.state.flush()
    assert master.isChecked() and not master.isEnabled()
    assert snap.current.setup.has_master_copy
    combo_pick(panel.control("sharding"), "fsdp")
    window.state.flush()
    assert master.isEnabled() and not master.isChecked()


def test_fp32_trainable_parameters_are_a_switch_of_the_panel(window):
    """LLaMA-Factory's upcast of the trained layers (TrainingSetup.trainable_fp32), as its freeze config reads."""
    panel = window.panel
    combo_pick(panel.control("method"), Method.FREEZE)
    combo_pick(panel.control("weights"), DType.BF16)
    combo_pick(panel.control("compute"), DType.BF16)
    panel.control("trainable_fp32").setChecked(True)
    setup = window.state.candidate_setup()
    assert setup.trainable_fp32 is True and setup.autocast
    assert "fp32 trainable" in panel.facts.text()


def test_liger_kernels_are_a_control_of_the_panel(window):
    """Liger's layer kernels (TrainingSetup.liger_kernels): the sets people run, liger's default named; another set
    read from a config shows in the control, and choosing one lowers a checkpoint-free step's estimate."""
    panel = window.panel
    box = panel.control("liger_kernels")
    labels = [box.itemText(i) for i in range(box.count())]
    assert box.count() == 7 and labels[0] == "off" and labels[1] == "all (default)"
    assert "all but RoPE" in labels  # a framework switch turned off is one item
    window.state.set_model("llama-3.2-1b")
    window.state.set_fields({"method": "lora", "grad_ckpt": False})
    before = window.state.flush().current.result.peak_allocated_bytes
    combo_pick(box, "rms_norm,glu,layer_norm")
    snap = window.state.flush()
    assert snap.current.setup.liger_kernels == ("rms_norm", "glu", "layer_norm")
    assert snap.current.result.peak_allocated_bytes < before
    window.state.set_field("liger_kernels", ("rms_norm", "glu", "cross_entropy"))
    assert box.currentData() == "rms_norm,glu,cross_entropy"
