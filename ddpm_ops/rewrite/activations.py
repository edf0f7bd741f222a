"""Reading the activation between two Linears, in each ATen form it lowers to.

:func:`_activation` returns the op's name for it (a name of
:data:`ddpm_ops.layers.VOCABULARY`), the activation's input and its nodes, or
raises ``_NoMatch``. The names are not spelled here: each vocabulary entry's
function is run once on a small tensor and the one ATen call it makes
(``aten.mish``, ``aten.gelu`` with its ``approximate``...) is what a graph
node must be to be that activation (:func:`_aten_forms`). The decomposed
forms inductor and export write are read by their structure and named by the
ATen call they stand for: post-grad, ``nn.Mish`` is ``z * tanh(softplus(z))``
with softplus's threshold of 20 written as ``where(z > 20, z, log1p(exp(z)))``;
SiLU is ``aten.silu``, ``z * sigmoid(z)`` or ``z / (1 + exp(-z))``; GELU in
either form is its ``erf`` or ``tanh`` formula.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.fx import Node
from torch.utils._python_dispatch import TorchDispatchMode

from ..layers import VOCABULARY
from .nodes import _NoMatch, _is, _no_kwargs, aten


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


@functools.cache
def _aten_forms() -> dict[tuple, str]:
    """``{(ATen overload, approximate): name}`` for every vocabulary activation whose function
    is one ATen call (all but the identity, which leaves no node to read)."""
    forms = {}
    for activation in VOCABULARY:
        h = torch.zeros(4)
        with torch.no_grad(), _Recorder() as recorder:
            activation.function(h)
        if len(recorder.calls) == 1:
            func, kwargs = recorder.calls[0]
            forms[(func, kwargs.get("approximate", "none") if func is aten.gelu.default else None)] = activation.name
    return forms


def _name(func, approximate: str | None = None) -> str:
    return _aten_forms()[(func, approximate)]


def _activation(node: Any) -> tuple[str, Node, list[Node]]:
    """``(name, z, nodes)`` for ``act(z)``; else raise ``_NoMatch``."""
    if isinstance(node, Node) and node.op == "call_function" and node.args:
        approximate = None
        if node.target is aten.gelu.default:
            approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        name = _aten_forms().get((node.target, approximate))
        if name is not None:
            return name, node.args[0], [node]
    found = _decomposed_mish(node)
    if found is not None:
        return _name(aten.mish.default), found[0], found[1]
    found = _decomposed_gelu(node)
    if found is not None:
        return found
    z, nodes = _silu(node)
    return _name(aten.silu.default), z, nodes


def _decomposed_mish(node: Any) -> tuple[Node, list[Node]] | None:
    """``(z, nodes)`` for ``z * tanh(where(z > 20, z, log1p(exp(z))))`` (or ``softplus``)."""
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for z, th in (node.args, node.args[::-1]):
        if not _is(th, aten.tanh.default):
            continue
        sp = th.args[0]
        if _is(sp, aten.softplus.default) and sp.args[0] is z and tuple(sp.args[1:]) in ((), (1,), (1, 20)):
            return z, [node, th, sp]
        if _is(sp, aten.where.self) and len(sp.args) == 3:
            gt, keep, soft = sp.args
            if _is(gt, aten.gt.Scalar) and gt.args[0] is z and gt.args[1] == 20 and keep is z \
                    and _is(soft, aten.log1p.default) and _is(soft.args[0], aten.exp.default) \
                    and soft.args[0].args[0] is z:
                return z, [node, th, sp, gt, soft, soft.args[0]]
    return None


def _times(node: Any, const: float):
    """``z`` for ``z * const`` (either order)."""
    if _is(node, aten.mul.Tensor) and len(node.args) == 2:
        for z, c in (node.args, node.args[::-1]):
            if isinstance(c, float) and abs(c - const) < 1e-12 and isinstance(z, Node):
                return z
    return None


def _plus_one(node: Any):
    if _is(node, aten.add.Tensor) and len(node.args) == 2 and not node.kwargs:
        for a, one in (node.args, node.args[::-1]):
            if one == 1 and isinstance(a, Node):
                return a
    return None


def _decomposed_gelu(node: Any) -> tuple[str, Node, list[Node]] | None:
    """GELU as decomposed post-grad: ``(z * 0.5) * (1 + erf(z / sqrt 2))``, or the tanh form
    ``(z * 0.5) * (1 + tanh(sqrt(2/pi) * (z + 0.044715 * z * z * z)))``."""
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for half, rest in (node.args, node.args[::-1]):
        z, inner = _times(half, 0.5), _plus_one(rest)
        if z is None or inner is None:
            continue
        if _is(inner, aten.erf.default) and _times(inner.args[0], 0.7071067811865476) is z:
            return _name(aten.gelu.default, "none"), z, [node, half, rest, inner, inner.args[0]]
        if _is(inner, aten.tanh.default):
            scaled = inner.args[0]
            s = _times(scaled, 0.7978845608028654)
            if _is(s, aten.add.Tensor) and len(s.args) == 2 and s.args[0] is z:
                cube = _times(s.args[1], 0.044715)
                if _is(cube, aten.mul.Tensor) and cube.args[1] is z and _is(cube.args[0], aten.mul.Tensor) \
                        and list(cube.args[0].args) == [z, z]:
                    return (_name(aten.gelu.default, "tanh"), z,
                            [node, half, rest, inner, scaled, s, s.args[1], cube, cube.args[0]])
    return None


def _silu(node: Any) -> tuple[Node, list[Node]]:
    """``(z, nodes)`` for ``SiLU(z)`` in any of its ATen spellings; else raise."""
    if _is(node, aten.silu.default):
        return node.args[0], [node]
    if _is(node, aten.mul.Tensor):
        a, b = node.args[:2]
        for z, s in ((a, b), (b, a)):
            if _is(s, aten.sigmoid.default) and s.args[0] is z:
                return z, [node, s]
    if _is(node, aten.div.Tensor):
        z, den = node.args[:2]
        if _is(den, aten.add.Tensor) and _no_kwargs(den, {"alpha": 1}):
            for e, one in (den.args[:2], den.args[1::-1]):
                if one == 1 and _is(e, aten.exp.default) and _is(e.args[0], aten.neg.default) \
                        and e.args[0].args[0] is z:
                    return z, [node, den, e, e.args[0]]
    name = getattr(node, "target", node)
    raise _NoMatch(f"activation {getattr(node, 'name', node)} ({name}) is not SiLU")
