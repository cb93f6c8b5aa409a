"""The setup panel's objective section (DPO / IPO, KTO, ORPO / SimPO / CPO, GRPO as TRL runs them): the
objective's own settings, shown only where they apply, and what choosing an objective changes in the setup.
A part of :class:`~.setup_panel.SetupPanel` (which provides the form groups, the state and the selector)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.views.setup_controls import TIPS, combo, enum_items, select_data, spin
from vramlab.core.spec.options import OBJECTIVE_BOUNDS, DType, GenerationBackend, Objective, Reference

if TYPE_CHECKING:
    from vramlab.app.state import AppState

FLOAT_REF_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


def objective_changes(obj: Objective, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The setup fields that choosing ``obj`` sets, from the current ``fields``: GRPO gets a generation batch TRL
    accepts (completions per prompt divide it); objectives without a reference drop its settings; leaving GRPO
    puts its generation settings back to their defaults."""
    changes: dict[str, Any] = {"objective": obj}
    f = fields
    if obj is Objective.GRPO:  # a generation batch TRL accepts: completions per prompt divide it
        rows = int(f["micro_batch"]) * int(f.get("steps_per_generation") or f["grad_accum"]) * int(f["gpus"])
        if rows < 2:
            changes["micro_batch"], rows = 2, 2
        changes["num_generations"] = max(d for d in range(2, min(rows, 8) + 1) if rows % d == 0) \
            if any(rows % d == 0 for d in range(2, min(rows, 8) + 1)) else 2
    if obj.no_reference:  # ORPO / SimPO / CPO: no reference model to configure
        changes.update(reference=None, reference_dtype=None)
    if obj is not Objective.GRPO:
        changes.update(num_generations=8, steps_per_generation=None, num_iterations=1,
                       generation_backend=GenerationBackend.TRANSFORMERS, vllm_memory_fraction=0.3,
                       vllm_sleep=False)
    return changes


class ObjectiveSection:
    """Builds and syncs the "Objective settings" group; mixed into the setup panel."""

    # what the setup panel provides
    state: AppState
    objective_combo: QtWidgets.QComboBox  # the selector, beside the method
    _syncing: bool
    _group: Callable[[str, str], QtWidgets.QFormLayout]

    def _build_objective(self) -> None:
        """The objective's own settings, shown only where they apply (the selector sits beside the method)."""
        form = self._group("Objective settings", "DPO / IPO and GRPO as TRL 1.16.0's trainers run them.")
        self.objective_box = form.parentWidget()
        self.objective_form = form
        self.objective_rows: dict[str, QtWidgets.QWidget] = {}

        def row(name: str, label: str, widget: QtWidgets.QWidget) -> None:
            widget.setObjectName(f"field:{name}")
            widget.setToolTip(TIPS[name])
            form.addRow(label, widget)
            self.objective_rows[name] = widget

        ref = combo([("TRL's default", None)] + enum_items(
            (Reference.COPY, Reference.ADAPTERS, Reference.PRECOMPUTED),
            {Reference.COPY: "second copy", Reference.ADAPTERS: "adapters disabled (LoRA)",
             Reference.PRECOMPUTED: "precomputed log-probs"}), TIPS["reference"])
        ref.currentIndexChanged.connect(lambda _i: self._write_objective("reference", ref.currentData()))
        row("reference", "Reference", ref)
        rdt = combo([("policy's", None)] + enum_items(FLOAT_REF_DTYPES), TIPS["reference_dtype"])
        rdt.currentIndexChanged.connect(lambda _i: self._write_objective("reference_dtype", rdt.currentData()))
        row("reference_dtype", "Reference dtype", rdt)
        comp = spin(0, OBJECTIVE_BOUNDS["completion_len"][1], TIPS["completion_len"], 64, " tokens")
        comp.setSpecialValueText("auto")
        comp.valueChanged.connect(lambda v: self._write_objective("completion_len", int(v) or None))
        row("completion_len", "Completion", comp)
        self.prompt_label = QtWidgets.QLabel()
        self.prompt_label.setObjectName("Facts")
        self.prompt_label.setWordWrap(True)  # its text must never widen the panel (issue 27)
        form.addRow("Prompt", self.prompt_label)
        gens = spin(2, OBJECTIVE_BOUNDS["num_generations"][1], TIPS["num_generations"])
        gens.valueChanged.connect(lambda v: self._write_objective("num_generations", int(v)))
        row("num_generations", "Generations", gens)
        backend = combo(enum_items(GenerationBackend, {
            GenerationBackend.TRANSFORMERS: "transformers.generate", GenerationBackend.VLLM_COLOCATE:
            "vLLM colocated", GenerationBackend.VLLM_SERVER: "vLLM server"}), TIPS["generation_backend"])
        backend.currentIndexChanged.connect(lambda _i: self._write_objective("generation_backend",
                                                                            backend.currentData()))
        row("generation_backend", "Generation", backend)
        frac = QtWidgets.QDoubleSpinBox()
        frac.setRange(0.05, 0.95)
        frac.setSingleStep(0.05)
        frac.setDecimals(2)
        frac.valueChanged.connect(lambda v: self._write_objective("vllm_memory_fraction", float(v)))
        row("vllm_memory_fraction", "vLLM memory", frac)
        sleep = QtWidgets.QCheckBox("vLLM sleep mode")
        sleep.toggled.connect(lambda v: self._write_objective("vllm_sleep", bool(v)))
        row("vllm_sleep", "", sleep)
        beta = QtWidgets.QDoubleSpinBox()
        beta.setRange(-0.001, 10.0)
        beta.setDecimals(3)
        beta.setSingleStep(0.01)
        beta.setSpecialValueText("auto")
        beta.valueChanged.connect(lambda v: self._write_objective("beta", None if v < 0 else float(v)))
        row("beta", "Beta", beta)
        iters = spin(1, OBJECTIVE_BOUNDS["num_iterations"][1], TIPS["num_iterations"])
        iters.valueChanged.connect(lambda v: self._write_objective("num_iterations", int(v)))
        row("num_iterations", "Iterations", iters)

    def _write_objective(self, name: str, value: Any) -> None:
        if not self._syncing:
            self.state.set_field(name, value)

    def _on_objective(self, _index: int) -> None:
        if self._syncing:
            return
        self.state.set_fields(objective_changes(Objective(self.objective_combo.currentData()), self.state.fields))

    def _sync_objective(self) -> None:
        f = self.state.fields
        obj = Objective(f.get("objective") or Objective.SFT)
        with QtCore.QSignalBlocker(self.objective_combo):
            select_data(self.objective_combo, obj)
        rows = self.objective_rows
        for name, w in rows.items():
            value = f.get(name)
            with QtCore.QSignalBlocker(w):
                if isinstance(w, QtWidgets.QComboBox):
                    select_data(w, None if value is None else type(w.itemData(w.count() - 1))(value))
                elif isinstance(w, QtWidgets.QCheckBox):
                    w.setChecked(bool(value))
                elif isinstance(w, QtWidgets.QDoubleSpinBox):
                    target = (-0.001 if name == "beta" else 0.3) if value is None else float(value)
                    if w.value() != target:
                        w.setValue(target)
                elif isinstance(w, QtWidgets.QSpinBox):
                    target = 0 if value is None else int(value)
                    if w.value() != target:
                        w.setValue(target)
        grpo = obj is Objective.GRPO
        backend = GenerationBackend(f.get("generation_backend") or GenerationBackend.TRANSFORMERS)
        has_ref = obj is not Objective.SFT and not obj.no_reference
        show = {"reference": has_ref, "completion_len": obj is not Objective.SFT,
                "reference_dtype": has_ref, "beta": obj is not Objective.SFT,
                "num_generations": grpo, "generation_backend": grpo, "num_iterations": grpo,
                "vllm_memory_fraction": grpo and backend is GenerationBackend.VLLM_COLOCATE,
                "vllm_sleep": grpo and backend is GenerationBackend.VLLM_COLOCATE}
        for name, w in rows.items():
            self.objective_form.setRowVisible(w, show[name])
        self.objective_form.setRowVisible(self.prompt_label, obj is not Objective.SFT)
        self.objective_box.setVisible(obj is not Objective.SFT)
        setup = self.state.current_setup()
        if setup is not None and obj is not Objective.SFT:
            self.prompt_label.setText(f"{setup.prompt_tokens:,} tokens (sequence − completion) · reference: "
                                      f"{setup.reference_mode.value}")
