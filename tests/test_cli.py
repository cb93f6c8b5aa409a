"""The CLI contract of ARCHITECTURE.md: JSON keys, exit codes, one-line errors, no Qt."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vramlab.core.cli import main


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_contract(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama-2-7b", "--method", "lora", "--json")
    assert code == 0
    d = json.loads(out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "components", "phases",
                "total_params", "trainable_params", "setup"):
        assert key in d
    assert sum(d["components"].values()) == d["peak_allocated_bytes"]
    assert d["peak_allocated_bytes"] <= d["peak_reserved_bytes"] <= d["device_used_bytes"]
    assert d["setup"]["lora_rank"] == 8 and d["setup"]["seq_len"] == 512 and d["setup"]["optimizer_impl"] == "foreach"
    assert set(d["phases"]) == {"load", "forward", "backward", "optimizer"}
    assert d["total_params"] == 6738415616


def test_table_names_the_memory_levels(capsys):
    code, out, _ = run(capsys, "estimate", "-m", "qwen2.5-0.5b", "--gpu", "rtx-4090")
    assert code == 0
    assert "max_memory_allocated" in out and "nvidia-smi" in out and "GiB" in out
    assert "fits" in out


@pytest.mark.parametrize(("args", "needle"), [
    (["estimate", "--model", "no-such-model"], "unknown model"),
    (["estimate", "--model", "llama-2-7b", "--batch", "0"], "micro batch"),
    (["estimate", "--model", "llama-2-7b", "--method", "qlora", "--weights", "fp32"], "QLoRA"),
    (["estimate", "--model", "llama-2-7b", "--bogus"], "unrecognized arguments"),
    (["estimate", "--model", "llama-2-7b", "--optimizer", "adamx"], "invalid choice"),
    (["estimate", "--model", "llama-2-7b", "--gpu", "rtx-9999"], "unknown GPU"),
    (["estimate", "--model", "/nonexistent/config.json"], "no such file"),
    (["estimate", "--model", "llama-2-7b", "--attention", "flashy"], "invalid choice"),
    (["simulate", "--model", "llama-2-7b", "--steps", "0"], "at least 1"),
    (["profile", "--model", "llama-2-7b", "--steps", "-1"], "at least 1"),
    (["fit", "--model", "llama-2-7b"], "--gpu"),
    (["fit", "--model", "llama-2-7b", "--gpu", "rtx-4090", "--target-batch", "0"], "must be from 1"),
    (["fit", "--model", "llama-2-7b", "--gpu", "rtx-4090", "--margin", "1.5"], "margin"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    code, out, err = run(capsys, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and needle in err


def test_broken_config_file(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text("{ not json")
    code, _, err = run(capsys, "estimate", "--model", str(cfg))
    assert code == 2 and str(cfg) in err and err.count("\n") == 1


def test_list_models_and_gpus(capsys):
    code, out, _ = run(capsys, "estimate", "--list-models")
    assert code == 0 and "llama-2-7b" in out and len(out.splitlines()) >= 20
    code, out, _ = run(capsys, "estimate", "--list-gpus")
    assert code == 0 and "rtx-4090" in out and len(out.splitlines()) >= 20
    code, out, _ = run(capsys, "estimate", "--list-models", "--json")
    models = {m["id"]: m for m in json.loads(out)}
    assert code == 0 and models["llama-2-7b"]["param_count"] == 6738415616
    code, out, _ = run(capsys, "estimate", "--list-gpus", "--json")
    assert code == 0 and {g["id"] for g in json.loads(out)} >= {"rtx-4090", "h100-sxm"}


def test_fit_json(capsys):
    code, out, _ = run(capsys, "fit", "-m", "llama-3.1-8b", "--method", "qlora", "--gpu", "rtx-4090",
                       "--target-batch", "32", "--json")
    d = json.loads(out)
    assert code == 0 and d["max_micro_batch"] >= 1 and d["effective_batch"] >= 32
    assert d["suggestion"]["micro_batch"] <= d["max_micro_batch"]


def test_fail_if_oom_exit_code(capsys):
    code, _, _ = run(capsys, "estimate", "-m", "llama-2-70b", "--gpu", "rtx-4090", "--fail-if-oom")
    assert code == 3


def test_gpus_without_a_driver(capsys):
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and out.strip()


def test_simulate_json(capsys):
    code, out, _ = run(capsys, "simulate", "-m", "smollm2-135m", "--method", "qlora", "--seq", "128", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["level"] == "simulate" and sum(d["components"].values()) == d["peak_allocated_bytes"]
    assert d["alive_at_peak"]


def test_the_installed_command_runs_headless():
    p = subprocess.run([sys.executable, "-m", "vramlab.core.cli", "estimate", "-m", "gpt2", "--json"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model"] == "gpt2"


@pytest.mark.parametrize(("flags", "weights", "impl"), [
    (["--method", "qlora"], "nf4", "foreach"),  # QLoRA brings a quantized base
    (["--method", "qlora", "--weights", "int8"], "int8", "foreach"),  # unless the same edit names one
    (["--preset", "qlora-nf4", "--method", "lora"], "bf16", "foreach"),  # LoRA on the preset's nf4: a float base
    (["--method", "lora", "--optimizer", "adamw8bit"], "bf16", "bitsandbytes"),  # 8-bit: no torch implementation
])
def test_the_cli_completes_an_edit_as_the_window_does(capsys, flags, weights, impl):
    """One rule (core.spec.edits.follow_changes) for what follows from a method or optimizer change; the window's
    editors apply the same (tests/gui/test_setup_panel.py)."""
    code, out, err = run(capsys, "estimate", "-m", "llama-2-7b", *flags, "--json")
    assert code == 0, err
    setup = json.loads(out)["setup"]
    assert setup["weights"] == weights
    assert setup["optimizer_impl"] == impl


# ---- advise and compare (issue 27, item 8) -------------------------------------------------------------------

def test_compare_defaults_to_full_lora_qlora_of_the_setup(capsys):
    code, out, _ = run(capsys, "compare", "-m", "llama-2-7b", "--seq", "1024", "--gpu", "4090", "--json", "--fast")
    assert code == 0
    d = json.loads(out)
    names = [r["name"] for r in d["rows"]]
    assert names == ["Full - AMP BF16", "LoRA - BF16", "QLoRA - NF4"]
    full, lora, qlora = (r["result"] for r in d["rows"])
    assert all(r["setup"]["seq_len"] == 1024 for r in (full, lora, qlora))
    assert full["setup"]["method"] == "full" and full["setup"]["weights"] == "fp32" and full["setup"]["amp"] is True
    assert full["device_used_bytes"] > lora["device_used_bytes"] > qlora["device_used_bytes"]
    assert [full["gpu"]["fits"], qlora["gpu"]["fits"]] == [False, True]
    # the same setup estimated alone gives the same bytes
    code, out, _ = run(capsys, "estimate", "-m", "llama-2-7b", "--seq", "1024", "--preset", "full-amp-bf16",
                       "--gpu", "4090", "--json", "--fast")
    assert json.loads(out)["device_used_bytes"] == full["device_used_bytes"]


def test_compare_any_presets_and_objectives_as_a_table_and_markdown(capsys):
    args = ["compare", "-m", "qwen2.5-0.5b", "--presets", "lora-bf16,qlora-nf4", "--objectives", "sft,dpo",
            "--fast", "--gpu", "4090"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    title, *rest = out.splitlines()
    assert "SFT / DPO" in title
    table = "\n".join(rest)
    for name in ("LoRA - BF16 · SFT", "LoRA - BF16 · DPO", "QLoRA - NF4 · SFT", "QLoRA - NF4 · DPO"):
        assert name in table
    assert "Fits GeForce RTX 4090" in table
    code, out, _ = run(capsys, *args, "--markdown")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("# ")
    rows = [line for line in lines if line.startswith("| ")]
    assert len(rows) == 1 + 4 and rows[0].startswith("| Setup |")
    assert all(row.count("|") == rows[0].count("|") for row in rows)


def test_compare_names_what_it_cannot_run_and_refuses_unknown_names(capsys):
    code, out, _ = run(capsys, "compare", "-m", "qwen2.5-0.5b", "--objectives", "grpo", "--num-generations", "3",
                       "--json", "--fast")
    assert code == 0  # GRPO takes a number of generations that divides its batch, as the window's comparison does
    assert json.loads(out)["rows"][0]["result"]["setup"]["objective"] == "grpo"
    code, out, _ = run(capsys, "compare", "-m", "qwen2.5-vl-7b", "--images", "1", "--fast", "--presets",
                       "full-amp-bf16,lora-bf16", "--objectives", "sft,dpo,orpo")
    assert code == 0  # TRL's ORPOTrainer gives a VLM no images: the ORPO columns say why they are not run
    table, notes = out.split("\n\n", 2)[1:]
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "GiB" in rows["Full - AMP BF16 · SFT"] and "GiB" in rows["LoRA - BF16 · DPO"]
    assert "not run" in rows["LoRA - BF16 · ORPO"]
    assert "LoRA - BF16 · ORPO: not run: " in notes and "the images never reach" in notes
    code, _, err = run(capsys, "compare", "-m", "qwen2.5-0.5b", "--presets", "full-nope")
    assert code == 2 and "unknown preset 'full-nope'" in err
    code, _, err = run(capsys, "compare", "-m", "qwen2.5-0.5b", "--objectives", "ppo")
    assert code == 2 and "unknown objective 'ppo'" in err


@pytest.mark.parametrize(("objective", "word"), [("dpo", "DPO"), ("grpo", "GRPO")])
def test_the_title_line_says_the_objective(capsys, objective, word):
    code, out, _ = run(capsys, "estimate", "-m", "qwen2.5-0.5b", "--method", "lora", "--objective", objective,
                       "--batch", "8", "--fast")
    assert code == 0
    assert f"· {word}," in out.splitlines()[0]


def test_advise_ranks_changes_and_searches_the_fit(capsys):
    code, out, _ = run(capsys, "advise", "-m", "llama-3.1-8b", "--method", "lora", "--seq", "2048", "--gpu", "4090",
                       "--fast", "--json")
    assert code == 0
    d = json.loads(out)
    assert set(d) >= {"objective", "result", "savings", "fit", "allocator_advice", "checklist"}
    saved = [s["saves_bytes"] for s in d["savings"]]
    assert saved == sorted(saved, reverse=True) and saved[0] > 0
    assert d["result"]["gpu"]["fits"] is False and d["fit"]["fits_now"] is False
    assert any(s["fits"] for s in d["savings"])
    code, out, _ = run(capsys, "advise", "-m", "llama-3.1-8b", "--method", "lora", "--seq", "2048", "--gpu", "4090",
                       "--fast")
    assert code == 0
    for heading in ("VRAM Lab advice", "Changes that save memory", "Fit search:", "Before you train:"):
        assert heading in out
    assert out.count("Turn on gradient checkpointing") == 1  # the savings once, not again under the fit search


def test_no_library_future_warning_in_the_output_of_a_traced_model(tmp_path):
    """Issue 27: a traced model with checkpointing printed transformers' FutureWarning for
    gradient_checkpointing_enable (deprecated in 5.x; Trainer calls activation_checkpointing_enable)."""
    import os

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "VRAMLAB_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-m", "vramlab.core.cli", "estimate", "-m", str(tmp_path / "config.json"),
                           "--source", "traced", "--grad-ckpt", "--method", "lora", "--seq", "64", "--fast"],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "source of the step: traced" in done.stdout
    assert "Warning:" not in done.stderr and "warnings.warn" not in done.stderr


def test_a_first_trace_reports_to_the_command_without_a_module_global(tmp_path, capsys, monkeypatch):
    """Issue 26: the command line set ``traced.DEFAULT_PROGRESS`` (a module global every later caller in the
    process inherited) for a trace to report on stderr; the progress is passed to the estimate instead."""
    from vramlab.core import traced

    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path / "cache"))  # a first trace: nothing cached
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run(capsys, "estimate", "-m", str(tmp_path / "config.json"), "--source", "traced",
                         "--seq", "64", "--fast")
    assert code == 0, err
    assert "trace of " in err and "source of the step: traced" in out
    assert getattr(traced, "DEFAULT_PROGRESS", None) is None


def test_a_cpu_profile_prints_no_reserved_or_device_rows(tmp_path, capsys):
    """Issue 27: on the CPU there is no caching allocator and no GPU; the table printed both rows anyway."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, _ = run(capsys, "profile", "-m", str(tmp_path / "config.json"), "--device", "cpu", "--seq", "32",
                       "--steps", "1", "--in-process", "--gpu", "4090")
    assert code == 0
    assert "Tensor peak (max_memory_allocated)" in out
    assert "Allocator reserved" not in out and "Device used (nvidia-smi)" not in out
    assert "resident memory" in out and "RTX 4090" not in out  # no verdict against a GPU it did not run on
