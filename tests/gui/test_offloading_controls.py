"""The setup panel's offloading controls (issue 29 item 5): Offload activations (``--offload-activations``),
Checkpoints in host memory (``--grad-ckpt-offload``) and Unsloth checkpointing (``--unsloth-gc``), the last two
enabled with gradient checkpointing, write their fields and the estimate follows the core's."""

from __future__ import annotations

from tests.gui.test_setup_panel import combo_pick
from vramlab.core.estimate import estimate
from vramlab.core.spec.options import ActivationOffload


def test_checkpoints_in_host_memory_writes_the_setup_and_the_estimate_follows(window):
    panel = window.panel
    window.state.flush()
    assert not panel.control("ckpt_offload").isEnabled()  # nothing is checkpointed
    panel.control("grad_ckpt").setChecked(True)
    window.state.flush()
    assert panel.control("ckpt_offload").isEnabled()
    panel.control("ckpt_offload").setChecked(True)
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


def test_unsloth_checkpointing_writes_the_setup_and_the_estimate_follows(window):
    panel = window.panel
    window.state.flush()
    assert not panel.control("unsloth_gc").isEnabled()  # nothing is checkpointed
    panel.control("grad_ckpt").setChecked(True)
    window.state.flush()
    assert panel.control("unsloth_gc").isEnabled()
    panel.control("unsloth_gc").setChecked(True)
    snap = window.state.flush()
    assert snap.error == "", snap.error
    setup = window.state.candidate_setup()
    assert setup.unsloth_gc and setup.grad_ckpt
    assert snap.current.result.peak_allocated_bytes == estimate(window.state.model.spec, setup,
                                                                window.state.gpu).peak_allocated_bytes
    assert "unsloth_zoo" in panel.control("unsloth_gc").toolTip()
