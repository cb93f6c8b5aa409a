"""benchmarks/results/composition*.json (issue 28's composition matrix, made by benchmarks/composition.py): every
pair of two axes' values is in some recorded cell, every answered cell is within 0.5 % of transformers' classes,
and every other cell is a refusal with its reason. Reads the recorded files only (no simulation)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FILES = sorted(RESULTS.glob("composition*.json"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_the_composition_design_covers_every_pair_and_every_cell_is_held_or_refused(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    axes, cells = data["axes"], data["cells"]
    todo = {(a, x, b, y) for a, b in itertools.combinations(axes, 2) for x in axes[a] for y in axes[b]}
    for cell in cells:
        todo -= {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(axes, 2)}
    assert not todo, f"pairs in no cell: {sorted(todo)[:5]}"
    for cell in cells:
        assert cell["status"] in ("answered", "refused"), cell
        if cell["status"] == "answered":
            assert abs(cell["error"]) <= 0.005 and cell["within"], cell
        else:
            assert cell["reason"], cell
    summary = data["summary"]
    assert summary["cells"] == len(cells)
    assert summary["answered"] == summary["within_0.5%"] == sum(c["status"] == "answered" for c in cells)
