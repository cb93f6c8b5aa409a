"""Training-framework configs in: axolotl, LLaMA-Factory, ms-swift (its YAML or a ``swift sft`` command line:
:mod:`.swift`), transformers ``TrainingArguments`` / TRL ``SFTConfig``, a peft ``adapter_config.json``, DeepSpeed
JSON and accelerate YAML, read as data (``json`` / ``yaml.safe_load`` / ``shlex``) into the fields of a
:class:`~vramlab.core.spec.training.TrainingSetup`. The frameworks' defaults are :mod:`.defaults`, taken from their
argument classes.

Every key that changes memory is mapped, and the mapping is kept (:class:`Mapped` rows, shown by the CLI
and the window): which field came from which key of which file, which came from the framework's own default
(frameworks differ: LLaMA-Factory and TRL turn gradient checkpointing on unless told not to, axolotl and
plain transformers leave it off), and which memory-relevant keys VRAM Lab does not model ("not modelled").
A value that VRAM Lab cannot model for a field it needs (an optimizer it does not know, say) is a
*refusal*: the setup is refused with that key named unless a command-line flag sets the field.

Several files combine: first every file's defaults, then every file's explicit keys in the order given
(a training YAML and then its DeepSpeed JSON); a DeepSpeed JSON named by a ``deepspeed:`` key is read too
when it exists. Command-line flags override all of it (in :mod:`vramlab.core.cli`).

Export (the other way) is in :mod:`.export`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources.axolotl import read_axolotl
from vramlab.core.sources.config_file import read_config_file
from vramlab.core.sources.launchers import read_accelerate, read_deepspeed, read_peft
from vramlab.core.sources.llamafactory import read_llamafactory
from vramlab.core.sources.mapping import DEFAULT, REFUSED, SET, ConfigFile, Mapped, SetupSource, replace_row
from vramlab.core.sources.swift import KEYS as SWIFT_KEYS
from vramlab.core.sources.swift import read as read_swift
from vramlab.core.sources.trainer import CPO_KEYS, DPO_KEYS, DPO_LOSSES, GRPO_KEYS, read_trl
from vramlab.core.spec.training import TrainingSetup


def detect_framework(data: Mapping[str, Any], path: str = "") -> str:
    """Which framework wrote this config, from keys only that framework has."""
    keys = set(data)
    if "peft_type" in keys or {"r", "target_modules"} <= keys:
        return "peft"
    if keys & {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
               "zero_allow_untested_optimizer"}:
        return "deepspeed"
    if keys & {"distributed_type", "compute_environment", "num_processes"} and not keys & {"base_model"}:
        return "accelerate"
    if keys & SWIFT_KEYS or "_command" in keys:  # before LLaMA-Factory: ms-swift has `template` too
        return "ms-swift"
    if keys & {"finetuning_type", "cutoff_len", "quantization_bit", "lora_target", "stage", "template"}:
        return "llamafactory"
    # before GRPO: CPOConfig and ORPOConfig have max_completion_length too, and they alone beside max_length
    if keys & CPO_KEYS or {"max_length", "max_completion_length"} <= keys:
        return "trl-cpo"
    if keys & GRPO_KEYS:
        return "trl-grpo"
    if keys & {"desirable_weight", "undesirable_weight"} or data.get("loss_type") == "kto":
        return "trl-kto"
    if keys & DPO_KEYS or (str(data.get("loss_type")) in DPO_LOSSES and not keys & {"dataset_text_field"}):
        return "trl-dpo"
    if "beta" in keys:  # a preference trainer's config (SFTConfig has no beta) with no key of one trainer
        return "trl-cpo"
    if keys & {"max_length", "max_seq_length", "use_peft", "dataset_text_field", "completion_only_loss",
               "assistant_only_loss", "loss_type", "dataset_name", "model_init_kwargs"}:
        return "trl"
    if keys & {"base_model", "micro_batch_size", "sequence_len", "adapter", "lora_r", "lora_target_linear"}:
        return "axolotl"
    if keys & {"per_device_train_batch_size", "gradient_accumulation_steps", "optim", "output_dir",
               "gradient_checkpointing", "activation_checkpointing"}:
        return "transformers"
    raise SetupError(f"{path}: cannot tell which framework wrote this config (none of the keys of axolotl, "
                     "LLaMA-Factory, ms-swift, TRL / transformers, peft, DeepSpeed or accelerate)")


_READERS = {"ms-swift": read_swift, "axolotl": read_axolotl, "llamafactory": read_llamafactory, "trl": read_trl,
            "trl-dpo": read_trl, "trl-grpo": read_trl, "trl-kto": read_trl, "trl-cpo": read_trl,
            "transformers": read_trl, "peft": read_peft, "deepspeed": read_deepspeed, "accelerate": read_accelerate}


def _read_one(path: Path) -> ConfigFile:
    data = read_config_file(path)  # a shell script running ms-swift comes back as its arguments
    f = ConfigFile(str(path), detect_framework(data, str(path)), data)
    _READERS[f.framework](f)
    return f


def read_training_configs(paths: Sequence[str | Path], *, adapter: Mapping[str, Any] | None = None,
                          adapter_source: str = "adapter_config.json") -> SetupSource:
    """Read training configs (and, first, an adapter config that came with a Hub model) into one
    :class:`SetupSource`: defaults of every file, then explicit keys in order; a later explicit value for
    a field marks the earlier row ``overridden_by`` that file."""
    files: list[ConfigFile] = []
    if adapter is not None:
        f = ConfigFile(adapter_source, "peft", adapter)
        read_peft(f)
        files.append(f)
    seen: set[Path] = set()
    queue = [Path(p).expanduser() for p in paths]
    while queue:
        p = queue.pop(0)
        key = p.resolve() if p.exists() else p
        if key in seen:
            continue
        seen.add(key)
        f = _read_one(p)
        files.append(f)
        queue[0:0] = f.follow
    return _combine(files)


def _combine(files: Iterable[ConfigFile]) -> SetupSource:
    files = list(files)
    rows: list[Mapped] = [r for f in files for r in f.rows]
    model = next((f.model for f in files if f.model), None)
    source = SetupSource(files=tuple(f.path for f in files), frameworks=tuple((f.path, f.framework) for f in files),
                         changes={}, rows=tuple(rows), model=model,
                         settle=tuple(rule for f in files for rule in f.settle), unsettled=tuple(rows))
    return _settled(source, {})


def with_flags(source: SetupSource, flagged: Mapping[str, str], values: Mapping[str, Any]) -> SetupSource:
    """``source`` under the command line's flags: the files' rules settled again on what the flags set (``field ->
    value``: ``--sharding zero3`` over a LLaMA-Factory config undoes its fp32 upcast, as ZeRO-3 in its DeepSpeed
    JSON does), then the rows the flags set marked overridden (:meth:`SetupSource.with_flags`)."""
    if source.settle and values:
        source = _settled(source, values)
    return source.with_flags(flagged)


def settled_edits(source: SetupSource, fields: Mapping[str, Any], ruled: Mapping[str, Any]) -> dict[str, Any]:
    """What the configs' own rules change of an edited setup (the window's ``fields``, every TrainingSetup field):
    the edits are the fields that differ from the setup the files gave, less those the rules set before and still
    hold (``ruled``: field -> the value they set); the answer is the fields the rules now give otherwise. The
    window's counterpart of :func:`with_flags` (Sharding set to ZeRO-3 after a LLaMA-Factory full config)."""
    if not source.settle:
        return {}

    def values(changes: Mapping[str, Any]) -> dict[str, Any]:
        setup = TrainingSetup().replace(**changes)
        return {f: getattr(setup, "weight_dtype" if f == "weights" else f) for f in fields}

    try:
        imported = values(source.changes)
        edits = {f: v for f, v in fields.items() if v != imported[f] and not (f in ruled and ruled[f] == v)}
        now = values(_settled(source, edits).changes)
    except (SetupError, ValueError, TypeError):
        return {}
    return {f: v for f, v in now.items() if f not in edits and v != fields[f]}


def _settled(source: SetupSource, values: Mapping[str, Any]) -> SetupSource:
    """The files' rows merged, each file's rules applied to the merged setup with ``values`` over it (LLaMA-Factory's
    fp32 upcast, off under ZeRO-3), and the refusals that remain."""
    rows = list(source.unsettled)
    changes, merged = _merge(rows)
    settled = rows
    view = {**changes, **values}
    for settle in source.settle:
        settled = settle(settled, view)
    if settled is not rows:
        changes, merged = _merge(settled)
    refused: dict[str, Mapped] = {}
    for r in merged:
        if r.status == REFUSED and r.field is not None:
            refused[r.field] = r
            changes.pop(r.field, None)
    return dataclasses.replace(source, changes=changes, rows=tuple(merged), refused=refused)


def _merge(rows: list[Mapped]) -> tuple[dict[str, Any], list[Mapped]]:
    """The fields the rows set, and the rows with each one a later key replaced marked ``overridden_by``."""
    rows = list(rows)
    changes: dict[str, Any] = {}
    owner: dict[str, int] = {}  # field -> index of the row that set it
    for status in (DEFAULT, SET):  # defaults first, then explicit keys: an explicit key beats any default
        for i, r in enumerate(rows):
            if r.status != status or r.field is None:
                continue
            if r.field in owner:
                prev = rows[owner[r.field]]
                if status == DEFAULT and prev.status == DEFAULT and prev.file != r.file:
                    continue  # the first file's framework default stands
                if prev.setting != r.setting:
                    rows[owner[r.field]] = replace_row(prev, overridden_by=f"{Path(r.file).name} {r.key}")
            changes[r.field] = r.setting
            owner[r.field] = i
    return changes, rows
