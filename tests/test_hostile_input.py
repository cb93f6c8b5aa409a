"""Hostile and extreme input (issue 13): each case a careless or adversarial user found, held to the contract
of DESIGN.md: a right answer, or exit 2 with one line naming the bound; never a traceback, a wrong GPU, a
negative or wrapped number, invalid JSON or a lost file."""

from __future__ import annotations

import json

import pytest

from vramlab.core.catalog import find_gpu
from vramlab.core.cli import main
from vramlab.core.spec import SetupError
from vramlab.core.units import GB, GiB


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *args: str) -> str:
    """Run the CLI, assert the contract for bad input, return the one line."""
    code, out, err = run(capsys, *args)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


# ---- 1. a GPU is the GPU named, or the size typed, never a substring ---------------------------------------

@pytest.mark.parametrize(("text", "size"), [("1GB", GB), ("1G", GB), ("41GB", 41 * GB), ("4GB", 4 * GB),
                                            ("24GiB", 24 * GiB), ("12288MiB", 12 * GiB)])
def test_a_typed_size_is_that_size_not_a_gpu_whose_name_contains_it(text, size):
    gpu = find_gpu(text)
    assert gpu.memory_bytes == size and gpu.id.startswith("custom")


@pytest.mark.parametrize(("text", "gpu_id"), [
    ("h200", "h200"), ("H200 SXM 141GB", "h200"), ("NVIDIA H200 SXM 141GB", "h200"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("rtx4090", "rtx-4090"), ("Tesla T4", "t4"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("a10", "a10"),
])
def test_names_match_exactly_vendor_words_and_case_aside(text, gpu_id):
    assert find_gpu(text).id == gpu_id


def test_a_partial_name_lists_the_near_matches():
    with pytest.raises(SetupError, match="h100-pcie, h100-sxm, h100-nvl"):
        find_gpu("h100")
    with pytest.raises(SetupError, match="bare number"):
        find_gpu("24")
    for absurd in ("1MB", "4096TB", "9" * 400 + "GB"):
        with pytest.raises(SetupError, match="GPU size"):
            find_gpu(absurd)


def test_cli_gpu_4gb_does_not_fit_a_7b_model(capsys):
    code, out, _ = run(capsys, "estimate", "-m", "llama-2-7b", "--gpu", "4GB", "--fast", "--json")
    d = json.loads(out)
    assert code == 0 and d["gpu"]["memory_bytes"] == 4 * GB and d["gpu"]["fits"] is False
