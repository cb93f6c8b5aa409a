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


class Poly:
    """An integer polynomial over :data:`MONOMIALS` (coefficients in that order)."""

    __slots__ = ("coefficients",)

    def __init__(self, coefficients: tuple[int, ...]) -> None:
        self.coefficients = coefficients

    @staticmethod
    def of(x: int | Poly) -> Poly:
        if x.__class__ is Poly:
            return x
        if x.__class__ is int:  # a concrete size: one Poly per value (a step with concrete sizes repeats them)
            p = _CONSTANTS.get(x)
            if p is None:
                if len(_CONSTANTS) >= 4096:
                    _CONSTANTS.clear()
                p = _CONSTANTS[x] = Poly((x,) + _ZEROS) if x else ZERO
            return p
        return Poly((int(x),) + _ZEROS) if x else ZERO

    @staticmethod
    def var(name: str) -> Poly:
        coefficients = [0] * N
        coefficients[{"b": 1, "s": 2, "r": 3}[name]] = 1
        return Poly(tuple(coefficients))

    def __add__(self, other: int | Poly) -> Poly:
        other = Poly.of(other)
        return Poly(tuple(a + b for a, b in zip(self.coefficients, other.coefficients)))

    __radd__ = __add__

    def __sub__(self, other: int | Poly) -> Poly:
        other = Poly.of(other)
        return Poly(tuple(a - b for a, b in zip(self.coefficients, other.coefficients)))

    def __rsub__(self, other: int | Poly) -> Poly:
        return Poly.of(other) - self

    def __neg__(self) -> Poly:
        return Poly(tuple(-a for a in self.coefficients))

    def __mul__(self, other: int | Poly) -> Poly:
        if not isinstance(other, Poly):
            return Poly(tuple(a * other for a in self.coefficients))
        out = [0] * N
        for i, a in enumerate(self.coefficients):
            if not a:
                continue
            for j, b in enumerate(other.coefficients):
                if not b:
                    continue
                m = tuple(x + y for x, y in zip(MONOMIALS[i], MONOMIALS[j]))
                k = _INDEX.get(m)
                if k is None:
                    raise ValueError(f"monomial b^{m[0]} s^{m[1]} r^{m[2]} is outside the size basis")
                out[k] += a * b
        return Poly(tuple(out))

    __rmul__ = __mul__

    def __floordiv__(self, d: int) -> Poly:
        if any(a % d for a in self.coefficients):
            raise ValueError(f"{self} is not divisible by {d}")
        return Poly(tuple(a // d for a in self.coefficients))

    def value(self, b: int, s: int, r: int) -> int:
        v = monomial_values(b, s, r)
        return sum(a * x for a, x in zip(self.coefficients, v))

    def generic(self) -> int:
        return self.value(*_GENERIC)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (int, Poly)):
            return self.coefficients == Poly.of(other).coefficients
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.coefficients)

    def __lt__(self, other: int | Poly) -> bool:
        return self.generic() < Poly.of(other).generic()

    def __gt__(self, other: int | Poly) -> bool:
        return self.generic() > Poly.of(other).generic()

    def __bool__(self) -> bool:
        return self.coefficients != _ALL_ZERO  # a tuple comparison: any() costs three times as much

    def __repr__(self) -> str:
        names = ("", "b", "s", "r", "bs", "bs²", "bsr", "br")
        terms = [f"{a}{n}" for a, n in zip(self.coefficients, names) if a]
        return "+".join(terms) or "0"


_ZEROS = (0,) * (N - 1)
_ALL_ZERO = (0,) * N
_CONSTANTS: dict[int, Poly] = {}  # Poly.of's constants by value (polynomials are immutable)
ZERO = Poly((0,) * N)  # polynomials are immutable: one zero serves every empty size


def monomial_values(b: int, s: int, r: int) -> tuple[int, ...]:
    return (1, b, s, r, b * s, b * s * s, b * s * r, b * r)
