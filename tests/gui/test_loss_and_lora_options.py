"""The loss kernel, the loss logits' dtype and LoRA's variants (DoRA, rsLoRA, LoRA-FA) in the setup panel: each
control writes its field, the estimate follows, the core's refusals are shown in the window, and the fields come
back from a scenario file, the saved settings and an exported training config."""

from __future__ import annotations

import json
from enum import StrEnum

from tests.gui.conftest import close_and_delete, make_window
from tests.gui.test_setup_panel import combo_pick
from vramlab.app.qt import QtCore
from vramlab.app.views.setup_controls import loss_kernel_items
from vramlab.core.estimate import estimate
from vramlab.core.sources.training import read_training_configs
from vramlab.core.spec.options import LossKernel, Method


def _peak(window) -> int:  # noqa: ANN001
    snap = window.state.flush()
    assert snap.error == "", snap.error
    return snap.current.result.peak_allocated_bytes


def test_the_loss_kernel_combo_lists_every_kernel_and_names_one_it_does_not_know(window):
    kernel = window.panel.control("loss_kernel")
    assert [kernel.itemData(i) for i in range(kernel.count())] == list(LossKernel)
    assert kernel.itemText(kernel.findData(LossKernel.CCE)) == "Cut Cross Entropy"
    assert kernel.isEnabled() and window.panel.control("loss_fp32").isEnabled()

    class Later(StrEnum):  # a member added to LossKernel after this window's table was written
        HF = "hf"
        FUTURE = "future_kernel"

    (_, _, hf_tip), (label, member, tip) = loss_kernel_items(Later)
    assert label == "future_kernel" and member is Later.FUTURE and "future_kernel" in tip and hf_tip


def test_choosing_cut_cross_entropy_changes_the_peak_to_the_cores(window):
    panel = window.panel
    hf = _peak(window)
    combo_pick(panel.control("loss_kernel"), LossKernel.CCE)
    setup = window.state.candidate_setup()
    assert setup.loss_kernel is LossKernel.CCE
    cce = _peak(window)
    assert cce < hf  # no logits
    assert cce == estimate(window.state.model.spec, setup, window.state.gpu).peak_allocated_bytes
    assert "Cut Cross Entropy" in panel.control("loss_kernel").toolTip()


def test_loss_logits_in_the_compute_dtype_is_the_clis_loss_bf16(window):
    fp32 = _peak(window)
    combo_pick(window.panel.control("loss_fp32"), False)
    assert window.state.candidate_setup().loss_fp32 is False
    assert _peak(window) < fp32


def test_cut_cross_entropy_with_a_chunked_loss_shows_the_cores_reason_by_the_controls_names(window):
    panel = window.panel
    before = _peak(window)
    combo_pick(panel.control("loss_kernel"), LossKernel.CCE)
    panel.control("chunked_loss").setChecked(True)
    snap = window.state.flush()
    assert "Cut Cross Entropy replaces lm_head" in snap.error
    shown = window.setup_banner.text()
    assert window.setup_banner.isVisible() and "“Chunked loss”" in shown and "--" not in shown
    assert snap.current.result.peak_allocated_bytes == before  # the last valid chart stays
    panel.control("chunked_loss").setChecked(False)
    combo_pick(panel.control("loss_fp32"), False)
    window.state.flush()
    assert "“Loss logits: compute dtype”" in window.setup_banner.text()
    combo_pick(panel.control("loss_fp32"), True)
    assert window.state.flush().error == "" and not window.setup_banner.isVisible()


def test_cut_cross_entropy_on_fp32_weights_is_refused_with_the_cores_reason(window):
    combo_pick(window.panel.control("loss_kernel"), LossKernel.CCE)
    combo_pick(window.panel.preset_combo, "full-amp-bf16")
    snap = window.state.flush()
    assert "Cut Cross Entropy cannot train on fp32 hidden states" in snap.error
    assert "“Weight storage” bf16" in window.setup_banner.text()


def test_dora_on_a_lora_setup_adds_trainable_parameters(window):
    panel = window.panel
    before = window.state.flush().current.result
    panel.control("use_dora").setChecked(True)
    after = window.state.flush().current.result
    assert window.state.candidate_setup().use_dora
    assert after.trainable_params > before.trainable_params  # a magnitude vector per adapted layer
    assert after.peak_allocated_bytes > before.peak_allocated_bytes


def test_rslora_and_lora_fa_write_the_setup(window):
    panel = window.panel
    before = window.state.flush().current.result
    panel.control("use_rslora").setChecked(True)
    assert window.state.candidate_setup().use_rslora
    assert window.state.flush().current.result.peak_allocated_bytes == before.peak_allocated_bytes  # a scale only
    panel.control("lora_fa").setChecked(True)
    setup = window.state.candidate_setup()
    assert setup.lora_fa and setup.resolved()["optimizer_impl"] == "peft LoRA-FA"
    assert window.state.flush().current.result.trainable_params < before.trainable_params  # A frozen
    panel.control("use_dora").setChecked(True)
    window.state.flush()
    assert "“DoRA” or “LoRA-FA”" in window.setup_banner.text()


def test_lora_variants_are_disabled_without_adapters_and_leave_with_them(window):
    panel = window.panel
    panel.control("use_dora").setChecked(True)
    panel.control("use_rslora").setChecked(True)
    assert all(panel.control(n).isEnabled() for n in ("use_dora", "use_rslora", "lora_fa"))
    combo_pick(panel.control("method"), Method.FULL)
    assert not any(panel.control(n).isEnabled() for n in ("use_dora", "use_rslora", "lora_fa"))
    assert window.state.flush().error == ""  # DoRA went with the adapters, not a refusal nobody can untick
    assert not window.state.fields["use_dora"] and not panel.control("use_dora").isChecked()
    combo_pick(panel.control("method"), Method.QLORA)
    assert panel.control("use_dora").isEnabled()
    panel.control("use_dora").setChecked(True)  # the core models DoRA on a float base only: its reason is shown
    assert "DoRA is modelled on a float base" in window.state.flush().error
    assert "“DoRA”" in window.setup_banner.text()


def test_full_lora_qlora_comparison_keeps_full_fine_tuning_valid_with_dora(window):
    window.panel.control("use_dora").setChecked(True)
    rows = {r.name: r for r in window.state.flush().rows}
    full = rows["Full - AMP BF16"]
    assert full.error == "" and full.setup.method is Method.FULL and not full.setup.use_dora
    assert rows["LoRA - BF16"].setup.use_dora


def test_new_fields_round_trip_through_scenario_files_settings_and_exports(window, tmp_path):
    panel = window.panel
    combo_pick(panel.control("loss_kernel"), LossKernel.CCE)
    panel.control("use_dora").setChecked(True)
    panel.control("use_rslora").setChecked(True)
    assert window.state.flush().error == ""
    window.state.pin_current("CCE DoRA")
    path = tmp_path / "scenarios.json"
    assert window.save_scenarios(str(path))
    saved = next(s for s in json.loads(path.read_text())["scenarios"] if s["name"] == "CCE DoRA")
    assert saved["setup"]["loss_kernel"] == "cce" and saved["setup"]["use_dora"] is True
    window.save_settings()

    other = make_window(tmp_path / "other.ini")
    try:
        assert other.load_scenarios(str(path))
        pinned = next(s for s in other.state.scenarios if s.name == "CCE DoRA")
        assert pinned.setup == window.state.candidate_setup()
    finally:
        close_and_delete(other)
    again = make_window(window.settings.fileName())  # the saved settings: the window opens as it was left
    try:
        QtCore.QCoreApplication.processEvents()  # a problem with the saved settings is shown after the start
        assert "not valid" not in again.message_banner.text()  # the Full row's refused CCE is no broken file
        again.state.flush()
        assert again.panel.control("loss_kernel").currentData() == LossKernel.CCE
        assert again.panel.control("use_dora").isChecked() and again.panel.control("use_rslora").isChecked()
        assert again.state.candidate_setup() == window.state.candidate_setup()
    finally:
        close_and_delete(again)

    written = window.export_training_config("axolotl", str(tmp_path))
    changes = read_training_configs(written).changes
    assert changes["loss_kernel"] == LossKernel.CCE and changes["use_dora"] and changes["use_rslora"]
