"""The setup panel's offloading controls (issue 29 item 5): Offload activations (``--offload-activations``) and
Checkpoints in host memory (``--grad-ckpt-offload``) write their fields, the estimate follows the core's, and the
core's refusal is shown by the controls' names."""

from __future__ import annotations

from tests.gui.test_setup_panel import combo_pick
from vramlab.core.estimate import estimate
from vramlab.core.spec.options import ActivationOffload


def test_checkpoints_in_host_memory_writes_the_setup_and_the_estimate_follows(window):
    panel = window.panel
    panel.control("ckpt_offload").setChecked(True)
    window.state.flush()
    assert "“Gradient checkpointing”" in window.setup_banner.text()  # the core's refusal, by the controls' names
    panel.control("grad_ckpt").setChecked(True)
    snap = window.state.flush()
    assert snap.error == "", snap.error
    setup = window.state.candidate_setup()
    assert setup.ckpt_offload and setup.grad_ckpt
    assert snap.current.result.peak_allocated_bytes == estimate(window.state.model.spec, setup,
                                                                window.state.gpu).peak_allocated_bytes


def test_the_offload_activations_control_lists_every_style(window):
    control = window.panel.control("offload_activations")
    assert [control.itemData(i) for i in range(control.count())] == list(ActivationOffload)
    combo_pick(control, ActivationOffload.TRL)
    assert window.state.candidate_setup().offload_activations is ActivationOffload.TRL
    assert "TRL" in control.toolTip()
    combo_pick(control, ActivationOffload.NONE)  # before the recompute, whose estimate would simulate
    assert window.state.candidate_setup().offload_activations is ActivationOffload.NONE
