"""Gemma 3 in the window: the pan-and-scan switch shows only where the processor has crops, and it changes the
tokens the setup shows and the estimate."""

from __future__ import annotations

from tests.gui.test_setup_panel import combo_pick


def test_pan_and_scan_shows_for_gemma3_only_and_adds_the_crops(window):
    panel = window.panel
    window.state.set_model("qwen2.5-vl-7b")
    window.state.flush()
    assert not panel.pan_and_scan.isVisibleTo(panel)  # Qwen's processor has no crops
    assert panel.vision_form.isRowVisible(panel.control("max_pixels"))
    window.state.set_model("gemma-3-4b-it")
    window.state.flush()
    assert panel.pan_and_scan.isVisibleTo(panel)
    assert not panel.vision_form.isRowVisible(panel.control("max_pixels"))  # Qwen-VL's setting only
    combo_pick(panel.control("method"), "lora")
    panel.control("images").setValue(1)
    panel.control("image_width").setValue(1280)
    panel.control("image_height").setValue(720)
    before = window.state.flush().current.result.peak_allocated_bytes
    assert "256 tokens each" in panel.vision_tokens.text()
    panel.pan_and_scan.setChecked(True)
    snap = window.state.flush()
    assert snap.current.setup.pan_and_scan
    assert "768 tokens each" in panel.vision_tokens.text()  # the image and its two crops
    assert snap.current.result.peak_allocated_bytes > before


def test_a_text_model_after_a_vlm_drops_its_images_instead_of_being_invalid(window):
    """The Images group is hidden for a text model, so images kept from the last model could not be cleared."""
    window.state.set_model("gemma-3-4b-it")
    combo_pick(window.panel.control("method"), "lora")
    window.panel.control("images").setValue(2)
    window.panel.pan_and_scan.setChecked(True)
    assert window.state.flush().current.setup.images == 2
    window.state.set_model("llama-2-7b")
    snap = window.state.flush()
    assert snap.current.result is not None and not snap.current.error and not snap.error
    assert (snap.current.setup.images, snap.current.setup.pan_and_scan) == (0, False)
    assert window.panel.control("images").value() == 0
