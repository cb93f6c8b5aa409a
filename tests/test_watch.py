"""The one NVML watcher of a profile run (core/monitor/watch.py) and the CUDA ordinal -> NVML device mapping,
against the fake NVML: the run's GPUs only, CUDA_DEVICE_ORDER, the run's own UUID, failed readings, and the
end-of-run context protocol (the child waits while the parent reads NVML)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from vramlab.core.monitor import FakeSampler, Scenario, fake_gpu
from vramlab.core.monitor.detect import cuda_device, cuda_devices, same_uuid
from vramlab.core.monitor.watch import RunWatch
from vramlab.core.units import MiB

A100 = "NVIDIA A100-SXM4-80GB"


def mixed() -> FakeSampler:
    """A 4090 at PCI slot 0 and an A100 at slot 1: CUDA's default order (fastest first) is not NVML's."""
    return FakeSampler([fake_gpu(0), fake_gpu(1, name=A100, memory_total_bytes=81920 * MiB,
                                               compute_capability=(8, 0))], pid=os.getpid())


# ---- the mapping ---------------------------------------------------------------------------------------------

def test_pci_bus_order_is_nvml_order():
    visible, certain = cuda_devices(mixed(), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert certain and [(d.index, d.nvml_index) for d in visible] == [(0, 0), (1, 1)]
    assert cuda_device(mixed(), 0, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}).name == A100


def test_fastest_first_on_mixed_gpus_is_uncertain_but_not_with_one_model_or_uuids():
    assert not cuda_devices(mixed(), {})[1]
    assert cuda_devices(FakeSampler([fake_gpu(0), fake_gpu(1)]), {})[1]  # equal GPUs keep PCI order
    uuid = fake_gpu(1).uuid
    visible, certain = cuda_devices(mixed(), {"CUDA_VISIBLE_DEVICES": uuid})
    assert certain and [d.nvml_index for d in visible] == [1]


def test_uuid_forms_match():
    assert same_uuid("GPU-f4e5a000-0000-4000-8000-000000000001", "f4e5a000-0000-4000-8000-000000000001")
    assert not same_uuid("GPU-f4e5a000-0000-4000-8000-000000000001", "f4e5a000-0000-4000-8000-000000000000")
    assert not same_uuid("", "")


def test_uncertain_order_waits_for_the_runs_own_uuid():
    fake = mixed()
    fake.set_allocated(1000 * MiB, index=1)
    watch = RunWatch(fake, environ={})
    assert watch.available() and watch.nvml_index(0) is None and watch.read() is None  # not guessed
    watch.set_uuid(0, fake_gpu(1).uuid.removeprefix("GPU-"))  # what torch.cuda.get_device_properties says
    watch.watch(0, fake.pid)
    assert watch.nvml_index(0) == 1
    watch.read()
    assert watch.stop()[0]["process_used_peak_bytes"] == fake.context_bytes + 1000 * MiB


# ---- the readings --------------------------------------------------------------------------------------------

def test_device_peak_covers_the_runs_gpus_only():
    """Two ranks on cuda:0 and cuda:1; someone else's job grows on GPU 2 and enters no rank's device peak."""
    fake = FakeSampler([fake_gpu(0), fake_gpu(1), fake_gpu(2)], Scenario.OTHER_PROCESS_ALLOCATING, fault_index=2,
                       pid=os.getpid())
    fake.set_allocated(100 * MiB, index=0)
    fake.set_allocated(300 * MiB, index=1)
    watch = RunWatch(fake, cuda_indices=(0, 1), environ={})
    watch.watch(0, fake.pid)
    watch.watch(1, fake.pid)
    for _ in range(5):
        watch.read()
    out = watch.stop()
    other = fake.sample([2]).get(2).memory_used_bytes
    assert out[0]["device_used_peak_bytes"] == fake.sample([0]).get(0).memory_used_bytes
    assert out[1]["device_used_peak_bytes"] == fake.sample([1]).get(1).memory_used_bytes
    assert max(out[r]["device_used_peak_bytes"] for r in (0, 1)) < other


class Flaky(FakeSampler):
    """A sampler that raises on every other reading (a driver surprise the protocol does not foresee)."""

    def sample(self, indices=None):  # noqa: ANN001, ANN201
        if self.samples_taken % 2 == 0:
            self._samples_taken += 1
            raise RuntimeError("NVML went away for a moment")
        return super().sample(indices)


def test_a_failed_reading_does_not_end_the_watch():
    fake = Flaky(pid=os.getpid())
    watch = RunWatch(fake, interval_s=0.005, environ={})
    watch.watch(0, fake.pid)
    assert watch.start()
    fake.set_allocated(10 * MiB)
    time.sleep(0.05)
    fake.set_allocated(900 * MiB)
    deadline = time.monotonic() + 5
    while watch.process_peak.get(0, 0) < fake.context_bytes + 900 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    out = watch.stop()
    assert out[0]["process_used_peak_bytes"] == fake.context_bytes + 900 * MiB  # read after many failures
    assert watch.errors >= 2 and "NVML went away" in watch.last_error


def test_settle_reads_the_context_as_nvml_less_reserved():
    fake = FakeSampler(context_bytes=480 * MiB, pid=os.getpid())
    fake.set_allocated(2048 * MiB)  # what the allocator holds: NVML sees it inside the process
    watch = RunWatch(fake, environ={})
    watch.watch(0, fake.pid)
    assert watch.settle(0, reserved_bytes=2048 * MiB) == 480 * MiB
    assert watch.stop()[0]["context_bytes"] == 480 * MiB


def test_no_driver_watches_nothing():
    watch = RunWatch(FakeSampler(scenario=Scenario.NO_DRIVER), environ={})
    assert not watch.available() and not watch.start()
    watch.watch(0, 1)
    assert watch.settle(0, 0) is None and watch.stop() == {0: {"device_used_peak_bytes": None,
                                                              "process_used_peak_bytes": None,
                                                              "device_delta_peak_bytes": None,
                                                              "context_bytes": None, "context_source": None}}


# ---- the protocol with a child -------------------------------------------------------------------------------

FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, threading
    req = json.loads(sys.stdin.readline())
    def out(obj):
        sys.stdout.write(json.dumps(obj) + "\\n"); sys.stdout.flush()
    out({"event": "device", "uuid": os.environ["FAKE_CHILD_UUID"]})
    out({"event": "phase", "key": "load", "allocated": 0, "reserved": 0, "t": 0.0})
    assert req["settle"], "the parent asks a CUDA child to settle"
    out({"event": "settle", "reserved": RESERVED, "allocated": RESERVED})
    got = threading.Event()
    threading.Thread(target=lambda: sys.stdin.readline() and got.set(), daemon=True).start()
    if not got.wait(10):
        out({"event": "failure", "kind": "error", "message": "no acknowledgement"}); sys.exit(1)
    out({"event": "result", "info": {"gpu": "fake"}, "phases": {"load": {"allocated": RESERVED,
         "reserved": RESERVED}}, "timing": {}, "total_params": 1, "trainable_params": 1, "managed_bytes": 0,
         "peak_allocated_bytes": RESERVED, "peak_reserved_bytes": RESERVED})
""")


def test_the_child_waits_at_its_end_while_the_parent_reads_its_context(tmp_path, monkeypatch):
    """End to end on the CPU: a stand-in child reports cuda:0's UUID (the A100 at NVML index 1, which NVML's
    order alone would not find), settles with 300 MiB reserved and waits; the parent reads NVML and lets it go.
    Reading the wrong GPU would give 500 - 300 MiB."""
    from vramlab.core.profiling import profile as profile_mod
    from vramlab.core.spec.model import ModelSpec
    from vramlab.core.spec.training import TrainingSetup

    reserved = 300 * MiB
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD.replace("RESERVED", str(reserved)))
    fake = mixed()
    fake.context_bytes = 500 * MiB
    fake.set_allocated(reserved, index=1)
    monkeypatch.setattr(profile_mod, "child_command", lambda: [sys.executable, str(script)])
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("FAKE_CHILD_UUID", fake_gpu(1).uuid.removeprefix("GPU-"))  # torch's form
    spec = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                     intermediate_size=256, vocab_size=300)

    def follow(event):  # noqa: ANN001, ANN202 - the fake GPU lists the child as its process
        if event.get("event") == "started":
            fake.pid = event["pid"]

    out = profile_mod.profile(spec, TrainingSetup(method="lora", seq_len=64), device="cuda", sampler=fake,
                              on_event=follow, timeout_s=60)
    assert out.ok, out.message
    assert out.context_bytes == 500 * MiB
    assert out.info["nvml_gpu_uuid"] == fake_gpu(1).uuid and out.info["driver"] == "550.54.14"
    assert any(o.name == "CUDA context (measured)" for o in out.result.overheads)


def test_waiting_for_an_acknowledgement_ends_at_its_timeout(tmp_path):
    import io

    from vramlab.core.profiling.readings import wait_for_file, wait_for_line

    assert wait_for_line(io.StringIO("ack\n"), 1.0)
    assert not wait_for_line(io.StringIO(""), 0.2)  # the parent closed the pipe: no wait beyond it
    t0 = time.monotonic()
    assert not wait_for_file(tmp_path / "ack0", 0.2) and time.monotonic() - t0 < 2
    (tmp_path / "ack1").touch()
    assert wait_for_file(tmp_path / "ack1", 1.0)


@pytest.mark.parametrize(("code", "destroyed"), [(0, True), (1, False)])
def test_a_failed_rank_leaves_the_group_without_destroying_it(tmp_path, monkeypatch, code, destroyed):
    """destroy_process_group() on a failed rank would wait on peers that sit in a collective."""
    from vramlab.core.profiling import dist_child

    (tmp_path / "request.json").write_text(json.dumps({}))
    calls = []
    monkeypatch.setattr(dist_child, "run", lambda *a, **k: code)
    monkeypatch.setattr(dist_child, "_destroy", lambda: calls.append("destroy"))
    monkeypatch.setenv("RANK", "0")
    assert dist_child.main([str(tmp_path)]) == code
    assert (calls == ["destroy"]) is destroyed


# ---- containers: NVML lists host PIDs ------------------------------------------------------------------------

def test_in_a_container_the_run_is_the_whole_gpus_delta_from_before_it():
    """Scenario.PID_NAMESPACE: the run's PID matches no NVML process, so the per-process peak stays unknown and
    the watch falls back on the whole GPU's used less its baseline, for the peak and for the context."""
    fake = FakeSampler(scenario=Scenario.PID_NAMESPACE, pid=os.getpid(), context_bytes=0)
    fake.set_allocated(0)
    watch = RunWatch(fake, environ={})
    watch.watch(0, fake.pid)
    watch.mark_baseline()  # before the run: nothing of ours on the GPU
    fake.context_bytes = 480 * MiB  # the child starts: its context, then its tensors
    fake.set_allocated(3000 * MiB)
    watch.read()
    fake.set_allocated(2000 * MiB)  # at the settle: what its allocator still reserves
    assert watch.settle(0, reserved_bytes=2000 * MiB) == 480 * MiB
    out = watch.stop()[0]
    assert out["process_used_peak_bytes"] is None  # no PID matched
    assert out["device_delta_peak_bytes"] == 3480 * MiB
    assert out["context_bytes"] == 480 * MiB and out["context_source"] == "whole-GPU delta"


def test_outside_a_container_the_context_is_the_processes_own():
    fake = FakeSampler(pid=os.getpid(), context_bytes=480 * MiB)
    fake.set_allocated(1000 * MiB)
    watch = RunWatch(fake, environ={})
    watch.watch(0, fake.pid)
    watch.mark_baseline()
    assert watch.settle(0, reserved_bytes=1000 * MiB) == 480 * MiB
    assert watch.stop()[0]["context_source"] == "process"
