"""difflib's alignment of two traces, in linear time per match.

``difflib.SequenceMatcher`` (no junk, ``autojunk=False``) aligns two sequences by taking the longest common
stretch of the ranges left (the first to end in ``a``, then the first in ``b``) and recursing on either side. Its
``find_longest_match`` walks every pair of equal events, which is quadratic on traces whose events repeat (a
traced GRPO step of a VLM: ~40,000 and ~51,000 events, each kind thousands of times; 40 minutes and more).
Here the same longest match is read from a suffix automaton of the ``b`` range (its states carry the first
place each stretch ends), walked once over the ``a`` range: linear in the two ranges. The recursion and the
opcodes are difflib's own, so the answer is difflib's, event for event."""

from __future__ import annotations

import difflib


def longest_match(a: list, alo: int, ahi: int, b: list, blo: int, bhi: int) -> tuple[int, int, int]:
    """The longest common stretch of ``a[alo:ahi]`` and ``b[blo:bhi]`` as difflib picks it (without junk): of
    the longest, the one ending first in ``a``, then first in ``b``. ``(alo, blo, 0)`` when there is none."""
    if ahi - alo == bhi - blo and a[alo:ahi] == b[blo:bhi]:
        return alo, blo, ahi - alo
    # the suffix automaton of b[blo:bhi]: per state its transitions, suffix link, longest length and the
    # first place (in b) that its stretches end
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
    best, besti, bestj = 0, alo, blo
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
        if n > best:  # strictly longer: the first to end in a keeps the tie; first[v], the first in b
            best, besti, bestj = n, i - n + 1, first[v] - n + 1
    return besti, bestj, best


class Matcher(difflib.SequenceMatcher):
    """``difflib.SequenceMatcher(None, a, b, autojunk=False)`` with its longest match found in linear time."""

    def __init__(self, a: list, b: list) -> None:
        super().__init__(None, a, b, autojunk=False)

    def find_longest_match(self, alo: int = 0, ahi: int | None = None, blo: int = 0,
                           bhi: int | None = None) -> difflib.Match:
        ahi = len(self.a) if ahi is None else ahi
        bhi = len(self.b) if bhi is None else bhi
        return difflib.Match(*longest_match(self.a, alo, ahi, self.b, blo, bhi))


def opcodes(a: list, b: list) -> list[tuple[str, int, int, int, int]]:
    """``difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()``."""
    return Matcher(a, b).get_opcodes()
