"""Hostile and extreme input (issue 13): each case a careless or adversarial user found, held to the contract
of ARCHITECTURE.md: a right answer, or exit 2 with one line naming the bound; never a traceback, a wrong GPU, a
negative or wrapped number, invalid JSON or a lost file."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from vramlab.core.catalog import find_gpu
from vramlab.core.checks import SetupError
from vramlab.core.cli import main
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

@pytest.mark.parametrize(("text", "size"), [("1GB", GiB), ("1G", GiB), ("41GB", 41 * GiB), ("4GB", 4 * GiB),
                                            ("24GiB", 24 * GiB), ("12288MiB", 12 * GiB), ("22.5GB", 22.5 * GB)])
def test_a_typed_size_is_that_size_not_a_gpu_whose_name_contains_it(text, size):
    gpu = find_gpu(text)
    assert gpu.memory_bytes == size and gpu.id.startswith(("custom", "card"))


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
    assert code == 0 and d["gpu"]["memory_bytes"] == 4 * GiB and d["gpu"]["fits"] is False


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


# ---- 3. saved settings: every value checked, a bad one replaced by its default ---------------------------------

@pytest.mark.parametrize(("text", "needle"), [
    (json.dumps({"micro_batch": 3_000_000_000}), "micro batch must be from 1"),
    ('{"method": "lora", "lora_rank": NaN}', "NaN"),
    ("[" * 50_000 + "]" * 50_000, "nests deeper"),
    ('{"seq_len": ' + "9" * 5000 + "}", "digits"),
    (json.dumps({"grad_ckpt": "no"}), "gradient checkpointing must be true or false"),
    (json.dumps({"lora_targets": [1, 2]}), "LoRA targets"),
    (json.dumps({"method": "qlora", "weights": "bf16"}), "QLoRA quantizes"),
    (json.dumps([1, 2]), "expected an object"),
])
def test_saved_setup_values_are_repaired_one_by_one_with_the_cli_rules(text, needle):
    from vramlab.core.fileio import FileProblem, parse_json
    from vramlab.core.spec.edits import repair_setup_fields
    from vramlab.core.spec.training import TrainingSetup

    try:
        data = parse_json(text, "saved setup")
    except FileProblem as e:
        assert needle in str(e)
        return
    fields, problems = repair_setup_fields({**data, "seq_len": 1024} if isinstance(data, dict) else data)
    assert len(problems) == 1 and needle in problems[0] and "using" in problems[0]
    setup = TrainingSetup().replace(**fields)
    setup.validate()
    assert setup.micro_batch == 1 and setup.grad_ckpt is False


# ---- 4. numbers out of range are refused with the bound -------------------------------------------------------

@pytest.mark.parametrize(("args", "needle"), [
    (["--batch", "4294967296"], "micro batch must be from 1 to 1,048,576"),
    (["--batch", "268435456"], "micro batch must be from 1 to 1,048,576"),
    (["--seq", "8589934592"], "sequence length must be from 1 to 134,217,728"),
    (["--gpus", "99999999999"], "GPU count must be from 1 to 65,536"),
    (["--grad-accum", "9" * 30], "gradient accumulation must be from 1"),
    (["--method", "lora", "--lora-alpha", "nan"], "LoRA alpha must be a finite number"),
    (["--method", "lora", "--lora-alpha", "inf"], "LoRA alpha must be a finite number"),
    (["--method", "lora", "--lora-dropout", "nan"], "LoRA dropout must be a finite number"),
    (["--batch", "1048576", "--seq", "134217728"], "more than 4 EiB"),
    (["--gpu", "inf"], "unknown GPU"),
    (["--gpu", "1e999GB"], "GPU"),
])
def test_absurd_numbers_are_refused_with_the_bound(capsys, args, needle):
    assert needle in refused(capsys, "estimate", "-m", "gpt2", "--fast", *args)


def test_the_largest_batch_allowed_answers_more_than_a_smaller_one(capsys):
    """int64 wrap-around gave a smaller answer for a larger batch; within the bounds it cannot."""
    peaks = []
    for batch in ("65536", "1048576"):
        code, out, _ = run(capsys, "estimate", "-m", "gpt2", "--batch", batch, "--fast", "--json")
        assert code == 0
        peaks.append(json.loads(out)["peak_allocated_bytes"])
    assert 0 < peaks[0] < peaks[1] < 2**62


def _config(tmp_path, **changes) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
           "vocab_size": 1000, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    cfg.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"hidden_size": 1e30}, "hidden_size must be a whole number"),
    ({"hidden_size": 10**30, "num_attention_heads": 8, "num_key_value_heads": 8},
     "hidden_size must be from 1 to 131,072"),
    ({"num_hidden_layers": 10_000}, "num_layers must be from 1 to 1,024"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 100_000,
      "num_experts_per_tok": 2}, "num_experts must be from 0 to 1,024"),
    ({"vocab_size": 10**12}, "vocab_size must be from 1 to 4,194,304"),
])
def test_absurd_configs_are_refused_quickly_with_the_bound(capsys, tmp_path, changes, needle):
    assert needle in refused(capsys, "estimate", "-m", _config(tmp_path, **changes), "--fast")


def test_a_view_chain_as_long_as_a_thousand_experts_does_not_recurse():
    """~1,000 experts overflowed Python's recursion limit: dropping a chain of views recursed once per view."""
    from vramlab.core.estimator.engine import Engine
    from vramlab.core.kinds import Kind

    e = Engine()
    h = e.alloc(4096, Kind.ACTIVATIONS)
    chain = [h]
    for _ in range(5000):
        chain.append(e.view(chain[-1]))
    for v in chain[:-1]:  # each one's own reference; each is still held by the view made from it
        e.drop(v)
    assert not any(v.freed for v in chain)
    e.drop(chain[-1])  # frees the whole chain, 5,001 deep
    assert all(v.freed for v in chain)


def test_a_negative_position_table_is_refused_not_a_negative_parameter_count(capsys, tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
           "n_positions": -1_000_000, "vocab_size": 100, "activation_function": "gelu_new"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert "max_position_embeddings must be from 1" in refused(capsys, "estimate", "-m", str(path), "--fast")


def test_a_five_thousand_digit_integer_in_a_config_or_header_is_one_line(capsys, tmp_path):
    path = _config(tmp_path)
    text = open(path).read().replace('"hidden_size": 256', '"hidden_size": ' + "9" * 5000)
    open(path, "w").write(text)
    assert "too long" in refused(capsys, "estimate", "-m", path, "--fast")
    _config(tmp_path)
    header = ('{"model.embed_tokens.weight": {"dtype": "BF16", "shape": [1000, ' + "9" * 5000
              + '], "data_offsets": [0, 512000]}}').encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(512_000))
    assert "too long" in refused(capsys, "estimate", "-m", str(tmp_path), "--fast")


def test_an_infinite_or_absurd_gpu_size_is_refused():
    from vramlab.core.spec.gpu import GpuSpec

    for memory in (math.inf, 10**30, -1, 0, "24GiB", True):
        with pytest.raises(SetupError, match="memory"):
            GpuSpec.from_dict({"id": "x", "name": "x", "memory_bytes": memory})


# ---- 6. environment and side files ------------------------------------------------------------------------------

def test_an_alloc_conf_we_cannot_read_is_a_warning_from_the_environment_and_an_error_as_a_flag(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128MB")
    code, out, err = run(capsys, "estimate", "-m", "gpt2", "--json")
    assert code == 0 and json.loads(out)["peak_reserved_bytes"] > 0
    assert err.count("\n") == 1 and "PYTORCH_CUDA_ALLOC_CONF ignored" in err and "128MB" in err
    for bad in ("max_split_size_mb:128MB", "expandable_segments:yes", "max_split_size_mb:8", "junk"):
        refused(capsys, "estimate", "-m", "gpt2", "--alloc-conf", bad)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6,expandable_segments:True")
    code, _out, err = run(capsys, "estimate", "-m", "gpt2")
    assert code == 0 and err == ""


@pytest.mark.parametrize("content", [
    "{ broken",
    "[" * 10_000 + "]" * 10_000,
    json.dumps({"rtx4090": {"gpu_name": 5, "context_bytes": 1, "slack_ratio": 1.0}}),
    json.dumps({"rtx4090": {"gpu_name": "NVIDIA GeForce RTX 4090", "context_bytes": -10 * 2**30,
                            "slack_ratio": 1.0}}),
    '{"rtx4090": {"gpu_name": "NVIDIA GeForce RTX 4090", "context_bytes": 400000000, "slack_ratio": NaN}}',
    json.dumps({"rtx4090": {"gpu_name": "NVIDIA GeForce RTX 4090", "context_bytes": 4e8, "slack_ratio": 1}}),
    json.dumps({"rtx4090": ["not", "an", "object"]}),
    json.dumps(["a list"]),
])
def test_a_damaged_calibration_is_ignored_with_a_warning(capsys, monkeypatch, tmp_path, caplog, content):
    monkeypatch.setenv("VRAMLAB_CONFIG_DIR", str(tmp_path))
    (tmp_path / "calibration.json").write_text(content)
    code, out, _err = run(capsys, "estimate", "-m", "gpt2", "--gpu", "rtx-4090", "--json")
    d = json.loads(out)
    assert code == 0 and not d.get("calibration")
    assert d["peak_allocated_bytes"] <= d["peak_reserved_bytes"] <= d["device_used_bytes"]
    assert d["gpu"]["headroom_bytes"] < d["gpu"]["memory_bytes"]
    assert any("calibration" in r.getMessage() for r in caplog.records)


# ---- 7. processes: bounded flags, host memory checked before a CPU profile allocates ------------------------------

@pytest.mark.parametrize(("args", "needle"), [
    (["profile", "--timeout", "0"], "more than 0"),
    (["profile", "--timeout", "-5"], "more than 0"),
    (["profile", "--timeout", "nan"], "more than 0"),
    (["profile", "--timeout", "inf"], "more than 0"),
    (["profile", "--steps", "1000000"], "give 1 to 100"),
    (["simulate", "--steps", "101"], "give 1 to 100"),
    (["fit", "--gpu", "rtx-4090", "--target-batch", "1" + "0" * 24], "must be from 1 to 1,073,741,824"),
])
def test_run_flags_are_bounded(capsys, args, needle):
    assert needle in refused(capsys, *args[:1], "-m", "gpt2", *args[1:])


def test_a_cpu_profile_that_cannot_fit_host_memory_is_refused_before_it_allocates(capsys, monkeypatch):
    import psutil

    from vramlab.core.catalog import find_model
    from vramlab.core.profiling.profile import check_host_memory
    from vramlab.core.spec.training import TrainingSetup

    with pytest.raises(SetupError, match="available"):
        check_host_memory(find_model("llama-2-7b"), TrainingSetup(), available=16 * GiB)
    check_host_memory(find_model("gpt2"), TrainingSetup(), available=16 * GiB)  # 1.2 GiB of tensors: fine

    class Tiny:
        available = 2 * GiB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny)
    err = refused(capsys, "profile", "-m", "llama-2-7b", "--device", "cpu")
    assert "vramlab simulate" in err


def test_flags_that_do_not_apply_are_named_not_silently_ignored(capsys):
    code, out, _err = run(capsys, "estimate", "-m", "gpt2", "--lora-rank", "16", "--trainable-layers", "2",
                          "--loss-chunks", "4", "--fast", "--json")
    warnings = json.loads(out)["warnings"]
    assert code == 0
    assert any("--lora-rank" in w and "full fine-tuning" in w for w in warnings)
    assert any("--trainable-layers" in w for w in warnings) and any("--loss-chunks" in w for w in warnings)
    code, out, _err = run(capsys, "estimate", "-m", "gpt2", "--method", "lora", "--lora-rank", "16", "--fast",
                          "--json")
    assert not any("does not apply" in w for w in json.loads(out)["warnings"])


# ---- 8. paths, output and temporary folders ---------------------------------------------------------------------

@pytest.mark.parametrize("model", ["/tmp/" + "a" * 300 + "/config.json", "b" * 300, "/tmp/x\ny/config.json"])
def test_odd_paths_are_one_line(capsys, model):
    err = refused(capsys, "estimate", "-m", model)
    assert "[Errno" not in err


def test_output_to_a_full_device_is_one_line_not_a_traceback():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    code = "import sys; from vramlab.core.cli import main; sys.exit(main(sys.argv[1:]))"
    for extra in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            p = subprocess.run([sys.executable, "-c", code, "estimate", "-m", "gpt2", "--fast", *extra], stdout=full,
                               stderr=subprocess.PIPE, text=True, timeout=120, check=False)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert "No space left on device" in p.stderr and "Traceback" not in p.stderr


def test_the_self_test_leaves_no_temporary_folder(monkeypatch, tmp_path, capsys):
    import tempfile

    from vramlab.app import selftest

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("VRAMLAB_CONFIG_DIR")
    for name in ("check_build", "check_resources", "check_estimate", "check_simulate"):
        monkeypatch.setattr(selftest, name, lambda: ("skipped here", {}))
    assert selftest.main(["--no-gui", "--no-profile", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert not list(tmp_path.iterdir()) and "VRAMLAB_CONFIG_DIR" not in os.environ


# ---- issue 27, item 10: unsupported inputs end fast and clearly ------------------------------------------------

def _run_python(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=kw.pop("capture", True), text=True, check=False,
                          timeout=120, **kw)


def _one_line_exit_2(done) -> str:
    assert done.returncode == 2, done.stderr
    assert done.stdout in ("", None) and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    return done.stderr


def test_an_empty_gpu_is_refused(capsys):
    assert "--gpu is empty" in refused(capsys, "estimate", "-m", "gpt2", "--gpu", "", "--fast")
    assert "--gpu is empty" in refused(capsys, "fit", "-m", "gpt2", "--gpu", "  ")


@pytest.mark.parametrize(("model_type", "extra"), [
    ("mamba", {"state_size": 16, "conv_kernel": 4}), ("zamba2", {"num_attention_heads": 32, "mamba_d_state": 64}),
    ("falcon_mamba", {"state_size": 16}), ("rwkv", {"attention_hidden_size": 768}),
    ("jamba", {"num_attention_heads": 32, "mamba_d_state": 16}), ("recurrent_gemma", {"num_attention_heads": 10}),
])
def test_a_state_space_config_is_refused_without_building_it(tmp_path, model_type, extra):
    """A Mamba config took 6 s, and 20 s in another run, to be refused after transformers built it: now one line
    from the file alone, before torch or transformers is imported."""
    cfg = {"model_type": model_type, "architectures": [f"{model_type.title()}ForCausalLM"], "hidden_size": 768,
           "num_hidden_layers": 24, "vocab_size": 50280, **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = ("import sys\nfrom vramlab.core.cli import main\n"
            f"code = main(['estimate', '-m', {str(tmp_path / 'config.json')!r}, '--fast'])\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'\n"
            "sys.exit(code)")
    err = _one_line_exit_2(_run_python("-c", code, env={**os.environ, "VRAMLAB_CACHE_DIR": str(tmp_path)}))
    assert model_type in err and ("state-space" in err or "recurrent" in err)


def test_a_config_of_no_language_model_is_refused_without_building_it(tmp_path):
    cfg = {"model_type": "vit", "architectures": ["ViTModel"], "hidden_size": 768, "num_hidden_layers": 12,
           "num_attention_heads": 12, "image_size": 224}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = ("import sys\nfrom vramlab.core.cli import main\n"
            f"code = main(['estimate', '-m', {str(tmp_path / 'config.json')!r}, '--fast'])\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'\n"
            "sys.exit(code)")
    err = _one_line_exit_2(_run_python("-c", code, env={**os.environ, "VRAMLAB_CACHE_DIR": str(tmp_path)}))
    assert "not a language model" in err


def test_closed_stdout_is_one_line_exit_2():
    done = subprocess.run([sys.executable, "-m", "vramlab.core.cli", "estimate", "-m", "gpt2",
                           "--fast"], stderr=subprocess.PIPE, text=True, check=False, timeout=120,
                          preexec_fn=lambda: os.close(1))  # `vramlab estimate ... >&-`
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "standard output is closed" in done.stderr


@pytest.mark.parametrize("stdin", ["garbage\n", "", "[1, 2]\n", '{"spec": 3, "setup": {}}\n',
                                   '{"spec": {"id": "x"}, "setup": {}}\n'])
def test_the_profile_child_given_garbage_is_one_line_exit_2(stdin):
    err = _one_line_exit_2(_run_python("-m", "vramlab.core.profiling.child", input=stdin))
    assert "internal profile process" in err and "vramlab profile" in err


def test_the_frozen_entry_of_the_profile_child_given_garbage_is_one_line_exit_2():
    code = "import sys\nfrom vramlab.app.entry import main\nsys.exit(main(['--profile-child']))"
    _one_line_exit_2(_run_python("-c", code, input="not json\n"))


def test_a_rank_given_a_missing_run_folder_is_one_line_exit_2(tmp_path):
    err = _one_line_exit_2(_run_python("-m", "vramlab.core.profiling.child", "--dist-rank", str(tmp_path / "gone")))
    assert "not a run folder" in err
    assert not (tmp_path / "gone").exists()
