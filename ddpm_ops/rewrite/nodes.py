"""Node predicates and the small readers every stage of the rewrite uses.

Each looks at one FX node and its inputs only: its target (``_is``), its
example value (``_val``), sizes compared without guards (``_known_eq``), a
timestep as ``root - offset`` (``_resolve_t``), a transposed weight
(``_transposed``), a cast (``_cast``, ``_float32_cast_source``). A reader that
does not recognise its node raises ``_NoMatch`` with the reason; a loop left
alone is logged with it.
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
    """Raised inside the rewrite with the reason a candidate was left alone; ``node``, where
    given, is the node the reason is about (a reader of a whole network names it to the user)."""

    def __init__(self, reason: str, node: Node | None = None):
        super().__init__(reason)
        self.node = node


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


def _cast(node: Any) -> tuple[Any, torch.dtype] | None:
    """``(t, dtype)`` for ``t.to(dtype)`` (``.float()``, ``.double()``; any ATen spelling) that
    changes nothing but the dtype, else None."""
    if _is(node, prims.convert_element_type.default):
        cast = node.args[0], node.args[1]
    elif _is(node, aten._to_copy.default) and len(node.args) == 1 and "dtype" in node.kwargs \
            and set(node.kwargs) <= {"dtype", "device", "layout"}:
        cast = node.args[0], node.kwargs["dtype"]
    elif _is(node, aten.to.dtype) and len(node.args) >= 2 and not any(node.args[2:]) \
            and not any(node.kwargs.values()):
        cast = node.args[0], node.args[1]
    else:
        return None
    before, after = _val(cast[0]), _val(node)
    return cast if before is None or after is None or before.device == after.device else None


def _float32_cast_source(node: Any) -> Any:
    """``t`` for ``t.float()`` / ``t.to(torch.float32)`` (any ATen spelling), else None."""
    cast = _cast(node)
    return cast[0] if cast is not None and cast[1] == torch.float32 else None
