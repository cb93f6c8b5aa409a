"""Llama 3.2 Vision in the window: the Images group says what the processor makes of an image (its tiles and the
cross-attention positions), and checkpointing with images is an error the window shows, not a crash."""

from __future__ import annotations

from tests.gui.test_setup_panel import combo_pick


def test_llama_32_vision_shows_tiles_and_refuses_checkpointing_with_images(window):
    panel = window.panel
    window.state.set_model("llama-3.2-11b-vision")
    window.state.flush()
    assert not panel.vision_box.isHidden()
    combo_pick(panel.control("method"), "lora")
    panel.control("images").setValue(1)
    panel.control("image_width").setValue(1120)
    panel.control("image_height").setValue(560)
    snap = window.state.flush()
    assert not snap.current.error, snap.current.error
    text = panel.vision_tokens.text()
    assert "2 tile(s)" in text and "6,404 cross-attention positions" in text and "1 vision" in text
    panel.control("grad_ckpt").setChecked(True)
    snap = window.state.flush()
    assert "checkpointing" in snap.current.error
    panel.control("images").setValue(0)  # a text-only batch: transformers checkpoints it
    snap = window.state.flush()
    assert not snap.current.error, snap.current.error
