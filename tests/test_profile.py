"""`vramlab profile`: the isolated child, its fault scenarios, and the CPU fallback. GPU tests skip
without CUDA (they run the same path on the device)."""

from __future__ import annotations

import os

import psutil
import pytest

from vramlab.core.estimate import estimate
from vramlab.core.profiling.profile import profile
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

TINY = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=300)
SETUP = TrainingSetup(method="lora", seq_len=64)


def _no_children_left() -> bool:
    return not psutil.Process(os.getpid()).children(recursive=True)


def test_cpu_profile_equals_simulation_and_estimate():
    events = []
    out = profile(TINY, SETUP, device="cpu", on_event=events.append)
    assert out.ok and out.kind == "ok"
    assert out.result.peak_allocated_bytes == simulate(TINY, SETUP).peak_allocated_bytes
    assert out.result.peak_allocated_bytes == estimate(TINY, SETUP, match_simulation=True).peak_allocated_bytes
    keys = [e["key"] for e in events if e["event"] == "phase"]
    assert keys[:4] == ["load", "forward@1", "backward@1", "optimizer@1"] and keys[-1] == "end"
    mem = [e for e in events if e["event"] == "mem"]  # the tracker's live bytes, 10 times a second
    assert mem and all(0 <= e["allocated"] == e["reserved"] <= out.result.peak_allocated_bytes for e in mem)
    assert out.tokens_per_s and out.tokens_per_s > 0
    d = out.to_json()  # the CLI contract's keys at the top, as estimate and simulate print them
    assert d["ok"] and d["level"] == "profile" and d["peak_allocated_bytes"] == out.result.peak_allocated_bytes
    assert sum(d["components"].values()) == d["peak_allocated_bytes"] and {"phases", "setup"} <= set(d)
    assert _no_children_left()


@pytest.mark.parametrize(("fault", "kind"), [("oom", "oom"), ("crash", "crashed")])
def test_failures_are_results(fault, kind):
    out = profile(TINY, SETUP, device="cpu", fault=fault, timeout_s=120)
    assert not out.ok and out.kind == kind
    assert out.failed_phase == "backward@1"
    assert _no_children_left()


def test_a_hang_is_ended_at_the_timeout():
    out = profile(TINY, SETUP, device="cpu", fault="hang", timeout_s=20)
    assert out.kind == "timeout" and out.failed_phase == "backward@1"
    assert _no_children_left()


def test_cancel_ends_the_child():
    calls = {"n": 0}

    def abort() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    out = profile(TINY, SETUP, device="cpu", fault="slow", should_abort=abort)
    assert out.kind == "cancelled"
    assert _no_children_left()


def test_cuda_without_a_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = profile(TINY, SETUP, device="cuda")
    assert out.kind == "no_gpu" and "CUDA" in out.message


@pytest.mark.gpu
def test_cuda_profile_against_estimate():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vramlab.core.catalog import find_model

    spec = find_model("qwen2.5-0.5b")
    for setup in (TrainingSetup(method="lora", seq_len=1024), TrainingSetup(seq_len=512, optimizer_impl="fused")):
        out = profile(spec, setup, device="cuda")
        assert out.ok, out.message
        measured = out.result
        sim = simulate(spec, setup)
        est = estimate(spec, setup, allocator=True)  # what `vramlab estimate` prints for this GPU
        for name, predicted in (("estimate", est.peak_allocated_bytes), ("simulate", sim.peak_allocated_bytes)):
            rel = abs(measured.peak_allocated_bytes - predicted) / measured.peak_allocated_bytes
            assert rel < 0.03, (name, setup, measured.peak_allocated_bytes, predicted)
        # the outer levels are models of the allocator and the runtime: held more loosely
        rel = abs(measured.peak_reserved_bytes - est.peak_reserved_bytes) / measured.peak_reserved_bytes
        assert rel < 0.15, ("reserved", measured.peak_reserved_bytes, est.peak_reserved_bytes)
        if out.device_used_peak_bytes and out.process_used_peak_bytes:
            rel = abs(out.process_used_peak_bytes - est.device_used_bytes) / out.process_used_peak_bytes
            assert rel < 0.2, ("device", out.process_used_peak_bytes, est.device_used_bytes)
        # NVML lists no per-process memory in many containers (another PID namespace): then there is no
        # measured context, and that is a valid answer, not a failure
        if out.context_bytes is not None:
            assert out.info.get("context_settled") and 100 * 2**20 < out.context_bytes < 2 * 2**30


def test_a_sharded_setup_torchrun_cannot_run_says_it_was_emulated():
    out = profile(TINY, SETUP.replace(gpus=2, sharding="zero2"), device="cpu")
    assert out.ok and "ZeRO-2" in out.info["emulated_rank0"]
    assert out.to_json()["environment"]["emulated_rank0"] == out.info["emulated_rank0"]
    assert _no_children_left()


def test_a_run_records_its_speed_kernel_and_allocator_settings(monkeypatch):
    """tokens/s counts the micro-batches that ran (at most two, however large grad_accum is); the SDPA kernel
    torch chose and PYTORCH_CUDA_ALLOC_CONF travel with the result."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    setup = SETUP.replace(grad_accum=4, micro_batch=2)
    out = profile(TINY, setup, device="cpu", steps=2)
    assert out.ok and out.step_time_s
    assert out.tokens_per_s * out.step_time_s == pytest.approx(2 * 64 * 2)  # batch x seq x 2 micro-batches
    assert out.info["pytorch_cuda_alloc_conf"] == "expandable_segments:True"
    assert out.info["sdpa_backend"] in ("flash", "math") and out.info["sdpa_predicted"] == out.info["sdpa_backend"]
    assert any(n.startswith("SDPA kernel: ") for n in out.result.notes)


def _needs_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
def test_cuda_run_is_watched_on_its_own_gpu_and_names_its_kernels():
    """The parent's NVML watch reads the GPU the child says it ran on; the run records its SDPA kernel, the
    allocator settings and the driver. Asserts only what holds in containers too (NVML may list no process)."""
    _needs_cuda()
    from vramlab.core.catalog import find_model
    from vramlab.core.monitor.detect import same_uuid

    out = profile(find_model("qwen2.5-0.5b"), TrainingSetup(method="lora", seq_len=256), device="cuda")
    assert out.ok, out.message
    if out.info.get("nvml_gpu_uuid") and out.info.get("gpu_uuid"):
        assert same_uuid(out.info["nvml_gpu_uuid"], out.info["gpu_uuid"])
        assert out.info.get("driver")
    assert out.info["sdpa_backend"] in ("flash", "efficient", "cudnn", "math")
    assert out.tokens_per_s and out.tokens_per_s > 0


@pytest.mark.gpu
def test_cuda_paged_8bit_states_live_outside_the_allocator():
    """bitsandbytes' PagedAdamW8bit keeps the states of tensors with >= 1e5 elements in managed memory: the
    optimizer step's allocator peak is lower than AdamW8bit's by about 2 bytes per such element."""
    _needs_cuda()
    from vramlab.core.catalog import find_model
    from vramlab.core.simulation.quant import bitsandbytes_version

    if bitsandbytes_version() is None:
        pytest.skip("needs bitsandbytes (pip install -e '.[gpu]')")
    spec = find_model("qwen2.5-0.5b")
    plain = profile(spec, TrainingSetup(seq_len=256, optimizer="adamw8bit"), device="cuda")
    paged = profile(spec, TrainingSetup(seq_len=256, optimizer="paged_adamw8bit"), device="cuda")
    assert plain.ok and paged.ok, (plain.message, paged.message)
    assert plain.info["quantization"].startswith("bitsandbytes")
    big = spec.num_layers * spec.hidden_size * spec.hidden_size  # far below the real count of such elements
    assert plain.result.peak_allocated_bytes >= paged.result.peak_allocated_bytes
    p1 = {p.key: p.bytes for p in plain.result.phases}["optimizer@1"]
    p2 = {p.key: p.bytes for p in paged.result.phases}["optimizer@1"]
    assert p1 - p2 > 2 * big


@pytest.mark.gpu
def test_cuda_qlora_runs_bitsandbytes_and_agrees_with_the_estimate():
    _needs_cuda()
    from vramlab.core.catalog import find_model
    from vramlab.core.simulation.quant import bitsandbytes_version

    if bitsandbytes_version() is None:
        pytest.skip("needs bitsandbytes (pip install -e '.[gpu]')")
    spec = find_model("qwen2.5-0.5b")
    setup = TrainingSetup(method="qlora", seq_len=512)
    out = profile(spec, setup, device="cuda")
    assert out.ok, out.message
    assert out.info["quantization"].startswith("bitsandbytes")
    est = estimate(spec, setup, allocator=True)
    rel = abs(out.result.peak_allocated_bytes - est.peak_allocated_bytes) / out.result.peak_allocated_bytes
    assert rel < 0.15, (out.result.peak_allocated_bytes, est.peak_allocated_bytes)
