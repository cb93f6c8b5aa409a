"""difflib's alignment of two traces, without its quadratic longest match.

``difflib.SequenceMatcher`` (no junk, ``autojunk=False``) aligns two sequences by taking the longest common
stretch of the ranges left (the first to end in ``a``, then the first in ``b``) and recursing on either side. Its
``find_longest_match`` walks every pair of equal events, which is quadratic on traces whose events repeat (a
traced GRPO step of a VLM: ~40,000 and ~51,000 events, each kind thousands of times; 40 minutes and more).
Here the same longest match is read from a suffix automaton of the ``b`` range (its states carry the first
place each stretch ends), walked once over the ``a`` range: linear in the two ranges. Where one more layer runs
in every generated token's forward, difflib looks again and again right of the last match, in the same range
less the part left of it: the stretches read in the wider range answer the narrower one wherever they prove it
(numpy over the range, a byte search for the few places they leave open), so the automaton is rarely built again.
The recursion and the opcodes are difflib's own, so the answer is difflib's, event for event."""

from __future__ import annotations

import difflib

import numpy as np


def _automaton(b: list, blo: int, bhi: int) -> tuple[list, list, list, list, list]:
    """The suffix automaton of ``b[blo:bhi]``: per state its transitions, suffix link, longest length, and the
    first and last places (in ``b``) that its stretches end."""
    nxt: list[dict] = [{}]
    link, length, first = [-1], [0], [-1]
    last = 0
    for pos in range(blo, bhi):
        c = b[pos]
        cur = len(nxt)
        nxt.append({})
        link.append(0)
        length.append(length[last] + 1)
        first.append(pos)
        p = last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                first.append(first[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        last = cur
    # the last place a state's stretches end: its own or one of the states whose suffix link leads to it
    final = list(first)
    for v in sorted(range(1, len(nxt)), key=length.__getitem__, reverse=True):
        final[link[v]] = max(final[link[v]], final[v])
    return nxt, link, length, first, final


def _scan(a: list, alo: int, ahi: int, blo: int, sam: tuple) -> tuple[tuple[int, int, int], list, list]:
    """difflib's longest match of ``a[alo:ahi]`` in the automaton's range, and per place ``e`` of ``a`` the
    longest stretch of ``a[alo:e + 1]`` that ends there and occurs in the range, and the last place it ends."""
    nxt, link, length, first, final = sam
    best, besti, bestj = 0, alo, blo
    longest, ends = [], []
    v, n = 0, 0
    for i in range(alo, ahi):
        c = a[i]
        while v and c not in nxt[v]:
            v = link[v]
            n = length[v]
        if c in nxt[v]:
            v = nxt[v][c]
            n += 1
        else:
            n = 0
        longest.append(n)
        ends.append(final[v])
        if n > best:  # strictly longer: the first to end in a keeps the tie; first[v], the first in b
            best, besti, bestj = n, i - n + 1, first[v] - n + 1
    return (besti, bestj, best), longest, ends


class Matcher(difflib.SequenceMatcher):
    """``difflib.SequenceMatcher(None, a, b, autojunk=False)`` of two sequences of integers, its longest match
    found in linear time. difflib looks for the longest match right of the last one in the same range ends
    (``ahi``, ``bhi``) again and again; the stretches an earlier look read there answer it where they prove it,
    else the automaton is built again."""

    KEEP = 4  # the ranges whose stretches are kept

    def __init__(self, a: list[int], b: list[int]) -> None:
        super().__init__(None, a, b, autojunk=False)
        self._a = np.asarray(a, dtype=np.int64)
        self._a_bytes = self._a.astype(np.int32).tobytes()
        self._b_bytes = np.asarray(b, dtype=np.int64).astype(np.int32).tobytes()
        # (ahi, bhi) -> (alo, blo, the longest stretch ending at each place of a[alo:ahi], where it ends last)
        self._read: dict[tuple[int, int], tuple[int, int, np.ndarray, np.ndarray]] = {}

    def find_longest_match(self, alo: int = 0, ahi: int | None = None, blo: int = 0,
                           bhi: int | None = None) -> difflib.Match:
        ahi = len(self.a) if ahi is None else ahi
        bhi = len(self.b) if bhi is None else bhi
        if ahi - alo == bhi - blo and self.a[alo:ahi] == self.b[blo:bhi]:
            return difflib.Match(alo, blo, ahi - alo)
        known = self._read.get((ahi, bhi))
        if known is not None and known[0] <= alo and known[1] <= blo:
            found = self._from_read(alo, ahi, blo, bhi, *known)
            if found is not None:
                return difflib.Match(*found)
        match, longest, ends = _scan(self.a, alo, ahi, blo, _automaton(self.b, blo, bhi))
        if len(self._read) >= self.KEEP:
            del self._read[next(iter(self._read))]
        self._read[(ahi, bhi)] = (alo, blo, np.array(longest, dtype=np.int64), np.array(ends, dtype=np.int64))
        return difflib.Match(*match)

    def _occurs(self, i: int, n: int, blo: int, bhi: int) -> int:
        """Where ``a[i:i + n]`` first occurs in ``b[blo:bhi]``; -1: nowhere."""
        needle = self._a_bytes[4 * i:4 * (i + n)]
        at = self._b_bytes.find(needle, 4 * blo, 4 * bhi)
        while at >= 0 and at % 4:  # a match across two events' bytes (find's -1 is none: -1 % 4 is 3)
            at = self._b_bytes.find(needle, at + 1, 4 * bhi)
        return at // 4 if at >= 0 else -1

    def _from_read(self, alo: int, ahi: int, blo: int, bhi: int, alo0: int, blo0: int, longest: np.ndarray,
                   ends: np.ndarray) -> tuple[int, int, int] | None:
        """The longest match in ``a[alo:ahi]``, ``b[blo:bhi]`` from the stretches read in a range holding it
        (they are at least as long): a stretch that lies in the narrower range is its own there; one that does
        not bounds the stretch ending at its place. None where the bounds leave it open."""
        n = longest[alo - alo0:]
        e = np.arange(alo, ahi)
        in_a = n <= e - alo + 1  # starts in a[alo:]
        in_b = (ends[alo - alo0:] - n + 1 >= blo) | (n == 0)  # occurs (its last time) in b[blo:]
        held = in_a & in_b
        if not held.any():
            return None
        best = int(n[held].max())
        if best == 0:
            return None
        at = int(np.flatnonzero(held & (n == best))[0]) + alo  # the first place the longest held one ends
        bound = np.where(in_a, n - 1, e - alo + 1)  # not held: shorter than read there, or cut at alo
        open_ = np.flatnonzero(~held & ((bound > best) | ((bound == best) & (e < at)))) + alo
        if len(open_) > 16:
            return None
        # each open place: the stretch of the best length ending there must not occur in the narrower range
        if any(self._occurs(x - best + 1, best, blo, bhi) >= 0 for x in open_.tolist()):
            return None
        return at - best + 1, self._occurs(at - best + 1, best, blo, bhi), best


def opcodes(a: list, b: list) -> list[tuple[str, int, int, int, int]]:
    """``difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()``."""
    codes: dict = {}
    return Matcher([codes.setdefault(t, len(codes)) for t in a], [codes.setdefault(t, len(codes)) for t in b]
                   ).get_opcodes()
