"""Freeze (``--method freeze --trainable-layers N``) against LLaMA-Factory's own freeze step (``_setup_freeze_tuning``,
model/adapter.py of LLaMA-Factory 0.9.5) applied to a tiny transformers model: the same parameters train in the
reference builder (core/tracing/hf.py), and the estimate counts them. Its ``init_adapter`` (the fp32 upcast of the
trainable parameters) leaves them in the dtype VRAM Lab reads from the same keys. Skipped without the
``conformance`` extra."""

from __future__ import annotations

import pytest

from tests.support.frameworks import module
from vramlab.core.estimate import estimate
from vramlab.core.sources.training import read_training_configs
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.training import TrainingSetup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPEC = ModelSpec(id="llama", name="Llama-ish", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=300)


def _model(tied: bool = False):
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=300, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def _trained(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _llamafactory(tmp_path, **keys):
    """The names LLaMA-Factory's freeze step trains, and the setup VRAM Lab reads from the same keys."""
    adapter = module("llamafactory.model.adapter")
    args = module("llamafactory.hparams.finetuning_args").FinetuningArguments(finetuning_type="freeze", **keys)
    model = _model()
    adapter._setup_freeze_tuning(model, args, is_trainable=True, cast_trainable_params_to_fp32=False)
    cfg = tmp_path / "freeze.yaml"
    cfg.write_text("finetuning_type: freeze\n" + "".join(f"{k}: {v}\n" for k, v in keys.items()))
    setup = TrainingSetup().replace(**read_training_configs([cfg]).changes)
    return _trained(model), setup


def _ours(setup: TrainingSetup) -> set[str]:
    from vramlab.core.tracing.hflora import freeze_all_but_last

    model = _model()
    freeze_all_but_last(model, setup.trainable_layers, setup.freeze_extra)
    return _trained(model)


@pytest.mark.parametrize("keys", [{}, {"freeze_trainable_layers": 1}, {"freeze_trainable_layers": 3},
                                  {"freeze_trainable_layers": 2, "freeze_extra_modules": "lm_head"},
                                  {"freeze_trainable_layers": 1, "freeze_extra_modules": "embed_tokens,lm_head"}],
                         ids=["default", "last1", "last3", "head", "embed+head"])
def test_freeze_trains_what_llamafactory_trains(tmp_path, keys):
    theirs, setup = _llamafactory(tmp_path, **keys)
    assert _ours(setup) == theirs
    model = dict(_model().named_parameters())
    assert estimate(SPEC, setup).trainable_params == sum(model[n].numel() for n in theirs)


def test_freeze_without_extras_leaves_norm_and_head_frozen(tmp_path):
    theirs, setup = _llamafactory(tmp_path, freeze_trainable_layers=2)
    assert not any(n.startswith(("lm_head", "model.norm", "model.embed_tokens")) for n in theirs)
    assert setup.freeze_extra == ()


def test_plain_requires_grad_freeze_of_all_but_the_last_layers():
    """What a user's own script does: everything frozen, then the last N layers unfrozen."""
    model = _model()
    model.requires_grad_(False)
    for layer in model.model.layers[-2:]:
        layer.requires_grad_(True)
    assert _ours(TrainingSetup(method="freeze", trainable_layers=2)) == _trained(model)


def test_tied_head_trains_only_with_the_embedding():
    from vramlab.core.tracing.hflora import freeze_all_but_last

    model = _model(tied=True)
    freeze_all_but_last(model, 1, ("lm_head",))
    assert not model.lm_head.weight.requires_grad
    freeze_all_but_last(model, 1, ("embed_tokens",))
    assert model.lm_head.weight.requires_grad


# ---- the fp32 upcast of trainable parameters (LLaMA-Factory 0.9.5 model/adapter.py init_adapter) --------------

def _upcast_by_llamafactory(monkeypatch, zero3: bool, **keys) -> dict[str, torch.dtype]:
    """LLaMA-Factory's own init_adapter on a bf16-loaded tiny Llama (its loader passes torch_dtype="auto": a bf16
    checkpoint loads bf16): each parameter's dtype, the trained ones marked."""
    adapter = module("llamafactory.model.adapter")
    monkeypatch.setattr(adapter, "is_deepspeed_zero3_enabled", lambda: zero3)  # as HfDeepSpeedConfig would say
    fargs = module("llamafactory.hparams.finetuning_args").FinetuningArguments(**keys)
    margs = module("llamafactory.hparams.model_args").ModelArguments(model_name_or_path="m")
    model = _model().to(torch.bfloat16)
    model = adapter.init_adapter(model.config, model, margs, fargs, is_trainable=True)
    return _dtypes(model)


def _dtypes(model) -> dict[str, torch.dtype]:
    return {("trained " if p.requires_grad else "") + n: p.dtype for n, p in model.named_parameters()}


def _read(tmp_path, zero3: bool, **keys) -> TrainingSetup:
    cfg = tmp_path / "lf.yaml"
    extra = "deepspeed: {zero_optimization: {stage: 3}}\n" if zero3 else ""
    cfg.write_text("bf16: true\n" + "".join(f"{k}: {str(v).lower()}\n" for k, v in keys.items()) + extra)
    src = read_training_configs([cfg])
    assert not src.refused
    return TrainingSetup().replace(**src.changes)


def _ours_dtypes(setup: TrainingSetup) -> dict[str, torch.dtype]:
    """The parameters as VRAM Lab's transformers build makes them (core/tracing/hf.py): the weights' dtype, the
    freeze, then trainable_fp32's upcast."""
    from vramlab.core.tracing.hflora import freeze_all_but_last, upcast_trainable

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[setup.weight_dtype.value]
    model = _model().to(dtype)
    if setup.method.value == "freeze":
        freeze_all_but_last(model, setup.trainable_layers, setup.freeze_extra)
    if setup.trainable_fp32:
        upcast_trainable(model)
    return _dtypes(model)


CASES = [(False, {}), (False, {"pure_bf16": True}), (True, {}), (False, {"use_badam": True}),
         (False, {"freeze_extra_modules": "lm_head,embed_tokens"})]


@pytest.mark.parametrize("method", ["full", "freeze"])
@pytest.mark.parametrize(("zero3", "keys"), CASES, ids=["upcast", "pure_bf16", "zero3", "badam", "extras"])
def test_each_parameter_has_the_dtype_llamafactory_leaves_it_in(tmp_path, monkeypatch, method, zero3, keys):
    if method == "full" and keys.get("freeze_extra_modules"):
        pytest.skip("freeze only")
    theirs = _upcast_by_llamafactory(monkeypatch, zero3, finetuning_type=method, **keys)
    assert _ours_dtypes(_read(tmp_path, zero3, finetuning_type=method, **keys)) == theirs
