"""Traced tapes as data: what :mod:`vramlab.core.measure.trace` derives from transformers' own classes,
kept in memory and on disk without torch (the estimator-only build can read them, never write them).

A :class:`TracedTape` is the same tape the hand-written program writes (:class:`~.tape.Tape`: every
allocation, free and reclassification of the step as a polynomial in batch, sequence and rank, with
repeated layers as blocks), plus what the trace learned beside it: the parameter counts, which sizes are
symbolic, how it was obtained (``mode``) and why.

On disk a tape is one ``.npz`` file of plain integer arrays and a JSON header (``numpy.load`` with
``allow_pickle=False``: nothing in it is code), written atomically. A file that cannot be read, is not
one of ours, or was written for another key is a miss, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import sys
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .poly import N, Poly
from .tape import Tape

FORMAT = 2  # bumped when the file layout or the meaning of a field changes
_ARRAYS = ("coef", "sign", "kind", "new_kind", "tag", "phase", "ref")

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

    def trainable(self, rank: int) -> int:
        return self.trainable_base + self.trainable_per_rank * rank

    @functools.cached_property
    def tape(self) -> Tape:
        rows = [(Poly(tuple(int(x) for x in c)), int(s), int(k), int(nk), int(t), int(p))
                for c, s, k, nk, t, p in zip(self.coef.tolist(), self.sign, self.kind, self.new_kind, self.tag,
                                             self.phase)]
        return Tape(rows, list(self.phases), dict(self.multiplicity))

    @functools.cached_property
    def full_tape(self) -> Tape | None:
        """The tape with every allocation numbered, for the allocator replay; None when it has repeated
        blocks (which of a block's repetitions frees a tensor allocated in another, or in the one before,
        is not recorded: the reserved level then comes from the fast model, and says so)."""
        if self.multiplicity and (self.tag >= 0).any():
            return None
        rows = [(Poly(tuple(int(x) for x in c)), int(s), int(k), int(nk), -1, int(p))
                for c, s, k, nk, p in zip(self.coef.tolist(), self.sign, self.kind, self.new_kind, self.phase)]
        hids = [int(r) + 1 if r >= 0 and s != 0 else 0 for r, s in zip(self.ref, self.sign)]
        return Tape(rows, list(self.phases), {}, hids)

    @property
    def full_length(self) -> int:
        return int(sum(self.multiplicity.get(int(t), 1) if t >= 0 else 1 for t in self.tag))

    # ---- files ------------------------------------------------------------------------------------
    def header(self, key: str) -> dict:
        return {"format": FORMAT, "key": key, "phases": list(self.phases),
                "multiplicity": {str(k): v for k, v in self.multiplicity.items()},
                "symbolic": list(self.symbolic), "total_params": self.total_params,
                "trainable_base": self.trainable_base, "trainable_per_rank": self.trainable_per_rank,
                "mode": self.mode, "note": self.note, "transformers_version": self.transformers_version,
                "seconds": self.seconds, "meta": self.meta}

    def to_bytes(self, key: str) -> bytes:
        buf = io.BytesIO()
        header = np.frombuffer(json.dumps(self.header(key), sort_keys=True).encode(), dtype=np.uint8)
        np.savez(buf, header=header, **{name: np.asarray(getattr(self, name), dtype=np.int64) for name in _ARRAYS})
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, key: str) -> TracedTape | None:
        """The tape in ``data``, or None when it is not a tape of this format written for ``key``."""
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                header = json.loads(z["header"].tobytes().decode())
                arrays = {name: np.asarray(z[name]) for name in _ARRAYS}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError):
            return None
        try:
            if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key:
                return None
            n = len(arrays["sign"])
            if arrays["coef"].shape != (n, N) or any(a.shape != (n,) for k, a in arrays.items() if k != "coef") \
                    or any(a.dtype != np.int64 for a in arrays.values()):
                return None
            phases = tuple(str(p) for p in header["phases"])
            if n and not (0 <= int(arrays["phase"].min()) and int(arrays["phase"].max()) < len(phases)):
                return None
            mult = {int(k): int(v) for k, v in header["multiplicity"].items()}
            if any(v < 1 for v in mult.values()):
                return None
            return cls(arrays["coef"], arrays["sign"], arrays["kind"], arrays["new_kind"], arrays["tag"],
                       arrays["phase"], arrays["ref"], phases, mult,
                       tuple(bool(x) for x in header["symbolic"]), int(header["total_params"]),
                       int(header["trainable_base"]), int(header["trainable_per_rank"]), str(header["mode"]),
                       str(header["note"]), str(header["transformers_version"]), float(header["seconds"]),
                       dict(header.get("meta") or {}))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


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
        path = self.folder / f"{key}.npz"
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
            write_atomic(self.folder / f"{key}.npz", rec.to_bytes(key))
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
