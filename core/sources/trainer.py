"""transformers ``TrainingArguments`` and TRL's configs (SFT, DPO / IPO, KTO, GRPO, CPO / SimPO): the keys the
HF Trainer family shares (also read by LLaMA-Factory and axolotl) and TRL's objectives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramlab.core.sources import defaults as D
from vramlab.core.sources import hub_kernels
from vramlab.core.sources.keys import (
    read_ckpt_mode,
    read_liger,
    read_lora_targets,
    read_lora_variants,
    read_nf4,
    read_optimizer,
    read_precision,
)
from vramlab.core.sources.launchers import follow_deepspeed
from vramlab.core.sources.mapping import ABSENT, FRAMEWORKS, SET, ConfigFile
from vramlab.core.sources.trl_peft import read_trl_peft
from vramlab.core.spec.liger import LIGER_KERNELS
from vramlab.core.spec.targets import parse_targets

# keys only TRL's GRPOConfig / DPOConfig have (1.16.0)
GRPO_KEYS = {"num_generations", "max_completion_length", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
              "num_iterations", "steps_per_generation", "generation_batch_size", "vllm_enable_sleep_mode"}
DPO_KEYS = {"precompute_ref_log_probs", "f_divergence_type", "ld_alpha", "sync_ref_model", "ref_model_init_kwargs",
             "use_weighting", "precompute_ref_batch_size"}
DPO_LOSSES = {"sigmoid": "dpo", "ipo": "ipo", "['sigmoid']": "dpo", "['ipo']": "ipo"}
# SFTConfig loss types that SFTTrainer (1.16.0) computes through its fused chunked LM head
SFT_FUSED_LOSSES = ("nll", "dft", "chunked_nll")
# keys only trl.experimental's CPOConfig has (SimPO is its loss_type simpo); ORPOConfig has no key of its own
CPO_KEYS = {"cpo_alpha", "simpo_gamma"}
CPO_LOSSES = {"sigmoid": "cpo", "simpo": "simpo"}


def read_trainer_fsdp(f: ConfigFile, fsdp: Any, key: str) -> None:
    """transformers' / axolotl's ``fsdp: "full_shard auto_wrap offload"`` (string or list) + fsdp_config."""
    words = fsdp.split() if isinstance(fsdp, str) else [str(w) for w in fsdp] if isinstance(fsdp, list) else []
    words = [w.lower() for w in words]
    if fsdp is not ABSENT and not (isinstance(fsdp, str | list)):
        raise f.fail(key, f"must be a list or a string of FSDP options, got {fsdp!r}")
    if "shard_grad_op" in words or "hybrid_shard_zero2" in words:
        f.put(key, "sharding", "zero2", note="FSDP SHARD_GRAD_OP: modelled as ZeRO-2")
    elif "no_shard" in words:
        f.put(key, "sharding", "none")
    elif words or fsdp is ABSENT:
        reshard = f.bool("fsdp_config.reshard_after_forward") if f.has("fsdp_config.reshard_after_forward") \
            else f.bool("fsdp_config.fsdp_reshard_after_forward")
        if reshard is False:
            f.put("fsdp_config.reshard_after_forward", "sharding", "zero2",
                  note="FSDP2 without resharding after forward: modelled as ZeRO-2")
        elif words:
            f.put(key, "sharding", "fsdp")
        else:
            f.row("fsdp_config", "{...}", "sharding", "fsdp", SET)
    offload = "offload" in words
    for k in ("fsdp_config.offload_params", "fsdp_config.fsdp_offload_params", "fsdp_config.cpu_offload",
              "fsdp_config.fsdp_cpu_offload"):
        if f.bool(k) is True:
            offload = True
            f.put(k, "offload", "params")
    if offload and "offload" in words:
        f.put(key, "offload", "params")
    for k in ("fsdp_config.activation_checkpointing", "fsdp_config.fsdp_activation_checkpointing"):
        if f.bool(k) is True:
            f.put(k, "grad_ckpt", True)


def read_trainer_common(f: ConfigFile, version: str, *, ckpt_default: bool) -> None:
    """The TrainingArguments keys every HF-Trainer-based framework shares."""
    args = D.LLAMAFACTORY_TRAINING if f.framework == "llamafactory" else D.TRAINING_ARGUMENTS
    mb = args["per_device_train_batch_size"]
    f.take("per_device_train_batch_size", "micro_batch", f.int("per_device_train_batch_size"), mb,
           note=f"{version}: {mb}")
    f.take("gradient_accumulation_steps", "grad_accum", f.int("gradient_accumulation_steps"),
           args["gradient_accumulation_steps"])
    if f.framework == "llamafactory":
        d = f.bool("disable_gradient_checkpointing")
        if d is ABSENT:
            f.default("disable_gradient_checkpointing", "grad_ckpt", not D.LLAMAFACTORY_MODEL[
                "disable_gradient_checkpointing"], note=f"{version}: on unless disabled")
        else:
            f.put("disable_gradient_checkpointing", "grad_ckpt", not d)
        read_ckpt_mode(f, "use_reentrant_gc", D.LLAMAFACTORY_MODEL["use_reentrant_gc"], f"{version}: reentrant")
        # use_unsloth_gc: its UnslothGradientCheckpointing in torch's checkpoint's place (checkpointing on only)
        if f.bool("use_unsloth_gc") is True and d is not True:
            f.put("use_unsloth_gc", "ckpt_offload", True, note="the checkpointed layers' inputs in host memory")
    else:
        key = "activation_checkpointing" if f.has("activation_checkpointing") else "gradient_checkpointing"
        gc = f.bool(key)
        if gc is ABSENT:
            f.default(key, "grad_ckpt", ckpt_default,
                      note=f"{version}: {'on' if ckpt_default else 'off'} unless set")
        else:
            f.put(key, "grad_ckpt", gc)
        key = "activation_checkpointing_kwargs" if f.has("activation_checkpointing_kwargs") else \
            "gradient_checkpointing_kwargs"
        read_ckpt_mode(f, f"{key}.use_reentrant", False, "transformers 5 gradient_checkpointing_enable: "
                   "use_reentrant False")
    read_optimizer(f, "optim", args["optim"], version)
    f.not_modelled("torch_compile", "gradient_checkpointing_kwargs.offload", note="")
    fsdp = f.get("fsdp")
    if fsdp not in (ABSENT, "", []):
        read_trainer_fsdp(f, fsdp, "fsdp")
    if f.framework in ("trl", "trl-dpo", "trl-grpo", "trl-kto", "trl-cpo", "transformers"):
        follow_deepspeed(f, "deepspeed")


def read_trl(f: ConfigFile) -> None:
    fw = f.framework
    v = FRAMEWORKS[fw][1]
    m = f.get("model_name_or_path")
    if isinstance(m, str):
        f.model = m
    peft = f.bool("use_peft") is True or f.has("lora_r")
    q4, q8 = f.bool("load_in_4bit"), f.bool("load_in_8bit")
    method = ("qlora" if q4 is True else "lora") if peft else "full"
    if peft:
        f.put("use_peft" if f.has("use_peft") else "lora_r", "method", method)
    else:
        f.default("use_peft", "method", "full", note=f"{v}: no peft")
    quant = None
    if method == "qlora":
        quant = read_nf4(f, "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                         D.TRL_MODEL["use_bnb_nested_quant"], note=f"{v}: off")
    elif q8 is True and peft:
        quant = "int8"
        f.put("load_in_8bit", "weights", "int8")
    dtype_key = next((k for k in ("model_init_kwargs.dtype", "model_init_kwargs.torch_dtype", "dtype", "torch_dtype")
                      if f.has(k)), "dtype")
    read_precision(f, method, quant, dtype_key=dtype_key, bf16_default=fw.startswith("trl"))
    if peft:
        r = f.int("lora_r")
        f.take("lora_r", "lora_rank", r, D.TRL_MODEL["lora_r"], note=v)
        a = f.float("lora_alpha")
        f.take("lora_alpha", "lora_alpha", a, float(D.TRL_MODEL["lora_alpha"]), note=v)
        d = f.float("lora_dropout")
        f.take("lora_dropout", "lora_dropout", d, D.TRL_MODEL["lora_dropout"], note=v)
        read_lora_variants(f, "use_dora", "use_rslora", note=v)
        t = f.get("lora_target_modules")
        if t is ABSENT:
            f.default("lora_target_modules", "lora_targets", parse_targets("q_proj,v_proj"),
                      note=f"{v}: peft's per-architecture default (q_proj, v_proj for Llama-style models)")
        else:
            targets = read_lora_targets(f, "lora_target_modules", t)
            if targets is not None:
                f.put("lora_target_modules", "lora_targets", targets)
        f.not_modelled("lora_modules_to_save", note="extra fully-trained modules")
        f.not_modelled("use_dora", "use_rslora", note="LoRA variants")
        read_trl_peft(f, v, quant)
    config = {"trl": D.SFT, "trl-dpo": D.DPO, "trl-grpo": D.GRPO, "trl-kto": D.KTO, "trl-cpo": D.CPO}
    read_trainer_common(f, v, ckpt_default=bool(config.get(fw, D.TRAINING_ARGUMENTS)["gradient_checkpointing"]))
    _read_trainer_liger(f, v)
    if fw.startswith("trl"):
        hub_kernels.read_trl(f, v)
    if fw in ("trl-dpo", "trl-grpo", "trl-kto"):
        _trl_objective(f, v)
    if fw == "trl-cpo":
        _trl_cpo(f, v)
    if fw == "trl":
        key = "max_length" if f.has("max_length") or not f.has("max_seq_length") else "max_seq_length"
        sl = f.int(key)
        f.take(key, "seq_len", sl, D.SFT["max_length"], note=v)
        # SFTTrainer.compute_loss (TRL 1.16.0) computes nll and dft (and chunked_nll, now an alias of nll) through
        # its fused LM head (trl/kernels/chunked_logprob.py: 4096 x 32768 tiles of the logits, never whole), the
        # loss kernel `trl` (core/simulation/trl_head.py)
        fused = "TRL's fused LM head (tiles of 4096 tokens x 32768 vocabulary entries, no logits)"
        lt = f.get("loss_type")
        if lt is ABSENT:
            f.default("loss_type", "loss_kernel", "trl" if D.SFT["loss_type"] in SFT_FUSED_LOSSES else "hf",
                      note=f"{v}: {D.SFT['loss_type']}, {fused}")
        elif lt in SFT_FUSED_LOSSES:
            f.put("loss_type", "loss_kernel", "trl", note=fused)
        else:
            f.refuse("loss_type", "loss_kernel", "is a loss VRAM Lab does not model (nll, dft, chunked_nll)")
        ls = f.float("label_smoothing_factor")
        if ls is not ABSENT and ls > 0:  # SFTTrainer.compute_loss: the label smoother needs the whole logits
            f.refuse("label_smoothing_factor", "loss_kernel", "label smoothing: SFTTrainer then computes the loss "
                     "on the whole logits (transformers' LabelSmoother) beside a no-grad pass of its fused head, a "
                     "step VRAM Lab does not model")
        f.not_modelled("packing", "padding_free", note="packing / padding-free batches")
        read_offloading(f, D.SFT, v)
    attn = f.get("attn_implementation")
    if attn is ABSENT:
        attn = f.get("model_init_kwargs.attn_implementation")
    if attn is not ABSENT:
        key = "attn_implementation" if f.has("attn_implementation") else "model_init_kwargs.attn_implementation"
        f.put(key, "attention", "eager" if str(attn).lower() == "eager" else "sdpa")


def _read_trainer_liger(f: ConfigFile, v: str) -> None:
    """``use_liger_kernel``: Trainer calls ``apply_liger_kernel(model, liger_kernel_config)`` when training starts
    (the family's ``apply_liger_kernel_to_*`` with those keywords). trl.experimental's CPO / ORPO trainers keep that
    patch as it is; TRL's SFT / DPO / KTO / GRPO trainers turn its fused linear cross-entropy off before it runs (it
    would replace the forward their fused LM head patches) and raise if the config turns it on."""
    if f.bool("use_liger_kernel") is not True:
        return
    kernels = f.get("liger_kernel_config")
    conf = kernels if isinstance(kernels, dict) else {}
    trl_head = f.framework in ("trl", "trl-dpo", "trl-grpo", "trl-kto")
    if trl_head and conf.get("fused_linear_cross_entropy") is True:
        f.refuse("liger_kernel_config", "loss_kernel", f'{{"fused_linear_cross_entropy": true}}: {v} raises (it '
                 "replaces the model's forward, which the trainer patches with a fused LM head)")
        return
    fused = not trl_head and conf.get("fused_linear_cross_entropy", True) is not False
    # the family's apply function takes the keys it has (swiglu= or geglu=), each on by default
    on = tuple(k for k, keys in (("rms_norm", ("rms_norm",)), ("glu", ("swiglu", "geglu")),
                                 ("layer_norm", ("layer_norm",)), ("rope", ("rope",)))
               if all(conf.get(n, True) is not False for n in keys))
    on += ("cross_entropy",) if conf.get("cross_entropy") is True else ()  # off by default
    on = tuple(k for k in LIGER_KERNELS if k in on)
    note = "liger_kernel_config" if conf else "liger-kernel 0.8.5's default for the model's family"
    if trl_head:
        note += f"; {v} turns its fused linear cross-entropy off (its own fused LM head scores the tokens)"
    read_liger(f, "use_liger_kernel", fused, note=note, kernels=on)


def read_offloading(f: ConfigFile, cfg: Mapping[str, Any], v: str) -> None:
    """TRL's ``activation_offloading`` (SFTConfig, DPOConfig, KTOConfig): its saved-tensors hooks around each
    training step (core/simulation/act_offload.py)."""
    on = f.bool("activation_offloading")
    if on is ABSENT and cfg["activation_offloading"]:
        f.default("activation_offloading", "offload_activations", "trl", note=v)
    elif on is not ABSENT:
        f.put("activation_offloading", "offload_activations", "trl" if on else "none")


def _read_loss_type(f: ConfigFile, losses: dict[str, str], default: str, note: str) -> None:
    """The trainer config's ``loss_type`` as VRAM Lab's objective (``losses``: the modelled ones; ``default``:
    the objective of the config's own default loss)."""
    lt = f.get("loss_type")
    objective = default if lt is ABSENT else losses.get(str(lt))
    if objective is None:
        f.refuse("loss_type", "objective", f"is a loss VRAM Lab does not model ({', '.join(sorted(losses))})")
    elif lt is ABSENT:
        f.default("loss_type", "objective", objective, note=note)
    else:
        f.put("loss_type", "objective", objective)


def _trl_cpo(f: ConfigFile, v: str) -> None:
    """CPOConfig (trl.experimental, TRL 1.16.0): CPO (loss_type sigmoid) or SimPO; no reference model. A file
    without a key of CPOConfig's own may be ORPOConfig's (it has none) or, with ``beta`` alone, DPOConfig's or
    KTOConfig's: its objective is refused until ``--objective`` says which."""
    if not (f.has("loss_type") or any(f.has(k) for k in CPO_KEYS)):
        key = "max_completion_length" if f.has("max_completion_length") else "beta"
        which = "ORPOConfig's or CPOConfig's" if key == "max_completion_length" else \
            "DPOConfig's, KTOConfig's, ORPOConfig's or CPOConfig's"
        f.refuse(key, "objective", f"is {which}, and no key says which trainer (ORPOConfig has none of its own)")
    else:
        _read_loss_type(f, CPO_LOSSES, "cpo", note=f"{v}: sigmoid")
    alpha = f.float("cpo_alpha")
    if alpha is not ABSENT and alpha != 1.0:  # 0 drops the chosen rows' NLL (its logits copy and fp32 softmax)
        f.refuse("cpo_alpha", "objective", "other than 1.0 is not modelled (the NLL term on the chosen rows)")
    sl = f.int("max_length")
    f.take("max_length", "seq_len", sl, D.CPO["max_length"], note=v)
    f.take("beta", "beta", f.float("beta"), D.CPO["beta"], note=v)
    f.not_modelled("alpha", note="AlphaPO's reward transform (vectors of the micro batch)")
    f.not_modelled("padding_value", "max_completion_length", note="padding: every row is full length")


def _trl_objective(f: ConfigFile, v: str) -> None:
    """DPOConfig / GRPOConfig (TRL 1.16.0): the objective and its settings, defaults as the config has them."""
    if f.framework in ("trl-dpo", "trl-kto"):
        if f.framework == "trl-dpo":
            _read_loss_type(f, DPO_LOSSES, "dpo", note=f"{v}: sigmoid")
        else:
            _read_loss_type(f, {"kto": "kto"}, "kto", note=f"{v}: kto")
        cfg = D.DPO if f.framework == "trl-dpo" else D.KTO
        sl = f.int("max_length")
        f.take("max_length", "seq_len", sl, cfg["max_length"], note=v)
        if f.bool("precompute_ref_log_probs") is True:
            f.put("precompute_ref_log_probs", "reference", "precomputed")
        b = f.float("beta")
        f.take("beta", "beta", b, cfg["beta"], note=v)
        read_offloading(f, cfg, v)
        f.not_modelled("padding_free", "use_weighting")
        return
    key = next(k for k in sorted(GRPO_KEYS) if f.has(k))
    f.put(key, "objective", "grpo", note="a key only GRPOConfig has")
    c = f.int("max_completion_length")
    f.take("max_completion_length", "completion_len", c, D.GRPO["max_completion_length"], note=v)
    c = D.GRPO["max_completion_length"] if c is ABSENT else c
    p = f.int("max_prompt_length")
    if p is ABSENT:
        f.default("max_prompt_length", "seq_len", 512 + c,
                  note=f"{v} does not truncate prompts: 512 prompt tokens assumed, give --prompt-len")
    else:
        f.put("max_prompt_length", "seq_len", p + c, note="prompt + completion")
    f.take("num_generations", "num_generations", f.int("num_generations"), D.GRPO["num_generations"], note=v)
    spg = f.int("steps_per_generation")
    if spg is not ABSENT:
        f.put("steps_per_generation", "steps_per_generation", spg)
    f.take("num_iterations", "num_iterations", f.int("num_iterations"), D.GRPO["num_iterations"], note=v)
    f.take("beta", "beta", f.float("beta"), D.GRPO["beta"], note=v)
    if f.bool("use_vllm") is True:
        mode = f.get("vllm_mode")
        backend = "vllm-server" if (D.GRPO["vllm_mode"] if mode is ABSENT else mode) == "server" \
            else "vllm-colocate"
        f.put("vllm_mode" if mode is not ABSENT else "use_vllm", "generation_backend", backend)
        if backend == "vllm-colocate":
            f.take("vllm_gpu_memory_utilization", "vllm_memory_fraction", f.float("vllm_gpu_memory_utilization"),
                   D.GRPO["vllm_gpu_memory_utilization"], note=v)
            sleep = f.bool("vllm_enable_sleep_mode")
            if sleep is not ABSENT:
                f.put("vllm_enable_sleep_mode", "vllm_sleep", sleep)
    else:
        f.default("use_vllm", "generation_backend", "transformers", note=f"{v}: model.generate")
    f.not_modelled("cast_lm_head_to_fp32", "use_transformers_paged", "top_entropy_quantile",
                   "activation_offloading")
