"""Reading a step's update as an affine function of the sample ``x`` and the network's output ``e``.

The update of one step (the nodes between ``x_k``, ``e_k`` and ``x_{k+1}``)
is evaluated symbolically: every node becomes a :class:`_Form`, a sum of
variables ``x``, ``e``, ``x0`` (the clamped prediction), ``z`` (the step's
noise draw) and ``p`` (the previous step's x0), each with a coefficient
:class:`_Coef` built from step-only nodes (the *leaves*: table lookups,
masks, scalars) and numbers. :func:`_read_update` proves ``x_{k+1}`` is

    x0 = clamp(A*x - B*e)                          (optional, once)
    x_{k+1} = clamp(C*x0 + D*x + E*e + S*z + P*p)  (the clamp optional, last)

or raises ``_NoMatch`` naming the node that is not.

An eps read back from the clamped x0, ``q*x - r*x0``, and clamped to two
numbers (DPPO's DDIM ``eps_clip_value``: ``(x - sqrt(alpha) * x0) /
sqrt(1 - alpha)``, then ``clamp_``) is the variable ``er``: the op's rows Q
and R and its ``eps_clip``. The update then reads ``E*er`` in place of ``E*e``.

A clamp of ``e`` between bounds computed from the sample, ``q*x - r*x_max`` and
``q*x - r*x_min`` (CleanDiffuser's predict-noise clip), is the clamp of
``x0 = (q*x - e) / r`` to ``(x_min, x_max)`` where ``r > 0``: it is read as the
x0 clamp, the clamped ``e`` as ``q*x - r*x0`` (:meth:`_UpdateReader._eps_clamp`;
``r > 0`` is proved on the tables' values by :func:`.emit._prove_eps_clip`).

A step may also add ``c = v * 0``, a multiplication by the literal zero of a
step-only tensor shaped like the sample or broadcastable to it (CleanDiffuser's
``fix_mask`` blend at its default, ``xt * (1. - 0.) + prior * 0.``). It is the
variable ``c``, kept out of the clamp of x0 and out of every coefficient but a
number: ``c`` is +-0 where ``v`` is finite and NaN where it is not, so adding
it changes no number of a finite row (up to the sign of zero) and makes the
non-finite entries NaN. :mod:`.plan` proves every step adds the same ``c``;
:mod:`.emit` adds it around the op.

``p`` is a multistep solver's term (DPM-Solver++ 2M keeps the previous x0
prediction in a Python variable): the reader is given ``prev``, the node the
step before designated as its x0 (:func:`.chain._step_region`'s carry), and
the nodes computed from it alone (``carried``: ``(1/2r) * x0_prev``), which
it evaluates as forms of ``p``. A step whose own x0 the next step reads is
given that node as ``x0_node``: its form in ``(x, e)``, clamped or not, is
the step's ``A*x - B*e``, so the op's previous x0 (the previous step's
clamped ``A*x - B*e``) is exactly the value the loop reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from .coefficients import (ONE, ZERO, _Coef, _is_num, _num, _number_factor, _proved_equal, _same_coef, cadd,
                           cdiv, cmul, cneg)
from .nodes import _cast, _NoMatch, _is, _known_eq, _no_kwargs, _val, aten, prims


VARS = ("x", "e", "x0", "z", "p", "er")


@dataclass
class _Form:
    """``sum(coef[v] * v)``; ``clip`` marks a value that is ``clamp(this sum, *clip)``."""

    coef: dict = field(default_factory=dict)
    clip: tuple | None = None

    def scaled(self, c: _Coef) -> _Form:
        return _Form({v: cmul(k, c) for v, k in self.coef.items()})

    def plus(self, other: _Form, sign: float = 1.0) -> _Form:
        out = dict(self.coef)
        for v, k in other.coef.items():
            k = k if sign == 1.0 else cneg(k)
            out[v] = cadd(out[v], k) if v in out else k
        return _Form(out)


@dataclass
class _Update:
    """What one step computes (see the module docstring); ``pre`` is ``{x: A, e: -B}``; ``post``
    may hold ``p``, the previous step's x0 (row P of the tables)."""

    out: Node
    pre: dict | None
    clip: tuple | None
    post: dict
    post_clip: tuple | None
    noise: Node | None
    leaves: set
    zero: Node | None = None  # the term v * 0 added to the result (the module docstring), if any
    zero_of: Node | None = None  # its v
    eps_clip: Node | None = None  # the clamp of e read as the x0 clamp (_UpdateReader._eps_clamp), if any
    eps_read: dict | None = None  # {x: q, x0: -r}: the clamped eps read back from x0 (``er``), if any
    eps_read_clip: tuple | None = None  # its clamp: two numbers


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
          aten.alias.default, aten.expand.default, aten.contiguous.default)


def _coefficient(a: Any, shape, step_only, leaves: set, earlier: str = "") -> _Coef:
    """``a`` as a coefficient of a value of ``shape``: a number, or a step-only floating-point node
    (added to ``leaves``) that is one number per sample; raise ``_NoMatch`` naming why not
    (``earlier`` says more where it depends on an earlier step's sample)."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return _num(a)
    if not isinstance(a, Node):
        raise _NoMatch(f"{a!r} is not a coefficient")
    if not step_only(a):
        raise _NoMatch(f"{a.name} depends on an earlier step's sample{earlier}")
    v = _val(a)
    if v is None or not v.is_floating_point():
        raise _NoMatch(f"{a.name} is not a floating-point coefficient")
    if _is(a, aten.expand.default) and _row_wise(_val(a.args[0]), shape):
        a, v = a.args[0], _val(a.args[0])
    if not _row_wise(v, shape) and not _row_constant(a, shape, {}):
        raise _NoMatch(f"{a.name} of shape {tuple(v.shape)} is not one number per sample "
                       "(a (B, 1) column or a scalar)")
    leaves.add(a)
    return _Coef("leaf", (a,))


class _UpdateReader:
    """Evaluates the nodes of one step's update; ``inside`` are the nodes that
    depend on ``x`` or ``e`` (everything else read is a leaf)."""

    def __init__(self, x: Node, e: Node, inside: set, sample_shape, step_only, prev: Node | None = None,
                 carried: frozenset = frozenset(), x0_node: Node | None = None, net_out: Node | None = None):
        self.x, self.e, self.inside, self.shape = x, e, inside, sample_shape
        self.net_out = e if net_out is None else net_out  # e itself, or what e lays out in the sample's order
        self.step_only = step_only  # node -> bool: independent of every step's sample
        self.prev, self.carried, self.x0_node = prev, carried, x0_node
        self.memo: dict[Node, _Form] = {}
        self.pre = None
        self.pre_source = None
        self.noise = None
        self.zero: Node | None = None
        self.eps_clip: Node | None = None
        self.eps_read: tuple | None = None  # (the clamped form read back, its clamp)
        self.leaves: set = set()

    # -- values that are not forms
    def coef(self, a: Any) -> _Coef:
        earlier = "" if self.prev is not None else " (and no step before this one in the loop gives the update a " \
            "previous x0)"
        return _coefficient(a, self.shape, self.step_only, self.leaves, earlier)

    def noise_atom(self, a: Any) -> _Form | None:
        v = _val(a)
        if not isinstance(a, Node) or v is None or not self.step_only(a) \
                or tuple(v.shape) != tuple(self.shape) or self.noise not in (None, a):
            return None
        if _is(a, aten.expand.default) and _row_wise(_val(a.args[0]), self.shape):
            return None  # a coefficient column expanded to the sample's shape
        self.noise = a
        return _Form({"z": ONE})

    def _is_form(self, a: Any) -> bool:
        """Whether ``a`` is a form: it depends on this step's sample or network output, or is
        (computed from nothing but) the previous step's x0."""
        return isinstance(a, Node) and (a is self.x or a is self.e or a in self.inside or a is self.prev
                                        or a in self.carried or a is self.net_out)

    def operand(self, a: Any) -> _Form | _Coef:
        if self._is_form(a):
            return self.form(a)
        return self.coef(a)

    # -- forms
    def form(self, n: Node) -> _Form:
        if n is self.prev:
            return _Form({"p": ONE})
        if n is self.net_out and n is not self.e:
            raise _NoMatch(f"the update reads the network's output {n.name} in the order the network reads the "
                           f"sample in, not through {self.e.name}, which lays it out in the sample's order")
        if n not in self.memo:
            f = _Form({"x": ONE}) if n is self.x else _Form({"e": ONE}) if n is self.e else self._evaluate(n)
            self.memo[n] = self.designate(f) if n is self.x0_node else f
        return self.memo[n]

    def designate(self, f: _Form) -> _Form:
        """``f``, the value of this step the next step reads as its previous x0, as the variable
        ``x0``: its form is the step's ``A*x - B*e`` (its clamp, if any, the x0 clamp)."""
        if f.clip is not None:
            return self.settle(f)
        if set(f.coef) == {"x0"} and _is_num(f.coef["x0"], 1.0):
            return f  # the clamped x0 itself, through a view
        if self.eps_clip is not None and "x0" in f.coef and _proved_equal(f.coef["x0"], ONE) and \
                all(_proved_equal(c, ZERO) for v, c in f.coef.items() if v != "x0"):
            # The clamped x0 computed again from the clamped e, (x - sigma * e_c) / alpha
            # (CleanDiffuser's x_theta): its x and x0 terms cancel to x0 where alpha and sigma
            # are finite and nonzero, which the eps clamp's proof (emit._prove_eps_clip) shows.
            return _Form({"x0": ONE})
        if set(f.coef) - {"x", "e"}:
            raise _NoMatch("the next step reads a value of this step that is not A*x - B*e (its x0 "
                           "prediction) but " + " + ".join(sorted(f.coef)))
        if self.pre is not None:
            raise _NoMatch(f"the next step reads {self.x0_node.name}, an x0 of this step other than the one "
                           "it clamps (the op gives the next step the clamped x0)")
        self.pre, self.pre_source = (dict(f.coef), None), f
        return _Form({"x0": ONE})

    def settle(self, f: _Form) -> _Form:
        """``f`` with a pending clamp turned into the variable ``x0`` (once per step)."""
        if f.clip is None:
            return f
        if f is self.pre_source:
            return _Form({"x0": ONE})
        if self.pre is not None and self.pre[1] is None and self.x0_node is not None:
            raise _NoMatch(f"the next step reads {self.x0_node.name}, an x0 of this step other than the one "
                           "it clamps (the op gives the next step the clamped x0)")
        if self.eps_clip is not None:
            raise _NoMatch(f"a clamp of x0 in a step whose clamp {self.eps_clip.name} of e to bounds that "
                           "depend on the sample already clamps its x0 (the op clamps x0 once)")
        if "x0" in f.coef and _is_num(f.coef.get("e", ZERO), 0.0):
            return self.read_back(f)
        if self.pre is not None or set(f.coef) - {"x", "e"}:
            raise _NoMatch("a clamp that is neither of the predicted x0 (once) nor the step's last op")
        self.pre, self.pre_source = (dict(f.coef), f.clip), f
        return _Form({"x0": ONE})

    def read_back(self, f: _Form) -> _Form:
        """``f``, a clamp of ``q*x - r*x0``, as the variable ``er``: DPPO's DDIM reads the eps back
        from the clamped x0, ``(x - sqrt(alpha) * x0) / sqrt(1 - alpha)``, and clamps it to
        ``eps_clip_value`` before the direction term. One such clamp a step, to two numbers."""
        coef = {v: c for v, c in f.coef.items() if not _is_num(c, 0.0)}
        if set(coef) - {"x", "x0"}:
            raise _NoMatch("a clamp of a value computed from the clamped x0 and " + ", ".join(sorted(set(coef) - {
                "x", "x0"})) + ": the op clamps x0, the eps read back from it (q*x - r*x0) and the step's result")
        if any(isinstance(b, Node) for b in f.clip):
            raise _NoMatch("a clamp of the eps read back from the clamped x0 (q*x - r*x0) to tensor bounds: the op "
                           "clamps it to two numbers")
        if self.eps_read is not None and self.eps_read[0] is not f:
            raise _NoMatch("two clamps of values read back from the clamped x0 in one step: the op reads one eps "
                           "back (q*x - r*x0)")
        self.eps_read = (f, f.clip)
        return _Form({"er": ONE})

    def _evaluate(self, n: Node) -> _Form:
        t = n.target
        if _is(n, aten.add.Tensor, aten.sub.Tensor):
            alpha = n.kwargs.get("alpha", 1)
            if not _no_kwargs(n, {"alpha": alpha}) or isinstance(alpha, bool):
                raise _NoMatch(f"{n.name} has unexpected arguments")
            return self._add(n, -float(alpha) if t == aten.sub.Tensor else float(alpha))
        if _is(n, aten.mul.Tensor, aten.div.Tensor):
            return self._mul(n)
        if _is(n, aten.neg.default):
            return self.settle(self.form(n.args[0])).scaled(_num(-1.0))
        if _is(n, aten.clamp.default, aten.clip.default, aten.clamp_min.default, aten.clamp_max.default,
               aten.clamp.Tensor, aten.clamp_min.Tensor, aten.clamp_max.Tensor):
            return self._clamp(n)
        if _is(n, aten.where.self):
            return self._where(n)
        cast = _cast(n)
        if cast is not None and _same_shape(n, cast[0]):
            # Widening float32 to float64 is exact (e of a float64 sample's step, net(x.float()).double());
            # any other cast rounds values the op keeps.
            before = _val(cast[0]).dtype
            if cast[1] != before and (before, cast[1]) != (torch.float32, torch.float64):
                raise _NoMatch(f"{n.name} casts the step's {before} values to {cast[1]}")
            return self.form(cast[0])
        if _is(n, *_VIEWS) and _same_shape(n, n.args[0]):
            return self.form(n.args[0])
        if _is(n, *_ROW_VIEWS) and _same_rows(n, n.args[0]):
            # A chunk's rows flattened or unflattened (DPPO's network reads (B, horizon *
            # action_dim)): each row's numbers stay in that row, in order, so the form is the same.
            return self.form(n.args[0])
        raise _NoMatch(f"the update is not affine in (x, e): {n.name} ({t}) is not add, sub, mul, "
                       "div, neg, clamp or a view")

    def _add(self, n: Node, sign: float) -> _Form:
        a, b = n.args[:2]
        fb = self._term(b)
        if abs(sign) != 1.0:
            fb = fb.scaled(_num(abs(sign)))
        return self._term(a).plus(fb, 1.0 if sign > 0 else -1.0)

    def _term(self, a: Any) -> _Form:
        """An operand of a sum: a form, a term v * 0 (``c``), or the step's noise draw."""
        if self._is_form(a):
            return self.settle(self.form(a))
        if isinstance(a, (int, float)) and not isinstance(a, bool) and a == 0:
            return _Form({})
        if isinstance(a, Node) and not self.step_only(a):
            raise _NoMatch(f"the update adds {a.name}, computed from an earlier step's sample "
                           + ("but not from the previous step's x0 alone (the op gives a step the x0 of the "
                              "step before it, nothing else)" if self.prev is not None else
                              "(a step before the loop's first: the op gives a call's first step no previous x0)"))
        c = self.zero_atom(a)
        if c is not None:
            return c
        z = self.noise_atom(a)
        if z is None:
            raise _NoMatch(f"the update adds {getattr(a, 'name', a)}, a term without x or e "
                           "that is not one noise draw of the sample's shape")
        return z

    def zero_atom(self, a: Any) -> _Form | None:
        """``a = v * 0`` (the literal zero) with ``v`` a step-only tensor of the sample's dtype
        whose shape broadcasts to the sample's, as the variable ``c``; else ``None``. One such
        term a step: a second one names itself."""
        v = _zero_times(a)
        if v is None:
            return None
        av, vv, xv = _val(a), _val(v), _val(self.x)
        if av is None or vv is None or xv is None or av.dtype != xv.dtype or not _broadcasts_to(av, self.shape):
            return None
        if self.zero not in (None, a):
            raise _NoMatch(f"the update adds {self.zero.name} and {a.name}, two terms v * 0 (the op's "
                           "result takes one, added once a call)")
        self.zero = a
        return _Form({"c": ONE})

    def _mul(self, n: Node) -> _Form:
        a, b = n.args[:2]
        oa, ob = self.operand_or_noise(a), self.operand_or_noise(b)
        if _is(n, aten.div.Tensor):
            if not isinstance(oa, _Form) or isinstance(ob, _Form) or n.kwargs:
                raise _NoMatch(f"{n.name} divides by the sample (not affine in x, e)")
            return self.settle(oa).scaled(cdiv(ONE, ob))
        if isinstance(oa, _Form) and isinstance(ob, _Form):
            raise _NoMatch(f"{n.name} multiplies two sample-dependent values (not affine in x, e)")
        f, c = (oa, ob) if isinstance(oa, _Form) else (ob, oa)
        if not isinstance(f, _Form):
            raise _NoMatch(f"{n.name} has no sample-dependent operand")
        return self.settle(f).scaled(c)

    def operand_or_noise(self, a: Any):
        if isinstance(a, Node) and not self._is_form(a):
            z = self.noise_atom(a)
            if z is not None:
                return z
        return self.operand(a)

    def _where(self, n: Node) -> _Form:
        """``where(m, a, b)`` with ``m`` a step-only boolean, one per sample (Diffusion-QL's last step
        spelt ``torch.where((t > 0)[:, None], mean + std * z, mean)``): each variable's coefficient
        is ``where(m, its coefficient in a, its coefficient in b)``, the selection the loop makes,
        row by row (0 where a branch lacks the variable)."""
        m, a, b = n.args[:3]
        if n.kwargs or not isinstance(m, Node) or self._is_form(m) or not self.step_only(m):
            raise _NoMatch(f"{n.name} selects with a condition that depends on the sample")
        v = _val(m)
        if v is None or v.dtype != torch.bool or not _row_wise(v, self.shape):
            raise _NoMatch(f"{n.name} selects with {m.name}, not one boolean per sample")
        fa, fb = (self._term(x) for x in (a, b))
        if "c" in fa.coef or "c" in fb.coef:
            raise _NoMatch(f"{n.name} selects a term v * 0 row by row (the op adds it to every row)")
        self.leaves.add(m)
        cond = _Coef("leaf", (m,))
        return _Form({var: _Coef("where", (cond, fa.coef.get(var, ZERO), fb.coef.get(var, ZERO)))
                      for var in VARS if var in fa.coef or var in fb.coef})

    def _clamp(self, n: Node) -> _Form:
        if _is(n, aten.clamp.default, aten.clip.default, aten.clamp.Tensor):  # torch.clip: export's training IR
            lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
            hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
        elif _is(n, aten.clamp_min.default, aten.clamp_min.Tensor):
            lo, hi = n.args[1], None
        else:
            lo, hi = None, n.args[1]
        if any(self._is_form(b) for b in (lo, hi)):
            inner = n.args[0]
            # pred.clip(lo, hi) with tensor bounds lowers to clamp_max(clamp_min(pred, lo), hi)
            # (or the reverse): one clamp of e between two bounds.
            pair = {aten.clamp_min.Tensor: aten.clamp_max.Tensor, aten.clamp_max.Tensor: aten.clamp_min.Tensor}
            if n.target in pair and _is(inner, pair[n.target]) and len(inner.users) == 1 and not inner.kwargs \
                    and self._is_form(inner.args[1]):
                if hi is None:
                    hi = inner.args[1]
                else:
                    lo = inner.args[1]
                inner = inner.args[0]
            return self._eps_clamp(n, inner, lo, hi)
        f = self.form(n.args[0])
        lo = -math.inf if lo is None else self.bound(n, lo)
        hi = math.inf if hi is None else self.bound(n, hi)
        if f.clip is not None:  # clamp_min then clamp_max: one clamp
            lo, hi = _tighter(n, lo, f.clip[0], max), _tighter(n, hi, f.clip[1], min)
        return _Form(dict(f.coef), (lo, hi))

    def _eps_clamp(self, n: Node, clamped: Any, lo: Any, hi: Any) -> _Form:
        """``clamp(e, q*x - r*M, q*x - r*m)`` read as the clamp of x0 to ``(m, M)``.

        CleanDiffuser clips an eps prediction to ``((x - alpha*x_max) / sigma, (x - alpha*x_min)
        / sigma)``: the x0 clip written on eps. With ``x0 = (q*x - e) / r`` and ``r > 0``,
        ``e >= q*x - r*M`` is ``x0 <= M`` and ``e <= q*x - r*m`` is ``x0 >= m``, so the clamped
        value is exactly ``q*x - r*clamp(x0, m, M)``: the step's x0 is ``A*x - B*e`` with
        ``A = q/r``, ``B = 1/r``, and the clamped e the form ``q*x - r*x0``. Both bounds must
        read x with the same coefficient ``q`` and their constant parts must be ``-r`` times one
        number or one float value per column of the sample (``M``, ``m``) with the same ``r``;
        that ``r`` is positive (and ``A``, ``B`` finite) at every step is proved by
        :func:`.emit._prove_eps_clip` on the tables' values, at compile time."""
        f = self.form(clamped)
        if f.clip is not None or set(f.coef) != {"e"} or not _is_num(f.coef["e"], 1.0):
            raise _NoMatch(f"{n.name} clamps to a bound that depends on the sample, and what it clamps is "
                           "not the network's output e itself (read as an x0 clamp for e only)")
        if self.pre is not None or self.eps_clip is not None:
            raise _NoMatch(f"{n.name} clamps e to bounds that depend on the sample (an x0 clamp written on "
                           "e) in a step that clamps its x0 already (the op clamps x0 once)")
        read = {}
        for side, b in (("lower", lo), ("upper", hi)):
            if b is None:
                continue
            if not self._is_form(b):
                raise _NoMatch(f"{n.name} clamps e to a {side} bound {getattr(b, 'name', b)} that does not "
                               "depend on the sample beside one that does (an x0 clamp written on e has "
                               "both of the form q*x - r*x_bound)")
            read[side] = self._bound_form(n, b)
        (q, r, _), *others = read.values()
        factors = [_number_factor(r2) for _, r2, _ in read.values()]
        f, core = factors[0]
        for (side, (q2, r2, m2)), (f2, core2) in zip(list(read.items())[1:], factors[1:]):
            if not isinstance(m2, Node) and f != 0.0 and _same_coef(core2, core):
                # A number bound takes the other bound's factor: ``(x + alpha) / sigma`` is
                # ``(x - alpha * -1.0) / sigma`` (torch may fold ``alpha * 1.0`` to ``alpha``).
                read[side] = q2, r, m2 * f2 / f
        for q2, r2, _ in list(read.values())[1:]:
            if not _same_coef(q2, q):
                raise _NoMatch(f"{n.name} clamps e to bounds that read x with different coefficients {q!r} "
                               f"and {q2!r} (an x0 clamp written on e has one, 1/sigma, in both)")
            if not _same_coef(r2, r):
                raise _NoMatch(f"{n.name} clamps e to bounds whose constant parts have different factors "
                               f"{r!r} and {r2!r} (an x0 clamp written on e has -alpha/sigma in both)")
        # e >= q*x - r*M is x0 <= M: the lower bound of e gives the upper bound of x0.
        x0_lo = read["upper"][2] if "upper" in read else -math.inf
        x0_hi = read["lower"][2] if "lower" in read else math.inf
        self.pre = ({"x": cdiv(q, r), "e": cneg(cdiv(ONE, r))}, (x0_lo, x0_hi))
        self.pre_source, self.eps_clip = None, n
        return _Form({"x": q, "x0": cneg(r)})

    def _bound_form(self, n: Node, b: Node) -> tuple:
        """A bound of an eps clamp as ``(q, r, m)``: the bound is ``q*x - r*m``, ``q`` and ``r``
        coefficients, ``m`` a number or a float32 tensor of one value per column."""
        x, terms = self._bound_terms(n, b)
        if x is None:
            raise _NoMatch(f"{n.name} clamps e to a bound {b.name} that depends on the sample but not on x "
                           "alone")
        if len(terms) != 1:
            raise _NoMatch(f"{n.name} clamps e to a bound {b.name} that is not q*x - r*x_bound with one "
                           f"bound (its constant part has {len(terms)} terms)")
        (c, m), = terms
        return x, cneg(c), m

    def _bound_terms(self, n: Node, b: Any) -> tuple:
        """``b`` as ``(q, [(c, m), ...])``, the value ``q*x + sum(c*m)`` (``q`` ``None`` where ``b``
        reads no x)."""
        if not self._is_form(b):
            return None, [self._bound_constant(n, b)]
        if b is self.x:
            return ONE, []
        if _is(b, *_VIEWS) and _same_shape(b, b.args[0]) or \
                _is(b, prims.convert_element_type.default) and _same_shape(b, b.args[0]) \
                and b.args[1] == _val(b.args[0]).dtype:
            return self._bound_terms(n, b.args[0])
        if _is(b, aten.add.Tensor, aten.sub.Tensor) and _no_kwargs(b, {"alpha": b.kwargs.get("alpha", 1)}) \
                and b.kwargs.get("alpha", 1) == 1:
            (qa, ta), (qb, tb) = (self._bound_terms(n, a) for a in b.args[:2])
            sign = ONE if _is(b, aten.add.Tensor) else _num(-1.0)
            tb = [(cmul(c, sign), m) for c, m in tb]
            q = qa if qb is None else cmul(qb, sign) if qa is None else cadd(qa, cmul(qb, sign))
            return q, ta + tb
        if _is(b, aten.neg.default):
            q, t = self._bound_terms(n, b.args[0])
            return (None if q is None else cneg(q)), [(cneg(c), m) for c, m in t]
        if _is(b, aten.mul.Tensor, aten.div.Tensor) and not b.kwargs:
            a, k = b.args[:2]
            if _is(b, aten.mul.Tensor) and not self._is_form(a):
                a, k = k, a
            if not self._is_form(k):
                c = self.coef(k)
                c = cdiv(ONE, c) if _is(b, aten.div.Tensor) else c
                q, t = self._bound_terms(n, a)
                return (None if q is None else cmul(q, c)), [(cmul(ci, c), m) for ci, m in t]
        raise _NoMatch(f"{n.name} clamps e to a bound that depends on the sample through {b.name} ({b.target}), "
                       "not an affine function q*x - r*x_bound of x")

    def _bound_constant(self, n: Node, b: Any) -> tuple:
        """A step-only part of an eps clamp's bound as ``(c, m)``: ``c`` a coefficient (one number
        per sample), ``m`` the bound (a number, or a float tensor of one value per column);
        ``alpha * x_max`` as ``(alpha, x_max)``."""
        if isinstance(b, (int, float)) and not isinstance(b, bool):
            return ONE, float(b)
        if not isinstance(b, Node) or not self.step_only(b):
            raise _NoMatch(f"{n.name} clamps e to a bound whose constant part {getattr(b, 'name', b)} is "
                           "not step-only")
        if _is(b, aten.mul.Tensor, aten.div.Tensor) and not b.kwargs:
            a, k = b.args[:2]
            orders = ((a, k), (k, a)) if _is(b, aten.mul.Tensor) else ((a, k),)
            for m_part, c_part in orders:
                if self._bound_tensor(m_part) or isinstance(m_part, (int, float)) and not isinstance(m_part, bool):
                    c = self.coef(c_part)
                    c = cdiv(ONE, c) if _is(b, aten.div.Tensor) else c
                    m = float(m_part) if not isinstance(m_part, Node) else m_part
                    return c, m
        if _is(b, aten.neg.default):
            c, m = self._bound_constant(n, b.args[0])
            return cneg(c), m
        if self._bound_tensor(b):
            return ONE, b
        try:  # ``alpha * 1.0``, which torch may fold to ``alpha``
            return self.coef(b), 1.0
        except _NoMatch:
            pass
        v = _val(b)
        raise _NoMatch(f"{n.name} clamps e to a bound whose constant part {b.name} (shape "
                       f"{None if v is None else tuple(v.shape)}) is not a coefficient times a number or one "
                       "float32 or float64 value per column of a (batch, dim) sample")

    def _bound_tensor(self, b: Any) -> bool:
        """Whether ``b`` is a tensor of one value per column that the op takes as per-column
        bounds (see :meth:`bound`). A 0-d value in an eps clamp's bound is its coefficient
        (``alpha`` of ``alpha * x_max``), not the bound."""
        if not isinstance(b, Node) or self._is_form(b) or not self.step_only(b) or _val(b) is None \
                or _val(b).dim() == 0:
            return False
        try:
            self.bound(b, b)
        except _NoMatch:
            return False
        return True

    def bound(self, n: Node, b: Any) -> float | Node:
        """A clamp's bound: a number, or a step-only float tensor of one value per column of the
        sample (CleanDiffuser's per-dimension ``x_min`` / ``x_max``: the op's per-column bounds) or
        of one value (a 0-d ``max_action`` buffer: that value in every column)."""
        if isinstance(b, (int, float)) and not isinstance(b, bool):
            return float(b)
        if not isinstance(b, Node) or self._is_form(b) or not self.step_only(b):
            raise _NoMatch(f"{n.name} clamps to a bound {getattr(b, 'name', b)} that depends on the sample")
        v = _val(b)
        dim = self.shape[-1] if len(self.shape) == 2 else None
        if v is None or v.dtype not in (torch.float32, torch.float64) or dim is None or not (
                v.dim() == 0 or v.dim() == 1 and _known_eq(v.shape[0], dim)
                or v.dim() == 2 and _known_eq(v.shape[0], 1) and _known_eq(v.shape[1], dim)):
            raise _NoMatch(f"{n.name} clamps to a tensor bound {b.name} that is not one float32 or float64 value, "
                           "or one per column of a (batch, dim) sample")
        return b


def _tighter(n: Node, a: float | Node, b: float | Node, pick) -> float | Node:
    """Two bounds of one side as one: the tighter number, or the tensor where the other side is
    unbounded (two tensors, or a tensor and a number, are not one bound the reader writes)."""
    if not isinstance(a, Node) and not isinstance(b, Node):
        return pick(a, b)
    if not isinstance(b, Node) and math.isinf(b):
        return a
    if not isinstance(a, Node) and math.isinf(a):
        return b
    raise _NoMatch(f"{n.name} clamps again a value clamped to a tensor bound")


_ROW_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _same_rows(n: Node, src: Any) -> bool:
    """Whether ``n`` reshapes ``src`` row by row: the same first dimension and element count."""
    nv, sv = _val(n), _val(src)
    return nv is not None and sv is not None and nv.dim() >= 2 and sv.dim() >= 2 \
        and _known_eq(nv.shape[0], sv.shape[0]) and _known_eq(nv.numel(), sv.numel())


def _same_shape(n: Node, src: Any) -> bool:
    nv, sv = _val(n), _val(src)
    return nv is not None and sv is not None and len(nv.shape) == len(sv.shape) \
        and all(_known_eq(a, b) for a, b in zip(nv.shape, sv.shape))


def _row_constant(n: Any, shape, memo: dict) -> bool:
    """Whether ``n`` is one number per sample broadcast over the sample's other dims: a row-wise
    value (:func:`_row_wise`), an ``expand`` of one, or a pointwise op of such values and numbers
    (TabDDPM's ``torch.sqrt(extract(alphas_cumprod_prev, t, x.shape))``: its ``extract`` expands
    each table lookup to the sample's shape before the step's arithmetic)."""
    if not isinstance(n, Node):
        return isinstance(n, (int, float)) and not isinstance(n, bool)
    if n not in memo:
        memo[n] = False
        v = _val(n)
        if _row_wise(v, shape):
            memo[n] = True
        elif _is(n, aten.expand.default):
            memo[n] = _row_wise(_val(n.args[0]), shape)
        elif isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags \
                and v is not None and v.is_floating_point():
            operands = [*n.args, *n.kwargs.values()]
            memo[n] = all(_row_constant(a, shape, memo) or not isinstance(a, Node) and not isinstance(a, (list, tuple))
                          for a in operands) and any(isinstance(a, Node) for a in operands)
    return memo[n]


def _zero_times(a: Any) -> Node | None:
    """``v`` where ``a`` is ``v * 0`` or ``0 * v``, a multiplication by the literal zero of a
    floating-point tensor; else ``None``."""
    if not _is(a, aten.mul.Tensor) or len(a.args) != 2 or a.kwargs:
        return None
    for v, k in (a.args, a.args[::-1]):
        if isinstance(v, Node) and isinstance(k, (int, float)) and not isinstance(k, bool) and k == 0:
            vv = _val(v)
            return v if vv is not None and vv.is_floating_point() else None
    return None


def _broadcasts_to(v, shape) -> bool:
    """Whether ``v`` broadcasts to ``shape`` without enlarging it (every dim, from the right,
    1 or the same)."""
    return v.dim() <= len(shape) and all(
        _known_eq(d, 1) or _known_eq(d, s) for d, s in zip(reversed(v.shape), reversed(tuple(shape))))


def _row_wise(v, shape) -> bool:
    """Whether ``v`` broadcasts against ``shape`` (B, dim) as one number per sample."""
    if v is None:
        return False
    if v.dim() == 0:
        return True
    if v.dim() < len(shape):  # broadcast from the right: it misses the batch dimension
        return all(_known_eq(d, 1) for d in v.shape)
    if v.dim() == len(shape):  # (B, 1) columns, (B, 1, 1) for a chunk
        return all(_known_eq(d, 1) for d in v.shape[1:]) and (_known_eq(v.shape[0], 1)
                                                              or _known_eq(v.shape[0], shape[0]))
    return False


def _read_update(x: Node, e: Node, out: Node, inside: set, sample_shape, step_only, *, prev: Node | None = None,
                 carried: frozenset = frozenset(), x0_node: Node | None = None, net_out: Node | None = None) -> _Update:
    """The affine update ``out`` of ``(x, e)`` (and of ``prev``, the previous step's x0, through
    ``carried``; ``x0_node``: this step's x0 as the next step reads it; ``net_out``: the network's
    output where ``e`` lays it out in the sample's order); raise ``_NoMatch`` with the reason it
    is not."""
    r = _UpdateReader(x, e, inside, sample_shape, step_only, prev, carried, x0_node, net_out)
    f = r.form(out)
    if x0_node is not None:
        r.form(x0_node)  # the next step reads it even where this update does not: it fixes A and B
    post_clip = None
    if f.clip is not None:
        post_clip, f = f.clip, _Form(dict(f.coef))
    zero = None
    if "c" in f.coef:
        # k * c with k a nonzero number is c up to the sign of zero: +-0 or NaN where c is. A
        # coefficient of the step (a table's value, possibly infinite) would not be.
        k = f.coef.pop("c")
        if not (_is_num(k) and k.args[0] != 0 and math.isfinite(k.args[0])):
            raise _NoMatch(f"the update adds {r.zero.name} (a term v * 0) times {k!r}, not a nonzero number")
        zero = r.zero
    if "x" not in f.coef and "e" not in f.coef and "x0" not in f.coef and "er" not in f.coef:
        raise _NoMatch(f"{out.name} does not depend on the sample")
    if "er" in f.coef and not _is_num(f.coef.get("e", ZERO), 0.0):
        raise _NoMatch(f"{out.name} reads both the network's output and the eps read back from the clamped x0 "
                       "(the op's E term reads one of them)")
    pre, clip = (r.pre if r.pre is not None else (None, None))
    eps_read, eps_read_clip = (None, None) if r.eps_read is None else r.eps_read
    if eps_read is not None:
        f.coef.pop("e", None)
        eps_read = {"x": eps_read.coef.get("x", ZERO), "x0": eps_read.coef["x0"]}
    return _Update(out=out, pre=pre, clip=clip, post=f.coef, post_clip=post_clip,
                   noise=r.noise, leaves=r.leaves, zero=zero, zero_of=_zero_times(zero), eps_clip=r.eps_clip,
                   eps_read=eps_read, eps_read_clip=eps_read_clip)



def _x0_clamped(u: _Update) -> _Update | None:
    """``x = clamp(a*x + b*e)`` read as ``x0 = clamp(a*x + b*e); x = x0`` (no clamp of the
    result), where ``u`` is that; else ``None``."""
    if u.post_clip is None or u.pre is not None or u.noise is not None or not set(u.post) <= {"x", "e"}:
        return None
    return _Update(out=u.out, pre=dict(u.post), clip=u.post_clip, post={"x0": ONE}, post_clip=None,
                   noise=None, leaves=u.leaves, zero=u.zero, zero_of=u.zero_of)


def _scale(factors: tuple, step_only, leaves: set) -> _Coef:
    """The product of a feed's scaling ``factors`` (:class:`.chain._Feed`: ``(factor, divides,
    shape)``) as a coefficient, each factor one number per sample of the value it scales."""
    c = ONE
    for factor, divides, shape in factors:
        f = _coefficient(factor, shape, step_only, leaves)
        c = cdiv(c, f) if divides else cmul(c, f)
    return c


def _rescaled(u: _Update, scale: _Coef, scale_next: _Coef) -> None:
    """``u`` rewritten for the op's state ``y = scale * x``, the sample as the network reads it
    (EDM's and k-diffusion's ``c_in * x``), where the next step's network reads ``scale_next *
    x'`` (1 after the loop's last step, so that the op's result is the sample): the network reads
    ``y`` as it is, x0 is ``(A/scale)*y - B*e`` (the same value, so its clamp and the previous x0
    too, and the eps read back from it with ``q/scale``), and ``y' = scale_next * x'`` multiplies
    every term of the update by ``scale_next``, the sample's ``D`` also divided by ``scale``. Only
    where both are finite and nonzero (:func:`.emit._prove_scales`)."""
    if u.pre is not None and "x" in u.pre:
        u.pre = {**u.pre, "x": cdiv(u.pre["x"], scale)}
    if u.eps_read is not None:
        u.eps_read = {**u.eps_read, "x": cdiv(u.eps_read["x"], scale)}
    u.post = {v: cmul(cdiv(c, scale) if v == "x" else c, scale_next) for v, c in u.post.items()}
