"""A first trace's progress reaches it as a parameter, from the caller through every estimate a command makes
(there is no module-wide default a caller sets and every later estimate reads)."""

from __future__ import annotations

import pytest

from vramlab.core import advisor, compare, traced
from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.spec.training import TrainingSetup

SPEC = find_model("llama-3.2-1b")
GPU = find_gpu("rtx-4090")
SETUP = TrainingSetup(method="full", micro_batch=64, seq_len=4096)  # does not fit: savings apply


def _recording(monkeypatch: pytest.MonkeyPatch, module: object) -> list[object]:
    """The ``progress`` every estimate of ``module`` is given (the estimate itself still runs)."""
    seen: list[object] = []
    real = module.estimate  # type: ignore[attr-defined]

    def estimate(*args: object, **kwargs: object):  # noqa: ANN202
        seen.append(kwargs.get("progress"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "estimate", estimate)
    return seen


def report(_text: str, _fraction: float) -> None:
    pass


def test_the_fit_search_hands_its_progress_to_every_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording(monkeypatch, advisor)
    advisor.fit_search(SPEC, SETUP.replace(micro_batch=1, seq_len=512), GPU, progress=report)
    assert len(seen) > 3 and all(p is report for p in seen)  # the searches for the largest batch and sequence


def test_savings_and_comparisons_hand_their_progress_to_every_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording(monkeypatch, advisor)
    advisor.savings(SPEC, SETUP, GPU, progress=report)
    rows = _recording(monkeypatch, compare)
    compare.compare_setups(SPEC, SETUP, GPU, progress=report)
    assert seen and rows and all(p is report for p in seen + rows)


def test_no_module_wide_progress_is_left() -> None:
    assert not hasattr(traced, "DEFAULT_PROGRESS")
