"""What TRL 1.16.0's trainers do to a peft model before training, read from their ``__init__``.

* SFT / DPO / KTO / GRPO (``trl/trainer/*_trainer.py``): on a quantized model (4-bit or 8-bit) every trainable
  parameter but a DoRA magnitude vector is cast to bf16 after ``get_peft_model`` ("the PEFT adapter weights are
  converted to bf16 to follow the recommendations from the original paper"), whatever ``bf16`` says; under
  DeepSpeed ZeRO-3 without quantization ``get_peft_model(..., autocast_adapter_dtype=False)`` keeps the adapters
  in the base model's dtype, and with gradient checkpointing ``use_reentrant`` is forced to True.
* CPO / ORPO (``trl/experimental``): the same ZeRO-3 rule; a quantized model goes through peft's
  ``prepare_model_for_kbit_training`` (every parameter left unquantized upcast to fp32: ``--kbit-prepare``), and
  under ``bf16`` ``peft_module_casting_to_bf16`` then casts the embeddings and lm_head back to bf16 while the norms
  stay fp32, a layout VRAM Lab does not model.

ZeRO-3 may come from another file (an accelerate config, a DeepSpeed JSON) or the command line, so those rules
are :attr:`ConfigFile.settle` rules on the merged setup. ``tests/test_trl_peft.py`` runs the trainers' own
``__init__`` on a tiny model and holds these rows to the dtypes it leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vramlab.core.sources.mapping import REFUSED, SET, ConfigFile, Mapped

# the trainers that cast a quantized model's adapters to bf16 and force reentrant checkpointing under ZeRO-3
TRL_MAIN = ("trl", "trl-dpo", "trl-grpo", "trl-kto")
QUANT_BF16 = "{v} {trainer}.__init__: a quantized model's adapters cast to bf16 (the QLoRA paper's recommendation)"
ZERO3_ADAPTERS = ("{v} {trainer}.__init__: under DeepSpeed ZeRO-3 without quantization get_peft_model(..., "
                  "autocast_adapter_dtype=False) keeps the adapters in the model's dtype")
ZERO3_REENTRANT = ("{v} {trainer}.__init__: PEFT with DeepSpeed ZeRO-3 and gradient checkpointing forces "
                   "use_reentrant=True")
TRAINERS = {"trl": "SFTTrainer", "trl-dpo": "DPOTrainer", "trl-grpo": "GRPOTrainer", "trl-kto": "KTOTrainer",
            "trl-cpo": "CPOTrainer"}


def adapter_dtype(trainer: str, *, quantized: bool, zero3: bool, weights: str, dora: bool) -> str | None:
    """The dtype TRL 1.16.0's ``trainer`` (a key of :data:`TRAINERS`) leaves on the LoRA weights: bf16 on a
    quantized base for SFT / DPO / KTO / GRPO (None with DoRA: bf16 weights beside an fp32 magnitude, not modelled);
    the weights' dtype under ZeRO-3 without quantization; else peft's fp32 (CPO / ORPO cast nothing on a quantized
    base: peft's prepare_model_for_kbit_training runs instead)."""
    if quantized and trainer in TRL_MAIN:
        return None if dora else "bf16"
    if zero3 and not quantized:
        return weights
    return "fp32"


def read_trl_peft(f: ConfigFile, v: str, quant: str | None) -> None:
    """The rows for a TRL config with peft (``quant``: the base's quantization read, or None)."""
    trainer = TRAINERS.get(f.framework)
    if trainer is None:
        return
    v = " ".join(v.split()[:2])  # "TRL 1.16.0"
    key = "load_in_4bit" if quant != "int8" else "load_in_8bit"
    dtype = adapter_dtype(f.framework, quantized=quant is not None, zero3=False, weights="",
                          dora=f.bool("use_dora") is True)
    if quant is not None and dtype is None:
        f.refuse("use_dora", "adapter_dtype", f"on a quantized model: {v} {trainer} casts the LoRA weights to "
                 "bf16 and keeps the DoRA magnitude in fp32, a mix VRAM Lab does not model")
    elif quant is not None and dtype == "bf16":
        f.put(key, "adapter_dtype", dtype, note=QUANT_BF16.format(v=v, trainer=trainer))
    elif quant is not None:  # trl.experimental's CPO / ORPO: prepare_model_for_kbit_training
        note = f"{v} {trainer}.__init__: peft's prepare_model_for_kbit_training upcasts what is not quantized"
        f.put(key, "kbit_upcast", True, note=note)
        f.settle.append(_cpo_bf16_settle(f.path, key, quant, v, trainer))
    f.settle.append(_zero3_settle(f, v, trainer, adapters=quant is None, ckpt=f.framework in TRL_MAIN))


def _zero3_settle(f: ConfigFile, v: str, trainer: str, *, adapters: bool, ckpt: bool) -> Callable:
    path, framework = f.path, f.framework
    explicit = f.get("gradient_checkpointing_kwargs.use_reentrant")

    def settle(rows: list[Mapped], merged: Mapping[str, Any]) -> list[Mapped]:
        if merged.get("sharding") != "zero3" or merged.get("method") not in ("lora", "qlora"):
            return rows
        out = list(rows)
        weights = merged.get("weights", "bf16")
        dtype = adapter_dtype(framework, quantized=not adapters, zero3=True, weights=weights,
                              dora=bool(merged.get("use_dora")))
        if adapters and merged.get("adapter_dtype", "fp32") != dtype and dtype in ("bf16", "fp16", "fp32"):
            out.append(Mapped(path, framework, "deepspeed", "zero3", "adapter_dtype", dtype, SET,
                              ZERO3_ADAPTERS.format(v=v, trainer=trainer)))
        if ckpt and merged.get("grad_ckpt") and merged.get("ckpt_reentrant") is not True:
            note = ZERO3_REENTRANT.format(v=v, trainer=trainer)
            if explicit is False:
                note += " (it warns and overrides use_reentrant: false)"
            out.append(Mapped(path, framework, "gradient_checkpointing_kwargs.use_reentrant",
                              explicit, "ckpt_reentrant", True, SET, note))
        return out
    return settle


def _cpo_bf16_settle(path: str, key: str, quant: str, v: str, trainer: str) -> Callable:
    def settle(rows: list[Mapped], merged: Mapping[str, Any]) -> list[Mapped]:
        if not merged.get("amp") or merged.get("compute") != "bf16":
            return rows
        return [*rows, Mapped(path, "trl-cpo", key, True, "kbit_upcast", None, REFUSED,
                              f"under bf16: {v} {trainer} casts the embeddings and lm_head back to bf16 and keeps "
                              "the norms in fp32 after prepare_model_for_kbit_training (peft_module_casting_to_bf16),"
                              " a layout VRAM Lab does not model")]
    return settle
