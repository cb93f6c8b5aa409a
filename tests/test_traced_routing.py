"""What reaches transformers' own classes on the traced and simulated paths, and what comes back from them:
the file the user named, every value of a config as valid JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramlab.core.cli import main

pytest.importorskip("transformers")

SMALL = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)


def _json_of(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_hf_reads_the_config_file_named_not_its_folders(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--model path/to/mine.json`` is that file: simulate --hf read the folder's config.json (another model
    beside it) and counted that one."""
    (tmp_path / "mine.json").write_text(json.dumps(SMALL))
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "hidden_size": 128, "num_hidden_layers": 3}))
    named = str(tmp_path / "mine.json")
    est = _json_of(capsys, "estimate", "--model", named, "--seq", "64", "--json")
    sim = _json_of(capsys, "simulate", "--hf", "--model", named, "--seq", "64", "--json")
    assert sim["total_params"] == est["total_params"]
    folder = _json_of(capsys, "simulate", "--hf", "--model", str(tmp_path), "--seq", "64", "--json")
    assert folder["total_params"] > est["total_params"]
