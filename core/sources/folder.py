"""A local model folder (or a ``config.json`` path) as an :class:`ImportedModel`: the config mapped by
:mod:`.hf_config`, checked against the exact parameter counts of its safetensors headers (:mod:`.files`).

* :func:`load_model_source` — a folder or a ``config.json`` path, with an exact parameter count from the
  safetensors headers as a check on the architecture.
* :func:`import_from_parts` — the same from a config dict and headers read elsewhere (the Hub reader).

Nothing here imports transformers, runs remote code, unpickles (``*.bin`` / ``*.pt`` files are never
opened) or touches the network. Units: parameter and element counts are plain integers; sizes are bytes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramlab.core.checks import SetupError
from vramlab.core.families.registry import LLAMA, TEXT_DEFAULTS
from vramlab.core.sources.files import (
    HEADER_FLOAT_DTYPES,
    MAX_INDEX_BYTES,
    SafetensorsIndex,
    TensorInfo,
    is_count,
    load_config_json,
    load_processor_files,
    parse_json_object,
    read_safetensors_header,
    read_safetensors_index,
    read_small_file,
)
from vramlab.core.sources.hf_config import (
    NO_DTYPE,
    hf_config_to_spec,
    imports_transformers,
    read_model_type,
)
from vramlab.core.sources.remote_code import RemoteCodeError, spec_from_headers
from vramlab.core.sources.text_readers import LLAMA_KEYS, Reader, common
from vramlab.core.spec.model import ModelSpec


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
                raw = read_small_file(bin_index, MAX_INDEX_BYTES, "an index")
                total = parse_json_object(raw, bin_index, "index").get("metadata", {}).get("total_size")
            except (SetupError, AttributeError):
                total = None
            if is_count(total):
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
    :func:`~vramlab.core.sources.remote_code.spec_from_headers`), or the refusal when there are none to count."""
    reason = str(error).removeprefix(f"{config_path}: ").split("; a model folder")[0]
    weights = _read_weights(folder, warnings)
    quantized = _quantization_from_config(cfg, warnings)
    if weights is not None:
        quantized = quantized or _quantization_from_tensors(weights.tensors)
    if weights is None or quantized:
        what = f"pre-quantized ({quantized}) weights" if weights is not None else "no safetensors to count"
        raise RemoteCodeError(f"{config_path}: {reason}; the folder has {what}, so there is no exact "
                              "count either") from error
    model_type = read_model_type(cfg, str(config_path), "")
    reader = Reader(cfg, source=str(config_path), prefix="", family=model_type,
                    defaults={k: v for k, v in TEXT_DEFAULTS[LLAMA].items() if k not in LLAMA_KEYS}, nested=False)
    try:
        kwargs = {**common(reader), "activation": reader.activation("hidden_act")}
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
    floats = {d: n for d, n in dtype_counts.items() if d in HEADER_FLOAT_DTYPES}
    if floats:
        spec = dataclasses.replace(spec, checkpoint_dtype=HEADER_FLOAT_DTYPES[max(floats, key=lambda d: floats[d])])
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
        commit = read_small_file(ref, 256, "a refs/main file").decode("ascii", "replace").strip()
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


def import_is_slow(path: str | Path) -> bool:
    """Whether importing ``path`` (a config.json or a model folder) builds its model in transformers first
    (a traced architecture met for the first time: seconds). False for anything unreadable: the import
    itself then says why, at once."""
    p = Path(path).expanduser()
    config_path = p / "config.json" if p.is_dir() else p
    if config_path.name != "config.json" and not config_path.name.endswith(".json"):
        return False
    try:
        return imports_transformers(load_config_json(config_path))
    except (SetupError, OSError):
        return False


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
        spec, spec_warnings = hf_config_to_spec(cfg, id=_slug(name), name=name, source=str(config_path),
                                                processor=processor_files(base, warnings) if by_folder else "")
    except RemoteCodeError as e:
        if folder is None:
            raise
        return _remote_code_model(cfg, folder, config_path, name, e, warnings)
    warnings.extend(spec_warnings)
    quantized = _quantization_from_config(cfg, warnings)
    weights = _read_weights(folder, warnings) if folder is not None else None
    return _imported(cfg, spec, weights, quantized, str(folder or config_path), warnings)


def processor_files(folder: Path, warnings: list[str]) -> str:
    """The folder's processor files (:func:`load_processor_files`); one that cannot be read is left out with a
    warning (the model is still imported: the files matter only where a processor class counts the images)."""
    try:
        return load_processor_files(folder)
    except SetupError as e:
        warnings.append(f"{e}: the processor files are not read")
        return ""


def import_from_parts(cfg: Mapping[str, Any], *, name: str, source_path: str, config_source: str,
                      shard_headers: Iterable[Mapping[str, TensorInfo]] | None,
                      index: SafetensorsIndex | None = None, warnings: Iterable[str] = (),
                      processor: str = "") -> ImportedModel:
    """Import a model whose ``config.json`` and safetensors headers were read elsewhere (the Hub reader reads
    them over HTTP ranges): the same mapping and checks as :func:`load_model_source` on a folder.
    ``shard_headers`` is one validated header per weight file (see :func:`parse_safetensors_header`), or
    ``None`` when the model has no safetensors (the count then comes from the config only). ``processor``: its
    processor files where they are at hand (:func:`load_processor_files`)."""
    out = list(warnings)
    spec, spec_warnings = hf_config_to_spec(cfg, id=_slug(name), name=name, source=config_source, processor=processor)
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

    floats = {d: n for d, n in dtype_counts.items() if d in HEADER_FLOAT_DTYPES}
    if floats and not quantized:
        stored = HEADER_FLOAT_DTYPES[max(floats, key=lambda d: floats[d])]
        if NO_DTYPE in warnings:
            warnings[warnings.index(NO_DTYPE)] = ("config.json names no torch_dtype: checkpoint dtype taken "
                                                   f"from the safetensors ({stored.value})")
        elif stored is not spec.checkpoint_dtype:
            warnings.append(f"config.json says {spec.checkpoint_dtype.value} but the safetensors are mostly "
                            f"{stored.value}: checkpoint dtype taken as {stored.value}")
        spec = dataclasses.replace(spec, checkpoint_dtype=stored)

    multimodal = "text_config" in cfg or any(k in cfg for k in ("vision_config", "audio_config"))
    multimodal = multimodal and spec.vision is None  # a modelled vision tower is counted with the rest
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
