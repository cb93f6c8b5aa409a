"""The setup panel's offloading controls (issue 29 item 5): Offload activations (``--offload-activations``),
Checkpoints in host memory (``--grad-ckpt-offload``) and Unsloth checkpointing (``--unsloth-gc``), the last two
enabled with gradient checkpointing, write their fields and the estimate follows the core's."""

from __future__ import annotations

import pytest

from tests.gui.test_setup_panel import combo_pick
from vramlab.core.estimate import estimate
from vramlab.core.spec.options import ActivationOffload


@pytest.mark.parametrize("name", ["ckpt_offload", "unsloth_gc"])
def test_a_checkpointing_variant_writes_the_setup_and_the_estimate_follows(window, name):
    """Checkpoints in host memory and Unsloth checkpointing: enabled only with gradient checkpointing."""
    panel = window.panel
    window.state.flush()
    assert not panel.control(name).isEnabled()  # nothing is checkpointed
    panel.control("grad_ckpt").setChecked(True)
    window.state.flush()
    assert panel.control(name).isEnabled()
    panel.control(name).setChecked(True)
    snap = window.state.flush()
    assert snap.error == "", snap.error
    setup = window.state.candidate_setup()
    assert getattr(setup, name) and setup.grad_ckpt
    assert snap.current.result.peak_allocated_bytes == estimate(window.state.model.spec, setup,
                                                                window.state.gpu).peak_allocated_bytes


def test_the_unsloth_checkpointing_tip_names_its_library(window):
    assert "unsloth_zoo" in window.panel.control("unsloth_gc").toolTip()


def test_the_offload_activations_control_lists_every_style(window):
    control = window.panel.control("offload_activations")
    assert [control.itemData(i) for i in range(control.count())] == list(ActivationOffload)
    combo_pick(control, ActivationOffload.TRL)
    assert window.state.candidate_setup().offload_activations is ActivationOffload.TRL
    assert "TRL" in control.toolTip()
    combo_pick(control, ActivationOffload.NONE)  # before the recompute, whose estimate would simulate
    assert window.state.candidate_setup().offload_activations is ActivationOffload.NONE
