"""Evaluate an engine tape for concrete sizes: the peak, what was alive then, and every phase's peak.

The tape holds every allocation, free and reclassification of one training step's replay, with sizes as
polynomials in (b, s, r). Layers that repeat identically were replayed once and appear as *blocks* with
a multiplicity: a block repeated ``m`` times raises everything after it by ``(m - 1)`` times its net
change, and the highest moment inside it is in its first repetition when the net change is negative and
in its last otherwise.

Peak semantics follow :class:`~vramlab.core.simulation.tracker.MemoryTracker`: the breakdown of a peak is
read at the first free after it (or at the end of its phase), so a tensor reclassified in between (a
gradient stolen by ``.grad``) is counted under its new kind.

How an evaluation stays cheap, for one point or ten thousand: a tape of thousands of events holds only a
few dozen distinct size polynomials. Every cumulative quantity (live bytes after an event, bytes of one
kind after an event) is a signed count of each distinct polynomial up to that event times its rounded
size, so the counts are tabulated once per tape and a point costs one matrix product over the distinct
sizes. Only the events where a peak can sit are tabulated: where a stretch of constant block bookkeeping
starts, and every allocation not directly followed by a surely larger level. All arithmetic is in float64,
exact because every sum is checked to stay below 2**52 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from dataclasses import dataclass

import numpy as np

from vramlab.core.checks import SetupError
from vramlab.core.estimator.engine import BLOCK, KINDS
from vramlab.core.estimator.poly import MONOMIALS, Poly, monomial_values

K = len(KINDS)
FLOAT_LIMIT = float(2**52)  # float64 sums of whole bytes are exact below this
INT_LIMIT = float(2**62)  # int64 ones below this
_CHUNK_ELEMENTS = 1 << 21  # tabulated events x points per pass


@dataclass(frozen=True)
class Evaluation:
    """One point: the peak, bytes per kind at the peak, its phase, and every phase's (peak, kinds)."""

    peak: int
    peak_kinds: list[int]  # (K,) bytes per kind at the peak
    peak_phase: str
    phase_peaks: dict[str, tuple[int, list[int]]]  # phase key -> (bytes, kinds)
    largest_alloc: int = 0  # the largest single allocation of the step (bytes)


@dataclass(frozen=True)
class Evaluations:
    """Many points at once (``P`` of them), as arrays."""

    phase_keys: tuple[str, ...]
    peak: np.ndarray  # (P,)
    peak_kinds: np.ndarray  # (P, K)
    peak_phase: np.ndarray  # (P,) index into phase_keys
    phase_totals: np.ndarray  # (phases, P)
    phase_kinds: np.ndarray  # (phases, P, K)
    largest_alloc: np.ndarray  # (P,) the largest single allocation

    def point(self, i: int) -> Evaluation:
        phases = {key: (int(self.phase_totals[k, i]), self.phase_kinds[k, i].tolist())
                  for k, key in enumerate(self.phase_keys)}
        return Evaluation(int(self.peak[i]), self.peak_kinds[i].tolist(), self.phase_keys[int(self.peak_phase[i])],
                          phases,
                          int(self.largest_alloc[i]))


@dataclass(frozen=True)
class Plan:
    """What an evaluation needs from the tape's structure, tabulated once (see the module docstring)."""

    sizes: np.ndarray  # (U, monomials) the distinct size polynomials
    bound: np.ndarray  # (monomials,) every event's size polynomial in absolute value, repeats counted
    bound_rounding: float  # and its rounding to whole blocks
    rows: np.ndarray  # (R,) the tabulated events, ascending; -1 first (before any event)
    live: np.ndarray  # (R, U) signed count of each size allocated up to and including each row
    block_added: np.ndarray  # (blocks, U) counts the repeats of each block add: (m - 1) x its net change
    value: np.ndarray  # (R, U) counts at each row with the repeats of earlier blocks
    after: np.ndarray  # (R, U) the same once the row's own block (if it ends there) has repeated
    in_block: np.ndarray  # (R, blocks) 1 where a row is inside a block (its rise counts once more per repeat)
    kinds: np.ndarray  # (R, pairs) the same per (kind, size) pair, with the repeats of earlier blocks
    block_kinds: np.ndarray  # (blocks, pairs) what the repeats of each block add per pair
    pair_kind: np.ndarray  # (pairs,)
    pair_size: np.ndarray  # (pairs,)
    kind_sum: np.ndarray  # (pairs, K) 1 where a pair is of a kind
    candidate_table: np.ndarray  # (segments, most candidates) positions where a segment's peak can sit
    moment: np.ndarray  # (R,) position of the row whose breakdown a peak at this row reads
    segment_key: np.ndarray  # (segments,) the phase key of each segment
    key_start: np.ndarray  # (phases,) position of the row before each phase key's first segment
    key_segments: np.ndarray  # (phases, most segments) each key's segments in order
    segment_index: np.ndarray  # (segments, 1) 0, 1, ...
    key_index: np.ndarray  # (phases, 1) 0, 1, ...
    block_end: np.ndarray  # (blocks,) positions of each block's last row
    block_before: np.ndarray  # (blocks,) positions of the row before each block
    blocks_before: np.ndarray  # (R,) blocks ending strictly before each row
    block_of: np.ndarray  # (R,) the block each row is in (-1: none)
    ends_block: np.ndarray  # (R,) the row is its block's last

    def with_tables(self, dtype: type) -> Plan:
        """The same with the count tables in ``dtype`` (small whole numbers: exact in either)."""
        return dataclasses.replace(self, **{name: getattr(self, name).astype(dtype) for name in PLAN_TABLES})

    @functools.cached_property
    def int_plan(self) -> Plan:
        """The tables in int64, for sums past 2**52 bytes, which float64 would round."""
        return self.with_tables(np.int64)

    @functools.cached_property
    def point(self) -> PointPlan:
        """The same tables cut to what one point reads (:meth:`Tape.evaluate`)."""
        return PointPlan.of(self)


@dataclass(frozen=True)
class PointPlan:
    """:class:`Plan` for one point at a time, where numpy's cost per call (and its first call's in a process)
    outweighs its arithmetic: sizes counted in whole blocks (every rounded size is a multiple of one; bytes only
    in what is returned), the block and phase-start products in one, ``value`` at the rows a segment's peak can
    sit at only, with the blocks' repeats as more columns, in the order of the rows, so that each segment's
    candidates are one stretch of it; the choices among the few segments and phases made in Python
    (``Tape._point``; ``Tape._columns`` makes the same in arrays)."""

    bound: tuple[float, ...]  # Plan.bound
    bound_rounding: float
    used: tuple[bool, ...]  # (monomials,) the monomials some size uses
    sizes: np.ndarray  # (U, monomials) float64, in blocks (divided by BLOCK, a power of two: exact)
    head: np.ndarray  # (blocks + phases, U): block_added, then ``after`` at each phase key's start
    blocks: int
    value: np.ndarray  # (C, U + blocks): ``value`` at the candidate rows (ascending), then ``in_block``
    segment_end: list[int]  # (segments,) where each segment's candidates end in ``value`` (they start at the last)
    moments: list[int] | np.ndarray  # (C,) ``moment`` of each candidate row (arrays where a file holds them: a
    segment_key: list[int]  # point reads a few of these and of block_of and ends_block)
    key_start: list[int]
    key_segments: list[list[int]]  # padded with repeats of the first, which never wins (first maximum)
    block_of: list[int] | np.ndarray  # (R,)
    ends_block: list[int] | np.ndarray  # (R,)
    kinds: np.ndarray  # (R, pairs) (whole numbers of any type: a point reads a few rows, in float64)
    block_kinds: np.ndarray  # (blocks + 1, pairs) float64; the last row 0 (what a row outside every block adds)
    pair_size: np.ndarray  # (pairs,)
    kind_bytes: np.ndarray  # (pairs, K) ``kind_sum`` times the block size

    @staticmethod
    def of(plan: Plan) -> PointPlan:
        table = plan.candidate_table
        # np.unique(table), written out: np.unique's first call imports numpy.ma (about 15 ms), which the first
        # estimate after a restart (its tape's stored plan read from the disk) would pay
        rows = np.sort(table, axis=None)
        if rows.size:
            rows = rows[np.concatenate(([True], rows[1:] != rows[:-1]))]
        # a segment's candidates are rows of its own stretch of the step, and the segments follow each other:
        # in ascending order they lie end to end
        segment_end = np.searchsorted(rows, table.max(axis=1), side="right") if table.size else rows[:0]
        value = np.concatenate((plan.value[rows], plan.in_block[rows]), axis=1)
        return PointPlan(
            tuple(float(v) for v in plan.bound.tolist()), plan.bound_rounding, tuple((plan.bound > 0).tolist()),
            plan.sizes.astype(np.float64) * _PER_BLOCK,
            np.concatenate((plan.block_added, plan.after[plan.key_start])).astype(np.float64),
            len(plan.block_end), value.astype(np.float64), segment_end.tolist(), plan.moment[rows].tolist(),
            plan.segment_key.tolist(), plan.key_start.tolist(), plan.key_segments.tolist(), plan.block_of.tolist(),
            plan.ends_block.tolist(), np.asarray(plan.kinds, np.float64),
            np.concatenate((plan.block_kinds, np.zeros((1, plan.block_kinds.shape[1])))).astype(np.float64),
            plan.pair_size, plan.kind_sum.astype(np.float64) * BLOCK)


_PER_BLOCK = 1.0 / BLOCK  # a power of two: multiplying by it divides exactly
PLAN_TABLES = ("live", "block_added", "value", "after", "in_block", "kinds", "block_kinds", "kind_sum")


def too_large() -> SetupError:
    """The refusal where int64 would wrap around (a larger batch would give a smaller answer): bad input."""
    return SetupError("this setup's allocations add up to more than 4 EiB in one step, beyond what the "
                       "estimator counts: choose a smaller batch or sequence")


class Tape:
    """An immutable tape (see :mod:`.engine` for how it is written)."""

    def __init__(self, rows: list[tuple[Poly, int, int, int, int, int]], phases: list[str],
                 multiplicity: dict[int, int], hids: list[int] | None = None) -> None:
        n = len(rows)
        if n:
            size_polys, signs, kinds, new_kinds, tags, phase_of = zip(*rows)
            coefficients = [p.coefficients for p in size_polys]
            coef = np.array(coefficients, dtype=np.int64)
        else:
            signs = kinds = new_kinds = tags = phase_of = ()
            coefficients = []
            coef = np.zeros((0, len(MONOMIALS)), dtype=np.int64)
        self._index(coef, *(np.array(c, dtype=np.int64) for c in (signs, kinds, new_kinds, tags, phase_of)), phases,
                    multiplicity, hids)
        self._coefficients = coefficients

    @classmethod
    def from_arrays(cls, coef: np.ndarray, sign: np.ndarray, kind: np.ndarray, new_kind: np.ndarray,
                    tag: np.ndarray, phase: np.ndarray, phases: list[str], multiplicity: dict[int, int],
                    hids: np.ndarray | None = None, plan: Plan | None = None) -> Tape:
        """The same tape from its columns (int64 arrays, ``coef`` of shape (n, monomials)) without a
        Python object per event, and with its evaluation plan when one was kept (a traced tape read back
        from the disk cache: :mod:`.stored`)."""
        tape = cls.__new__(cls)
        tape._index(coef, sign, kind, new_kind, tag, phase, phases, multiplicity, hids)
        tape._coefficients = None  # read from ``coef`` if a plan is built
        tape._plan = plan
        return tape

    def _index(self, coef: np.ndarray, sign: np.ndarray, kind: np.ndarray, new_kind: np.ndarray, tag: np.ndarray,
               phase: np.ndarray, phases: list[str], multiplicity: dict[int, int], hids: object) -> None:
        n = len(sign)
        self.n = n
        self.phases = phases
        self.hids = np.asarray(hids if hids is not None else np.zeros(n), dtype=np.int64)
        self.coef = coef
        self.sign = sign
        self.kind = kind
        self.new_kind = new_kind  # reclassifications: the kind it becomes
        self.phase = phase
        # blocks: maximal runs of events of one repeated tag
        top = max(max(multiplicity, default=-1), int(tag.max()) if n else -1)
        lookup = np.ones(top + 2, dtype=np.int64)  # tag -> its multiplicity; the last entry (tag -1) stays 1
        lookup[list(multiplicity)] = list(multiplicity.values())
        mult = lookup[np.where(tag >= 0, tag, -1)]
        repeated = mult > 1
        change = np.flatnonzero(np.diff(tag) != 0) + 1
        run_start = np.concatenate(([0], change)) if n else np.zeros(0, dtype=np.int64)
        run_end = np.concatenate((change, [n])) - 1 if n else np.zeros(0, dtype=np.int64)
        keep = repeated[run_start] if n else np.zeros(0, dtype=bool)
        self.block_first = run_start[keep].astype(np.int64)
        self.block_last = run_end[keep].astype(np.int64)
        self.block_mult = mult[self.block_first]
        self.row_mult = mult
        self.full_length = int(mult.sum())  # events of the step with every layer replayed
        # phase segments in order: (phase index, start, end)
        self.segments: list[tuple[int, int, int]] = []
        if n:
            change = np.flatnonzero(np.diff(self.phase)) + 1
            for a, e in zip(np.concatenate(([0], change)), np.concatenate((change, [n]))):
                self.segments.append((int(self.phase[a]), int(a), int(e)))
        keys: dict[str, int] = {}  # phase keys in order of first appearance (micro-batches share a key)
        self.key_of_phase = [keys.setdefault(key, len(keys)) for key in phases]
        self.phase_keys = tuple(keys)
        self._plan: Plan | None = None
        self._abs_bound: np.ndarray | None = None  # allocation_columns' bound, once
        self._plan_lock = threading.Lock()
        self._last: tuple[tuple[int, ...], Evaluation] | None = None  # the last point evaluated, and its answer

    # ---- the allocator's input ---------------------------------------------------------------------------
    def allocations(self, b: int, s: int, r: int) -> list[tuple[int, int]]:
        """The allocation sequence — (id, bytes) to allocate, (id, -1) to free — for the caching-allocator
        model. Only a tape replayed without repeated layers has every allocation in it."""
        return list(zip(*self.allocation_columns(b, s, r)))

    def allocation_columns(self, b: int, s: int, r: int) -> tuple[list[int], list[int]]:
        """:meth:`allocations` as two lists, ids and bytes (``zip`` them to replay without building the
        pairs)."""
        if len(self.block_first):
            raise ValueError("allocation sequences need a tape without repeated layers")
        exact = monomial_values(int(b), int(s), int(r))
        # no repeated layers here: every size counts once, so its bound is the absolute coefficients summed
        # (no evaluation plan is built for these full-depth tapes)
        if self._abs_bound is None:
            self._abs_bound = np.abs(self.coef).sum(axis=0, dtype=np.float64)
        bound = self._abs_bound
        if float(bound @ np.array(exact, dtype=np.float64)) + BLOCK * self.n >= INT_LIMIT:
            raise too_large()
        # a monomial no size uses may be past int64 (see evaluate): it counts 0
        raw = self.coef @ np.array([v if used else 0 for v, used in zip(exact, bound > 0)], dtype=np.int64)
        use = (self.hids != 0) & (raw > 0)
        nbytes = np.where(self.sign > 0, raw, -1)[use]
        return self.hids[use].tolist(), nbytes.tolist()

    # ---- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self, b: int, s: int, r: int) -> Evaluation:
        """The peak, its breakdown and every phase's peak for one (batch, sequence, rank). The answer is
        shared with later calls at the same point: read it, do not change it."""
        exact = monomial_values(int(b), int(s), int(r))  # Python integers: no wrapping
        pp = self._point_plan()
        bound = sum(map(operator.mul, pp.bound, exact)) + pp.bound_rounding
        if bound >= INT_LIMIT:
            raise too_large()
        # a monomial no size uses may be past int64 (a huge sequence without eager attention's b s^2): it counts 0
        used = tuple(v if use else 0 for v, use in zip(exact, pp.used))
        last = self._last  # the same point again (a tape of concrete sizes has only one): nothing to redo
        if last is not None and last[0] == used:
            return last[1]
        if bound < FLOAT_LIMIT:
            ev = self._point(pp, np.array(used, dtype=np.float64))
        else:
            ev = self._evaluate(self.plan(), np.array(used, dtype=np.int64)[:, None], bound).point(0)
        self._last = (used, ev)
        return ev

    def _point_plan(self) -> PointPlan:
        """The tables one point reads (a tape read back from the disk cache brings them: :mod:`.stored`)."""
        return self.plan().point

    def evaluate_many(self, points: np.ndarray) -> Evaluations:
        """The same for many (batch, sequence, rank) points at once (``points``: shape (P, 3))."""
        points = np.asarray(points, dtype=np.int64).reshape(-1, 3)
        plan = self.plan()
        # every sum below is at most the step's allocations added up, repeats counted (in float: no wrapping)
        bound = float((plan.bound @ _monomials(points.astype(np.float64))).max()) + plan.bound_rounding
        if bound >= INT_LIMIT:
            raise too_large()
        return self._evaluate(plan, _monomials(points), bound)

    def _evaluate(self, plan: Plan, values: np.ndarray, bound: float) -> Evaluations:
        """``values``: (monomials, P) int64; ``bound``: what no sum exceeds."""
        raw = plan.sizes @ values  # (U, P) bytes of each distinct size
        rounded = np.where(raw > 0, (raw + (BLOCK - 1)) // BLOCK * BLOCK, 0)
        if bound < FLOAT_LIMIT:  # float64 products are faster, and still exact
            rounded = rounded.astype(np.float64)
        else:
            plan = plan.int_plan
        chunk = max(1, _CHUNK_ELEMENTS // max(len(plan.rows), 1))
        parts = [self._columns(plan, rounded[:, i:i + chunk]) for i in range(0, rounded.shape[1], chunk)]
        if len(parts) == 1:
            return parts[0]
        return Evaluations(self.phase_keys, *(np.concatenate([getattr(p, f) for p in parts], axis=axis)
                                              for f, axis in (("peak", 0), ("peak_kinds", 0), ("peak_phase", 0),
                                                              ("phase_totals", 1), ("phase_kinds", 1),
                                                              ("largest_alloc", 0))))

    def _point(self, pp: PointPlan, values: np.ndarray) -> Evaluation:
        """:meth:`_columns` for one point, in float64 (exact: every sum is below 2**52 bytes), counted in
        whole blocks: the same choices, each the first maximum, made in Python over the few segments and
        phases, with as few kinds of numpy call as it takes (each kind's first call in a process costs 10-50 us,
        more than its arithmetic here: the first estimate after a restart pays them)."""
        x = pp.sizes @ values  # blocks of each distinct size (exact below 2**53)
        np.ceil(x, out=x)
        np.maximum(x, 0.0, out=x)
        head = pp.head @ x
        heads = head.tolist()
        blocks = pp.blocks
        added, after_start = heads[:blocks], heads[blocks:]  # the repeats of each block; each phase's start
        # each candidate row's level, its block's repeats counted where they rise
        level = (pp.value @ np.concatenate((x, np.maximum(head[:blocks], 0.0)))).tolist()
        moments = pp.moments
        top, moment, start = [], [], 0
        for end in pp.segment_end:  # each segment's highest candidate: the first maximum
            stretch = level[start:end]
            best = max(stretch)
            top.append(best)
            moment.append(int(moments[start + stretch.index(best)]))
            start = end
        rows, extra, totals = [], [], []
        for k, segments in enumerate(pp.key_segments):
            total, win = after_start[k], -1  # the level before the phase, or the first segment that beats it
            for seg in segments:
                if top[seg] > total:
                    total, win = top[seg], seg
            totals.append(total)
            rows.append(moment[win] if win >= 0 else pp.key_start[k])
            extra.append(win >= 0)
        best, win = 0.0, -1  # the step's peak: the first segment that beats every earlier one (and zero)
        for seg, v in enumerate(top):
            if v > best:
                best, win = v, seg
        rows.append(moment[win] if win >= 0 else 0)
        extra.append(True)
        # what the repeats of a row's block add to its counts (the zero row past the blocks: nothing)
        for i, (row, at) in enumerate(zip(rows, extra)):
            blk = int(pp.block_of[row])
            extra[i] = blk if blk >= 0 and (added[blk] > 0 if at else int(pp.ends_block[row]) == 1) else blocks
        counts = pp.block_kinds[extra]  # (phases + 1, pairs), then earlier blocks' repeats included
        counts += pp.kinds[rows]
        kinds = ((counts * x[pp.pair_size]) @ pp.kind_bytes).astype(np.int64).tolist()  # (phases + 1, K) bytes
        phases = {key: (int(totals[k]) * BLOCK, kinds[k]) for k, key in enumerate(self.phase_keys)}
        largest = int(max(x.tolist(), default=0.0)) * BLOCK
        key = pp.segment_key[win] if win >= 0 else pp.segment_key[0]
        return Evaluation(int(best) * BLOCK, kinds[-1], self.phase_keys[key], phases, largest)

    def _columns(self, plan: Plan, rounded: np.ndarray) -> Evaluations:
        points = rounded.shape[1]
        cols = np.arange(points)
        # products of more than a few points through numpy's own loops: BLAS would start threads that, on a
        # busy machine, spin (a 1,600 x 30 by 30 x 64 product: 6.7 ms of CPU instead of 1)
        mm = np.matmul if rounded.dtype.kind == "i" or points <= 16 else \
            functools.partial(np.einsum, "...ij,jk->...ik")
        added = mm(plan.block_added, rounded)  # (blocks, P) what the repeats of each block add
        # the highest level each tabulated row stands for, and the level once its block's repeats are done
        value = mm(plan.value, rounded) + mm(plan.in_block, np.maximum(added, 0))
        after = mm(plan.after, rounded)
        # each segment's highest row: the first maximum among its candidates (padded with repeats of the
        # first, which argmax never prefers to it)
        table = value[plan.candidate_table]  # (segments, candidates, P)
        pick = np.argmax(table, axis=1)  # (segments, P)
        top = table[plan.segment_index, pick, cols]
        moment = plan.moment[plan.candidate_table[plan.segment_index, pick]]
        # a phase's peak: its level before it starts, or the first segment of that phase that beats it
        options = np.concatenate((after[plan.key_start][:, None, :], top[plan.key_segments]), axis=1)
        win = np.argmax(options, axis=1)  # (phases, P): 0 the level before, i the phase's i-th segment
        total = options[plan.key_index, win, cols]
        seg = plan.key_segments[plan.key_index, np.maximum(win - 1, 0)]
        where = np.where(win > 0, moment[seg, cols], plan.key_start[:, None])
        read_at = win > 0
        # the step's peak: the first segment whose highest row beats every earlier one (and zero)
        options = np.concatenate((np.zeros((1, points), dtype=top.dtype), top))
        win = np.argmax(options, axis=0)
        best = options[win, cols]
        best_where = np.where(win > 0, moment[np.maximum(win - 1, 0), cols], 0)
        best_key = np.where(win > 0, plan.segment_key[np.maximum(win - 1, 0)], plan.segment_key[0])

        # bytes per kind at the rows read: each (kind, size) pair's count times its size, summed by kind
        rows = np.concatenate((where, best_where[None]))  # (phases + 1, P)
        at = np.concatenate((read_at, np.ones((1, points), dtype=bool)))
        counts = plan.kinds[rows]  # (phases + 1, P, pairs), the repeats of earlier blocks included
        if len(plan.block_end):
            bi = np.maximum(plan.block_of[rows], 0)
            inside = (plan.block_of[rows] >= 0) & np.where(at, added[bi, cols] > 0, plan.ends_block[rows] == 1)
            counts = counts + plan.block_kinds[bi] * inside[..., None]
        kinds = mm(counts * rounded[plan.pair_size].T, plan.kind_sum)  # (phases + 1, P, K)
        as_int = functools.partial(np.asarray, dtype=np.int64)
        largest = as_int(rounded.max(axis=0)) if len(rounded) else np.zeros(points, np.int64)
        return Evaluations(self.phase_keys, as_int(best), as_int(kinds[-1]), best_key, as_int(total),
                           as_int(kinds[:-1]), largest)

    # ---- structure ---------------------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """The tabulated structure, built on first use (tapes recorded for the allocator never need it)."""
        with self._plan_lock:  # the window's replay thread may evaluate the same tape
            if self._plan is None:
                self._plan = self._build_plan().with_tables(np.float64)  # one dtype kept: an MoE tape's are large
                self._coefficients = []  # only the plan needed them
        return self._plan

    def _build_plan(self) -> Plan:
        n = self.n
        distinct: dict[tuple[int, ...], int] = {}  # the distinct size polynomials, and each event's
        coefficients = self._coefficients if self._coefficients is not None else map(tuple, self.coef.tolist())
        size_of = np.array([distinct.setdefault(c, len(distinct)) for c in coefficients], dtype=np.int64)
        sizes = np.array(list(distinct), dtype=np.int64).reshape(-1, len(MONOMIALS))
        nsizes = len(sizes)
        weight = np.bincount(size_of, weights=self.row_mult, minlength=nsizes).astype(np.float64)
        bound = weight @ np.abs(sizes).astype(np.float64)
        reclass = self.sign == 0
        zero = ~self.coef.any(axis=1)
        moves = (self.sign != 0) & ~zero  # changes the live level (at some point)
        surely_up = (self.sign > 0) & (self.coef >= 0).all(axis=1) & ~zero  # raises it at every point

        # where the block bookkeeping is constant: phase segments cut at block starts and after block ends
        cuts = {a for _ph, a, _e in self.segments} | set(self.block_first.tolist()) | \
            {int(e) + 1 for e in self.block_last.tolist()}
        cuts = sorted(c for c in cuts if c < n)
        region_end = np.empty(n, dtype=np.int64)
        for c, nxt in zip(cuts, cuts[1:] + [n]):
            region_end[c:nxt] = nxt
        # the next event that moves the level, for every event (n: none)
        moving = np.flatnonzero(moves)
        pos = np.searchsorted(moving, np.arange(n), side="right")
        next_move = np.where(pos < len(moving), moving[np.minimum(pos, len(moving) - 1)], n)
        rises = (self.sign > 0) & ~zero
        blocked = (next_move < region_end) & surely_up[np.minimum(next_move, n - 1)] if n else np.zeros(0, bool)
        is_candidate = rises & ~blocked
        is_candidate[cuts] = True
        candidate_rows = np.flatnonzero(is_candidate)

        # the breakdown of a peak at event j is read at the first free after it, within its phase
        frees = np.flatnonzero(self.sign < 0)
        seg_end = np.empty(n, dtype=np.int64)
        for _ph, a, e in self.segments:
            seg_end[a:e] = e
        fpos = np.searchsorted(frees, candidate_rows, side="right")
        next_free = np.where(fpos < len(frees), frees[np.minimum(fpos, len(frees) - 1)], n)
        moments = np.minimum(next_free, seg_end[candidate_rows]) - 1

        seg_before = np.array([a - 1 for _ph, a, _e in self.segments], dtype=np.int64)
        needed = np.unique(np.concatenate(([-1], candidate_rows, moments, seg_before, self.block_last,
                                           self.block_first - 1)))
        rows = len(needed)

        def at(events: np.ndarray) -> np.ndarray:
            """Positions in ``needed`` of events that are in it."""
            return np.searchsorted(needed, events)

        # signed counts of each size (live bytes) and of each (kind, size) pair up to each needed row: every
        # event counted at the first needed row at or after it, then summed along the rows
        bucket = np.searchsorted(needed, np.arange(n))
        live = np.zeros((rows + 1, nsizes), dtype=np.int64)
        np.add.at(live, (bucket, size_of), self.sign)
        live = np.cumsum(live[:rows], axis=0)
        pair_rows = np.concatenate((np.arange(n), np.flatnonzero(reclass)))
        pair_kind = np.concatenate((self.kind, self.new_kind[reclass]))
        pair_sizes = np.concatenate((size_of, size_of[reclass]))
        pair_sign = np.concatenate((np.where(reclass, -1, self.sign), np.ones(int(reclass.sum()), dtype=np.int64)))
        pair_ids, pair_of = np.unique(pair_kind * max(nsizes, 1) + pair_sizes, return_inverse=True)
        pair_of = pair_of.reshape(-1)
        pairs = np.stack((pair_ids // max(nsizes, 1), pair_ids % max(nsizes, 1)), axis=1)
        kinds = np.zeros((rows + 1, len(pairs)), dtype=np.int64)
        np.add.at(kinds, (bucket[pair_rows], pair_of), pair_sign)
        kinds = np.cumsum(kinds[:rows], axis=0)

        seg_starts = np.array([a for _ph, a, _e in self.segments], dtype=np.int64)
        seg_of_candidate = np.searchsorted(seg_starts, candidate_rows, side="right") - 1
        per_segment = [at(candidate_rows[seg_of_candidate == k]).tolist() for k in range(len(self.segments))]
        candidate_table = np.array([c + c[:1] * (max(map(len, per_segment)) - len(c)) for c in per_segment],
                                   dtype=np.int64).reshape(len(per_segment), -1)
        moment = np.zeros(rows, dtype=np.int64)
        moment[at(candidate_rows)] = at(moments)
        segment_key = np.array([self.key_of_phase[ph] for ph, _a, _e in self.segments], dtype=np.int64)
        seg_start = at(seg_before)
        by_key = [np.flatnonzero(segment_key == k).tolist() for k in range(len(self.phase_keys))]
        key_segments = np.array([segs + segs[:1] * (max(map(len, by_key)) - len(segs)) for segs in by_key],
                                dtype=np.int64).reshape(len(by_key), -1)
        key_start = np.array([seg_start[segs[0]] for segs in by_key], dtype=np.int64)
        kind_sum = np.zeros((len(pairs), K), dtype=np.int64)
        kind_sum[np.arange(len(pairs)), pairs[:, 0]] = 1
        blocks_before = np.searchsorted(self.block_last, needed, side="left")
        first = np.searchsorted(self.block_first, needed, side="right") - 1  # the last block starting at or before
        block_of = np.where((first >= 0) & (needed <= self.block_last[np.maximum(first, 0)] if len(self.block_last)
                                            else False), first, -1)
        ends_block = np.isin(needed, self.block_last).astype(np.int64)
        block_end = at(self.block_last)
        block_before = at(self.block_first - 1)
        block_added = (self.block_mult - 1)[:, None] * (live[block_end] - live[block_before])
        prefix = np.concatenate((np.zeros((1, nsizes), dtype=np.int64), np.cumsum(block_added, axis=0)))
        in_block = (block_of[:, None] == np.arange(len(block_end))[None, :]).astype(np.int64)
        block_kinds = (self.block_mult - 1)[:, None] * (kinds[block_end] - kinds[block_before])
        kinds_prefix = np.concatenate((np.zeros((1, len(pairs)), dtype=np.int64), np.cumsum(block_kinds, axis=0)))
        return Plan(sizes, bound, float(BLOCK * weight.sum()), needed, live, block_added, live + prefix[blocks_before],
                     live + prefix[blocks_before + ends_block], in_block, kinds + kinds_prefix[blocks_before],
                     block_kinds, pairs[:, 0].copy(),
                     pairs[:, 1].copy(), kind_sum, candidate_table, moment, segment_key, key_start, key_segments,
                     np.arange(len(self.segments))[:, None], np.arange(len(by_key))[:, None],
                     block_end, block_before, blocks_before, block_of, ends_block)


def _monomials(points: np.ndarray) -> np.ndarray:
    """(monomials, P): every monomial of :data:`~.poly.MONOMIALS` at every (b, s, r) row of ``points``."""
    b, s, r = points.T
    return np.stack(np.broadcast_arrays(*monomial_values(b, s, r)))
