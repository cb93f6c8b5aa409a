"""unsloth 2026.10.9 installs with transformers <= 5.17.0 (its wheel's Requires-Dist); the run VRAM Lab models is
transformers 5.25's classes with Unsloth's code. The result says so in one note wherever Unsloth runs: the CLI's text,
its --json, a simulation (the window shows the notes: tests/gui/test_unsloth_controls.py)."""

from __future__ import annotations

import json

import pytest

from vramlab.core import versions
from vramlab.core.cli import main
from vramlab.core.estimate import estimate
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

LLAMA = ModelSpec(id="llama", name="Llama-ish", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=32000)
LORA = TrainingSetup(method="lora", lora_targets="all-linear", seq_len=128, hub_kernels=False)
ARGS = ["estimate", "--model", "llama-3.2-1b", "--method", "lora", "--lora-targets", "all-linear"]


def _gap(notes) -> list[str]:  # noqa: ANN001
    return [n for n in notes if "newer than unsloth" in n]


def test_the_cli_names_the_transformers_unsloth_does_not_support(capsys: pytest.CaptureFixture) -> None:
    assert main([*ARGS, "--unsloth-kernels", "all", "--json"]) == 0
    (note,) = _gap(json.loads(capsys.readouterr().out)["notes"])
    assert "transformers 5.25.0 is newer than unsloth 2026.10.9 supports (<= 5.17.0" in note
    assert "Unsloth's kernels" in note
    assert main([*ARGS, "--unsloth-kernels", "all"]) == 0
    assert len(_gap(capsys.readouterr().out.splitlines())) == 1
    assert main(ARGS + ["--json"]) == 0  # no Unsloth: nothing to say
    assert _gap(json.loads(capsys.readouterr().out)["notes"]) == []


def test_its_checkpointing_alone_is_named_and_a_supported_release_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    gc = LORA.replace(grad_ckpt=True, unsloth_gc=True, seq_len=1024)
    (note,) = _gap(estimate(LLAMA, gc).notes)
    assert "with Unsloth's checkpointing;" in note
    assert _gap(estimate(LLAMA, gc.replace(seq_len=256)).notes) == []  # below 512 tokens: plain checkpointing
    monkeypatch.setattr(versions, "MODELLED", {**versions.MODELLED, "transformers": "5.17.0"})
    assert _gap(estimate(LLAMA, LORA.replace(unsloth_kernels="all")).notes) == []


def test_a_simulation_names_it_too() -> None:
    pytest.importorskip("torch")
    from vramlab.core.simulation.simulate import simulate

    (note,) = _gap(simulate(LLAMA, LORA.replace(unsloth_kernels="lora_mlp")).notes)
    assert "transformers 5.25.0's classes with Unsloth's kernels" in note
