"""The TRL reader's adapter dtype and checkpointing mode held to TRL 1.16.0's trainers' own ``__init__``.

Each trainer runs on a tiny Llama up to ``transformers.Trainer.__init__`` (stopped there: what TRL does to the
peft model happens before it). A quantized base is TRL's own test (``getattr(model, "is_loaded_in_4bit")``), set
on the tiny model; DeepSpeed ZeRO-3 is TRL's own test too (``args.deepspeed_plugin.zero_stage == 3``), set on the
config's arguments (DeepSpeed itself does not run here). VRAM Lab reads the same keys from a YAML file and must
land on the dtype TRL leaves on the LoRA weights and the ``use_reentrant`` it leaves in the arguments. Skipped
without the ``conformance`` extra."""

from __future__ import annotations

import json
import types
from unittest import mock

import pytest

from tests.support.frameworks import module
from vramlab.core.checks import SetupError
from vramlab.core.sources.training import read_training_configs
from vramlab.core.spec.training import TrainingSetup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = module("trl")
peft = module("peft")


class _Stop(Exception):
    pass


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, 300)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>")


def _run_init(trainer: str, *, quantized: bool, zero3: bool, bf16: bool = False):
    """The model and arguments as TRL's trainer leaves them when it hands over to transformers' Trainer."""
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=300)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if quantized:
        model.is_loaded_in_4bit = True
    trainer_cls, config_cls = {
        "sft": (trl.SFTTrainer, trl.SFTConfig), "dpo": (trl.DPOTrainer, trl.DPOConfig),
        "kto": (trl.KTOTrainer, trl.KTOConfig),
        "cpo": (module("trl.experimental.cpo").CPOTrainer, module("trl.experimental.cpo").CPOConfig)}[trainer]
    args = config_cls(output_dir="/tmp/vramlab-trl-peft", use_cpu=True, bf16=bf16, report_to=[],
                      gradient_checkpointing=True)
    if zero3:
        args.deepspeed_plugin = types.SimpleNamespace(zero_stage=3)
    seen = {}

    def stop(self, model=None, args=None, **_):  # noqa: ANN001, ANN202
        seen.update(model=model, args=args)
        raise _Stop

    rows = [{"prompt": "t3 t4", "completion": "t5", "chosen": "t5", "rejected": "t6", "label": True}]
    with mock.patch.object(transformers.Trainer, "__init__", stop), pytest.raises(_Stop):
        trainer_cls(model=model, args=args, processing_class=_tokenizer(),
                    train_dataset=module("datasets").Dataset.from_list(rows),
                    peft_config=peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return seen["model"], seen["args"]


def _read(tmp_path, framework_keys: dict, *, quantized: bool, zero3: bool) -> TrainingSetup:
    keys = {"use_peft": True, "lora_r": 8, "lora_target_modules": ["q_proj", "v_proj"], "bf16": False,
            "dtype": "bfloat16", "gradient_checkpointing": True, **framework_keys}
    if quantized:
        keys.update(load_in_4bit=True, dtype="bfloat16")
    if zero3:
        ds = tmp_path / "ds3.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
        keys["deepspeed"] = str(ds)
    cfg = tmp_path / "trl.yaml"
    cfg.write_text(json.dumps(keys))
    return TrainingSetup().replace(**read_training_configs([cfg]).changes)


def _lora_dtype(model) -> str:
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert len(dtypes) == 1, dtypes
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtypes.pop()]


# the keys only each trainer's config has, so that the reader knows which trainer the file is for
MARKERS = {"sft": {"max_length": 64}, "dpo": {"precompute_ref_log_probs": False},
           "kto": {"desirable_weight": 1.0}, "cpo": {"cpo_alpha": 1.0}}


@pytest.mark.parametrize("trainer", ["sft", "dpo", "kto"])
@pytest.mark.parametrize("quantized,zero3", [(True, False), (False, True), (True, True), (False, False)],
                         ids=["qlora", "zero3", "qlora-zero3", "plain"])
def test_adapter_dtype_and_checkpointing_are_the_trainers(tmp_path, trainer, quantized, zero3):
    model, args = _run_init(trainer, quantized=quantized, zero3=zero3)
    setup = _read(tmp_path, MARKERS[trainer], quantized=quantized, zero3=zero3)
    assert setup.adapter_dtype.value == _lora_dtype(model)
    reentrant = (args.gradient_checkpointing_kwargs or {}).get("use_reentrant", False)
    assert setup.ckpt_reentrant is reentrant


def test_cpo_prepares_a_quantized_model_and_its_bf16_layout_is_refused(tmp_path):
    """CPOTrainer runs prepare_model_for_kbit_training: without bf16 the unquantized parameters end in fp32 (what
    --kbit-prepare models); with bf16 the embeddings and lm_head go back to bf16 beside fp32 norms (refused)."""
    model, _ = _run_init("cpo", quantized=True, zero3=False)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {torch.float32}
    setup = _read(tmp_path, MARKERS["cpo"], quantized=True, zero3=False)
    assert setup.kbit_upcast is True
    model, _ = _run_init("cpo", quantized=True, zero3=False, bf16=True)
    dtypes = {n.rsplit(".", 2)[-2]: p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert dtypes["embed_tokens"] == torch.bfloat16 and dtypes["norm"] == torch.float32
    cfg = tmp_path / "trl.yaml"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "bf16": True}))
    with pytest.raises(SetupError, match="peft_module_casting_to_bf16"):
        read_training_configs([cfg]).check()
