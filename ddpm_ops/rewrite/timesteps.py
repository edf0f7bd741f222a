"""Step-only values as tables over every step index, computed by the loop's own nodes.

A step's coefficients and time embeddings are functions of its timestep.
:func:`_unify` proves that step ``k``'s value is step 0's function applied
to step ``k``'s timestep: the two subgraphs are the same node for node,
except at *sites*:

* ``"index"``: per-sample timesteps ``t_k = root - (offset + k)``, one root
  and one offset for the whole loop (every lookup reads ``t_k`` itself);
* ``"full"``: timesteps shared by the batch, ``full(shape, v_k)`` with the
  same shape and dtype in every step, or a batch-free value broadcast to
  every row by ``expand`` / ``repeat`` with the same sizes in every step
  (flow policies' ``ts[i].expand(B, 1)`` of a ``linspace``).

:class:`_Reemit` then copies step 0's subgraph into the graph with each
site replaced by a vector (``arange(S)`` for index sites, the K step values
``v_k``, last step first, for full sites) after proving that every copied
node maps row ``b`` of its inputs to row ``b`` of its output, so row ``s``
of the copy is the value at step index ``s``. Parameters are read by the
copy, so the tables follow them from call to call. Anything else raises
``_NoMatch`` with the node it could not prove.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from .linear import _linear
from .nodes import _NoMatch, _is, _known_eq, _resolve_t, _val, aten, prims

_RANDOM = {getattr(prims, n).default for n in ("inductor_random", "inductor_randint", "inductor_seeds")
           if hasattr(prims, n)}
_LOOKUPS = (aten.gather.default, aten.index.Tensor, aten.index_select.default)
_KEEP_ROWS = (aten.clone.default, aten.alias.default, aten.contiguous.default)
_SHAPED = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)


def _random(node: Node) -> bool:
    return node.target in _RANDOM or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


class _Sites:
    """The sites found so far: step-0 site node -> per-step node, and the index root."""

    def __init__(self, K: int):
        self.K = K
        self.steps: dict[Node, list] = {}
        self.kind: str | None = None
        self.root: Node | None = None
        self.offset: int | None = None

    def _index_pair(self, a: Node, b: Node, k: int) -> bool:
        va, vb = _val(a), _val(b)
        if va is None or vb is None or va.dtype not in (torch.int32, torch.int64) or va.dtype != vb.dtype \
                or va.dim() != 1 or vb.dim() != 1:
            return False
        try:
            (ra, oa), (rb, ob) = _resolve_t(a), _resolve_t(b)
        except _NoMatch:
            return False
        if ra is not rb or oa - ob != k:
            return False
        if self.root is None:
            self.root, self.offset = rb, ob
        if rb is not self.root or ob != self.offset:
            raise _NoMatch(f"{b.name} reads the timestep at offset {ob}, another lookup at {self.offset}")
        return True

    def _full_pair(self, a: Node, b: Node) -> bool:
        if _is(a, aten.expand.default, aten.repeat.default) and _is(b, a.target):
            return _broadcast_rows(a) and _broadcast_rows(b) and list(a.args[1]) == list(b.args[1]) \
                and not a.kwargs and not b.kwargs
        if not (_is(a, aten.full.default) and _is(b, aten.full.default)):
            return False
        return list(a.args[0]) == list(b.args[0]) and a.kwargs == b.kwargs and _val(a).dim() >= 1 \
            and isinstance(a.args[1], (int, float)) and isinstance(b.args[1], (int, float))

    def pair(self, a: Node, b: Node, k: int) -> bool:
        kind = "index" if self._index_pair(a, b, k) else "full" if self._full_pair(a, b) else None
        if kind is None:
            return False
        if self.kind not in (None, kind):
            raise _NoMatch(f"{b.name}: the loop mixes per-sample and batch-shared timesteps")
        self.kind = kind
        per_step = self.steps.setdefault(b, [None] * self.K)
        if per_step[k] not in (None, a):
            raise _NoMatch(f"{b.name} stands for two values of step {k}")
        per_step[k] = a
        return True


def _broadcast_rows(n: Node) -> bool:
    """Whether ``n``, an ``expand`` or ``repeat``, makes every row of its (batched) result the
    whole of a source without that dimension, or copies of its one row: one value per step."""
    src, out = _val(n.args[0]), _val(n)
    if src is None or out is None or out.dim() == 0:
        return False
    return src.dim() < out.dim() or _known_eq(src.shape[0], 1)


def _depends_on(node: Any, roots: set, memo: dict) -> bool:
    if not isinstance(node, Node):
        return False
    if node not in memo:
        memo[node] = node in roots or any(_depends_on(a, roots, memo) for a in node.all_input_nodes)
    return memo[node]


def _unify(a: Any, b: Any, k: int, sites: _Sites, seen: dict) -> bool:
    """Whether step ``k``'s value ``a`` is step 0's value ``b`` with sites swapped."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_unify(x, y, k, sites, seen) for x, y in zip(a, b))
    if not isinstance(a, Node) or not isinstance(b, Node):
        return not isinstance(a, Node) and not isinstance(b, Node) and type(a) is type(b) and a == b
    if (a, b) in seen:
        return seen[(a, b)]
    if a is b:
        ok = True
        if k:
            seen.setdefault("shared", []).append((a, k))
    elif sites.pair(a, b, k):
        ok = True
    else:
        ok = a.op == b.op == "call_function" and a.target == b.target and not _random(a) \
            and _unify(list(a.args), list(b.args), k, sites, seen) \
            and a.kwargs.keys() == b.kwargs.keys() \
            and all(_unify(a.kwargs[n], b.kwargs[n], k, sites, seen) for n in a.kwargs)
    seen[(a, b)] = ok
    return ok


class _NoSites(_Sites):
    def pair(self, a: Node, b: Node, k: int) -> bool:
        return False


def _recomputed(a: Node, b: Node) -> bool:
    """Whether ``a`` is ``b`` itself or ``b`` computed again: the same ops, nothing random, on the
    same inputs."""
    return a is b or _unify(a, b, 1, _NoSites(2), {})


def _find_sites(per_step: list[list], K: int) -> _Sites:
    """The sites of values ``per_step[k][j]`` (step k, value j); raise if a value is not step 0's."""
    sites = _Sites(K)
    seen: dict = {}
    for k in range(1, K):  # step 1 first: it finds the root the later steps are held to
        for a, b in zip(per_step[k], per_step[0]):
            if not _unify(a, b, k, sites, seen):
                raise _NoMatch(f"{getattr(a, 'name', a)} of step {k} is not step 0's "
                               f"{getattr(b, 'name', b)} at its own timestep")
    memo: dict = {}
    for a, k in seen.get("shared", []):  # a value shared by two steps reads no step's own timestep
        if sites.root is not None and _depends_on(a, {sites.root}, {}):
            raise _NoMatch(f"{a.name} is read by step {k} and step 0 but depends on the timestep")
        for b, nodes in sites.steps.items():
            if _depends_on(a, {b}, memo.setdefault(b, {})):
                if nodes[k] not in (None, b):
                    raise _NoMatch(f"{a.name} is read by step {k} and step 0 but depends on a timestep")
                nodes[k] = b
    for b, nodes in sites.steps.items():
        nodes[0] = b
        if any(n is None for n in nodes):
            raise _NoMatch(f"the timestep {b.name} of step 0 has no counterpart in every step")
    return sites


def _lookup_sites(values: list) -> _Sites:
    """The sites of one step's ``values`` (a loop of one step): the index of every table lookup
    they read, and every other node that is that timestep, ``root - offset`` with one root and
    one offset for all; raise if two lookups read different timesteps."""
    sites = _Sites(1)
    nodes, seen, work = [], set(), [v for v in values if isinstance(v, Node)]
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        nodes.append(n)
        work.extend(n.all_input_nodes)
    for n in nodes:
        if _is(n, *_LOOKUPS):
            idx = (n.args[1][0] if len(n.args[1]) == 1 else None) if _is(n, aten.index.Tensor) else n.args[2]
            if isinstance(idx, Node) and _val(idx) is not None and _val(idx).dim() == 1:
                root, offset = _resolve_t(idx)
                if sites.root not in (None, root) or sites.offset not in (None, offset):
                    raise _NoMatch(f"{n.name} reads the timestep {idx.name}, another lookup "
                                   f"{sites.root.name} - {sites.offset}")
                sites.root, sites.offset, sites.kind = root, offset, "index"
    if sites.root is None:
        return sites
    for n in nodes:
        v = _val(n)
        if v is not None and v.dim() == 1 and v.dtype in (torch.int32, torch.int64) \
                and _resolve_t(n) == (sites.root, sites.offset):
            sites.steps[n] = [n]
    return sites


class _Reemit:
    """Copies step-0 values with their sites replaced by vectors (see the module docstring)."""

    def __init__(self, em, sites: _Sites):
        self.em, self.sites = em, sites
        self.memo: dict[Node, Any] = {}
        self.proved: set = set()
        self.dep: dict = {}
        self.bound: int | None = None
        self.vectors: dict[Node, Node] = {}
        self.linears: dict[Node, tuple] = {}

    def depends(self, node: Any) -> bool:
        return _depends_on(node, set(self.sites.steps), self.dep)

    # -- the proof, before anything is emitted
    def prove(self, node: Any) -> None:
        if not self.depends(node) or node in self.sites.steps:
            return
        if node in self.proved:
            return
        self.proved.add(node)
        if self._prove_linear(node):
            return
        self._prove_node(node)
        for a in node.all_input_nodes:
            self.prove(a)

    def _prove_linear(self, n: Node) -> bool:
        """A Linear of the timestep's rows by fixed parameters, in any form ``_linear`` reads
        (pad_mm's padding of the batch rows too): copied as one ``addmm`` of the rows."""
        try:
            inp, weight, bias, _ = _linear(n)
        except _NoMatch:
            return False
        bv = _val(bias)
        if not self.depends(inp) or self.depends(weight) or self.depends(bias) or bv is None or bv.dim() != 1:
            return False
        self.linears[n] = (inp, weight, bias)
        self.prove(inp)
        return True

    def _rows_operand(self, node: Node, a: Any) -> None:
        out, v = _val(node), _val(a)
        if self.depends(a):
            if v is None or v.dim() != out.dim() or v.dim() == 0 or not _known_eq(v.shape[0], out.shape[0]):
                raise _NoMatch(f"{node.name} does not keep the timestep's rows in dim 0")
        elif v is not None and v.dim() == out.dim() and v.dim() > 0 and not _known_eq(v.shape[0], 1):
            raise _NoMatch(f"{node.name} combines the timestep with {a.name}, whose rows are not broadcast")

    def _prove_node(self, n: Node) -> None:
        out = _val(n)
        if n.op != "call_function" or out is None or out.dim() == 0 or _random(n):
            raise _NoMatch(f"{n.name} ({n.target}) is not a row-wise function of the timestep")
        tags = getattr(n.target, "tags", ())
        # A copy to another device keeps the rows: IDQL makes the timestep on the CPU with
        # torch.tensor([t]).repeat(B) and moves it to the GPU at every step.
        if torch.Tag.pointwise in tags or _is(n, prims.convert_element_type.default, aten.to.dtype, *_KEEP_ROWS,
                                              aten._to_copy.default, prims.device_put.default):
            for a in n.all_input_nodes:
                self._rows_operand(n, a)
            return
        if _is(n, *_LOOKUPS):
            self._prove_lookup(n)
            return
        if _is(n, aten.mm.default, aten.addmm.default):
            lhs, rhs = n.args[:2] if _is(n, aten.mm.default) else n.args[1:3]
            bias = n.args[0] if _is(n, aten.addmm.default) else None
            if not self.depends(lhs) or self.depends(rhs) or self.depends(bias) \
                    or (bias is not None and _val(bias).dim() > 1):
                raise _NoMatch(f"{n.name} is not the timestep's rows times a fixed matrix")
            return
        if _is(n, aten.cat.default):
            dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            if dim % out.dim() != 0:
                for p in n.args[0]:
                    self._rows_operand(n, p)
                    if not self.depends(p):
                        raise _NoMatch(f"{n.name} concatenates {p.name}, which is not computed from the timestep")
                return
        src = n.args[0]
        sv = _val(src)
        if sv is None or sv.dim() == 0 or not _known_eq(sv.shape[0], out.shape[0]):
            raise _NoMatch(f"{n.name} does not keep the timestep's rows in dim 0")
        if _is(n, *_SHAPED) or (_is(n, aten.unsqueeze.default) and n.args[1] % (sv.dim() + 1) != 0) \
                or (_is(n, aten.permute.default) and list(n.args[1])[0] % sv.dim() == 0) \
                or (_is(n, aten.slice.Tensor, aten.select.int) and n.args[1] % sv.dim() != 0):
            return
        raise _NoMatch(f"{n.name} ({n.target}) is not a row-wise function of the timestep")

    def _prove_lookup(self, n: Node) -> None:
        if _is(n, aten.index.Tensor):
            table, idx, ok = n.args[0], n.args[1][0] if len(n.args[1]) == 1 else None, True
        elif _is(n, aten.index_select.default):
            table, idx, ok = n.args[0], n.args[2], n.args[1] == 0
        else:
            table, idx = n.args[0], n.args[2]
            ok = n.args[1] in (0, -1) and _val(table).dim() == 1 and not n.kwargs.get("sparse_grad")
        if not ok or idx is None or self.depends(table) or _val(idx).dim() != 1:
            raise _NoMatch(f"{n.name} is not a lookup table[t] of one timestep tensor")
        if self.sites.kind == "index":
            if idx not in self.sites.steps:
                raise _NoMatch(f"{n.name} indexes a table by a value computed from the timestep")
            size = _val(table).shape[0]
            if not isinstance(size, int):
                raise _NoMatch(f"{table.name} has a symbolic length")
            self.bound = size if self.bound is None else min(self.bound, size)

    # -- the copy
    def vector(self, site: Node) -> Node:
        em = self.em
        if site not in self.vectors:
            if self.sites.kind == "index":
                self.vectors[site] = em(prims.iota.default, self.size(), start=0, step=1,
                                        dtype=_val(site).dtype, device=_val(site).device, requires_grad=False)
            elif _is(site, aten.full.default):
                shape = list(site.args[0])[1:]
                values = [n.args[1] for n in reversed(self.sites.steps[site])]
                self.vectors[site] = em.stack([em(aten.full.default, shape, v, **site.kwargs) for v in values])
            else:  # a value broadcast to every row: each step's first row, computed by the step
                self.vectors[site] = em.stack([em(aten.select.int, n, 0, 0) for n in reversed(self.sites.steps[site])])
        return self.vectors[site]

    def size(self) -> int:
        if self.sites.kind == "full":
            return self.sites.K
        if self.bound is None:
            raise _NoMatch("no table is indexed by the per-sample timestep: its range is unknown")
        return self.bound

    def copy(self, node: Any) -> Any:
        if isinstance(node, (list, tuple)):
            return type(node)(self.copy(a) for a in node)
        if not isinstance(node, Node) or not self.depends(node):
            return node
        if node in self.sites.steps:
            return self.vector(node)
        if node in self.memo:
            return self.memo[node]
        if node in self.linears:
            inp, weight, bias = self.linears[node]
            copied = self.em(aten.addmm.default, bias, self.copy(inp),
                             self.em(aten.permute.default, weight, [1, 0]))
        elif _is(node, aten.mm.default) and _known_eq(_val(node.args[0]).shape[1], 1):
            # A product over one term (learned Fourier features: t times a (1, n) kernel) is an
            # outer product: a pointwise mul fuses with the features around it, where an mm
            # would be a matmul kernel of its own at every call (inductor turns it into the
            # mul on the CPU alone).
            copied = self.em(aten.mul.Tensor, self.copy(node.args[0]), node.args[1])
        else:
            args = [self.copy(a) for a in node.args]
            if _is(node, *_SHAPED):
                args[1] = [self.size(), *list(args[1])[1:]] if args[1][0] != -1 else list(args[1])
            kwargs = {k: self.copy(v) for k, v in node.kwargs.items()}
            copied = self.em(node.target, *args, **kwargs)
        self.memo[node] = copied
        return copied

    def rows(self, node: Any) -> Any:
        """``node`` over every step index: ``(S, ...)``; a value without a site as it is."""
        self.prove(node)
        return self.copy(node)
