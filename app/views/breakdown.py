"""The breakdown chart: one stacked bar per scenario (the current setup first), split by memory kind at
the peak, at the memory level the user picked; the GPU's capacity as a line, a fits / does-not-fit
verdict with the headroom, a legend, and the core's notes and warnings underneath."""

from __future__ import annotations

from html import escape

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.state import Row, Snapshot
from vramlab.app.theme import Theme
from vramlab.app.views.bars import Segment, Stack, StackedBarPlot, result_segments, wrap_tick
from vramlab.app.views.legend import LegendEntry, LegendWidget
from vramlab.core.catalog import common_sizes
from vramlab.core.kinds import KIND_ORDER
from vramlab.core.report import capacity_label, gui_message, level_axis_label, phase_label, verdict
from vramlab.core.units import fmt_auto, fmt_bytes, fmt_count

SAME_AS_CURRENT = "= current setup"
TINY_FRACTION = 0.005  # a kind under this share of the tallest bar, in every bar, is too thin to see


def row_tick(row: Row, show_model: bool, same_as_current: bool = False) -> str:
    name = wrap_tick(row.name)
    if row.result is None:
        return f"{name}\n(not estimated:\nsee below)"
    if same_as_current:  # the same setup as the first bar: say so rather than leave two equal bars unexplained
        name += f"\n({SAME_AS_CURRENT})"
    if show_model:
        return f"{name}\n{wrap_tick(row.model.name, 20)}"
    return name


def same_as_current(snapshot: Snapshot, row: Row) -> bool:
    cur = snapshot.rows[0]
    return (not row.is_current and row.result is not None and cur.result is not None
            and row.model == cur.model and row.setup == cur.setup)


def stacks_for(snapshot: Snapshot) -> list[Stack]:
    """The chart's bars for a snapshot: the core's components (and overheads) per row."""
    models = {r.model.id for r in snapshot.rows if r.result is not None}
    show_model = len(models) > 1
    out: list[Stack] = []
    for i, row in enumerate(snapshot.rows):
        res = row.result
        if res is None:
            out.append(Stack(i, row_tick(row, show_model), row.name, (), 0, snapshot.level,
                             note=gui_message(row.error)))
            continue
        segs = result_segments(res, snapshot.level)
        note = f"Peak in {phase_label(res.peak_phase).lower()}; {res.setup.precision_label()}"
        if row.error:
            note += f" — showing the last valid setup ({row.error})"
        out.append(Stack(i, row_tick(row, show_model, same_as_current(snapshot, row)), row.name, segs,
                         res.bytes_at(snapshot.level),
                         snapshot.level, highlight=row.is_current and len(snapshot.rows) > 1, note=note))
    return out


def objective_explanation(snapshot: Snapshot) -> str:
    """When the bars train the same model with different objectives (SFT / DPO / GRPO): what each step holds,
    in words, so that a DPO bar below SFT's or GRPO's token counts need no guessing. Empty otherwise."""
    from vramlab.core.estimate import objective_notes
    from vramlab.core.kinds import Kind
    from vramlab.core.spec.options import Objective

    rows = [r for r in snapshot.rows if r.result is not None and r.setup is not None]
    if len({r.setup.objective for r in rows if r.setup}) < 2:
        return ""
    unit = snapshot.unit
    lines: list[str] = []
    sft = next((r for r in [*rows[1:], *rows[:1]] if r.setup and r.setup.objective is Objective.SFT), None)
    seen: set[Objective] = set()
    for r in [*rows[1:], *rows[:1]]:  # the scenarios named by their objective first, the current setup last
        s, res = r.setup, r.result
        assert s is not None and res is not None
        if s.objective in seen:
            continue
        seen.add(s.objective)
        if s.objective is Objective.SFT:
            logits = res.components.get(Kind.LOGITS, 0)
            lines.append(f"<b>{escape(r.name)}</b>: {s.micro_batch} row{'s' if s.micro_batch != 1 else ''} of "
                         f"{s.seq_len:,} tokens; the loss keeps the full logits (batch × sequence × vocabulary, "
                         f"{fmt_bytes(logits, unit)} of “Logits & loss” at the peak).")
        elif s.objective is Objective.GRPO:
            first = objective_notes(r.model, s)[0].removeprefix("GRPO: ")
            lines.append(f"<b>{escape(r.name)}</b>: {s.num_generations} completions per prompt; {escape(first)}. "
                         f"Each completion follows a {s.prompt_tokens:,}-token prompt (sequence − completion), and "
                         f"training then runs on prompt + completion rows.")
        else:
            notes = objective_notes(r.model, s)
            first, ref = notes[0].split(": ", 1)[-1], notes[1]
            why = ""
            if sft is not None and sft.result is not None:
                below = res.peak_allocated_bytes < sft.result.peak_allocated_bytes
                why = (" It sits below SFT although it runs twice the rows: " if below else
                       " It can sit below SFT (with a large vocabulary or short completions): ") + \
                    "TRL computes its log-probabilities through a fused LM head, without the full logits SFT keeps."
            lines.append(f"<b>{escape(r.name)}</b>: {escape(first)}; {escape(ref)}." + why)
    return "<br>".join(lines)


def _segments_by_size(stacks: list[Stack]) -> tuple[list[Segment], list[Segment], dict[str, int]]:
    """(the segments a bar shows, those too thin to see in every bar, the largest size of each), in legend
    order: kinds in the core's order, then overheads. Too thin: under ``TINY_FRACTION`` of the tallest bar."""
    tallest = max((s.top_bytes for s in stacks), default=0)
    seen: dict[str, Segment] = {}
    largest: dict[str, int] = {}
    for s in stacks:
        for seg in s.segments:
            seen.setdefault(seg.key, seg)
            largest[seg.key] = max(largest.get(seg.key, 0), seg.nbytes)
    order = {f"kind:{k.value}": i for i, k in enumerate(KIND_ORDER)}
    ranked = sorted(seen.values(), key=lambda s: (s.overhead, order.get(s.key, 99)))
    shown = [s for s in ranked if largest[s.key] >= tallest * TINY_FRACTION]
    return shown, [s for s in ranked if s not in shown], largest


def legend_entries(stacks: list[Stack]) -> list[LegendEntry]:
    """A swatch for each kind a bar shows (the ones too thin to see are named by :func:`thin_kinds_note`)."""
    shown, _thin, _largest = _segments_by_size(stacks)
    return [LegendEntry(s.key, s.label, s.color, s.description, s.overhead) for s in shown]


def thin_kinds_note(stacks: list[Stack]) -> str:
    """The kinds in the bars too thin to see in any of them, with their largest size: named under the legend
    instead of a swatch nobody finds in the bars ("" when there are none)."""
    _shown, thin, largest = _segments_by_size(stacks)
    if not thin:
        return ""
    return "Too thin to see here: " + ", ".join(f"{s.label} (up to {fmt_auto(largest[s.key])})" for s in thin) + "."


class BreakdownView(QtWidgets.QWidget):
    """Verdict, chart and legend for a :class:`Snapshot`; also used (light, larger) in the report."""

    def __init__(self, theme: Theme, parent: QtWidgets.QWidget | None = None, font_pt: float = 9.0,
                 show_notes: bool = True) -> None:
        super().__init__(parent)
        self._snapshot: Snapshot | None = None
        outer = QtWidgets.QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(4)
        # Verdict, chart and legend: what "export chart" renders (the notes stay on screen only).
        self.chart_area = QtWidgets.QWidget(self)
        self.chart_area.setAutoFillBackground(True)
        layout = QtWidgets.QVBoxLayout(self.chart_area)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.setSpacing(4)
        outer.addWidget(self.chart_area, 1)
        self.verdict = QtWidgets.QLabel(self.chart_area)
        self.verdict.setObjectName("Verdict")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.subtitle = QtWidgets.QLabel(self.chart_area)
        self.subtitle.setObjectName("Facts")
        self.subtitle.setWordWrap(True)
        self.plot = StackedBarPlot(theme, self.chart_area, font_pt=font_pt)
        self.plot.setMinimumHeight(220)
        self.plot.setToolTip("")
        self.legend = LegendWidget(self.chart_area, None if font_pt == 9.0 else font_pt)
        self.thin_note = QtWidgets.QLabel(self.chart_area)  # wraps: never widens the window
        self.thin_note.setObjectName("Facts")
        self.thin_note.setWordWrap(True)
        self.thin_note.setToolTip("Each is under 0.5 % of the tallest bar in every bar: hover a bar for its exact "
                                  "size, or read the comparison's kind table")
        # why a bar has no estimate, under the chart (and in its exports): "(not estimated)" alone says nothing
        self.invalid_notes = QtWidgets.QLabel(self.chart_area)
        self.invalid_notes.setObjectName("InvalidBars")
        self.invalid_notes.setWordWrap(True)
        self.invalid_notes.setVisible(False)
        self.objective_notes = QtWidgets.QLabel(self.chart_area)
        self.objective_notes.setObjectName("ObjectiveNotes")
        self.objective_notes.setWordWrap(True)
        self.objective_notes.setVisible(False)
        layout.addWidget(self.verdict)
        layout.addWidget(self.subtitle)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.legend)
        layout.addWidget(self.thin_note)
        layout.addWidget(self.invalid_notes)
        layout.addWidget(self.objective_notes)
        self.notes: QtWidgets.QTextBrowser | None = None
        if show_notes:
            self.notes = QtWidgets.QTextBrowser(self)
            self.notes.setObjectName("Notes")
            self.notes.setOpenLinks(False)
            self.notes.setMaximumHeight(120)
            self.notes.setVerticalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAsNeeded)
            outer.addWidget(self.notes)
        self._theme = theme

    def apply_theme(self, theme: Theme) -> None:
        self._theme = theme
        self.plot.apply_theme(theme)
        if self._snapshot is not None:
            self.set_snapshot(self._snapshot)

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        unit, level, gpu = snapshot.unit, snapshot.level, snapshot.gpu
        stacks = stacks_for(snapshot)
        extra: list[float] = []
        if gpu is not None:
            extra.append(gpu.memory_bytes)
        self.plot.set_line("capacity", gpu.memory_bytes if gpu else None,
                           capacity_label(gpu, unit) if gpu else "", kind="capacity")
        for label, size in common_sizes():
            # a "24 GB" card holds 24 GiB: the line sits at that memory in the axis' unit, and its label says so
            # (in GB mode "24 GB" alone, at 25.77 on the axis, read as a misplaced line)
            self.plot.set_line(f"ref:{label}", size if snapshot.common_sizes else None,
                               f"“{label}” cards: {fmt_bytes(size, unit)}", kind="reference")
            if snapshot.common_sizes:
                extra.append(size)
        self.plot.set_y_extra(extra)
        self.plot.set_axis_label(level_axis_label(level, unit))
        self.plot.set_stacks(stacks, unit)
        self.legend.set_entries(legend_entries(stacks))
        thin = thin_kinds_note(stacks)
        self.thin_note.setText(thin)
        self.thin_note.setVisible(bool(thin))
        invalid = [r for r in snapshot.rows if r.result is None and r.error and not r.is_current]
        self.invalid_notes.setText("<br>".join(f"<b>{escape(r.name)}</b> is not estimated: "
                                               f"{escape(gui_message(r.error))}" for r in invalid))
        self.invalid_notes.setVisible(bool(invalid))
        explained = objective_explanation(snapshot)
        self.objective_notes.setText(explained)
        self.objective_notes.setVisible(bool(explained))

        current = snapshot.current
        v = verdict(current.result, gpu, unit)
        if snapshot.tracing:
            v = type(v)("unknown", "The verdict follows once the trace is done; the bars show the last setup "
                                   "estimated.")
        elif snapshot.error:  # the banner above says what is wrong; a green "Fits" under it would contradict it
            v = type(v)("unknown", "The setup is not valid (see the message above): the bars show the last "
                                   "valid setup, and no verdict is given until it is fixed.")
        self.verdict.setText(v.text)
        if self.verdict.property("state") != v.state:
            self.verdict.setProperty("state", v.state)
            self.verdict.style().unpolish(self.verdict)
            self.verdict.style().polish(self.verdict)
        res = current.result
        if res is not None:
            self.subtitle.setText(
                f"Current setup: peak in {phase_label(res.peak_phase).lower()} · "
                f"{fmt_count(res.total_params)} parameters, {fmt_count(res.trainable_params)} trainable · "
                f"analytical estimate, per GPU"
            )
        else:
            self.subtitle.setText("")
        if self.notes is not None:
            self.notes.setHtml(self._notes_html(snapshot))

    def _notes_html(self, snapshot: Snapshot) -> str:
        res = snapshot.current.result
        parts: list[str] = []
        # the core's words name CLI flags; the window names its controls for them (as in its error messages)
        for w in snapshot.warnings:
            parts.append(f"<div style='color:{self._theme.warning_fg}'>⚠ {escape(gui_message(w))}</div>")
        if res is not None:
            parts.extend(f"<div>• {escape(gui_message(n))}</div>" for n in res.notes)
        return "".join(parts)
