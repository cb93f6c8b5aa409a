"""Many points at once: ``estimate_points`` gives, point by point, what ``estimate`` gives."""

from __future__ import annotations

import pytest

from vramlab.core.catalog import find_gpu, find_model
from vramlab.core.checks import SetupError
from vramlab.core.estimate import estimate, estimate_points
from vramlab.core.estimator.engine import KINDS
from vramlab.core.spec.training import TrainingSetup

CASES = [
    ("llama-3.2-1b", TrainingSetup(method="lora", lora_targets="all-linear"), None),
    ("qwen2.5-0.5b", TrainingSetup(method="qlora", optimizer="paged_adamw8bit"), "a100-80gb"),
    ("smollm2-135m", TrainingSetup(method="full", sharding="zero2", gpus=4, grad_ckpt=True), "h100-pcie"),
    ("smollm2-135m", TrainingSetup(method="full", chunked_loss=True), None),
]
POINTS = [(1, 128, 8), (2, 512, 16), (8, 2048, 4), (1, 1024, 64), (4, 128, 8), (2, 512, 16)]


@pytest.mark.parametrize(("model", "setup", "gpu"), CASES, ids=[c[0] + "-" + c[1].method.value for c in CASES])
def test_each_point_is_the_single_estimate(model, setup, gpu):  # noqa: ANN001
    spec = find_model(model)
    g = find_gpu(gpu) if gpu else None
    many = estimate_points(spec, setup, POINTS, gpu=g, calibration=None)
    for i in range(len(POINTS)):
        one = estimate(spec, many.setup_at(i), g, calibration=None)
        assert int(many.peak_allocated_bytes[i]) == one.peak_allocated_bytes
        assert int(many.peak_reserved_bytes[i]) == one.peak_reserved_bytes
        assert int(many.device_used_bytes[i]) == one.device_used_bytes
        assert many.peak_phase[i] == one.peak_phase
        assert {KINDS[k]: int(v) for k, v in enumerate(many.components[i]) if v} == one.components


def test_a_point_the_single_estimate_refuses_is_refused():
    with pytest.raises(SetupError, match="micro batch"):
        estimate_points(find_model("gpt2"), TrainingSetup(), [(1, 128, 8), (0, 128, 8)])


def test_a_step_too_long_to_replay_takes_the_fast_allocator_model_and_says_so(monkeypatch):
    """10,000 layers took 89 s and 2 GB to replay; beyond the budget the fast model answers, labelled. (Setup
    validation now refuses more than 1,024 layers, so the budget is lowered here to put GPT-2 beyond it.)"""
    from vramlab.core import estimate as estimate_module
    from vramlab.core import levels

    budget = 1_000
    monkeypatch.setattr(estimate_module, "REPLAY_BUDGET", budget)
    monkeypatch.setattr(levels, "REPLAY_BUDGET", budget)
    gpt2 = find_model("gpt2")
    fast = estimate(gpt2, TrainingSetup(), calibration=None)
    replayed = estimate(gpt2, TrainingSetup(), allocator=True, calibration=None)
    assert replayed.peak_reserved_bytes == fast.peak_reserved_bytes
    assert any("fast model" in w for w in replayed.warnings)
    slack = next(o for o in replayed.overheads if o.name.startswith("Allocator"))
    assert f"{budget:,}" in slack.why
