"""The application state: the setup being edited, the pinned scenarios, and what the core says about them.

:class:`AppState` is the one controller the views bind to. It owns

* the model being trained (:class:`ModelChoice`: a preset or an imported config.json / model folder),
* the setup fields as the user typed them (a dict of :class:`~vramlab.core.spec.training.TrainingSetup` keyword
  arguments, which may be invalid for a moment: the editors show them as they are),
* the GPU, the memory level and the unit the views show,
* the scenarios of the comparison (pinned snapshots, or presets that follow the current setup),
* simulation results received from the worker thread.

Edits restart a 50 ms debounce timer; when it fires, every row is estimated (sub-millisecond per row once
the core has cached the setup's structure) and one frozen :class:`Snapshot` is emitted. An invalid setup
produces a snapshot whose ``error`` holds the core's :class:`~vramlab.core.checks.SetupError` message and
whose current row keeps the last valid setup and result, so the chart stays where it was.

The allocator-reserved and device levels of that first snapshot come from the core's fast slack model. A
worker thread then replays each new row's step through the caching-allocator model (what ``vramlab
estimate`` prints; 20-400 ms a row) and a second snapshot follows with those levels (``Snapshot.exact``).
The tensor level is the same in both; replayed results are kept, so going back to a setup is instant.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vramlab.app.qt import QtCore
from vramlab.app.tracing import TraceController
from vramlab.app.workers import Runner
from vramlab.core.catalog import ModelEntry, find_gpu, resolve_model
from vramlab.core.checks import SetupError
from vramlab.core.compare import COMPARE_PRESETS, objective_variants, under_preset
from vramlab.core.estimate import estimate
from vramlab.core.result import MemLevel, MemoryResult
from vramlab.core.spec.edits import follow_changes
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import Method
from vramlab.core.spec.presets import PRECISION_PRESETS, PrecisionPreset, matching_preset, precision_preset
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.spec.unsloth_loss import unsloth_gpu_on
from vramlab.core.traced import cached_tape, uses_trace
from vramlab.core.units import Unit

log = logging.getLogger(__name__)

DEBOUNCE_MS = 50
REPLAY_DELAY_MS = 400  # edits paused this long: replay the allocator for the rows shown (see AppState)
DEFAULT_MODEL = "llama-2-7b"
DEFAULT_GPU = "rtx-4090"
DEFAULT_PRESET = "lora-bf16"
SETUP_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingSetup))
_VISION_FIELDS = ("images", "image_width", "image_height", "frames", "max_pixels", "vision_tuning", "pan_and_scan",
                  "vision_ckpt")
CURRENT_KEY = "current"
CURRENT_NAME = "Current setup"
_CACHE_SIZE = 512


# ---- value types ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelChoice:
    """A model and how to find it again: ``ref`` is a preset id or the imported path."""

    ref: str
    spec: ModelSpec
    warnings: tuple[str, ...] = ()
    imported: bool = False
    origin: str = ""  # a Hub model: repository, commit, and whether the network was used

    @classmethod
    def from_entry(cls, ref: str, entry: ModelEntry) -> ModelChoice:
        imported = entry.source != "preset"
        return cls(ref if imported else entry.spec.id, entry.spec, tuple(entry.warnings), imported, entry.origin)


def load_model(ref: str) -> ModelChoice:
    """Resolve a preset id / name, a config.json or a model folder. Raises SetupError with the reason."""
    ref = ref.strip()
    if not ref:
        raise SetupError("no model given: choose a preset or open a config.json / model folder")
    try:
        entry = resolve_model(ref, network=False)  # a Hub id not in the cache: the window looks it up off-thread
    except SetupError:
        raise
    except OSError as e:  # the importer names the file in SetupErrors; be as clear for raw I/O errors
        raise SetupError(f"cannot read {ref}: {e.strerror or e}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise SetupError(f"{ref} is not a model this app can read: {e}") from e
    return ModelChoice.from_entry(ref, entry)


def setup_fields(setup: TrainingSetup) -> dict[str, Any]:
    """The keyword arguments that rebuild ``setup``, with the weight dtype made explicit."""
    out = {name: getattr(setup, name) for name in SETUP_FIELDS}
    out["weights"] = setup.weight_dtype
    return out


def fields_to_json(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items()}


@dataclass(frozen=True)
class Scenario:
    """A setup in the comparison. ``follows`` names a precision preset when the scenario tracks the current
    setup (model, batch, sequence, optimizer, ...) with that preset applied; otherwise it is a pinned
    snapshot that does not change."""

    uid: int
    name: str
    model: ModelChoice
    setup: TrainingSetup
    follows: str | None = None


@dataclass(frozen=True)
class Row:
    """One bar of the chart and one row of the table."""

    key: str
    name: str
    model: ModelSpec
    setup: TrainingSetup | None
    result: MemoryResult | None
    error: str = ""
    uid: int | None = None
    follows: str | None = None
    tracing: bool = False  # no estimate yet because its first trace is running (``error`` says so): information

    @property
    def is_current(self) -> bool:
        return self.key == CURRENT_KEY


@dataclass(frozen=True)
class Snapshot:
    """Everything the views draw, computed once per change. ``rows[0]`` is the current setup."""

    rows: tuple[Row, ...]
    gpu: GpuSpec | None
    level: MemLevel
    unit: Unit
    error: str = ""
    common_sizes: bool = False
    warnings: tuple[str, ...] = ()
    exact: bool = True  # every row's reserved and device levels come from the allocator replay

    @property
    def current(self) -> Row:
        return self.rows[0]

    @property
    def tracing(self) -> bool:
        """The current setup waits for its first trace (``error`` says so): information, not a fault."""
        return self.current.tracing

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)


def scenario_key(uid: int) -> str:
    return f"s{uid}"


class TracePending(SetupError):
    """No estimate yet: the setup's first trace is running (or was just started). Rows and snapshots carry it
    as ``tracing``, so that views show it as information without reading its text."""


# ---- the controller -----------------------------------------------------------------------------------------

class AppState(QtCore.QObject):
    """Owns the setup and the scenarios; recomputes (debounced) and emits :class:`Snapshot` objects."""

    inputsChanged = QtCore.Signal()  # model, fields or GPU changed: editors re-read them
    computed = QtCore.Signal(object)  # Snapshot
    scenariosChanged = QtCore.Signal()
    simulationsChanged = QtCore.Signal()
    message = QtCore.Signal(str)  # short status-bar text

    def __init__(self, parent: QtCore.QObject | None = None, model: ModelChoice | None = None,
                 gpu: GpuSpec | None = None, replay: bool = True) -> None:
        super().__init__(parent)
        self.replay = replay  # refine the outer levels by replaying the allocator (see the module docstring)
        self._exact: OrderedDict[tuple[ModelSpec, TrainingSetup, GpuSpec | None], MemoryResult] = OrderedDict()
        self._pending: dict[tuple[ModelSpec, TrainingSetup, GpuSpec | None], None] = {}
        self._failed: set[tuple[ModelSpec, TrainingSetup, GpuSpec | None]] = set()  # replays that raised
        self._closed = False
        self._replayer = Runner("vramlab-replay", self)  # one replay job at a time (see app.workers)
        self._replayer.finished.connect(self._on_replayed)
        self._replayer.errored.connect(self._on_replay_errored)
        self._replayer.ended.connect(self._start_replay)
        # the replay waits until edits pause (and, at start-up, until the window has painted): it holds the GIL
        # in pure Python for 20-400 ms a row
        self._replay_timer = QtCore.QTimer(self)
        self._replay_timer.setSingleShot(True)
        self._replay_timer.setInterval(REPLAY_DELAY_MS)
        self._replay_timer.timeout.connect(self._start_replay)
        # a first trace (an architecture without a hand-written program) runs in the background, and the
        # estimate is made again when it is done; a failed or cancelled one is not retried for that setup
        self.tracer = TraceController(self)
        self.tracer.succeeded.connect(lambda _job: self._schedule())
        self.tracer.failed.connect(self._on_trace_failed)
        self.tracer.cancelled.connect(self._on_trace_cancelled)
        self.tracer.runningChanged.connect(lambda running: None if running else self._schedule())
        self._trace_failed: dict[tuple[ModelSpec, TrainingSetup], str] = {}
        self._model = model or load_model(DEFAULT_MODEL)
        self._fields: dict[str, Any] = setup_fields(precision_preset(DEFAULT_PRESET).apply(TrainingSetup()))
        self._gpu: GpuSpec | None = gpu if gpu is not None else find_gpu(DEFAULT_GPU)
        self._level = MemLevel.ALLOCATED
        self._unit = Unit.GIB
        self._common_sizes = False
        self._scenarios: list[Scenario] = []
        self._next_uid = 1
        self._cache: OrderedDict[tuple[ModelSpec, TrainingSetup, GpuSpec | None], MemoryResult] = OrderedDict()
        self._last_valid: tuple[ModelChoice, TrainingSetup] | None = None
        self._simulations: dict[tuple[ModelSpec, TrainingSetup], MemoryResult] = {}
        self._snapshot: Snapshot | None = None
        self._timer = QtCore.QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(DEBOUNCE_MS)
        self._timer.timeout.connect(self._recompute)
        self.compare_presets(schedule=False)

    # ---- read access --------------------------------------------------------------------------------------
    @property
    def model(self) -> ModelChoice:
        return self._model

    @property
    def fields(self) -> Mapping[str, Any]:
        return dict(self._fields)

    @property
    def gpu(self) -> GpuSpec | None:
        return self._gpu

    @property
    def level(self) -> MemLevel:
        return self._level

    @property
    def unit(self) -> Unit:
        return self._unit

    @property
    def common_sizes(self) -> bool:
        return self._common_sizes

    @property
    def scenarios(self) -> tuple[Scenario, ...]:
        return tuple(self._scenarios)

    @property
    def pending(self) -> bool:
        """A recompute is scheduled (an edit arrived less than the debounce interval ago)."""
        return self._timer.isActive()

    @property
    def snapshot(self) -> Snapshot:
        if self._snapshot is None:
            self._recompute()
        assert self._snapshot is not None
        return self._snapshot

    def candidate_setup(self) -> TrainingSetup:
        """The setup the fields describe; raises SetupError (with the core's message) when they cannot."""
        try:
            return TrainingSetup(**self._fields)
        except SetupError:
            raise
        except (ValueError, TypeError) as e:
            raise SetupError(str(e)) from e

    def current_setup(self) -> TrainingSetup | None:
        """The current setup if it is valid for the current model, else None."""
        try:
            setup = self.candidate_setup()
            setup.validate(self._model.spec)
        except SetupError:
            return None
        return setup

    def current_preset(self) -> PrecisionPreset | None:
        """The precision preset the fields match, or None ('Custom')."""
        try:
            return matching_preset(self.candidate_setup())
        except SetupError:
            return None

    def simulation_for(self, spec: ModelSpec, setup: TrainingSetup | None) -> MemoryResult | None:
        if setup is None:
            return None
        return self._simulations.get((spec, setup))

    # ---- edits ------------------------------------------------------------------------------------------------
    def set_model(self, ref: str) -> ModelChoice:
        """Switch to a preset or import a config.json / model folder. Raises SetupError (nothing changes)."""
        choice = load_model(ref)
        self.set_model_choice(choice)
        return choice

    def set_model_choice(self, choice: ModelChoice) -> None:
        if choice == self._model:
            return
        self._model = choice
        layers = choice.spec.num_layers
        if self._fields.get("trainable_layers") and self._fields["trainable_layers"] > layers:
            self._fields["trainable_layers"] = layers
        if choice.spec.vision is None:  # a text model: the images the last model took would make the setup
            # invalid, and the Images group they are edited in is hidden for it
            defaults = TrainingSetup()
            self._fields.update({name: getattr(defaults, name) for name in _VISION_FIELDS})
        self._changed()

    def set_field(self, name: str, value: Any) -> None:
        self.set_fields({name: value})

    def set_fields(self, changes: Mapping[str, Any]) -> None:
        """Apply edits from the editors, with what follows from them by the core's one rule
        (:func:`~vramlab.core.spec.edits.follow_changes`, the CLI's too); freeze starts with 4 trainable layers."""
        unknown = set(changes) - set(SETUP_FIELDS)
        if unknown:
            raise KeyError(f"unknown setup fields: {', '.join(sorted(unknown))}")
        new = {**self._fields, **changes, **follow_changes(self._fields, changes)}
        if "method" in changes and Method(new["method"]) is Method.FREEZE and not new.get("trainable_layers"):
            new["trainable_layers"] = min(4, self._model.spec.num_layers)  # the editor's starting value
        if new == self._fields:
            return
        self._fields = new
        self._changed()

    def set_setup(self, setup: TrainingSetup) -> None:
        fields = setup_fields(setup)
        if fields != self._fields:
            self._fields = fields
            self._changed()

    def apply_preset(self, preset_id: str) -> None:
        preset = precision_preset(preset_id)
        self.set_fields(dict(preset.fields))

    def set_gpu(self, gpu: GpuSpec | None) -> None:
        if gpu != self._gpu:
            self._gpu = gpu
            if self._fields.get("unsloth_gpu"):  # Unsloth's free memory, if given, kept; the rest the GPU's
                self._fields["unsloth_gpu"] = unsloth_gpu_on(self._fields["unsloth_gpu"], gpu)
            self._changed()

    def set_level(self, level: MemLevel | str) -> None:
        level = MemLevel(level)
        if level is not self._level:
            self._level = level
            self._redisplay()

    def set_unit(self, unit: Unit | str) -> None:
        unit = Unit(unit)
        if unit is not self._unit:
            self._unit = unit
            self._redisplay()

    def set_common_sizes(self, on: bool) -> None:
        if bool(on) != self._common_sizes:
            self._common_sizes = bool(on)
            self._redisplay()

    # ---- scenarios -----------------------------------------------------------------------------------------
    def _new_uid(self) -> int:
        uid = self._next_uid
        self._next_uid += 1
        return uid

    def _unique_name(self, base: str, exclude: int | None = None) -> str:
        taken = {s.name for s in self._scenarios if s.uid != exclude} | {CURRENT_NAME}
        if base not in taken:
            return base
        n = 2
        while f"{base} #{n}" in taken:
            n += 1
        return f"{base} #{n}"

    def pin_current(self, name: str | None = None) -> Scenario | None:
        """Add the current setup to the comparison as a fixed scenario (None if the setup is invalid)."""
        setup = self.current_setup()
        if setup is None:
            self.message.emit("The current setup is invalid; fix it before pinning it.")
            return None
        preset = matching_preset(setup)
        base = name.strip() if name and name.strip() else (preset.label if preset else "Custom setup")
        scenario = Scenario(self._new_uid(), self._unique_name(base), self._model, setup)
        self._scenarios.append(scenario)
        self.scenariosChanged.emit()
        self.message.emit(f"Pinned “{scenario.name}”.")
        self._schedule()
        return scenario

    def compare_presets(self, presets: Iterable[str] = COMPARE_PRESETS, schedule: bool = True) -> None:
        """Replace the comparison with the current setup under each preset (they follow later edits)."""
        self._scenarios = []
        for pid in presets:
            preset = precision_preset(pid)
            setup = self._follow_setup(preset) or preset.apply(TrainingSetup())
            self._scenarios.append(Scenario(self._new_uid(), preset.label, self._model, setup, follows=preset.id))
        self.scenariosChanged.emit()
        if schedule:
            self._schedule()

    def compare_objectives(self) -> None:
        """Replace the comparison with the current setup trained as SFT, DPO and GRPO (pinned snapshots); GRPO
        takes a number of generations that divides its generation batch (TRL's check)."""
        setup = self.current_setup()
        if setup is None:
            self.message.emit("The current setup is invalid; fix it before comparing objectives.")
            return
        self._scenarios = []
        for name, changes in objective_variants(setup):
            try:
                variant = setup.replace(**changes)
                variant.validate(self._model.spec)
            except SetupError as e:
                self.message.emit(f"{name} left out: {e}")
                continue
            self._scenarios.append(Scenario(self._new_uid(), self._unique_name(name), self._model, variant))
        self.scenariosChanged.emit()
        self._schedule()

    def scenario(self, uid: int) -> Scenario | None:
        return next((s for s in self._scenarios if s.uid == uid), None)

    def rename_scenario(self, uid: int, name: str) -> bool:
        s = self.scenario(uid)
        name = name.strip()
        if s is None or not name or name == s.name:
            return False
        self._replace_scenario(dataclasses.replace(s, name=self._unique_name(name, exclude=uid)))
        return True

    def move_scenario(self, uid: int, delta: int) -> bool:
        s = self.scenario(uid)
        if s is None:
            return False
        i = self._scenarios.index(s)
        j = max(0, min(len(self._scenarios) - 1, i + delta))
        if i == j:
            return False
        self._scenarios.insert(j, self._scenarios.pop(i))
        self.scenariosChanged.emit()
        self._schedule()
        return True

    def remove_scenario(self, uid: int) -> bool:
        s = self.scenario(uid)
        if s is None:
            return False
        self._scenarios.remove(s)
        self.scenariosChanged.emit()
        self._schedule()
        return True

    def load_into_editor(self, uid: int) -> None:
        """Make a scenario the current setup (its model and every field)."""
        s = self.scenario(uid)
        if s is None:
            return
        self._model = s.model
        self._fields = setup_fields(s.setup)
        self._changed()

    def set_scenarios(self, scenarios: Iterable[tuple[str, ModelChoice, TrainingSetup, str | None]]) -> None:
        """Replace the comparison (from a file or the saved settings): (name, model, setup, follows)."""
        self._scenarios = []
        for name, model, setup, follows in scenarios:
            self._scenarios.append(Scenario(self._new_uid(), self._unique_name(name), model, setup, follows))
        self.scenariosChanged.emit()
        self._schedule()

    def _replace_scenario(self, new: Scenario) -> None:
        for i, s in enumerate(self._scenarios):
            if s.uid == new.uid:
                self._scenarios[i] = new
        self.scenariosChanged.emit()
        self._redisplay(rename_only=True)

    # ---- simulations ---------------------------------------------------------------------------------------
    def add_simulation(self, result: MemoryResult) -> None:
        self._simulations[(result.model, result.setup)] = result
        self.simulationsChanged.emit()

    # ---- recompute -------------------------------------------------------------------------------------------
    def _changed(self) -> None:
        self.inputsChanged.emit()
        self._schedule()

    def _schedule(self) -> None:
        # a throttle: the recompute runs DEBOUNCE_MS after the first edit of a burst, with the fields as they
        # are then, so a dragged slider is followed at about 1000 / DEBOUNCE_MS frames a second and typed
        # digits inside the interval still give one recompute
        if not self._timer.isActive():
            self._timer.start()

    def flush(self) -> Snapshot:
        """Recompute now if an edit is pending; returns the latest snapshot."""
        if self._timer.isActive() or self._snapshot is None:
            self._recompute()
        assert self._snapshot is not None
        return self._snapshot

    def estimate(self, spec: ModelSpec, setup: TrainingSetup) -> MemoryResult:
        """The core's estimate on the current GPU (memoised: the table, chart and report share it): the
        allocator replay's when it is done, else the fast one (and the replay is queued)."""
        if uses_trace(spec, setup):  # before the replay queue: the trace runs once, on its own worker
            self._traced_or_pending(spec, setup)
        key = (spec, setup, self._gpu)
        exact = self._exact.get(key)
        if exact is not None:
            self._exact.move_to_end(key)
            return exact
        if self.replay and key not in self._failed:
            self._pending[key] = None
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        result = estimate(spec, setup, self._gpu)
        self._cache[key] = result
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return result

    def _traced_or_pending(self, spec: ModelSpec, setup: TrainingSetup) -> None:
        """Return when the traced tape is at hand; else start (or wait for) its trace and say so."""
        failed = self._trace_failed.get((spec, setup))
        if failed is not None:
            raise SetupError(failed)
        if cached_tape(spec, setup) is not None:
            return
        if not self.tracer.running:
            self.tracer.start(spec, setup)
        raise TracePending(f"Tracing {spec.name}: the first estimate of this recipe is traced from transformers' "
                         "own classes (seconds; progress in the status bar, which can cancel it); the numbers "
                         "appear when it is done")

    @QtCore.Slot(object, str)
    def _on_trace_failed(self, job: Any, reason: str) -> None:
        if job is not None:
            self._trace_failed[job] = f"The trace of transformers' step failed: {reason}"
        self._schedule()

    @QtCore.Slot()
    def _on_trace_cancelled(self) -> None:
        job = self.tracer.job
        if job is not None:
            self._trace_failed[job] = ("The trace was cancelled: this setup has no estimate (edit it, or choose "
                                       "another, to trace again)")

    def _follow_setup(self, preset: PrecisionPreset) -> TrainingSetup | None:
        """The current fields with ``preset``'s precision choices instead of the user's."""
        try:
            return under_preset(self._fields, preset)
        except (SetupError, ValueError, TypeError):
            return None

    def _evaluate(self, model: ModelSpec, setup: TrainingSetup) -> tuple[MemoryResult | None, str, bool]:
        """The estimate, or None with the reason; the last item says whether the reason is a running trace."""
        try:
            setup.validate(model)
            return self.estimate(model, setup), "", False
        except SetupError as e:
            return None, str(e), isinstance(e, TracePending)
        except Exception as e:  # a core bug must not take the window down: say so, keep the last chart
            log.exception("estimate failed for %s / %s", model.id, setup)
            return (None, f"The estimate failed unexpectedly ({type(e).__name__}: {e}). Please report this setup.",
                    False)

    def _recompute(self) -> None:
        self._timer.stop()
        spec = self._model.spec
        error, tracing = "", False
        result: MemoryResult | None = None
        try:
            setup: TrainingSetup | None = self.candidate_setup()
        except SetupError as e:
            setup, error = None, str(e)
        if setup is not None:
            result, error, tracing = self._evaluate(spec, setup)
        if result is not None and setup is not None:
            self._last_valid = (self._model, setup)
            current = Row(CURRENT_KEY, CURRENT_NAME, spec, setup, result)
        elif self._last_valid is not None:  # keep the last valid chart, on the current GPU
            model, last = self._last_valid
            kept, _, _ = self._evaluate(model.spec, last)
            current = Row(CURRENT_KEY, CURRENT_NAME, model.spec, last, kept, error, tracing=tracing)
        else:
            current = Row(CURRENT_KEY, CURRENT_NAME, spec, None, None, error, tracing=tracing)

        rows = [current]
        presets = {p.id: p for p in PRECISION_PRESETS}
        for i, scenario in enumerate(self._scenarios):
            s = scenario
            if s.follows in presets and not error:
                derived = self._follow_setup(presets[s.follows])
                if derived is not None and (derived != s.setup or s.model != self._model):
                    s = dataclasses.replace(s, model=self._model, setup=derived)
                    self._scenarios[i] = s
            res, err, traces = self._evaluate(s.model.spec, s.setup)
            rows.append(Row(scenario_key(s.uid), s.name, s.model.spec, s.setup, res, err, s.uid, s.follows, traces))
        warnings = (*self._model.warnings, *(current.result.warnings if current.result else ()))
        exact = all(r.result is None or (r.model, r.setup, self._gpu) in self._exact for r in rows)
        self._snapshot = Snapshot(tuple(rows), self._gpu, self._level, self._unit, error, self._common_sizes,
                                  tuple(dict.fromkeys(warnings)), exact)
        self.computed.emit(self._snapshot)
        if self._pending and not self._replayer.running:
            self._replay_timer.start()

    # ---- the allocator replay (worker thread) ---------------------------------------------------------------------
    def _start_replay(self) -> None:
        if self._closed or self._replayer.running or not self._pending or self._timer.isActive():
            return  # one job at a time; an edit that is due starts it again
        items = list(self._pending)
        self._pending.clear()
        self._replayer.start(lambda worker: _replay(items, worker.aborted), keep_on_abort=True)

    @QtCore.Slot(object)
    def _on_replay_errored(self, exc: Any) -> None:  # _replay keeps per-row failures: this is a bug in it
        log.error("allocator replay failed: %s: %s", type(exc).__name__, exc)

    @QtCore.Slot(object)
    def _on_replayed(self, results: Any) -> None:
        if self._closed:
            return
        for key, result in results:
            if result is None:
                self._failed.add(key)
            else:
                self._exact[key] = result
        while len(self._exact) > _CACHE_SIZE:
            self._exact.popitem(last=False)
        shown = self._snapshot
        if shown is None or self._timer.isActive():
            return  # an edit is due: it will show the replayed rows it has (the next job starts when this ends)
        if any(r is not None for _k, r in results) and any(
                r.result is not None and (r.model, r.setup, shown.gpu) in self._exact for r in shown.rows):
            self._recompute()  # emits the replayed snapshot

    @property
    def replaying(self) -> bool:
        """Whether the allocator replay of shown rows is running or queued."""
        return self._replayer.running or bool(self._pending)

    def shutdown(self) -> None:
        """Stop the replay worker (window closing): the row being replayed finishes, nothing new starts."""
        self._closed = True
        self._pending.clear()
        self._timer.stop()
        self._replay_timer.stop()
        self._replayer.shutdown()
        self.tracer.shutdown()

    def _redisplay(self, rename_only: bool = False) -> None:
        """Level, unit or names changed: no new estimate is needed, only a new snapshot."""
        if self._snapshot is None:
            self._recompute()
            return
        if self._timer.isActive():  # an estimate is due anyway; it will carry the new display settings
            return
        rows = self._snapshot.rows
        if rename_only:
            names = {scenario_key(s.uid): s.name for s in self._scenarios}
            rows = tuple(dataclasses.replace(r, name=names.get(r.key, r.name)) for r in rows)
        self._snapshot = dataclasses.replace(self._snapshot, rows=rows, level=self._level, unit=self._unit,
                                             common_sizes=self._common_sizes)
        self.computed.emit(self._snapshot)


def _replay(items: list[tuple[ModelSpec, TrainingSetup, GpuSpec | None]],
            should_abort: Callable[[], bool] = lambda: False,
            ) -> list[tuple[tuple[ModelSpec, TrainingSetup, GpuSpec | None], MemoryResult | None]]:
    """Worker thread: each row's estimate with its step replayed through the caching-allocator model. A row
    that fails (None) keeps its fast estimate; the failure is logged, never raised. Stops between rows when
    ``should_abort()``."""
    out: list[tuple[tuple[ModelSpec, TrainingSetup, GpuSpec | None], MemoryResult | None]] = []
    for key in items:
        if should_abort():
            break
        spec, setup, gpu = key
        try:
            out.append((key, estimate(spec, setup, gpu, allocator=True)))
        except Exception:
            log.exception("allocator replay failed for %s / %s", spec.id, setup)
            out.append((key, None))
    return out
