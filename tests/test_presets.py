"""The preset catalogs in resources/: every model's shapes reproduce its publisher's parameter count exactly,
and the GPU table is complete and sane."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.model import ModelSpec

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
GIB = 1 << 30


def _load(name: str, key: str) -> list[dict]:
    with open(RESOURCES / name, encoding="utf-8") as f:
        return json.load(f)[key]


MODEL_ENTRIES = _load("models.json", "models")
GPU_ENTRIES = _load("gpus.json", "gpus")
MODELS = {e["id"]: e for e in MODEL_ENTRIES}
GPUS = {e["id"]: e for e in GPU_ENTRIES}

REQUIRED_MODELS = (
    "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b",
    "llama-3.2-3b", "mistral-7b-v0.1", "mixtral-8x7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
    "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "gemma-2-2b", "gemma-2-9b", "phi-3-mini-4k",
    "tinyllama-1.1b",
)
REQUIRED_GPUS = (
    "rtx-3090", "rtx-4090", "rtx-5090", "rtx-a6000", "l40s", "t4", "l4", "a10g", "v100-16gb", "v100-32gb",
    "a100-40gb", "a100-80gb", "h100-pcie", "h100-sxm", "h200", "b200", "mi300x",
)
# Publisher totals, written here independently of the JSON so that editing one side alone fails.
KNOWN_TOTALS = {
    "llama-2-7b": 6_738_415_616,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b-v0.1": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-2b": 2_614_341_888,
    "tinyllama-1.1b": 1_100_048_384,
    "phi-3-mini-4k": 3_821_079_552,
}
SLUG = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")


# ---- models --------------------------------------------------------------------------------------------

def test_model_ids_unique_and_enough():
    ids = [e["id"] for e in MODEL_ENTRIES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(ids) >= 20
    assert all(SLUG.match(i) for i in ids), [i for i in ids if not SLUG.match(i)]


@pytest.mark.parametrize("model_id", REQUIRED_MODELS)
def test_required_model_present(model_id):
    assert model_id in MODELS


@pytest.mark.parametrize("entry", MODEL_ENTRIES, ids=[e["id"] for e in MODEL_ENTRIES])
def test_param_count_matches_published(entry):
    spec = ModelSpec.from_dict(entry)
    assert entry.get("published_params"), "every preset needs the publisher's total"
    assert entry.get("source"), "every preset says where its numbers come from"
    assert spec.param_count == entry["published_params"], (
        f"{entry['id']}: shapes give {spec.param_count:,}, publisher says {entry['published_params']:,} "
        f"(off by {spec.param_count - entry['published_params']:+,}); recheck the config numbers"
    )


@pytest.mark.parametrize("entry", MODEL_ENTRIES, ids=[e["id"] for e in MODEL_ENTRIES])
def test_model_entry_round_trips(entry):
    """Each JSON value is already canonical: to_dict gives the same value back (enums as their strings)."""
    out = ModelSpec.from_dict(entry).to_dict()
    assert {k: out[k] for k in entry} == entry


@pytest.mark.parametrize("model_id", sorted(KNOWN_TOTALS))
def test_known_publisher_totals(model_id):
    assert ModelSpec.from_dict(MODELS[model_id]).param_count == KNOWN_TOTALS[model_id]


def test_moe_presets_have_fewer_active_params():
    moe = [ModelSpec.from_dict(e) for e in MODEL_ENTRIES if e.get("num_experts")]
    assert moe, "the catalog has MoE models"
    for m in moe:
        assert 0 < m.active_param_count < m.param_count, m.id


# ---- GPUs ----------------------------------------------------------------------------------------------

def test_gpu_ids_unique_and_enough():
    ids = [e["id"] for e in GPU_ENTRIES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(ids) >= 20
    assert all(SLUG.match(i) for i in ids), [i for i in ids if not SLUG.match(i)]


@pytest.mark.parametrize("gpu_id", REQUIRED_GPUS)
def test_required_gpu_present(gpu_id):
    assert gpu_id in GPUS


@pytest.mark.parametrize("entry", GPU_ENTRIES, ids=[e["id"] for e in GPU_ENTRIES])
def test_gpu_sane(entry):
    g = GpuSpec.from_dict(entry)
    assert 4 * GIB <= g.memory_bytes <= 300 * GIB, f"{g.id}: {g.memory_bytes / GIB:.1f} GiB"
    assert isinstance(g.memory_bytes, int)
    assert g.bf16_tflops > 0
    assert g.memory_bandwidth_gbps > 0
    assert g.tier in ("consumer", "workstation", "datacenter")
    assert g.vendor in ("nvidia", "amd")
    assert g.arch and g.compute_capability and g.name


def test_rtx_4090_memory_is_what_nvidia_smi_reports():
    assert GPUS["rtx-4090"]["memory_bytes"] == 24564 * (1 << 20) == 25_757_220_864
