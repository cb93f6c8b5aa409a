"""TRL's own trainers against the estimate of the same YAML (tools/conformance.py, `make conformance`, holds every
row; here the one whose peak falls inside an objective's loss, so that what the loss keeps alive decides it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("trl")
pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def conformance():  # noqa: ANN201
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import conformance
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return conformance


@pytest.mark.slow  # a few seconds of TRL on two cores: make test-slow; make conformance runs every row
def test_kto_with_lora_is_ktotrainers_own_step_to_the_byte(conformance, tmp_path) -> None:  # noqa: ANN001
    """KTOTrainer (LoRA: the reference is the policy with its adapters off, so the peak is inside _compute_loss)
    on its CUDA path: the estimate of its YAML differs only by the training loop's own 0-dim tensors. Its counts
    of desirable and undesirable rows (labels.sum(), len(labels) - num_chosen) stay on the device to the end."""
    folder = tmp_path / "tiny"
    conformance._tiny(folder)
    c = conformance.against_the_estimate(folder, "trl kto lora", tmp_path)
    assert c["setup"]["objective"] == "kto" and c["setup"]["reference"] == "adapters"
    assert c["unexplained_bytes"] == 0, c["tensors_at_the_peaks"]
    assert c["estimate_equals_its_reference"]
