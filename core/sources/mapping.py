"""The shared reading of training configs: the frameworks and the versions whose defaults are followed, one
key's row (:class:`Mapped`), the result of a read (:class:`SetupSource`), and one file's keys
(:class:`ConfigFile`, with the typed getters every dialect uses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.sources.defaults import FRAMEWORK_TRANSFORMERS, VERSIONS
from vramlab.core.versions import MODELLED

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
    "deepspeed": ("DeepSpeed", "DeepSpeed 0.19 config JSON"),
    "accelerate": ("accelerate", "accelerate 1.x config YAML"),
    "ms-swift": ("ms-swift", "ms-swift 4.6.0 SftArguments / RLHFArguments"),
}


SET, DEFAULT, NOT_MODELLED, REFUSED = "set", "default", "not modelled", "refused"


# the command-line flag of a setup field, where it is not the field's name
FLAGS = {"seq_len": "--seq", "micro_batch": "--batch", "ckpt_reentrant": "--grad-ckpt-reentrant",
         "ckpt_offload": "--grad-ckpt-offload"}


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
    # the files' rules on the merged setup (ConfigFile.settle) and the rows before them: settled again under flags
    settle: tuple[Callable[[list[Mapped], Mapping[str, Any]], list[Mapped]], ...] = field(default=(), compare=False,
                                                                                         repr=False)
    unsettled: tuple[Mapped, ...] = field(default=(), compare=False, repr=False)

    def with_flags(self, flagged: Mapping[str, str]) -> SetupSource:
        """Rows marked overridden for the fields a command-line flag set (``field -> '--flag'``); the
        refusals those flags resolve are dropped."""
        rows = tuple(
            replace_row(r, overridden_by=flagged[r.field]) if r.field in flagged and r.status != NOT_MODELLED
            and not r.overridden_by else r
            for r in self.rows
        )
        refused = {f: r for f, r in self.refused.items() if f not in flagged}
        return dataclasses.replace(self, rows=rows, refused=refused)

    def check(self) -> None:
        """Refuse a setup that needs a value VRAM Lab cannot model (one line naming the key)."""
        for fld, r in self.refused.items():
            flag = FLAGS.get(fld, "--" + fld.replace("_", "-"))
            raise SetupError(f"{r.file}: {r.key}: {r.value!r} {r.note}; set it with {flag} or change the file")

    def to_json(self) -> dict[str, Any]:
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
                    f"{g.field} = {show(g.setting)}" + (f" (overridden by {g.overridden_by})" if g.overridden_by
                                                         else "") for g in group)
                label = "default" if r.status == DEFAULT else ("REFUSED" if r.status == REFUSED else "")
                what += (f"  ({label})" if label else "") + (f"  [{r.note}]" if r.note else "")
            shown = "(absent)" if r.status == DEFAULT else show(r.value)
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


def brief(v: Any) -> Any:
    """A file's value as the mapping keeps it: scalars and short lists of scalars as they are, anything else
    summarised (a YAML alias can make a small file hold a structure far too large to print)."""
    scalar = (str, int, float, bool, type(None))
    if isinstance(v, scalar):
        return v if not isinstance(v, str) or len(v) <= 200 else v[:200] + "…"
    if isinstance(v, list) and len(v) <= 16 and all(isinstance(x, scalar) for x in v):
        return [brief(x) for x in v]
    if isinstance(v, Mapping):
        return "{…}"
    return "[…]" if isinstance(v, list) else type(v).__name__


def show(v: Any) -> str:
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def replace_row(r: Mapped, **kw: Any) -> Mapped:

    return dataclasses.replace(r, **kw)


def framework_versions_text(frameworks: Sequence[str]) -> list[str]:
    """For training configs read: the transformers their framework's release installs, where the release the
    hand-written programs model is not among them."""
    names = {"llamafactory": ("llamafactory", "LLaMA-Factory"), "axolotl": ("axolotl", "axolotl"),
             "trl": ("trl", "TRL"), "trl-dpo": ("trl", "TRL"), "trl-grpo": ("trl", "TRL"), "trl-kto": ("trl", "TRL"),
             "trl-cpo": ("trl", "TRL"), "ms-swift": ("ms-swift", "ms-swift")}
    out: list[str] = []
    modelled = MODELLED["transformers"]
    for fw in dict.fromkeys(frameworks):
        if fw not in names:
            continue
        dist, label = names[fw]
        pin = FRAMEWORK_TRANSFORMERS[dist]
        try:
            from packaging.requirements import Requirement

            ok = Requirement(pin).specifier.contains(modelled, prereleases=True)
        except ImportError:  # packaging comes with pip; without it the pin is shown as it is
            ok = False
        if not ok:
            out.append(f"{label} {VERSIONS[dist]} installs {pin}: its run has that release's behaviour, while the "
                       f"hand-written programs model transformers {modelled}'s (a trace follows the installed one)")
    return out


# ---- one file ---------------------------------------------------------------------------------------------

ABSENT: Any = object()


class ConfigFile:
    """The keys of one file and the rows they produce."""

    def __init__(self, path: str, framework: str, data: Mapping[str, Any]):
        self.path, self.framework, self.data = path, framework, data
        self.rows: list[Mapped] = []
        self.model: str | None = None
        self.follow: list[Path] = []  # other configs this one names (a deepspeed: JSON)
        # rules that need every file read (a framework's rule on the ZeRO stage its DeepSpeed JSON gives): each
        # takes all the rows and the merged fields and returns the rows, this file's own rows changed or kept
        self.settle: list[Callable[[list[Mapped], Mapping[str, Any]], list[Mapped]]] = []

    def get(self, key: str) -> Any:
        """The value at a dotted key; ``ABSENT`` when missing or null (YAML's empty value)."""
        cur: Any = self.data
        for part in key.split("."):
            if not isinstance(cur, Mapping) or part not in cur:
                return ABSENT
            cur = cur[part]
        return ABSENT if cur is None else cur

    def has(self, key: str) -> bool:
        return self.get(key) is not ABSENT

    def fail(self, key: str, problem: str) -> SetupError:
        return SetupError(f"{self.path}: {key}: {problem}")

    def bool(self, key: str) -> Any:
        v = self.get(key)
        if v is ABSENT:
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no"):
            return v.strip().lower() in ("true", "yes")
        if not isinstance(v, bool):
            raise self.fail(key, f"must be true or false, got {v!r}")
        return v

    def int(self, key: str, low: int = 1) -> Any:
        v = self.get(key)
        if v is ABSENT or v == "auto":
            return ABSENT
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise self.fail(key, f"must be a whole number >= {low}, got {v!r}")
        return v

    def float(self, key: str) -> Any:
        v = self.get(key)
        if v is ABSENT:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(key, f"must be a number, got {v!r}")
        return float(v)

    def row(self, key: str, value: Any, fld: str | None, setting: Any, status: str = SET, note: str = "") -> None:
        self.rows.append(Mapped(self.path, self.framework, key, brief(value), fld, setting, status, note))

    def put(self, key: str, fld: str, setting: Any, note: str = "") -> None:
        self.row(key, self.get(key), fld, setting, SET, note)

    def default(self, key: str, fld: str, setting: Any, note: str = "") -> None:
        self.row(key, None, fld, setting, DEFAULT, note)

    def take(self, key: str, fld: str, value: Any, default: Any, note: str = "") -> None:
        """``value`` (read from ``key``) when the file has it, else the framework's ``default``."""
        if value is ABSENT:
            self.default(key, fld, default, note=note)
        else:
            self.put(key, fld, value)

    def not_modelled(self, *keys: str, note: str = "", when: Any = None) -> None:
        """Rows for memory-relevant keys that are present (and, with ``when``, equal to it or truthy)."""
        for key in keys:
            v = self.get(key)
            if v is ABSENT or v is False or v in ([], {}, "auto"):  # "auto": the trainer decides
                continue
            if when is not None and v != when:
                continue
            self.row(key, v, None, None, NOT_MODELLED, note)

    def refuse(self, key: str, fld: str, note: str) -> None:
        self.row(key, self.get(key), fld, None, REFUSED, note)
