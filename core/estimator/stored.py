"""Traced tapes as data: what :mod:`vramlab.core.measure.trace` derives from transformers' own classes,
kept in memory and on disk without torch (the estimator-only build can read them, never write them).

A :class:`TracedTape` is the same tape the hand-written program writes (:class:`~.tape.Tape`: every
allocation, free and reclassification of the step as a polynomial in batch, sequence and rank, with
repeated layers as blocks), plus what the trace learned beside it: the parameter counts, which sizes are
symbolic, how it was obtained (``mode``) and why.

On disk a tape is one ``.tape`` file: a magic line, a CRC-32 of the rest, a JSON header, then plain
little-endian integer and float64 arrays that the header lists by name, type, shape and place (read with
``numpy.frombuffer``: nothing in it is code, and reading it costs one file read). Beside the tape's
columns it keeps the tape's evaluation plan (:class:`~.tape.Tape`'s tabulated structure, tens of
milliseconds to build), so that the first estimate after a restart costs what later ones cost. The plan
is kept with a digest of the code that builds it (:func:`plan_digest`): a plan from other code is
dropped and built again; the tape itself is keyed as before. Written atomically. A file that cannot be
read, is not one of ours, is damaged or was written for another key is a miss, never an error.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .poly import N
from .tape import Tape, _Plan

FORMAT = 3  # bumped when the file layout or the meaning of a field changes (3: one raw file with the plan)
SUFFIX = ".tape"
MAGIC = b"VRAM Lab traced tape\n"
_ARRAYS = ("coef", "sign", "kind", "new_kind", "tag", "phase", "ref")
_DTYPES = {np.dtype(t).str: np.dtype(t) for t in ("<i1", "<i2", "<i4", "<i8", "<f8")}
_PLAN = "plan."  # the plan's arrays are kept under this prefix
_PLAN_ARRAYS = tuple(f.name for f in dataclasses.fields(_Plan) if f.name != "bound_rounding")

# how a tape was obtained
FITTED = "fitted"  # sizes fitted as polynomials in the symbolic sizes and verified at a further point
SEQUENCE_FIXED = "sequence fixed"  # the step changes form with sequence length: a tape for this length only
DIRECT = "direct simulation"  # the full-depth model traced at exactly this point


@dataclass(frozen=True, eq=False)
class TracedTape:
    """One traced step (see the module docstring). Rows: ``sign`` +1 allocate, -1 free, 0 reclassify
    (``kind`` -> ``new_kind``); ``ref`` is the allocation a row belongs to (-1: a phase mark); ``tag``
    names the repeated block a row is in (-1: none), repeated ``multiplicity[tag]`` times."""

    coef: np.ndarray  # (n, monomials) int64
    sign: np.ndarray
    kind: np.ndarray
    new_kind: np.ndarray
    tag: np.ndarray
    phase: np.ndarray
    ref: np.ndarray
    phases: tuple[str, ...]
    multiplicity: dict[int, int]
    symbolic: tuple[bool, bool, bool]
    total_params: int
    trainable_base: int  # trainable parameters: base + per_rank x LoRA rank
    trainable_per_rank: int
    mode: str = FITTED
    note: str = ""  # why the mode is not FITTED; what was verified
    transformers_version: str = ""
    seconds: float = 0.0  # how long the trace took
    meta: dict = field(default_factory=dict)
    plan: _Plan | None = field(default=None, repr=False)  # the tape's evaluation plan, when read from a file

    def trainable(self, rank: int) -> int:
        return self.trainable_base + self.trainable_per_rank * rank

    @functools.cached_property
    def tape(self) -> Tape:
        return Tape.from_arrays(self.coef, self.sign, self.kind, self.new_kind, self.tag, self.phase,
                                list(self.phases), dict(self.multiplicity), plan=self.plan)

    @functools.cached_property
    def full_tape(self) -> Tape | None:
        """The tape with every allocation numbered, for the allocator replay; None when it has repeated
        blocks (which of a block's repetitions frees a tensor allocated in another, or in the one before,
        is not recorded: the reserved level then comes from the fast model, and says so)."""
        if self.multiplicity and (self.tag >= 0).any():
            return None
        hids = np.where((self.ref >= 0) & (self.sign != 0), self.ref + 1, 0)
        return Tape.from_arrays(self.coef, self.sign, self.kind, self.new_kind, np.full_like(self.tag, -1),
                                self.phase, list(self.phases), {}, hids)

    @property
    def full_length(self) -> int:
        return int(sum(self.multiplicity.get(int(t), 1) if t >= 0 else 1 for t in self.tag))

    # ---- files ------------------------------------------------------------------------------------------
    def header(self, key: str) -> dict:
        return {"format": FORMAT, "key": key, "phases": list(self.phases),
                "multiplicity": {str(k): v for k, v in self.multiplicity.items()},
                "symbolic": list(self.symbolic), "total_params": self.total_params,
                "trainable_base": self.trainable_base, "trainable_per_rank": self.trainable_per_rank,
                "mode": self.mode, "note": self.note, "transformers_version": self.transformers_version,
                "seconds": self.seconds, "meta": self.meta}

    def to_bytes(self, key: str) -> bytes:
        """The file: :data:`MAGIC`, the header's length and the CRC-32 of everything after the CRC (8 bytes
        each, little-endian), the JSON header (padded to 8 bytes), the arrays. The tape's rows keep an index
        into its distinct size polynomials; every array is stored in the narrowest integer type that holds
        it (the header says which type it is read back as), the arrays of one such pair of types one after
        another (one read each). The evaluation plan is built here if it was not yet (the tape of a new
        trace: once, when it is stored)."""
        n = len(self.sign)
        distinct, index = np.unique(np.asarray(self.coef, dtype=np.int64).reshape(n, N), axis=0,
                                    return_inverse=True)
        arrays = {"sizes": distinct, "size_of": index.reshape(-1),
                  **{name: np.asarray(getattr(self, name), dtype=np.int64) for name in _ARRAYS[1:]}}
        header = self.header(key)
        if n:
            plan = self.tape.plan()
            kept = {_PLAN + name: getattr(plan, name) for name in _PLAN_ARRAYS}
            if all(isinstance(a, np.ndarray) and a.dtype.str in _DTYPES for a in kept.values()):
                header["plan"] = {"digest": plan_digest(), "bound_rounding": plan.bound_rounding}
                arrays.update(kept)
        # arrays of one stored type and one type read back are written one after another: one read per group
        groups: dict[tuple[str, str], list[tuple[str, np.ndarray]]] = {}
        for name, a in arrays.items():
            stored = _narrowest(a)
            groups.setdefault((stored.dtype.str, a.dtype.str), []).append((name, stored))
        listing, group_list, offset, parts = [], [], 0, []
        for g, ((stored_type, dtype), members) in enumerate(groups.items()):
            start = 0
            for name, a in members:
                listing.append([name, g, start, list(a.shape)])
                start += a.size
            data = b"".join(a.tobytes() for _name, a in members)
            group_list.append([stored_type, dtype, offset, start])
            parts.extend((data, bytes(-len(data) % 8)))
            offset += len(data) + (-len(data) % 8)
        header["groups"] = group_list
        body = b"".join(parts)
        header["arrays"] = listing
        text = json.dumps(header, sort_keys=True).encode()
        text += b" " * (-(len(MAGIC) + 16 + len(text)) % 8)
        return MAGIC + len(text).to_bytes(8, "little") + zlib.crc32(text + body).to_bytes(8, "little") + text + body

    @classmethod
    def from_bytes(cls, data: bytes, key: str) -> TracedTape | None:
        """The tape in ``data``, or None when it is not an intact tape of this format written for ``key``."""
        try:
            if not data.startswith(MAGIC):
                return None
            start = len(MAGIC) + 16
            length = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
            if zlib.crc32(memoryview(data)[start:]) != int.from_bytes(data[len(MAGIC) + 8:start], "little"):
                return None  # damaged (the header or the arrays) or cut short
            header = json.loads(data[start:start + length])
            if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key:
                return None
            body = memoryview(data)[start + length:]
            groups = []
            for stored, dtype, offset, count in header["groups"]:
                if stored not in _DTYPES or dtype not in _DTYPES or offset < 0 or count < 0 or \
                        offset + _DTYPES[stored].itemsize * count > len(body):
                    return None
                g = np.frombuffer(body, dtype=_DTYPES[stored], count=count, offset=offset)
                groups.append(g if stored == dtype else g.astype(_DTYPES[dtype]))
            arrays = {}
            for name, g, start, shape in header["arrays"]:
                size = math.prod(shape)
                if not 0 <= g < len(groups) or start < 0 or min(shape, default=0) < 0 or \
                        start + size > len(groups[g]):
                    return None
                arrays[name] = groups[g][start:start + size].reshape(shape)
            sizes, size_of = arrays["sizes"], arrays["size_of"]
            n = len(size_of)
            if sizes.shape[1:] != (N,) or any(arrays[k].shape != (n,) for k in _ARRAYS[1:]) or \
                    any(arrays[k].dtype != np.int64 for k in ("sizes", "size_of", *_ARRAYS[1:])) or \
                    (n and not 0 <= int(size_of.min()) <= int(size_of.max()) < len(sizes)):
                return None
            phases = tuple(str(p) for p in header["phases"])
            if n and not (0 <= int(arrays["phase"].min()) and int(arrays["phase"].max()) < len(phases)):
                return None
            mult = {int(k): int(v) for k, v in header["multiplicity"].items()}
            if any(v < 1 for v in mult.values()):
                return None
            plan, kept = None, header.get("plan")
            if kept and kept.get("digest") == plan_digest():
                plan = _Plan(**{name: arrays[_PLAN + name] for name in _PLAN_ARRAYS},
                             bound_rounding=float(kept["bound_rounding"]))
            return cls(sizes[size_of], *(arrays[k] for k in _ARRAYS[1:]), phases, mult,
                       tuple(bool(x) for x in header["symbolic"]), int(header["total_params"]),
                       int(header["trainable_base"]), int(header["trainable_per_rank"]), str(header["mode"]),
                       str(header["note"]), str(header["transformers_version"]), float(header["seconds"]),
                       dict(header.get("meta") or {}), plan)
        except (KeyError, TypeError, ValueError, AttributeError, UnicodeDecodeError):
            return None


def _narrowest(a: np.ndarray) -> np.ndarray:
    """``a`` little-endian, as the narrowest of int8 / int16 / int32 that holds it exactly (else as it is)."""
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    if a.size and (a.dtype.kind == "i" or (a.dtype.kind == "f" and np.array_equal(a, np.round(a)))):
        lo, hi = float(a.min()), float(a.max())
        for t in ("<i1", "<i2", "<i4"):
            info = np.iinfo(t)
            if info.min <= lo and hi <= info.max:
                return a.astype(t)
    return a


@functools.cache
def plan_digest() -> str:
    """A digest of the code that builds a tape's evaluation plan (the bytecode, names and constants of
    :meth:`.Tape.plan` and what it calls there, nested functions included, and the plan's fields): a kept
    plan is used only by the code that built it."""
    h = hashlib.sha256(repr([f.name for f in dataclasses.fields(_Plan)]).encode())
    todo = [Tape.plan.__code__, Tape._build_plan.__code__, _Plan.with_tables.__code__]
    while todo:
        code = todo.pop()
        h.update(code.co_code + repr(code.co_names).encode())
        for c in code.co_consts:
            if isinstance(c, type(code)):
                todo.append(c)
            else:  # a frozenset's order varies with string hashing between processes
                h.update(repr(sorted(map(repr, c)) if isinstance(c, frozenset) else c).encode())
    return h.hexdigest()


def cache_dir() -> Path:
    """Where traced tapes are kept: ``VRAMLAB_CACHE_DIR``, else the platform's user cache folder."""
    override = os.environ.get("VRAMLAB_CACHE_DIR")
    if override:
        return Path(override)
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "VRAM Lab" / "cache" / "traces"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "VRAM Lab" / "traces"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vramlab" / "traces"


def key_digest(key: object) -> str:
    """A file name for a key: the SHA-256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class TraceStore:
    """Traced tapes by key: in memory (least recently used first out), then on disk."""

    def __init__(self, folder: Path | None = None, size: int = 64) -> None:
        self._folder = folder
        self.size = size
        self._d: OrderedDict[str, TracedTape] = OrderedDict()
        self._lock = threading.Lock()
        self.disk_hits = 0

    @property
    def folder(self) -> Path:
        return self._folder or cache_dir()

    def get(self, key: str) -> TracedTape | None:
        with self._lock:
            rec = self._d.get(key)
            if rec is not None:
                self._d.move_to_end(key)
                return rec
        path = self.folder / f"{key}{SUFFIX}"
        try:
            data = path.read_bytes()
        except OSError:
            return None
        rec = TracedTape.from_bytes(data, key)
        if rec is not None:
            self.disk_hits += 1
            self._remember(key, rec)
        return rec

    def put(self, key: str, rec: TracedTape) -> None:
        """Keep ``rec``; a disk that refuses the write (full, read-only) leaves it in memory only."""
        self._remember(key, rec)
        from ..fileio import write_atomic

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / f"{key}{SUFFIX}", rec.to_bytes(key))
        except OSError:
            pass

    def forget_memory(self) -> None:
        with self._lock:
            self._d.clear()

    def _remember(self, key: str, rec: TracedTape) -> None:
        with self._lock:
            self._d[key] = rec
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)
