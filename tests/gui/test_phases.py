"""The phases view: phase peaks of the estimate, the peak outlined, and "Simulate" on a worker thread
(finished / errored / cancelled), shown beside the estimate with the tensors alive at the peak."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from tests.gui.helpers import drawn_heights, expected
from vramlab.core.estimate import estimate
from vramlab.core.kinds import Kind, LiveTensor
from vramlab.core.result import Level
from vramlab.core.units import GiB


def fake_simulate(spec, setup, gpu=None, on_phase=None, should_abort=None):
    """Like core.simulation.simulate, without torch: the estimate relabelled, one phase event per phase."""
    base = estimate(spec, setup, gpu)
    for p in base.phases:
        if should_abort is not None and should_abort():
            raise RuntimeError("aborted")
        if on_phase is not None:
            on_phase(p.key, p.bytes)
    weights = base.components[Kind.WEIGHTS]
    alive = (LiveTensor(weights // 2, Kind.WEIGHTS, "embed_tokens.weight", (spec.vocab_size, spec.hidden_size),
                         "bfloat16", "load"),
             LiveTensor(4096, Kind.INPUTS, "input_ids", (1, setup.seq_len), "int64", "forward@2"))
    return dataclasses.replace(base, level=Level.SIMULATE, alive_at_peak=alive, timing={"total": 0.01})


def test_phase_bars_equal_the_core_phase_peaks(window):
    window.tabs.setCurrentWidget(window.phases)
    snap = window.state.flush()
    core = estimate(snap.current.model, snap.current.setup, snap.gpu)
    heights = drawn_heights(window.phases.plot)
    assert len(heights) == len(core.phases) == 7
    for x, phase in enumerate(core.phases):
        assert heights[float(x)] == pytest.approx(expected(phase.components, GiB), rel=1e-12)
    stacks = window.phases.plot.stacks
    peak = [s for s in stacks if s.highlight]
    assert len(peak) == 1 and peak[0].total_bytes == core.peak_allocated_bytes
    assert peak[0].caption.startswith("▲ peak")
    assert [s.tick for s in stacks][:2] == ["Load", "Forward\nstep 1"]


def test_phases_of_a_selected_scenario(window):
    view = window.phases
    full = next(r for r in window.state.flush().rows if r.name == "Full - AMP BF16")
    view.scenario_combo.setCurrentIndex(view.scenario_combo.findData(full.key))
    view.scenario_combo.activated.emit(view.scenario_combo.currentIndex())
    core = estimate(full.model, full.setup, window.state.gpu)
    peak = next(s for s in view.plot.stacks if s.highlight)
    assert peak.title.startswith("Optimizer, step 1") and peak.total_bytes == core.peak_allocated_bytes


def test_simulate_runs_on_a_worker_thread_and_shows_the_result(window, qtbot, no_leaked_qthreads):
    window.sims.set_simulate_fn(fake_simulate)
    main = threading.get_ident()
    seen: list[int] = []

    def spy(spec, setup, gpu=None, on_phase=None, should_abort=None):
        seen.append(threading.get_ident())
        return fake_simulate(spec, setup, gpu, on_phase, should_abort)

    window.sims.set_simulate_fn(spy)
    progress: list[str] = []
    window.sims.progress.connect(lambda key, live: progress.append(key))
    with qtbot.waitSignal(window.sims.succeeded, timeout=10000):
        window.act_simulate.trigger()
        assert window.sims.running and not window.act_simulate.isEnabled()
    qtbot.waitUntil(lambda: not window.sims.running, timeout=5000)
    assert seen and seen[0] != main and len(no_leaked_qthreads) == 1
    assert progress[0] == "load"
    view = window.phases
    assert window.tabs.currentWidget() is view
    assert view.alive.rowCount() == 2 and view.alive.text(0, 2) == "embed_tokens.weight"
    assert any(s.pale for s in view.plot.stacks)  # the simulation beside the estimate
    assert view.residuals.rowCount() > 3
    assert "Simulated peak" in view.summary.text()
    assert window.act_simulate.isEnabled()


def test_simulation_errors_are_reported(window, qtbot):
    def broken(*args, **kwargs):
        raise ValueError("fake tensors disagree")

    window.sims.set_simulate_fn(broken)
    with qtbot.waitSignal(window.sims.failed, timeout=10000) as blocker:
        window.phases.simulate()
    assert "fake tensors disagree" in blocker.args[0]
    qtbot.waitUntil(lambda: not window.sims.running, timeout=5000)
    assert "Simulation failed" in window.message_banner.text()


def test_a_build_without_torch_says_what_to_do(window, qtbot):
    def no_torch(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    window.sims.set_simulate_fn(no_torch)
    with qtbot.waitSignal(window.sims.failed, timeout=10000) as blocker:
        window.phases.simulate()
    qtbot.waitUntil(lambda: not window.sims.running, timeout=5000)
    assert "needs PyTorch" in blocker.args[0] and "ModuleNotFoundError" not in blocker.args[0]


def test_simulation_can_be_cancelled(window, qtbot):
    started = threading.Event()

    def slow(spec, setup, gpu=None, on_phase=None, should_abort=None):
        started.set()
        while not should_abort():
            time.sleep(0.005)
        raise RuntimeError("stopped between phases")

    window.sims.set_simulate_fn(slow)
    window.phases.simulate()
    assert started.wait(5)
    with qtbot.waitSignal(window.sims.cancelled, timeout=5000):
        window.phases.cancel_button.click()
    qtbot.waitUntil(lambda: not window.sims.running, timeout=5000)
    assert window.phases.progress.text() == "Simulation cancelled."


def test_closing_the_window_stops_a_running_simulation(window, qtbot):
    def forever(spec, setup, gpu=None, on_phase=None, should_abort=None):
        while not should_abort():
            time.sleep(0.005)
        raise RuntimeError("stopped")

    window.sims.set_simulate_fn(forever)
    window.phases.simulate()
    assert window.sims.running
    window.close()  # must abort and join the thread (the fixture fails the test otherwise)


def test_real_simulation_of_a_small_model(window, qtbot):
    """The real core.simulation.simulate (torch, fake tensors) through the same worker."""
    window.state.set_model("smollm2-135m")
    window.state.flush()
    with qtbot.waitSignal(window.sims.succeeded, timeout=60000) as blocker:
        assert window.phases.simulate()
    qtbot.waitUntil(lambda: not window.sims.running, timeout=10000)
    result = blocker.args[0]
    assert result.level is Level.SIMULATE and result.alive_at_peak
    est = window.state.flush().current.result
    assert abs(result.peak_allocated_bytes - est.peak_allocated_bytes) < 0.25 * est.peak_allocated_bytes
    assert window.phases.alive.rowCount() == len(result.alive_at_peak)
    # one total above each pair of bars (the estimate's), none crowding it from the simulation's bar beside it,
    # unless the simulation peaks in another phase; the legend says what the translucent bars are
    plot = window.phases.plot
    pairs = len({p.key for p in est.phases} | {p.key for p in result.phases})
    extra = 0 if result.peak_phase == est.peak_phase else 1
    assert len(plot.total_labels()) == pairs + extra
    assert any(e.key == "simulation" for e in window.phases.legend.entries())


def test_garbage_collection_stays_on_the_gui_thread_while_simulating(window, qtbot):
    import gc

    assert gc.isenabled()
    seen: list[bool] = []

    def probe(spec, setup, gpu=None, on_phase=None, should_abort=None):
        seen.append(gc.isenabled())
        return fake_simulate(spec, setup, gpu, on_phase, should_abort)

    window.sims.set_simulate_fn(probe)
    with qtbot.waitSignal(window.sims.runningChanged, timeout=10000, check_params_cb=lambda running: not running):
        window.phases.simulate()
    assert seen == [False]  # no automatic collection could start inside the worker thread
    assert gc.isenabled()
