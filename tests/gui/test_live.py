"""The Live profile tab: a real CPU profile of a tiny model through the window (child process, sampler thread,
plots, phase bands, predicted vs measured), cancel, each fault of the child (out of memory, crash, hang past
the timeout), NVML faults from the fake sampler (no driver, GPU lost mid-run, field not supported, another
process allocating), saving and exporting, calibration after a GPU run, and closing the window mid-run.

Every test that runs a profile leaves no QThread and no child process behind (tests/gui/conftest.py)."""

from __future__ import annotations

import csv
import io
import json
import os
import threading
import time

import numpy as np
import psutil
import pytest
import shiboken6

from vramlab.app.profiling import LiveSampler, ProfileController, probe_sampler
from vramlab.app.state import ModelChoice
from vramlab.app.workers import GcPause
from vramlab.core.estimate import estimate
from vramlab.core.live import (
    KINDS,
    LEVELS,
    MEASURED_ONLY,
    PHASES,
    RunRequest,
)
from vramlab.core.monitor import FakeSampler, Scenario
from vramlab.core.monitor.fake import OTHER_PID, RTX_4090_MEMORY_BYTES
from vramlab.core.monitor.watch import RunWatch
from vramlab.core.profiling.child import MEM_INTERVAL_S
from vramlab.core.profiling.outcomes import ProfileOutcome
from vramlab.core.result import Level, MemLevel, Overhead
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import MiB, Unit

TINY = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=300)
SETUP = TrainingSetup(method="lora", seq_len=64)
RUN_TIMEOUT_MS = 120_000  # a CPU run of TINY takes ~3 s alone; the CI machine is shared


def children() -> list[psutil.Process]:
    return [p for p in psutil.Process(os.getpid()).children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def live(window):
    """The window on the Live tab with the tiny model, a healthy fake GPU sampler, and CPU selected."""
    window.state.set_model_choice(ModelChoice("tiny", TINY))
    window.state.set_setup(SETUP)
    window.state.flush()
    fake = FakeSampler()
    window.live_ctl.set_sampler_factory(lambda: fake)
    window.tabs.setCurrentWidget(window.live)
    window.live.refresh_devices()
    assert window.live.set_device("cpu")
    window.fake = fake
    return window


def run(qtbot, window, **kwargs) -> ProfileOutcome:
    with qtbot.waitSignal(window.live_ctl.finished, timeout=RUN_TIMEOUT_MS) as blocker:
        assert window.live.start(**kwargs)
        assert window.live_ctl.running and not window.act_profile.isEnabled()
    qtbot.waitUntil(lambda: not window.live_ctl.running, timeout=5000)
    return blocker.args[0]


# ---- end to end ------------------------------------------------------------------------------------------------

def test_cpu_profile_end_to_end(live, qtbot, no_leaked_qthreads, tmp_path):
    view = live.live
    fake = live.fake
    # the fake GPU follows the run: its process is the child, its allocation the last phase boundary
    live.live_ctl.childStarted.connect(lambda started: setattr(fake, "pid", started.pid))
    fake.set_allocation_source(lambda _i: view.marks[-1].allocated_bytes * 100 if view.marks else 0)
    main = threading.get_ident()
    outcome = run(qtbot, live)

    assert outcome.ok and outcome.kind == "ok" and outcome.device == "cpu"
    assert len(no_leaked_qthreads) == 2  # the profile worker's and the sampler's (both deleted by now)
    assert not children()
    assert threading.get_ident() == main

    # curves got data: the fake GPU, this run's NVML share, the child's RSS, the phase boundaries
    for key in ("device_used", "process_used", "rss", "allocated", "allocated_live", "measured_peak",
                "predicted_peak", "util", "cpu", "power"):
        x, y = view.plots.curve_data(key)
        assert len(x) and np.any(np.isfinite(y)), key
    assert len(view.buffer) >= 10  # 20 Hz over a few seconds
    x, _y = view.plots.curve_data("reserved")
    assert not len(x)  # no caching allocator on the CPU
    assert not len(view.plots.curve_data("reserved_live")[0])
    # the tensor level between boundaries: the child's own 10 Hz readings, never above the run's peak
    x, y = view.plots.curve_data("allocated_live")
    # as many as the run lasted: every 0.1 s from the first boundary to the end, within half (a reading's own
    # time and the GIL stretch the interval; a run can be shorter than half a second, so no fixed count)
    span = view.marks[-1].t_s - view.marks[0].t_s
    assert len(x) == len(view.memory) >= max(1, int(0.5 * span / MEM_INTERVAL_S)) and np.all(np.diff(x) >= 0)
    assert max(r.allocated_bytes for r in view.memory) <= outcome.result.peak_allocated_bytes
    x, y = view.plots.curve_data("allocated")
    assert len(x) == len(view.marks) and view.marks[-1].key == "end"
    assert y[-1] == pytest.approx(view.marks[-1].allocated_bytes / view.plots.unit.factor)
    assert view.plots.unit is Unit.MIB  # everything is below 1 GiB: the axis says MiB
    assert "MiB" in view.plots.memory.getAxis("left").labelText
    # the run is over: the axes fit it (no headroom kept for growth), and every band label is on screen
    (x0, x1), (y0, y1) = view.plots.memory.vb.viewRange()
    highest = max(np.nanmax(view.plots.curve_data(k)[1]) for k in ("device_used", "process_used", "rss"))
    assert highest <= y1 <= highest * 1.2 and x1 >= view.marks[-1].t_s
    labels = [text for region, text in view.plots.bands_group if region.isVisible() and text.isVisible()]
    assert labels and all(y0 <= text.pos().y() <= y1 for text in labels)

    # phase bands with their names, in order, covering the run
    labels = [label for label, _ in view.plots.visible_bands()]
    assert labels[:5] == ["start-up", "load", "fwd 1", "bwd 1", "opt 1"] and labels[-1] == "opt 2"
    regions = [r for _, r in view.plots.visible_bands()]
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(regions, regions[1:]))

    # predicted vs measured: the numbers are the core's; the CPU run agrees with the estimate in simulation mode
    predicted = estimate(TINY, SETUP, None, match_simulation=True)
    assert view.request.predicted.peak_allocated_bytes == predicted.peak_allocated_bytes
    rows = {(r.section, r.label): r for r in view.rows}
    tensors = rows[(LEVELS, "Tensor peak (max_memory_allocated)")]
    assert tensors.measured_bytes == outcome.result.peak_allocated_bytes
    assert tensors.predicted_bytes == predicted.peak_allocated_bytes
    assert abs(tensors.residual_fraction) <= 0.01, tensors
    for phase in predicted.phases:
        row = next(r for r in view.rows if r.section == PHASES and r.predicted_bytes == phase.bytes)
        assert abs(row.residual_fraction) <= 0.01, row
    kinds = [r for r in view.rows if r.section == KINDS]
    assert kinds and sum(r.measured_bytes for r in kinds) == outcome.result.peak_allocated_bytes
    assert rows[(LEVELS, "Allocator reserved (max_memory_reserved)")].measured_bytes is None
    assert rows[(MEASURED_ONLY, "Process RSS peak (host memory)")].measured_bytes > 50 * MiB
    # the table shows them, each number with its level and unit in the header
    headers = [view.table.header(i) for i in range(view.table.columnCount())]
    assert headers[1:5] == ["Predicted [MiB]", "Measured [MiB]", "Residual [MiB]", "Residual [%]"]
    texts = [view.table.text(i, 0) for i in range(view.table.rowCount())]
    assert "Tensor peak (max_memory_allocated)" in texts and KINDS in texts
    title = texts.index(KINDS)  # a section's title: bold, across the table
    assert view.table.cell(title, 0).bold and view.table.columnSpan(title, 0) == view.table.columnCount()
    assert view.verdict_label.property("state") == "fits"
    assert view.verdict_text().startswith("✔ The estimate agrees with the measured tensor peak")
    assert view.progress.value() == view.progress.maximum() == 7  # load + (forward, backward, optimizer) x 2
    assert "done" in view.progress.format()
    assert not view.calibrate_button.isVisible()  # CPU: nothing to calibrate

    # save (with the environment fingerprint) and export
    saved = tmp_path / "run.json"
    assert view.save_result(str(saved))
    doc = json.loads(saved.read_text())
    assert doc["format"] == "vramlab-profile/1" and doc["outcome"]["kind"] == "ok"
    env = doc["environment"]
    assert {"gpu", "driver", "cuda_runtime", "torch", "bitsandbytes", "python", "platform"} <= set(env)
    assert env["torch"].startswith("2.") and env["device"] == "cpu"
    assert doc["comparison"][0]["measured_bytes"] == outcome.result.peak_allocated_bytes
    assert len(doc["series"]["t_s"]) == len(view.buffer) and doc["phase_marks"][-1]["key"] == "end"
    assert TrainingSetup.from_dict(doc["setup"]) == view.request.setup
    assert view.request.setup.resolved() == SETUP.resolved()
    table = tmp_path / "run.csv"
    assert view.export_csv(str(table))
    rows_csv = list(csv.DictReader(io.StringIO(table.read_text())))
    assert rows_csv[0]["measured_bytes"] == str(outcome.result.peak_allocated_bytes)
    png = tmp_path / "run.png"
    assert view.export_png(str(png)) and png.stat().st_size > 10_000

    # the unit follows the app's
    live.state.set_unit("GB")
    live.state.flush()
    assert view.table.header(2) == "Measured [GB]"  # no MiB for decimal units
    # and so do the verdict, the facts and the plot's axis
    assert "MiB" not in view.verdict_text() and "GB" in view.verdict_text()
    assert "MiB" not in view.facts.text()
    assert "MiB" not in view.plots.memory.getAxis("left").labelText


def test_cancel_mid_run_ends_the_child(live, qtbot):
    pids: list[int] = []
    live.live_ctl.childStarted.connect(lambda started: pids.append(started.pid))
    with qtbot.waitSignal(live.live_ctl.finished, timeout=RUN_TIMEOUT_MS) as blocker:
        assert live.live.start(fault="slow")
        qtbot.waitUntil(lambda: bool(pids) and psutil.pid_exists(pids[0]), timeout=10000)
        assert children()
        live.act_cancel_profile.trigger()
    outcome = blocker.args[0]
    assert outcome.kind == "cancelled"
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE
    assert not children()
    assert live.live.verdict_text() == "Cancelled: the profiling process was ended."
    assert live.act_profile.isEnabled() and not live.act_cancel_profile.isEnabled()


@pytest.mark.parametrize(("fault", "kind", "text"), [
    ("oom", "oom", "Out of memory in backward, step 1"),
    ("crash", "crashed", "The profiling process ended unexpectedly in backward, step 1 (the run ended with exit "
                         "code 139"),
    ("hang", "timeout", "No result after 6 s"),
])
def test_each_fault_is_a_clear_result_and_the_window_keeps_working(live, qtbot, fault, kind, text):
    if fault == "hang":
        live.live.timeout_spin.setValue(0.1)  # 6 s
    outcome = run(qtbot, live, fault=fault)
    assert outcome.kind == kind
    view = live.live
    assert view.verdict_text().startswith("✘ " + text), view.verdict_text()
    assert view.verdict_label.property("state") == "nofit"
    assert f"· {kind}" in view.progress.format()
    assert not children()
    # the window keeps working: edits recompute, a new run can start, the failure is in the status bar
    live.state.set_field("seq_len", 32)
    assert live.state.flush().current.setup.seq_len == 32
    assert view.start_button.isEnabled() and live.act_profile.isEnabled()
    assert text.split(" (")[0] in live.statusBar().currentMessage()


# ---- NVML faults (fake sampler) ------------------------------------------------------------------------------------

def test_no_nvidia_driver_says_so_and_runs_on_the_cpu(window, qtbot):
    window.live_ctl.set_sampler_factory(lambda: FakeSampler(scenario=Scenario.NO_DRIVER))
    window.state.set_model_choice(ModelChoice("tiny", TINY))
    window.state.flush()
    view = window.live
    view.refresh_devices()
    assert view.device() == "cpu" and not view.set_device("cuda")
    assert not view.notice.isHidden() and view.notice.text().startswith(
        "No NVIDIA GPU found: no NVIDIA driver found (libnvidia-ml.so not loadable)")
    # the Advisor's entry point: load a setup into the editor, switch to the tab, start
    wanted = TrainingSetup(method="lora", seq_len=48)
    with qtbot.waitSignal(window.live_ctl.finished, timeout=RUN_TIMEOUT_MS) as blocker:
        assert window.run_profile(wanted)
        assert window.tabs.currentWidget() is view
        assert window.state.current_setup().resolved() == wanted.resolved()
        assert view.request.setup == window.state.current_setup()
        assert "on the CPU" in view.summary.text()
    outcome = blocker.args[0]
    assert outcome.ok and outcome.device == "cpu"
    assert not len(view.plots.curve_data("device_used")[0])  # no GPU readings at all
    assert len(view.plots.curve_data("rss")[0])


def test_gpu_lost_mid_run_is_reported_and_the_run_still_ends(live, qtbot):
    fake = FakeSampler(scenario=Scenario.GPU_LOST_MID_RUN, lost_after_samples=5)
    live.live_ctl.set_sampler_factory(lambda: fake)
    live.live.refresh_devices()
    live.live.set_device("cpu")
    outcome = run(qtbot, live)
    view = live.live
    assert outcome.ok
    assert view.lost_at_s is not None and view.lost_at_s < 2.0
    assert view.notice.kind() == "warning" and "NVML lost the GPU" in view.notice.text()
    assert "NVML lost the GPU at" in view.verdict_text()
    t, used = view.buffer.column("t_s"), view.buffer.column("device_used_bytes")
    assert np.all(np.isfinite(used[t < view.lost_at_s])) and np.all(np.isnan(used[t >= view.lost_at_s]))
    assert "GPU readings lost" in view.readout.text()


def test_sampler_reads_unsupported_fields_and_other_processes():
    fake = FakeSampler(scenario=[Scenario.FIELD_NOT_SUPPORTED, Scenario.OTHER_PROCESS_ALLOCATING])
    probe = probe_sampler(fake)
    assert probe.available and probe.name == "NVIDIA GeForce RTX 4090" and probe.nvml_index == 0
    worker = LiveSampler(RunWatch(fake), time.monotonic())
    worker.set_pid(fake.pid)
    fake.set_allocated(1024 * MiB)
    s = worker.read()
    assert s.power_w is None and "power_mw" in s.missing  # one unsupported field never loses the sample
    assert s.device_total_bytes == RTX_4090_MEMORY_BYTES
    assert s.process_used_bytes == fake.context_bytes + 1024 * MiB
    assert s.device_used_bytes > s.process_used_bytes  # another process (pid OTHER_PID) is allocating
    assert OTHER_PID != fake.pid
    assert s.rss_bytes and s.rss_bytes > 0  # psutil: this process stands in for the child


def test_sampler_searches_the_process_tree_once_per_interval_and_after_a_process_ends(monkeypatch):
    """Finding a process's descendants reads every process of the machine: the sampler does it once per
    TREE_RESCAN_S, and again at the next reading after a process of the tree ended."""
    import subprocess
    import sys

    searches: list[int] = []
    children_of = psutil.Process.children
    monkeypatch.setattr(psutil.Process, "children",
                        lambda self, recursive=False: searches.append(1) or children_of(self, recursive=recursive))
    sampler = LiveSampler(None, time.monotonic())
    sampler.set_pid(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(6):
            assert sampler.read().rss_bytes
        assert len(searches) == 1
        assert child.pid in [p.pid for p in sampler._tree()]  # noqa: SLF001
        child.kill()
        child.wait()
        sampler.read()  # the child's reading fails and is skipped
        sampler.read()  # so this one searches again
        assert len(searches) == 2
        assert child.pid not in [p.pid for p in sampler._tree()]  # noqa: SLF001
    finally:
        child.kill()
        child.wait()


def test_an_uncertain_cuda_order_is_said(live, monkeypatch):
    """Mixed GPUs under CUDA's default fastest-first order: NVML cannot know which is cuda:0, and the tab says
    so instead of silently naming the first by PCI order."""
    from vramlab.core.monitor import fake_gpu

    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mixed = FakeSampler([fake_gpu(0), fake_gpu(1, name="NVIDIA A100-SXM4-80GB")])
    live.live_ctl.set_sampler_factory(lambda: mixed)
    probe = live.live.refresh_devices()
    assert probe.available and not probe.order_certain
    assert live.live.notice.kind() == "warning" and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in live.live.notice.text()
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert live.live.refresh_devices().order_certain
    assert "CUDA_DEVICE_ORDER" not in live.live.notice.text()


# ---- the result panel without a run ----------------------------------------------------------------------------------

def cuda_outcome(spec: ModelSpec, setup: TrainingSetup, gpu) -> ProfileOutcome:
    """What a GPU run reports, built from the estimate (a machine without a GPU cannot make one)."""
    est = estimate(spec, setup, gpu)
    result = type(est)(level=Level.PROFILE, model=spec, setup=setup,
                       peak_allocated_bytes=int(est.peak_allocated_bytes * 1.01),
                       peak_reserved_bytes=est.peak_reserved_bytes, device_used_bytes=est.device_used_bytes,
                       components={}, peak_phase=est.peak_phase, phases=est.phases, total_params=est.total_params,
                       trainable_params=est.trainable_params,
                       overheads=(Overhead("CUDA context (measured)", 500 * MiB, MemLevel.DEVICE, ""),))
    return ProfileOutcome(True, "ok", "", "cuda", result=result,
                          info={"gpu": "NVIDIA GeForce RTX 4090", "torch": "2.5.1", "cuda": "12.4",
                                "device_total_bytes": RTX_4090_MEMORY_BYTES},
                          device_used_peak_bytes=est.device_used_bytes + 300 * MiB,
                          process_used_peak_bytes=est.device_used_bytes, context_bytes=500 * MiB,
                          step_time_s=0.5, tokens_per_s=1024.0)


def test_gpu_result_levels_verdict_and_calibration(live, tmp_path, monkeypatch, qtbot):
    monkeypatch.setenv("VRAMLAB_CONFIG_DIR", str(tmp_path))
    from vramlab.core.live_plan import gpu_spec_for

    gpu = gpu_spec_for(probe_sampler(live.fake))
    spec = live.state.model.spec
    outcome = cuda_outcome(spec, SETUP, gpu)
    predicted = estimate(spec, SETUP, gpu)
    view = live.live
    view.show_outcome(outcome, RunRequest(spec, SETUP, "cuda", gpu, predicted))
    rows = {r.label: r for r in view.rows}
    assert rows["Allocator reserved (max_memory_reserved)"].residual_bytes == 0
    assert rows["Device used (nvidia-smi)"].measured_bytes == predicted.device_used_bytes
    assert rows["CUDA context"].measured_bytes == 500 * MiB and rows["CUDA context"].predicted_bytes
    whole = rows["Whole GPU at its peak (device level, all processes)"]
    assert whole.measured_bytes == predicted.device_used_bytes + 300 * MiB
    kinds = [r for r in view.rows if r.section == KINDS]
    assert kinds and all(r.measured_bytes is None and "Split by kind" in r.note for r in kinds)
    assert view.verdict_text().startswith("✔ Fits NVIDIA GeForce RTX 4090")
    assert "(+1.0 % of measured)" in view.verdict_text()
    assert "Measured CUDA context" in view.facts.text()
    assert not view.calibrate_button.isHidden()
    assert view.calibrate_button.text() == "Save calibration for NVIDIA GeForce RTX 4090"
    view.calibrate_button.click()  # the allocator replay it needs runs on a worker thread
    qtbot.waitUntil(lambda: "Saved calibrated" in view.notice.text(), timeout=30000)
    data = json.loads((tmp_path / "calibration.json").read_text())
    (cal,) = data.values()
    assert cal["gpu_name"] == "NVIDIA GeForce RTX 4090" and cal["context_bytes"] == 500 * MiB
    assert "Saved calibrated on NVIDIA GeForce RTX 4090" in view.notice.text()


def test_a_gpu_run_draws_every_device_curve(live, qtbot):
    """The GPU path end to end without a GPU: the fake NVML (another process allocating too) and a stand-in
    for the child that reports CUDA readings, so every device-level curve, line and text is exercised."""
    fake = FakeSampler(scenario=Scenario.OTHER_PROCESS_ALLOCATING, ramp_bytes_per_sample=MiB)
    live.live_ctl.set_sampler_factory(lambda: fake)
    view = live.live
    view.refresh_devices()
    assert view.set_device("cuda") and view.tracked_check.isEnabled()
    fake.set_allocation_source(lambda _i: view.marks[-1].reserved_bytes if view.marks else 0)
    calls = []

    def stand_in(spec, setup, device, gpu=None, on_event=None, should_abort=None, sampler=None, **kwargs):
        calls.append((device, sampler, kwargs["tracked"], type(kwargs.get("watch")).__name__))
        on_event({"event": "started", "pid": os.getpid()})
        previous = None
        for i, key in enumerate(("load", "forward@1", "backward@1", "optimizer@1", "forward@2", "backward@2",
                                 "optimizer@2", "end")):
            ended = {"ended": previous, "ended_peak_allocated": (i + 1) * MiB,
                     "ended_peak_reserved": (i + 2) * MiB} if previous else {}
            on_event({"event": "phase", "key": key, "allocated": i * MiB, "reserved": (i + 1) * MiB, **ended})
            previous = key
            deadline = time.monotonic() + 0.15
            while time.monotonic() < deadline:
                should_abort()
                time.sleep(0.02)
        return cuda_outcome(spec, setup, gpu)

    live.live_ctl.set_profile_fn(stand_in)
    outcome = run(qtbot, live)
    # the GPU sampler and the run's one NVML watch (driven by the sampler thread) are handed to the core
    assert calls == [("cuda", fake, False, "RunWatch")]
    assert outcome.ok and outcome.device == "cuda"
    for key in ("device_used", "process_used", "allocated", "reserved", "measured_peak", "predicted_peak", "util",
                "power"):
        assert len(view.plots.curve_data(key)[0]), key
    assert view.plots.lines["predicted_device"].isVisible()
    assert "Predicted device used (estimate)" in view.plots.lines["predicted_device"].label.format
    assert not view.plots.lines["capacity"].isVisible()  # 24 GiB would flatten a run of a few hundred MiB
    assert "others" in view.readout.text() and "W" in view.readout.text()
    assert view.verdict_text().startswith("✔ Fits NVIDIA GeForce RTX 4090")
    assert not view.calibrate_button.isHidden()
    assert view.plots.activity.getAxis("right").labelText == "Power [W]"


def test_an_oversized_cpu_run_is_refused_before_it_starts(window, qtbot):
    window.live_ctl.set_sampler_factory(lambda: FakeSampler(scenario=Scenario.NO_DRIVER))
    window.state.set_model("llama-3.1-405b")
    window.state.flush()
    assert not window.run_profile()
    assert not window.live_ctl.running
    assert window.live.notice.text().startswith("Not started: a CPU profile of this setup allocates about")


# ---- threads and shutdown --------------------------------------------------------------------------------------------

def test_closing_the_window_mid_run_ends_threads_and_child(live, qtbot, no_leaked_qthreads):
    pids: list[int] = []
    live.live_ctl.childStarted.connect(lambda started: pids.append(started.pid))
    assert live.live.start(fault="hang")
    qtbot.waitUntil(lambda: bool(pids), timeout=10000)
    live.close()
    assert not live.live_ctl.running
    assert len(no_leaked_qthreads) == 2
    assert all(not shiboken6.isValid(t) or not t.isRunning() for t in no_leaked_qthreads)
    assert not children()
    assert not GcPause.shared().active


def test_a_failure_inside_the_worker_becomes_an_error_outcome(qtbot):
    def broken(*_a, **_k):
        raise RuntimeError("no child for you")

    ctl = ProfileController(profile_fn=broken, sampler_factory=lambda: FakeSampler(scenario=Scenario.NO_DRIVER))
    request = RunRequest(TINY, SETUP, "cpu", None, None)
    with qtbot.waitSignal(ctl.finished, timeout=10000) as blocker:
        assert ctl.start(request)
        assert not ctl.start(request)  # one run at a time
    outcome = blocker.args[0]
    assert outcome.kind == "error" and outcome.message == "RuntimeError: no child for you"
    assert not ctl.running and not GcPause.shared().active
    assert ctl.shutdown()
    ctl.deleteLater()


# ---- several GPUs ------------------------------------------------------------------------------------------------

def test_a_sharded_run_under_torchrun_draws_rank_0_and_names_every_rank(live, qtbot):
    """FSDP over two ranks on the CPU (gloo): every rank reports its phases; rank 0's drive the bands and the
    progress, the others are kept apart, the whole process tree is sampled, and the result names each rank."""
    view = live.live
    setup = SETUP.replace(gpus=2, sharding="fsdp")
    live.state.set_setup(setup)
    live.state.flush()
    outcome = run(qtbot, live)
    assert outcome.ok, outcome.message
    assert len(outcome.ranks) == 2
    assert all(m.leads for m in view.marks) and view.rank_marks and all(m.rank == 1 for m in view.rank_marks)
    keys = [m.key for m in view.marks]
    assert keys[0] == "load" and keys[-1] == "end" and keys.count("end") == 1
    assert keys == [m.key for m in view.rank_marks]  # the same phases, in the same order, on rank 1
    labels = [label for label, _ in view.plots.visible_bands()]
    assert labels[:5] == ["start-up", "load", "fwd 1", "bwd 1", "opt 1"] and labels[-1] == "opt 2"
    assert view.progress.value() == view.progress.maximum() == 7
    # torchrun's ranks are children of the launcher: the host curve is the whole tree's, three processes that
    # each import torch (well over 150 MiB resident apiece; the launcher alone would be one of them)
    assert view.buffer.max("rss_bytes") > 3 * 150 * MiB
    facts = view.facts.text()
    assert "2 ranks under torchrun" in facts and "rank 0" in facts and "rank 1" in facts
    assert not children()


def test_an_emulated_sharded_run_says_why():
    from vramlab.core.live import rank_lines

    plain = ProfileOutcome(True, "ok", "", "cpu")
    assert rank_lines(plain, Unit.GIB) == []
    emulated = ProfileOutcome(True, "ok", "", "cpu", info={"emulated_rank0": "ZeRO-2 is not profiled for real"})
    (line,) = rank_lines(emulated, Unit.GIB)
    assert "rank 0 emulated in one process" in line and "ZeRO-2" in line


def test_frames_follow_what_moves_and_every_reading_is_drawn(live, qtbot):
    """The 20 Hz tick draws a frame only when a memory curve moves a pixel (or a phase boundary arrives);
    otherwise once per calm interval. Readings are never dropped: each frame draws every reading so far."""
    from vramlab.core.live import CALM_FRAME_S, LiveSample, PhaseMark

    view = live.live
    view._reset_run()  # noqa: SLF001 - the view fed by hand, as the controller's signals would
    t0 = time.monotonic()

    def feed(n: int, rss: int) -> None:
        for _ in range(n):
            view._on_sample(LiveSample(time.monotonic() - t0, rss_bytes=rss, cpu_pct=50.0))  # noqa: SLF001
            view._tick()  # noqa: SLF001

    feed(30, 100 * MiB)
    assert view.frame_reasons == {"event": 1, "peak": 0, "calm": 0}  # the first frame only: nothing moved
    assert len(view.plots.curve_data("rss")[0]) == 1
    feed(1, 150 * MiB)  # memory moved: drawn at this tick, with every reading so far
    assert view.frame_reasons["peak"] == 1
    assert len(view.plots.curve_data("rss")[0]) == 31 == view.buffer.appended
    feed(5, 150 * MiB)
    assert view.frame_reasons["peak"] == 1 and len(view.plots.curve_data("rss")[0]) == 31
    qtbot.wait(int(CALM_FRAME_S * 1000) + 50)
    feed(1, 150 * MiB)  # nothing moved, but the calm interval passed: the curve catches up
    assert view.frame_reasons["calm"] == 1 and len(view.plots.curve_data("rss")[0]) == 37
    view._on_phase(PhaseMark(time.monotonic() - t0, "load", 0, 0))  # noqa: SLF001
    view._tick()  # noqa: SLF001
    assert view.frame_reasons["event"] == 2 and [b[0] for b in view.plots.visible_bands()] == ["load"]
