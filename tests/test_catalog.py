"""GPU names as people type them and as nvidia-smi and cloud consoles print them (issue 27, item 6)."""

from __future__ import annotations

import json

import pytest

from vramlab.core.catalog import find_gpu, gpus, match_gpu
from vramlab.core.checks import SetupError
from vramlab.core.cli import main
from vramlab.core.units import GB, GiB, MiB


@pytest.mark.parametrize(("text", "gpu_id"), [
    ("4090", "rtx-4090"), ("RTX 4090", "rtx-4090"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("3090", "rtx-3090"), ("3090 Ti", "rtx-3090-ti"), ("5090", "rtx-5090"),
    # nvidia-smi's names
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"), ("NVIDIA L40S", "l40s"), ("NVIDIA RTX 6000 Ada Generation",
                                                                             "rtx-6000-ada"),
    ("NVIDIA A10G", "a10g"), ("Tesla V100-SXM2-32GB", "v100-32gb"), ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA GeForce RTX 3060", "rtx-3060-12gb"),
    # cloud consoles and what people write
    ("A100-SXM4-80GB", "a100-80gb"), ("H100 PCIe", "h100-pcie"), ("H100 SXM", "h100-sxm"), ("H100 SXM5", "h100-sxm"),
    ("L40S", "l40s"), ("RTX 6000 Ada", "rtx-6000-ada"), ("RTX A6000", "rtx-a6000"), ("A6000", "rtx-a6000"),
    ("nvidia-tesla-t4", "t4"), ("nvidia-l4", "l4"), ("nvidia-h100-80gb", "h100-sxm"), ("rtx 4090 24GB", "rtx-4090"),
    ("L40S 48 GB", "l40s"), ("MI300X", "mi300x"), ("1x H100 (80 GB SXM5)", "h100-sxm"),
    ("gpu_1x_h100_sxm5", "h100-sxm"),
])
def test_gpu_names_people_and_drivers_write(text, gpu_id):
    assert find_gpu(text).id == gpu_id


def test_every_catalogue_gpu_is_found_by_its_id_and_by_the_driver_style_name():
    for g in gpus():
        assert match_gpu(g.id) == g
        assert match_gpu(f"NVIDIA {g.name}") == g


@pytest.mark.parametrize(("text", "ids"), [
    ("h100", "h100-pcie, h100-sxm, h100-nvl"), ("a100", "a100-40gb, a100-80gb, a100-80gb-pcie"),
    ("RTX 6000", "rtx-6000-ada, rtx-pro-6000-blackwell"), ("A100 SXM", "a100-40gb, a100-80gb"),
])
def test_a_name_of_several_gpus_lists_them(text, ids):
    with pytest.raises(SetupError, match=f"names {len(ids.split(','))} GPUs: {ids}"):
        find_gpu(text)


def test_a_size_in_the_name_must_be_the_gpus():
    assert match_gpu("RTX 4090 48GB") is None
    assert match_gpu("H100 40GB") is None


@pytest.mark.parametrize("text", ["24GB", "24 GB", "24gb", "24G", "24g"])
def test_a_whole_number_of_gb_is_the_card_of_that_size(text):
    gpu = find_gpu(text)
    assert gpu.memory_bytes == 24 * GiB
    assert "24 GB card" in gpu.name
    # what users mean: the memory of the 24 GB cards they own, not 24 x 10^9 bytes (22.35 GiB)
    for card in ("rtx-4090", "rtx-3090", "rtx-a5000"):
        assert abs(gpu.memory_bytes - find_gpu(card).memory_bytes) <= 16 * MiB


@pytest.mark.parametrize(("text", "size"), [("24GiB", 24 * GiB), ("24 GiB", 24 * GiB), ("22.5GB", 22.5 * GB),
                                            ("24000MB", 24 * GB), ("24576MiB", 24 * GiB)])
def test_an_explicit_size_stays_that_size_and_says_so(text, size):
    gpu = find_gpu(text)
    assert gpu.memory_bytes == size
    assert "card" not in gpu.name and "as given" in gpu.name


def test_cli_says_which_reading_of_a_size_it_took(capsys):
    code = main(["estimate", "-m", "gpt2", "--gpu", "24GB", "--fast", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["gpu"]["memory_bytes"] == 24 * GiB
    assert "read as a 24 GB card" in err
    code = main(["estimate", "-m", "gpt2", "--gpu", "24GiB", "--fast"])
    out, err = capsys.readouterr()
    assert code == 0 and "24GiB as given" in out and "card" not in out + err
    code = main(["estimate", "-m", "gpt2", "--gpu", "4090", "--fast"])
    out, err = capsys.readouterr()
    assert code == 0 and "GeForce RTX 4090" in out


@pytest.mark.parametrize("text", ["24GB", "22.5GB", "24GiB", "rtx-4090"])
def test_a_gpu_is_found_again_by_its_own_id(text):
    """A saved comparison names its GPU by id: a size typed earlier comes back as the same memory."""
    gpu = find_gpu(text)
    again = find_gpu(gpu.id)
    assert again.id == gpu.id and again.memory_bytes == gpu.memory_bytes
