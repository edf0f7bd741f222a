"""Emitting what the op takes from a loop's steps: step tables, time and condition biases, noise.

Step-only values (coefficients, time embeddings) are computed by the steps'
own nodes; when they are the same for the whole batch (shared timesteps:
a Python-int ``t``, ``torch.full`` timesteps) each step's value is its first
row, and the K rows are stacked into tables indexed by ``s = K - 1 - k``
(``t_start = K - 1``). :func:`_uniform` proves a value is the same in
every row. Where the timesteps differ between samples, :func:`_indexed_tables`
evaluates step 0's coefficients at every step index (:mod:`.timesteps`).
Loop-invariant inputs of the first Linear fold into ``cond_bias``.
"""
from __future__ import annotations

import math

from typing import Any

import torch
from torch.fx import Graph, Node

from .coefficients import _Coef
from .linear import _linear
from .nodes import _NoMatch, _is, _known_eq, _val, aten, prims


class _Emitter:
    """Inserts nodes before ``anchor``, each with its fake ``val`` and the anchor's module stack.
    A symbolic size among the arguments (a dynamic batch) is read from ``sample``, the node
    whose value ``example`` is, by an ``aten.sym_size`` node: a post-grad graph names its sizes
    by nodes, not constants."""

    def __init__(self, graph: Graph, anchor: Node, example: torch.Tensor, sample: Node | None = None):
        self.graph, self.anchor, self.sample = graph, anchor, sample
        self.fake_mode = getattr(example, "fake_mode", None)
        self.device = example.device
        self.inserted: list[Node] = []
        self.sizes: dict = {}

    def _size_node(self, size: torch.SymInt) -> Node:
        shape = _val(self.sample).shape if self.sample is not None else ()
        for d, s in enumerate(shape):
            if isinstance(s, torch.SymInt) and s.node.expr == size.node.expr:
                if d not in self.sizes:
                    self.sizes[d] = self(aten.sym_size.int, self.sample, d)
                return self.sizes[d]
        raise _NoMatch(f"the size {size} is symbolic and not one of the sample's")

    def __call__(self, target, *args, **kwargs) -> Node:
        def name_sizes(a):
            if isinstance(a, (list, tuple)):
                return type(a)(name_sizes(v) for v in a)
            return self._size_node(a) if isinstance(a, torch.SymInt) else a
        args, kwargs = name_sizes(args), {k: name_sizes(v) for k, v in kwargs.items()}
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.inserted.append(node)
        # An exported program's unflatten places every node by its module stack: the loop's.
        for key in ("nn_module_stack", "stack_trace"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        if self.fake_mode is not None:
            vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta.get("val"))
            with self.fake_mode, torch.no_grad():
                node.meta["val"] = target(*vals[0], **vals[1])
        return node

    def full(self, shape: list, value: float, dtype=torch.float32) -> Node:
        return self(aten.full.default, shape, value, dtype=dtype, device=self.device, pin_memory=False)

    def cast(self, node: Node, dtype: torch.dtype) -> Node:
        """``node`` in ``dtype`` (itself where it is already)."""
        return node if _val(node).dtype == dtype else self(prims.convert_element_type.default, node, dtype)

    def stack(self, rows: list) -> Node:
        """``torch.stack(rows)`` as inductor's post-grad graph spells it (``cat`` of ``unsqueeze``)."""
        return self(aten.cat.default, [self(aten.unsqueeze.default, r, 0) for r in rows])

    def rollback(self) -> None:
        for n in reversed(self.inserted):
            self.graph.erase_node(n)
        self.inserted.clear()


def _scalar(em: _Emitter, c: _Coef, memo: dict) -> Any:
    """``c`` as a 0-d node (or a Python float), its leaves read at row 0."""
    if c.op == "num":
        return c.args[0]
    if c.op == "leaf":
        leaf = c.args[0]
        if leaf not in memo:
            v = _val(leaf)
            memo[leaf] = leaf if v.dim() == 0 else em(aten.select.int, em(aten.reshape.default, leaf, [-1]), 0, 0)
        return memo[leaf]
    parts = [_scalar(em, a, memo) for a in c.args]
    if c.op == "where":
        return _where(em, *parts)
    if all(isinstance(p, float) for p in parts):
        a = parts[0]
        return {"neg": lambda: -a, "mul": lambda: a * parts[1], "add": lambda: a + parts[1],
                "div": lambda: a / parts[1]}[c.op]()
    if c.op == "neg":
        return em(aten.neg.default, parts[0])
    a, b = parts
    if c.op == "div":
        return em(aten.div.Tensor, a if isinstance(a, Node) else _number(em, a, b), b)
    if not isinstance(a, Node):
        a, b = b, a
    return em(aten.mul.Tensor if c.op == "mul" else aten.add.Tensor, a, b)


def _number(em: _Emitter, value: float, other: Any) -> Node:
    """The Python number ``value`` as a 0-d node beside the operand ``other``: of ``other``'s
    dtype where it is a node, as eager computes a number with a tensor; else float32 (torch's
    default dtype, eager's for an op of numbers alone)."""
    return em.full([], value, _val(other).dtype if isinstance(other, Node) else torch.float32)


def _where(em: _Emitter, cond: Node, a: Any, b: Any) -> Node:
    """``where(cond, a, b)`` of a boolean node and two coefficients (nodes or floats)."""
    a, b = (p if isinstance(p, Node) else _number(em, p, q) for p, q in ((a, b), (b, a)))
    return em(aten.where.self, cond, a, b)


def _stack_rows(em: _Emitter, per_step: list, dtype=torch.float32) -> Node:
    """``stack`` of one value per step, the last step first (row ``s = K - 1 - k``), in
    ``dtype`` (a number in it: a step's number multiplies the sample in the sample's dtype)."""
    rows = [r if isinstance(r, Node) else em.full([], r, dtype) for r in reversed(per_step)]
    return em.cast(em.stack(rows), dtype)


def _shared_tables(em: _Emitter, updates: list, dtype: torch.dtype) -> Node:
    """``(6, K)``: rows A, B, C, D, E, S of every step, stacked by ``s = K - 1 - k``; ``(7, K)``
    with row P where a step reads the previous step's x0 (a multistep solver); ``(9, K)`` with P,
    Q and R where a step reads an eps back from its clamped x0; in ``dtype`` (the sample's). Row
    ``K - 1``, the call's first step, has ``P = 0``: the loop's first step reads no previous x0
    (the op's is zero there)."""
    memo: dict = {}
    rows = _row_count(updates)
    columns = [[0.0 if c is None else _scalar(em, c, memo) for c in _coefs(u, rows)] for u in updates]
    return em.stack([_stack_rows(em, [step[i] for step in columns], dtype) for i in range(rows)])


def _first_row(em: _Emitter, piece: Node) -> Node:
    return em(aten.select.int, piece, 0, 0)


# ----------------------------------------------------------------------------- one value per batch

_ROW_OPS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
            aten.expand.default, aten.clone.default, aten.alias.default, aten.slice.Tensor,
            aten.select.int, aten.permute.default)


def _uniform(node: Any, batch, memo: dict) -> bool:
    """Whether every row of ``node`` along the batch dimension is the same
    (true of values without a batch dimension: tables, weights, scalars)."""
    if not isinstance(node, Node):
        return True
    if node in memo:
        return memo[node]
    memo[node] = False  # cycles cannot happen; this is the answer while unproved
    memo[node] = _uniform_uncached(node, batch, memo)
    return memo[node]


def _batched(node: Node, batch) -> bool:
    v = _val(node)
    return v is not None and v.dim() >= 1 and _known_eq(v.shape[0], batch) and not _known_eq(batch, 1)


def _uniform_uncached(node: Node, batch, memo: dict) -> bool:
    if not _batched(node, batch):
        return True  # one row, or no batch dimension: it broadcasts the same into every row
    if _is(node, aten.full.default, aten.zeros.default, aten.ones.default):
        return True
    if _is(node, aten.copy.default):  # ``torch.full((B,), t)`` of a 0-d tensor ``t``: t copied into every row
        return _uniform(node.args[1], batch, memo)
    if node.op != "call_function":
        return False
    try:  # a Linear in any form (pad_mm pads a GPU's rows too): a row of it reads that row only
        inp, _w, bias, _nodes = _linear(node)
    except _NoMatch:
        pass
    else:
        bv = _val(bias)
        return (bias is None or bv is not None and bv.dim() <= 1) and _uniform(inp, batch, memo)
    tags = getattr(node.target, "tags", ())
    if torch.Tag.pointwise in tags or _is(node, prims.convert_element_type.default, aten._to_copy.default,
                                             aten.to.dtype, prims.device_put.default):
        return _inputs_uniform(node, batch, memo)
    if _is(node, aten.gather.default, aten.index.Tensor, aten.index_select.default):
        table = node.args[0]
        tv = _val(table)
        if tv is not None and tv.dim() == 1:
            # Every row reads a one-dimensional table at its own index: the same index, the same
            # value, whatever the table's length (which may happen to equal the batch's).
            return all(_uniform(a, batch, memo) for a in node.all_input_nodes if a is not table)
        return _inputs_uniform(node, batch, memo)
    if _is(node, aten.mm.default):  # a row of the product reads that row of the input only
        return _uniform(node.args[0], batch, memo)
    if _is(node, aten.addmm.default):
        bias = _val(node.args[0])
        return bias is not None and bias.dim() <= 1 and _uniform(node.args[1], batch, memo)
    if _is(node, aten.cat.default):
        dim = node.args[1] if len(node.args) > 1 else 0
        return dim != 0 and all(_uniform(a, batch, memo) for a in node.args[0])
    if _is(node, aten.repeat.default):  # flow policies' ts[i].repeat(B, 1)
        src, repeats = node.args[0], list(node.args[1])
        sv = _val(src)
        if sv is None:
            return False
        if len(repeats) > sv.dim() or _known_eq(sv.shape[0], 1):
            return True  # every row is the whole source, or copies of its one row
        return repeats[0] == 1 and _uniform(src, batch, memo)
    if _is(node, aten.expand.default):  # ConditionalUnet1D's ``torch.tensor([t]).expand(B)``
        sv = _val(node.args[0])
        if sv is not None and (sv.dim() < _val(node).dim() or _known_eq(sv.shape[0], 1)):
            return True  # every row is the whole source, or its one row
    if _is(node, *_ROW_OPS):
        src = node.args[0]
        sv, v = _val(src), _val(node)
        keeps_rows = sv is not None and (sv.dim() == 0 or (sv.dim() >= 1 and _known_eq(sv.shape[0], v.shape[0])))
        if _is(node, aten.permute.default):
            keeps_rows = keeps_rows and list(node.args[1])[0] == 0
        if _is(node, aten.slice.Tensor, aten.select.int):
            keeps_rows = keeps_rows and node.args[1] not in (0, -sv.dim())
        return keeps_rows and _uniform(src, batch, memo)
    return False


def _inputs_uniform(node: Node, batch, memo: dict) -> bool:
    return all(_uniform(a, batch, memo) for a in node.all_input_nodes)


def _check_uniform(nodes, batch) -> None:
    memo: dict = {}
    for n in nodes:
        if _batched(n, batch) and not _uniform(n, batch, memo):
            raise _NoMatch(f"{n.name} may differ between samples, and the timesteps are not a "
                           "per-sample tensor")


# ----------------------------------------------------------------------------- tables over step indices

def _row_count(updates: list) -> int:
    """The rows of the op's tables for ``updates``: 9 where a step reads an eps back from its
    clamped x0 (rows P, Q, R), 7 where one reads the previous x0 (P), else 6."""
    if any(u.eps_read is not None for u in updates):
        return 9
    return 7 if any("p" in u.post for u in updates) else 6


def _coefs(u, rows: int | None = None) -> list:
    """The coefficients of an update in the op's row order (``None`` where absent; B as the op
    reads it): the six, then P where it reads one, Q and R where it reads an eps back from x0,
    or the first ``rows`` of them. E is that eps's coefficient where the step reads one."""
    pre = u.pre or {}
    b = pre.get("e")
    read = u.eps_read
    rows = rows or (9 if read is not None else 7 if "p" in u.post else 6)
    coefs = [pre.get("x"), None if b is None else _Coef("neg", (b,)), u.post.get("x0"), u.post.get("x"),
             u.post.get("er" if read is not None else "e"), u.post.get("z"), u.post.get("p"),
             None if read is None else read["x"], None if read is None else _Coef("neg", (read["x0"],))]
    return coefs[:rows]


def _shape_of(c) -> Any:
    """``c`` with its leaves blanked: two steps' coefficients are one function when these agree."""
    if c is None or c.op == "num":
        return c
    if c.op == "leaf":
        return "leaf"
    return (c.op, *map(_shape_of, c.args))


def _leaves_of(c, out: list) -> list:
    if c is not None and c.op == "leaf":
        out.append(c.args[0])
    elif c is not None and c.op != "num":
        for a in c.args:
            _leaves_of(a, out)
    return out


def _step_values(updates: list) -> list[list]:
    """Per step, the leaves of its coefficients in one order; raise unless every step has step 0's form."""
    form = [_shape_of(c) for c in _coefs(updates[0])]
    if any(u.eps_read is not None for u in updates[1:]) and updates[0].eps_read is None:
        raise _NoMatch("a later step reads an eps back from its clamped x0 and step 0 does not")
    if any("p" in u.post for u in updates):
        # Step 0 reads no previous x0, so it is not the function that gives the P table.
        raise _NoMatch("a step reads the previous step's x0 (a multistep solver), which is read with "
                       "timesteps shared by the batch only")
    values = []
    for k, u in enumerate(updates):
        if [_shape_of(c) for c in _coefs(u)] != form:
            raise _NoMatch(f"step {k}'s update is not step 0's function of its timestep")
        values.append([leaf for c in _coefs(u) for leaf in _leaves_of(c, [])])
    return values


def _vector(em: _Emitter, c: _Coef, reemit, batch, memo: dict) -> Any:
    """``c`` over every step index (``(S,)``), or a 0-d node or float where it does not vary."""
    if c.op == "num":
        return c.args[0]
    if c.op == "leaf":
        leaf = c.args[0]
        if leaf in memo:
            return memo[leaf]
        if reemit.depends(leaf):
            rows = reemit.rows(leaf)
            v = _val(leaf)
            if v.dim() >= 2 and math.prod(v.shape[1:]) != 1:
                # A leaf broadcast over the sample's other dims (affine._row_constant) has one
                # number a row, repeated: its first.
                memo[leaf] = em(aten.select.int, em(aten.reshape.default, rows, [reemit.size(), -1]), 1, 0)
            else:
                memo[leaf] = em(aten.reshape.default, rows, [reemit.size()])
        else:
            _check_uniform([leaf], batch)
            memo[leaf] = _scalar(em, c, {})
        return memo[leaf]
    parts = [_vector(em, a, reemit, batch, memo) for a in c.args]
    if c.op == "where":
        return _where(em, *parts)
    if all(isinstance(p, float) for p in parts):
        return _scalar(em, _Coef(c.op, tuple(_Coef("num", (p,)) for p in parts)), {})
    if c.op == "neg":
        return em(aten.neg.default, parts[0])
    a, b = (p if isinstance(p, Node) else _number(em, p, q) for p, q in (parts, parts[::-1]))
    target = {"mul": aten.mul.Tensor, "add": aten.add.Tensor, "div": aten.div.Tensor}[c.op]
    return em(target, a, b)


def _indexed_tables(em: _Emitter, updates: list, reemit, batch, dtype: torch.dtype) -> Node:
    """``(6, S)`` (``(9, S)`` with an eps read back from x0): step 0's coefficients evaluated at
    every step index ``s``, in ``dtype`` (the sample's)."""
    S = reemit.size()
    memo: dict = {}
    constant_rows: dict = {}  # one row per number the coefficients are (the absent ones' 0.0)
    rows = []
    for c in _coefs(updates[0]):
        v = 0.0 if c is None else _vector(em, c, reemit, batch, memo)
        if not isinstance(v, Node):
            if v not in constant_rows:
                constant_rows[v] = em.full([S], v, dtype)
            v = constant_rows[v]
        elif _val(v).dim() == 0:
            v = em(aten.expand.default, em(aten.reshape.default, v, [1]), [S])
        rows.append(em.cast(v, dtype))
    return em.stack(rows)
