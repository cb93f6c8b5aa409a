"""Reading a user's model files as data, safely: ``config.json`` and other small JSON files with size and
depth limits, and the JSON headers of ``*.safetensors`` files (the 8-byte little-endian length and the header
itself; no tensor data is read, nothing is unpickled, nothing runs).

* :func:`load_config_json` — read a ``config.json`` into a dict.
* :func:`read_safetensors_header` — validate one ``.safetensors`` file's header and list its tensors.
* :func:`parse_safetensors_header` — the same validation for header bytes read elsewhere (HTTP ranges).
* :func:`read_safetensors_index` — read ``model.safetensors.index.json`` (weight_map, total_size).

Units: element counts are plain integers; sizes are bytes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.spec.options import DType

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

HEADER_FLOAT_DTYPES = {"F32": DType.FP32, "BF16": DType.BF16, "F16": DType.FP16}

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


# ---- small readers -----------------------------------------------------------------------------------


def read_small_file(path: Path, limit: int, what: str) -> bytes:
    """Read a whole small file, refusing one larger than ``limit`` bytes."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise SetupError(f"{path}: {size:,} bytes is far too large for {what}")
        with path.open("rb") as f:
            return f.read(limit + 1)
    except OSError as e:
        raise SetupError(f"{path}: cannot read {what} ({e.strerror or e})") from e


def parse_json_object(raw: bytes, path: Path, what: str) -> dict[str, Any]:
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
    return parse_json_object(read_small_file(p, MAX_CONFIG_BYTES, "a config.json"), p, "config.json")


# a checkpoint's processor files: transformers' processor and image processor settings (read where a family's images
# are counted by its processor class: core/tracing/vlm_processor.py)
PROCESSOR_FILES = (("processor", "processor_config.json"), ("image_processor", "preprocessor_config.json"),
                   ("video_processor", "video_preprocessor_config.json"))


def load_processor_files(folder: Path) -> str:
    """The processor files of a model folder (``processor_config.json``, ``preprocessor_config.json``,
    ``video_preprocessor_config.json``) as one canonical JSON object (``{"processor": ..., "image_processor": ...,
    "video_processor": ...}``, sorted keys), "" where it has none. A ``processor_config.json`` that holds its image
    or video processor's settings itself (as transformers 5 saves it) gives them where their own file is absent.
    Plain JSON; nothing in it is executed."""
    out: dict[str, Any] = {}
    for key, filename in PROCESSOR_FILES:
        path = folder / filename
        if path.is_file():
            out[key] = parse_json_object(read_small_file(path, MAX_CONFIG_BYTES, f"a {filename}"), path, filename)
    for key in ("image_processor", "video_processor"):
        nested = out.get("processor", {}).get(key)
        if key not in out and isinstance(nested, dict):
            out[key] = nested
    return json.dumps(out, sort_keys=True, separators=(",", ":")) if out else ""


# ---- safetensors -------------------------------------------------------------------------------------


def is_count(value: Any) -> bool:
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
        if not isinstance(shape, list) or not all(is_count(d) for d in shape):
            raise SetupError(f"{where}: shape must be a list of whole numbers >= 0, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(o) for o in offsets)):
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
    data = parse_json_object(read_small_file(p, MAX_INDEX_BYTES, "a safetensors index"), p,
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
        if not is_count(raw_total):
            raise SetupError(f"{p}: metadata.total_size must be a whole number of bytes, got {raw_total!r}")
        total = raw_total
    return SafetensorsIndex(path=str(p), weight_map=dict(weight_map), total_size=total)


def _is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in ("/", "\\", "\0"))


