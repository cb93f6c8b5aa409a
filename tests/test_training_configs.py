"""Training-framework configs in (``--config``): each fixture in tests/fixtures/training is written from the
framework's documented keys, and the setup it gives must equal the one written by hand with flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramlab.core.checks import SetupError
from vramlab.core.cli import main
from vramlab.core.sources.config_file import read_config_file
from vramlab.core.sources.training import detect_framework, read_training_configs

FIX = Path(__file__).parent / "fixtures" / "training"
MODEL = ["-m", "llama-2-7b", "--fast", "--json"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def setup_of(capsys, *args: str) -> dict:
    code, out, err = run(capsys, "estimate", *MODEL, *args)
    assert code == 0, err
    return json.loads(out)


CASES = {
    "axolotl full FSDP offload": (
        ["axolotl_full_fsdp.yaml"], ["--gpus", "8"],
        "--method full --weights bf16 --compute bf16 --amp --seq 2048 --batch 1 --grad-accum 8 --optimizer adamw "
        "--optimizer-impl fused "
        "--grad-ckpt --grad-ckpt-reentrant --attention sdpa --sharding fsdp --offload params --gpus 8"),
    "axolotl LoRA": (
        ["axolotl_lora.yaml"], [],
        "--method lora --lora-rank 16 --lora-alpha 32 --lora-dropout 0.05 --lora-targets q_proj,k_proj,v_proj,o_proj "
        "--seq 1024 --batch 4 --grad-accum 2 --optimizer adamw --optimizer-impl foreach --weights bf16 "
        "--compute bf16 --amp --input-grads"),
    "axolotl QLoRA + its ZeRO-2 JSON": (
        ["axolotl_qlora_zero2.yaml"], ["--gpus", "2"],
        "--method qlora --weights nf4 --compute bf16 --amp --lora-rank 32 --lora-alpha 16 --lora-dropout 0.05 "
        "--lora-targets all-linear --seq 4096 --batch 2 --grad-accum 4 --optimizer paged_adamw8bit "
        "--grad-ckpt --grad-ckpt-reentrant "
        "--attention sdpa --sharding zero2 --offload optimizer --gpus 2 --input-grads"),
    "LLaMA-Factory LoRA (defaults: checkpointing on, all targets)": (
        ["llamafactory_lora_sft.yaml"], [],
        "--method lora --lora-rank 8 --lora-dropout 0 --lora-targets all-linear --weights bf16 --compute bf16 --amp "
        "--batch 1 --grad-accum 8 "
        "--grad-ckpt --grad-ckpt-reentrant --optimizer adamw --optimizer-impl fused --seq 2048"),
    "LLaMA-Factory full + ZeRO-3 offload JSON": (
        ["llamafactory_full_zero3.yaml"], ["--gpus", "4"],
        "--method full --weights bf16 --compute bf16 --amp --batch 2 --grad-accum 16 "
        "--grad-ckpt --grad-ckpt-reentrant --seq 1024 "
        "--optimizer adamw --optimizer-impl fused --sharding zero3 --offload params --gpus 4"),
    "LLaMA-Factory QLoRA": (
        ["llamafactory_qlora.yaml"], [],
        "--method qlora --weights nf4 --compute bf16 --amp --lora-rank 16 --lora-targets q_proj,v_proj "
        "--lora-dropout 0 --seq 512 --batch 4 --grad-accum 4 --attention eager --optimizer adamw "
        "--optimizer-impl fused"),
    "TRL SFT QLoRA (defaults: bf16, checkpointing)": (
        ["trl_sft_qlora.yaml"], [],
        "--method qlora --weights nf4 --compute bf16 --amp --lora-rank 64 --lora-alpha 16 --lora-dropout 0.1 "
        "--lora-targets all-linear --attention sdpa --batch 2 --grad-accum 8 --seq 2048 --grad-ckpt "
        "--optimizer paged_adamw8bit --loss-kernel trl --adapter-dtype bf16"),
    "transformers TrainingArguments JSON, fp16": (
        ["training_args.json"], [],
        "--method full --weights fp32 --compute fp16 --amp --batch 4 --grad-accum 2 --grad-ckpt --optimizer adamw "
        "--optimizer-impl foreach"),
    "peft adapter_config.json": (
        ["adapter_config.json"], [],
        "--method lora --lora-rank 16 --lora-alpha 32 --lora-dropout 0.05 --lora-targets all-linear"),
    "accelerate FSDP": (
        ["accelerate_fsdp.yaml"], [], "--gpus 8 --sharding fsdp --offload none --compute bf16"),
    "accelerate DeepSpeed": (
        ["accelerate_deepspeed.yaml"], [],
        "--gpus 4 --sharding zero2 --offload optimizer --grad-accum 4 --compute bf16"),
    "LLaMA-Factory + accelerate FSDP together": (
        ["llamafactory_lora_sft.yaml", "accelerate_fsdp.yaml"], [],
        "--method lora --lora-rank 8 --lora-dropout 0 --lora-targets all-linear --weights bf16 --compute bf16 --amp "
        "--batch 1 --grad-accum 8 "
        "--grad-ckpt --grad-ckpt-reentrant --optimizer adamw --optimizer-impl fused --seq 2048 "
        "--gpus 8 --sharding fsdp --offload none"),
}


# axolotl 0.19.0 and LLaMA-Factory 0.9.5 install transformers releases (5.16.1, <= 5.6.0) whose from_pretrained loads
# models without the Hub kernels that 5.25 turns on by default
for _name, (_files, _extra, _flags) in list(CASES.items()):
    if _name.startswith(("axolotl", "LLaMA-Factory")):
        CASES[_name] = (_files, _extra, _flags + " --no-hub-kernels")


@pytest.mark.parametrize("case", list(CASES))
def test_imported_setup_equals_the_one_written_with_flags(capsys, case):
    files, extra, flags = CASES[case]
    config_args = [a for f in files for a in ("--config", str(FIX / f))]
    imported = setup_of(capsys, *config_args, *extra)
    by_hand = setup_of(capsys, *flags.split())
    assert imported["setup"] == by_hand["setup"]
    assert imported["peak_allocated_bytes"] == by_hand["peak_allocated_bytes"]
    assert [f["path"] for f in imported["setup_source"]["files"]][: len(files)] == [str(FIX / f) for f in files]


def test_flags_override_the_config_and_the_mapping_says_so(capsys):
    d = setup_of(capsys, "--config", str(FIX / "axolotl_lora.yaml"), "--lora-rank", "64")
    assert d["setup"]["lora_rank"] == 64 and d["setup"]["seq_len"] == 1024
    row = next(r for r in d["setup_source"]["mapping"] if r["key"] == "lora_r")
    assert row["setting"] == 16 and row["overridden_by"] == "--lora-rank"


def test_frameworks_differ_in_their_checkpointing_default(capsys):
    """The same absence means checkpointing on in LLaMA-Factory and TRL, off in axolotl and transformers."""
    src = read_training_configs([FIX / "llamafactory_lora_sft.yaml"])
    assert src.changes["grad_ckpt"] is True
    row = next(r for r in src.rows if r.field == "grad_ckpt")
    assert row.status == "default" and "LLaMA-Factory" in row.note
    assert read_training_configs([FIX / "axolotl_lora.yaml"]).changes["grad_ckpt"] is False


def test_table_before_the_answer_names_keys_defaults_and_not_modelled(capsys):
    code, out, _ = run(capsys, "estimate", "-m", "llama-2-7b", "--fast", "--gpus", "2",
                       "--config", str(FIX / "axolotl_qlora_zero2.yaml"))
    assert code == 0
    head, _, answer = out.partition("VRAM Lab estimate")
    assert "axolotl" in head and "DeepSpeed" in head
    assert "sample_packing" in head and "not modelled" in head
    assert "lora_r" in head and "lora_rank = 32" in head
    assert "zero_optimization.stage" in head and "sharding = zero2" in head
    assert "Tensor peak" in answer


def test_json_names_the_version_whose_defaults_are_followed(capsys):
    d = setup_of(capsys, "--config", str(FIX / "trl_sft_qlora.yaml"))
    f = d["setup_source"]["files"][0]
    assert f["framework"] == "TRL SFTConfig" and "TRL" in f["defaults_followed"]
    statuses = {r["status"] for r in d["setup_source"]["mapping"]}
    assert {"set", "default"} <= statuses


def test_an_unmodelled_optimizer_is_refused_unless_a_flag_sets_it(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("base_model: x/y\nadapter: lora\nlora_r: 8\noptimizer: adamw_anyprecision\n")
    code, out, err = run(capsys, "estimate", "-m", "llama-2-7b", "--fast", "--config", str(cfg))
    assert code == 2 and out == "" and err.count("\n") == 1 and "optimizer" in err and "adamw_anyprecision" in err
    code, _, _ = run(capsys, "estimate", "-m", "llama-2-7b", "--fast", "--config", str(cfg), "--optimizer", "adamw")
    assert code == 0


@pytest.mark.parametrize(("text", "needle"), [
    ("base_model: [unclosed\n", "not valid YAML"),
    ("!!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
    ("- just\n- a list\n", "mapping"),
    ("learning_rate: 1.0\n", "cannot tell which framework"),
    ("base_model: x\nmicro_batch_size: -3\n", "micro_batch_size"),
    ("base_model: x\ngradient_checkpointing: maybe\n", "gradient_checkpointing"),
])
def test_bad_config_files_are_one_line_exit_2(capsys, tmp_path, text, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    code, out, err = run(capsys, "estimate", "-m", "llama-2-7b", "--fast", "--config", str(cfg))
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err


def test_the_model_may_come_from_the_config(capsys, tmp_path):
    cfg = tmp_path / "lf.yaml"
    cfg.write_text("model_name_or_path: qwen2.5-0.5b\nfinetuning_type: full\n")
    code, out, _ = run(capsys, "estimate", "--fast", "--json", "--config", str(cfg))
    d = json.loads(out)
    assert code == 0 and d["setup_source"]["model"] == "qwen2.5-0.5b" and d["total_params"] == 494032768
    code, _, err = run(capsys, "estimate", "--fast")
    assert code == 2 and "--model is required" in err and err.count("\n") == 1


def test_frameworks_are_told_apart_by_their_keys():
    kinds = {p.name: detect_framework(read_config_file(p), p.name) for p in FIX.iterdir()}
    assert kinds["axolotl_lora.yaml"] == "axolotl" and kinds["llamafactory_qlora.yaml"] == "llamafactory"
    assert kinds["trl_sft_qlora.yaml"] == "trl" and kinds["training_args.json"] == "transformers"
    assert kinds["adapter_config.json"] == "peft" and kinds["deepspeed_zero2.json"] == "deepspeed"
    assert kinds["accelerate_fsdp.yaml"] == "accelerate"


def test_a_missing_deepspeed_file_is_named_not_guessed(tmp_path):
    cfg = tmp_path / "ax.yaml"
    cfg.write_text("base_model: x\ndeepspeed: nowhere.json\n")
    src = read_training_configs([cfg])
    row = next(r for r in src.rows if r.key == "deepspeed")
    assert row.status == "not modelled" and "not found" in row.note and "sharding" not in src.changes


def test_a_config_that_is_not_there(tmp_path):
    with pytest.raises(SetupError, match="no such file"):
        read_training_configs([tmp_path / "missing.yaml"])


def test_a_yaml_alias_bomb_is_summarised_not_expanded(capsys, tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
              for i in range(1, 9)]
    lines += ["base_model: x", "adapter: lora", "sample_packing: *a8"]  # 10 x 8^8 strings if expanded
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    d = setup_of(capsys, "--config", str(cfg))
    row = next(r for r in d["setup_source"]["mapping"] if r["key"] == "sample_packing")
    assert row["status"] == "not modelled" and row["value"] == "[…]"


def test_a_device_or_folder_is_not_read_as_a_config(tmp_path):
    with pytest.raises(SetupError, match="not a regular file"):
        read_training_configs([tmp_path])
    with pytest.raises(SetupError, match="not a regular file"):
        read_training_configs(["/dev/zero"])


def _changes(tmp_path, name: str, text: str) -> dict:
    cfg = tmp_path / name
    cfg.write_text(text)
    return dict(read_training_configs([cfg]).changes)


@pytest.mark.parametrize(("name", "text", "reentrant"), [
    # LLaMA-Factory 0.9.5 ModelArguments.use_reentrant_gc defaults to True
    ("lf.yaml", "finetuning_type: lora\n", True),
    ("lf.yaml", "finetuning_type: lora\nuse_reentrant_gc: false\n", False),
    # axolotl 0.19.0 normalize_config: reentrant unless the kwargs, unfrozen_parameters or rl say otherwise
    ("ax.yaml", "base_model: m\ngradient_checkpointing: true\n", True),
    ("ax.yaml", "base_model: m\ngradient_checkpointing: true\nrl: dpo\n", False),
    ("ax.yaml", "base_model: m\ngradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n",
     False),
    # transformers 5 / TRL: gradient_checkpointing_enable's default is use_reentrant False
    ("trl.yaml", "max_length: 512\ngradient_checkpointing: true\n", False),
    ("trl.yaml", "max_length: 512\ngradient_checkpointing: true\ngradient_checkpointing_kwargs:\n"
                 "  use_reentrant: true\n", True),
    ("args.json", '{"output_dir": "o", "gradient_checkpointing": true, '
                  '"gradient_checkpointing_kwargs": "{\\"use_reentrant\\": true}"}', True),
])
def test_the_checkpointing_mode_follows_each_frameworks_default_and_its_kwargs(tmp_path, name, text, reentrant):
    assert _changes(tmp_path, name, text)["ckpt_reentrant"] is reentrant


def test_llamafactory_freeze_keys(tmp_path):
    c = _changes(tmp_path, "lf.yaml", "finetuning_type: freeze\nfreeze_extra_modules: lm_head,wte\n")
    assert c["trainable_layers"] == 2 and c["freeze_extra"] == ("lm_head", "embed_tokens")
    src = read_training_configs([tmp_path / "lf.yaml"])
    cfg = tmp_path / "neg.yaml"
    cfg.write_text("finetuning_type: freeze\nfreeze_trainable_layers: -2\nfreeze_trainable_modules: mlp\n")
    src = read_training_configs([cfg])
    assert "trainable_layers" in src.refused
    assert any(r.key == "freeze_trainable_modules" and r.status == "not modelled" for r in src.rows)


SWIFT_SH = """#!/bin/bash
# LoRA on two GPUs
CUDA_VISIBLE_DEVICES=0,1 NPROC_PER_NODE=2 \\
swift sft \\
    --model Qwen/Qwen2.5-7B-Instruct \\
    --tuner_type lora \\
    --torch_dtype bfloat16 \\
    --per_device_train_batch_size 2 \\
    --lora_rank 16 \\
    --target_modules q_proj v_proj \\
    --max_length 2048 \\
    --deepspeed zero2_offload \\
    --output_dir output
"""


def test_an_ms_swift_command_line_is_read_as_its_arguments(tmp_path):
    cfg = tmp_path / "train.sh"
    cfg.write_text(SWIFT_SH)
    src = read_training_configs([cfg])
    assert src.frameworks == ((str(cfg), "ms-swift"),) and src.model == "Qwen/Qwen2.5-7B-Instruct"
    c = src.changes
    assert (c["method"], c["lora_rank"], c["lora_targets"], c["micro_batch"], c["seq_len"]) == \
        ("lora", 16, ("q_proj", "v_proj"), 2, 2048)
    assert (c["weights"], c["compute"], c["amp"]) == ("bf16", "bf16", True)
    assert (c["sharding"], c["offload"], c["gpus"]) == ("zero2", "optimizer", 2)
    assert c["grad_accum"] == 4  # ceil(16 / 2 / 2): ms-swift's TrainArgumentsMixin
    assert c["lora_alpha"] == 32.0 and c["lora_dropout"] == 0.05 and c["grad_ckpt"] is True
    assert c["ckpt_reentrant"] is True  # DeepSpeed: ms-swift keeps the reentrant checkpoint


def test_an_ms_swift_yaml_with_a_template_key_is_not_llamafactory(tmp_path):
    c = _changes(tmp_path, "sft.yaml", "model: Qwen/Qwen2.5-7B\ntemplate: qwen\nquant_method: bnb\nquant_bits: 4\n"
                                       "max_length: 1024\ntarget_modules: all-linear\n")
    assert (c["method"], c["weights"], c["double_quant"], c["seq_len"]) == ("qlora", "nf4", True, 1024)
    assert c["grad_accum"] == 16 and c["lora_rank"] == 8


@pytest.mark.parametrize(("keys", "compute", "amp"), [
    # ms-swift 4.6.0 ModelArguments._init_mixed_precision: a float32 or float16 model gets fp16 autocast, a bfloat16
    # one bf16, each only where the switch is left None
    ("torch_dtype: float32\n", "fp16", True),
    ("torch_dtype: float32\nfp16: false\n", "fp32", False),
    ("torch_dtype: bfloat16\nbf16: false\n", "bf16", False),
    ("torch_dtype: float32\nbf16: true\n", "bf16", True),
])
def test_ms_swift_autocasts_only_where_its_switch_is_left_unset(tmp_path, keys, compute, amp):
    c = _changes(tmp_path, "sft.yaml", f"model: m\ntuner_type: full\nmax_length: 64\n{keys}")
    assert (c["compute"], c["amp"]) == (compute, amp)


def test_ms_swift_without_max_length_is_refused_unless_a_flag_sets_it(capsys, tmp_path):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text("model: Qwen/Qwen2.5-7B\ntuner_type: full\n")
    code, _out, err = run(capsys, "estimate", *MODEL, "--config", str(cfg))
    assert code == 2 and "max_length" in err and "--seq" in err and "--seq-len" not in err
    assert setup_of(capsys, "--config", str(cfg), "--seq", "512")["setup"]["seq_len"] == 512


def test_ms_swift_grpo_counts_the_completion_on_top_of_the_prompt(tmp_path):
    cfg = tmp_path / "grpo.sh"
    cfg.write_text("swift rlhf --rlhf_type grpo --model m --max_length 1024 --max_completion_length 256 "
                   "--num_generations 4\n")
    c = read_training_configs([cfg]).changes
    assert (c["objective"], c["seq_len"], c["completion_len"], c["num_generations"], c["beta"]) == \
        ("grpo", 1280, 256, 4, 0.04)


# LLaMA-Factory 0.9.5 init_adapter upcasts the trainable parameters to fp32 unless pure_bf16 / use_badam, or under
# DeepSpeed ZeRO-3 without quantization (core/sources/llamafactory.py quotes the rule)
LF_FULL = "model_name_or_path: m\nfinetuning_type: full\nbf16: true\ncutoff_len: 512\n"


@pytest.mark.parametrize(("extra", "weights", "amp"), [
    ("", "fp32", True),  # the upcast: fp32 weights under bf16 autocast
    ("pure_bf16: true\n", "bf16", True),  # bf16 autocast over a bf16 model, nothing upcast
    ("use_badam: true\n", "bf16", True),
    ("deepspeed: ds.json\n", "fp32", True),  # ZeRO-2: the upcast stands
    ("deepspeed: ds3.json\n", "bf16", True),  # ZeRO-3: DeepSpeed's own fp32 master partitions, no upcast
    ("deepspeed: {zero_optimization: {stage: 3}}\n", "bf16", True),  # inline
], ids=["bf16", "pure_bf16", "badam", "zero2", "zero3", "zero3-inline"])
def test_llamafactory_full_trains_fp32_weights_unless_pure_bf16_badam_or_zero3(tmp_path, extra, weights, amp):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    (tmp_path / "ds3.json").write_text('{"zero_optimization": {"stage": 3}}')
    c = _changes(tmp_path, "lf.yaml", LF_FULL + extra)
    assert (c["weights"], c["compute"], c["amp"]) == (weights, "bf16", amp)


@pytest.mark.parametrize(("extra", "flags", "weights"), [
    ("", ["--sharding", "zero3", "--gpus", "4"], "bf16"),  # ZeRO-3 from the command line: no upcast, as from its JSON
    ("", ["--sharding", "zero2", "--gpus", "4"], "fp32"),
    ("deepspeed: ds3.json\n", ["--sharding", "zero2"], "fp32"),  # the JSON's ZeRO-3 overridden: the upcast is back
], ids=["flag-zero3", "flag-zero2", "file-zero3-flag-zero2"])
def test_llamafactory_upcast_follows_the_sharding_the_command_line_sets(capsys, tmp_path, extra, flags, weights):
    """LLaMA-Factory's rule reads the run's ZeRO stage wherever it comes from: ``--sharding zero3`` over its full
    config kept the fp32 weights the file's upcast gave (a ZeRO-3 run that LLaMA-Factory never upcasts)."""
    (tmp_path / "ds3.json").write_text('{"zero_optimization": {"stage": 3}}')
    cfg = tmp_path / "lf.yaml"
    cfg.write_text(LF_FULL + extra)
    out = setup_of(capsys, "--config", str(cfg), *flags)
    assert out["setup"]["weights"] == weights


def test_llamafactory_pure_bf16_under_a_zero3_flag_is_refused_as_llamafactory_refuses_it(capsys, tmp_path):
    cfg = tmp_path / "lf.yaml"
    cfg.write_text(LF_FULL + "pure_bf16: true\n")
    code, _out, err = run(capsys, "estimate", *MODEL, "--config", str(cfg), "--sharding", "zero3", "--gpus", "4")
    assert code == 2 and "pure_bf16" in err and "ZeRO-3" in err


def test_llamafactory_pure_bf16_alone_is_bf16_without_autocast(tmp_path):
    c = _changes(tmp_path, "lf.yaml", "finetuning_type: full\npure_bf16: true\n")
    assert (c["weights"], c["compute"], c["amp"]) == ("bf16", "bf16", False)


def test_llamafactory_full_bf16_estimates_the_fp32_weights_it_trains(capsys, tmp_path):
    cfg = tmp_path / "lf.yaml"
    cfg.write_text(LF_FULL)
    imported = setup_of(capsys, "--config", str(cfg))
    by_hand = setup_of(capsys, "--method", "full", "--weights", "fp32", "--compute", "bf16", "--amp", "--seq", "512",
                       "--batch", "8", "--grad-ckpt", "--grad-ckpt-reentrant", "--optimizer", "adamw",
                       "--optimizer-impl", "fused", "--no-hub-kernels")
    assert imported["setup"] == by_hand["setup"]
    assert imported["peak_allocated_bytes"] == by_hand["peak_allocated_bytes"]
    row = next(r for r in imported["setup_source"]["mapping"] if r["field"] == "weights" and not r.get("overridden_by"))
    assert "init_adapter" in row["note"]


def test_llamafactory_adapters_are_fp32_with_or_without_the_upcast(capsys, tmp_path):
    for extra in ("", "pure_bf16: true\n"):
        cfg = tmp_path / "lf.yaml"
        cfg.write_text("finetuning_type: lora\nbf16: true\n" + extra)
        assert setup_of(capsys, "--config", str(cfg))["setup"]["adapter_dtype"] == "fp32"  # peft's default


@pytest.mark.parametrize(("extra", "weights", "upcast"), [
    ("bf16: true\n", "bf16", True),  # fp32 trained layers beside bf16 frozen ones
    ("fp16: true\n", "fp16", True),  # the frozen ones stay 16-bit (not HF Trainer's fp32 for full training)
    ("bf16: true\npure_bf16: true\n", "bf16", None),
    ("bf16: true\ndeepspeed: {zero_optimization: {stage: 3}}\n", "bf16", None),
    ("", "fp32", None),  # fp32 training: nothing to upcast
], ids=["bf16", "fp16", "pure_bf16", "zero3", "fp32"])
def test_llamafactory_freeze_trains_fp32_layers_beside_frozen_16_bit_ones(tmp_path, extra, weights, upcast):
    c = _changes(tmp_path, "lf.yaml", "finetuning_type: freeze\n" + extra)
    assert (c["weights"], c.get("trainable_fp32")) == (weights, upcast)


def test_llamafactory_freeze_estimates_the_upcast_it_trains(capsys, tmp_path):
    cfg = tmp_path / "lf.yaml"
    cfg.write_text("finetuning_type: freeze\nbf16: true\ncutoff_len: 512\n")
    imported = setup_of(capsys, "--config", str(cfg))
    by_hand = setup_of(capsys, "--method", "freeze", "--trainable-layers", "2", "--weights", "bf16", "--compute",
                       "bf16", "--amp", "--trainable-fp32", "--seq", "512", "--batch", "8", "--grad-ckpt",
                       "--grad-ckpt-reentrant", "--optimizer", "adamw", "--optimizer-impl", "fused", "--no-hub-kernels")
    assert imported["setup"] == by_hand["setup"]
    assert imported["peak_allocated_bytes"] == by_hand["peak_allocated_bytes"]
    cfg.write_text("finetuning_type: freeze\nbf16: true\ncutoff_len: 512\npure_bf16: true\n")
    pure = setup_of(capsys, "--config", str(cfg))  # the same run with its trained layers left in bf16
    # AdamW's two states per trained element, fp32 instead of bf16: two more bytes each
    extra = imported["components"]["optimizer_states"] - pure["components"]["optimizer_states"]
    assert extra == 2 * 2 * imported["trainable_params"]


def test_llamafactory_refuses_pure_bf16_under_zero3(tmp_path):
    with pytest.raises(SetupError, match="incompatible with DeepSpeed ZeRO-3"):
        _changes(tmp_path, "lf.yaml", "finetuning_type: full\npure_bf16: true\n"
                                      "deepspeed: {zero_optimization: {stage: 3}}\n")


@pytest.mark.parametrize(("text", "tuning"), [
    ("finetuning_type: full\nfreeze_vision_tower: false\nfreeze_multi_modal_projector: false\n", "full"),
    ("finetuning_type: full\nfreeze_multi_modal_projector: false\n", "projector"),
    ("finetuning_type: freeze\nfreeze_vision_tower: true\n", "frozen"),
    ("finetuning_type: lora\nfreeze_vision_tower: false\n", "lora"),  # lora_target all: every tower linear
])
def test_llamafactory_vision_switches_set_what_the_tower_and_projector_train(tmp_path, text, tuning):
    """LLaMA-Factory 0.9.5's freeze_vision_tower / freeze_multi_modal_projector (get_forbidden_modules,
    find_all_linear_modules): read as the vision tuning they give; they were ignored, so a config training the
    tower was estimated with it frozen."""
    assert _changes(tmp_path, "lf.yaml", text)["vision_tuning"] == tuning


@pytest.mark.parametrize(("text", "needle"), [
    ("finetuning_type: full\nfreeze_vision_tower: false\n", "projector frozen"),
    ("finetuning_type: lora\nlora_target: q_proj,v_proj\nfreeze_vision_tower: false\n", "lora_target: all"),
    ("finetuning_type: full\nfreeze_language_model: true\n", "frozen language model"),
])
def test_llamafactory_vision_switches_vram_lab_cannot_express_are_refused(tmp_path, text, needle):
    cfg = tmp_path / "lf.yaml"
    cfg.write_text("model_name_or_path: m\n" + text)
    with pytest.raises(SetupError, match=needle):
        read_training_configs([cfg]).check()
