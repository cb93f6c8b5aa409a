"""Sizes as polynomials in micro-batch ``b``, sequence length ``s`` and LoRA rank ``r``.

A tape recorded once with symbolic sizes can be evaluated for any (b, s, r) without replaying the
step, which is what makes sweeps cheap. Every element count in the training step is a polynomial over
the monomials 1, b, s, r, bs, bs², bsr, br with integer coefficients (the model's dimensions).
"""

from __future__ import annotations

MONOMIALS = ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 2, 0), (1, 1, 1), (1, 0, 1))
_INDEX = {m: i for i, m in enumerate(MONOMIALS)}
N = len(MONOMIALS)
_GENERIC = (3, 257, 7)  # a point where no structural comparison is accidentally equal


class P:
    """An integer polynomial over :data:`MONOMIALS` (coefficients in that order)."""

    __slots__ = ("c",)

    def __init__(self, c: tuple[int, ...]) -> None:
        self.c = c

    @staticmethod
    def of(x: int | P) -> P:
        if x.__class__ is P:
            return x
        return P((int(x),) + _ZEROS) if x else ZERO

    @staticmethod
    def var(name: str) -> P:
        c = [0] * N
        c[{"b": 1, "s": 2, "r": 3}[name]] = 1
        return P(tuple(c))

    def __add__(self, o: int | P) -> P:
        o = P.of(o)
        return P(tuple(a + b for a, b in zip(self.c, o.c)))

    __radd__ = __add__

    def __sub__(self, o: int | P) -> P:
        o = P.of(o)
        return P(tuple(a - b for a, b in zip(self.c, o.c)))

    def __rsub__(self, o: int | P) -> P:
        return P.of(o) - self

    def __neg__(self) -> P:
        return P(tuple(-a for a in self.c))

    def __mul__(self, o: int | P) -> P:
        if not isinstance(o, P):
            return P(tuple(a * o for a in self.c))
        out = [0] * N
        for i, a in enumerate(self.c):
            if not a:
                continue
            for j, b in enumerate(o.c):
                if not b:
                    continue
                m = tuple(x + y for x, y in zip(MONOMIALS[i], MONOMIALS[j]))
                k = _INDEX.get(m)
                if k is None:
                    raise ValueError(f"monomial b^{m[0]} s^{m[1]} r^{m[2]} is outside the size basis")
                out[k] += a * b
        return P(tuple(out))

    __rmul__ = __mul__

    def __floordiv__(self, d: int) -> P:
        if any(a % d for a in self.c):
            raise ValueError(f"{self} is not divisible by {d}")
        return P(tuple(a // d for a in self.c))

    def value(self, b: int, s: int, r: int) -> int:
        v = monomial_values(b, s, r)
        return sum(a * x for a, x in zip(self.c, v))

    def generic(self) -> int:
        return self.value(*_GENERIC)

    def __eq__(self, o: object) -> bool:
        if isinstance(o, (int, P)):
            return self.c == P.of(o).c
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.c)

    def __lt__(self, o: int | P) -> bool:
        return self.generic() < P.of(o).generic()

    def __gt__(self, o: int | P) -> bool:
        return self.generic() > P.of(o).generic()

    def __bool__(self) -> bool:
        return any(self.c)

    def __repr__(self) -> str:
        names = ("", "b", "s", "r", "bs", "bs²", "bsr", "br")
        terms = [f"{a}{n}" for a, n in zip(self.c, names) if a]
        return "+".join(terms) or "0"


_ZEROS = (0,) * (N - 1)
ZERO = P((0,) * N)  # polynomials are immutable: one zero serves every empty size


def monomial_values(b: int, s: int, r: int) -> tuple[int, ...]:
    return (1, b, s, r, b * s, b * s * s, b * s * r, b * r)
