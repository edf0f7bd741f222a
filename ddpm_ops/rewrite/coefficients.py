"""Coefficients of the update reader (:mod:`.affine`): values that are one number per sample,
built from step-only nodes (the *leaves*: table lookups, masks, scalars) and numbers by
products, quotients, sums and negation, and the algebra the reader proves things with:
structural equality (:func:`_same_coef`), a number factor pulled out (:func:`_number_factor`),
and equality as Laurent polynomials in the leaves (:func:`_proved_equal`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _Coef:
    """A coefficient: ``("num", v)``, ``("leaf", node)`` or ``(op, a, b)`` / ``("neg", a)``."""

    op: str
    args: tuple

    def __repr__(self) -> str:
        if self.op == "num":
            return repr(self.args[0])
        if self.op == "leaf":
            return self.args[0].name
        return f"{self.op}({', '.join(map(repr, self.args))})"


def _num(v: float) -> _Coef:
    return _Coef("num", (float(v),))


ONE, ZERO = _num(1.0), _num(0.0)


def _is_num(c: _Coef, v: float | None = None) -> bool:
    return c.op == "num" and (v is None or c.args[0] == v)


def cmul(a: _Coef, b: _Coef) -> _Coef:
    if _is_num(a, 0.0) or _is_num(b, 0.0):
        return ZERO
    if _is_num(a, 1.0):
        return b
    if _is_num(b, 1.0):
        return a
    if _is_num(a) and _is_num(b):
        return _num(a.args[0] * b.args[0])
    return _Coef("mul", (a, b))


def cadd(a: _Coef, b: _Coef) -> _Coef:
    if _is_num(a, 0.0):
        return b
    if _is_num(b, 0.0):
        return a
    if _is_num(a) and _is_num(b):
        return _num(a.args[0] + b.args[0])
    return _Coef("add", (a, b))


def cneg(a: _Coef) -> _Coef:
    if a.op == "neg":
        return a.args[0]
    return _num(-a.args[0]) if _is_num(a) else _Coef("neg", (a,))


def cdiv(a: _Coef, b: _Coef) -> _Coef:
    if _is_num(b, 1.0):
        return a
    if _is_num(a, 0.0):
        return ZERO
    return _Coef("div", (a, b))


def _polynomial(c: _Coef, leaves: list) -> dict | None:
    """``c`` as a Laurent polynomial in its leaves, ``{monomial: factor}`` (a monomial a sorted
    tuple of ``(leaf index in leaves, power)``; a leaf computed again alike is the same leaf);
    None where ``c`` divides by a sum."""
    from .timesteps import _recomputed  # (timesteps reads the network: imported when needed)

    if _is_num(c):
        return {(): c.args[0]} if c.args[0] else {}
    if c.op == "leaf":
        node = c.args[0]
        index = next((i for i, n in enumerate(leaves) if _recomputed(n, node)), None)
        if index is None:
            index = len(leaves)
            leaves.append(node)
        return {((index, 1),): 1.0}
    parts = [_polynomial(a, leaves) for a in c.args]
    if any(p is None for p in parts):
        return None
    if c.op == "neg":
        return {m: -v for m, v in parts[0].items()}
    if c.op == "add":
        total = dict(parts[0])
        for m, v in parts[1].items():
            total[m] = total.get(m, 0.0) + v
        return {m: v for m, v in total.items() if v}
    if c.op == "div":
        if len(parts[1]) != 1:
            return None
        (m, v), = parts[1].items()
        parts[1] = {tuple((i, -p) for i, p in m): 1.0 / v}
    if c.op in ("mul", "div"):
        product: dict = {}
        for ma, va in parts[0].items():
            for mb, vb in parts[1].items():
                powers = dict(ma)
                for i, p in mb:
                    powers[i] = powers.get(i, 0) + p
                m = tuple(sorted((i, p) for i, p in powers.items() if p))
                product[m] = product.get(m, 0.0) + va * vb
        return {m: v for m, v in product.items() if v}
    return None


def _proved_equal(a: _Coef, b: _Coef) -> bool:
    """Whether ``a`` and ``b`` are one value for any values of their leaves: equal as Laurent
    polynomials in them (``sigma * (1 / sigma) / alpha`` is ``1 / alpha``), up to the rounding
    of the numbers they hold."""
    leaves: list = []
    pa, pb = _polynomial(a, leaves), _polynomial(b, leaves)
    if pa is None or pb is None:
        return False
    return all(abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))
               for a, b in ((pa.get(m, 0.0), pb.get(m, 0.0)) for m in {*pa, *pb}))


def _number_factor(c: _Coef) -> tuple:
    """``c`` as ``(f, core)``, ``c = f * core`` with the numbers of its products, quotients and
    negations gathered in ``f``."""
    if _is_num(c):
        return c.args[0], ONE
    if c.op == "neg":
        f, core = _number_factor(c.args[0])
        return -f, core
    if c.op in ("mul", "div"):
        (fa, ca), (fb, cb) = map(_number_factor, c.args)
        if c.op == "mul":
            return fa * fb, cmul(ca, cb)
        if fb != 0.0:
            return fa / fb, cdiv(ca, cb)
    return 1.0, c


def _same_coef(a: _Coef, b: _Coef) -> bool:
    """Whether two coefficients are one value: the same ops on the same leaves, a leaf matching
    a leaf computed again alike (``sigmas[i]`` written twice is two lookups)."""
    from .timesteps import _recomputed  # (timesteps reads the network: imported when needed)

    if a == b:
        return True
    if a.op != b.op or len(a.args) != len(b.args):
        return False
    if a.op == "num":
        return a.args[0] == b.args[0]
    if a.op == "leaf":
        return _recomputed(a.args[0], b.args[0])
    return all(_same_coef(x, y) for x, y in zip(a.args, b.args))
