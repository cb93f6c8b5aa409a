"""Calibration from a profile: saved per GPU, applied to later estimates of that GPU only."""

from __future__ import annotations

from vramlab.core.calibration import Calibration, for_gpu, from_profile, load_all, save
from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.estimate import estimate
from vramlab.core.levels import allocator_slack
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import MiB


def test_round_trip_and_lookup(tmp_path):
    path = tmp_path / "cal.json"
    save(Calibration("NVIDIA GeForce RTX 4090", 612 * MiB, 1.3, "2.13.0", "560.35", "2026-11-29"), path)
    assert for_gpu("NVIDIA GeForce RTX 4090", path).context_bytes == 612 * MiB
    assert for_gpu("GeForce RTX 4090", path) is not None  # preset names drop the vendor prefix
    assert for_gpu("NVIDIA A100-SXM4-80GB", path) is None
    assert for_gpu("NVIDIA GeForce RTX 4090 (cuda:1)", path) is not None  # a detected GPU in the app
    assert for_gpu("RTX 4090 D", path) is None and for_gpu("", path) is None


def test_a_gpu_whose_name_contains_another_is_not_it(tmp_path):
    path = tmp_path / "cal.json"
    save(Calibration("NVIDIA A100-SXM4-80GB", 500 * MiB, 1.0), path)
    save(Calibration("NVIDIA L40S", 450 * MiB, 1.0), path)
    assert for_gpu("NVIDIA A10", path) is None  # "a10" is in "a100sxm480gb"
    assert for_gpu("NVIDIA L4", path) is None  # "l4" is in "l40s"
    assert for_gpu("NVIDIA L40S", path).context_bytes == 450 * MiB
    path.write_text("{ broken")
    assert load_all(path) == {}  # a damaged file is ignored, not fatal


def test_ratio_is_clamped():
    assert from_profile("X", 1, 100, 10_000, 10).slack_ratio == 4.0
    assert from_profile("X", 1, 100, 100, 10_000).slack_ratio == 0.25


def test_estimates_use_the_measured_context(monkeypatch, tmp_path):
    monkeypatch.setenv("VRAMLAB_CONFIG_DIR", str(tmp_path))
    spec, setup, gpu = find_model("llama-2-7b"), TrainingSetup(method="qlora"), find_gpu("rtx-4090")
    plain = estimate(spec, setup, gpu)
    save(Calibration(gpu.name, 900 * MiB, 2.0))
    cal = estimate(spec, setup, gpu)
    assert cal.calibration.startswith("calibrated on")
    assert cal.peak_allocated_bytes == plain.peak_allocated_bytes  # the tensor level never changes
    # the allocator's slack is scaled; the cuBLAS workspaces inside the reserved level are not slack
    slack, cal_slack = allocator_slack(plain), allocator_slack(cal)
    assert cal_slack == int(slack * 2.0)
    workspaces = plain.peak_reserved_bytes - plain.peak_allocated_bytes - slack
    assert workspaces > 0 and cal.peak_reserved_bytes - cal.peak_allocated_bytes == cal_slack + workspaces
    other = estimate(spec, setup, find_gpu("a100-80gb"))
    assert other.calibration == ""
