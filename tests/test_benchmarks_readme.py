"""benchmarks/README.md and benchmarks/results/: the latest figures are the recorded files', and every result
file is named by what it measures, not by the commit it was compared with."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("benchmarks_summary", ROOT / "benchmarks" / "summary.py")
assert _spec and _spec.loader
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)


def test_the_latest_figures_are_those_of_the_result_files() -> None:
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    assert summary.rewrite(text) == text, "run: .venv/bin/python benchmarks/summary.py --write"
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        assert f"`{path.name}`" in text, f"{path.name} is not in benchmarks/README.md"


def test_every_benchmark_is_described() -> None:
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.stem not in ("common", "run_all", "summary"):
            assert f"`{path.name}`" in text, f"benchmarks/{path.name} is not described in benchmarks/README.md"


def test_result_files_are_named_by_what_they_measure_not_by_a_commit() -> None:
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        for word in re.split(r"[-_.]", path.stem):
            assert not (re.fullmatch(r"[0-9a-f]{7,40}", word) and re.search(r"\d", word)), path.name
