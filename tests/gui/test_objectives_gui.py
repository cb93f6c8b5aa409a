"""The objective selector beside the method, its settings shown only where they apply, and the comparison of
SFT, DPO and GRPO of one model (issue 15)."""

from __future__ import annotations

from tests.gui.test_setup_panel import combo_pick
from vramlab.core.kinds import Kind
from vramlab.core.spec.options import GenerationBackend, Objective, Reference
from vramlab.core.spec.training import TrainingSetup


def test_objective_selector_shows_only_the_settings_that_apply(window):
    panel = window.panel
    form = panel.objective_form
    assert not panel.objective_box.isVisibleTo(panel)  # SFT: no objective settings
    combo_pick(panel.objective_combo, Objective.DPO)
    assert window.state.fields["objective"] == Objective.DPO
    assert panel.objective_box.isVisibleTo(panel)
    assert form.isRowVisible(panel.objective_rows["reference"])
    assert not form.isRowVisible(panel.objective_rows["num_generations"])
    combo_pick(panel.objective_combo, Objective.GRPO)
    setup = window.state.current_setup()
    assert setup is not None and setup.objective is Objective.GRPO  # generations chosen to divide the batch
    assert form.isRowVisible(panel.objective_rows["num_generations"])
    assert not form.isRowVisible(panel.objective_rows["vllm_memory_fraction"])
    combo_pick(panel.objective_rows["generation_backend"], GenerationBackend.VLLM_COLOCATE)
    assert window.state.fields["generation_backend"] == GenerationBackend.VLLM_COLOCATE
    assert form.isRowVisible(panel.objective_rows["vllm_memory_fraction"])
    panel.objective_rows["completion_len"].setValue(128)
    assert window.state.current_setup().completion_tokens == 128
    combo_pick(panel.objective_combo, Objective.SFT)
    assert window.state.current_setup().generation_backend is GenerationBackend.TRANSFORMERS


def test_comparison_puts_sft_dpo_and_grpo_side_by_side(window):
    state = window.state
    state.set_model("smollm2-135m")
    state.set_setup(TrainingSetup(method="lora", micro_batch=4, seq_len=256))
    state.flush()
    window.comparison.actions["objectives"].trigger()
    state.flush()
    snap = window.comparison.model.snapshot
    names = [r.name for r in snap.rows[1:]]
    assert names == ["SFT", "DPO", "GRPO"]
    grpo = snap.rows[3]
    assert grpo.result is not None and grpo.setup.objective is Objective.GRPO
    assert "generate@1" in {p.key for p in grpo.result.phases}
    assert any(p.components.get(Kind.KV_CACHE) for p in grpo.result.phases)
    headers, rows = window.comparison.model.table()
    col = headers.index("Objective")
    assert rows[2][col].startswith("DPO") and rows[3][col].startswith("GRPO")


def test_orpo_hides_the_reference_and_drops_one_set_for_dpo(window):
    panel = window.panel
    form = panel.objective_form
    combo_pick(panel.objective_combo, Objective.DPO)
    combo_pick(panel.objective_rows["reference"], Reference.PRECOMPUTED)
    assert window.state.fields["reference"] == Reference.PRECOMPUTED
    combo_pick(panel.objective_combo, Objective.ORPO)
    assert window.state.fields["reference"] is None  # ORPOTrainer has no reference: the setup stays valid
    setup = window.state.current_setup()
    assert setup is not None and setup.objective is Objective.ORPO and setup.reference_mode is Reference.NONE
    assert not form.isRowVisible(panel.objective_rows["reference"])
    assert not form.isRowVisible(panel.objective_rows["reference_dtype"])
    assert form.isRowVisible(panel.objective_rows["completion_len"]) and form.isRowVisible(panel.objective_rows["beta"])


def test_choosing_grpo_makes_a_generation_batch_trl_accepts():
    """What picking an objective changes (app.views.setup_objective.objective_changes, no window needed): GRPO's
    completions per prompt must divide the generation batch, and leaving GRPO resets its generation settings."""
    from vramlab.app.views.setup_objective import objective_changes
    from vramlab.core.spec.options import GenerationBackend, Objective

    one = {"micro_batch": 1, "grad_accum": 1, "gpus": 1}
    grpo = objective_changes(Objective.GRPO, one)
    assert (grpo["micro_batch"], grpo["num_generations"]) == (2, 2)
    twelve = {"micro_batch": 3, "grad_accum": 4, "gpus": 1}
    changes = objective_changes(Objective.GRPO, twelve)
    assert "micro_batch" not in changes and 12 % changes["num_generations"] == 0 and changes["num_generations"] <= 8
    back = objective_changes(Objective.ORPO, twelve)
    assert back["reference"] is None and back["generation_backend"] is GenerationBackend.TRANSFORMERS
