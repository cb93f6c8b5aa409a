"""The window and where a run comes from: a Hub id looked up off the GUI thread (progress, cancel, errors),
the ids of the local cache offered, training configs opened from the menu or dropped, the mapping panel, and
exporting the setup as a training config."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hub_server import serve_hub
from vramlab.app.qt import QtCore, QtGui, QtWidgets
from vramlab.core.sources.training import read_training_configs

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "training"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    yield from serve_hub(tmp_path, monkeypatch)


def type_model(window, qtbot, text: str) -> None:
    edit = window.panel.model_combo.lineEdit()
    edit.setText(text)
    qtbot.keyClick(edit, QtCore.Qt.Key.Key_Return)


def test_typing_a_hub_id_looks_it_up_in_the_background(window, qtbot, hub):
    seen: list = []
    window.hub.progress.connect(seen.append)
    with qtbot.waitSignal(window.hub.succeeded, timeout=15000):
        type_model(window, qtbot, "acme/tiny-llama")
        assert window.hub.running  # the GUI thread returned at once; the lookup runs on its thread
        assert window.panel.lookup_row.isVisibleTo(window.panel)
    assert window.state.model.ref == "acme/tiny-llama" and window.state.model.spec.published_params
    assert any("header" in s.text and s.network for s in seen)  # a typed step: the view reads no message text
    assert not window.panel.lookup_row.isVisibleTo(window.panel)
    assert "acme/tiny-llama" in window.panel.model_info.text() and "Hub" in window.panel.model_info.text()
    assert hub.weight_bytes_sent() == 0
    # now it is in the cache and among the recent ids: offered in the model box
    assert window.panel.model_combo.findData("hub:acme/tiny-llama") >= 0


def test_a_hub_error_is_shown_and_the_model_stays(window, qtbot, hub):
    before = window.state.model.ref
    with qtbot.waitSignal(window.hub.failed, timeout=15000):
        type_model(window, qtbot, "acme/does-not-exist")
    assert window.state.model.ref == before
    assert "no such model repository" in window.message_banner.text()


def test_cancel_leaves_the_model_as_it_was(window, qtbot, hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "10")
    before = window.state.model.ref
    with qtbot.waitSignal(window.hub.cancelled, timeout=15000):
        type_model(window, qtbot, "acme/slow")  # the server answers after 3 s
        window.panel.lookup_cancel.click()
    qtbot.waitUntil(lambda: not window.hub.running, timeout=15000)
    assert window.state.model.ref == before


def test_an_adapter_repo_sets_the_model_and_the_lora_setup(window, qtbot, hub):
    with qtbot.waitSignal(window.hub.succeeded, timeout=15000):
        window.lookup_hub("acme/tiny-lora")
    assert window.state.model.spec.name == "acme/tiny-llama"
    assert window.state.fields["method"] == "lora" and window.state.fields["lora_rank"] == 16
    assert window.mapping.table.rowCount() > 0


def test_open_training_config_applies_it_and_shows_the_mapping(window, tmp_path):
    assert window.open_training_configs([str(FIX / "llamafactory_qlora.yaml")])
    f = window.state.fields
    assert f["method"] == "qlora" and f["lora_rank"] == 16 and f["seq_len"] == 512 and f["attention"] == "eager"
    assert window.mapping_dock.isVisible()
    keys = [window.mapping.table.text(r, 0) for r in range(window.mapping.table.rowCount())]
    assert "quantization_bit" in keys and "cutoff_len" in keys
    hows = [window.mapping.table.text(r, 3) for r in range(window.mapping.table.rowCount())]
    assert any(h.startswith("framework default") for h in hows)
    assert "LLaMA-Factory" in window.mapping.header.text()
    # an edit in the window after reading the config is named beside the key it changed
    window.state.set_field("lora_rank", 64)
    row = keys.index("lora_rank")
    assert "changed in the window: lora_rank = 64" in window.mapping.table.text(row, 3)
    window.state.set_field("lora_rank", 16)
    assert "changed in the window" not in window.mapping.table.text(row, 3)
    # a config VRAM Lab cannot model changes nothing and says why
    bad = tmp_path / "bad.yaml"
    bad.write_text("base_model: x\noptimizer: adamw_anyprecision\n")
    before = dict(window.state.fields)
    assert not window.open_training_configs([str(bad)])
    assert window.state.fields == before and "adamw_anyprecision" in window.message_banner.text()


def test_zero3_chosen_after_a_llamafactory_full_config_follows_llamafactorys_rule(window, tmp_path):
    """LLaMA-Factory upcasts full fine-tuning's weights to fp32 except under DeepSpeed ZeRO-3: Sharding set to
    ZeRO-3 in the window after its config kept the fp32 weights (a run LLaMA-Factory never makes); set back, the
    upcast returns; a precision the user picks stands."""
    cfg = tmp_path / "lf.yaml"
    cfg.write_text("model_name_or_path: llama-3.2-1b\nfinetuning_type: full\nbf16: true\ncutoff_len: 512\n")
    assert window.open_training_configs([str(cfg)])
    assert window.state.fields["weights"] == "fp32"
    window.state.set_fields({"sharding": "zero3", "gpus": 4})
    assert window.state.fields["weights"] == "bf16"
    window.state.set_field("sharding", "zero2")
    assert window.state.fields["weights"] == "fp32"
    window.state.set_fields({"sharding": "zero3", "weights": "fp16", "compute": "fp16"})  # the user's own choice
    assert window.state.fields["weights"] == "fp16"


def test_dropping_a_config_on_the_window_then_exporting_it(window, qtbot, tmp_path):
    urls = [QtCore.QUrl.fromLocalFile(str(FIX / "axolotl_lora.yaml"))]
    mime = QtCore.QMimeData()
    mime.setUrls(urls)
    pos = QtCore.QPointF(window.width() / 2, window.height() / 2)
    enter = QtGui.QDragEnterEvent(pos.toPoint(), QtCore.Qt.DropAction.CopyAction, mime,
                                  QtCore.Qt.MouseButton.LeftButton, QtCore.Qt.KeyboardModifier.NoModifier)
    QtWidgets.QApplication.sendEvent(window, enter)
    assert enter.isAccepted()
    drop = QtGui.QDropEvent(pos, QtCore.Qt.DropAction.CopyAction, mime, QtCore.Qt.MouseButton.LeftButton,
                            QtCore.Qt.KeyboardModifier.NoModifier)
    QtWidgets.QApplication.sendEvent(window, drop)
    assert window.state.fields["lora_rank"] == 16 and window.state.fields["micro_batch"] == 4
    # File -> Export training config writes what reads back as the same settings
    written = window.export_training_config("axolotl", str(tmp_path))
    assert [p.name for p in written] == ["axolotl.yaml"]
    source = read_training_configs(written)
    assert source.changes["lora_rank"] == 16 and source.changes["seq_len"] == 1024
    assert source.model == "meta-llama/Llama-2-7b-hf"  # the preset's Hub id
