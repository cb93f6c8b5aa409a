"""The training frameworks' own defaults for the keys VRAM Lab reads, by the framework's own key names, at the
version each reader follows (:data:`VERSIONS`).

They are copied from the frameworks' argument classes, never written from memory, and a test holds every entry
to the class it names (tests/test_framework_defaults.py imports transformers' ``TrainingArguments``, TRL's
configs, peft's ``LoraConfig``, LLaMA-Factory's argument dataclasses and axolotl's config schema; the
``conformance`` extra installs them). A default that is a rule rather than a value (LLaMA-Factory's
``lora_alpha = lora_rank * 2``, axolotl's checkpointing mode) is code in the reader, with the same test.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the frameworks' versions whose defaults these are (the conformance extra pins the same)
VERSIONS: Mapping[str, str] = {
    "transformers": "5.25.0", "trl": "1.16.0", "peft": "0.21.2", "llamafactory": "0.9.5", "axolotl": "0.19.0",
    "ms-swift": "4.6.0",
}

# where each table comes from: (distribution, "module:Class"), for the test and for people
SOURCES: Mapping[str, tuple[str, str]] = {
    "TRAINING_ARGUMENTS": ("transformers", "transformers:TrainingArguments"),
    "SFT": ("trl", "trl:SFTConfig"),
    "DPO": ("trl", "trl:DPOConfig"),
    "GRPO": ("trl", "trl:GRPOConfig"),
    "KTO": ("trl", "trl:KTOConfig"),
    "CPO": ("trl", "trl.experimental.cpo:CPOConfig"),
    "TRL_MODEL": ("trl", "trl:ModelConfig"),
    "PEFT_LORA": ("peft", "peft:LoraConfig"),
    "LLAMAFACTORY_FINETUNING": ("llamafactory", "llamafactory.hparams.finetuning_args:FinetuningArguments"),
    "LLAMAFACTORY_DATA": ("llamafactory", "llamafactory.hparams.data_args:DataArguments"),
    "LLAMAFACTORY_MODEL": ("llamafactory", "llamafactory.hparams.model_args:ModelArguments"),
    "LLAMAFACTORY_TRAINING": ("llamafactory", "llamafactory.hparams.training_args:TrainingArguments"),
    "AXOLOTL": ("axolotl", "axolotl.utils.schemas.config:AxolotlInputConfig"),
    # ms-swift does not import beside transformers 5.25 / TRL 1.x: its classes are read from their source files
    "SWIFT_BASE": ("ms-swift", "swift/arguments/base_args/base_args.py:BaseArguments"),
    "SWIFT_TUNER": ("ms-swift", "swift/arguments/tuner_args.py:TunerArguments"),
    "SWIFT_QUANT": ("ms-swift", "swift/arguments/base_args/quant_args.py:QuantizeArguments"),
    "SWIFT_MODEL": ("ms-swift", "swift/arguments/base_args/model_args.py:ModelArguments"),
    "SWIFT_TEMPLATE": ("ms-swift", "swift/arguments/base_args/template_args.py:TemplateArguments"),
    "SWIFT_TRAINING": ("ms-swift", "swift/trainers/arguments.py:TrainArgumentsMixin"),
    "SWIFT_GRPO": ("ms-swift", "swift/arguments/rlhf_args.py:GRPOArguments"),
    "SWIFT_RLHF": ("ms-swift", "swift/arguments/rlhf_args.py:RLHFArguments"),
}

TRAINING_ARGUMENTS: Mapping[str, Any] = {
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "optim": "adamw_torch_fused",
    "gradient_checkpointing": None, "bf16": False, "fp16": False,
}
SFT: Mapping[str, Any] = {"max_length": 1024, "loss_type": "nll", "gradient_checkpointing": True,
                          "activation_offloading": False}
DPO: Mapping[str, Any] = {"max_length": 1024, "beta": 0.1, "loss_type": ["sigmoid"], "gradient_checkpointing": True,
                          "activation_offloading": False}
GRPO: Mapping[str, Any] = {
    "max_completion_length": 512, "num_generations": 8, "num_iterations": 1, "beta": 0.0,
    "vllm_gpu_memory_utilization": 0.3, "vllm_mode": "colocate", "use_vllm": False, "gradient_checkpointing": True,
}
KTO: Mapping[str, Any] = {"max_length": 1024, "beta": 0.1, "loss_type": "kto", "gradient_checkpointing": True,
                          "activation_offloading": False}
CPO: Mapping[str, Any] = {"max_length": 1024, "beta": 0.1, "loss_type": "sigmoid", "cpo_alpha": 1.0,
                          "gradient_checkpointing": True}
TRL_MODEL: Mapping[str, Any] = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "use_bnb_nested_quant": False,
                                "lora_target_modules": None}
PEFT_LORA: Mapping[str, Any] = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0}
LLAMAFACTORY_FINETUNING: Mapping[str, Any] = {
    "finetuning_type": "lora", "lora_rank": 8, "lora_alpha": None, "lora_dropout": 0.0, "lora_target": "all",
    "freeze_trainable_layers": 2, "freeze_trainable_modules": "all", "freeze_extra_modules": None,
    "pure_bf16": False, "freeze_vision_tower": True, "freeze_multi_modal_projector": True,
    "freeze_language_model": False,
}
LLAMAFACTORY_DATA: Mapping[str, Any] = {"cutoff_len": 2048}
LLAMAFACTORY_MODEL: Mapping[str, Any] = {
    "double_quantization": True, "quantization_type": "nf4", "disable_gradient_checkpointing": False,
    "use_reentrant_gc": True, "use_unsloth_gc": False,
}
LLAMAFACTORY_TRAINING: Mapping[str, Any] = {
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "optim": "adamw_torch_fused",
}
AXOLOTL: Mapping[str, Any] = {
    "adapter": None, "lora_r": None, "lora_alpha": None, "lora_dropout": 0.0, "micro_batch_size": 1,
    "gradient_accumulation_steps": 1, "sequence_len": 512, "gradient_checkpointing": False,
    "optimizer": "adamw_torch_fused", "bf16": "auto", "load_in_4bit": False, "activation_offloading": False,
}

# the transformers each framework's release installs (its Requires-Dist): a run through that framework has
# that transformers' behaviour, which may not be the release VRAM Lab's hand-written programs model
FRAMEWORK_TRANSFORMERS: Mapping[str, str] = {
    "llamafactory": "transformers!=4.52.0,!=4.57.0,<=5.6.0,>=4.55.0",
    "axolotl": "transformers==5.16.1",
    "trl": "transformers>=4.56.2",
    "ms-swift": "transformers<5.20.0,>=4.33",
}

SWIFT_BASE: Mapping[str, Any] = {"tuner_type": "lora"}
SWIFT_TUNER: Mapping[str, Any] = {
    "lora_rank": 8, "lora_alpha": 32.0, "lora_dropout": 0.05, "target_modules": ["all-linear"], "freeze_llm": False,
    "freeze_vit": True, "freeze_aligner": True, "use_dora": False, "use_rslora": False,
}
SWIFT_QUANT: Mapping[str, Any] = {"quant_method": None, "quant_bits": None, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": True}
SWIFT_MODEL: Mapping[str, Any] = {"torch_dtype": None, "attn_impl": None}
SWIFT_TEMPLATE: Mapping[str, Any] = {"max_length": None, "padding_free": False}
SWIFT_TRAINING: Mapping[str, Any] = {
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": None, "gradient_checkpointing": True,
    "vit_gradient_checkpointing": None, "gradient_checkpointing_kwargs": None,
    # not in the mixin: transformers' TrainingArguments (ms-swift 4.6.0 runs transformers < 5.20, whose default
    # is the same fused AdamW)
    "optim": TRAINING_ARGUMENTS["optim"],
}
SWIFT_GRPO: Mapping[str, Any] = {"num_generations": 8}
SWIFT_RLHF: Mapping[str, Any] = {"rlhf_type": "dpo", "beta": None, "max_completion_length": 512,
                                 "num_generations": SWIFT_GRPO["num_generations"]}
# what the reader looks up: the classes SftArguments is made of, merged
SWIFT: Mapping[str, Any] = {**SWIFT_BASE, **SWIFT_TUNER, **SWIFT_QUANT, **SWIFT_MODEL, **SWIFT_TEMPLATE,
                            **SWIFT_TRAINING}
