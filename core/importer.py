"""Import a user's local Hugging Face model description as a :class:`~vramlab.core.spec.ModelSpec`.

A model folder holds ``config.json`` (the architecture) and usually ``*.safetensors`` weights. Both are read
as **data**: the config with :func:`json.loads`, the weights by their JSON header only (the 8-byte
little-endian header length and the header itself; no tensor data is read). Nothing here imports
transformers, runs remote code, unpickles (``*.bin`` / ``*.pt`` files are never opened) or touches the
network.

Public API
----------
* :func:`load_config_json` — read a ``config.json`` into a dict.
* :func:`spec_from_hf_config` / :func:`hf_config_to_spec` — map a config dict to a ModelSpec (the latter
  also returns the warnings, e.g. "the vision tower is not counted").
* :func:`read_safetensors_header` — validate one ``.safetensors`` file's header and list its tensors.
* :func:`parse_safetensors_header` — the same validation for header bytes read elsewhere (HTTP ranges).
* :func:`read_safetensors_index` — read ``model.safetensors.index.json`` (weight_map, total_size).
* :func:`load_model_source` — all of the above for a folder or a ``config.json`` path, with an exact
  parameter count from the safetensors headers as a check on the architecture.
* :func:`import_from_parts` — the same from a config dict and headers read elsewhere (the Hub reader).

Units: parameter and element counts are plain integers; sizes are bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .remote_code import RemoteCodeError, remote_code_reason, spec_from_headers
from .spec import Activation, DType, MlpKind, ModelSpec, NormKind, SetupError

__all__ = [
    "SAFETENSORS_DTYPE_BITS",
    "SUPPORTED_MODEL_TYPES",
    "ImportedModel",
    "SafetensorsIndex",
    "TensorInfo",
    "hf_config_to_spec",
    "import_from_parts",
    "load_config_json",
    "load_model_source",
    "parse_safetensors_header",
    "read_safetensors_header",
    "read_safetensors_index",
    "spec_from_hf_config",
]

# ---- limits ------------------------------------------------------------------------------------------

MAX_CONFIG_BYTES = 16 * 1024**2  # a config.json is a few KiB; anything this large is not one
MAX_INDEX_BYTES = 64 * 1024**2  # a shard index lists every tensor name: a few MiB at most
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header

# Bits per element of every dtype the safetensors format (0.8) defines.
SAFETENSORS_DTYPE_BITS: Mapping[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

_FLOAT_DTYPES = {"F32": DType.FP32, "BF16": DType.BF16, "F16": DType.FP16}

# ---- results -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header: dtype code (e.g. ``"BF16"``), shape, and data size in bytes."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar of shape ``()``)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsIndex:
    """``model.safetensors.index.json``: which shard file holds each tensor, and the total tensor bytes."""

    path: str
    weight_map: dict[str, str]
    total_size: int | None  # bytes of tensor data over all shards, as the publisher wrote it

    @property
    def shards(self) -> tuple[str, ...]:
        """The shard file names, sorted, each once."""
        return tuple(sorted(set(self.weight_map.values())))


@dataclass(frozen=True)
class ImportedModel:
    """A local model read into a ModelSpec, with what its weight files say.

    ``tensor_params`` / ``tensor_bytes`` / ``dtype_counts`` cover every tensor in the safetensors files
    exactly as stored (a vision tower and stored buffers included; packed elements for quantized
    checkpoints). ``spec.published_params`` is the comparable language-model parameter count taken from the
    same headers (buffers, vision tensors and a duplicate tied ``lm_head`` left out), set only for
    unquantized safetensors, so that ``spec.param_count == spec.published_params`` is the check.
    All three are ``None`` / empty when no safetensors were read.
    """

    spec: ModelSpec
    source_path: str
    tensor_params: int | None = None  # elements in all safetensors tensors
    tensor_bytes: int | None = None  # bytes of tensor data in all safetensors files
    dtype_counts: dict[str, int] = field(default_factory=dict)  # safetensors dtype code -> elements
    quantized: str | None = None  # "bnb-nf4", "bnb-int8", "gptq", "awq", "fp8", ... or None
    warnings: tuple[str, ...] = ()


# ---- small readers -----------------------------------------------------------------------------------


def _read_small_file(path: Path, limit: int, what: str) -> bytes:
    """Read a whole small file, refusing one larger than ``limit`` bytes."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise SetupError(f"{path}: {size:,} bytes is far too large for {what}")
        with path.open("rb") as f:
            return f.read(limit + 1)
    except OSError as e:
        raise SetupError(f"{path}: cannot read {what} ({e.strerror or e})") from e


def _parse_json_object(raw: bytes, path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise SetupError(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise SetupError(f"{path}: {what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") \
            from e
    except RecursionError as e:
        raise SetupError(f"{path}: {what} is nested too deeply to be a model description") from e
    except ValueError as e:  # an integer of more than 4,300 digits
        raise SetupError(f"{path}: {what} holds a number too long to read ({str(e).split(':')[0]})") from e
    if not isinstance(data, dict):
        raise SetupError(f"{path}: {what} must be a JSON object {{...}}, not {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def load_config_json(path: str | Path) -> dict[str, Any]:
    """Read a Hugging Face ``config.json`` (plain JSON; nothing in it is executed).

    Raises :class:`SetupError` naming the file when it cannot be read, is not JSON or is not an object.
    """
    p = Path(path)
    return _parse_json_object(_read_small_file(p, MAX_CONFIG_BYTES, "a config.json"), p, "config.json")


# ---- safetensors -------------------------------------------------------------------------------------


def _is_count(value: Any) -> bool:
    """A JSON whole number >= 0 (booleans are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """List the tensors of a ``.safetensors`` file from its header, without reading any tensor data.

    The file is ``u64 little-endian N`` + ``N bytes of JSON`` + data. The header is validated as the
    safetensors library does: N within 100 MB and the file, a UTF-8 JSON object, known dtypes, whole-number
    shapes, and ``data_offsets`` that tile the data section exactly (each tensor's span equals
    ``numel x dtype size``, no gaps or overlaps, the last ending at the end of the file).

    Returns tensor name -> :class:`TensorInfo` (``__metadata__`` is skipped). Raises :class:`SetupError`
    naming the file and the problem for a malformed file.
    """
    p = Path(path)
    try:
        file_size = p.stat().st_size
        with p.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SetupError(
                    f"{p}: not a safetensors file: {len(head)} bytes, too short for the 8-byte header length"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise SetupError(
                    f"{p}: not a safetensors file: header length {n:,} bytes exceeds the 100 MB limit"
                )
            if 8 + n > file_size:
                raise SetupError(
                    f"{p}: truncated or not a safetensors file: header length {n:,} bytes runs past the "
                    f"end of the file ({file_size:,} bytes)"
                )
            raw = f.read(n)
    except OSError as e:
        raise SetupError(f"{p}: cannot read safetensors header ({e.strerror or e})") from e
    if len(raw) != n:
        raise SetupError(f"{p}: truncated safetensors header ({len(raw):,} of {n:,} bytes)")
    return parse_safetensors_header(raw, data_size=file_size - 8 - n, source=p)


def parse_safetensors_header(raw: bytes, *, data_size: int, source: str | Path) -> dict[str, TensorInfo]:
    """Validate the JSON header bytes of a safetensors file whose data section is ``data_size`` bytes (the
    file size minus 8 minus ``len(raw)``), as :func:`read_safetensors_header` does for a local file; used
    for headers read over HTTP ranges. ``source`` names the file in errors."""
    p = Path(source) if not isinstance(source, Path) else source
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SetupError(f"{source}: safetensors header is not UTF-8 text (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise SetupError(f"{source}: safetensors header is not valid JSON ({e.msg} at char {e.pos})") from e
    except RecursionError as e:
        raise SetupError(f"{source}: safetensors header is nested too deeply") from e
    except ValueError as e:  # an integer of more than 4,300 digits
        what = str(e).split(":")[0]
        raise SetupError(f"{source}: safetensors header holds a number too long to read ({what})") from e
    if not isinstance(header, dict):
        raise SetupError(f"{source}: safetensors header must be a JSON object, not {_json_kind(header)}")
    return _validate_header(header, data_size=data_size, path=p)


def _validate_header(header: dict[str, Any], *, data_size: int, path: Path) -> dict[str, TensorInfo]:
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise SetupError(f"{path}: safetensors __metadata__ must map names to strings")
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise SetupError(f"{where}: entry must be an object with dtype, shape and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BITS:
            raise SetupError(
                f"{where}: unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPE_BITS)})"
            )
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise SetupError(f"{where}: shape must be a list of whole numbers >= 0, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise SetupError(f"{where}: data_offsets must be [begin, end] byte offsets, got {offsets!r}")
        begin, end = offsets
        bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
        if bits % 8:
            raise SetupError(f"{where}: {math.prod(shape)} x {dtype} is not a whole number of bytes")
        nbytes = bits // 8
        if end < begin:
            raise SetupError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
        if end > data_size:
            raise SetupError(
                f"{where}: data_offsets [{begin}, {end}] run past the end of the data section "
                f"({data_size:,} bytes): the file is truncated or the header is wrong"
            )
        if end - begin != nbytes:
            raise SetupError(
                f"{where}: data_offsets [{begin}, {end}] span {end - begin:,} bytes, but shape "
                f"{shape} of {dtype} needs {nbytes:,}"
            )
        tensors[name] = TensorInfo(dtype=dtype, shape=tuple(shape), nbytes=nbytes)
        spans.append((begin, end, name))
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            problem = "overlaps the previous tensor" if begin < cursor else f"leaves a gap at byte {cursor:,}"
            raise SetupError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] {problem}")
        cursor = end
    if cursor != data_size:
        raise SetupError(
            f"{path}: the tensors cover {cursor:,} bytes but the data section has {data_size:,}: "
            "the header does not describe the file"
        )
    return tensors


def read_safetensors_index(path: str | Path) -> SafetensorsIndex:
    """Read a ``*.safetensors.index.json``: ``weight_map`` (tensor name -> shard file name) and
    ``metadata.total_size`` (bytes; ``None`` when absent).

    Shard names must be plain file names in the same folder. Raises :class:`SetupError` naming the file.
    """
    p = Path(path)
    data = _parse_json_object(_read_small_file(p, MAX_INDEX_BYTES, "a safetensors index"), p,
                              "safetensors index")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SetupError(f"{p}: 'weight_map' must be a non-empty object of tensor name -> shard file")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not _is_plain_file_name(shard):
            raise SetupError(
                f"{p}: weight_map[{tensor!r}] must be a shard file name in the same folder, got {shard!r}"
            )
    total: int | None = None
    meta = data.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise SetupError(f"{p}: 'metadata' must be an object")
    raw_total = (meta or {}).get("total_size")
    if raw_total is not None:
        if isinstance(raw_total, float) and raw_total.is_integer() and raw_total >= 0:
            raw_total = int(raw_total)
        if not _is_count(raw_total):
            raise SetupError(f"{p}: metadata.total_size must be a whole number of bytes, got {raw_total!r}")
        total = raw_total
    return SafetensorsIndex(path=str(p), weight_map=dict(weight_map), total_size=total)


def _is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in ("/", "\\", "\0"))


# ---- config.json -> ModelSpec ------------------------------------------------------------------------

_MISSING: Any = object()

# Keys that do not change the parameter count: not listed when a nested config leaves them to the defaults.
_UNCOUNTED_KEYS = frozenset({"max_position_embeddings", "final_logit_softcapping", "attn_logit_softcapping",
                             "num_experts_per_tok", "hidden_act", "decoder_sparse_step"})

# The size keys every llama-style config must carry.
_LLAMA_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


class _Reader:
    """Typed access to one config dict. Errors name the file and the key (with its ``text_config.``
    prefix when nested). ``defaults`` are transformers' class defaults for the model type; a nested
    config (``text_config``) is saved as a diff against them, so its missing size keys come from there."""

    def __init__(self, data: Mapping[str, Any], *, source: str, prefix: str, family: str,
                 defaults: Mapping[str, Any], nested: bool) -> None:
        self.data = data
        self.source = source
        self.prefix = prefix
        self.family = family
        self.defaults = defaults
        self.nested = nested
        self.defaulted: list[str] = []  # size keys a nested config left to the class defaults
        self.warnings: list[str] = []

    def key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, problem: str) -> SetupError:
        return SetupError(f"{self.source}: {self.key(key)} {problem}")

    def require(self, *keys: str) -> None:
        """All of ``keys`` must be present (or, in a nested config, have a class default)."""
        absent = [k for k in keys if self.data.get(k) is None]
        missing = [k for k in absent if not (self.nested and self.defaults.get(k) is not None)]
        if missing:
            names = ", ".join(self.key(k) for k in missing)
            raise SetupError(f"{self.source}: missing {names} (needed to describe a "
                             f"{self.family or 'Llama-style'} model)")

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key)
        if value is not None:
            return value
        if default is not _MISSING:
            return default
        if key not in self.defaults:
            raise self.fail(key, "is missing")
        if self.nested and key not in _UNCOUNTED_KEYS and key not in self.defaulted:
            self.defaulted.append(key)
        return self.defaults[key]

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be a whole number, got {value!r}")
        return value

    def get_opt_int(self, key: str) -> int | None:
        """An optional whole number: absent or null gives the class default (which may be None)."""
        if self.data.get(key) is None and self.defaults.get(key) is None:
            return None
        return self.get_int(key)

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        value = self.raw(key, default)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        return float(value)

    def get_int_list(self, key: str) -> list[int]:
        value = self.raw(key, [])
        if not isinstance(value, list) or not all(_is_count(v) for v in value):
            raise self.fail(key, f"must be a list of layer indices, got {value!r}")
        return value

    def kv_heads(self, heads: int) -> int:
        """num_key_value_heads: null means "as many as attention heads"; absent means the class default."""
        key = "num_key_value_heads"
        if key in self.data and self.data[key] is None:
            return heads
        if self.data.get(key) is None and self.defaults.get(key) is None:
            return heads
        return self.get_int(key)

    def activation(self, key: str, fallback: str = "silu") -> Activation:
        value = self.raw(key, fallback)
        if not isinstance(value, str):
            raise self.fail(key, f"must be an activation name, got {value!r}")
        try:
            return Activation.parse(value)
        except SetupError:
            self.warnings.append(
                f"{self.key(key)} {value!r} is not an activation VRAM Lab models; estimating with "
                f"{fallback} (activation memory may differ slightly, the parameter count does not)"
            )
            return Activation.parse(fallback)


def _common(r: _Reader) -> dict[str, Any]:
    """The ModelSpec fields every llama-style config spells the same way."""
    r.require(*_LLAMA_KEYS)
    heads = r.get_int("num_attention_heads")
    return {
        "num_layers": r.get_int("num_hidden_layers"),
        "hidden_size": r.get_int("hidden_size"),
        "num_heads": heads,
        "num_kv_heads": r.kv_heads(heads),
        "intermediate_size": r.get_int("intermediate_size"),
        "vocab_size": r.get_int("vocab_size"),
        "head_dim": r.get_opt_int("head_dim") or 0,
        "tie_embeddings": r.get_bool("tie_word_embeddings"),
        "max_position_embeddings": r.get_int("max_position_embeddings"),
    }


def _llama(r: _Reader) -> dict[str, Any]:
    bias = r.get_bool("attention_bias", False)
    return {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": bias, "o_bias": bias,
            "mlp_bias": r.get_bool("mlp_bias", False)}


def _window(r: _Reader) -> int:
    """``sliding_window``: null means none; absent means the class default (MistralConfig's is 4096)."""
    if "sliding_window" in r.data and r.data["sliding_window"] is None:
        return 0
    return r.get_opt_int("sliding_window") or 0


def _mistral(r: _Reader) -> dict[str, Any]:
    return {**_common(r), "activation": r.activation("hidden_act"), "sliding_window": _window(r)}


def _mixtral(r: _Reader) -> dict[str, Any]:
    return {**_mistral(r), "num_experts": r.get_int("num_local_experts"),
            "experts_per_token": r.get_int("num_experts_per_tok")}


def _qwen2(r: _Reader) -> dict[str, Any]:
    # Qwen2 hard-codes bias on q/k/v (not on o_proj).
    return {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": True}


def _moe_layers(r: _Reader, num_layers: int, num_experts: int) -> bool:
    """True when every layer is a sparse MoE block, False when none is; refuses a mixed stack
    (transformers: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    if num_experts <= 0:
        return False
    step = r.get_int("decoder_sparse_step", 1)
    if step < 1:
        raise r.fail("decoder_sparse_step", f"must be at least 1, got {step}")
    dense_only = set(r.get_int_list("mlp_only_layers"))
    moe = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
    if len(moe) == num_layers:
        return True
    if not moe:
        r.warnings.append(f"no layer uses the {num_experts} experts (decoder_sparse_step / mlp_only_layers); "
                          "read as a dense model")
        return False
    dense = [i for i in range(num_layers) if i not in moe]
    shown = ", ".join(map(str, dense[:8])) + (", ..." if len(dense) > 8 else "")
    raise SetupError(
        f"{r.source}: {len(dense)} of {num_layers} layers use a dense MLP instead of the experts "
        f"(layers {shown}; from {r.key('decoder_sparse_step')}={step} and {r.key('mlp_only_layers')}): "
        "ModelSpec gives every layer the same MLP, so mixed dense/MoE stacks are not supported"
    )


def _qwen2_moe(r: _Reader) -> dict[str, Any]:
    kw = {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": r.get_bool("qkv_bias")}
    experts = r.get_int("num_experts")
    if not _moe_layers(r, kw["num_layers"], experts):
        return kw
    shared = r.get_int("shared_expert_intermediate_size")
    if shared <= 0:
        r.warnings.append("shared_expert_intermediate_size is 0: transformers still builds the 1 x hidden "
                          "shared_expert_gate, which is not counted")
    return {**kw, "num_experts": experts, "experts_per_token": r.get_int("num_experts_per_tok"),
            "moe_intermediate_size": r.get_int("moe_intermediate_size"),
            "shared_expert_intermediate_size": max(shared, 0)}


def _qwen3(r: _Reader) -> dict[str, Any]:
    bias = r.get_bool("attention_bias", False)
    return {**_common(r), "activation": r.activation("hidden_act"), "qkv_bias": bias, "o_bias": bias,
            "qk_norm": True}


def _qwen3_moe(r: _Reader) -> dict[str, Any]:
    kw = _qwen3(r)
    experts = r.get_int("num_experts")
    if not _moe_layers(r, kw["num_layers"], experts):
        return kw
    return {**kw, "num_experts": experts, "experts_per_token": r.get_int("num_experts_per_tok"),
            "moe_intermediate_size": r.get_int("moe_intermediate_size")}


def _gemma(r: _Reader) -> dict[str, Any]:
    # transformers' Gemma MLP uses hidden_activation, defaulting to the tanh GELU whatever hidden_act says.
    bias = r.get_bool("attention_bias", False)
    return {**_common(r), "activation": r.activation("hidden_activation", "gelu_pytorch_tanh"),
            "qkv_bias": bias, "o_bias": bias, "scale_embeddings": True}


def _gemma2(r: _Reader) -> dict[str, Any]:
    return {**_gemma(r), "norms_per_layer": 4,
            "final_logit_softcap": r.get_float("final_logit_softcapping"),
            "attn_logit_softcap": r.get_float("attn_logit_softcapping")}


def _gemma3_text(r: _Reader) -> dict[str, Any]:
    return {**_gemma2(r), "qk_norm": True}


def _phi3(r: _Reader) -> dict[str, Any]:
    # Fused qkv_proj / gate_up_proj hold exactly the elements of separate q/k/v and gate/up projections.
    kw = _common(r)
    head_dim = kw["head_dim"] or kw["hidden_size"] // max(kw["num_heads"], 1)
    rope = r.data.get("rope_parameters") if isinstance(r.data.get("rope_parameters"), dict) else {}
    factor = r.data.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise r.fail("partial_rotary_factor", f"must be a number in (0, 1], got {factor!r}")
    return {**kw, "activation": r.activation("hidden_act"), "fused_qkv": True, "fused_gate_up": True,
            "rope_pass_cat": True, "sliding_window": _window(r),
            "rotary_dim": int(head_dim * factor) if factor < 1 else 0}


def _phi(r: _Reader) -> dict[str, Any]:
    kw = _common(r)
    if r.get_bool("qk_layernorm", False):
        raise SetupError(
            f"{r.source}: {r.key('qk_layernorm')} is true: phi's q/k LayerNorms carry a bias, which "
            "ModelSpec's qk_norm (weight only) cannot count exactly, so this config is not supported"
        )
    return {**kw, "activation": r.activation("hidden_act", "gelu_new"), "qkv_bias": True, "o_bias": True,
            "mlp_bias": True, "lm_head_bias": True, "mlp_kind": MlpKind.PLAIN,
            "norm_kind": NormKind.LAYERNORM, "norms_per_layer": 1, "parallel_block": True}


def _stablelm(r: _Reader) -> dict[str, Any]:
    kw = _common(r)
    if r.get_bool("qk_layernorm", False):
        head_dim = kw["head_dim"] or kw["hidden_size"] // max(kw["num_heads"], 1)
        raise _full_qk_norm_error(r, "StableLM's per-head q/k LayerNorms (qk_layernorm)", kw, head_dim)
    parallel = r.get_bool("use_parallel_residual", False)
    return {**kw, "activation": r.activation("hidden_act"), "qkv_bias": r.get_bool("use_qkv_bias", False),
            "norm_kind": NormKind.LAYERNORM, "norms_per_layer": 1 if parallel else 2,
            "parallel_block": parallel}


def _starcoder2(r: _Reader) -> dict[str, Any]:
    bias = r.get_bool("use_bias", True)
    return {**_common(r), "activation": r.activation("hidden_act", "gelu_pytorch_tanh"), "qkv_bias": bias,
            "o_bias": bias, "mlp_bias": bias, "mlp_kind": MlpKind.PLAIN, "norm_kind": NormKind.LAYERNORM}


def _olmo2(r: _Reader) -> dict[str, Any]:
    kw = _common(r)
    head_dim = kw["head_dim"] or kw["hidden_size"] // max(kw["num_heads"], 1)
    raise _full_qk_norm_error(r, "OLMo-2's q_norm and k_norm (over the whole q and k projections)", kw,
                              head_dim)


def _full_qk_norm_error(r: _Reader, what: str, kw: Mapping[str, Any], head_dim: int) -> SetupError:
    q_dim, kv_dim = kw["num_heads"] * head_dim, kw["num_kv_heads"] * head_dim
    short = kw["num_layers"] * (q_dim + kv_dim - 2 * head_dim)
    return SetupError(
        f"{r.source}: {what} have {q_dim} + {kv_dim} norm weights per layer, but ModelSpec's qk_norm "
        f"counts one head_dim ({head_dim}) each, so the import would be {short:,} parameters short: "
        f"model_type {r.family!r} cannot be expressed exactly and is not supported yet"
    )


def _gpt2(r: _Reader) -> dict[str, Any]:
    r.require("n_embd", "n_layer", "n_head", "vocab_size")
    if r.get_bool("add_cross_attention", False):
        raise r.fail("add_cross_attention", "is true: cross-attention layers are not supported")
    hidden, heads = r.get_int("n_embd"), r.get_int("n_head")
    inner = r.get_opt_int("n_inner") or 4 * hidden
    return {"num_layers": r.get_int("n_layer"), "hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": heads, "intermediate_size": inner, "vocab_size": r.get_int("vocab_size"),
            "max_position_embeddings": r.get_int("n_positions"), "learned_positions": True,
            "tie_embeddings": r.get_bool("tie_word_embeddings"),
            "activation": r.activation("activation_function", "gelu_new"),
            "qkv_bias": True, "o_bias": True, "mlp_bias": True, "mlp_kind": MlpKind.PLAIN,
            "norm_kind": NormKind.LAYERNORM}


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
             "kv_lora_rank", "q_lora_rank")


def _generic(r: _Reader) -> dict[str, Any]:
    what = (f"model_type {r.family!r} is not one VRAM Lab maps" if r.family
            else "the config names no model_type")
    present = [k for k in _LLAMA_KEYS if r.data.get(k) is not None]
    if len(present) < len(_LLAMA_KEYS):
        missing = ", ".join(r.key(k) for k in _LLAMA_KEYS if k not in present)
        raise SetupError(
            f"{r.source}: {what}, and it lacks the Llama-style keys needed to read it generically: "
            f"missing {missing}"
        )
    odd = [k for k in _MOE_KEYS if r.data.get(k)]
    if odd:
        raise SetupError(
            f"{r.source}: {what}, and its {', '.join(r.key(k) for k in odd)} (mixture-of-experts / latent "
            "attention) cannot be placed by a generic Llama-style reading"
        )
    if r.data.get("tie_word_embeddings") is None:
        r.warnings.append("tie_word_embeddings is not set: assumed untied (a separate lm_head)")
    r.warnings.append(
        f"{what}: read as a Llama-style decoder (RMSNorm, gated MLP, no biases); check the parameter "
        "count against the checkpoint"
    )
    return _llama(r)


# transformers' class defaults (configuration_<type>.py). Top-level configs carry every size key; nested
# text configs are saved as a diff against these, so a key left out there means "this default".
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "tie_word_embeddings": False,
}
_MISTRAL_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
}
_QWEN2_DEFAULTS: dict[str, Any] = {
    **_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
}
_GEMMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
_GEMMA2_DEFAULTS: dict[str, Any] = {
    **_GEMMA_DEFAULTS, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}


@dataclass(frozen=True)
class _Family:
    build: Callable[[_Reader], dict[str, Any]]
    defaults: Mapping[str, Any]


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(_llama, _LLAMA_DEFAULTS),
    "mistral": _Family(_mistral, _MISTRAL_DEFAULTS),
    "mixtral": _Family(_mixtral, {**_MISTRAL_DEFAULTS, "num_local_experts": 8, "num_experts_per_tok": 2,
                                  "sliding_window": None}),
    "qwen2": _Family(_qwen2, _QWEN2_DEFAULTS),
    "qwen2_moe": _Family(_qwen2_moe, {
        **_QWEN2_DEFAULTS, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "qkv_bias": True,
    }),
    "qwen3": _Family(_qwen3, {**_QWEN2_DEFAULTS, "head_dim": 128}),
    "qwen3_moe": _Family(_qwen3_moe, {
        **_QWEN2_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    }),
    "gemma": _Family(_gemma, _GEMMA_DEFAULTS),
    "gemma2": _Family(_gemma2, _GEMMA2_DEFAULTS),
    "gemma3_text": _Family(_gemma3_text, {
        **_GEMMA2_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }),
    "phi3": _Family(_phi3, {
        **_LLAMA_DEFAULTS, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "max_position_embeddings": 4096,
    }),
    "phi": _Family(_phi, {
        **_LLAMA_DEFAULTS, "vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 24, "hidden_act": "gelu_new",
    }),
    "stablelm": _Family(_stablelm, {
        **_LLAMA_DEFAULTS, "vocab_size": 50304, "hidden_size": 2560, "intermediate_size": 6912,
        "num_key_value_heads": 32, "max_position_embeddings": 4096,
    }),
    "starcoder2": _Family(_starcoder2, {
        "vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
        "num_attention_heads": 24, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    }),
    "olmo2": _Family(_olmo2, {**_LLAMA_DEFAULTS, "vocab_size": 50304}),
    "gpt2": _Family(_gpt2, {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "tie_word_embeddings": True,
    }),
}
_ALIASES = {
    # Qwen2-VL / Qwen2.5-VL language models are Qwen2 decoders (their vision tower is not counted).
    "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted((*_FAMILIES, *_ALIASES)))

# Wrappers whose text_config may omit its own model_type.
_WRAPPED_TEXT_TYPE = {
    "gemma3": "gemma3_text", "llava": "llama", "llava_next": "llama", "mistral3": "mistral",
    "paligemma": "gemma", "idefics3": "llama",
}

_MLA = ("uses multi-head latent attention (MLA: low-rank compressed q and kv projections), which ModelSpec "
        "cannot describe; MLA models are not supported")
_NOT_MAPPED = ("is not mapped yet: its layer layout (norms, biases, MLP or fused projections) differs from "
               "the Llama-style default, so a generic reading would miscount")
_FULL_QK = "normalises the whole q and k projections, which ModelSpec's per-head qk_norm cannot count"
_REFUSED: dict[str, str] = {
    "deepseek_v2": f"DeepSeek-V2 {_MLA}",
    "deepseek_v3": f"DeepSeek-V3 {_MLA}",
    "deepseek_vl_v2": f"DeepSeek-VL2's language model {_MLA}",
    "deepseek": "DeepSeek-MoE (dense first layers, shared and fine-grained experts) is not supported",
    "olmo": "OLMo-1 uses LayerNorms without learnable weights, which ModelSpec cannot count",
    "olmo3": f"OLMo-3 {_FULL_QK}",
    "olmoe": f"OLMoE {_FULL_QK}",
    "llama4": "Llama 4 interleaves dense and MoE layers with a shared expert; not supported",
    "llama4_text": "Llama 4 interleaves dense and MoE layers with a shared expert; not supported",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp) is not supported",
    "mllama": "Llama 3.2 Vision interleaves cross-attention layers; not supported",
    **{t: f"{t} is a state-space / recurrent model, not a transformer ModelSpec can describe"
       for t in ("mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2",
                 "falcon_h1", "nemotron_h")},
    **{t: f"{t} is not a decoder-only language model"
       for t in ("t5", "mt5", "umt5", "bart", "mbart", "bert", "roberta", "deberta", "whisper",
                 "encoder-decoder", "vision-encoder-decoder")},
    **{t: f"model_type {t!r} {_NOT_MAPPED}"
       for t in ("gpt_neox", "falcon", "bloom", "opt", "mpt", "gptj", "gpt_bigcode", "phimoe", "phi3small",
                 "dbrx", "cohere", "cohere2", "granitemoe", "nemotron")},
}

# Leading class names of `architectures` for configs without model_type.
_ARCH_PREFIX = {
    "Llama": "llama", "MistralFor": "mistral", "Mixtral": "mixtral", "Qwen2Moe": "qwen2_moe",
    "Qwen2For": "qwen2", "Qwen3Moe": "qwen3_moe", "Qwen3For": "qwen3", "Gemma3ForCausal": "gemma3_text",
    "Gemma2": "gemma2", "GemmaFor": "gemma", "Phi3For": "phi3", "PhiFor": "phi", "StableLm": "stablelm",
    "Starcoder2": "starcoder2", "Olmo2": "olmo2", "GPT2": "gpt2", "DeepseekV3": "deepseek_v3",
    "DeepseekV2": "deepseek_v2",
}
_LM_HEAD_ARCH = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")

_TORCH_DTYPES = {
    "float32": DType.FP32, "float": DType.FP32, "fp32": DType.FP32,
    "bfloat16": DType.BF16, "bf16": DType.BF16,
    "float16": DType.FP16, "half": DType.FP16, "fp16": DType.FP16,
}


def _model_type(cfg: Mapping[str, Any], source: str, prefix: str) -> str:
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise SetupError(f"{source}: {prefix}model_type must be a string, got {mt!r}")
    if mt:
        return mt.strip().lower()
    archs = cfg.get("architectures")
    if isinstance(archs, list):
        for arch in archs:
            for head, family in _ARCH_PREFIX.items():
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


_NO_DTYPE = "config.json names no torch_dtype: checkpoint dtype taken as bf16"


def hf_config_to_spec(cfg: Mapping[str, Any], *, id: str, name: str, source: str = "config.json"
                      ) -> tuple[ModelSpec, tuple[str, ...]]:
    """Map a Hugging Face config dict to a ModelSpec, with warnings for the user.

    Multimodal wrappers (``text_config``, or a ``vision_config``) give the language model only, with a
    warning that the vision tower is not counted. ``source`` names the file in error messages. Raises
    :class:`SetupError` (naming ``source`` and the key) for missing or wrong-typed keys and for
    architectures ModelSpec cannot express exactly.
    """
    warnings: list[str] = []
    top_type = _model_type(cfg, source, "")
    if top_type in _REFUSED:
        raise SetupError(f"{source}: {_REFUSED[top_type]}")
    inner: Mapping[str, Any] = cfg
    prefix = ""
    text_config = cfg.get("text_config")
    if text_config is not None:
        if not isinstance(text_config, dict):
            raise SetupError(f"{source}: text_config must be an object, got {text_config!r}")
        inner, prefix = text_config, "text_config."
    model_type = _model_type(inner, source, prefix)
    if not model_type and prefix:
        model_type = _WRAPPED_TEXT_TYPE.get(top_type, "")
    if model_type in _REFUSED:
        raise SetupError(f"{source}: {_REFUSED[model_type]}")
    multimodal = bool(prefix) or any(k in cfg for k in ("vision_config", "audio_config"))
    if multimodal:
        what = top_type or "multimodal"
        warnings.append(
            f"{what} is a multimodal model: only its language model ({model_type or 'text_config'}) is "
            "imported; the vision tower and projector are not counted"
        )
    family_key = _ALIASES.get(model_type, model_type)
    family = _FAMILIES.get(family_key)
    if family is None:  # generic: the size keys must be there; the rest as Llama has them
        reason = remote_code_reason(inner, model_type) or (remote_code_reason(cfg, top_type) if prefix else None)
        if reason:
            raise RemoteCodeError(f"{source}: {reason}; a model folder with its *.safetensors is counted "
                                  "exactly from their headers")
        defaults = {k: v for k, v in _LLAMA_DEFAULTS.items() if k not in _LLAMA_KEYS}
        reader = _Reader(inner, source=source, prefix=prefix, family=model_type,
                         defaults=defaults, nested=False)
        kwargs = _generic(reader)
    else:
        reader = _Reader(inner, source=source, prefix=prefix, family=model_type, defaults=family.defaults,
                         nested=bool(prefix))
        kwargs = family.build(reader)
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
        warnings.append(_NO_DTYPE)
    try:
        spec = ModelSpec(id=id, name=name, family=family_key or "generic",
                         checkpoint_dtype=dtype or DType.BF16, source=source, **kwargs)
    except SetupError as e:
        raise SetupError(f"{source}: {e}") from e
    return spec, tuple(warnings)


def spec_from_hf_config(cfg: Mapping[str, Any], *, id: str, name: str,
                        source: str = "config.json") -> ModelSpec:
    """Map a Hugging Face ``config.json`` dict to a ModelSpec (see :func:`hf_config_to_spec`, which also
    returns the warnings)."""
    return hf_config_to_spec(cfg, id=id, name=name, source=source)[0]


# ---- tensors -> counts -------------------------------------------------------------------------------

# Name components of tensors that belong to a vision / audio tower or its projector, not the language model.
_NON_TEXT_PARTS = frozenset({
    "vision_tower", "vision_model", "visual", "vision_encoder", "vision_embed_tokens",
    "multi_modal_projector", "mm_projector", "image_newline", "vision_resampler", "connector",
    "audio_tower", "audio_model", "embed_vision", "embed_audio",
})


def _is_buffer(name: str, info: TensorInfo) -> bool:
    """Stored buffers that are not parameters: RoPE inverse frequencies and GPT-2's causal-mask tables."""
    last = name.rsplit(".", 1)[-1]
    return last in ("inv_freq", "masked_bias") or (name.endswith("attn.bias") and len(info.shape) == 4)


def _quantization_from_config(cfg: Mapping[str, Any], warnings: list[str]) -> str | None:
    qc = cfg.get("quantization_config")
    if qc is None:
        text = cfg.get("text_config")
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        warnings.append("quantization_config is not an object; ignored")
        return None
    method = str(qc.get("quant_method") or "").lower()
    if method == "bitsandbytes" or (not method and ("load_in_4bit" in qc or "load_in_8bit" in qc)):
        if qc.get("load_in_4bit"):
            return f"bnb-{str(qc.get('bnb_4bit_quant_type') or 'fp4').lower()}"
        return "bnb-int8" if qc.get("load_in_8bit") else "bitsandbytes"
    return method.replace("_", "-") or "unknown"


def _quantization_from_tensors(tensors: Mapping[str, TensorInfo]) -> str | None:
    names = list(tensors)
    if any(n.endswith(".qweight") for n in names):
        return "gptq" if any(n.endswith(".g_idx") for n in names) else "awq"
    for n in names:
        if "quant_state.bitsandbytes__" in n:
            return "bnb-" + n.rsplit("bitsandbytes__", 1)[1]
    if any(n.endswith(".absmax") for n in names):
        return "bnb-4bit"
    if any(n.endswith(".SCB") for n in names):
        return "bnb-int8"
    weights = [t for n, t in tensors.items() if n.endswith(".weight") and len(t.shape) == 2]
    if any(t.dtype.startswith("F8_") for t in weights):
        return "fp8"
    if any(t.dtype in ("F4", "F6_E2M3", "F6_E3M2") for t in weights):
        return "fp4"
    if any(t.dtype in ("U8", "I8", "I32", "U32") for t in weights):
        return "packed"
    return None


@dataclass
class _Weights:
    tensors: dict[str, TensorInfo]
    index: SafetensorsIndex | None


def _pick_safetensors(folder: Path, warnings: list[str]) -> tuple[list[Path], SafetensorsIndex | None] | None:
    """The safetensors files that hold the model (via the index when there is one); None when none."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    preferred = folder / "model.safetensors.index.json"
    index_path = preferred if preferred.is_file() else (indexes[0] if len(indexes) == 1 else None)
    if index_path is None and len(indexes) > 1:
        warnings.append(f"several safetensors indexes ({', '.join(p.name for p in indexes)}); none used")
    if index_path is not None:
        index = read_safetensors_index(index_path)
        missing = [s for s in index.shards if not (folder / s).is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            warnings.append(
                f"{index_path.name} lists {len(missing)} shard(s) not in the folder ({shown}): the download "
                "looks incomplete, so the parameter count comes from config.json only"
            )
            return None
        return [folder / s for s in index.shards], index
    files = sorted(p for p in folder.glob("*.safetensors")
                   if p.is_file() and p.name != "adapter_model.safetensors")
    if not files:
        return None
    if any(p.name == "model.safetensors" for p in files):
        return [folder / "model.safetensors"], None
    shards = [p for p in files if re.fullmatch(r"model-\d+-of-\d+\.safetensors", p.name)]
    if shards:
        warnings.append(f"no model.safetensors.index.json: counted the {len(shards)} model-*-of-* shards")
        return shards, None
    if len(files) > 1:
        warnings.append(f"no index: counted all {len(files)} .safetensors files "
                        f"({', '.join(p.name for p in files)})")
    return files, None


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state")


def _read_weights(folder: Path, warnings: list[str]) -> _Weights | None:
    picked = _pick_safetensors(folder, warnings)
    if picked is None:
        _warn_other_weights(folder, warnings)
        return None
    files, index = picked
    return _combine_headers([read_safetensors_header(path) for path in files], index, warnings)


def _combine_headers(headers: Iterable[Mapping[str, TensorInfo]], index: SafetensorsIndex | None,
                     warnings: list[str]) -> _Weights:
    """The tensors of all shard headers (each name once), checked against the index when there is one."""
    tensors: dict[str, TensorInfo] = {}
    duplicates: list[str] = []
    for header in headers:
        for name, info in header.items():
            if name in tensors:
                duplicates.append(name)
                continue
            tensors[name] = info
    if duplicates:
        warnings.append(f"{len(duplicates)} tensor(s) appear in more than one file (e.g. {duplicates[0]!r}); "
                        "counted once")
    if index is not None:
        listed = set(index.weight_map)
        if listed != set(tensors):
            extra, absent = len(set(tensors) - listed), len(listed - set(tensors))
            warnings.append(f"{Path(index.path).name} and the shard headers disagree ({absent} listed "
                            f"tensors not found, {extra} unlisted tensors found)")
        nbytes = sum(t.nbytes for t in tensors.values())
        if index.total_size is not None and index.total_size != nbytes:
            warnings.append(f"{Path(index.path).name} gives total_size {index.total_size:,} bytes; the shard "
                            f"headers hold {nbytes:,}")
    return _Weights(tensors=tensors, index=index)


def _warn_other_weights(folder: Path, warnings: list[str]) -> None:
    pickles = sorted(p.name for p in folder.iterdir()
                     if p.name.endswith(_PICKLE_SUFFIXES) and not p.name.startswith(_NOT_WEIGHTS))
    if pickles:
        shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
        note = ""
        bin_index = folder / "pytorch_model.bin.index.json"
        if bin_index.is_file():
            try:
                raw = _read_small_file(bin_index, MAX_INDEX_BYTES, "an index")
                total = _parse_json_object(raw, bin_index, "index").get("metadata", {}).get("total_size")
            except (SetupError, AttributeError):
                total = None
            if _is_count(total):
                note = f" (its index gives {total:,} bytes of weights)"
        warnings.append(
            f"the weights are pickle files ({shown}), which VRAM Lab never opens (unpickling can run code): "
            f"the parameter count comes from config.json only{note}; a safetensors copy gives an exact check"
        )
    if any(folder.glob("*.gguf")):
        warnings.append("GGUF files are not read: the parameter count comes from config.json only")


def _compare_counts(spec: ModelSpec, weights: _Weights, multimodal: bool, warnings: list[str]) -> int:
    """The language-model parameter count of the tensors, with warnings where it differs from the spec."""
    buffers = [n for n, t in weights.tensors.items() if _is_buffer(n, t)]
    non_text = [n for n in weights.tensors if multimodal and _NON_TEXT_PARTS.intersection(n.split("."))]
    skip = set(buffers) | set(non_text)
    heads = [n for n in weights.tensors if n.endswith("lm_head.weight") and n not in skip]
    if spec.tie_embeddings and heads:
        warnings.append(f"the embeddings are tied but the checkpoint also stores {heads[0]}; counted once")
        skip.update(heads)
    if buffers:
        n = sum(weights.tensors[b].numel for b in buffers)
        warnings.append(f"{len(buffers)} stored buffer(s) ({buffers[0]}, ...; {n:,} elements) are not "
                        "parameters and are not counted")
    if non_text:
        n = sum(weights.tensors[t].numel for t in non_text)
        warnings.append(f"the safetensors also hold {n:,} vision/projector parameters, not counted")
    params = sum(t.numel for n, t in weights.tensors.items() if n not in skip)
    implied = spec.param_count
    if params != implied:
        diff = params - implied
        hint = ""
        if abs(diff) == spec.vocab_size * spec.hidden_size:
            hint = " (exactly one vocab x hidden matrix: check tie_word_embeddings)"
        raise SetupError(f"{spec.source}: the safetensors hold {params:,} parameters, but config.json read as "
                         f"{spec.family or 'a Llama-style'} model implies {implied:,} ({diff:+,}){hint}: the "
                         "config and the weights disagree, and VRAM Lab does not pick one silently")
    return params


def _remote_code_model(cfg: Mapping[str, Any], folder: Path, config_path: Path, name: str,
                       error: RemoteCodeError, warnings: list[str]) -> ImportedModel:
    """A config only remote code can build: parameters counted from the safetensors headers (see
    :func:`~vramlab.core.remote_code.spec_from_headers`), or the refusal when there are none to count."""
    reason = str(error).removeprefix(f"{config_path}: ").split("; a model folder")[0]
    weights = _read_weights(folder, warnings)
    quantized = _quantization_from_config(cfg, warnings)
    if weights is not None:
        quantized = quantized or _quantization_from_tensors(weights.tensors)
    if weights is None or quantized:
        what = f"pre-quantized ({quantized}) weights" if weights is not None else "no safetensors to count"
        raise RemoteCodeError(f"{config_path}: {reason}; the folder has {what}, so there is no exact "
                              "count either") from error
    model_type = _model_type(cfg, str(config_path), "")
    reader = _Reader(cfg, source=str(config_path), prefix="", family=model_type,
                     defaults={k: v for k, v in _LLAMA_DEFAULTS.items() if k not in _LLAMA_KEYS}, nested=False)
    try:
        kwargs = {**_common(reader), "activation": reader.activation("hidden_act")}
    except SetupError as e:
        raise RemoteCodeError(f"{config_path}: {reason}; and it lacks the Llama-style size keys an activation "
                              f"model needs ({str(e).split(': ', 1)[-1]})") from error
    tensors = {n: t for n, t in weights.tensors.items() if not _is_buffer(n, t)}
    vh = {(kwargs["vocab_size"], kwargs["hidden_size"]), (kwargs["hidden_size"], kwargs["vocab_size"])}
    heads = sum(1 for t in tensors.values() if t.shape in vh)
    params = sum(t.numel for t in tensors.values())
    bias_sizes = {t.numel for n, t in tensors.items() if n.endswith("bias")}
    spec, note = spec_from_headers(reason, kwargs, params, heads, bias_sizes, id=_slug(name), name=name,
                                   source=str(config_path), family=model_type)
    dtype_counts: dict[str, int] = {}
    for t in weights.tensors.values():
        dtype_counts[t.dtype] = dtype_counts.get(t.dtype, 0) + t.numel
    floats = {d: n for d, n in dtype_counts.items() if d in _FLOAT_DTYPES}
    if floats:
        spec = dataclasses.replace(spec, checkpoint_dtype=_FLOAT_DTYPES[max(floats, key=lambda d: floats[d])])
    warnings.append(note)
    warnings.extend(reader.warnings)
    return ImportedModel(spec=spec, source_path=str(folder), tensor_params=sum(dtype_counts.values()),
                         tensor_bytes=sum(t.nbytes for t in weights.tensors.values()), dtype_counts=dtype_counts,
                         warnings=tuple(warnings))


# ---- folder / file -> ImportedModel ------------------------------------------------------------------


def _hf_cache_snapshot(folder: Path, warnings: list[str]) -> Path:
    """A hub-cache repo folder (``models--org--name``) -> its snapshot for refs/main (or the only one)."""
    snapshots = folder / "snapshots"
    if not (folder.name.startswith("models--") and snapshots.is_dir()):
        return folder
    ref = folder / "refs" / "main"
    if ref.is_file():
        commit = _read_small_file(ref, 256, "a refs/main file").decode("ascii", "replace").strip()
        if re.fullmatch(r"[0-9a-f]{40}", commit) and (snapshots / commit).is_dir():
            return snapshots / commit
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SetupError(f"{folder}: a Hugging Face cache folder without snapshots")
    if len(found) > 1:
        warnings.append(f"{len(found)} snapshots in the cache folder; read the newest ({found[-1].name})")
    return found[-1]


def _display_name(folder: Path) -> str:
    """The folder name, or ``org/name`` for a hub-cache snapshot (.../models--org--name/snapshots/<hash>)."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return folder.name or "model"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "local-model"


def _missing_config_error(folder: Path) -> SetupError:
    if (folder / "adapter_config.json").is_file():
        hint = ("this is a PEFT adapter (adapter_config.json): import the base model it names in "
                "base_model_name_or_path")
    elif (folder / "params.json").is_file():
        hint = "this is an original (non-Hugging Face) checkpoint with params.json: use its HF version"
    else:
        hint = "choose the folder that holds the model's config.json"
    return SetupError(f"{folder}: no config.json in this folder; {hint}")


def load_model_source(path: str | Path) -> ImportedModel:
    """Import a local model: ``path`` is a model folder (``config.json`` + ``*.safetensors`` or an index)
    or a ``config.json`` file (then only the config is read).

    The spec's id and name come from the folder name (``org/name`` in a Hugging Face cache). With
    unquantized safetensors, ``spec.published_params`` is the exact parameter count from the tensor
    headers, and any difference from ``spec.param_count`` is a warning. Pickle weights (``*.bin``,
    ``*.pt``) are never opened. Raises :class:`SetupError` naming the file for anything unreadable.
    """
    p = Path(path).expanduser()
    try:
        return _load_model_source(p)
    except OSError as e:  # a folder or file that vanished or cannot be listed mid-way
        raise SetupError(f"{e.filename or p}: cannot read ({e.strerror or e})") from e


def _load_model_source(p: Path) -> ImportedModel:
    if not p.exists():
        raise SetupError(f"{p}: no such file or folder")
    warnings: list[str] = []
    folder: Path | None
    if p.is_dir():
        folder = _hf_cache_snapshot(p, warnings)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise _missing_config_error(folder)
    elif p.name.endswith((".safetensors", ".safetensors.index.json")):
        folder, config_path = p.parent, p.parent / "config.json"
        if not config_path.is_file():
            raise _missing_config_error(folder)
    elif p.is_file():
        folder, config_path = None, p
    else:
        raise SetupError(f"{p}: not a regular file or folder")
    base = folder if folder is not None else config_path.parent
    by_folder = folder is not None or config_path.name == "config.json"
    name = _display_name(base) if by_folder else config_path.stem
    cfg = load_config_json(config_path)
    try:
        spec, spec_warnings = hf_config_to_spec(cfg, id=_slug(name), name=name, source=str(config_path))
    except RemoteCodeError as e:
        if folder is None:
            raise
        return _remote_code_model(cfg, folder, config_path, name, e, warnings)
    warnings.extend(spec_warnings)
    quantized = _quantization_from_config(cfg, warnings)
    weights = _read_weights(folder, warnings) if folder is not None else None
    return _imported(cfg, spec, weights, quantized, str(folder or config_path), warnings)


def import_from_parts(cfg: Mapping[str, Any], *, name: str, source_path: str, config_source: str,
                      shard_headers: Iterable[Mapping[str, TensorInfo]] | None,
                      index: SafetensorsIndex | None = None, warnings: Iterable[str] = ()) -> ImportedModel:
    """Import a model whose ``config.json`` and safetensors headers were read elsewhere (the Hub reader reads
    them over HTTP ranges): the same mapping and checks as :func:`load_model_source` on a folder.
    ``shard_headers`` is one validated header per weight file (see :func:`parse_safetensors_header`), or
    ``None`` when the model has no safetensors (the count then comes from the config only)."""
    out = list(warnings)
    spec, spec_warnings = hf_config_to_spec(cfg, id=_slug(name), name=name, source=config_source)
    out.extend(spec_warnings)
    quantized = _quantization_from_config(cfg, out)
    weights = _combine_headers(shard_headers, index, out) if shard_headers is not None else None
    return _imported(cfg, spec, weights, quantized, source_path, out)


def _imported(cfg: Mapping[str, Any], spec: ModelSpec, weights: _Weights | None, quantized: str | None,
              source_path: str, warnings: list[str]) -> ImportedModel:
    if weights is None:
        if quantized:
            warnings.append(f"pre-quantized checkpoint ({quantized}): the architecture count is of the "
                            "unquantized model")
        return ImportedModel(spec=spec, source_path=source_path, quantized=quantized,
                             warnings=tuple(warnings))

    tensors = weights.tensors
    dtype_counts: dict[str, int] = {}
    for t in tensors.values():
        dtype_counts[t.dtype] = dtype_counts.get(t.dtype, 0) + t.numel
    total_params = sum(dtype_counts.values())
    total_bytes = sum(t.nbytes for t in tensors.values())
    quantized = quantized or _quantization_from_tensors(tensors)

    floats = {d: n for d, n in dtype_counts.items() if d in _FLOAT_DTYPES}
    if floats and not quantized:
        stored = _FLOAT_DTYPES[max(floats, key=lambda d: floats[d])]
        if _NO_DTYPE in warnings:
            warnings[warnings.index(_NO_DTYPE)] = ("config.json names no torch_dtype: checkpoint dtype taken "
                                                   f"from the safetensors ({stored.value})")
        elif stored is not spec.checkpoint_dtype:
            warnings.append(f"config.json says {spec.checkpoint_dtype.value} but the safetensors are mostly "
                            f"{stored.value}: checkpoint dtype taken as {stored.value}")
        spec = dataclasses.replace(spec, checkpoint_dtype=stored)

    multimodal = "text_config" in cfg or any(k in cfg for k in ("vision_config", "audio_config"))
    if quantized:
        warnings.append(
            f"pre-quantized checkpoint ({quantized}): the safetensors hold packed tensors and quantization "
            f"scales, so their {total_params:,} elements are not the parameter count; the architecture "
            f"count from config.json is {spec.param_count:,}"
        )
    else:
        params = _compare_counts(spec, weights, multimodal, warnings)
        spec = dataclasses.replace(spec, published_params=params)
    return ImportedModel(spec=spec, source_path=source_path, tensor_params=total_params,
                         tensor_bytes=total_bytes, dtype_counts=dtype_counts, quantized=quantized,
                         warnings=tuple(warnings))
