"""What a CUDA profile compares and refuses, checked on the CPU (core/profiling/profile.py): the tensor level is
torch's ``requested_bytes.all.peak``; the kernel note compares with the kernel the estimate modelled (cuDNN is
not flash); in a container the device level is the whole GPU's delta; quantized and 8-bit setups need
bitsandbytes on a GPU, as transformers does."""

from __future__ import annotations

import pytest

from vramlab.core.catalog import find_model
from vramlab.core.checks import SetupError
from vramlab.core.profiling import profile as profile_mod
from vramlab.core.profiling.outcomes import read_outcome
from vramlab.core.profiling.profile import bitsandbytes_refusal
from vramlab.core.profiling.readings import tensor_level_peak
from vramlab.core.spec.training import TrainingSetup
from vramlab.core.units import MiB

SPEC = find_model("llama-3.1-8b")
BF16 = TrainingSetup(method="lora", seq_len=512)


def test_the_tensor_level_is_the_requested_bytes_not_the_allocated_blocks():
    stats = {"allocated_bytes.all.peak": 1100 * MiB, "requested_bytes.all.peak": 1000 * MiB}
    assert tensor_level_peak(stats) == 1000 * MiB
    assert tensor_level_peak({"allocated_bytes.all.peak": 1}) is None


def final(ran: str, capability: list[int], requested: int | None = 900 * MiB) -> dict:
    out = {"event": "result", "phases": {"forward@1": {"allocated": 1000 * MiB, "reserved": 1200 * MiB}},
           "peak_allocated_bytes": 1000 * MiB, "peak_reserved_bytes": 1200 * MiB, "timing": {},
           "info": {"gpu": "GPU", "torch": "2.13.0", "capability": capability, "sdpa_backend": ran,
                    "sdpa_predicted": ran}}
    if requested is not None:
        out["peak_requested_bytes"] = requested
    return out


def test_a_profile_reports_the_requested_peak_beside_max_memory_allocated():
    out = read_outcome(SPEC, BF16, "cuda", None, final("flash", [8, 9]), [], {})
    assert out.requested_peak_bytes == 900 * MiB and out.result.peak_allocated_bytes == 1000 * MiB
    assert out.to_json()["requested_peak_bytes"] == 900 * MiB


def test_the_kernel_note_compares_with_the_kernel_modelled_for_that_gpu(monkeypatch):
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    hopper = read_outcome(SPEC, BF16, "cuda", None, final("cudnn", [9, 0]), [], {})
    assert not any("while the prediction modelled" in n for n in hopper.result.notes)
    ada = read_outcome(SPEC, BF16, "cuda", None, final("cudnn", [8, 9]), [], {})
    assert any("cuDNN" in n and "while the prediction modelled flash" in n for n in ada.result.notes)


def test_in_a_container_the_device_level_is_the_whole_gpus_delta():
    readings = {"process_used_peak_bytes": None, "device_delta_peak_bytes": 1800 * MiB,
                "device_used_peak_bytes": 9000 * MiB, "context_bytes": 500 * MiB, "context_source": "whole-GPU delta"}
    out = read_outcome(SPEC, BF16, "cuda", None, final("flash", [8, 9]), [], readings)
    assert out.result.device_used_bytes == 1800 * MiB and out.device_delta_peak_bytes == 1800 * MiB
    assert any("PID namespace" in n for n in out.result.notes)


@pytest.mark.parametrize("setup", [TrainingSetup(method="qlora"), TrainingSetup(weights="int8", method="qlora"),
                                   TrainingSetup(optimizer="adamw8bit"), TrainingSetup(optimizer="paged_adamw8bit")])
def test_bitsandbytes_setups_on_a_gpu_need_bitsandbytes(setup):
    why = bitsandbytes_refusal(setup, "cuda", installed=False)
    assert why and "bitsandbytes" in why and "vramlab[gpu]" in why
    assert bitsandbytes_refusal(setup, "cuda", installed=True) is None
    assert bitsandbytes_refusal(setup, "cpu", installed=False) is None  # the emulation runs on the CPU
    assert bitsandbytes_refusal(BF16, "cuda", installed=False) is None


def test_a_cuda_profile_refuses_before_it_starts_anything(monkeypatch):
    monkeypatch.setattr(profile_mod, "bitsandbytes_refusal", lambda setup, device: "needs bitsandbytes")
    started = []
    monkeypatch.setattr(profile_mod, "_one_process", lambda *a, **k: started.append(1))
    with pytest.raises(SetupError, match="needs bitsandbytes"):
        profile_mod.profile(SPEC, TrainingSetup(method="qlora"), device="cuda")
    assert not started


def test_the_profile_text_shows_both_tensor_counters_and_the_whole_gpu_delta():
    from vramlab.core.report import profile_text

    readings = {"device_delta_peak_bytes": 1800 * MiB, "context_bytes": 500 * MiB, "context_source": "whole-GPU delta"}
    text = profile_text(read_outcome(SPEC, BF16, "cuda", None, final("flash", [8, 9]), [], readings), "MiB")
    assert "requested_bytes.all.peak" in text and "max_memory_allocated" in text
    assert "whole-GPU delta" in text and "since before the run" in text
