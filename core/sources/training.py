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

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources import defaults as D
from vramlab.core.sources.swift import KEYS as SWIFT_KEYS
from vramlab.core.spec.targets import parse_targets

__all__ = [
    "FRAMEWORKS",
    "Mapped",
    "SetupSource",
    "detect_framework",
    "grouped_rows",
    "read_config_file",
    "read_training_configs",
]

MAX_CONFIG_BYTES = 4 * 1024**2  # a training config is a few KiB

# framework id -> (name shown, the version whose defaults and keys are followed)
FRAMEWORKS: Mapping[str, tuple[str, str]] = {
    "axolotl": ("axolotl", "axolotl 0.19.0 config schema"),
    "llamafactory": ("LLaMA-Factory", "LLaMA-Factory 0.9.5 arguments"),
    "trl": ("TRL SFTConfig", "TRL 1.16.0 SFTConfig (transformers 5 TrainingArguments)"),
    "trl-dpo": ("TRL DPOConfig", "TRL 1.16.0 DPOConfig (transformers 5 TrainingArguments)"),
    "trl-grpo": ("TRL GRPOConfig", "TRL 1.16.0 GRPOConfig (transformers 5 TrainingArguments)"),
    "trl-kto": ("TRL KTOConfig", "TRL 1.16.0 KTOConfig (transformers 5 TrainingArguments)"),
    "trl-cpo": ("TRL CPOConfig", "TRL 1.16.0 trl.experimental CPOConfig (transformers 5 TrainingArguments)"),
    "transformers": ("transformers TrainingArguments", "transformers 5.25.0 TrainingArguments"),
    "peft": ("peft adapter_config.json", "peft 0.21.2 LoraConfig"),
    "deepspeed": ("DeepSpeed", "DeepSpeed 0.16 config JSON"),
    "accelerate": ("accelerate", "accelerate 1.x config YAML"),
    "ms-swift": ("ms-swift", "ms-swift 4.6.0 SftArguments / RLHFArguments"),
}

SET, DEFAULT, NOT_MODELLED, REFUSED = "set", "default", "not modelled", "refused"
# the command-line flag of a setup field, where it is not the field's name
_FLAGS = {"seq_len": "--seq", "micro_batch": "--batch", "ckpt_reentrant": "--grad-ckpt-reentrant"}


@dataclass(frozen=True)
class Mapped:
    """One key of one file and what became of it.

    ``status``: ``set`` (the key's value set ``field``), ``default`` (the key is absent and the framework's
    default set ``field``), ``not modelled`` (the key changes memory but VRAM Lab does not model it; no
    field is set), ``refused`` (``field`` cannot be modelled with this value: the setup is refused unless a
    flag sets the field). ``overridden_by`` names what replaced it (a later file, or a command-line flag).
    """

    file: str
    framework: str
    key: str
    value: Any
    field: str | None
    setting: Any
    status: str
    note: str = ""
    overridden_by: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"file": self.file, "framework": self.framework, "key": self.key, "value": _jsonable(self.value),
               "field": self.field, "setting": _jsonable(self.setting), "status": self.status}
        if self.note:
            out["note"] = self.note
        if self.overridden_by:
            out["overridden_by"] = self.overridden_by
        return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return list(v)
    if v is None or isinstance(v, str | int | float | bool | list | dict):
        return v
    return str(v)


@dataclass(frozen=True)
class SetupSource:
    """What a set of training configs say: ``changes`` (TrainingSetup field -> value, defaults included),
    the model they name (``None`` if none), every row of the mapping, and the frameworks read."""

    files: tuple[str, ...]
    frameworks: tuple[tuple[str, str], ...]  # (file, framework id)
    changes: Mapping[str, Any]
    rows: tuple[Mapped, ...]
    model: str | None = None
    refused: Mapping[str, Mapped] = field(default_factory=dict)  # field -> the row that cannot be modelled

    def with_flags(self, flagged: Mapping[str, str]) -> SetupSource:
        """Rows marked overridden for the fields a command-line flag set (``field -> '--flag'``); the
        refusals those flags resolve are dropped."""
        rows = tuple(
            _replace(r, overridden_by=flagged[r.field]) if r.field in flagged and r.status != NOT_MODELLED
            and not r.overridden_by else r
            for r in self.rows
        )
        refused = {f: r for f, r in self.refused.items() if f not in flagged}
        return SetupSource(self.files, self.frameworks, self.changes, rows, self.model, refused)

    def check(self) -> None:
        """Refuse a setup that needs a value VRAM Lab cannot model (one line naming the key)."""
        for fld, r in self.refused.items():
            flag = _FLAGS.get(fld, "--" + fld.replace("_", "-"))
            raise SetupError(f"{r.file}: {r.key}: {r.value!r} {r.note}; set it with {flag} or change the file")

    def to_json(self) -> dict[str, Any]:
        from vramlab.core.report import framework_versions_text

        return {
            "files": [{"path": f, "framework": FRAMEWORKS[fw][0], "defaults_followed": FRAMEWORKS[fw][1]}
                      for f, fw in self.frameworks],
            "model": self.model,
            "versions": framework_versions_text([fw for _f, fw in self.frameworks]),
            "mapping": [r.to_json() for r in self.rows],
        }

    def table(self) -> str:
        """The mapping for people: one line per key, before the answer."""
        lines = ["Setup from training config(s):"]
        for f, fw in self.frameworks:
            lines.append(f"  {f}: {FRAMEWORKS[fw][0]} (defaults of {FRAMEWORKS[fw][1]})")
        from vramlab.core.report import framework_versions_text

        lines += [f"  note: {t}" for t in framework_versions_text([fw for _f, fw in self.frameworks])]
        if self.model:
            lines.append(f"  model: {self.model}")
        width = min(max((len(r.key) for r in self.rows), default=10), 40) + 2
        for group in grouped_rows(self.rows):
            r = group[0]
            if r.status == NOT_MODELLED:
                what = "not modelled" + (f" ({r.note})" if r.note else "")
            elif r.field is None:
                what = r.note
            else:
                what = "-> " + ", ".join(
                    f"{g.field} = {_show(g.setting)}" + (f" (overridden by {g.overridden_by})" if g.overridden_by
                                                         else "") for g in group)
                label = "default" if r.status == DEFAULT else ("REFUSED" if r.status == REFUSED else "")
                what += (f"  ({label})" if label else "") + (f"  [{r.note}]" if r.note else "")
            shown = "(absent)" if r.status == DEFAULT else _show(r.value)
            lines.append(f"    {r.key.ljust(width) if len(r.key) < width else r.key + '  '}{shown:<18}{what}")
        return "\n".join(lines)


def grouped_rows(rows: Iterable[Mapped]) -> list[list[Mapped]]:
    """Consecutive rows of the same key, file and status (one key that sets several fields) as one line."""
    out: list[list[Mapped]] = []
    for r in rows:
        if out and (out[-1][0].file, out[-1][0].key, out[-1][0].status) == (r.file, r.key, r.status) \
                and r.field is not None and out[-1][0].field is not None:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _brief(v: Any) -> Any:
    """A file's value as the mapping keeps it: scalars and short lists of scalars as they are, anything else
    summarised (a YAML alias can make a small file hold a structure far too large to print)."""
    scalar = (str, int, float, bool, type(None))
    if isinstance(v, scalar):
        return v if not isinstance(v, str) or len(v) <= 200 else v[:200] + "…"
    if isinstance(v, list) and len(v) <= 16 and all(isinstance(x, scalar) for x in v):
        return [_brief(x) for x in v]
    if isinstance(v, Mapping):
        return "{…}"
    return "[…]" if isinstance(v, list) else type(v).__name__


def _show(v: Any) -> str:
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _replace(r: Mapped, **kw: Any) -> Mapped:
    import dataclasses

    return dataclasses.replace(r, **kw)


# ---- reading files ----------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A JSON or YAML file as a dict (``yaml.safe_load``: no tags, no code). ``.json`` files are read as
    JSON, everything else as YAML (YAML also reads most JSON)."""
    import yaml

    p = Path(path).expanduser()
    try:
        if not p.is_file():
            raise SetupError(f"{p}: " + ("no such file" if not p.exists() else "not a regular file"))
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise SetupError(f"{p}: {size:,} bytes is far too large for a training config")
        with p.open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise SetupError(f"{p}: far too large for a training config")
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SetupError(f"{p}: not UTF-8 text (byte {e.start})") from e
    except OSError as e:
        raise SetupError(f"{p}: cannot read ({e.strerror or e})") from e
    from vramlab.core.sources.swift import is_command, parse_command

    if p.suffix.lower() in (".sh", ".bash", ".txt", "") and is_command(text):
        return parse_command(text, str(p))
    try:
        if p.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise SetupError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
        else:
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(e, "problem", None) or type(e).__name__
                raise SetupError(f"{p}: not valid YAML ({problem}{at})") from e
    except RecursionError as e:
        raise SetupError(f"{p}: nested too deeply to be a config") from e
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise SetupError(f"{p}: a config must be a mapping of keys to values, not {kind}")
    return data


# keys only TRL's GRPOConfig / DPOConfig have (1.16.0)
_GRPO_KEYS = {"num_generations", "max_completion_length", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
              "num_iterations", "steps_per_generation", "generation_batch_size", "vllm_enable_sleep_mode"}
_DPO_KEYS = {"precompute_ref_log_probs", "f_divergence_type", "ld_alpha", "sync_ref_model", "ref_model_init_kwargs",
             "use_weighting", "precompute_ref_batch_size"}
DPO_LOSSES = {"sigmoid": "dpo", "ipo": "ipo", "['sigmoid']": "dpo", "['ipo']": "ipo"}
# SFTConfig loss types that SFTTrainer (1.16.0) computes through its fused chunked LM head
SFT_FUSED_LOSSES = ("nll", "dft", "chunked_nll")
# keys only trl.experimental's CPOConfig has (SimPO is its loss_type simpo); ORPOConfig has no key of its own
_CPO_KEYS = {"cpo_alpha", "simpo_gamma"}
CPO_LOSSES = {"sigmoid": "cpo", "simpo": "simpo"}


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
    if keys & _CPO_KEYS:  # before GRPO: CPOConfig has max_completion_length too
        return "trl-cpo"
    if keys & _GRPO_KEYS:
        return "trl-grpo"
    if keys & {"desirable_weight", "undesirable_weight"} or data.get("loss_type") == "kto":
        return "trl-kto"
    if keys & _DPO_KEYS or (str(data.get("loss_type")) in DPO_LOSSES and not keys & {"dataset_text_field"}):
        return "trl-dpo"
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


# ---- one file ---------------------------------------------------------------------------------------------

_ABSENT: Any = object()


class _File:
    """The keys of one file and the rows they produce."""

    def __init__(self, path: str, framework: str, data: Mapping[str, Any]):
        self.path, self.framework, self.data = path, framework, data
        self.rows: list[Mapped] = []
        self.model: str | None = None
        self.follow: list[Path] = []  # other configs this one names (a deepspeed: JSON)

    def get(self, key: str) -> Any:
        """The value at a dotted key; ``_ABSENT`` when missing or null (YAML's empty value)."""
        cur: Any = self.data
        for part in key.split("."):
            if not isinstance(cur, Mapping) or part not in cur:
                return _ABSENT
            cur = cur[part]
        return _ABSENT if cur is None else cur

    def has(self, key: str) -> bool:
        return self.get(key) is not _ABSENT

    def fail(self, key: str, problem: str) -> SetupError:
        return SetupError(f"{self.path}: {key}: {problem}")

    def bool(self, key: str) -> Any:
        v = self.get(key)
        if v is _ABSENT:
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no"):
            return v.strip().lower() in ("true", "yes")
        if not isinstance(v, bool):
            raise self.fail(key, f"must be true or false, got {v!r}")
        return v

    def int(self, key: str, low: int = 1) -> Any:
        v = self.get(key)
        if v is _ABSENT or v == "auto":
            return _ABSENT
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise self.fail(key, f"must be a whole number >= {low}, got {v!r}")
        return v

    def float(self, key: str) -> Any:
        v = self.get(key)
        if v is _ABSENT:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(key, f"must be a number, got {v!r}")
        return float(v)

    def row(self, key: str, value: Any, fld: str | None, setting: Any, status: str = SET, note: str = "") -> None:
        self.rows.append(Mapped(self.path, self.framework, key, _brief(value), fld, setting, status, note))

    def put(self, key: str, fld: str, setting: Any, note: str = "") -> None:
        self.row(key, self.get(key), fld, setting, SET, note)

    def default(self, key: str, fld: str, setting: Any, note: str = "") -> None:
        self.row(key, None, fld, setting, DEFAULT, note)

    def take(self, key: str, fld: str, value: Any, default: Any, note: str = "") -> None:
        """``value`` (read from ``key``) when the file has it, else the framework's ``default``."""
        if value is _ABSENT:
            self.default(key, fld, default, note=note)
        else:
            self.put(key, fld, value)

    def not_modelled(self, *keys: str, note: str = "", when: Any = None) -> None:
        """Rows for memory-relevant keys that are present (and, with ``when``, equal to it or truthy)."""
        for key in keys:
            v = self.get(key)
            if v is _ABSENT or v is False or v in ([], {}, "auto"):  # "auto": the trainer decides
                continue
            if when is not None and v != when:
                continue
            self.row(key, v, None, None, NOT_MODELLED, note)

    def refuse(self, key: str, fld: str, note: str) -> None:
        self.row(key, self.get(key), fld, None, REFUSED, note)


# HF TrainingArguments `optim` names -> (optimizer, implementation): torch's AdamW and SGD take foreach on
# CUDA unless fused is asked for; transformers' Adafactor and bitsandbytes' 32-bit Lion step one tensor at a time.
_HF_OPTIM: Mapping[str, tuple[str, str | None]] = {
    "adamw_torch": ("adamw", "foreach"), "adamw_torch_fused": ("adamw", "fused"),
    "adamw_bnb_8bit": ("adamw8bit", None), "adamw_8bit": ("adamw8bit", None),
    "paged_adamw_8bit": ("paged_adamw8bit", None),
    "sgd": ("sgd", "foreach"), "adafactor": ("adafactor", "single"),
    "lion_32bit": ("lion", "single"),
    # bitsandbytes' PagedAdamW32bit; torchao's AdamW8bit / AdamW4bit (transformers 5.25.0 trainer_optimizer.py), and
    # AdamWFp8 under axolotl 0.19.0's name (core/builders/base.py)
    "paged_adamw_32bit": ("paged_adamw_32bit", None), "adamw_torch_8bit": ("adamw_torch_8bit", None),
    "adamw_torch_4bit": ("adamw_torch_4bit", None), "ao_adamw_fp8": ("adamw_torchao_fp8", None),
}


def _optimizer(f: _File, key: str, default: str | None, version: str) -> None:
    name = f.get(key)
    if name is _ABSENT:
        if default is not None:
            opt, impl = _HF_OPTIM[default]
            f.default(key, "optimizer", opt, note=f"{version}: {default}")
            if impl:
                f.default(key, "optimizer_impl", impl, note=f"{version}: {default}")
        return
    if not isinstance(name, str):
        raise f.fail(key, f"must be an optimizer name, got {name!r}")
    mapped = _HF_OPTIM.get(name.strip().lower())
    if mapped is None:
        f.refuse(key, "optimizer", "is not an optimizer VRAM Lab models (adamw_torch, adamw_torch_fused, "
                 "adamw_bnb_8bit, paged_adamw_8bit, paged_adamw_32bit, adamw_torch_8bit, adamw_torch_4bit, "
                 "ao_adamw_fp8, sgd, adafactor, lion_32bit)")
        return
    f.put(key, "optimizer", mapped[0])
    if mapped[1]:
        f.put(key, "optimizer_impl", mapped[1])


_DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                "float32": "fp32", "fp32": "fp32", "float": "fp32"}


def _precision(f: _File, method: str, quant: str | None, *, pure: Mapping[str, str] | None = None,
               dtype_key: str | None = None, bf16_default: bool = False) -> None:
    """HF Trainer's precision switches as VRAM Lab's weight, compute and autocast facts.

    ``bf16: true`` trains under bf16 autocast on a bf16-loaded model; ``fp16: true`` under fp16 autocast with
    fp32 weights for full fine-tuning (GradScaler refuses fp16 gradients) and fp16 base weights for adapters;
    a "pure" key (axolotl ``bfloat16``/``float16``, LLaMA-Factory ``pure_bf16``) or a load dtype without an
    autocast switch (TRL ``model_init_kwargs.dtype``) trains in that dtype without autocast; nothing at all
    is fp32 training. A quantized base (``quant``) keeps its storage; the compute dtype still applies."""
    auto = f.get("bf16") == "auto"  # axolotl: bf16 when the GPU has it (every GPU since Ampere)
    bf16 = True if auto else f.bool("bf16")
    fp16 = f.bool("fp16")
    pure_on = [(k, dt) for k, dt in (pure or {}).items() if f.bool(k) is True]
    load = None
    if dtype_key and f.has(dtype_key):
        raw = f.get(dtype_key)
        load = _DTYPE_NAMES.get(str(raw).lower()) if isinstance(raw, str) else None
        if load is None and raw != "auto":
            raise f.fail(dtype_key, f"must be bfloat16, float16 or float32, got {raw!r}")
    explicit = bf16 is not _ABSENT or fp16 is not _ABSENT or bool(pure_on) or load is not None
    use_bf16 = bf16 is True or (bf16 is _ABSENT and fp16 is not True and not pure_on and bf16_default)
    use_fp16 = fp16 is True and not use_bf16
    note = "auto: bf16 on a GPU that has it" if auto else ""
    if use_bf16:
        key, compute, amp = "bf16", "bf16", True
        weights = load or "bf16"
    elif use_fp16:
        key, compute, amp = "fp16", "fp16", True
        weights = load or ("fp32" if method in ("full", "freeze") else "fp16")
    elif pure_on:
        key, dt = pure_on[0]
        compute, weights, amp = dt, dt, False
    elif load is not None:
        key, compute, weights, amp = dtype_key, load, load, False
    else:
        key, compute, weights, amp = ("bf16" if f.has("bf16") else "fp16"), "fp32", "fp32", False
        note = "no bf16/fp16: fp32 training"
    if load is not None and key != dtype_key and weights == load and quant is None:
        f.put(dtype_key, "weights", weights)
    add = (lambda fld, val: f.put(key, fld, val, note=note)) if explicit else \
        (lambda fld, val: f.default(key, fld, val, note=f"{FRAMEWORKS[f.framework][1]}: bf16"))
    add("compute", compute)
    if quant is None and not (load is not None and key != dtype_key):
        add("weights", weights)
    add("amp", amp)


def _lora_targets(f: _File, key: str, value: Any) -> tuple[str, ...] | None:
    try:
        if isinstance(value, str):
            return parse_targets(value)
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            return parse_targets(value)
    except SetupError as e:
        f.refuse(key, "lora_targets", f"names modules VRAM Lab does not model ({e})")
        return None
    raise f.fail(key, f"must be a list of module names, got {value!r}")


def _fsdp(f: _File, strategy_key: str, offload_key: str, ckpt_key: str | None, reshard_key: str | None) -> None:
    """FSDP settings (accelerate's fsdp_config, or axolotl / transformers fsdp_config) as sharding."""
    strat = f.get(strategy_key)
    reshard = f.bool(reshard_key) if reshard_key else _ABSENT
    if strat is not _ABSENT:
        s = str(strat).strip().upper()
        table = {"1": "fsdp", "FULL_SHARD": "fsdp", "2": "zero2", "SHARD_GRAD_OP": "zero2", "3": "none",
                 "NO_SHARD": "none", "4": "fsdp", "HYBRID_SHARD": "fsdp", "5": "zero2", "_HYBRID_SHARD_ZERO2": "zero2"}
        if s not in table:
            raise f.fail(strategy_key, f"unknown FSDP sharding strategy {strat!r}")
        note = "modelled as FULL_SHARD within one node" if "HYBRID" in s or s == "4" else (
            "FSDP SHARD_GRAD_OP shards gradients and optimizer states: modelled as ZeRO-2" if table[s] == "zero2"
            else "")
        f.put(strategy_key, "sharding", table[s], note=note)
    elif reshard is not _ABSENT:
        f.put(reshard_key, "sharding", "fsdp" if reshard else "zero2",
              note="" if reshard else "FSDP2 without resharding after forward: modelled as ZeRO-2")
    else:
        f.default(strategy_key, "sharding", "fsdp", note="FULL_SHARD")
    off = f.bool(offload_key)
    if off is not _ABSENT:
        f.put(offload_key, "offload", "params" if off else "none")
    if ckpt_key:
        ck = f.bool(ckpt_key)
        if ck is True:
            f.put(ckpt_key, "grad_ckpt", True)


# ---- frameworks -------------------------------------------------------------------------------------------


def _lora_variants(f: _File, dora_key: str, rslora_key: str, note: str = "") -> None:
    """peft's ``use_dora`` / ``use_rslora`` under the framework's key (every framework passes them to LoraConfig,
    default False): DoRA is modelled; rsLoRA changes only the scaling, so no tensor."""
    for key, fld in ((dora_key, "use_dora"), (rslora_key, "use_rslora")):
        v = f.bool(key)
        if v is not _ABSENT and v is not None:
            f.put(key, fld, v, note=note)


def _axolotl(f: _File) -> None:
    v = FRAMEWORKS["axolotl"][1]
    base = f.get("base_model")
    if isinstance(base, str):
        f.model = base
    adapter = f.get("adapter")
    q4, q8 = f.bool("load_in_4bit"), f.bool("load_in_8bit")
    if adapter is _ABSENT or adapter == "":
        method = "full"
        f.default("adapter", "method", "full", note=f"{v}: no adapter is full fine-tuning")
    elif adapter in ("lora", "qlora"):
        method = "qlora" if adapter == "qlora" or q4 is True else "lora"
        f.put("adapter", "method", method)
    else:
        method = "full"
        f.refuse("adapter", "method", "is an adapter VRAM Lab does not model (lora, qlora)")
    quant = None
    if method == "qlora":
        quant = "nf4"
        f.row("load_in_4bit", f.get("load_in_4bit"), "weights", "nf4", SET if q4 is True else DEFAULT)
    elif q8 is True:
        quant = "int8"
        f.put("load_in_8bit", "weights", "int8")
    # bf16 "auto" (the schema's default): bf16 on a GPU that has it
    _precision(f, method, quant, pure={"bfloat16": "bf16", "float16": "fp16"},
               bf16_default=D.AXOLOTL["bf16"] == "auto")
    if method in ("lora", "qlora"):
        r = f.int("lora_r")
        if r is _ABSENT:  # axolotl passes None on to peft's LoraConfig
            f.default("lora_r", "lora_rank", D.PEFT_LORA["r"], note=f"{v}: none; peft's LoraConfig r")
        else:
            f.put("lora_r", "lora_rank", r)
        a = f.float("lora_alpha")
        if a is not _ABSENT:
            f.put("lora_alpha", "lora_alpha", a)
        d = f.float("lora_dropout")
        f.take("lora_dropout", "lora_dropout", d, D.AXOLOTL["lora_dropout"])
        _lora_variants(f, "peft_use_dora", "peft_use_rslora")
        if f.bool("lora_target_linear") is True:
            f.put("lora_target_linear", "lora_targets", parse_targets("all-linear"))
        elif f.has("lora_target_modules"):
            t = _lora_targets(f, "lora_target_modules", f.get("lora_target_modules"))
            if t is not None:
                f.put("lora_target_modules", "lora_targets", t)
        f.not_modelled("lora_modules_to_save", note="extra fully-trained modules")
        f.not_modelled("peft_use_dora", "peft_use_rslora", note="DoRA / rsLoRA variants")
    f.take("micro_batch_size", "micro_batch", f.int("micro_batch_size"), D.AXOLOTL["micro_batch_size"])
    f.take("gradient_accumulation_steps", "grad_accum", f.int("gradient_accumulation_steps"),
           D.AXOLOTL["gradient_accumulation_steps"])
    sl = f.int("sequence_len")
    f.take("sequence_len", "seq_len", sl, D.AXOLOTL["sequence_len"], note=v)
    gc = f.get("gradient_checkpointing")
    if gc is _ABSENT:
        f.default("gradient_checkpointing", "grad_ckpt", bool(D.AXOLOTL["gradient_checkpointing"]),
                  note=f"{v}: off unless set")
    elif gc in ("unsloth", "offload"):
        f.put("gradient_checkpointing", "grad_ckpt", True, note="checkpoints kept on the GPU in the model "
              f"(the {gc} variant offloads them to CPU: not modelled)")
    else:
        f.put("gradient_checkpointing", "grad_ckpt", f.bool("gradient_checkpointing"))
    # normalize_config (axolotl 0.19.0 utils/config): reentrant unless the kwargs say, parameters are unfrozen
    # by name or an RL trainer runs (whose builder passes use_reentrant False)
    plain = not f.has("unfrozen_parameters") and not f.has("rl")
    _ckpt_mode(f, "gradient_checkpointing_kwargs.use_reentrant", plain,
               f"{v}: {'reentrant' if plain else 'non-reentrant with rl or unfrozen_parameters'}")
    if f.bool("eager_attention") is True:
        f.put("eager_attention", "attention", "eager")
    else:
        for key in ("flash_attention", "sdp_attention", "xformers_attention", "flex_attention"):
            if f.bool(key) is True:
                f.put(key, "attention", "sdpa", note="saves the output and the log-sum-exp, as SDPA")
                break
    _optimizer(f, "optimizer", D.AXOLOTL["optimizer"], v)
    if f.bool("chunked_cross_entropy") is True:
        f.put("chunked_cross_entropy", "chunked_loss", True)
    f.not_modelled("sample_packing", "pad_to_sequence_len", note="packing / padding to full length")
    f.not_modelled("unfrozen_parameters", note="selective freezing by name")
    if f.bool("cut_cross_entropy") is True:  # axolotl's CutCrossEntropyPlugin: cce_patch on the model's forward
        f.put("cut_cross_entropy", "loss_kernel", "cce", note="lm_head and the loss without logits")
    f.not_modelled("liger_fused_linear_cross_entropy", "liger_cross_entropy",
                   note="fused linear cross-entropy kernels")
    f.not_modelled("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", note="fused LoRA kernels")
    f.not_modelled("activation_offloading", "torch_compile", "tensor_parallel_size", "context_parallel_size",
                   "sequence_parallel_degree")
    _follow_deepspeed(f, "deepspeed")
    fsdp = f.get("fsdp")
    fsdp_config = f.get("fsdp_config")
    if fsdp is not _ABSENT or (isinstance(fsdp_config, Mapping) and fsdp_config):
        _trainer_fsdp(f, fsdp, "fsdp")


def _trainer_fsdp(f: _File, fsdp: Any, key: str) -> None:
    """transformers' / axolotl's ``fsdp: "full_shard auto_wrap offload"`` (string or list) + fsdp_config."""
    words = fsdp.split() if isinstance(fsdp, str) else [str(w) for w in fsdp] if isinstance(fsdp, list) else []
    words = [w.lower() for w in words]
    if fsdp is not _ABSENT and not (isinstance(fsdp, str | list)):
        raise f.fail(key, f"must be a list or a string of FSDP options, got {fsdp!r}")
    if "shard_grad_op" in words or "hybrid_shard_zero2" in words:
        f.put(key, "sharding", "zero2", note="FSDP SHARD_GRAD_OP: modelled as ZeRO-2")
    elif "no_shard" in words:
        f.put(key, "sharding", "none")
    elif words or fsdp is _ABSENT:
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


def _follow_deepspeed(f: _File, key: str) -> None:
    ds = f.get(key)
    if ds is _ABSENT:
        return
    if isinstance(ds, Mapping):  # an inline DeepSpeed config (transformers accepts a dict)
        sub = _File(f"{f.path} ({key})", "deepspeed", ds)
        _deepspeed(sub)
        f.rows.extend(_replace(r, key=f"{key}.{r.key}") for r in sub.rows)
        return
    if not isinstance(ds, str):
        raise f.fail(key, f"must be the path of a DeepSpeed JSON, got {ds!r}")
    path = _beside(f, ds)
    if path.is_file():
        f.follow.append(path)
        f.row(key, ds, None, None, SET, note=f"read {path.name} too")
    else:
        f.row(key, ds, None, None, NOT_MODELLED, note="file not found next to the config: give it with --config")


def _beside(f: _File, name: str) -> Path:
    """A file a config names: absolute, or next to the config, or (as the launcher sees it) in the current
    folder."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path
    near = Path(f.path).parent / path
    return near if near.is_file() or not path.is_file() else path


def _llamafactory(f: _File) -> None:
    v = FRAMEWORKS["llamafactory"][1]
    m = f.get("model_name_or_path")
    if isinstance(m, str):
        f.model = m
    ft = f.get("finetuning_type")
    qbit = f.int("quantization_bit")
    if ft is _ABSENT:
        ft = D.LLAMAFACTORY_FINETUNING["finetuning_type"]
        method_status = DEFAULT
    else:
        method_status = SET
    if ft not in ("lora", "full", "freeze"):
        f.refuse("finetuning_type", "method", "is not a method VRAM Lab models (lora, full, freeze)")
        ft = "full"
    method = "qlora" if ft == "lora" and qbit == 4 else ft
    f.row("finetuning_type", None if method_status == DEFAULT else f.get("finetuning_type"), "method", method,
          method_status, note=f"{v}: lora" if method_status == DEFAULT else "")
    quant = None
    if qbit is not _ABSENT:
        qm = f.get("quantization_method")
        if qm not in (_ABSENT, "bitsandbytes", "bnb"):
            f.refuse("quantization_method", "weights", "is a quantization VRAM Lab does not model (bitsandbytes)")
        elif qbit == 4:
            quant = "nf4"
            qt = f.get("quantization_type")
            if qt not in (_ABSENT, "nf4"):
                f.refuse("quantization_type", "weights", "is a 4-bit type VRAM Lab does not model (nf4)")
            f.put("quantization_bit", "weights", "nf4")
            dq = f.bool("double_quantization")
            f.take("double_quantization", "double_quant", dq, D.LLAMAFACTORY_MODEL["double_quantization"], note=v)
        elif qbit == 8:
            quant = "int8"
            f.put("quantization_bit", "weights", "int8")
        else:
            f.refuse("quantization_bit", "weights", "is a bit width VRAM Lab does not model (4, 8)")
    _precision(f, method, quant, pure={"pure_bf16": "bf16"})
    if method in ("lora", "qlora"):
        r = f.int("lora_rank")
        f.take("lora_rank", "lora_rank", r, D.LLAMAFACTORY_FINETUNING["lora_rank"], note=v)
        a = f.float("lora_alpha")
        if a is not _ABSENT:
            f.put("lora_alpha", "lora_alpha", a)
        else:  # FinetuningArguments.__post_init__: lora_alpha = lora_alpha or lora_rank * 2
            rank = D.LLAMAFACTORY_FINETUNING["lora_rank"] if r is _ABSENT else r
            f.default("lora_alpha", "lora_alpha", float(rank * 2), note=f"{v}: lora_rank x 2")
        d = f.float("lora_dropout")
        f.take("lora_dropout", "lora_dropout", d, D.LLAMAFACTORY_FINETUNING["lora_dropout"])
        _lora_variants(f, "use_dora", "use_rslora")
        t = f.get("lora_target")
        if t is _ABSENT:
            assert D.LLAMAFACTORY_FINETUNING["lora_target"] == "all"
            f.default("lora_target", "lora_targets", parse_targets("all-linear"), note=f"{v}: all")
        else:
            targets = _lora_targets(f, "lora_target", t)
            if targets is not None:
                f.put("lora_target", "lora_targets", targets)
        f.not_modelled("additional_target", note="extra fully-trained modules")
        f.not_modelled("use_dora", "use_rslora", "pissa_init", "loraplus_lr_ratio", note="LoRA variants")
    elif method == "freeze":
        _llamafactory_freeze(f, v)
    _trainer_common(f, v, ckpt_default=True)
    cl = f.int("cutoff_len")
    f.take("cutoff_len", "seq_len", cl, D.LLAMAFACTORY_DATA["cutoff_len"], note=v)
    fa = f.get("flash_attn")
    if fa is not _ABSENT:
        f.put("flash_attn", "attention", "eager" if str(fa).lower() == "disabled" else "sdpa")
    f.not_modelled("packing", "neat_packing", note="packing")
    f.not_modelled("use_galore", "use_apollo", "use_badam", "use_adam_mini", "use_muon", note="optimizer variant")
    f.not_modelled("enable_liger_kernel", "use_unsloth", "use_unsloth_gc", "upcast_layernorm", "upcast_lmhead_output")
    if f.get("stage") not in (_ABSENT, "sft", "pt"):
        f.not_modelled("stage", note="a stage with a reference or reward model; the policy step is modelled")
    _follow_deepspeed(f, "deepspeed")


# LLaMA-Factory's freeze_extra_modules name modules outside the layers by the model's own names; the roles
# VRAM Lab models (spec.FREEZE_EXTRAS) by the names transformers' decoders give them
_FREEZE_EXTRA_NAMES = {"embed_tokens": "embed_tokens", "wte": "embed_tokens", "word_embeddings": "embed_tokens",
                       "embed_in": "embed_tokens", "norm": "norm", "ln_f": "norm", "final_layernorm": "norm",
                       "norm_f": "norm", "lm_head": "lm_head", "embed_out": "lm_head"}


def _names(f: _File, key: str) -> list[str]:
    """A comma-separated string or a list of names (LLaMA-Factory's ``split_arg``)."""
    raw = f.get(key)
    if isinstance(raw, str):
        return [x.strip() for x in raw.split(",") if x.strip()]
    if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        return [x.strip() for x in raw]
    raise f.fail(key, f"must be module names separated by commas, got {raw!r}")


def _llamafactory_freeze(f: _File, v: str) -> None:
    """``_setup_freeze_tuning`` (LLaMA-Factory 0.9.5, model/adapter.py): the last ``freeze_trainable_layers``
    layers train (negative: the first ones), only their ``freeze_trainable_modules`` ("all"), and nothing
    outside the layers unless ``freeze_extra_modules`` names it."""
    raw = f.get("freeze_trainable_layers")
    if isinstance(raw, int) and not isinstance(raw, bool) and raw < 0:
        f.refuse("freeze_trainable_layers", "trainable_layers",
                 "trains the first layers (a negative count): VRAM Lab models the last N")
    else:
        f.take("freeze_trainable_layers", "trainable_layers", f.int("freeze_trainable_layers"),
               D.LLAMAFACTORY_FINETUNING["freeze_trainable_layers"], note=v)
    if f.has("freeze_trainable_modules") and _names(f, "freeze_trainable_modules") != ["all"]:
        f.not_modelled("freeze_trainable_modules", note="only some modules of the trained layers: modelled as all "
                       "of them (an overestimate)")
    if f.bool("use_llama_pro") is True:
        f.not_modelled("use_llama_pro", note="LLaMA Pro's expanded layers spread over the model: modelled as the "
                       "last N")
    if not f.has("freeze_extra_modules"):
        f.default("freeze_extra_modules", "freeze_extra", (),
                  note=f"{v}: none (embedding, final norm and head frozen)")
        return
    names = _names(f, "freeze_extra_modules")
    known = tuple(dict.fromkeys(_FREEZE_EXTRA_NAMES[n] for n in names if n in _FREEZE_EXTRA_NAMES))
    unknown = [n for n in names if n not in _FREEZE_EXTRA_NAMES]
    note = "LLaMA-Factory matches names as substrings: 'norm' also trains every layer's norms (not modelled)" \
        if "norm" in names else ""
    f.put("freeze_extra_modules", "freeze_extra", known, note=note)
    if unknown:
        f.row("freeze_extra_modules", unknown, None, None, NOT_MODELLED,
              note="modules VRAM Lab does not know by these names (it models the embedding, final norm and head)")


def _ckpt_mode(f: _File, key: str, default: bool, note: str) -> None:
    """Which torch.utils.checkpoint the framework asks for (``use_reentrant``), from ``key`` or its default."""
    parent = key.rpartition(".")[0]
    if parent and f.has(parent) and isinstance(f.get(parent), str):  # TrainingArguments takes the dict as JSON
        try:
            parsed = json.loads(f.get(parent))
        except ValueError:
            raise f.fail(parent, "must be a mapping such as {\"use_reentrant\": false}") from None
        if isinstance(parsed, Mapping) and isinstance(parsed.get("use_reentrant"), bool):
            f.row(key, parsed["use_reentrant"], "ckpt_reentrant", parsed["use_reentrant"], SET)
            return
    f.take(key, "ckpt_reentrant", f.bool(key), default, note=note)


def _trainer_common(f: _File, version: str, *, ckpt_default: bool) -> None:
    """The TrainingArguments keys every HF-Trainer-based framework shares."""
    args = D.LLAMAFACTORY_TRAINING if f.framework == "llamafactory" else D.TRAINING_ARGUMENTS
    mb = args["per_device_train_batch_size"]
    f.take("per_device_train_batch_size", "micro_batch", f.int("per_device_train_batch_size"), mb,
           note=f"{version}: {mb}")
    f.take("gradient_accumulation_steps", "grad_accum", f.int("gradient_accumulation_steps"),
           args["gradient_accumulation_steps"])
    if f.framework == "llamafactory":
        d = f.bool("disable_gradient_checkpointing")
        if d is _ABSENT:
            f.default("disable_gradient_checkpointing", "grad_ckpt", not D.LLAMAFACTORY_MODEL[
                "disable_gradient_checkpointing"], note=f"{version}: on unless disabled")
        else:
            f.put("disable_gradient_checkpointing", "grad_ckpt", not d)
        _ckpt_mode(f, "use_reentrant_gc", D.LLAMAFACTORY_MODEL["use_reentrant_gc"], f"{version}: reentrant")
    else:
        key = "activation_checkpointing" if f.has("activation_checkpointing") else "gradient_checkpointing"
        gc = f.bool(key)
        if gc is _ABSENT:
            f.default(key, "grad_ckpt", ckpt_default,
                      note=f"{version}: {'on' if ckpt_default else 'off'} unless set")
        else:
            f.put(key, "grad_ckpt", gc)
        key = "activation_checkpointing_kwargs" if f.has("activation_checkpointing_kwargs") else \
            "gradient_checkpointing_kwargs"
        _ckpt_mode(f, f"{key}.use_reentrant", False, "transformers 5 gradient_checkpointing_enable: "
                   "use_reentrant False")
    _optimizer(f, "optim", args["optim"], version)
    f.not_modelled("torch_compile", "gradient_checkpointing_kwargs.offload", note="")
    fsdp = f.get("fsdp")
    if fsdp not in (_ABSENT, "", []):
        _trainer_fsdp(f, fsdp, "fsdp")
    if f.framework in ("trl", "trl-dpo", "trl-grpo", "trl-kto", "trl-cpo", "transformers"):
        _follow_deepspeed(f, "deepspeed")


def _trl(f: _File) -> None:
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
        quant = "nf4"
        qt = f.get("bnb_4bit_quant_type")
        if qt not in (_ABSENT, "nf4"):
            f.refuse("bnb_4bit_quant_type", "weights", "is a 4-bit type VRAM Lab does not model (nf4)")
        f.put("load_in_4bit", "weights", "nf4")
        dq = f.bool("use_bnb_nested_quant")
        f.take("use_bnb_nested_quant", "double_quant", dq, D.TRL_MODEL["use_bnb_nested_quant"], note=f"{v}: off")
    elif q8 is True and peft:
        quant = "int8"
        f.put("load_in_8bit", "weights", "int8")
    dtype_key = next((k for k in ("model_init_kwargs.dtype", "model_init_kwargs.torch_dtype", "dtype", "torch_dtype")
                      if f.has(k)), "dtype")
    _precision(f, method, quant, dtype_key=dtype_key, bf16_default=fw.startswith("trl"))
    if peft:
        r = f.int("lora_r")
        f.take("lora_r", "lora_rank", r, D.TRL_MODEL["lora_r"], note=v)
        a = f.float("lora_alpha")
        f.take("lora_alpha", "lora_alpha", a, float(D.TRL_MODEL["lora_alpha"]), note=v)
        d = f.float("lora_dropout")
        f.take("lora_dropout", "lora_dropout", d, D.TRL_MODEL["lora_dropout"], note=v)
        _lora_variants(f, "use_dora", "use_rslora", note=v)
        t = f.get("lora_target_modules")
        if t is _ABSENT:
            f.default("lora_target_modules", "lora_targets", parse_targets("q_proj,v_proj"),
                      note=f"{v}: peft's per-architecture default (q_proj, v_proj for Llama-style models)")
        else:
            targets = _lora_targets(f, "lora_target_modules", t)
            if targets is not None:
                f.put("lora_target_modules", "lora_targets", targets)
        f.not_modelled("lora_modules_to_save", note="extra fully-trained modules")
        f.not_modelled("use_dora", "use_rslora", note="LoRA variants")
    config = {"trl": D.SFT, "trl-dpo": D.DPO, "trl-grpo": D.GRPO, "trl-kto": D.KTO, "trl-cpo": D.CPO}
    _trainer_common(f, v, ckpt_default=bool(config.get(fw, D.TRAINING_ARGUMENTS)["gradient_checkpointing"]))
    if fw in ("trl-dpo", "trl-grpo", "trl-kto"):
        _trl_objective(f, v)
    if fw == "trl-cpo":
        _trl_cpo(f, v)
    if fw == "trl":
        key = "max_length" if f.has("max_length") or not f.has("max_seq_length") else "max_seq_length"
        sl = f.int(key)
        f.take(key, "seq_len", sl, D.SFT["max_length"], note=v)
        # SFTTrainer.compute_loss (TRL 1.16.0) computes nll and dft (and chunked_nll, now an alias of nll) through
        # its fused LM head (trl/kernels/chunked_logprob.py: the logits in vocabulary tiles, never whole): modelled
        # as VRAM Lab's chunked loss, which also never holds the whole logits
        fused = "TRL's fused chunked LM head (vocabulary tiles): modelled as the chunked loss"
        lt = f.get("loss_type")
        if lt is _ABSENT:
            f.default("loss_type", "chunked_loss", D.SFT["loss_type"] in SFT_FUSED_LOSSES,
                      note=f"{v}: {D.SFT['loss_type']}, {fused}")
        elif lt in SFT_FUSED_LOSSES:
            f.put("loss_type", "chunked_loss", True, note=fused)
        else:
            f.refuse("loss_type", "chunked_loss", "is a loss VRAM Lab does not model (nll, dft, chunked_nll)")
        f.not_modelled("packing", "padding_free", note="packing / padding-free batches")
        f.not_modelled("activation_offloading", "use_liger_kernel")
    attn = f.get("attn_implementation")
    if attn is _ABSENT:
        attn = f.get("model_init_kwargs.attn_implementation")
    if attn is not _ABSENT:
        key = "attn_implementation" if f.has("attn_implementation") else "model_init_kwargs.attn_implementation"
        f.put(key, "attention", "eager" if str(attn).lower() == "eager" else "sdpa")


def _trl_cpo(f: _File, v: str) -> None:
    """CPOConfig (trl.experimental, TRL 1.16.0): CPO (loss_type sigmoid) or SimPO; no reference model."""
    lt = f.get("loss_type")
    objective = "cpo" if lt is _ABSENT else CPO_LOSSES.get(str(lt))
    if objective is None:
        f.refuse("loss_type", "objective", f"is a loss VRAM Lab does not model ({', '.join(sorted(CPO_LOSSES))})")
    elif lt is _ABSENT:
        f.default("loss_type", "objective", objective, note=f"{v}: sigmoid")
    else:
        f.put("loss_type", "objective", objective)
    alpha = f.float("cpo_alpha")
    if alpha is not _ABSENT and alpha != 1.0:  # 0 drops the chosen rows' NLL (its logits copy and fp32 softmax)
        f.refuse("cpo_alpha", "objective", "other than 1.0 is not modelled (the NLL term on the chosen rows)")
    sl = f.int("max_length")
    f.take("max_length", "seq_len", sl, D.CPO["max_length"], note=v)
    f.take("beta", "beta", f.float("beta"), D.CPO["beta"], note=v)
    f.not_modelled("alpha", note="AlphaPO's reward transform (vectors of the micro batch)")
    f.not_modelled("padding_value", "max_completion_length", note="padding: every row is full length")


def _trl_objective(f: _File, v: str) -> None:
    """DPOConfig / GRPOConfig (TRL 1.16.0): the objective and its settings, defaults as the config has them."""
    if f.framework in ("trl-dpo", "trl-kto"):
        lt = f.get("loss_type")
        losses = DPO_LOSSES if f.framework == "trl-dpo" else {"kto": "kto"}
        objective = ("dpo" if f.framework == "trl-dpo" else "kto") if lt is _ABSENT else losses.get(str(lt))
        if objective is None:
            f.refuse("loss_type", "objective", f"is a loss VRAM Lab does not model ({', '.join(sorted(losses))})")
        elif lt is _ABSENT:
            f.default("loss_type", "objective", objective, note=f"{v}: {'sigmoid' if objective == 'dpo' else 'kto'}")
        else:
            f.put("loss_type", "objective", objective)
        cfg = D.DPO if f.framework == "trl-dpo" else D.KTO
        sl = f.int("max_length")
        f.take("max_length", "seq_len", sl, cfg["max_length"], note=v)
        if f.bool("precompute_ref_log_probs") is True:
            f.put("precompute_ref_log_probs", "reference", "precomputed")
        b = f.float("beta")
        f.take("beta", "beta", b, cfg["beta"], note=v)
        f.not_modelled("padding_free", "use_weighting", "activation_offloading", "use_liger_kernel")
        return
    key = next(k for k in sorted(_GRPO_KEYS) if f.has(k))
    f.put(key, "objective", "grpo", note="a key only GRPOConfig has")
    c = f.int("max_completion_length")
    f.take("max_completion_length", "completion_len", c, D.GRPO["max_completion_length"], note=v)
    c = D.GRPO["max_completion_length"] if c is _ABSENT else c
    p = f.int("max_prompt_length")
    if p is _ABSENT:
        f.default("max_prompt_length", "seq_len", 512 + c,
                  note=f"{v} does not truncate prompts: 512 prompt tokens assumed, give --prompt-len")
    else:
        f.put("max_prompt_length", "seq_len", p + c, note="prompt + completion")
    f.take("num_generations", "num_generations", f.int("num_generations"), D.GRPO["num_generations"], note=v)
    spg = f.int("steps_per_generation")
    if spg is not _ABSENT:
        f.put("steps_per_generation", "steps_per_generation", spg)
    f.take("num_iterations", "num_iterations", f.int("num_iterations"), D.GRPO["num_iterations"], note=v)
    f.take("beta", "beta", f.float("beta"), D.GRPO["beta"], note=v)
    if f.bool("use_vllm") is True:
        mode = f.get("vllm_mode")
        backend = "vllm-server" if (D.GRPO["vllm_mode"] if mode is _ABSENT else mode) == "server" \
            else "vllm-colocate"
        f.put("vllm_mode" if mode is not _ABSENT else "use_vllm", "generation_backend", backend)
        if backend == "vllm-colocate":
            f.take("vllm_gpu_memory_utilization", "vllm_memory_fraction", f.float("vllm_gpu_memory_utilization"),
                   D.GRPO["vllm_gpu_memory_utilization"], note=v)
            sleep = f.bool("vllm_enable_sleep_mode")
            if sleep is not _ABSENT:
                f.put("vllm_enable_sleep_mode", "vllm_sleep", sleep)
    else:
        f.default("use_vllm", "generation_backend", "transformers", note=f"{v}: model.generate")
    f.not_modelled("cast_lm_head_to_fp32", "use_transformers_paged", "top_entropy_quantile",
                   "activation_offloading", "use_liger_kernel")


def _peft(f: _File) -> None:
    v = FRAMEWORKS["peft"][1]
    base = f.get("base_model_name_or_path")
    if isinstance(base, str):
        f.model = base
    pt = f.get("peft_type")
    if pt not in (_ABSENT, "LORA"):
        f.refuse("peft_type", "method", "is a peft method VRAM Lab does not model (LORA)")
    f.row("peft_type", f.get("peft_type") if f.has("peft_type") else None, "method", "lora",
          SET if f.has("peft_type") else DEFAULT, note="the base's quantization is not in adapter_config.json")
    r = f.int("r")
    f.take("r", "lora_rank", r, D.PEFT_LORA["r"], note=v)
    a = f.float("lora_alpha")
    f.take("lora_alpha", "lora_alpha", a, float(D.PEFT_LORA["lora_alpha"]), note=v)
    d = f.float("lora_dropout")
    f.take("lora_dropout", "lora_dropout", d, D.PEFT_LORA["lora_dropout"])
    _lora_variants(f, "use_dora", "use_rslora")
    t = f.get("target_modules")
    if t is not _ABSENT:
        targets = _lora_targets(f, "target_modules", t)
        if targets is not None:
            f.put("target_modules", "lora_targets", targets)
    f.not_modelled("modules_to_save", note="extra fully-trained modules")
    f.not_modelled("use_dora", "use_rslora", note="LoRA variants")
    f.not_modelled("rank_pattern", "alpha_pattern", "layers_to_transform", note="per-layer ranks or layers")


def _zero(f: _File, stage_key: str, param_key: str, optimizer_key: str) -> None:
    """A ZeRO stage and its offload devices, as DeepSpeed's JSON and accelerate's deepspeed_config name them:
    parameters offloaded imply the optimizer too; NVMe is off the GPU like the CPU."""
    stage = f.int(stage_key, low=0)
    if stage is not _ABSENT:
        if stage > 3:
            raise f.fail(stage_key, f"must be 0, 1, 2 or 3, got {stage}")
        f.put(stage_key, "sharding", ("none", "zero1", "zero2", "zero3")[stage])
    par_dev, opt_dev = f.get(param_key), f.get(optimizer_key)
    nvme = "NVMe modelled as CPU (off the GPU either way)"
    if par_dev not in (_ABSENT, "none"):
        f.put(param_key, "offload", "params", note=nvme if par_dev == "nvme" else "")
    elif opt_dev not in (_ABSENT, "none"):
        f.put(optimizer_key, "offload", "optimizer", note=nvme if opt_dev == "nvme" else "")
    elif opt_dev == "none" or par_dev == "none":
        f.put(optimizer_key if opt_dev == "none" else param_key, "offload", "none")


def _deepspeed(f: _File) -> None:
    _zero(f, "zero_optimization.stage", "zero_optimization.offload_param.device",
          "zero_optimization.offload_optimizer.device")
    bf16 = f.bool("bf16.enabled") if f.get("bf16.enabled") != "auto" else _ABSENT
    fp16 = f.bool("fp16.enabled") if f.get("fp16.enabled") != "auto" else _ABSENT
    if bf16 is True:
        f.put("bf16.enabled", "compute", "bf16")
    elif fp16 is True:
        f.put("fp16.enabled", "compute", "fp16")
    elif bf16 is False and fp16 is False:
        f.put("bf16.enabled", "compute", "fp32", note="bf16 and fp16 both disabled: fp32")
    mb = f.int("train_micro_batch_size_per_gpu")
    if mb is not _ABSENT:
        f.put("train_micro_batch_size_per_gpu", "micro_batch", mb)
    ga = f.int("gradient_accumulation_steps")
    if ga is not _ABSENT:
        f.put("gradient_accumulation_steps", "grad_accum", ga)
    f.not_modelled("train_batch_size", note="the world size comes from the launcher: give --gpus")
    f.not_modelled("zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
                   "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters",
                   "zero_optimization.stage3_max_reuse_distance", note="communication buckets")
    f.not_modelled("activation_checkpointing.partition_activations", "activation_checkpointing.cpu_checkpointing",
                   note="DeepSpeed's activation partitioning")
    f.not_modelled("zero_optimization.zero_quantized_weights", "zero_optimization.zero_hpz_partition_size",
                   note="ZeRO++")
    if f.get("bf16.enabled") is True or f.get("fp16.enabled") is True:
        key = "bf16.enabled" if f.get("bf16.enabled") is True else "fp16.enabled"
        f.row(key, True, None, None, NOT_MODELLED, note="DeepSpeed's mixed-precision optimizer also keeps fp32 "
              "master weights (sharded under ZeRO); set --master-weights to count them")


def _accelerate(f: _File) -> None:
    dt = f.get("distributed_type")
    n = f.int("num_processes")
    if n is not _ABSENT:
        f.put("num_processes", "gpus", n)
    if dt is _ABSENT:
        return
    dt = str(dt).upper()
    if dt == "FSDP":
        _fsdp(f, "fsdp_config.fsdp_sharding_strategy", "fsdp_config.fsdp_offload_params"
              if f.has("fsdp_config.fsdp_offload_params") else "fsdp_config.fsdp_cpu_offload",
              "fsdp_config.fsdp_activation_checkpointing", "fsdp_config.fsdp_reshard_after_forward")
    elif dt == "DEEPSPEED":
        cfg_file = f.get("deepspeed_config.deepspeed_config_file")
        if isinstance(cfg_file, str):
            path = _beside(f, cfg_file)
            if path.is_file():
                f.follow.append(path)
                f.row("deepspeed_config.deepspeed_config_file", cfg_file, None, None, SET, note=f"read {path.name} too")
            else:
                f.row("deepspeed_config.deepspeed_config_file", cfg_file, None, None, NOT_MODELLED,
                      note="file not found next to the config: give it with --config")
        _zero(f, "deepspeed_config.zero_stage", "deepspeed_config.offload_param_device",
              "deepspeed_config.offload_optimizer_device")
        ga = f.int("deepspeed_config.gradient_accumulation_steps")
        if ga is not _ABSENT:
            f.put("deepspeed_config.gradient_accumulation_steps", "grad_accum", ga)
    elif dt in ("NO", "MULTI_GPU"):
        note = "DDP: every GPU holds everything" if dt == "MULTI_GPU" else ""
        f.put("distributed_type", "sharding", "none", note=note)
    else:
        f.not_modelled("distributed_type", note="only NO, MULTI_GPU, FSDP and DEEPSPEED are modelled")
    mp = f.get("mixed_precision")
    if mp not in (_ABSENT, "no"):
        if mp in ("bf16", "fp16"):
            f.put("mixed_precision", "compute", mp)
        else:
            f.not_modelled("mixed_precision", note=f"{mp} compute")


def _swift(f: _File) -> None:
    from vramlab.core.sources.swift import read

    read(f)


_READERS = {"ms-swift": _swift, "axolotl": _axolotl, "llamafactory": _llamafactory, "trl": _trl, "trl-dpo": _trl,
            "trl-grpo": _trl,
            "trl-kto": _trl, "trl-cpo": _trl,
            "transformers": _trl,
            "peft": _peft, "deepspeed": _deepspeed, "accelerate": _accelerate}


def _read_one(path: Path) -> _File:
    data = read_config_file(path)  # a shell script running ms-swift comes back as its arguments
    f = _File(str(path), detect_framework(data, str(path)), data)
    _READERS[f.framework](f)
    return f


def read_training_configs(paths: Sequence[str | Path], *, adapter: Mapping[str, Any] | None = None,
                          adapter_source: str = "adapter_config.json") -> SetupSource:
    """Read training configs (and, first, an adapter config that came with a Hub model) into one
    :class:`SetupSource`: defaults of every file, then explicit keys in order; a later explicit value for
    a field marks the earlier row ``overridden_by`` that file."""
    files: list[_File] = []
    if adapter is not None:
        f = _File(adapter_source, "peft", adapter)
        _peft(f)
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


def _combine(files: Iterable[_File]) -> SetupSource:
    files = list(files)
    changes: dict[str, Any] = {}
    owner: dict[str, int] = {}  # field -> index of the row that set it
    rows: list[Mapped] = []
    for f in files:
        rows.extend(f.rows)
    refused: dict[str, Mapped] = {}
    for status in (DEFAULT, SET):  # defaults first, then explicit keys: an explicit key beats any default
        for i, r in enumerate(rows):
            if r.status != status or r.field is None:
                continue
            if r.field in owner:
                prev = rows[owner[r.field]]
                if status == DEFAULT and prev.status == DEFAULT and prev.file != r.file:
                    continue  # the first file's framework default stands
                if prev.setting != r.setting:
                    rows[owner[r.field]] = _replace(prev, overridden_by=f"{Path(r.file).name} {r.key}")
            changes[r.field] = r.setting
            owner[r.field] = i
    for r in rows:
        if r.status == REFUSED and r.field is not None:
            refused[r.field] = r
            changes.pop(r.field, None)
    model = next((f.model for f in files if f.model), None)
    return SetupSource(files=tuple(f.path for f in files), frameworks=tuple((f.path, f.framework) for f in files),
                       changes=changes, rows=tuple(rows), model=model, refused=refused)
