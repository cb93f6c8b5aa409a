"""Configs that only remote code can build, and how their parameters are still counted exactly.

A ``config.json`` whose ``model_type`` transformers does not ship (Qwen-7B's first release says
``"qwen"`` and points its ``auto_map`` at ``modeling_qwen.py``) describes layers that only the
publisher's Python code defines. VRAM Lab never runs that code, so such a config cannot be read from
its numbers alone: reading it as a Llama-style decoder counts Qwen-7B's ``intermediate_size: 22016``
(which its code halves) as 12.05B parameters instead of 7.72B. This module

* knows which model types the installed transformers ships, without importing it (importing
  transformers takes seconds and may import torch): its ``auto_mappings.py`` is parsed as data;
* says why a config is refused (:func:`remote_code_reason`);
* counts such a model exactly from its safetensors headers, and picks the Llama-style reading whose
  shapes hold exactly that many parameters for the activation model, saying what it assumed
  (:func:`spec_from_headers`). When no such reading exists the model is refused.

Nothing here imports transformers or torch, and nothing executes a file.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.spec.model import MlpKind, ModelSpec

__all__ = ["RemoteCodeError", "remote_code_reason", "spec_from_headers", "transformers_model_types"]


class RemoteCodeError(SetupError):
    """The config names an architecture that only remote code (never run here) can build."""


def _literal_keys(node: ast.AST) -> list[str]:
    """The string keys of an ``OrderedDict([("a", "A"), ...])`` or ``{"a": "A", ...}`` literal."""
    if isinstance(node, ast.Call) and node.args:
        node = node.args[0]
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if isinstance(node, ast.List):
        out = []
        for item in node.elts:
            if isinstance(item, ast.Tuple) and item.elts and isinstance(item.elts[0], ast.Constant) \
                    and isinstance(item.elts[0].value, str):
                out.append(item.elts[0].value)
        return out
    return []


def _mapping_names(path: Path, mapping: str = "CONFIG_MAPPING_NAMES") -> set[str]:
    """Keys assigned to or added to ``mapping`` in one source file (parsed, never run)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == mapping
                                                for t in node.targets):
            names.update(_literal_keys(node.value))
            if isinstance(node.value, ast.Call):  # OrderedDict(**{"gpt-sw3": ...}, **CONFIG_MAPPING_NAMES)
                for kw in node.value.keywords:
                    names.update(_literal_keys(kw.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == mapping:
            for arg in node.args:
                names.update(_literal_keys(arg))
    return names


def _auto_dir() -> Path | None:
    """transformers' models/auto folder, found without importing it; None when it is not installed."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "auto"


@functools.cache
def transformers_model_types() -> tuple[str, frozenset[str]] | None:
    """(transformers' version, the model types it ships), or None when it is not installed or its
    mapping cannot be read. The mapping is parsed from the package's source as data."""
    auto = _auto_dir()
    if auto is None:
        return None
    names = _mapping_names(auto / "auto_mappings.py") | _mapping_names(auto / "configuration_auto.py")
    if len(names) < 50:  # not the layout we know: do not pretend to know
        return None
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return version, frozenset(names)


_LM_MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")


@functools.cache
def transformers_lm_types() -> frozenset[str] | None:
    """The model types the installed transformers builds as a causal, masked or seq2seq language model (the auto
    classes the trace uses), parsed from its source as data; None when it cannot be read."""
    return _auto_mapping_types(_LM_MAPPINGS, 50)


@functools.cache
def transformers_vlm_types() -> frozenset[str] | None:
    """The model types the installed transformers builds as an image-text-to-text model, parsed from its source
    as data (no import: a config of another kind is answered without loading torch); None when it cannot be read."""
    return _auto_mapping_types(("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",), 10)


def _auto_mapping_types(mappings: tuple[str, ...], at_least: int) -> frozenset[str] | None:
    auto = _auto_dir()
    if auto is None:
        return None
    names: set[str] = set()
    for mapping in mappings:
        names |= _mapping_names(auto / "modeling_auto.py", mapping) | _mapping_names(auto / "auto_mappings.py", mapping)
    return frozenset(names) if len(names) >= at_least else None  # not the layout we know: do not pretend to know


def _auto_map_target(cfg: Mapping[str, Any]) -> str | None:
    auto_map = cfg.get("auto_map")
    if not isinstance(auto_map, dict) or not auto_map:
        return None
    for key in ("AutoModelForCausalLM", "AutoModel"):
        value = auto_map.get(key)
        if isinstance(value, str):
            return value
    first = next(iter(auto_map.values()))
    return first if isinstance(first, str) else str(first)


def remote_code_reason(cfg: Mapping[str, Any], model_type: str) -> str | None:
    """Why ``cfg`` (whose ``model_type`` VRAM Lab does not map) can only be built by remote code, or None.

    A type the installed transformers ships is buildable whatever ``auto_map`` says (Phi-3's config
    carries one). Without transformers, an ``auto_map`` is the only evidence, and it is taken."""
    known = transformers_model_types()
    target = _auto_map_target(cfg)
    code = f" (its auto_map points at {target})" if target else ""
    what = f"model_type {model_type!r}" if model_type else "a config without a model_type"
    if known is not None and model_type:
        version, types = known
        if model_type in types:
            return None
        hint = closest_family(cfg, model_type, types)
        return (f"{what} is not an architecture transformers {version} ships: only the publisher's remote "
                f"code{code} defines its layers, and VRAM Lab never runs remote code, so its config cannot "
                f"be counted exactly{hint}")
    if target:
        return (f"{what} comes with remote code{code}, which VRAM Lab never runs, so its config cannot be "
                "counted exactly")
    return None


def closest_family(cfg: Mapping[str, Any], model_type: str, types: frozenset[str]) -> str:
    """What the user can do instead: the families transformers ships that the config points at (its
    ``text_config``'s or ``llm_config``'s model_type, an architecture's name, a model type spelled alike),
    as a clause of the refusal ("" when nothing is close)."""
    import difflib
    import re

    found: list[str] = []
    for key in ("text_config", "llm_config", "language_config"):
        sub = cfg.get(key)
        if isinstance(sub, Mapping) and sub.get("model_type") in types:
            found.append(str(sub["model_type"]))
    names = [model_type] if model_type else []
    archs = cfg.get("architectures")
    if isinstance(archs, list):
        for arch in archs:
            if isinstance(arch, str):
                stem = re.sub(r"(For[A-Z]\w*|LMHeadModel|Model)$", "", arch)
                names.append(re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", stem).lower())
                names.append(stem.lower())
    for name in names:  # the same family under a newer name (minicpmv -> minicpmv4_6), never a mere look-alike
        alike = difflib.get_close_matches(name, sorted(types), n=4, cutoff=0.6)
        found.extend(t for t in alike if len(name) >= 4 and (t.startswith(name) or name.startswith(t)))
    found = list(dict.fromkeys(f for f in found if f != model_type))[:3]
    if not found:
        return ""
    shown = " or ".join(repr(f) for f in found)
    return (f"; the closest architecture transformers ships is {shown}: a checkpoint converted to it (a "
            "config.json with that model_type) is estimated with transformers' own class")


# ---- exact counts from the headers -------------------------------------------------------------------


def _gated_llama(kwargs: Mapping[str, Any], *, qkv_bias: bool, inter: int, tie: bool) -> ModelSpec:
    return ModelSpec(id="probe", name="probe", **{**kwargs, "intermediate_size": inter, "qkv_bias": qkv_bias,
                                                  "tie_embeddings": tie, "mlp_kind": MlpKind.GATED})


def spec_from_headers(reason: str, kwargs: Mapping[str, Any], params: int, head_matrices: int,
                      bias_sizes: set[int], *, id: str, name: str, source: str, family: str
                      ) -> tuple[ModelSpec, str]:
    """A Llama-style ModelSpec with exactly ``params`` parameters, and the note that says so.

    ``kwargs`` is the Llama-style reading of the config's size keys (layers, hidden, heads, vocab);
    ``params`` the parameter count of the safetensors headers (buffers left out); ``head_matrices`` how many
    vocab x hidden matrices the headers hold (1: tied embeddings); ``bias_sizes`` the sizes of the tensors
    named ``*bias``. q/k/v carry a bias when such a tensor has the size of q, k or v, or of all three fused
    (a q/k/v bias adds exactly as many parameters per layer as one more unit of MLP width, so the count
    alone cannot tell). The per-projection MLP width is then chosen so that the spec's count equals
    ``params``; when no whole width does, the model is refused. Raises :class:`RemoteCodeError`.
    """
    tie = head_matrices < 2
    probe = _gated_llama(kwargs, qkv_bias=False, inter=1, tie=tie)
    qkv = {probe.q_dim, probe.kv_dim, probe.q_dim + 2 * probe.kv_dim}
    biased = bool(qkv & bias_sizes)
    for qkv_bias in (biased, not biased):
        base = _gated_llama(kwargs, qkv_bias=qkv_bias, inter=1, tie=tie).param_count
        slope = _gated_llama(kwargs, qkv_bias=qkv_bias, inter=2, tie=tie).param_count - base
        rest = params - base
        if slope > 0 and rest >= 0 and rest % slope == 0:
            inter = 1 + rest // slope
            spec = ModelSpec(id=id, name=name, source=source, family=family, published_params=params,
                             **{**kwargs, "intermediate_size": inter, "qkv_bias": qkv_bias, "tie_embeddings": tie,
                                "mlp_kind": MlpKind.GATED})
            said = kwargs.get("intermediate_size")
            width = (f"intermediate_size {inter}" + (f" (config.json says {said})" if said != inter else ""))
            note = (f"{reason}; the parameters are counted exactly from the safetensors headers ({params:,}); "
                    f"the activation memory assumes a Llama-style decoder (RMSNorm, gated MLP, RoPE"
                    f"{', q/k/v bias' if qkv_bias else ''}{', tied embeddings' if tie else ''}) with "
                    f"{width}, the width at which its shapes hold exactly that many parameters")
            return spec, note
    raise RemoteCodeError(
        f"{source}: {reason}; its safetensors headers hold {params:,} parameters, which no Llama-style "
        "reading of its sizes reproduces, so its activation memory cannot be modelled either"
    )
