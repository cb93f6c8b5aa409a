"""A first trace in the window (issue 12): it runs on a worker, the row says it is tracing (information, not an
error), the status bar shows its progress and can cancel it, and the estimate appears when it is done, labelled
with its source. The trace itself is a fake that waits for the test (the real one: tests/test_trace.py)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from tests.gui.conftest import close_and_delete, make_window
from vramlab.app import state as state_module
from vramlab.app.state import ModelChoice
from vramlab.core.spec.model import ModelSpec

SPEC = ModelSpec(id="neo", name="Neo-ish", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=4,
                 intermediate_size=1024, vocab_size=1000, tape="traced")


@pytest.fixture
def traced_window(qtbot, temporary_settings, monkeypatch, no_leaked_qthreads):
    done = threading.Event()
    release = threading.Event()
    entered = threading.Event()
    real_estimate = state_module.estimate

    def estimate(spec, setup, gpu=None, **kwargs):
        if spec.tape == "traced":  # what a traced tape answers, labelled as such (the core is tested elsewhere)
            r = real_estimate(dataclasses.replace(spec, tape="auto"), setup, gpu, **kwargs)
            return dataclasses.replace(r, source="traced (transformers test)")
        return real_estimate(spec, setup, gpu, **kwargs)

    def fake_trace(spec, setup, progress=None, should_abort=None):
        entered.set()
        progress("tracing 3 layers at batch 2, sequence 41", 0.5)
        while not release.wait(0.02):
            if should_abort():
                from vramlab.core.simulation.step import Aborted

                raise Aborted()
        done.set()

    monkeypatch.setattr(state_module, "estimate", estimate)
    monkeypatch.setattr(state_module, "cached_tape", lambda spec, setup: object() if done.is_set() else None)
    w = make_window(temporary_settings)
    w.state.tracer.set_trace_fn(fake_trace)
    w.resize(1280, 860)
    w.show()
    qtbot.waitExposed(w)
    w.state.set_field("method", "full")
    w.state.flush()
    yield w, release, entered
    release.set()
    close_and_delete(w)


def test_a_first_trace_runs_in_the_background_and_its_estimate_follows(traced_window, qtbot):
    w, release, entered = traced_window
    w.state.set_model_choice(ModelChoice("neo", SPEC, imported=True))
    snap = w.state.flush()
    assert snap.tracing and snap.current.tracing and "Neo-ish" in snap.error
    assert w.setup_banner.kind() == "info" and w.setup_banner.isVisible()
    assert w.advisor.banner.kind() == "info"  # a running trace is information in every view, not an error
    qtbot.waitUntil(entered.is_set, timeout=10000)
    qtbot.waitUntil(lambda: "batch 2, sequence 41" in w.trace_label.text(), timeout=10000)
    assert w.trace_bar.value() == 50 and w.trace_cancel.isVisible()
    release.set()
    qtbot.waitUntil(lambda: not w.state.tracer.running, timeout=10000)
    qtbot.waitUntil(lambda: w.state.flush().current.result is not None
                    and w.state.flush().current.model == SPEC, timeout=10000)
    snap = w.state.flush()
    assert not snap.error and snap.current.result.source == "traced (transformers test)"
    assert "step: traced (transformers test)" in w.status_level.text()
    assert not w.trace_cancel.isVisible()


def test_a_trace_can_be_cancelled_and_is_not_started_again(traced_window, qtbot):
    w, _release, entered = traced_window
    w.state.set_model_choice(ModelChoice("neo", SPEC, imported=True))
    w.state.flush()
    qtbot.waitUntil(entered.is_set, timeout=10000)
    started = w.state.tracer._runner.jobs_started
    w.trace_cancel.click()
    qtbot.waitUntil(lambda: not w.state.tracer.running, timeout=10000)
    qtbot.waitUntil(lambda: "cancelled" in w.state.flush().error, timeout=10000)
    w.state.flush()
    assert w.state.tracer._runner.jobs_started == started  # the same setup is not traced again by itself
    assert w.setup_banner.kind() == "error"


def test_a_config_that_transformers_must_build_first_is_read_off_the_gui_thread(
        qtbot, temporary_settings, tmp_path, monkeypatch, no_leaked_qthreads):
    """The first import of a traced architecture builds it in transformers (seconds): the window reads it on
    the lookup worker, says so, and takes the model when it is read; a second import is read at once."""
    pytest.importorskip("transformers")
    import json

    from vramlab.app import window_files

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path / "cache"))
    on_worker = []
    real = window_files._read_local_model
    monkeypatch.setattr(window_files, "_read_local_model",
                        lambda *a, **k: (on_worker.append(threading.current_thread() is not threading.main_thread()),
                                         real(*a, **k))[1])
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 500,
                                "max_position_embeddings": 512}))
    w = make_window(temporary_settings)
    try:
        assert w.open_model(str(path)) is None  # not read yet: on its way
        assert w.hub.running
        qtbot.waitUntil(lambda: not w.hub.running, timeout=60000)
        assert on_worker == [True]
        spec = w.state.model.spec
        assert spec.transformers_config and spec.num_layers == 2
        assert w.open_model(str(path)) is not None  # counted before: read at once, on the GUI thread
        assert on_worker == [True]
    finally:
        close_and_delete(w)
