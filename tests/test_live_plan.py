"""core.live_plan: what a live profile runs, decided before it starts (the "Live profile" tab shows it)."""

from __future__ import annotations

import pytest

from vramlab.core import live_plan
from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.live import GpuProbe
from vramlab.core.live_plan import RunRefused, plan_run
from vramlab.core.spec.training import TrainingSetup

GPT2 = find_model("gpt2")
H100 = GpuProbe(True, "", "NVIDIA H100 80GB HBM3", 80 * 2**30, 3, compute_capability=(9, 0))
NO_GPU = GpuProbe(False, "NVML Shared Library Not Found")


def test_a_setup_the_model_refuses_is_not_profiled():
    with pytest.raises(RunRefused, match="cannot be profiled.*12 layers"):
        plan_run(GPT2, TrainingSetup(method="freeze", trainable_layers=100), "cpu", NO_GPU, None)


def test_cuda_without_a_gpu_is_refused_with_the_probes_reason():
    with pytest.raises(RunRefused, match="NVML Shared Library Not Found"):
        plan_run(GPT2, TrainingSetup(), "cuda", NO_GPU, find_gpu("rtx-4090"))


def test_a_cuda_run_uses_the_detected_gpu_and_the_tracker_when_asked():
    r = plan_run(GPT2, TrainingSetup(), "cuda", H100, find_gpu("rtx-4090"), tracked=True, steps=3).request
    assert "H100" in r.gpu.name and r.gpu.memory_bytes == 80 * 2**30
    assert r.tracked and r.steps == 3 and r.nvml_index == 3
    assert r.predicted is not None and r.predicted.gpu == r.gpu  # compared on the card it runs on


def test_a_card_the_catalogue_cannot_read_falls_back_to_the_chosen_gpu():
    unreadable = GpuProbe(True, "", "Mystery GPU", None)  # the driver gave no memory size
    r = plan_run(GPT2, TrainingSetup(), "cuda", unreadable, find_gpu("rtx-4090")).request
    assert r.gpu == find_gpu("rtx-4090")


def test_a_cpu_run_has_no_gpu_no_tracker_and_the_simulation_estimate():
    r = plan_run(GPT2, TrainingSetup(), "cpu", H100, find_gpu("rtx-4090"), tracked=True).request
    assert r.gpu is None and not r.tracked
    assert r.predicted is not None and r.predicted.gpu is None  # compared with no GPU's levels


def test_a_cpu_run_the_host_cannot_hold_is_refused_unless_a_fault_is_injected():
    huge, full = find_model("llama-2-70b"), TrainingSetup(method="full")  # about 640 GiB of real tensors
    with pytest.raises(RunRefused, match="Not started.*available"):
        plan_run(huge, full, "cpu", NO_GPU, None)
    assert plan_run(huge, full, "cpu", NO_GPU, None, fault="oom").request.fault == "oom"


def test_an_estimator_bug_does_not_stop_the_measurement(monkeypatch):
    def broken(*_args, **_kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(live_plan, "predicted_for", broken)
    plan = plan_run(GPT2, TrainingSetup(), "cuda", H100, None)
    assert plan.request.predicted is None
    assert "ZeroDivisionError: boom" in plan.warning and "measuring anyway" in plan.warning
