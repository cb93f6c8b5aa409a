"""The trace's exact solve: which (batch, sequence, rank) points determine every size as an integer polynomial
in the estimator's monomials, the rational elimination over them, the sizes computed from each tensor's
dimensions, and the stretches of events that one more layer adds (the tape's blocks, placed in a deeper run).
Pure arithmetic on recorded traces: nothing here runs a model."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from vramlab.core.estimator.poly import MONOMIALS, N
from vramlab.core.estimator.stored import TracedTape
from vramlab.core.tracing import align
from vramlab.core.tracing.capture import PHASE, RECLASSIFY, Trace, TraceFailed

B_FIT, B_CHECK = (2, 3), 5
R_FIT, R_CHECK = (4, 8), 6


def basis(symbolic: tuple[bool, bool, bool]) -> list[int]:
    """The monomials (indices into MONOMIALS) a size is fitted over: where a size is concrete, monomials
    that differ only in its power are one column, kept as the one with the lowest such power (so that its
    coefficient stays a whole number: at a fixed s, ``bsr`` and ``br`` are both ``br`` times a constant)."""
    groups: dict[tuple[int, ...], int] = {}
    for i, m in enumerate(MONOMIALS):
        effective = tuple(e if sym else 0 for e, sym in zip(m, symbolic))
        concrete = sum(e for e, sym in zip(m, symbolic) if not sym)
        j = groups.get(effective)
        if j is None or concrete < sum(e for e, sym in zip(MONOMIALS[j], symbolic) if not sym):
            groups[effective] = i
    return sorted(groups.values())


def _row(cols: list[int], b: int, s: int, r: int) -> list[int]:
    v = (1, b, s, r, b * s, b * s * s, b * s * r, b * r)
    return [v[i] for i in cols]


def choose_points(candidates: list[tuple[int, int, int]], cols: list[int]) -> list[tuple[int, int, int]]:
    """The first candidates (in order) that together determine every coefficient over ``cols``."""
    chosen: list[tuple[int, int, int]] = []
    rank = 0
    for p in candidates:
        trial = np.array([_row(cols, *q) for q in (*chosen, p)], dtype=np.float64)
        if np.linalg.matrix_rank(trial) > rank:
            chosen.append(p)
            rank += 1
            if rank == len(cols):
                return chosen
    raise TraceFailed("the fit points do not determine the sizes")


def solve_exact(points: list[tuple[int, int, int]], cols: list[int], sizes: np.ndarray) -> np.ndarray:
    """Integer coefficients (allocations x monomials) with ``sizes[p, a]`` the size of allocation ``a``
    at point ``p``; exact rational elimination over the distinct size columns. Raises TraceFailed when a
    size is not an integer polynomial of that form."""
    distinct, inverse = np.unique(sizes, axis=1, return_inverse=True)
    inverse = inverse.reshape(-1)
    k = len(cols)
    inv = _inverse([[Fraction(v) for v in _row(cols, *p)] for p in points])  # once (k <= 8)
    coef = np.zeros((distinct.shape[1], N), dtype=np.int64)
    for u in range(distinct.shape[1]):
        y = [int(v) for v in distinct[:, u]]
        for i, col in enumerate(cols):
            c = sum((inv[i][j] * y[j] for j in range(k)), Fraction(0))
            if c.denominator != 1:
                raise TraceFailed("an allocation's size is not a polynomial in batch, sequence and rank")
            coef[u, col] = int(c)
    return coef[inverse]


_DIM_MONOMIALS = (0, 1, 2, 3, 4)  # 1, b, s, r, bs: what one dimension of a tensor is made of (b x s: tokens)


def dim_basis(symbolic: tuple[bool, bool, bool]) -> list[int]:
    """The monomials (of :func:`basis`) a tensor dimension is fitted over."""
    return [i for i in basis(symbolic) if i in _DIM_MONOMIALS]


def sizes_from_dims(dims: list[list[tuple[int, tuple[int, ...]] | None]], ran: list[tuple[int, int, int]],
                    points: list[tuple[int, int, int]], cols: list[int]) -> np.ndarray:
    """Every allocation's size at each of ``points`` from its dimensions at ``ran`` (``dims[i][a]``: allocation
    ``a``'s bytes per element and shape at ``ran[i]``; points that determine a polynomial over ``cols``): each
    dimension of each allocated tensor fitted exactly as an integer polynomial over ``cols`` (1, b, s, r, bs, as
    far as they vary), times its bytes per element. Where every dimension has that form, this is what a trace
    at the other points measures; the tape fitted from it is verified at a further point like any other.
    Raises TraceFailed where an allocation has no such form (its rank or bytes per element differ between
    runs, its storage is not one tensor's elements, or a dimension is not such a polynomial)."""
    count = len(dims[0])
    width = 0
    for row in dims:
        if len(row) != count:
            raise TraceFailed("the runs differ in form")
        for d in row:
            if d is None:
                raise TraceFailed("an allocation is not one tensor's elements")
            width = max(width, len(d[1]))
    values = np.ones((len(dims), count, width), dtype=np.int64)  # missing leading dimensions: 1
    for i, row in enumerate(dims):
        for a, (per, shape) in enumerate(row):
            if len(shape) != len(dims[0][a][1]) or per != dims[0][a][0]:
                raise TraceFailed("an allocation changes its rank or element size between runs")
            values[i, a, width - len(shape):] = shape
    if len(ran) != len(cols):
        raise TraceFailed("the runs do not determine the dimensions")
    inv = _inverse([[Fraction(v) for v in _row(cols, *p)] for p in ran])
    scale = 1
    for row in inv:
        for v in row:
            scale = scale * v.denominator // np.gcd(scale, v.denominator)
    adj = np.array([[int(v * scale) for v in row] for row in inv], dtype=np.int64)
    flat = values.reshape(len(dims), -1)
    scaled = adj @ flat  # each dimension's coefficients over cols, times scale
    if np.any(scaled % scale):
        raise TraceFailed("a tensor dimension is not a polynomial in batch, sequence and rank")
    coef = scaled // scale
    at = np.array([_row(cols, *p) for p in points], dtype=np.int64) @ coef
    per = np.array([d[0] for d in dims[0]], dtype=np.int64)
    return at.reshape(len(points), count, width).prod(axis=2) * per


def _inverse(x: list[list[Fraction]]) -> list[list[Fraction]]:
    """The inverse of a small square matrix, exactly (Gauss-Jordan over fractions)."""
    k = len(x)
    inv = [[Fraction(int(i == j)) for j in range(k)] for i in range(k)]
    a = [row[:] for row in x]
    for c in range(k):
        pivot = next(i for i in range(c, k) if a[i][c] != 0)
        a[c], a[pivot] = a[pivot], a[c]
        inv[c], inv[pivot] = inv[pivot], inv[c]
        f = a[c][c]
        a[c] = [v / f for v in a[c]]
        inv[c] = [v / f for v in inv[c]]
        for i in range(k):
            if i != c and a[i][c] != 0:
                g = a[i][c]
                a[i] = [u - g * v for u, v in zip(a[i], a[c])]
                inv[i] = [u - g * v for u, v in zip(inv[i], inv[c])]
    return inv


def values_at(coef: np.ndarray, b: int, s: int, r: int) -> list[int]:
    v = np.array((1, b, s, r, b * s, b * s * s, b * s * r, b * r), dtype=np.int64)
    return (coef @ v).tolist()


def layer_chunks(low: Trace, template: Trace) -> list[tuple[int, int]]:
    """The stretches of ``template`` (one layer more than ``low``) that the extra layer adds: the
    difference must be pure insertions."""
    out = []
    for tag, _i1, _i2, j1, j2 in align.opcodes(low.tokens(), template.tokens()):  # difflib's, linear per match
        if tag == "equal":
            continue
        if tag != "insert":
            raise TraceFailed("one more layer changes more than it adds (the layers do not repeat identically)")
        # a stretch that ends a run of reclassifications and starts another run (of allocations: peft's
        # adapters, then the parameters classified) may be read across the two runs; each half repeats
        # within its own run
        cuts = [j for j in range(j1 + 1, j2)
                if (template.ops[j][0] == RECLASSIFY) != (template.ops[j - 1][0] == RECLASSIFY)]
        if len(cuts) == 1:
            out.extend([(j1, cuts[0]), (cuts[0], j2)])
        else:
            out.append((j1, j2))
    if any(template.ops[j][0] == PHASE for a, b in out for j in range(a, b)):
        raise TraceFailed("one more layer adds a phase")
    return out


def expanded(tokens: np.ndarray, chunks: list[tuple[int, int]], reps: int) -> tuple[np.ndarray, list[int]]:
    """``tokens`` with each chunk written ``reps`` times, and where each chunk starts in the result."""
    parts, starts, at, shift = [], [], 0, 0
    for a, b in chunks:
        parts.append(tokens[at:a])
        starts.append(a + shift)
        parts.extend([tokens[a:b]] * reps)
        shift += (reps - 1) * (b - a)
        at = b
    parts.append(tokens[at:])
    return np.concatenate(parts) if parts else tokens, starts


def place_chunks(template: np.ndarray, chunks: list[tuple[int, int]], target: np.ndarray,
                 reps: int) -> list[tuple[int, int]] | None:
    """Where each added stretch of ``template`` really is one layer. The difference of two depths says
    what one more layer adds, but a stretch inside a run of alike layers can be read at several offsets
    (shifted while the event leaving it equals the one entering it), and one read across the end of one
    run and the start of the next (the optimizer's per-tensor temporaries, then its frees) is two
    stretches, and two read with a few events of another layer between them are one. Chunk by chunk, left
    to right, each is shifted, cut in two, or joined with the next, until ``template`` with every chunk
    repeated ``reps`` times reads as ``target`` (a trace with that many more layers) past it. None: no
    placement does."""

    def mismatch(ch: list[tuple[int, int]]) -> int:
        got, _ = expanded(template, ch, reps)
        n = min(len(got), len(target))
        bad = np.flatnonzero(got[:n] != target[:n])
        return int(bad[0]) if len(bad) else (n if len(got) != len(target) else -1)

    def done_past(ch: list[tuple[int, int]], c: int) -> bool:
        m = mismatch(ch)
        if m < 0:
            return True
        _, starts = expanded(template, ch, reps)
        a, b = ch[c]
        return m >= starts[c] + reps * (b - a)

    def shifted(ch: list[tuple[int, int]], c: int, right: bool = True) -> list[tuple[int, int]] | None:
        a, b = ch[c]
        lo = ch[c - 1][1] if c else 0
        hi = ch[c + 1][0] if c + 1 < len(ch) else len(template)
        options = [0]
        k = 1
        while right and b + k - 1 < hi and template[a + k - 1] == template[b + k - 1]:
            options.append(k)
            k += 1
        k = -1
        while a + k >= lo and template[a + k] == template[b + k]:
            options.append(k)
            k -= 1
        for k in sorted(options, key=abs):
            trial = ch[:c] + [(a + k, b + k)] + ch[c + 1:]
            if done_past(trial, c):
                return trial
        return None

    def merged(ch: list[tuple[int, int]], c: int) -> list[tuple[int, int]] | None:
        """Chunks c and c + 1 as one stretch of their joint length that removes the same events."""
        (a1, b1), (a2, b2) = ch[c], ch[c + 1]
        length = (b1 - a1) + (b2 - a2)
        lo = ch[c - 1][1] if c else 0
        hi = ch[c + 2][0] if c + 2 < len(ch) else len(template)
        rest = np.concatenate((template[lo:a1], template[b1:a2], template[b2:hi]))
        for w in range(lo, hi - length + 1):
            if np.array_equal(np.concatenate((template[lo:w], template[w + length:hi])), rest):
                trial = ch[:c] + [(w, w + length)] + ch[c + 2:]
                if done_past(trial, c):
                    return trial
        return None

    chunks = list(chunks)
    c = 0
    while c < len(chunks):
        found = shifted(chunks, c)
        step = 1
        if found is None:  # cut in two where the events change, each part placed on its own
            a, b = chunks[c]
            for p in range(a + 1, b):
                if template[p] == template[p - 1]:
                    continue
                first = shifted(chunks[:c] + [(a, p), (p, b)] + chunks[c + 1:], c, right=False)
                found = shifted(first, c + 1) if first is not None else None
                if found is not None:
                    step = 2
                    break
        if found is None and c + 1 < len(chunks):  # two stretches with a few events between: one layer
            found = merged(chunks, c)
        if found is None:
            return None
        chunks = found
        c += step
    return chunks


def make_tape(template: Trace, coef: np.ndarray, tag: np.ndarray, mult: dict[int, int],
              symbolic: tuple[bool, bool, bool], total: int, base: int, per_rank: int, mode: str, note: str,
              seconds: float) -> TracedTape:
    """The tape of ``template``'s events sized by ``coef``; its meta names the modules LoRA adapted."""
    import transformers

    rows = len(template.ops)
    out_coef = np.zeros((rows, N), dtype=np.int64)
    sign = np.zeros(rows, dtype=np.int64)
    kind = np.zeros(rows, dtype=np.int64)
    new_kind = np.zeros(rows, dtype=np.int64)
    phase = np.zeros(rows, dtype=np.int64)
    ref = np.full(rows, -1, dtype=np.int64)
    for i, (op, a, k, nk, ph) in enumerate(template.ops):
        phase[i] = ph
        if op == PHASE:
                sign[i] = 1
                continue
        out_coef[i] = coef[a]
        sign[i] = op
        kind[i] = k
        new_kind[i] = nk
        ref[i] = a
    meta: dict = {"lora_modules": list(template.adapted)} if template.adapted else {}
    if template.build_notes:
        meta["notes"] = list(template.build_notes)
    return TracedTape(out_coef, sign, kind, new_kind, tag, phase, ref, tuple(template.phases), mult, symbolic,
                          total, base, per_rank, mode, note, transformers.__version__, seconds, meta)
