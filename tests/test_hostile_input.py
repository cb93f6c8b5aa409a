"""Hostile and extreme input (issue 13): each case a careless or adversarial user found, held to the contract
of DESIGN.md: a right answer, or exit 2 with one line naming the bound; never a traceback, a wrong GPU, a
negative or wrapped number, invalid JSON or a lost file."""

from __future__ import annotations

import json
import math

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


# ---- 2. a failed write never loses the old file -------------------------------------------------------------

def _disk_full_halfway(monkeypatch):
    """os.fsync fails as on a full disk, after part of the new content is written."""
    def fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", fsync)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    from vramlab.core.fileio import write_atomic, write_json

    target = tmp_path / "scenarios.json"
    write_json(target, {"old": True})
    before = target.read_bytes()
    _disk_full_halfway(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, "x" * 100_000)
    assert target.read_bytes() == before and json.loads(before) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["scenarios.json"]


def test_calibration_save_on_a_full_disk_keeps_the_old_calibration(tmp_path, monkeypatch):
    from vramlab.core.calibration import Calibration, for_gpu, save

    path = tmp_path / "calibration.json"
    save(Calibration("NVIDIA L4", 400 * 2**20, 1.0), path)
    _disk_full_halfway(monkeypatch)
    with pytest.raises(OSError):
        save(Calibration("NVIDIA A10", 300 * 2**20, 1.0), path)
    assert for_gpu("NVIDIA L4", path).context_bytes == 400 * 2**20


def test_json_we_write_never_holds_nan(tmp_path):
    from vramlab.core.fileio import write_json

    with pytest.raises(ValueError):
        write_json(tmp_path / "x.json", {"alpha": math.nan})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("text", "needle"), [
    ("[" * 100_000 + "]" * 100_000, "nests deeper"),
    ('{"micro_batch": ' + "9" * 5000 + "}", "digits"),
    ('{"lora_alpha": NaN}', "NaN"),
    ('{"x": Infinity}', "Infinity"),
    ("{ broken", "not valid JSON"),
])
def test_hostile_json_files_are_one_line_problems(tmp_path, text, needle):
    from vramlab.core.fileio import FileProblem, read_json_file

    path = tmp_path / "f.json"
    path.write_text(text)
    with pytest.raises(FileProblem, match=needle) as e:
        read_json_file(path)
    assert "\n" not in str(e.value)
