"""The details issue 27 saw in the window (item 5), each as a user meets it: no green verdict under an error,
reference lines that say where they are, a repeated bar named as such, a legend of what the bars show, settings
that do not apply shown off, the reason a bar has no estimate, colours told apart, the window's own control
names in its messages, plain numbers and plurals, and the SFT / DPO / GRPO comparison explained."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from vramlab.app.palette import KIND_COLORS, MIN_DELTA_E, OVERHEAD_COLORS
from vramlab.app.views.breakdown import SAME_AS_CURRENT, TINY_FRACTION
from vramlab.core.checks import SetupError
from vramlab.core.live import ComparisonRow, rows_table
from vramlab.core.report import FLAG_LABELS, gui_message
from vramlab.core.result import MemLevel
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import MiB, Unit

CORE = Path(__file__).resolve().parents[2] / "core"


def test_an_invalid_setup_shows_no_fits_verdict_under_its_error(window):
    window.state.set_field("offload", "optimizer")  # invalid without sharding
    snap = window.state.flush()
    assert snap.error and window.setup_banner.isVisible()
    verdict = window.breakdown.verdict
    assert verdict.property("state") == "unknown" and "✔" not in verdict.text() and "Fits" not in verdict.text()
    assert "not valid" in verdict.text()
    window.state.set_field("offload", "none")
    window.state.flush()
    assert window.breakdown.verdict.text().startswith("✔ Fits")


@pytest.mark.parametrize("unit", [Unit.GIB, Unit.GB])
def test_reference_lines_say_the_value_they_are_drawn_at(window, unit):
    window.act_sizes.trigger()
    window.state.set_unit(unit)
    window.state.flush()
    plot = window.breakdown.plot
    keys = [k for k in plot.line_keys() if k.startswith("ref:")]
    assert len(keys) == 5
    for key in keys:
        label = plot._lines[key].label.format
        number = float(re.search(r": ([0-9.,]+) " + unit.value, label).group(1).replace(",", ""))
        assert number == pytest.approx(plot.line_value(key), abs=0.006), label  # the label reads off the axis
        assert label.startswith(f"“{key.removeprefix('ref:')}” cards")


def test_a_bar_equal_to_the_current_setup_says_so(window):
    stacks = window.breakdown.plot.stacks
    ticks = {s.title: s.tick for s in stacks}
    assert SAME_AS_CURRENT in ticks["LoRA - BF16"]  # the default setup is the LoRA preset
    assert SAME_AS_CURRENT not in ticks["Full - AMP BF16"] and SAME_AS_CURRENT not in ticks["Current setup"]
    window.state.set_field("lora_rank", 16)  # the preset follows: still the same setup
    window.state.set_field("method", "full")
    window.state.flush()
    ticks = {s.title: s.tick for s in window.breakdown.plot.stacks}
    assert not any(SAME_AS_CURRENT in t for name, t in ticks.items() if name != "Full - AMP BF16")


def test_the_legend_shows_a_swatch_only_for_kinds_a_bar_shows(window):
    for level in MemLevel:
        window.state.set_level(level)
        window.state.flush()
        stacks = window.breakdown.plot.stacks
        tallest = max(s.top_bytes for s in stacks)
        largest: dict[str, int] = {}
        for s in stacks:
            for seg in s.segments:
                largest[seg.key] = max(largest.get(seg.key, 0), seg.nbytes)
        entries = window.breakdown.legend.entries()
        assert {e.key for e in entries} == {k for k, n in largest.items() if n >= tallest * TINY_FRACTION}
        thin = [s.label for s in stacks for seg in s.segments if largest[seg.key] < tallest * TINY_FRACTION
                for s in [seg]]
        note = window.breakdown.thin_note
        # named together under the legend, with their size, instead of a swatch nobody finds in the bars
        assert note.isVisibleTo(window.breakdown) == bool(thin)
        assert all(label in note.text() for label in thin)
    assert "Batch inputs" not in [e.label for e in entries]  # a few kB under 7-137 GiB bars
    assert "Batch inputs (up to " in window.breakdown.thin_note.text()


def test_double_quantization_is_unticked_where_it_does_not_apply(window):
    box = window.panel.control("double_quant")
    assert window.state.fields["weights"] != "nf4"
    assert not box.isChecked() and not box.isEnabled() and "NF4 weights only" in box.toolTip()
    window.panel.preset_combo.setCurrentIndex(window.panel.preset_combo.findData("qlora-nf4"))
    window.panel.preset_combo.activated.emit(window.panel.preset_combo.currentIndex())
    window.state.flush()
    assert window.state.fields["weights"] == "nf4"
    assert box.isEnabled() and box.isChecked() == bool(window.state.fields["double_quant"])


def test_bars_without_an_estimate_say_why(window):
    from vramlab.core.spec.options import LossKernel

    window.state.set_model("llama-2-7b")
    window.state.set_field("loss_kernel", LossKernel.CCE)
    snap = window.state.flush()
    invalid = [r for r in snap.rows if r.result is None]
    # Cut Cross Entropy cannot train on the fp32 hidden states of the AMP preset (its backward's own refusal)
    assert {r.name for r in invalid} == {"Full - AMP BF16"}
    notes = window.breakdown.invalid_notes
    assert notes.isVisibleTo(window.breakdown)
    text = notes.text()
    for r in invalid:
        assert f"<b>{r.name}</b> is not estimated" in text and "fp32 hidden states" in text
    assert "(invalid)" not in "".join(s.tick for s in window.breakdown.plot.stacks)
    window.state.set_field("loss_kernel", LossKernel.HF)
    window.state.flush()
    assert not notes.isVisibleTo(window.breakdown)


def _lab(color: str) -> tuple[float, float, float]:
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))

    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = lin(r), lin(g), lin(b)
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def _delta_e(a: str, b: str) -> float:
    return sum((p - q) ** 2 for p, q in zip(_lab(a), _lab(b))) ** 0.5


def test_chart_colours_are_told_apart():
    kinds = {k.label: c for k, c in KIND_COLORS.items()}
    overheads = dict(OVERHEAD_COLORS)
    for group in (kinds, overheads):
        for (a, ca), (b, cb) in itertools.combinations(group.items(), 2):
            assert _delta_e(ca, cb) >= MIN_DELTA_E, (a, b, round(_delta_e(ca, cb), 1))
    for (a, ca), (b, cb) in itertools.product(kinds.items(), overheads.items()):
        assert _delta_e(ca, cb) >= 15, (a, b, round(_delta_e(ca, cb), 1))


def test_the_window_names_its_own_controls_in_messages(window):
    """Every CLI flag a setup error can name has a control name in the window (the flags with no control listed)."""
    # options with no control in the window yet (set by the CLI or a training config the window reads)
    no_control = {"--kbit-prepare", "--json", "--source"}  # the window always takes the automatic source
    named = set()
    for path in (*sorted((CORE / "spec").glob("*.py")), CORE / "vision.py"):
        named |= set(re.findall(r"--[a-z][a-z0-9-]*", path.read_text(encoding="utf-8")))
    assert named - no_control <= set(FLAG_LABELS), sorted(named - no_control - set(FLAG_LABELS))
    with pytest.raises(SetupError) as err:
        TrainingSetup(method="lora", objective="dpo", seq_len=512, completion_len=512).validate()
    shown = gui_message(str(err.value))
    assert "--" not in shown and "“Completion”" in shown and "“Sequence length”" in shown
    window.state.set_fields({"objective": "dpo", "completion_len": 512, "seq_len": 512})
    window.state.flush()
    assert "“Completion”" in window.setup_banner.text() and "--" not in window.setup_banner.text()


def test_max_pixels_zero_reads_as_the_processors_default(window):
    window.state.set_model("qwen2.5-vl-3b")
    window.state.set_field("max_pixels", None)
    window.state.flush()
    spin = window.panel.control("max_pixels")
    assert spin.value() == 0 and spin.text() == "processor's default"


def test_one_sequence_is_singular(window):
    window.state.set_fields({"micro_batch": 1, "grad_accum": 1, "gpus": 1})
    window.state.flush()
    assert window.panel.effective.text().startswith("1 sequence per step")
    window.state.set_field("grad_accum", 4)
    window.state.flush()
    assert window.panel.effective.text().startswith("4 sequences per step")


def test_live_figures_have_two_decimals():
    row = ComparisonRow("Levels", "Tensor peak", "tensors", int(413.0441 * MiB), int(420.5 * MiB))
    _headers, cells = rows_table([row], Unit.MIB)
    assert cells[0][1:4] == ["413.04", "420.50", "+7.46"]


def test_the_objective_comparison_explains_dpo_and_grpo(window):
    window.state.set_model("smollm2-135m")  # a large vocabulary for its size: SFT's logits weigh
    window.state.set_setup(TrainingSetup(method="lora", micro_batch=4, seq_len=1024))
    window.state.flush()
    window.comparison.actions["objectives"].trigger()
    snap = window.state.flush()
    rows = {r.name: r for r in snap.rows}
    dpo, sft, grpo = rows["DPO"], rows["SFT"], rows["GRPO"]
    for label in (window.breakdown.objective_notes, window.comparison.objective_notes):
        text = label.text()
        assert label.isVisibleTo(label.parentWidget())
        assert "fused LM head" in text and "full logits" in text
        below = dpo.result.peak_allocated_bytes < sft.result.peak_allocated_bytes
        assert ("sits below SFT although it runs twice the rows" in text) == below
        s = grpo.setup
        assert f"{s.num_generations} completions per prompt" in text
        assert f"{s.completion_tokens} tokens" in text and f"{s.prompt_tokens:,}-token prompt" in text
    window.state.compare_presets()
    window.state.flush()
    assert not window.breakdown.objective_notes.isVisibleTo(window.breakdown)


def test_the_notes_name_the_windows_controls_not_cli_flags(window):
    """The Hub kernels note (on by default) names its switch as the window shows it."""
    window.state.flush()
    text = window.breakdown.notes.toPlainText()
    assert "Hub kernels" in text and "“Hub kernels (transformers ≥ 5.25)”" in text
    assert "--no-hub-kernels" not in text
