"""Node predicates and the small structural readers of the matcher.

Each reader takes one FX node and either returns the pieces it is made of
(``_column_of``: the ``(B,)`` tensor a ``(B, 1)`` column reshapes,
``_coefficient``: ``(table, t)`` of ``table[t]``, ``_time_column``: ``(t, T)``
of ``t.float() / T``, ``_silu``, ``_transposed``, ...) or raises
``_NoMatch`` with the reason it does not. They look at one node and its
inputs only; whether the pieces form a DDPM step is :mod:`.steps`'s concern,
the many spellings of a Linear are :mod:`.linear`'s.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

aten = torch.ops.aten
prims = torch.ops.prims


def _op_or_none(packet: str, overload: str):
    try:
        return getattr(getattr(aten, packet), overload)
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch
        return None


# torch.export's check of a tensor's dtype/device: it reads a node without using its value,
# so it goes with the node it checks.
_ASSERT_METADATA = _op_or_none("_assert_tensor_metadata", "default")


class _NoMatch(Exception):
    """Raised inside the matcher with the reason a candidate was left alone."""


def _is(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _val(node: Any):
    if not isinstance(node, Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _known_eq(a, b) -> bool:
    """``a == b`` for ints or SymInts, without adding a guard."""
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        return bool(statically_known_true(a == b))
    except Exception:  # pragma: no cover
        return isinstance(a, int) and isinstance(b, int) and a == b


def _shape_eq(shape, expected) -> bool:
    return len(shape) == len(expected) and all(_known_eq(a, b) for a, b in zip(shape, expected))


def _no_kwargs(node: Node, allowed: dict | None = None) -> bool:
    """True when ``node``'s kwargs hold nothing but the given default values."""
    allowed = allowed or {}
    return all(k in allowed and v == allowed[k] for k, v in node.kwargs.items())


def _int_const(a) -> int | None:
    if isinstance(a, bool):
        return None
    if isinstance(a, int):
        return a
    return None


_VIEW_LIKE = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _column_of(node: Any) -> Node:
    """The 1-D ``(B,)`` node that ``node`` reshapes to ``(B, 1)``; else raise."""
    out = _val(node)
    if out is None or out.dim() != 2:
        raise _NoMatch(f"{getattr(node, 'name', node)} is not a (B, 1) column")
    if _is(node, aten.unsqueeze.default):
        src, dim = node.args[0], node.args[1]
        if dim not in (1, -1):
            raise _NoMatch(f"{node.name} unsqueezes dim {dim}, not 1")
    elif _is(node, *_VIEW_LIKE):
        src = node.args[0]
    else:
        raise _NoMatch(f"{getattr(node, 'name', node)} ({getattr(node, 'target', node)}) "
                       "is not a reshape of a 1-D tensor to (B, 1)")
    src = _strip_identity_slices(src)
    sv = _val(src)
    if sv is None or sv.dim() != 1 or not _shape_eq(out.shape, (sv.shape[0], 1)):
        raise _NoMatch(f"{node.name} does not reshape a (B,) tensor to (B, 1)")
    return src


def _strip_identity_slices(node: Any) -> Any:
    """Skip ``x[:]`` (``aten.slice`` over a whole dim), as written by ``t[:, None]``."""
    while _is(node, aten.slice.Tensor):
        src = node.args[0]
        sv, ov = _val(src), _val(node)
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", None)
        if sv is None or ov is None or step != 1 or start not in (None, 0):
            break
        if not _shape_eq(ov.shape, sv.shape):
            break
        node = src
    return node


def _resolve_t(node: Any) -> tuple[Node, int]:
    """``node`` as ``root - offset`` with an integer constant offset."""
    offset = 0
    while True:
        if _is(node, aten.sub.Tensor) and _no_kwargs(node, {"alpha": 1}):
            c = _int_const(node.args[1])
            if c is None:
                break
            offset += c
            node = node.args[0]
        elif _is(node, aten.add.Tensor) and _no_kwargs(node, {"alpha": 1}):
            c = _int_const(node.args[1])
            if c is None:
                break
            offset -= c
            node = node.args[0]
        else:
            break
    if not isinstance(node, Node):
        raise _NoMatch("the timestep is not a tensor")
    return node, offset


def _table_lookup(col: Node) -> tuple[Node, Node]:
    """``(table, t)`` for ``table[t]``."""
    if _is(col, aten.index.Tensor):
        table, indices = col.args[0], col.args[1]
        if not isinstance(indices, (list, tuple)) or len(indices) != 1:
            raise _NoMatch(f"{col.name} indexes with {indices}, not one timestep tensor")
        return table, indices[0]
    if _is(col, aten.index_select.default) and col.args[1] in (0, -1):
        return col.args[0], col.args[2]
    # table.gather(-1, t), as in the DDPM reference code's extract(); equal to
    # table[t] for a 1-D table and 1-D t
    if _is(col, aten.gather.default) and col.args[1] in (0, -1) and not col.kwargs.get("sparse_grad"):
        tv, iv = _val(col.args[0]), _val(col.args[2])
        if tv is not None and iv is not None and tv.dim() == 1 and iv.dim() == 1:
            return col.args[0], col.args[2]
    raise _NoMatch(f"{col.name} ({col.target}) is not a table lookup table[t]")


def _coefficient(node: Any) -> tuple[Node, Node]:
    """``(table, t)`` for ``table[t]`` reshaped to ``(B, 1)``."""
    return _table_lookup(_column_of(node))


def _times_one(node: Any) -> Any:
    """``a`` for ``a * 1`` (the ``alpha``/``beta`` factors of a decomposed addmm)."""
    if _is(node, aten.mul.Tensor) and len(node.args) == 2 and node.args[1] == 1 \
            and not isinstance(node.args[1], bool):
        return node.args[0]
    return node


def _transposed(node: Any) -> Node:
    if _is(node, aten.permute.default) and list(node.args[1]) in ([1, 0], [-1, -2], [-1, 0], [1, -2]):
        return node.args[0]
    if _is(node, aten.t.default):
        return node.args[0]
    if _is(node, aten.transpose.int) and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]:
        return node.args[0]
    raise _NoMatch(f"{getattr(node, 'name', node)} is not the transpose of a Linear weight")


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


def _float32_cast_source(node: Any) -> Any:
    """``t`` for ``t.float()`` / ``t.to(torch.float32)`` (any ATen spelling), else None."""
    if _is(node, prims.convert_element_type.default):
        ok = node.args[1] == torch.float32
    elif _is(node, aten._to_copy.default):
        ok = node.kwargs.get("dtype") == torch.float32 and set(node.kwargs) <= {"dtype", "device", "layout"}
        ok = ok and len(node.args) == 1
    elif _is(node, aten.to.dtype):
        ok = len(node.args) >= 2 and node.args[1] == torch.float32 and not any(node.args[2:]) \
            and not any(node.kwargs.values())
    else:
        ok = False
    return node.args[0] if ok else None


def _time_column(node: Any) -> tuple[Node, int]:
    """``(t, T)`` for the ``(B, 1)`` time column ``t.float() / T``: reshaped
    after the division or before it (``t[:, None].float() / T``,
    ``t.float()[:, None] / T``); ``t / T`` (true division of the int
    timesteps, which promotes to float32 first) in either place as well."""
    nv = _val(node)
    reshaped_first = _is(node, aten.div.Tensor, aten.div.Scalar) and nv is not None and nv.dim() == 2
    q = node if reshaped_first else _column_of(node)
    if not (_is(q, aten.div.Tensor, aten.div.Scalar) and len(q.args) == 2 and not q.kwargs):
        raise _NoMatch(f"the time column {q.name} is not t.float() / T")
    f, T = q.args
    if isinstance(T, bool) or not isinstance(T, (int, float)) or T <= 0 or int(T) != T:
        raise _NoMatch(f"the time column divides by {T!r}, not a positive integer T")
    t = _float32_cast_source(f)
    cast = t is not None
    if not cast:
        t = f
    if reshaped_first:
        t = _column_of(t)
        if not cast:
            inner = _float32_cast_source(t)
            cast = inner is not None
            t = inner if cast else t
    tv, qv = _val(t), _val(q)
    if not cast and (qv is None or qv.dtype != torch.float32):
        raise _NoMatch(f"the time column {q.name} is not t.float() / T")
    if tv is None or tv.dim() != 1 or tv.dtype not in (torch.int32, torch.int64):
        raise _NoMatch("the timestep is not a 1-D int32/int64 tensor")
    return t, int(T)
