"""The batch a training run holds beside its step's own (issue 29): accelerate's ``DataLoaderShard`` (the data
loader HF Trainer and every framework on it iterate) collates the next batch before it hands over the current one,
and moves a batch to the device only when it becomes current. So at any moment of a step one batch is on the device
(the step's own, which the estimate holds) and the next waits in host memory: what axolotl's own run showed at its
peak on the CPU (3,072 B at 2 x 64, tools/conformance_frameworks.py) is host memory on CUDA, not a batch the
estimate lacks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")


def test_the_next_batch_is_collated_and_left_on_the_host() -> None:
    from accelerate.data_loader import DataLoaderShard

    made: list[dict] = []

    def collate(rows: list[int]) -> dict:
        made.append({"input_ids": torch.tensor([rows] * 2)})
        return made[-1]

    loader = DataLoaderShard(list(range(8)), batch_size=2, collate_fn=collate, device=torch.device("meta"))
    it = iter(loader)
    current = next(it)
    assert len(made) == 2  # the current batch and the next one
    assert current["input_ids"].device.type == "meta"  # the current one moved to the device
    assert made[1]["input_ids"].device.type == "cpu"  # the next one still on the host
    next(it)
    assert len(made) == 3


def test_the_conformance_names_it_host_memory() -> None:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    try:
        import conformance_frameworks as F
    finally:
        sys.path.remove(str(root / "tools"))
    batch = {"bytes": 1024, "shape": [F.BATCH, F.SEQ], "dtype": "int64",
             "made_by": "lift_fresh.default @ transformers/tokenization_utils_base.py:693 as_tensor"}
    named, total = F._named({"only_in_the_run": [batch] * 3})
    assert total == -3 * 1024
    assert [r["kind"] for r in named] == [F._HOST]
    assert "DataLoaderShard" in named[0]["what"]
