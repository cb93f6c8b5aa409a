"""LoRA's target modules: the canonical HF module names of each role and the parsing of what a user names."""

from __future__ import annotations

import re
from collections.abc import Iterable

from vramlab.core.checks import SetupError

# HF module names; the plain (non-gated) MLP uses up_proj/down_proj (fc1/fc2 are accepted as aliases).
# Fused projections (one matrix for q, k and v; one for gate and up) keep their own names: a model has
# either the fused module or the separate ones, and peft adapts the module it is given.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "gate_up_proj")
ALL_TARGETS = (*ATTN_TARGETS, *MLP_TARGETS, *FUSED_TARGETS, "lm_head")
_TARGET_ALIASES: dict[str, str | tuple[str, ...]] = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
    "fc1": "up_proj", "fc2": "down_proj", "dense": "o_proj", "output": "lm_head",
    # other families' names for the same roles: GPT-NeoX / Falcon / BLOOM, GPT-2 (Conv1D), GPT-J, MPT, ...
    "qkv": "qkv_proj", "query_key_value": "qkv_proj", "c_attn": "qkv_proj", "wqkv": "qkv_proj",
    "gate_up": "gate_up_proj", "c_fc": "up_proj", "fc_in": "up_proj", "dense_h_to_4h": "up_proj",
    "fc_out": "down_proj", "dense_4h_to_h": "down_proj",
    "out_proj": "o_proj", "c_proj": ("o_proj", "down_proj"),  # GPT-2's c_proj is both
}


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """Parse 'q_proj,v_proj' / 'q,v' / 'all-linear' into canonical HF module names (ordered, unique). Any other
    module name (DeepSeek-V2's ``kv_a_proj_with_mqa``) is kept as given, after the canonical ones: peft adapts
    every linear module whose name is it or ends in ``.`` + it, and the model decides whether it has one (a
    hand-written family refuses it in :meth:`TrainingSetup.validate_for`, the built model in its LoRA step)."""
    items = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else [str(t) for t in targets]
    items = [t for t in items if t]
    out: list[str] = []
    for t in items:
        key = t.lower()
        if key in ("all-linear", "all_linear", "all"):
            names = [*ATTN_TARGETS, *MLP_TARGETS]
        elif key in _TARGET_ALIASES or key in ALL_TARGETS:
            alias = _TARGET_ALIASES.get(key, key)
            names = list(alias) if isinstance(alias, tuple) else [alias]
        elif _MODULE_NAME.fullmatch(t):
            names = [t]
        else:
            raise SetupError(f"LoRA target {t!r} is not a module name; use the model's module names (e.g. "
                             f"{', '.join(ALL_TARGETS)}) or all-linear")
        for n in names:
            if n not in out:
                out.append(n)
    if not out:
        raise SetupError("LoRA needs at least one target module, e.g. --lora-targets q_proj,v_proj")
    known = sorted((n for n in out if n in ALL_TARGETS), key=ALL_TARGETS.index)
    return (*known, *(n for n in out if n not in ALL_TARGETS))


ALL_LINEAR = parse_targets("all-linear")


def names_all_linear(targets: Iterable[str]) -> bool:
    """Whether ``targets`` (parsed) is ``all-linear``, the output head aside: peft's shorthand for every
    ``nn.Linear`` and ``Conv1D`` of the model but its output embeddings (peft 0.21.2
    ``tuners_utils._maybe_include_all_linear_layers``), which the model built resolves, not a list of names."""
    return tuple(t for t in targets if t != "lm_head") == ALL_LINEAR
