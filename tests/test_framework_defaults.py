"""The readers' defaults (core/sources/defaults.py) against the frameworks' own argument classes, imported: every
entry of every table equals the default of the class it names, at the version VERSIONS names. The rules that
are code (LLaMA-Factory's lora_alpha, the default optimizer's mapping) run the framework's class too.

Skipped without the ``conformance`` extra (``pip install -e .[conformance]``; LLaMA-Factory and axolotl are
installed with --no-deps: see tests/support/frameworks.py)."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest

from tests.support.frameworks import module, source_defaults
from vramlab.core.sources import defaults as D
from vramlab.core.sources.training import read_training_configs

TABLES = sorted(D.SOURCES)


def _installed(dist: str) -> None:
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (pip install -e .[conformance])")
    if installed != D.VERSIONS[dist]:
        pytest.skip(f"{dist} {installed} is installed; the defaults follow {D.VERSIONS[dist]}")


def _class(name: str):
    dist, where = D.SOURCES[name]
    mod, _, cls = where.partition(":")
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (pip install -e .[conformance])")
    if installed != D.VERSIONS[dist]:
        pytest.skip(f"{dist} {installed} is installed; the defaults follow {D.VERSIONS[dist]}")
    return getattr(module(mod), cls)


def _default(cls, key: str):
    fields = getattr(cls, "model_fields", None)
    if fields is not None:  # a pydantic model (axolotl's schema)
        return fields[key].default
    found = {f.name: f for f in dataclasses.fields(cls)}[key]
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    return found.default


@pytest.mark.parametrize("table", TABLES)
def test_every_default_is_the_frameworks_own(table):
    values = dict(getattr(D, table))
    assert values, table
    dist, where = D.SOURCES[table]
    if where.endswith(".py") or ".py:" in where:  # read from the source (the framework does not import here)
        _installed(dist)
        own = source_defaults(dist, where)
        if table == "SWIFT_TRAINING":
            values.pop("optim")  # transformers' TrainingArguments' own (TRAINING_ARGUMENTS holds it)
        if table == "SWIFT_RLHF":
            values.pop("num_generations")  # GRPOArguments' (SWIFT_GRPO holds it)
        assert {k: own.get(k, "absent") for k in values} == values
        return
    cls = _class(table)
    assert {k: _default(cls, k) for k in values} == values


def test_llamafactory_lora_alpha_is_twice_the_rank_as_its_arguments_make_it(tmp_path):
    args = module("llamafactory.hparams.finetuning_args").FinetuningArguments(lora_rank=24)
    cfg = tmp_path / "lf.yaml"
    cfg.write_text("finetuning_type: lora\nlora_rank: 24\n")
    src = read_training_configs([cfg])
    assert src.changes["lora_alpha"] == args.lora_alpha == 48
    assert "None" not in src.table()


def test_trl_sft_defaults_are_its_config_after_post_init(tmp_path):
    """SFTConfig's own __post_init__ (bf16 on unless fp16) and loss: what `trl sft` runs with an empty config."""
    _class("SFT")
    from trl import SFTConfig

    made = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True)  # no GPU here: bf16 is checked against it
    cfg = tmp_path / "sft.yaml"
    cfg.write_text("max_length: 1024\n")
    c = read_training_configs([cfg]).changes
    # SFTTrainer.compute_loss computes nll through its fused LM head (never the whole logits)
    import inspect

    from trl import SFTTrainer

    assert "fused_lm_head=True" in inspect.getsource(SFTTrainer.compute_loss) and made.loss_type == "nll"
    assert c["loss_kernel"] == "trl"
    assert c["compute"] == ("bf16" if made.bf16 else "fp32")
    assert c["grad_ckpt"] is bool(made.gradient_checkpointing)
    assert c["micro_batch"] == made.per_device_train_batch_size
    assert c["ckpt_reentrant"] is bool((made.gradient_checkpointing_kwargs or {}).get("use_reentrant", False))
