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
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import conformance
    finally:
        sys.path.remove(str(ROOT / "tools"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tool runs (tensors of a few KB)
    yield conformance
    torch.set_num_threads(threads)


@pytest.mark.slow  # a few seconds of TRL on two cores each: make test-slow; make conformance runs every row
@pytest.mark.parametrize(("case", "what"), [
    # the reference is the policy with its adapters off, so the peak is inside _compute_loss: KTOTrainer's counts
    # of desirable and undesirable rows (labels.sum(), len(labels) - num_chosen) stay on the device to the end
    ("trl kto lora", {"objective": "kto", "reference": "adapters"}),
    # trl.experimental's ORPOTrainer holds DPODataCollatorWithPadding's prompt, chosen and rejected tensors for the
    # whole step; the rows concatenated for the forward go when concatenated_forward returns
    ("trl orpo full", {"objective": "orpo", "reference": "none"}),
])
def test_trls_own_trainer_is_the_estimate_to_the_byte(conformance, tmp_path, case: str, what: dict) -> None:  # noqa: ANN001
    """TRL's own trainer on its CUDA path: the estimate of its YAML differs only by the training loop's own 0-dim
    tensors."""
    folder = tmp_path / "tiny"
    conformance._tiny(folder)
    c = conformance.against_the_estimate(folder, case, tmp_path)
    assert {k: c["setup"][k] for k in what} == what
    assert c["unexplained_bytes"] == 0, c["tensors_at_the_peaks"]
    assert c["estimate_equals_its_reference"]
