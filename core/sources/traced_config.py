"""A config of an architecture without a hand-written program, as a spec that the trace estimates.

``model_type``\\ s the hand-written families do not describe (GPT-NeoX, OPT, Falcon, BLOOM, OLMo, Cohere, ...)
but the installed transformers ships (no remote code) become a :class:`~vramlab.core.spec.model.ModelSpec`
that carries transformers' own config of them (``transformers_config``, canonical JSON) and the fields
that config fills in (layers, widths, heads, vocabulary: for display and the outer levels). The
parameters are counted from the model transformers builds from that config on the meta device (no
memory, no weights), so the count is the model's own; a model folder's safetensors headers must agree
with it (:mod:`.folder` makes a disagreement an error). The estimate then replays the trace of that
model's training step (:mod:`vramlab.core.traced`).

Needs torch and transformers: without them (the estimator-only build) such a config is refused with
what to install.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vramlab.core.cache import cache_dir, key_digest
from vramlab.core.checks import SetupError, check_int
from vramlab.core.spec.model import MODEL_BOUNDS, ModelSpec
from vramlab.core.spec.options import DType
from vramlab.core.versions import trace_versions

_FIELD_NAMES = {"num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
                "head_dim", "tie_embeddings", "max_position_embeddings", "sliding_window"}
# keys of a saved config that do not describe the model (left out of the canonical form)
VOLATILE_KEYS = ("transformers_version", "_name_or_path", "_commit_hash", "auto_map")


# transformers' own tag for a float JSON cannot hold (configuration_utils: ``{"__float__": "Infinity"}``), as it
# writes a config.json since 5.x: Granite 4's default time_step_limit is (0.0, inf)
_FLOAT_TAG = "__float__"
_TAGGED = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float written as transformers writes it (a tagged object): JSON that any
    reader takes (no ``Infinity``/``NaN`` literals), read back by :func:`from_json_safe`."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT_TAG: "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def from_json_safe(value: Any) -> Any:
    """The floats of transformers' tagged objects back (a config.json transformers saved, or a canonical form)."""
    if isinstance(value, dict):
        if set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _TAGGED:
            return _TAGGED[value[_FLOAT_TAG]]
        return {k: from_json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json_safe(v) for v in value]
    return value


def canonical_text(config: Any) -> str:
    """A transformers config's canonical JSON (sorted keys, the volatile ones left out, non-finite floats
    tagged): valid JSON, the key of its traces, and what :func:`config_from_text` reads back."""
    canonical = {k: v for k, v in config.to_dict().items() if k not in VOLATILE_KEYS}
    return json.dumps(json_safe(canonical), sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_from_dict(data: Mapping[str, Any]) -> Any:
    """The transformers config of a config dict (its ``model_type``'s class; tagged floats read back)."""
    from transformers import CONFIG_MAPPING

    plain = from_json_safe(dict(data))
    return CONFIG_MAPPING[plain["model_type"]].from_dict({k: v for k, v in plain.items() if k != "model_type"})


def traced_spec(cfg: Mapping[str, Any], model_type: str, *, id: str, name: str, source: str,
                dtype: DType | None, reason: str = "") -> tuple[ModelSpec, tuple[str, ...]]:
    """The spec of ``cfg`` (a config of ``model_type``, which transformers ships) for the trace, and the
    warnings (``reason``: why it is traced, where a hand-written program exists for its type). Raises
    SetupError when transformers is not installed, the type is not a causal language model it builds, or it
    cannot read the config."""
    data = {k: v for k, v in cfg.items() if k not in VOLATILE_KEYS}
    known = _read_counted(data)
    if known is not None:  # read before (no transformers import: seconds saved on every later run)
        text, total, fields = known
        return _spec(model_type, id, name, source, dtype, text, total, fields, reason)
    try:
        import torch
        from transformers import CONFIG_MAPPING
    except ImportError:
        raise SetupError(f"{source}: model_type {model_type!r} has no hand-written program; VRAM Lab estimates "
                         "it from a trace of transformers' own classes, which needs torch, transformers and "
                         "peft (pip install 'vramlab[hf]')") from None
    auto = _auto_class(model_type)
    if auto is None or model_type not in CONFIG_MAPPING:
        raise SetupError(f"{source}: model_type {model_type!r} is not a language model that transformers "
                         "builds (a causal, seq2seq or masked LM), so it cannot be traced")
    _check_bounds(data, source)
    try:
        config = CONFIG_MAPPING[model_type].from_dict(from_json_safe(data))
        text = canonical_text(config)
        with torch.device("meta"):
            model = auto.from_config(config)
    except Exception as e:  # noqa: BLE001 - ValueError, TypeError, huggingface_hub's strict-dataclass errors...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SetupError(f"{source}: transformers cannot build this {model_type} config ({first})") from None
    total = int(sum(p.numel() for p in model.parameters()))  # a tied weight is one parameter
    fields = config_fields(config)
    out = _spec(model_type, id, name, source, dtype, text, total, fields, reason)
    _write_counted(data, text, total, fields)
    return out


# The config keys that size a model's stacks, under transformers' names, with the bound ModelSpec holds them to
_SIZE_KEYS = {"num_hidden_layers": "num_layers", "n_layer": "num_layers", "num_layers": "num_layers",
              "hidden_size": "hidden_size", "n_embd": "hidden_size", "vocab_size": "vocab_size",
              "num_attention_heads": "num_heads", "n_head": "num_heads", "intermediate_size": "intermediate_size",
              "num_local_experts": "num_experts", "num_experts": "num_experts", "n_routed_experts": "num_experts"}


def _check_bounds(data: Mapping[str, Any], source: str) -> None:
    """Refuse a stack size past ModelSpec's bounds before transformers builds the model: on the meta device a
    4,096-layer model still takes tens of seconds to build, only to be refused afterwards."""
    for key, bound in _SIZE_KEYS.items():
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            lo, hi = MODEL_BOUNDS[bound]
            check_int(key, value, lo, hi, label=f"{source}: {key}")


def _auto_class(model_type: str) -> Any:
    """The auto class transformers trains ``model_type`` with, as :func:`vramlab.core.tracing.hfconfig.task_of`
    chooses it: an encoder-decoder's seq2seq LM (decoder labels), an encoder's masked LM, else the causal LM;
    None when it has none of them."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
    from transformers.models.auto import modeling_auto as ma

    for names, auto in ((ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, AutoModelForSeq2SeqLM),
                        (ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES, AutoModelForMaskedLM),
                        (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, AutoModelForCausalLM)):
        if model_type in names:
            return auto
    return None


def _spec(model_type: str, id: str, name: str, source: str, dtype: DType | None, text: str, total: int,
          fields: dict[str, Any], reason: str = "") -> tuple[ModelSpec, tuple[str, ...]]:
    why = reason or f"{model_type} has no hand-written program"
    warnings = (f"{why}: its estimate is traced from transformers' own classes (the first estimate of a recipe "
                "takes seconds, later ones come from the cache)",)
    if '"is_encoder_decoder":true' in text:
        warnings += (f"{model_type} is an encoder-decoder trained with decoder labels: VRAM Lab assumes labels as "
                     "long as the input, so the sequence length is both the encoder's and the decoder's",)
    try:
        spec = ModelSpec(id=id, name=name, family=model_type, checkpoint_dtype=dtype or DType.BF16, source=source,
                         transformers_config=text, counted_params=total, **fields)
    except SetupError as e:
        raise SetupError(f"{source}: {e}") from None
    return spec, warnings


def _counted_path(data: Mapping[str, Any]) -> Path:
    return cache_dir() / "configs" / f"{key_digest({'config': data, 'versions': trace_versions()})}.json"


def counted_before(cfg: Mapping[str, Any]) -> bool:
    """Whether this config's canonical form and parameter count are cached (reading it imports nothing)."""
    return _read_counted({k: v for k, v in cfg.items() if k not in VOLATILE_KEYS}) is not None


def _read_counted(data: Mapping[str, Any]) -> tuple[str, int, dict[str, Any]] | None:
    """What an earlier run read from this config with these versions (None: a miss, also for a file that is
    not one of ours)."""
    try:
        stored = json.loads(_counted_path(data).read_text(encoding="utf-8"))
        text, total, fields = stored["canonical"], stored["params"], stored["fields"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(text, str) and isinstance(total, int) and isinstance(fields, dict)
            and set(fields) == _FIELD_NAMES):
        return None
    return text, total, fields


def _write_counted(data: Mapping[str, Any], text: str, total: int, fields: dict[str, Any]) -> None:
    from vramlab.core.fileio import write_atomic

    path = _counted_path(data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"canonical": text, "params": total, "fields": fields}))
    except (OSError, TypeError, ValueError):
        pass  # a cache that cannot be written is only slower


def _attr(config: Any, name: str) -> Any:
    """``config.name``, or None where it has none or holds it per layer (Gemma 4's ``head_dim``: transformers
    refuses the global reading)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError) or other
        return None


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = _attr(config, n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def config_fields(config: Any) -> dict[str, Any]:
    """What the config says of the ModelSpec fields (shown and used by the outer levels; the trace
    decides the bytes)."""
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    if not (layers and hidden and heads):
        raise SetupError("the config has no layer count, hidden size or head count that VRAM Lab can read")
    kv = _first(config, "num_key_value_heads", "num_kv_heads", "multi_query_group_num", default=heads)
    if _attr(config, "multi_query") is True:
        kv = 1
    if heads % kv:
        kv = heads
    head_dim = _first(config, "head_dim", default=0)
    if not head_dim and hidden % heads:
        head_dim = hidden // heads or 1
    inter = _first(config, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", default=4 * hidden)
    return {
        "num_layers": layers, "hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv,
        "intermediate_size": inter, "vocab_size": _first(config, "vocab_size", default=1),
        "head_dim": head_dim, "tie_embeddings": bool(_attr(config, "tie_word_embeddings")),
        "max_position_embeddings": _first(config, "max_position_embeddings", "n_positions", "seq_length",
                                          default=4096),
        "sliding_window": _first(config, "sliding_window", default=0),
    }
