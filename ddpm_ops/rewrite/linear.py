"""Reading a Linear layer in each ATen form it lowers to.

With a bias: ``aten.linear``; ``permute``/``t``/``transpose`` + ``addmm``;
``mm`` + ``add``; inductor's CPU decomposition of a one-row ``addmm``.
Without one (``nn.Linear(bias=False)``): ``aten.linear`` without a bias;
``permute``/``t``/``transpose`` + ``mm``. Any ``addmm`` or ``mm`` form also
as inductor's ``pad_mm`` leaves it on CUDA (operands zero-padded to aligned
sizes, the result sliced back). :func:`_linear` is the one entry point;
every form ends in the same check that the result is exactly
``input @ weight.T``.
"""
from __future__ import annotations

from typing import Any

from torch.fx import Node

from .nodes import _NoMatch, _int_const, _is, _known_eq, _no_kwargs, _shape_eq, _times_one, \
    _transposed, _val, aten


def _linear(node: Any) -> tuple[Node, Node, Node | None, list[Node]]:
    """``(input, weight, bias, nodes)`` for ``F.linear(input, weight, bias)``, ``bias`` None
    for a Linear without one.

    Also through inductor's ``pad_mm`` (a joint-graph pass that, on CUDA and
    when it benchmarks faster, zero-pads an ``addmm``'s operands to aligned
    sizes and slices the real block back out): zero rows and columns add
    exact zeros, so the block equals the unpadded Linear.
    """
    slices = []
    while _is(node, aten.slice.Tensor) and _from_start(node):
        slices.append(node)
        node = node.args[0]
    inp, weight, bias, nodes = _unpadded_linear(node)
    # Whatever was peeled off (padding, slices), the result must be exactly
    # input @ weight.T: (rows of input, rows of weight), inner sizes equal.
    out = slices[0] if slices else node
    ov, iv, wv = _val(out), _val(inp), _val(weight)
    if ov is None or iv is None or wv is None or iv.dim() != 2 or wv.dim() != 2 \
            or not _known_eq(iv.shape[1], wv.shape[1]) \
            or not _shape_eq(ov.shape, (iv.shape[0], wv.shape[0])):
        raise _NoMatch(f"{out.name} is not input @ weight.T of the Linear it wraps")
    return inp, weight, bias, slices + nodes


def _from_start(node: Node) -> bool:
    """``x[..., :end]``: an ``aten.slice`` from index 0 with step 1."""
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", 0)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    return start in (None, 0) and step == 1


def _zero_padded(node: Any, pads: list[Node]) -> Any:
    """``x`` for ``constant_pad_nd(x, pad, 0)`` padding only after each dim (pad_mm's padding).

    Only zero padding: a negative pad crops (``F.pad(h, (0, -1))``), which is
    not the identity on the product."""
    if _is(node, aten.constant_pad_nd.default):
        pad = list(node.args[1])
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
        amounts = [_int_const(p) for p in pad]
        if value == 0 and all(a is not None and a >= 0 for a in amounts) \
                and all(a == 0 for a in amounts[0::2]):
            pads.append(node)
            return node.args[0]
    return node


def _zero_extended_bias(node: Any, pads: list[Node]) -> Any:
    """``b`` for ``cat([b, zeros])`` (pad_mm's padding of a 1-D bias)."""
    if _is(node, aten.cat.default) and len(node.args[0]) == 2 \
            and (node.args[1] if len(node.args) > 1 else 0) in (0, -1):
        bias, zeros = node.args[0]
        if _is(zeros, aten.full.default) and zeros.args[1] == 0 and _val(bias) is not None \
                and _val(bias).dim() == 1:
            pads.extend([node, zeros])
            return bias
    return node


def _unpadded_linear(node: Any) -> tuple[Node, Node, Node | None, list[Node]]:
    if _is(node, aten.linear.default):
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[0], node.args[1], bias, [node]
    if _is(node, aten.addmm.default) and _no_kwargs(node, {"beta": 1, "alpha": 1}):
        return _addmm_linear(node)
    if _is(node, aten.mm.default) and _no_kwargs(node):
        return _mm_linear(node)
    if _is(node, aten.add.Tensor) and _no_kwargs(node, {"alpha": 1}):
        found = _mm_plus_bias(node) or _one_row_product_plus_bias(node)
        if found is not None:
            return found
    raise _NoMatch(f"{getattr(node, 'name', node)} ({getattr(node, 'target', node)}) is not a Linear")


def _addmm_linear(node: Node) -> tuple[Node, Node, Node, list[Node]]:
    """``addmm(b, input, weight.T)``, each operand possibly zero-padded by pad_mm."""
    pads: list[Node] = []
    bias = _zero_extended_bias(node.args[0], pads)
    inp = _zero_padded(node.args[1], pads)
    wt = _zero_padded(node.args[2], pads)
    return inp, _transposed(wt), bias, [node, *pads]


def _mm_linear(node: Node) -> tuple[Node, Node, None, list[Node]]:
    """``mm(input, weight.T)``: a Linear without bias, each operand possibly zero-padded by pad_mm."""
    pads: list[Node] = []
    inp = _zero_padded(node.args[0], pads)
    wt = _zero_padded(node.args[1], pads)
    return inp, _transposed(wt), None, [node, *pads]


def _mm_plus_bias(node: Node) -> tuple[Node, Node, Node, list[Node]] | None:
    """``mm(input, weight.T) + b`` (either order); None when neither operand is an ``mm``."""
    for mm, bias in (node.args[:2], node.args[1::-1]):
        if _is(mm, aten.mm.default) and isinstance(bias, Node):
            bv = _val(bias)
            if bv is not None and bv.dim() == 1:
                return mm.args[0], _transposed(mm.args[1]), bias, [node, mm]
    return None


def _one_row_product_plus_bias(node: Node) -> tuple[Node, Node, Node, list[Node]] | None:
    """inductor's CPU decomposition of a one-row addmm with small weights
    (batch 1): ``1 * (input.T * weight.T).sum(0, keepdim=True) + 1 * bias``."""
    for prod, bias in (node.args[:2], node.args[1::-1]):
        prod, bias = _times_one(prod), _times_one(bias)
        if not (_sums_product_over_rows(prod) and isinstance(bias, Node)):
            continue
        bv = _val(bias)
        if bv is None or bv.dim() != 1:
            continue
        mul = prod.args[0]
        found = _one_row_operands(mul, bv)
        if found is not None:
            inp, weight, it = found
            ones = [n for n in node.args[:2] if n is not prod and n is not bias]
            return inp, weight, bias, [node, prod, mul, it, *ones]
    return None


def _sums_product_over_rows(prod: Any) -> bool:
    """``(a * b).sum(0, keepdim=True)``."""
    return _is(prod, aten.sum.dim_IntList) and list(prod.args[1]) == [0] \
        and (prod.args[2] if len(prod.args) > 2 else prod.kwargs.get("keepdim")) is True \
        and _is(prod.args[0], aten.mul.Tensor)


def _one_row_operands(mul: Node, bv) -> tuple[Node, Node, Node] | None:
    """``(input, weight, input.T)`` for ``input.T * weight.T`` (either order)
    with a one-row input and a weight of ``bv``'s rows."""
    for it, wt in (mul.args[:2], mul.args[1::-1]):
        try:
            inp, weight = _transposed(it), _transposed(wt)
        except _NoMatch:
            continue
        iv, wv = _val(inp), _val(weight)
        # One row only: with more, `*` would multiply elementwise, not as a product.
        if iv is None or wv is None or iv.dim() != 2 or wv.dim() != 2 \
                or not _known_eq(iv.shape[0], 1) \
                or not _known_eq(wv.shape[0], bv.shape[0]) \
                or not _known_eq(iv.shape[1], wv.shape[1]):
            continue
        return inp, weight, it
    return None
