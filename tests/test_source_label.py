"""Every result says where its tensor-level step came from (the CLI text and ``--json``)."""

from __future__ import annotations

import json

import pytest

from vramlab.core.estimate import estimate
from vramlab.core.simulation.simulate import simulate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

TINY = ModelSpec(id="tiny", name="Tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=256)


def test_estimate_and_simulations_name_their_source() -> None:
    setup = TrainingSetup(seq_len=64)
    assert estimate(TINY, setup).to_json()["source"] == "hand-written"
    assert simulate(TINY, setup).to_json()["source"] == "simulated (built-in builder)"
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    assert simulate(TINY, setup, hf=True).to_json()["source"] == "simulated (transformers + peft)"


def test_cli_says_it(capsys: pytest.CaptureFixture[str]) -> None:
    from vramlab.core.cli import main

    assert main(["estimate", "-m", "qwen2.5-0.5b"]) == 0
    assert "source of the step: hand-written" in capsys.readouterr().out
    assert main(["estimate", "-m", "qwen2.5-0.5b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "hand-written"
