"""A Hugging Face ``config.json`` (a dict, read by :mod:`.files`) as a :class:`~vramlab.core.spec.model.ModelSpec`.

* :func:`spec_from_hf_config` / :func:`hf_config_to_spec` — map a config dict to a ModelSpec (the latter also
  returns the warnings, e.g. "the vision tower is not counted"). Families are mapped key by key; a config
  this module cannot read exactly is refused with the reason, never read as another family's default.

This module routes: which model type a config is (:mod:`vramlab.core.families.registry` names them all), whether
a hand-written reader reads it (:mod:`.text_readers`, with a vision family's own ``config`` piece for its tower),
the trace reads it (:mod:`.traced_config`, :mod:`.traced_vlm`) or it is refused with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families import piece
from vramlab.core.families.registry import (
    ARCH_PREFIX,
    LLAMA,
    NOT_DECODERS,
    REFUSED,
    STATE_SPACE,
    TEXT_ALIASES,
    TEXT_DEFAULTS,
    TRACED_NOT_DECODERS,
    WRAPPED_TEXT_TYPE,
)
from vramlab.core.sources.remote_code import (
    RemoteCodeError,
    remote_code_reason,
    transformers_lm_types,
    transformers_model_types,
)
from vramlab.core.sources.text_readers import (
    LLAMA_KEYS,
    READERS,
    Inexpressible,
    Reader,
    generic,
    unread_shape_keys,
)
from vramlab.core.sources.traced_vlm import NotTraceable, traceable_vlm, traced_instead, why_not_traced
from vramlab.core.spec.model import ModelSpec
from vramlab.core.spec.options import DType

# Keys a state-space layer's config has and an attention layer's does not
_STATE_SPACE_KEYS = ("state_size", "ssm_state_size", "mamba_d_state", "mamba_d_conv", "d_state", "rescale_every")
# Keys that give an attention layer's head count, under the names transformers' configs use
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
              "decoder_attention_heads", "num_attention_heads_per_layer")
_LM_HEAD_ARCH = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")

_TORCH_DTYPES = {
    "float32": DType.FP32, "float": DType.FP32, "fp32": DType.FP32,
    "bfloat16": DType.BF16, "bf16": DType.BF16,
    "float16": DType.FP16, "half": DType.FP16, "fp16": DType.FP16,
}


def read_model_type(cfg: Mapping[str, Any], source: str, prefix: str) -> str:
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise SetupError(f"{source}: {prefix}model_type must be a string, got {mt!r}")
    if mt:
        return mt.strip().lower()
    archs = cfg.get("architectures")
    if isinstance(archs, list):
        for arch in archs:
            for head, family in ARCH_PREFIX.items():
                if isinstance(arch, str) and arch.startswith(head):
                    return family
    return ""


def _config_dtype(cfgs: Iterable[Mapping[str, Any]], warnings: list[str]) -> DType | None:
    """checkpoint dtype from ``dtype`` / ``torch_dtype`` (first config that names one)."""
    for cfg in cfgs:
        for key in ("dtype", "torch_dtype"):
            value = cfg.get(key)
            if value is None:
                continue
            text = str(value).lower().removeprefix("torch.")
            if text in _TORCH_DTYPES:
                return _TORCH_DTYPES[text]
            warnings.append(f"{key} {value!r} is not fp32, bf16 or fp16; checkpoint dtype taken as bf16")
            return DType.BF16
    return None


NO_DTYPE = "config.json names no torch_dtype: checkpoint dtype taken as bf16"


def hf_config_to_spec(cfg: Mapping[str, Any], *, id: str, name: str, source: str = "config.json",
                      probe: bool = False, processor: str = "") -> tuple[ModelSpec, tuple[str, ...]]:
    """Map a Hugging Face config dict to a ModelSpec, with warnings for the user.

    Multimodal wrappers (``text_config``, or a ``vision_config``) give the language model only, with a
    warning that the vision tower is not counted. ``source`` names the file in error messages. Raises
    :class:`SetupError` (naming ``source`` and the key) for missing or wrong-typed keys and for
    architectures ModelSpec cannot express exactly where transformers cannot be traced instead. ``probe``:
    raise :class:`_WouldTrace` instead of tracing (:func:`imports_transformers`). ``processor``: the checkpoint's
    processor files beside the config (``core.sources.files.load_processor_files``), read where a family's
    images are counted by its processor class.
    """
    warnings: list[str] = []
    top_type = read_model_type(cfg, source, "")
    if top_type in REFUSED:
        if _traceable(top_type):
            return _traced(cfg, top_type, id=id, name=name, source=source, probe=probe)
        raise SetupError(f"{source}: {REFUSED[top_type]}")
    inner: Mapping[str, Any] = cfg
    prefix = ""
    text_config = cfg.get("text_config")
    if text_config is not None:
        if not isinstance(text_config, dict):
            raise SetupError(f"{source}: text_config must be an object, got {text_config!r}")
        inner, prefix = text_config, "text_config."
    model_type = read_model_type(inner, source, prefix)
    if not model_type and prefix:
        model_type = WRAPPED_TEXT_TYPE.get(top_type, "")
    if model_type in REFUSED:
        if _traceable(model_type) and not prefix:
            return _traced(cfg, model_type, id=id, name=name, source=source, probe=probe)
        raise SetupError(f"{source}: {REFUSED[model_type]}")
    multimodal = bool(prefix) or any(k in cfg for k in ("vision_config", "audio_config"))
    untraced = ""
    if traceable_vlm(top_type):  # the whole VLM traced from transformers' class (sources.traced_vlm)
        if probe:
            raise _WouldTrace(None)  # its own cache (sources.traced_vlm): not asked here, as before
        try:
            return _traced_vlm(cfg, id=id, name=name, source=source, settings=processor)
        except NotTraceable as e:  # a family answered by its processor, whose processor or class cannot here
            untraced = f" ({e}), and --images is refused"
    elif multimodal:
        untraced = why_not_traced(top_type)
    family_config = piece(top_type, "config")  # a vision family's reading of its tower (core/families/<family>/)
    vision = family_config.vision_from_config(cfg, inner, source, warnings) if family_config is not None else None
    if vision is None and multimodal and family_config is not None and traced_instead(cfg, processor):  # Pixtral
        if probe:
            raise _WouldTrace(None)
        try:
            return _traced_vlm(cfg, id=id, name=name, source=source, settings=processor)
        except NotTraceable as e:
            untraced = f" ({e}), and --images is refused"
    if vision is not None:
        multimodal = False  # the tower and projector are counted and estimated (core/vision.py)
    if multimodal:
        what = top_type or "multimodal"
        warnings.append(
            f"{what} is a multimodal model: only its language model ({model_type or 'text_config'}) is "
            f"imported; the vision tower and projector are not counted{untraced}"
        )
    family_key = TEXT_ALIASES.get(model_type, model_type)
    read = READERS.get(family_key)
    if read is None:  # generic: the size keys must be there; the rest as Llama has them
        reason = remote_code_reason(inner, model_type) or (remote_code_reason(cfg, top_type) if prefix else None)
        if reason:
            raise RemoteCodeError(f"{source}: {reason}; a model folder with its *.safetensors is counted "
                                  "exactly from their headers")
        if _traceable(model_type):
            # transformers' own class, traced, rather than a Llama-style guess at it (Granite's embedding,
            # residual and logit multipliers are full-size temporaries a Llama reading lacks; Gemma 4's 512-wide
            # global heads); a multimodal config's language model alone, as the warning above says. The generic
            # reading below stays for the estimator-only build
            return _traced(inner, model_type, id=id, name=name, source=source, probe=probe,
                           dtype_from=(inner, cfg), before=warnings)
        defaults = {k: v for k, v in TEXT_DEFAULTS[LLAMA].items() if k not in LLAMA_KEYS}
        reader = Reader(inner, source=source, prefix=prefix, family=model_type,
                         defaults=defaults, nested=False)
        kwargs = generic(reader)
    else:
        reader = Reader(inner, source=source, prefix=prefix, family=model_type, defaults=TEXT_DEFAULTS[family_key],
                         nested=bool(prefix))
        try:
            kwargs = read(reader)
            own = getattr(family_config, "TEXT_KEYS", ())  # text_config keys the vision family reads itself
            unread = [k for k in unread_shape_keys(reader) if k not in own]
        except Inexpressible as e:
            if not (_traceable(model_type) and vision is None):
                raise
            return _traced(inner, model_type, id=id, name=name, source=source, probe=probe, dtype_from=(inner, cfg),
                           before=warnings, reason=str(e).removeprefix(f"{source}: "))
        if unread:
            shown = ", ".join(f"{prefix}{k}" for k in unread)
            why = (f"{shown} may change the model's shapes and the hand-written {family_key} program does not read "
                   f"{'it' if len(unread) == 1 else 'them'}")
            if _traceable(model_type) and vision is None:
                return _traced(inner, model_type, id=id, name=name, source=source, probe=probe,
                               dtype_from=(inner, cfg), before=warnings, reason=why)
            warnings.append(f"{why}: the count and the estimate may be off (with torch, transformers and peft "
                            "installed it is traced from transformers' own class)")
    if reader.defaulted:
        shown = ", ".join(f"{k}={reader.defaults[k]}" for k in reader.defaulted)
        warnings.append(f"{prefix.rstrip('.') or 'config.json'} leaves {len(reader.defaulted)} size key(s) "
                        f"to transformers' {family_key} defaults: {shown}")
    warnings.extend(reader.warnings)
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs) \
            and not any(a.endswith(_LM_HEAD_ARCH) for a in archs):
        warnings.append(f"architectures is {', '.join(archs)}: VRAM Lab counts a language-model head "
                        "(lm_head), which this checkpoint may not have")
    dtype = _config_dtype((inner, cfg) if prefix else (cfg,), warnings)
    if dtype is None:
        warnings.append(NO_DTYPE)
    if vision is not None and family_config is not None and family_config.PROJECTS_TO_TEXT and "hidden_size" in kwargs:
        vision = dataclasses.replace(vision, out_hidden_size=kwargs["hidden_size"])  # the projector's output
    try:
        spec = ModelSpec(id=id, name=name, family=family_key or "generic",
                         checkpoint_dtype=dtype or DType.BF16, source=source, vision=vision, **kwargs)
    except SetupError as e:
        raise SetupError(f"{source}: {e}") from e
    return spec, tuple(warnings)


def _traced_vlm(cfg: Mapping[str, Any], *, id: str, name: str, source: str,
                settings: str = "") -> tuple[ModelSpec, tuple[str, ...]]:
    from vramlab.core.sources.traced_vlm import traced_vlm_spec

    warnings: list[str] = []
    text = cfg.get("text_config")
    dtype = _config_dtype((text, cfg) if isinstance(text, dict) else (cfg,), warnings)
    if dtype is None:
        warnings.append(NO_DTYPE)
    spec, more = traced_vlm_spec(cfg, id=id, name=name, source=source, dtype=dtype, settings=settings)
    return spec, (*more, *warnings)


def _traceable(model_type: str) -> bool:
    """Whether a type without a hand-written program is estimated from its trace instead: a decoder the
    installed transformers ships (parsed from its sources as data; the estimator-only build has none), or
    one of the encoder-decoders and encoders traced with their own loss."""
    if (model_type in NOT_DECODERS and model_type not in TRACED_NOT_DECODERS) or model_type in STATE_SPACE:
        return False
    known = transformers_model_types()
    return known is not None and model_type in known[1]


class _WouldTrace(Exception):  # noqa: N818 - a signal, not an error
    def __init__(self, cfg: Mapping[str, Any] | None) -> None:
        super().__init__()
        self.cfg = cfg


def imports_transformers(cfg: Mapping[str, Any]) -> bool:
    """Whether reading ``cfg`` builds its model in transformers (a traced type, or a config its hand-written
    program cannot express, whose parameters this installation has not counted before): seconds, the first
    time, which a window runs off its GUI thread."""
    from vramlab.core.sources.traced_config import counted_before

    try:
        hf_config_to_spec(cfg, id="probe", name="probe", probe=True)
    except _WouldTrace as e:
        return e.cfg is not None and not counted_before(e.cfg)
    except (SetupError, TypeError, ValueError):
        return False
    return False


def _check_attention_layers(cfg: Mapping[str, Any], model_type: str, source: str) -> None:
    """Refuse, from the file alone and before transformers is imported, a config that has no attention heads
    or has a state-space layer's keys: the trace would build the model for seconds and end in the same refusal."""
    ssm = [k for k in _STATE_SPACE_KEYS if k in cfg]
    if ssm and not any(isinstance(cfg.get(k), int | list) for k in _HEAD_KEYS):
        raise SetupError(f"{source}: model_type {model_type!r} has state-space layers ({ssm[0]}): not a transformer "
                         "VRAM Lab can model")
    lm_types = transformers_lm_types()
    if lm_types is not None and model_type not in lm_types:
        raise SetupError(f"{source}: model_type {model_type!r} is not a language model that transformers builds "
                         "(a causal, seq2seq or masked LM), so it cannot be traced")
    if not any(isinstance(cfg.get(k), int | list) for k in _HEAD_KEYS):
        raise SetupError(f"{source}: model_type {model_type!r} names no attention head count "
                         f"({', '.join(_HEAD_KEYS[:3])}, ...): not a transformer VRAM Lab can model")


def _traced(cfg: Mapping[str, Any], model_type: str, *, id: str, name: str, source: str, probe: bool = False,
            dtype_from: tuple[Mapping[str, Any], ...] = (), before: Iterable[str] = (), reason: str = ""
            ) -> tuple[ModelSpec, tuple[str, ...]]:
    """``cfg`` traced (:mod:`.traced_config`); ``dtype_from``: the configs that may name the checkpoint dtype
    (``cfg``'s own by default); ``before``: warnings said first; ``reason``: why a type with a hand-written
    program is traced."""
    if probe:
        raise _WouldTrace(cfg)
    from vramlab.core.sources.traced_config import traced_spec

    _check_attention_layers(cfg, model_type, source)
    warnings: list[str] = []
    dtype = _config_dtype(tuple(c for c in dtype_from if isinstance(c, Mapping)) or (cfg,), warnings)
    if dtype is None:
        warnings.append(NO_DTYPE)
    spec, more = traced_spec(cfg, model_type, id=id, name=name, source=source, dtype=dtype, reason=reason)
    return spec, (*before, *more, *warnings)


def spec_from_hf_config(cfg: Mapping[str, Any], *, id: str, name: str,
                        source: str = "config.json") -> ModelSpec:
    """Map a Hugging Face ``config.json`` dict to a ModelSpec (see :func:`hf_config_to_spec`, which also
    returns the warnings)."""
    return hf_config_to_spec(cfg, id=id, name=name, source=source)[0]


