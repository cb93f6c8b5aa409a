"""Traced tapes as data: what :mod:`vramlab.core.tracing.trace` derives from transformers' own classes,
kept in memory and on disk without torch (the estimator-only build can read them, never write them).

A :class:`TracedTape` is the same tape the hand-written program writes (:class:`~.tape.Tape`: every
allocation, free and reclassification of the step as a polynomial in batch, sequence and rank, with
repeated layers as blocks), plus what the trace learned beside it: the parameter counts, which sizes are
symbolic, how it was obtained (``mode``) and why.

On disk a tape is one ``.tape`` file in two parts, each with its own CRC-32 (:meth:`TracedTape.to_bytes`):
the first holds a JSON header and the tape's single-point plan (:class:`~.tape.PointPlan`, what one estimate
reads), the rest its columns and its full evaluation plan (:class:`~.tape.Tape`'s tabulated structure, tens
of milliseconds to build, which many points at once read); plain little-endian integer and float64 arrays that
the header lists by name, type, shape and place (read with ``numpy.frombuffer``: nothing in it is code). The
first estimate after a restart reads and checks the first part only (:func:`_read`); the rest is read, checked
and decoded when first needed (:class:`_FileTape`), and a rest found damaged then is refused with a message
and its file removed, so that the tape is traced again. The plans are kept with a digest of the code that
builds them (:func:`plan_digest`): plans from other code are dropped and built again; the tape itself is keyed
as before. Written atomically. A file that cannot be read, is not one of ours, has a damaged first part or was
written for another key is a miss, never an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vramlab.core.cache import cache_dir
from vramlab.core.checks import SetupError
from vramlab.core.estimator.poly import N
from vramlab.core.estimator.tape import PLAN_TABLES, K, Plan, PointPlan, Tape

FORMAT = 5  # bumped when the file layout or the meaning of a field changes (3: one raw file with the plan; 4: the
# single-point plan kept too, apart from the rest, which is decoded when first needed; 5: that plan's segments as
# stretches of its candidate rows, its indices read as Python lists)
SUFFIX = ".tape"
MAGIC = b"VRAM Lab traced tape\n"
_ARRAYS = ("coef", "sign", "kind", "new_kind", "tag", "phase", "ref")
_DTYPES = {np.dtype(t).str: np.dtype(t) for t in ("<i1", "<i2", "<i4", "<i8", "<f8")}
_PLAN = "plan."  # the plan's arrays are kept under this prefix
_PLAN_ARRAYS = tuple(f.name for f in dataclasses.fields(Plan) if f.name != "bound_rounding")
_POINT = "point."  # the single-point plan's own arrays under this one

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
    plan: Plan | None = field(default=None, repr=False)  # the tape's evaluation plan, when read from a file

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
        """The file: :data:`MAGIC`; the header's length, the first part's length (the header and the
        single-point plan's arrays), the first part's CRC-32 and the rest's (8 bytes each, little-endian); the
        JSON header (padded to 8 bytes); the arrays. The tape's rows keep an index
        into its distinct size polynomials; every array is stored in a narrow integer type that holds it (the
        header says which type it is read back as), arrays of one pair of types one after another (one
        conversion each): the single-point plan (:class:`~.tape.PointPlan`, what the first estimate reads)
        in three such groups, its tables, its counts and indices, and its sizes, then where the rest's arrays are
        (JSON text; the header says where it lies), then the columns and the full plan. The evaluation plan is
        built here if it was not yet (the tape of a new trace: once, when it is stored)."""
        n = len(self.sign)
        distinct, index = np.unique(np.asarray(self.coef, dtype=np.int64).reshape(n, N), axis=0,
                                    return_inverse=True)
        rest = {"sizes": distinct, "size_of": index.reshape(-1),
                **{name: np.asarray(getattr(self, name), dtype=np.int64) for name in _ARRAYS[1:]}}
        parts: list[tuple[bool, bool, list[tuple[str, np.ndarray]]]] = []  # (of the rest?, read as stored?, arrays)
        header = self.header(key)
        if n:
            plan = self.tape.plan()
            pp = plan.point
            shared = [name for name in _POINT_SHARED if getattr(pp, name) is getattr(plan, name)]
            kept = {_PLAN + name: getattr(plan, name) for name in _PLAN_ARRAYS if name not in shared}
            # read back as float64 (the matrix products), or as stored (the counts and indices, of which a point
            # reads a few rows: views of the file's bytes, nothing converted)
            point = [(False, [(_POINT + name, np.asarray(getattr(pp, name), dtype=np.float64))
                              for name in _POINT_TABLES]),
                     (True, [(_POINT + name, np.asarray(getattr(pp, name), dtype=np.float64))
                             for name in _POINT_COUNTS]),
                     (True, [(_POINT + name, np.asarray(getattr(pp, name), dtype=np.int64))
                             for name in _POINT_INDICES]),
                     (False, [(_POINT + "sizes", pp.sizes)])]
            if all(isinstance(a, np.ndarray) and a.dtype.str in _DTYPES
                   for a in (*kept.values(), *(a for _as_stored, group in point for _name, a in group))):
                header["plan"] = {"digest": plan_digest(), "bound_rounding": plan.bound_rounding, "shared": shared,
                                  "point": {"bound": list(pp.bound), "used": list(pp.used),
                                            "bound_rounding": pp.bound_rounding, "blocks": pp.blocks}}
                parts.extend((False, as_stored, members) for as_stored, members in point)
                rest.update(kept)
        parts.extend((True, False, [(name, a)]) for name, a in rest.items())
        groups: dict[tuple[bool, str, str], list[tuple[str, np.ndarray]]] = {}
        for of_rest, as_stored, members in parts:
            stored = _narrow_type([a for _name, a in members])
            for name, a in members:
                read = stored if as_stored else a.dtype
                groups.setdefault((of_rest, stored.str, read.str), []).append((name, a.astype(stored)))
        listing, rest_listing = {}, {}
        for g, ((of_rest, _stored, _dtype), members) in enumerate(groups.items()):
            start = 0
            for name, a in members:
                (rest_listing if of_rest else listing)[name] = [g, start, list(a.shape)]
                start += a.size
        # the rest's listing as JSON text of its own at the end of the first part, parsed when the rest is first
        # read (inside the header it was a string of escaped quotes, a tenth of the first look-up's instructions)
        rest_text = json.dumps(rest_listing, separators=(",", ":")).encode()
        group_list, offset, chunks, first = [], 0, [], None
        for (of_rest, stored_type, dtype), members in groups.items():
            if of_rest and first is None:  # the single-point plan's groups come first
                header["rest_arrays"] = [offset, len(rest_text)]
                chunks.extend((rest_text, bytes(-len(rest_text) % 8)))
                offset += len(rest_text) + (-len(rest_text) % 8)
                first = offset
            data = b"".join(a.tobytes() for _name, a in members)
            group_list.append([stored_type, dtype, offset, sum(a.size for _name, a in members)])
            chunks.extend((data, bytes(-len(data) % 8)))
            offset += len(data) + (-len(data) % 8)
        header["groups"] = group_list
        header["arrays"] = listing
        header["repeated"] = bool(self.multiplicity and (np.asarray(self.tag) >= 0).any())  # full_tape is None
        text = json.dumps(header, sort_keys=True).encode()
        text += b" " * (-(_PREAMBLE + len(text)) % 8)
        body = b"".join(chunks)
        head, rest_part = text + body[:first], body[first:]
        return MAGIC + struct.pack("<4Q", len(text), len(head), zlib.crc32(head), zlib.crc32(rest_part)) + head + \
            rest_part

    @classmethod
    def from_bytes(cls, data: bytes, key: str) -> TracedTape | None:
        """The tape in ``data`` (a whole file), or None when it is not an intact tape of this format written for
        ``key`` (see :func:`_parse`)."""
        view = memoryview(data)
        first = _first_length(data[:_PREAMBLE])
        if first is None:
            return None
        return _parse(data[:_PREAMBLE], view[_PREAMBLE:_PREAMBLE + first], key, lambda: view[_PREAMBLE + first:])


_PREAMBLE = len(MAGIC) + 32  # the magic line, then four little-endian 8-byte numbers (see TracedTape.to_bytes)


def _first_length(preamble: bytes) -> int | None:
    """The length of the file's first part, from its preamble (None: not one of our files)."""
    if len(preamble) != _PREAMBLE or not preamble.startswith(MAGIC):
        return None
    return struct.unpack_from("<4Q", preamble, len(MAGIC))[1]


def _parse(preamble: bytes, first: memoryview | bytes, key: str, rest: Callable[[], memoryview | bytes],
           on_damage: Callable[[], None] | None = None) -> TracedTape | None:
    """The tape in a file's first part (its preamble, then ``first``: the header and the single-point plan),
    ``rest()`` reading the remainder when it is first needed; None when the first part is not intact, not of
    this format or not written for ``key``. The first part's checksum is checked here and, when the plans were
    kept by this code, only the single-point plan is decoded (every index in it checked): the rest (the columns
    and the full plan) is read, checked against its own checksum and decoded when first asked for
    (:class:`_FileTape`; damaged then: ``on_damage()``, and an error that says so)."""
    try:
        length, first_length, first_crc, rest_crc = struct.unpack_from("<4Q", preamble, len(MAGIC))
        if len(first) != first_length or zlib.crc32(first) != first_crc:
            return None  # damaged (the header or the single-point plan) or cut short
        header = json.loads(bytes(first[:length]))
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key:
            return None
        arrays = _Arrays(first[length:], header, rest, rest_crc)
        scalars = (tuple(str(p) for p in header["phases"]),
                   {int(k): int(v) for k, v in header["multiplicity"].items()},
                   tuple(bool(x) for x in header["symbolic"]), int(header["total_params"]),
                   int(header["trainable_base"]), int(header["trainable_per_rank"]), str(header["mode"]),
                   str(header["note"]), str(header["transformers_version"]), float(header["seconds"]),
                   dict(header.get("meta") or {}))
        if any(v < 1 for v in scalars[1].values()):
            return None
        kept = header.get("plan")
        if kept and kept.get("digest") == plan_digest():
            point = _read_point(kept["point"], arrays, len(dict.fromkeys(scalars[0])))
            if point is None:
                return None
            return _FileTape.of(scalars, point, arrays, kept, bool(header["repeated"]), on_damage)
        columns = arrays.columns(len(scalars[0]))  # no plan kept, or by other code: built on first use
        return None if columns is None else TracedTape(*columns, *scalars)
    except (KeyError, TypeError, ValueError, AttributeError, UnicodeDecodeError, IndexError, struct.error):
        return None


def _read(path: str, key: str, on_damage: Callable[[], None]) -> TracedTape | None:
    """The tape in the file at ``path`` (None: none there, or not an intact one for ``key``): its first part
    read now, the rest when it is first needed (see :func:`_parse`)."""
    with open(path, "rb", buffering=0) as f:
        preamble = f.read(_PREAMBLE)
        first = _first_length(preamble)
        if first is None:
            return None
        data = f.read(first)

    def rest() -> bytes:
        with open(path, "rb", buffering=0) as f:
            f.seek(_PREAMBLE + first)
            return f.read()

    return _parse(preamble, memoryview(data), key, rest, on_damage)  # (a slice of bytes would copy them)


class _Damaged(ValueError):
    """The rest of a tape file, read when first needed, is not as its checksum says (or is gone)."""


_LAZY_FIELDS = ("coef", *_ARRAYS[1:], "plan")  # what a tape read from a file decodes when first asked for
_SCALAR_FIELDS = tuple(f.name for f in dataclasses.fields(TracedTape) if f.name not in _LAZY_FIELDS)
# the single-point plan's arrays: its tables (float64), its counts and its indices (whole numbers, read as
# stored; lists in the plan from segment_key to key_segments) and ``sizes`` (float64); of these, the full plan's
# own arrays (there in float64 or int64) are stored once
_POINT_TABLES = ("head", "value", "kind_bytes", "block_kinds")
_POINT_COUNTS = ("kinds",)
_POINT_INDICES = ("pair_size", "segment_end", "moments", "segment_key", "key_start", "key_segments", "block_of",
                  "ends_block")
_POINT_SHARED = ("kinds", "pair_size")
_F8 = np.dtype(np.float64)


class _Arrays:
    """A tape file's arrays (see :meth:`TracedTape.to_bytes`), each group decoded when one of its arrays is
    first asked for, and each array checked against its group and the file then (ValueError: it is not
    inside). ``first``: the arrays in the file's first part; the groups after it are in ``rest()``, read and
    checked against ``rest_crc`` when the first of them is asked for (:class:`_Damaged`: not intact)."""

    def __init__(self, first: memoryview | bytes, header: dict, rest: Callable[[], memoryview | bytes],
                 rest_crc: int) -> None:
        self._first = first
        self._rest: memoryview | bytes | None = None
        self._read_rest, self._rest_crc = rest, rest_crc
        self._groups: list = header["groups"]
        self._listing: dict = header["arrays"]
        self._rest_listing: list | None = header["rest_arrays"]  # [offset, length] of its JSON text in ``first``
        self._decoded: dict[int, np.ndarray] = {}
        self.lock = threading.RLock()  # the columns and the whole tape are decoded under it

    def _body(self, offset: int) -> tuple[memoryview | bytes, int]:
        """The bytes a group at ``offset`` (from the end of the header) is in, and its offset there."""
        if offset < len(self._first):
            return self._first, offset
        if self._rest is None:
            try:
                rest = self._read_rest()
            except OSError as e:
                raise _Damaged(f"the rest of the file cannot be read ({e})") from e
            if zlib.crc32(rest) != self._rest_crc:
                raise _Damaged("the rest of the file does not match its checksum")
            self._rest = rest
        return self._rest, offset - len(self._first)

    def _where(self, name: str) -> list:
        """Where an array is: its group, its start in the group, its shape."""
        if name not in self._listing and self._rest_listing is not None:
            at, length = self._rest_listing
            if not 0 <= at <= at + length <= len(self._first):
                raise ValueError("the listing of the file's rest is not inside its first part")
            self._listing = {**self._listing, **json.loads(bytes(self._first[at:at + length]))}
            self._rest_listing = None
        return self._listing[name]

    def __getitem__(self, name: str) -> np.ndarray:
        g, start, shape = self._where(name)
        group = self._group(g)
        size = math.prod(shape)
        if start < 0 or min(shape, default=0) < 0 or start + size > len(group):
            raise ValueError(f"array {name} is not inside its group")
        return group[start:start + size].reshape(shape)

    def _group(self, g: int) -> np.ndarray:
        """Group ``g`` decoded (once)."""
        group = self._decoded.get(g)
        if group is None:
            stored, dtype, offset, count = self._groups[g]
            if stored not in _DTYPES or dtype not in _DTYPES or offset < 0 or count < 0:
                raise ValueError(f"array group {g} is not one of ours")
            body, at = self._body(offset)
            if at + _DTYPES[stored].itemsize * count > len(body):
                raise ValueError(f"array group {g} is not inside the file")
            group = np.frombuffer(body, dtype=_DTYPES[stored], count=count, offset=at)
            if stored != dtype:
                group = group.astype(_DTYPES[dtype])
            self._decoded[g] = group
        return group

    def shape(self, name: str) -> list:
        """The shape an array is listed with (not read)."""
        return self._where(name)[2]

    def run(self, names: list[str]) -> np.ndarray | None:
        """The arrays ``names`` as one flat stretch of their group, when they lie end to end there in this order
        (None: they do not, or the group does not hold them)."""
        g0, start0, _shape = self._listing[names[0]]
        at = start0
        if start0 < 0:
            return None
        for name in names:
            g, start, shape = self._listing[name]
            if g != g0 or start != at or min(shape, default=0) < 0:
                return None
            at += math.prod(shape)
        group = self._group(g0)
        return group[start0:at] if at <= len(group) else None

    def columns(self, phases: int) -> tuple[np.ndarray, ...] | None:
        """The tape's columns (``coef``, then :data:`_ARRAYS`' others), None when their indices are out of range."""
        sizes, size_of = self["sizes"], self["size_of"]
        n = len(size_of)
        if sizes.shape[1:] != (N,) or any(self[k].shape != (n,) for k in _ARRAYS[1:]) or \
                any(self[k].dtype != np.int64 for k in ("sizes", "size_of", *_ARRAYS[1:])) or \
                (n and not 0 <= int(size_of.min()) <= int(size_of.max()) < len(sizes)) or \
                (n and not (0 <= int(self["phase"].min()) and int(self["phase"].max()) < phases)):
            return None
        return (sizes[size_of], *(self[k] for k in _ARRAYS[1:]))

    def plan(self, kept: dict, point: PointPlan) -> Plan:
        """The full evaluation plan: its own arrays, and those it shares with the single-point plan."""
        shared = set(kept["shared"]) & set(_POINT_SHARED)
        return Plan(**{name: np.asarray(getattr(point, name), np.float64 if name in PLAN_TABLES else np.int64)
                        if name in shared else self[_PLAN + name] for name in _PLAN_ARRAYS},
                     bound_rounding=float(kept["bound_rounding"]))


def _read_point(kept: dict, arrays: _Arrays, keys: int) -> PointPlan | None:
    """The single-point plan kept in a file (``keys``: the tape's phase keys), None when its tables do not fit
    together or an index in them points outside what it indexes (a file is data)."""
    tables = [arrays[_POINT + name] for name in _POINT_TABLES]
    head, value, kind_bytes, block_kinds = tables
    kinds, sizes = arrays[_POINT + "kinds"], arrays[_POINT + "sizes"]
    # (a shape that does not unpack so is not ours: ValueError, a miss)
    (pairs,), (segments,), (candidates,), (segment_keys,), (key_starts,), (key_rows, most), (rows,), (ends,) = \
        [arrays.shape(_POINT + name) for name in _POINT_INDICES]
    blocks, bound, used = int(kept["blocks"]), tuple(map(float, kept["bound"])), tuple(map(bool, kept["used"]))
    if head.dtype != _F8 or value.dtype != _F8 or kind_bytes.dtype != _F8 or block_kinds.dtype != _F8 or \
            sizes.dtype != _F8 or kinds.dtype.kind not in "if" or sizes.ndim != 2:
        return None
    nsizes, monomials = sizes.shape
    if not (monomials == len(bound) == len(used) == N and head.shape == (blocks + keys, nsizes)
            and value.shape == (candidates, nsizes + blocks) and segment_keys == segments and key_starts == keys
            and key_rows == keys and most > 0 and ends == rows and kinds.shape == (rows, pairs)
            and block_kinds.shape == (blocks + 1, pairs) and kind_bytes.shape == (pairs, K)):
        return None
    # every index inside what it indexes: the indices lie end to end in one group (as written), so each one's
    # least and greatest come from two reductions over that stretch; then they are read as Python lists
    flat = arrays.run([_POINT + name for name in _POINT_INDICES])
    if flat is None:
        return None
    counts = (pairs, segments, candidates, segments, keys, keys * most, rows, rows)
    bounds = ((0, nsizes), (1, candidates + 1), (0, rows), (0, keys), (0, rows), (0, segments), (-1, blocks), (0, 2))
    starts, kept_bounds, at = [], [], 0
    for count, bound_of in zip(counts, bounds):
        if count:
            starts.append(at)
            kept_bounds.append(bound_of)
        at += count
    least, greatest = np.minimum.reduceat(flat, starts).tolist(), np.maximum.reduceat(flat, starts).tolist()
    for (lo, hi), a, b in zip(kept_bounds, least, greatest):
        if a < lo or b >= hi:
            return None
    parts, at = [], 0
    for count in counts:
        parts.append(flat[at:at + count])
        at += count
    # the few a point reads all of as Python lists; of the per-row ones, a point reads a few elements (as they are)
    pair_size, segment_end, moments, segment_key, key_start, key_segments, block_of, ends_block = parts
    segment_end, segment_key, key_start, key_segments = (a.tolist() for a in parts[1:2] + parts[3:6])
    # each segment's candidates a stretch of ``value``, the stretches end to end: ascending ends, the last C
    if segment_end != sorted(set(segment_end)) or (segment_end and segment_end[-1] != candidates):
        return None
    return PointPlan(bound=bound, bound_rounding=float(kept["bound_rounding"]), used=used, sizes=sizes, head=head,
                      blocks=blocks, value=value, segment_end=segment_end, moments=moments,
                      segment_key=segment_key, key_start=key_start,
                      key_segments=[key_segments[i:i + most] for i in range(0, keys * most, most)],
                      block_of=block_of, ends_block=ends_block, kinds=kinds, block_kinds=block_kinds,
                      pair_size=pair_size, kind_bytes=kind_bytes)


class _Decoded:
    """A column (or the plan) of a :class:`_FileTape`, decoded from the file when first asked for; then an
    attribute of its own (this descriptor sets nothing: the instance's attribute hides it)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, rec: _FileTape | None, owner: type | None = None) -> object:
        return self if rec is None else rec._decode()[self.name]


class _FileTape(TracedTape):
    """A :class:`TracedTape` read from a file with its plans kept: the single-point plan decoded, the columns
    and the full plan decoded from the file's bytes when one of them is first asked for (the allocator
    replay, many points at once, a rare sum past 2**52 bytes)."""

    coef, sign, kind, new_kind, tag, phase, ref, plan = (_Decoded() for _ in _LAZY_FIELDS)

    @classmethod
    def of(cls, scalars: tuple, point: PointPlan, arrays: _Arrays, kept: dict, repeated: bool,
           on_damage: Callable[[], None] | None) -> _FileTape:
        rec = object.__new__(cls)
        for f, v in zip(_SCALAR_FIELDS, scalars):
            object.__setattr__(rec, f, v)
        for f, v in (("_point", point), ("_arrays", arrays), ("_kept", kept), ("_repeated", repeated),
                     ("_on_damage", on_damage)):
            object.__setattr__(rec, f, v)
        return rec

    def _decode(self) -> dict:
        arrays = self._arrays
        with arrays.lock:
            if "coef" not in vars(self):
                try:
                    columns = arrays.columns(len(self.phases))
                    plan = arrays.plan(self._kept, self._point)
                    why = "its indices are out of range"
                except _Damaged as e:
                    columns, why = None, str(e)
                    if self._on_damage is not None:
                        self._on_damage()
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                    columns, why = None, f"it is malformed ({e})"
                if columns is None:
                    raise SetupError(f"a traced tape read from the disk cache cannot be used: {why}; it is traced "
                                     "again when it is next needed")
                for f, v in zip(_LAZY_FIELDS, (*columns, plan)):
                    object.__setattr__(self, f, v)
        return vars(self)

    @functools.cached_property
    def tape(self) -> Tape:
        return _PointTape(self) if "_arrays" in vars(self) else TracedTape.tape.func(self)

    @functools.cached_property
    def full_tape(self) -> Tape | None:
        """None where the file says the tape repeats blocks (the columns are not read to find out)."""
        return None if vars(self).get("_repeated") else TracedTape.full_tape.func(self)


class _PointTape(Tape):
    """The tape of a :class:`_FileTape`: one point is evaluated from the stored single-point plan; anything
    else (the columns, the block structure, the full plan) makes the whole tape from the file first."""

    def __init__(self, rec: _FileTape) -> None:  # no Tape.__init__: nothing is indexed yet
        self.phases = list(rec.phases)
        self.phase_keys = tuple(dict.fromkeys(self.phases))
        self._last = None
        self._rec = rec

    def _point_plan(self) -> PointPlan:
        return self._rec._point

    def __getattr__(self, name: str) -> object:  # only what is not set yet: the whole tape's
        if name.startswith("__") or name == "_rec":
            raise AttributeError(name)
        rec = self._rec
        with rec._arrays.lock:
            if "_plan_lock" not in vars(self):
                whole = Tape.from_arrays(rec.coef, rec.sign, rec.kind, rec.new_kind, rec.tag, rec.phase,
                                         list(rec.phases), dict(rec.multiplicity), plan=rec.plan)
                vars(self).update({k: v for k, v in vars(whole).items() if k != "_last"})
        return object.__getattribute__(self, name)


def _narrow_type(arrays: list[np.ndarray]) -> np.dtype:
    """The narrowest of int8 / int16 / int32 (little-endian) that holds every one of ``arrays`` exactly (whole
    numbers), else the type they have."""
    dtype = np.dtype(arrays[0].dtype).newbyteorder("<")
    lo = min((float(a.min()) for a in arrays if a.size), default=0.0)
    hi = max((float(a.max()) for a in arrays if a.size), default=0.0)
    if all(a.dtype.kind == "i" or (a.dtype.kind == "f" and np.array_equal(a, np.round(a))) for a in arrays):
        for t in ("<i1", "<i2", "<i4"):
            info = np.iinfo(t)
            if info.min <= lo and hi <= info.max:
                return np.dtype(t)
    return dtype


@functools.cache
def plan_digest() -> str:
    """A digest of the code that builds a tape's evaluation plans (the bytecode, names and constants of
    :meth:`.Tape.plan` and what it calls there, and of the single-point plan's :meth:`.PointPlan.of`, nested
    functions included, and both plans' fields): kept plans are used only by the code that built them.
    Computed when the module is imported (0.05-0.3 ms), not by the first estimate that reads a file."""
    h = hashlib.sha256(repr([f.name for cls in (Plan, PointPlan) for f in dataclasses.fields(cls)]).encode())
    todo = [Tape.plan.__code__, Tape._build_plan.__code__, Plan.with_tables.__code__, PointPlan.of.__code__]
    while todo:
        code = todo.pop()
        h.update(code.co_code + repr(code.co_names).encode())
        for c in code.co_consts:
            if isinstance(c, type(code)):
                todo.append(c)
            else:  # a frozenset's order varies with string hashing between processes
                h.update(repr(sorted(map(repr, c)) if isinstance(c, frozenset) else c).encode())
    return h.hexdigest()


plan_digest()


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
        path = os.path.join(self._folder or cache_dir(), key + SUFFIX)  # (pathlib's first paths: 0.05 ms)
        try:
            rec = _read(path, key, lambda: self._discard(key, path))
        except OSError:
            return None
        if rec is not None:
            self.disk_hits += 1
            self._remember(key, rec)
            with contextlib.suppress(OSError):  # used now: what :meth:`prefetch` reads first after a restart
                os.utime(path)
        return rec

    def prefetch(self, most: int = 8) -> int:
        """Read the ``most`` most recently used tapes on disk (written by a trace or last read, newest first)
        into memory, their first parts only (what an estimate at one point needs; the rest stays lazy), so that
        a traced model picked after a restart answers from memory. A tape already in memory, a damaged or
        foreign file is skipped; never raises. Returns how many were read."""
        folder = self._folder or cache_dir()
        try:
            with os.scandir(folder) as it:
                found = [(e.stat().st_mtime, e.name, e.path) for e in it if e.name.endswith(SUFFIX) and e.is_file()]
        except OSError:
            return 0
        read, most = 0, min(most, self.size)
        for _, name, path in sorted(found, reverse=True)[:4 * most]:  # a few damaged ones do not stop it
            if read >= most:
                break
            key = name[: -len(SUFFIX)]
            with self._lock:
                if key in self._d:
                    continue
            try:
                rec = _read(path, key, lambda k=key, p=path: self._discard(k, p))
            except (OSError, ValueError):
                continue
            if rec is None:
                continue
            with self._lock:
                if key not in self._d and len(self._d) < self.size:  # a look-up meanwhile, or a full memory, wins
                    self._d[key] = rec
                    self._d.move_to_end(key, last=False)  # first out: nobody asked for it yet
                    read += 1
        return read

    def put(self, key: str, rec: TracedTape) -> None:
        """Keep ``rec``; a disk that refuses the write (full, read-only) leaves it in memory only."""
        self._remember(key, rec)
        from vramlab.core.fileio import write_atomic

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / f"{key}{SUFFIX}", rec.to_bytes(key))
        except OSError:
            pass

    def _discard(self, key: str, path: str) -> None:
        """Forget a tape whose file turned out damaged, in memory and on disk, so that it is traced again."""
        with self._lock:
            self._d.pop(key, None)
        with contextlib.suppress(OSError):
            os.remove(path)

    def forget_memory(self) -> None:
        with self._lock:
            self._d.clear()

    def _remember(self, key: str, rec: TracedTape) -> None:
        with self._lock:
            self._d[key] = rec
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)
