"""Finding sampling loops: applications of one MLP where each reads the sample the previous step made.

Nodes are classified by what they depend on: :func:`_latest_step` gives,
for every node, the latest application of the network whose output it
depends on (-1 for nodes independent of every step's sample: the step-only
and loop-invariant ones). For applications ``N_0 .. N_{K-1}`` of one network,
step ``k`` reads ``x_k``, the piece of ``N_k``'s input that depends on
``N_{k-1}`` (the same position of a ``cat`` in every step), or the sample
that piece is read from (an action chunk flattened, in its order or
another, a sample scaled by a number per step: :func:`_feed`); its update
is every node that depends on ``x_k`` or ``e_k`` up to ``x_{k+1}``, the
sample ``N_{k+1}`` reads. The last step ends at a node every later use of the step
goes through (:func:`_step_ends` lists them; :mod:`.plan` chooses). An
application chained to no other is a loop of one step where it reads a time
input beside its sample (:func:`_lone_x_pos`). A step that alone cannot be
fused raises :class:`_StepNoMatch`, and its loop is cut there
(:meth:`_Loop.part`). A piece that sums a value of the step and a condition
is read as two pieces through the same columns (:func:`_split_sums`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from .affine import _row_wise
from .network import _Net
from .nodes import _ASSERT_METADATA, _float32_cast_source, _NoMatch, _is, _known_eq, _no_kwargs, _shape_eq, _val, aten
from .tables import _batched, _uniform
from .timesteps import _recomputed


@dataclass
class _Loop:
    """``K`` steps of one network: ``nets[k]`` reads ``pieces[k]`` (``x`` at ``x_pos``).
    ``next_x`` is the sample the step after the last one reads, where a longer loop was cut
    after this part: the part's last step ends there."""

    nets: list
    pieces: list  # per step, the first Linear's input pieces (a cat's tensors, or [input]), then its terms
    x_pos: int
    next_x: Node | None = None
    # piece -> the earlier piece whose columns of the first Linear it is read through (a sum's
    # loop-invariant addend: :func:`_split_sums`)
    shared: dict = field(default_factory=dict)
    feeds: dict = field(default_factory=dict, repr=False)  # step -> its _Feed, once read

    def x(self, k: int) -> Node:
        return self.pieces[k][self.x_pos]

    def feed(self, k: int) -> _Feed:
        """How step ``k``'s network reads its sample (:func:`_feed`)."""
        if k not in self.feeds:
            self.feeds[k] = _feed(self.x(k))
        return self.feeds[k]

    def sample(self, k: int) -> Node:
        """Step ``k``'s sample as the update reads it: ``x(k)``, or what ``x(k)`` is read from (an
        action chunk ``(B, horizon, action_dim)`` the network reads as ``(B, horizon *
        action_dim)``, as DPPO's; a sample scaled for the network, as k-diffusion's ``input *
        c_in``)."""
        return self.feed(k).sample

    def part(self, start: int, stop: int) -> _Loop:
        """Steps ``start .. stop - 1`` as a loop of their own."""
        return _Loop(self.nets[start:stop], self.pieces[start:stop], self.x_pos,
                     self.x(stop) if stop < len(self.nets) else self.next_x, dict(self.shared))

    def columns(self) -> list:
        """Per piece, its ``(start, stop)`` among the first Linear's input columns (``None`` for
        a term, added after the Linear)."""
        read = len(self.pieces[0]) - len(self.nets[0].terms)
        out, start = [], 0
        for p, piece in enumerate(self.pieces[0]):
            if p >= read:
                out.append(None)
            elif p in self.shared:
                out.append(out[self.shared[p]])
            else:
                out.append((start, start + _val(piece).shape[1]))
                start = out[-1][1]
        return out


_LAYOUT = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
           aten.contiguous.default, aten.alias.default, aten.permute.default)


@dataclass(frozen=True)
class _Feed:
    """How a network's piece ``x(k)`` reads the step's sample: ``x(k) = R(c * sample)``, with ``R``
    ops that keep each row's elements in its row (a chunk's dims permuted and flattened to
    ``(B, n)``) and ``c`` a product of factors, each one number per sample (EDM's and
    k-diffusion's ``c_in * x``, diffusers' ``x / sqrt(sigma**2 + 1)``).

    ``path``: the ops from the sample to ``x(k)`` (empty where the network reads the sample as it
    is); ``order``: ``x(k)``'s row element ``j`` is the sample's row element ``order[j]`` (in
    row-major order), ``None`` where the orders agree; ``factors``: ``(factor, divides, shape)``
    of each scaling op, in order, ``shape`` the shape of the value it scales."""

    sample: Node
    path: tuple = ()
    order: tuple | None = None
    factors: tuple = ()


def _feed(piece: Node | None) -> _Feed:
    """How the network's input piece reads its step's sample: down from ``piece``, through
    readings that keep each row (:func:`_kept`) and scalings read by nothing else, to the first
    value also read elsewhere (by the update); where none is, to the last value a layout op alone
    leads to (a chunk that only the network reads). ``_Feed(piece)`` where the piece is the
    sample."""
    def read_elsewhere(n):
        return sum(not _is(u, _ASSERT_METADATA) for u in n.users) > 1

    plain = _Feed(piece)
    if not isinstance(piece, Node) or read_elsewhere(piece):
        return plain
    path, node, layout_only, fallback = [], piece, True, None
    while (below := _fed_from(node)) is not None:
        path.append(node)
        layout_only = layout_only and _kept(node) is not None
        node = below
        if read_elsewhere(node):
            break
        if layout_only:
            fallback = (node, len(path))
    else:
        if fallback is None:
            return plain
        node, path = fallback[0], path[:fallback[1]]
    path.reverse()
    order = _row_order(node, path)
    if order is None:
        return plain
    factors = []
    for i, n in enumerate(path):
        if _kept(n) is None:
            scaled = path[i - 1] if i else node
            factors.append((n.args[1] if n.args[0] is scaled else n.args[0], _is(n, aten.div.Tensor),
                            tuple(_val(n).shape)))
    return _Feed(node, tuple(path), None if order == list(range(len(order))) else tuple(order), tuple(factors))


def _fed_from(node: Node) -> Node | None:
    """The value ``node`` reads with each row's elements kept (:func:`_kept`) or scales by a
    factor that is one number per sample (``mul`` by it, ``div`` by it); else ``None``."""
    kept = _kept(node)
    if kept is not None:
        return kept
    if not _is(node, aten.mul.Tensor, aten.div.Tensor) or node.kwargs or len(node.args) != 2:
        return None
    out = _val(node)
    operands = node.args if _is(node, aten.mul.Tensor) else node.args[:1]
    for i, a in enumerate(operands):
        factor = node.args[1 - i]
        fv = _val(factor)
        if isinstance(a, Node) and _val(a) is not None and out is not None and _shape_eq(_val(a).shape, out.shape) \
                and (isinstance(factor, (int, float)) and not isinstance(factor, bool) or _row_wise(fv, out.shape)):
            return a
    return None


def _kept(node: Node) -> Node | None:
    """The value ``node`` reads with each row's elements kept, where it is one of: a layout op
    (:data:`_LAYOUT`, the rows kept as :func:`_row_order` proves); a cast to float32 of a float64
    value (a float64 sample, as TabDDPM's between its networks: ``net(x.float())``); a ``cat`` of
    it and pieces of no columns (TabDDPM's ``cat([z_norm, log_z])`` without categorical features,
    which torch.export keeps). Else ``None``."""
    if _is(node, *_LAYOUT):
        return node.args[0] if isinstance(node.args[0], Node) else None
    source = _float32_cast_source(node)
    if source is not None and _val(source) is not None and _val(source).dtype == torch.float64:
        return source
    pieces = _column_cat(node)
    return pieces[0] if pieces is not None and len(pieces) == 1 else None


def _row_order(src: Node, path: list) -> list | None:
    """Where ``path`` (ops applied one after the other, from ``src``) keeps every row's elements in
    that row: ``order[j]`` is the position, row-major in ``src``'s row, of the last node's row
    element ``j``; else ``None``. Scalings keep the order; so do copies; views and reshapes
    keep it row-major; a permute of the dims after the first moves it."""
    sv = _val(src)
    if sv is None or sv.dim() < 2 or not all(isinstance(d, int) for d in sv.shape[1:]):
        return None
    rows = torch.arange(math.prod(sv.shape[1:])).reshape(sv.shape[1:])
    for n in path:
        v = _val(n)
        if v is None or v.dim() < 2 or not _known_eq(v.shape[0], sv.shape[0]) \
                or not all(isinstance(d, int) for d in v.shape[1:]):
            return None
        if _is(n, aten.permute.default):
            perm = [d % v.dim() for d in n.args[1]]
            if perm[0] != 0:
                return None
            rows = rows.permute([d - 1 for d in perm[1:]])
        elif _is(n, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            if math.prod(v.shape[1:]) != rows.numel():
                return None
            rows = rows.reshape(v.shape[1:])
        if tuple(rows.shape) != tuple(v.shape[1:]):
            return None
    return rows.reshape(-1).tolist()


def _in_sample_order(out: Node, order: tuple, shape) -> list | None:
    """The layout ops from ``out``, the network's output in the order its input reads the sample
    (``order``, :class:`_Feed`), to the one node that lays it out in the sample's order and shape
    (a transposed chunk written back: ``out.view(B, Da, Ta).transpose(1, 2)``); ``None`` where
    no such node is, or more than one."""
    inverse = [0] * len(order)
    for j, i in enumerate(order):
        inverse[i] = j
    found, work = [], [[]]
    while work:
        path = work.pop()
        for u in (path[-1] if path else out).users:
            if not _is(u, *_LAYOUT):
                continue
            rows = _row_order(out, [*path, u])
            if rows is None:
                continue
            if rows == inverse and _shape_eq(_val(u).shape, shape):
                found.append([*path, u])
            else:
                work.append([*path, u])
    return found[0] if len(found) == 1 else None


class _StepNoMatch(_NoMatch):
    """A step that cannot be fused (``step``); ``sample_kept``: only because its sample is also
    used outside the loop (a kept trajectory), so the loop may be cut just before it."""

    def __init__(self, message: str, step: int, sample_kept: bool = False):
        super().__init__(message)
        self.step, self.sample_kept = step, sample_kept


def _pieces(net: _Net) -> list:
    """The first layer's inputs: the pieces its Linear reads, then the terms it adds."""
    return [*_input_pieces(net), *net.terms]


def _input_pieces(net: _Net) -> list:
    pieces = _column_cat(net.inp)
    return [net.inp] if pieces is None else _join_columns(pieces)


def _column_cat(node: Node) -> list | None:
    """The pieces of ``node``, a ``cat`` of ``(batch, w)`` pieces along their columns, with each
    piece that is such a ``cat`` itself read as its own pieces (diffusion_policy's
    ``cat([x, cat([time_features, global_cond])])``: the same columns in the same order) and
    pieces of no columns left out; else ``None``."""
    if not _is(node, aten.cat.default):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    v = _val(node)
    if v is None or v.dim() != 2 or dim not in (1, -1):
        return None
    pieces = []
    for piece in node.args[0]:
        pv = _val(piece)
        if pv is not None and pv.dim() == 2 and _known_eq(pv.shape[1], 0):
            continue  # no columns (TabDDPM's log_z without categorical features)
        inner = _column_cat(piece)
        pieces.extend([piece] if inner is None else inner)
    return pieces or None


def _sum_of_two(node) -> tuple[Node, Node] | None:
    """``(a, b)`` for ``node = a + b`` with both addends of ``node``'s shape (no broadcast,
    ``alpha`` 1); else ``None``."""
    if not (_is(node, aten.add.Tensor) and _no_kwargs(node, {"alpha": 1})):
        return None
    a, b = node.args[:2]
    out = _val(node)
    if out is None or not all(isinstance(v, Node) and _val(v) is not None and _shape_eq(_val(v).shape, out.shape)
                              for v in (a, b)):
        return None
    return a, b


def _invariant(values: list, batch) -> bool:
    """Whether ``values`` (one per step) are one loop-invariant value (the same node, or step
    0's computed again) that differs between samples."""
    first = values[0]
    return all(_recomputed(v, first) for v in values[1:]) and _batched(first, batch) \
        and not _uniform(first, batch, {})


def _split_sums(loop: _Loop) -> None:
    """Read each piece of the first Linear's input that is, in every step, a sum ``a_k + c`` of
    a value ``a_k`` that changes with the step and one loop-invariant ``c`` that differs between
    samples, as two pieces through the same columns: the Linear is linear, ``W (a_k + c) = W a_k
    + W c``, so ``a_k`` is a step-only piece (the time rows or network) and ``c`` a
    loop-invariant one (the condition network) of the same block of the weight. CleanDiffuser's
    MlpNNDiffusion adds its condition to the timestep features before the ``cat``: ``t = t +
    condition`` (or ``t += condition``), ``mlp(cat([x, t], -1))``. Where the addends are not
    both shaped like the sum, or the piece is another function of the two, it is read whole."""
    if len(loop.nets) < 2:
        return
    batch = _val(loop.x(0)).shape[0]
    read = len(loop.pieces[0]) - len(loop.nets[0].terms)
    for p in range(read):
        first = loop.pieces[0][p]
        if p == loop.x_pos or p in loop.shared or all(step[p] is first for step in loop.pieces):
            continue
        sums = [_sum_of_two(step[p]) for step in loop.pieces]
        if any(s is None for s in sums):
            continue
        for j in (0, 1):
            parts, rest = [s[1 - j] for s in sums], [s[j] for s in sums]
            if _invariant(parts, batch) and not all(r is rest[0] for r in rest):
                break
        else:
            continue
        for step, r in zip(loop.pieces, rest):  # the invariant addend after the pieces read, before the terms
            step[p] = r
            step.insert(read, parts[0])
        loop.shared[read] = p
        read += 1


def _mixed_piece(loop: _Loop) -> str | None:
    """Why a piece of the first Linear's input that mixes the step with a loop-invariant value
    that differs between samples is not read, where its op is not a sum (``temb(t) * cond``):
    such a piece is neither time rows nor a condition, and only a sum splits into the two
    through the Linear's columns. ``None`` where no piece is such an op."""
    batch = _val(loop.x(0)).shape[0]
    for p, first in enumerate(loop.pieces[0]):
        if p == loop.x_pos or all(step[p] is first for step in loop.pieces) \
                or any(not isinstance(step[p], Node) or step[p].target != first.target or
                       len(step[p].args) != len(first.args) for step in loop.pieces):
            continue
        for i, a in enumerate(first.args):
            if isinstance(a, Node) and _invariant([step[p].args[i] for step in loop.pieces], batch):
                what = ("a sum whose addends are not both of its shape" if _is(first, aten.add.Tensor)
                        else f"{first.target}, not a sum,")
                return (f"the first Linear's input {first.name} is {what} of {a.name}, which differs between "
                        "samples and not between steps, and values that change with the step: not read as "
                        "time rows plus a condition through the same columns")
    return None


def _columns_of(piece) -> tuple | None:
    """``(X, start, stop)`` where ``piece`` is columns ``start:stop`` of a 2-D ``X``, in order:
    ``X[:, j].unsqueeze(-1)`` (``unsqueeze`` or a ``(B, 1)`` view of a ``select``) or
    ``X[:, a:b]`` (a ``slice`` of step 1); else ``None``."""
    if not isinstance(piece, Node):
        return None
    pv = _val(piece)
    if pv is None or pv.dim() != 2:
        return None
    if _is(piece, aten.unsqueeze.default) and piece.args[1] in (1, -1) or \
            _is(piece, aten.view.default, aten.reshape.default) and _known_eq(pv.shape[1], 1):
        sel = piece.args[0]
        if _is(sel, aten.select.int) and sel.args[1] in (1, -1) and isinstance(sel.args[2], int):
            src, j = sel.args[0], sel.args[2]
            sv = _val(src)
            if sv is not None and sv.dim() == 2 and _known_eq(sv.shape[0], pv.shape[0]) \
                    and isinstance(sv.shape[1], int) and 0 <= j < sv.shape[1]:
                return src, j, j + 1
        return None
    if _is(piece, aten.slice.Tensor) and piece.args[1] in (1, -1) and (len(piece.args) < 5 or piece.args[4] == 1):
        src = piece.args[0]
        sv = _val(src)
        if sv is not None and sv.dim() == 2 and isinstance(sv.shape[1], int) and isinstance(pv.shape[1], int):
            start = piece.args[2] if len(piece.args) > 2 and piece.args[2] is not None else 0
            if isinstance(start, int) and 0 <= start:
                return src, start, start + pv.shape[1]
    return None


def _column_nodes(net: _Net, x: Node) -> set:
    """The nodes that take ``x``'s columns one by one into the first layer's ``cat`` (the
    ``select`` and ``unsqueeze`` of :func:`_columns_of`): part of the network's input."""
    out: set = set()
    if _is(net.inp, aten.cat.default):
        for piece in net.inp.args[0]:
            c = _columns_of(piece)
            if c is not None and c[0] is x:
                out.add(piece)
                out.update(a for a in piece.all_input_nodes if a is not x)
    return out


def _join_columns(pieces: list) -> list:
    """``pieces`` with each run of pieces that are all the columns of one node, in order, as that
    node (tiny-diffusion embeds each coordinate on its own: ``cat([x[:, 0:1], x[:, 1:2], t])`` is
    ``cat([x, t])``, the same first-layer columns in the same order)."""
    out, i = [], 0
    while i < len(pieces):
        c = _columns_of(pieces[i])
        if c is not None and c[1] == 0:
            src, stop, j = c[0], c[2], i + 1
            while stop < _val(src).shape[1] and j < len(pieces):
                nxt = _columns_of(pieces[j])
                if nxt is None or nxt[0] is not src or nxt[1] != stop:
                    break
                stop, j = nxt[2], j + 1
            if stop == _val(src).shape[1] and j - i > 1:
                out.append(src)
                i = j
                continue
        out.append(pieces[i])
        i += 1
    return out


def _latest_step(graph: Graph, nets: list[_Net]) -> dict[Node, int]:
    """Node -> index of the latest of ``nets`` whose output it depends on, or -1."""
    index = {n.out: i for i, n in enumerate(nets)}
    latest: dict[Node, int] = {}
    for node in graph.nodes:
        found = index.get(node, -1)
        for a in node.all_input_nodes:
            found = max(found, latest.get(a, -1))
        latest[node] = found
    return latest


def _loops(nets: list[_Net], latest: dict[Node, int], direct=lambda piece, net: True) -> tuple[list[_Loop], list[str]]:
    """The loops among ``nets`` (applications of one network, in graph order),
    and why applications that read a previous one were not chained. ``direct(piece, net)``
    says whether ``piece`` is made from ``net``'s output with no other network applied in
    between (another network's step: the two are no consecutive steps). An application
    chained to none is a loop of one step where :func:`_lone_x_pos` finds its sample."""
    loops, reasons = [], []
    current: list[int] = []
    positions: list[int] = []

    def close():
        x_pos = positions[0] if positions else _lone_x_pos(nets[current[0]]) if current else None
        if x_pos is not None:
            loops.append(_Loop([nets[i] for i in current], [_pieces(nets[i]) for i in current], x_pos))
        current.clear()
        positions.clear()

    for j, net in enumerate(nets):
        pieces = _pieces(net)
        reading = [p for p, a in enumerate(pieces) if latest.get(a, -1) == j - 1 and j > 0]
        others = [a for a in pieces if latest.get(a, -1) >= 0 and latest.get(a, -1) != j - 1]
        if others:
            reasons.append(f"{net.inp.name} reads {others[0].name}, a value of an earlier step "
                           "than the previous one")
            close()
            continue
        if len(reading) == 1 and reading[0] < len(pieces) - len(net.terms) and current \
                and current[-1] == j - 1 and len(pieces) == len(_pieces(nets[j - 1])) \
                and direct(pieces[reading[0]], nets[j - 1]):
            current.append(j)
            positions.append(reading[0])
            continue
        if len(reading) > 1:
            reasons.append(f"{net.inp.name} reads the previous step's sample in more than one piece")
        elif reading and reading[0] >= len(pieces) - len(net.terms):
            reasons.append(f"{pieces[reading[0]].name}, added to the first Linear's output, reads "
                           "the previous step's sample (a residual connection?)")
        close()
        current.append(j)
    close()
    return loops, reasons


def _lone_x_pos(net: _Net) -> int | None:
    """The sample's place among the pieces of a network applied once: the one piece of the
    first Linear's input shaped like the network's output that is also read after the network
    (by the update), where the network reads a time input beside it; else ``None``."""
    pieces = _pieces(net)
    if len(pieces) < 2:
        return None  # no time input: an MLP, not a sampling step
    out = _val(net.out)
    found = []
    for p, a in enumerate(pieces[:len(pieces) - len(net.terms)]):
        v = _val(a)
        if out is None or v is None or tuple(v.shape) != tuple(out.shape):
            continue
        readers = [u for u in a.users if u is not net.inp and u not in net.nodes]
        if readers and _reaches(net.out, set(readers)):
            found.append(p)
    return found[0] if len(found) == 1 else None


def _reaches(start: Node, targets: set, limit: int = 64) -> bool:
    """Whether one of ``targets`` is among the first ``limit`` descendants of ``start``."""
    seen, work = set(), [start]
    while work and len(seen) < limit:
        n = work.pop()
        if n in targets:
            return True
        if n in seen:
            continue
        seen.add(n)
        work.extend(n.users)
    return False


def _descendants(starts: list[Node], stop: Node | None, excluded: set) -> list[Node]:
    """Nodes reachable from ``starts`` through users, not through ``stop`` or ``excluded``
    (nor metadata checks: they go with the node they check)."""
    seen: set[Node] = set()
    work = [u for s in starts for u in s.users]
    while work:
        n = work.pop()
        if n in seen or n in excluded or _is(n, _ASSERT_METADATA):
            continue
        seen.add(n)
        if n is not stop:
            work.extend(n.users)
    return [n for n in starts[0].graph.nodes if n in seen]


def _ancestors_within(node: Node, region: set) -> set:
    out: set[Node] = set()
    work = [node]
    while work:
        n = work.pop()
        for a in n.all_input_nodes:
            if a in region and a not in out:
                out.add(a)
                work.append(a)
    return out


def _step_region(loop: _Loop, k: int, position: dict, choose=None) -> tuple[Node, set, Node | None]:
    """``(x_{k+1}, update nodes, carry)`` of step ``k``; raise :class:`_StepNoMatch` if something
    inside the step is used outside it. Where the loop's last step has no known end
    (``loop.next_x``), ``choose(ends, region)`` picks it among the possible ends (the first by
    default).

    ``carry`` is the one value of the step (a node of the update, or the network's output)
    that is also read outside it, where a later step of the loop may read it: a multistep
    solver's x0 prediction, kept in a Python variable for the next step. Its readers outside
    the step are left out of the step's region; :mod:`.plan` proves that the next step's update
    reads it and nothing else does (else the step is named as here). ``None`` when there is none."""
    net, x = loop.nets[k], loop.sample(k)
    # x(k): the network's input, the sample scaled or a chunk flattened (the feed's ops); its
    # columns taken one by one (_join_columns)
    excluded = net.nodes | {net.inp, loop.x(k), *loop.feed(k).path} | _column_nodes(net, loop.x(k))
    end = loop.sample(k + 1) if k + 1 < len(loop.nets) else _feed(loop.next_x).sample
    if end is not None:
        region = _descendants([x, net.out], end, excluded)
        if k == 0:  # the loop's input may be read elsewhere too (kept in a trajectory): not the step
            inside = _ancestors_within(end, set(region))
            excluded |= {u for u in x.users if u not in inside and u is not end}
            region = _descendants([x, net.out], end, excluded)
        if end not in region:
            raise _StepNoMatch(f"the sample {end.name} of step {k + 1} does not depend on step {k}", k)
    else:
        region = _descendants([x, net.out], None, excluded)
        ends = _step_ends(region, net.out)
        end = choose(ends, set(region)) if choose is not None else ends[0]
    inside = _ancestors_within(end, set(region)) | {end}
    carry = None
    if k + 1 < len(loop.nets):
        carry, readers = _carried(net, x, end, inside, excluded)
        if carry is not None:
            excluded |= readers
            region = _descendants([x, net.out], end, excluded)
    # The loop's own input stays in the graph; a later step's sample is replaced by the op.
    outside = [u for u in x.users if u is not net.inp and u is not loop.x(k) and u not in inside
               and u not in net.nodes and u not in excluded] if k else []
    if outside:
        raise _StepNoMatch(f"the sample {x.name} of step {k} is also used by {[u.name for u in outside]} "
                           "(a trajectory kept?)", k, sample_kept=True)
    open_end = loop.next_x is None and k + 1 == len(loop.nets)
    stray = [n for n in region if n not in inside and not (open_end and position[n] > position[end])]
    if stray:
        raise _StepNoMatch(f"{stray[0].name} of step {k} is used outside the step "
                           f"(by {[u.name for u in stray[0].users]})", k)
    leaked = [n for n in net.nodes if n is not net.out
              and any(u not in net.nodes and not _is(u, _ASSERT_METADATA) for u in n.users)]
    if leaked:
        raise _StepNoMatch(f"the network's intermediate {leaked[0].name} is used outside the step "
                           f"(by {[u.name for u in leaked[0].users if u not in net.nodes]})", k)
    return end, inside, carry


def _carried(net: _Net, x: Node, end: Node, inside: set, excluded: set) -> tuple[Node | None, set]:
    """The one value of a step read outside it besides its result (``end``) and sample, and
    those readers: ``(None, set())`` unless exactly one value is."""
    found = []
    for n in (net.out, *inside):
        if n is end:
            continue
        readers = {u for u in n.users if u not in inside and u not in net.nodes and u not in excluded
                   and u is not net.inp and not _is(u, _ASSERT_METADATA)}
        if readers:
            found.append((n, readers))
    return found[0] if len(found) == 1 else (None, set())


def _step_ends(region: list[Node], e: Node) -> list[Node]:
    """The nodes of ``region`` (in graph order) where the last step may end: every
    earlier node of it is an ancestor, and no later one reads an earlier one or ``e``
    (a later reader of the sample is :func:`_step_region`'s to judge)."""
    members = set(region)
    ends = []
    for i, n in enumerate(region):
        earlier = set(region[:i]) | {e}
        if len(_ancestors_within(n, members)) != i:
            continue
        if all(not (set(m.all_input_nodes) & earlier) for m in region[i + 1:]):
            ends.append(n)
    if not ends:
        raise _NoMatch("the last step's update has no single result")
    return ends
