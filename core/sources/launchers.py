"""The configs beside a training config: a peft ``adapter_config.json``, a DeepSpeed JSON (named by a training
config, inline, or given on its own) and an accelerate YAML (DeepSpeed or FSDP plugin)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from vramlab.core.sources import defaults as D
from vramlab.core.sources.keys import read_lora_targets, read_lora_variants
from vramlab.core.sources.mapping import ABSENT, DEFAULT, FRAMEWORKS, NOT_MODELLED, SET, ConfigFile, replace_row


def read_peft(f: ConfigFile) -> None:
    v = FRAMEWORKS["peft"][1]
    base = f.get("base_model_name_or_path")
    if isinstance(base, str):
        f.model = base
    pt = f.get("peft_type")
    if pt not in (ABSENT, "LORA"):
        f.refuse("peft_type", "method", "is a peft method VRAM Lab does not model (LORA)")
    f.row("peft_type", f.get("peft_type") if f.has("peft_type") else None, "method", "lora",
          SET if f.has("peft_type") else DEFAULT, note="the base's quantization is not in adapter_config.json")
    r = f.int("r")
    f.take("r", "lora_rank", r, D.PEFT_LORA["r"], note=v)
    a = f.float("lora_alpha")
    f.take("lora_alpha", "lora_alpha", a, float(D.PEFT_LORA["lora_alpha"]), note=v)
    d = f.float("lora_dropout")
    f.take("lora_dropout", "lora_dropout", d, D.PEFT_LORA["lora_dropout"])
    read_lora_variants(f, "use_dora", "use_rslora")
    t = f.get("target_modules")
    if t is not ABSENT:
        targets = read_lora_targets(f, "target_modules", t)
        if targets is not None:
            f.put("target_modules", "lora_targets", targets)
    f.not_modelled("modules_to_save", note="extra fully-trained modules")
    f.not_modelled("use_dora", "use_rslora", note="LoRA variants")
    f.not_modelled("rank_pattern", "alpha_pattern", "layers_to_transform", note="per-layer ranks or layers")


def read_zero(f: ConfigFile, stage_key: str, param_key: str, optimizer_key: str) -> None:
    """A ZeRO stage and its offload devices, as DeepSpeed's JSON and accelerate's deepspeed_config name them:
    parameters offloaded imply the optimizer too; NVMe is off the GPU like the CPU."""
    stage = f.int(stage_key, low=0)
    if stage is not ABSENT:
        if stage > 3:
            raise f.fail(stage_key, f"must be 0, 1, 2 or 3, got {stage}")
        f.put(stage_key, "sharding", ("none", "zero1", "zero2", "zero3")[stage],
              note="DeepSpeed's ZeRO optimizer keeps fp32 master partitions of 16-bit trainable weights" if stage
              else "")
    par_dev, opt_dev = f.get(param_key), f.get(optimizer_key)
    nvme = "NVMe modelled as CPU (off the GPU either way)"
    if par_dev not in (ABSENT, "none"):
        f.put(param_key, "offload", "params", note=nvme if par_dev == "nvme" else "")
    elif opt_dev not in (ABSENT, "none"):
        f.put(optimizer_key, "offload", "optimizer", note=nvme if opt_dev == "nvme" else "")
    elif opt_dev == "none" or par_dev == "none":
        f.put(optimizer_key if opt_dev == "none" else param_key, "offload", "none")


def read_deepspeed(f: ConfigFile) -> None:
    read_zero(f, "zero_optimization.stage", "zero_optimization.offload_param.device",
          "zero_optimization.offload_optimizer.device")
    bf16 = f.bool("bf16.enabled") if f.get("bf16.enabled") != "auto" else ABSENT
    fp16 = f.bool("fp16.enabled") if f.get("fp16.enabled") != "auto" else ABSENT
    if bf16 is True:
        f.put("bf16.enabled", "compute", "bf16")
    elif fp16 is True:
        f.put("fp16.enabled", "compute", "fp16")
    elif bf16 is False and fp16 is False:
        f.put("bf16.enabled", "compute", "fp32", note="bf16 and fp16 both disabled: fp32")
    mb = f.int("train_micro_batch_size_per_gpu")
    if mb is not ABSENT:
        f.put("train_micro_batch_size_per_gpu", "micro_batch", mb)
    ga = f.int("gradient_accumulation_steps")
    if ga is not ABSENT:
        f.put("gradient_accumulation_steps", "grad_accum", ga)
    f.not_modelled("train_batch_size", note="the world size comes from the launcher: give --gpus")
    f.not_modelled("zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
                   "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters",
                   "zero_optimization.stage3_max_reuse_distance", note="communication buckets")
    f.not_modelled("zero_optimization.sub_group_size", note="stage 3 steps sub-groups of DeepSpeed's default size")
    f.not_modelled("data_types.grad_accum_dtype", note="gradients are accumulated in the model's dtype, the default")
    f.not_modelled("activation_checkpointing.partition_activations", "activation_checkpointing.cpu_checkpointing",
                   note="DeepSpeed's activation partitioning")
    f.not_modelled("zero_optimization.zero_quantized_weights", "zero_optimization.zero_hpz_partition_size",
                   note="ZeRO++")
    # DeepSpeed 0.19 keeps fp32 masters of 16-bit trainable weights in its mixed-precision optimizers: ZeRO's at
    # every stage (TrainingSetup.has_master_copy counts them under --sharding zero1/2/3), and BF16_Optimizer /
    # FP16_Optimizer at stage 0 (set here; with "auto" too: fp32 training has no 16-bit trainable weights to copy)
    key = next((k for k in ("bf16.enabled", "fp16.enabled") if f.get(k) in (True, "auto")), None)
    if key is not None and f.int("zero_optimization.stage", low=0) in (0, ABSENT):
        f.put(key, "master_weights", True, note="DeepSpeed 0.19's BF16_Optimizer / FP16_Optimizer keep fp32 master "
              "weights of 16-bit trainable ones")


def read_accelerate(f: ConfigFile) -> None:
    dt = f.get("distributed_type")
    n = f.int("num_processes")
    if n is not ABSENT:
        f.put("num_processes", "gpus", n)
    if dt is ABSENT:
        return
    dt = str(dt).upper()
    if dt == "FSDP":
        read_fsdp(f, "fsdp_config.fsdp_sharding_strategy", "fsdp_config.fsdp_offload_params"
              if f.has("fsdp_config.fsdp_offload_params") else "fsdp_config.fsdp_cpu_offload",
              "fsdp_config.fsdp_activation_checkpointing", "fsdp_config.fsdp_reshard_after_forward")
    elif dt == "DEEPSPEED":
        cfg_file = f.get("deepspeed_config.deepspeed_config_file")
        if isinstance(cfg_file, str):
            path = beside(f, cfg_file)
            if path.is_file():
                f.follow.append(path)
                f.row("deepspeed_config.deepspeed_config_file", cfg_file, None, None, SET, note=f"read {path.name} too")
            else:
                f.row("deepspeed_config.deepspeed_config_file", cfg_file, None, None, NOT_MODELLED,
                      note="file not found next to the config: give it with --config")
        read_zero(f, "deepspeed_config.zero_stage", "deepspeed_config.offload_param_device",
              "deepspeed_config.offload_optimizer_device")
        ga = f.int("deepspeed_config.gradient_accumulation_steps")
        if ga is not ABSENT:
            f.put("deepspeed_config.gradient_accumulation_steps", "grad_accum", ga)
    elif dt in ("NO", "MULTI_GPU"):
        note = "DDP: every GPU holds everything" if dt == "MULTI_GPU" else ""
        f.put("distributed_type", "sharding", "none", note=note)
    else:
        f.not_modelled("distributed_type", note="only NO, MULTI_GPU, FSDP and DEEPSPEED are modelled")
    mp = f.get("mixed_precision")
    if mp not in (ABSENT, "no"):
        if mp in ("bf16", "fp16"):
            f.put("mixed_precision", "compute", mp)
        else:
            f.not_modelled("mixed_precision", note=f"{mp} compute")


def read_fsdp(f: ConfigFile, strategy_key: str, offload_key: str, ckpt_key: str | None,
              reshard_key: str | None) -> None:
    """FSDP settings (accelerate's fsdp_config, or axolotl / transformers fsdp_config) as sharding."""
    strat = f.get(strategy_key)
    reshard = f.bool(reshard_key) if reshard_key else ABSENT
    if strat is not ABSENT:
        s = str(strat).strip().upper()
        table = {"1": "fsdp", "FULL_SHARD": "fsdp", "2": "zero2", "SHARD_GRAD_OP": "zero2", "3": "none",
                 "NO_SHARD": "none", "4": "fsdp", "HYBRID_SHARD": "fsdp", "5": "zero2", "_HYBRID_SHARD_ZERO2": "zero2"}
        if s not in table:
            raise f.fail(strategy_key, f"unknown FSDP sharding strategy {strat!r}")
        note = "modelled as FULL_SHARD within one node" if "HYBRID" in s or s == "4" else (
            "FSDP SHARD_GRAD_OP shards gradients and optimizer states: modelled as ZeRO-2" if table[s] == "zero2"
            else "")
        f.put(strategy_key, "sharding", table[s], note=note)
    elif reshard is not ABSENT:
        f.put(reshard_key, "sharding", "fsdp" if reshard else "zero2",
              note="" if reshard else "FSDP2 without resharding after forward: modelled as ZeRO-2")
    else:
        f.default(strategy_key, "sharding", "fsdp", note="FULL_SHARD")
    off = f.bool(offload_key)
    if off is not ABSENT:
        f.put(offload_key, "offload", "params" if off else "none")
    if ckpt_key:
        ck = f.bool(ckpt_key)
        if ck is True:
            f.put(ckpt_key, "grad_ckpt", True)


def follow_deepspeed(f: ConfigFile, key: str) -> None:
    ds = f.get(key)
    if ds is ABSENT:
        return
    if isinstance(ds, Mapping):  # an inline DeepSpeed config (transformers accepts a dict)
        sub = ConfigFile(f"{f.path} ({key})", "deepspeed", ds)
        read_deepspeed(sub)
        f.rows.extend(replace_row(r, key=f"{key}.{r.key}") for r in sub.rows)
        return
    if not isinstance(ds, str):
        raise f.fail(key, f"must be the path of a DeepSpeed JSON, got {ds!r}")
    path = beside(f, ds)
    if path.is_file():
        f.follow.append(path)
        f.row(key, ds, None, None, SET, note=f"read {path.name} too")
    else:
        f.row(key, ds, None, None, NOT_MODELLED, note="file not found next to the config: give it with --config")


def beside(f: ConfigFile, name: str) -> Path:
    """A file a config names: absolute, or next to the config, or (as the launcher sees it) in the current
    folder."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path
    near = Path(f.path).parent / path
    return near if near.is_file() or not path.is_file() else path
