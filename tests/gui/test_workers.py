"""Background work in the window: every worker thread, the allocator replay's included, shares one pause of
automatic garbage collection, so overlapping jobs neither switch it back on early nor leave it off."""

from __future__ import annotations

import gc
import threading

import pytest
import shiboken6

from tests.gui.conftest import close_and_delete, make_window
from vramlab.app import state as state_module


def _fake_simulate(release: threading.Event, entered: threading.Event):
    from vramlab.core.estimate import estimate
    from vramlab.core.result import Level

    def simulate(spec, setup, gpu=None, on_phase=None, should_abort=None):
        entered.set()
        release.wait(20)
        import dataclasses

        return dataclasses.replace(estimate(spec, setup, gpu), level=Level.SIMULATE)

    return simulate


@pytest.fixture
def blocked(qtbot, temporary_settings, monkeypatch, no_leaked_qthreads):
    """A window whose simulation and allocator replay each wait for their own event before finishing."""
    sim_release, sim_entered = threading.Event(), threading.Event()
    replay_release, replay_entered = threading.Event(), threading.Event()
    original = state_module._replay

    def slow_replay(items, *args, **kwargs):
        replay_entered.set()
        replay_release.wait(20)
        return original(items, *args, **kwargs)

    monkeypatch.setattr(state_module, "_replay", slow_replay)
    w = make_window(temporary_settings, replay=True)
    w.sims.set_simulate_fn(_fake_simulate(sim_release, sim_entered))
    w.show()
    qtbot.waitExposed(w)
    # the start-up replay of the shown rows: let it through, so each test starts with nothing running
    qtbot.waitUntil(replay_entered.is_set, timeout=10000)
    replay_release.set()
    qtbot.waitUntil(lambda: not w.state.replaying, timeout=60000)
    assert gc.isenabled()
    replay_entered.clear()
    replay_release.clear()
    yield w, (sim_release, sim_entered), (replay_release, replay_entered)
    sim_release.set()
    replay_release.set()
    close_and_delete(w)
    assert gc.isenabled()


def test_a_simulation_ending_while_the_replay_runs_leaves_gc_off_until_both_end(blocked, qtbot):
    w, (sim_release, sim_entered), (replay_release, replay_entered) = blocked
    assert w.phases.simulate()
    qtbot.waitUntil(sim_entered.is_set, timeout=10000)
    w.state.set_field("seq_len", 1536)  # an edit while the simulation runs: the replay starts too
    w.state.flush()
    qtbot.waitUntil(replay_entered.is_set, timeout=10000)
    sim_release.set()
    qtbot.waitUntil(lambda: not w.sims.running, timeout=10000)
    assert not gc.isenabled()  # the replay's thread still runs: no automatic collection may start in it
    replay_release.set()
    qtbot.waitUntil(lambda: not w.state.replaying, timeout=60000)
    assert gc.isenabled()  # and once nothing runs, it is back on


def test_the_replay_ending_while_a_simulation_runs_leaves_gc_off_until_both_end(blocked, qtbot):
    w, (sim_release, sim_entered), (replay_release, replay_entered) = blocked
    w.state.set_field("seq_len", 1536)
    w.state.flush()
    qtbot.waitUntil(replay_entered.is_set, timeout=10000)
    assert w.phases.simulate()
    qtbot.waitUntil(sim_entered.is_set, timeout=10000)
    replay_release.set()
    qtbot.waitUntil(lambda: not w.state.replaying, timeout=60000)
    assert not gc.isenabled()  # the simulation's thread still runs
    sim_release.set()
    qtbot.waitUntil(lambda: not w.sims.running, timeout=10000)
    assert gc.isenabled()


def test_the_replay_runs_on_a_qthread_the_leak_fixture_sees(blocked, qtbot, no_leaked_qthreads):
    w, _sim, (replay_release, replay_entered) = blocked
    w.state.set_field("seq_len", 1536)
    w.state.flush()
    qtbot.waitUntil(replay_entered.is_set, timeout=10000)
    running = [t for t in no_leaked_qthreads if shiboken6.isValid(t) and t.isRunning()]
    assert [t.objectName() for t in running] == ["vramlab-replay"]
    replay_release.set()
    qtbot.waitUntil(lambda: not w.state.replaying, timeout=60000)


# ---- the runner's outcomes -------------------------------------------------------------------------------------

def _run(qtbot, fn, keep_on_abort=False, abort_when=None):
    from vramlab.app.workers import GcPause, Runner

    runner = Runner("vramlab-test")
    seen: list[tuple[str, object]] = []
    runner.finished.connect(lambda v: seen.append(("finished", v)))
    runner.errored.connect(lambda e: seen.append(("errored", e)))
    runner.cancelled.connect(lambda: seen.append(("cancelled", None)))
    with qtbot.waitSignal(runner.ended, timeout=10000):
        assert runner.start(fn, keep_on_abort=keep_on_abort)
        if abort_when is not None:  # abort once the job runs (an abort before it starts skips the job)
            assert abort_when.wait(10)
            runner.abort()
    assert not runner.running and not GcPause.shared().active
    runner.deleteLater()
    return seen


def test_a_job_that_completes_after_cancel_is_cancelled_unless_it_keeps_its_value(qtbot):
    """A Hub lookup or a simulation that returns just as the user cancels is not shown (the old workers said
    'cancelled' there); a profile keeps its own cancelled outcome."""
    started = threading.Event()

    def job(worker):
        started.set()
        while not worker.aborted():
            worker.wait(0.01)
        return "a value computed anyway"

    assert _run(qtbot, job, abort_when=started) == [("cancelled", None)]
    started.clear()
    assert _run(qtbot, job, keep_on_abort=True, abort_when=started) == [("finished", "a value computed anyway")]


def test_a_job_that_exits_ends_errored_and_releases_the_gc_pause(qtbot):
    def job(_worker):
        raise SystemExit(3)  # a library calling sys.exit inside the job

    (kind, exc), = _run(qtbot, job)
    assert kind == "errored" and isinstance(exc, SystemExit)
    assert gc.isenabled()


@pytest.fixture
def unsettled(monkeypatch):  # noqa: ANN001, ANN201
    """A process whose collector has not been settled yet; what a test freezes is unfrozen after it."""
    from vramlab.app import workers

    monkeypatch.setattr(workers, "_settled", False)
    yield workers
    gc.unfreeze()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_settled_once_and_left_on_or_off_as_found(unsettled, enabled):  # noqa: ANN001
    """After start-up the window's idle step freezes what is alive (later collections do not walk it) once per
    process, and leaves the collector on or off (a worker's GcPause) as it found it."""
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        assert unsettled.settle_collector()
        frozen = gc.get_freeze_count()
        assert frozen > 1000 and gc.get_count()[0] < 700  # the start-up's objects, and a young generation emptied
        assert gc.isenabled() is enabled
        assert not unsettled.settle_collector()  # once: a second call freezes nothing more
        assert gc.get_freeze_count() == frozen
    finally:
        (gc.enable if was else gc.disable)()


def test_the_windows_idle_step_prefetches_then_settles(unsettled, monkeypatch):  # noqa: ANN001
    from vramlab.app import main_window

    order = []
    monkeypatch.setattr(main_window, "prefetch_traces", lambda: order.append("prefetch") or 3)
    monkeypatch.setattr(main_window, "settle_collector", lambda: order.append("settle") or True)
    assert main_window.after_start_idle() == 3
    assert order == ["prefetch", "settle"]
