"""Evaluate an engine tape for concrete sizes: live bytes over time, the peak and what was alive then.

The tape holds every allocation, free and reclassification of one training step's replay, with sizes as
polynomials in (b, s, r). Layers that repeat identically were replayed once and appear as *blocks* with
a multiplicity: a block repeated ``m`` times raises everything after it by ``(m - 1)`` times its net
change, and the highest moment inside it is in its first repetition when the net change is negative and
in its last otherwise. Everything is vectorised, so one evaluation costs tens of microseconds.

Peak semantics follow :class:`~vramlab.core.measure.tracker.MemoryTracker`: the breakdown of a peak is
read at the first free after it (or at the end of its phase), so a tensor reclassified in between (a
gradient stolen by ``.grad``) is counted under its new kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec import SetupError
from .engine import BLOCK, KINDS
from .poly import N, P, monomial_values

K = len(KINDS)
# Sizes are evaluated in int64: a step whose bytes could pass this is refused before it can wrap around.
MAX_STEP_BYTES = 2**61


@dataclass(frozen=True)
class Evaluation:
    peak: int
    peak_kinds: np.ndarray  # (K,) bytes per kind at the peak
    peak_phase: str
    phase_peaks: dict[str, tuple[int, np.ndarray]]  # phase key -> (bytes, kinds)
    timeline: np.ndarray | None = None  # live bytes after each event of the reduced tape (no repeats)
    largest_alloc: int = 0  # the largest single allocation of the step (bytes)


class Tape:
    """An immutable, vectorised tape (see :mod:`.engine` for how it is written)."""

    def __init__(self, rows: list[tuple[P, int, int, int, int, int]], phases: list[str],
                 multiplicity: dict[int, int], hids: list[int] | None = None) -> None:
        n = len(rows)
        self.hids = np.array(hids if hids is not None else [0] * n, dtype=np.int64)
        self.coef = np.zeros((n, N), dtype=np.int64)
        self.sign = np.zeros(n, dtype=np.int64)
        self.kind = np.zeros(n, dtype=np.int64)
        self.kind2 = np.zeros(n, dtype=np.int64)
        tags = np.zeros(n, dtype=np.int64)
        self.phase = np.zeros(n, dtype=np.int64)
        for i, (size, sign, k, k2, tag, ph) in enumerate(rows):
            self.coef[i] = size.c
            self.sign[i] = sign
            self.kind[i] = k
            self.kind2[i] = k2
            tags[i] = tag
            self.phase[i] = ph
        self.phases = phases
        self.n = n
        # blocks: maximal runs of events whose tag repeats
        mult = np.ones(n, dtype=np.int64)
        for tag, m in multiplicity.items():
            mult[tags == tag] = m
        self.block_start: list[int] = []
        self.block_end: list[int] = []
        self.block_mult: list[int] = []
        i = 0
        while i < n:
            if mult[i] > 1:
                j = i
                while j + 1 < n and tags[j + 1] == tags[i]:
                    j += 1
                self.block_start.append(i)
                self.block_end.append(j)
                self.block_mult.append(int(mult[i]))
                i = j + 1
            else:
                i += 1
        self.reclass = self.sign == 0
        self.is_free = self.sign < 0
        # phase segments in order: (phase index, start, end)
        self.segments: list[tuple[int, int, int]] = []
        if n:
            change = np.flatnonzero(np.diff(self.phase)) + 1
            starts = np.concatenate(([0], change))
            ends = np.concatenate((change, [n]))
            for a, e in zip(starts, ends):
                self.segments.append((int(self.phase[a]), int(a), int(e)))
        # structure-only lookups, so that an evaluation is a few vectorised passes
        free_idx = np.flatnonzero(self.is_free)
        pos = np.searchsorted(free_idx, np.arange(n) + 1)
        self.next_free = np.where(pos < len(free_idx), free_idx[np.minimum(pos, len(free_idx) - 1)], n)
        self.bstart = np.array(self.block_start, dtype=np.int64)
        self.bend = np.array(self.block_end, dtype=np.int64)
        self.bmult = np.array(self.block_mult, dtype=np.int64)
        # number of blocks that end strictly before each event, and the block each event is in (-1: none)
        self.blocks_before = np.searchsorted(self.bend, np.arange(n), side="left")
        self.block_of = np.full(n, -1, dtype=np.int64)
        for bi, (a, e) in enumerate(zip(self.block_start, self.block_end)):
            self.block_of[a:e + 1] = bi
        self.kind_ev = np.where(self.reclass, self.kind, self.kind)
        self.rc_idx = np.flatnonzero(self.reclass)
        # an upper bound of every partial sum an evaluation makes, per monomial (float: it cannot overflow)
        self.abs_cols = (np.abs(self.coef).sum(axis=0, dtype=np.float64) * max(self.block_mult, default=1)).tolist()

    def check_range(self, b: int, s: int, r: int) -> np.ndarray:
        """The monomial values as int64, or SetupError when a sum over the step could exceed
        :data:`MAX_STEP_BYTES` (int64 would wrap around and a larger batch would give a smaller answer)."""
        mono = monomial_values(b, s, r)
        if sum(c * float(x) for c, x in zip(self.abs_cols, mono)) > MAX_STEP_BYTES:
            raise SetupError(f"batch {b:,} x sequence {s:,} would need more than 2 EiB in one step, beyond what "
                             "the estimator counts: choose a smaller batch or sequence")
        return np.array(mono, dtype=np.int64)

    def allocations(self, b: int, s: int, r: int) -> list[tuple[int, int]]:
        """The allocation sequence — (id, bytes) to allocate, (id, -1) to free — for the caching-allocator
        model. Only a tape replayed without repeated layers has every allocation in it."""
        if self.block_start:
            raise ValueError("allocation sequences need a tape without repeated layers")
        v = self.check_range(b, s, r)
        raw = self.coef @ v
        out = []
        for hid, sign, n in zip(self.hids.tolist(), self.sign.tolist(), raw.tolist()):
            if hid and n > 0:
                out.append((hid, n if sign > 0 else -1))
        return out

    def evaluate(self, b: int, s: int, r: int, timeline: bool = False) -> Evaluation:
        n = self.n
        v = self.check_range(b, s, r)
        raw = self.coef @ v
        size = np.where(raw > 0, (raw + BLOCK - 1) // BLOCK * BLOCK, 0)
        delta = self.sign * size
        cum = np.cumsum(delta)
        kd = np.where(self.reclass, -size, delta)  # the change to the event's own kind
        nb = len(self.bstart)
        if nb:
            before = np.where(self.bstart > 0, cum[np.maximum(self.bstart - 1, 0)], 0)
            before = np.where(self.bstart > 0, before, 0)
            net = cum[self.bend] - before
            contrib = (self.bmult - 1) * net
            prefix = np.concatenate(([0], np.cumsum(contrib)))
            extra_before = prefix[self.blocks_before]
            bonus_b = np.where(net > 0, contrib, 0)
            bonus = np.where(self.block_of >= 0, bonus_b[np.maximum(self.block_of, 0)], 0)
            value = cum + extra_before + bonus
            level_after = cum + prefix[self.blocks_before + (self.block_of >= 0) * (np.arange(n) == self.bend[
                np.maximum(self.block_of, 0)])]
        else:
            net = contrib = prefix = bonus_b = None
            value = cum
            level_after = cum

        phase_peaks: dict[str, tuple[int, int, str]] = {}  # key -> (bytes, event index, how)
        best = (0, -1, "")
        best_phase = self.phases[0] if self.phases else ""
        seen: set[str] = set()
        for ph, a, e in self.segments:
            key = self.phases[ph]
            if key not in seen:
                seen.add(key)
                start = int(level_after[a - 1]) if a > 0 else 0
                cur = phase_peaks.get(key)
                if cur is None or start > cur[0]:
                    phase_peaks[key] = (start, a - 1, "after")
            j = a + int(np.argmax(value[a:e]))
            top = int(value[j])
            if top > phase_peaks[key][0]:
                phase_peaks[key] = (top, min(int(self.next_free[j]), e) - 1, "at")
            if top > best[0]:
                best = (top, min(int(self.next_free[j]), e) - 1, "at")
                best_phase = key
        # breakdowns: bytes per kind at a few moments, from one pass of segment sums
        queries = [(idx, how) for _t, idx, how in phase_peaks.values()] + [(best[1], "at")]
        points = {i for i, _h in queries if i >= 0}
        if nb:
            points.update(int(x) for x in self.bend)
            points.update(int(x) - 1 for x in self.bstart if x > 0)
        pts = sorted(points)
        upto: dict[int, np.ndarray] = {}
        if pts:
            dk = np.zeros((n, K), dtype=np.int64)
            dk[np.arange(n), self.kind] = kd
            if len(self.rc_idx):
                np.add.at(dk, (self.rc_idx, self.kind2[self.rc_idx]), size[self.rc_idx])
            bounds = np.array([0] + [i + 1 for i in pts[:-1]], dtype=np.int64)
            sums = np.add.reduceat(dk[: pts[-1] + 1], bounds, axis=0)
            acc = np.cumsum(sums, axis=0)
            upto = {i: acc[k] for k, i in enumerate(pts)}
        zero = np.zeros(K, dtype=np.int64)

        def kinds_upto(i: int) -> np.ndarray:
            return upto[i] if i >= 0 else zero

        if nb:
            bnet = np.array([kinds_upto(int(e)) - kinds_upto(int(a) - 1)
                             for a, e in zip(self.bstart, self.bend)])
            bcontrib = (self.bmult - 1)[:, None] * bnet
            bprefix = np.concatenate((zero[None, :], np.cumsum(bcontrib, axis=0)))

        def kinds_at(i: int, how: str) -> np.ndarray:
            if i < 0:
                return zero
            out = kinds_upto(i)
            if not nb:
                return out
            out = out + bprefix[int(self.blocks_before[i])]
            bi = int(self.block_of[i])
            if bi >= 0 and ((how == "at" and net[bi] > 0) or (how == "after" and i == int(self.bend[bi]))):
                out = out + bcontrib[bi]
            return out

        resolved = {key: (total, kinds_at(idx, how)) for key, (total, idx, how) in phase_peaks.items()}
        for key in self.phases:
            resolved.setdefault(key, (0, zero))
        peak_kinds = kinds_at(best[1], "at")
        return Evaluation(best[0], peak_kinds, best_phase, resolved, level_after if timeline else None,
                          int(size.max()) if n else 0)
