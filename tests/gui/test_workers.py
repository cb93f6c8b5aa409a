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
