"""Finding the MLPs of a graph: chains of Linears with an activation between two of them.

:func:`_find_nets` reads every Linear (:func:`.linear._linear`), links a
Linear to the one before it when its input is that Linear's output, directly
(``identity``) or through one activation (:func:`.activations._activation`),
and returns one :class:`_Net` per chain, ending at a Linear no other Linear
reads. A Linear may also read, directly or through one activation, the
first Linear's output plus addends (TabDDPM's ``mlp(proj(x) +
time_embed(t))``): the addends are the network's ``terms``, inputs of its
first layer that it adds as they are. A network's ``key`` (its weight and bias nodes and activations) says
when two applications are the same network. :func:`_net_ending_at` reads the
one MLP that ends at a given node (a time embedding's, an observation
encoder's), for the op's bias networks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Graph, Node

from .activations import _activation
from .linear import _linear
from .nodes import _NoMatch, _is, _no_kwargs, _shape_eq, _val, aten

_LINEAR_TARGETS = (aten.addmm.default, aten.add.Tensor, aten.linear.default, aten.slice.Tensor)


@dataclass
class _Net:
    """One application of an MLP: ``out = Linear_L(act(... Linear_1(inp)))``."""

    out: Node
    inp: Node
    weights: list
    biases: list
    activations: list
    nodes: set = field(default_factory=set)  # every node of the MLP, out included, inp not
    terms: list = field(default_factory=list)  # addends of the first Linear's output

    @property
    def key(self) -> tuple:
        return (tuple(self.weights), tuple(self.biases), tuple(self.activations))


def _find_nets(graph: Graph) -> list[_Net]:
    """Every MLP application in ``graph``, in graph order of their outputs."""
    linears = {}
    for node in graph.nodes:
        if _is(node, *_LINEAR_TARGETS):
            try:
                linears[node] = _linear(node)
            except _NoMatch:
                pass
    before: dict[Node, tuple] = {}  # a Linear -> (the Linear before it, activation, its nodes)
    for node, (inp, _w, _b, _nodes) in linears.items():
        inp, copies = _through_copies(inp)
        if inp in linears:
            before[node] = (inp, "identity", copies)
            continue
        try:
            name, z, act_nodes = _activation(inp)
        except _NoMatch:
            continue
        if z in linears:
            before[node] = (z, name, [*act_nodes, *copies])
    terms: dict[Node, list] = {}  # a first Linear -> the addends of its output
    for node, (inp, _w, _b, _nodes) in linears.items():
        if node in before:
            continue
        inp, copies = _through_copies(inp)
        try:
            name, z, act_nodes = _activation(inp)
        except _NoMatch:
            name, z, act_nodes = "identity", inp, []
        found = _first_linear_plus_terms(z, linears, before)
        if found is not None:
            first, addends, add_nodes = found
            before[node] = (first, name, [*add_nodes, *act_nodes, *copies])
            terms[first] = addends
    read = {prev for prev, _a, _n in before.values()}
    return [_walk_back(last, linears, before, terms) for last in linears if last not in read]


def _through_copies(node: Node) -> tuple[Node, list]:
    """What ``node`` copies (exported graphs keep eval-mode dropout as ``clone`` and a full
    slice as ``alias``), and the copies."""
    copies = []
    while _is(node, aten.clone.default, aten.alias.default):
        copies.append(node)
        node = node.args[0]
    return node, copies


def _first_linear_plus_terms(node: Node, linears: dict, before: dict) -> tuple[Node, list, list] | None:
    """``(first, terms, add nodes)`` for ``node = first + terms[0] + ...``, a sum (``add``s of
    tensors of ``node``'s shape) in which exactly one addend is a Linear that starts a chain
    (none before it); other Linears among the addends (a time embedding's last one) are terms
    like the rest. Else ``None``."""
    if not _is(node, aten.add.Tensor):
        return None
    out = _val(node)
    if out is None:
        return None
    addends, add_nodes, work = [], [], [node]
    while work:
        n = work.pop()
        if n not in linears and _is(n, aten.add.Tensor) and _no_kwargs(n, {"alpha": 1}) \
                and all(isinstance(a, Node) for a in n.args[:2]):
            add_nodes.append(n)
            work.extend(reversed(n.args[:2]))
        elif _val(n) is not None and _shape_eq(_val(n).shape, out.shape):
            addends.append(n)
        else:
            return None  # a broadcast addend, or a number
    firsts = [a for a in addends if a in linears and a not in before]
    if len(firsts) != 1:
        return None
    return firsts[0], [a for a in addends if a is not firsts[0]], add_nodes


def _walk_back(last: Node, linears: dict, before: dict, terms: dict) -> _Net:
    weights, biases, acts, nodes = [], [], [], set()
    cur = last
    while True:
        inp, w, b, lin_nodes = linears[cur]
        weights.insert(0, w)
        biases.insert(0, b)
        nodes.update(lin_nodes)
        if cur not in before:
            return _Net(out=last, inp=inp, weights=weights, biases=biases, activations=acts, nodes=nodes,
                        terms=terms.get(cur, []))
        prev, act, act_nodes = before[cur]
        acts.insert(0, act)
        nodes.update(act_nodes)
        cur = prev


def _net_ending_at(node) -> _Net | None:
    """The MLP whose last Linear makes ``node``, as long as the chain goes back; else ``None``."""
    try:
        inp, w, b, nodes = _linear(node)
    except _NoMatch:
        return None
    net = _Net(out=node, inp=inp, weights=[w], biases=[b], activations=[], nodes=set(nodes))
    while True:
        try:
            act, act_nodes = "identity", []
            inp, w, b, nodes = _linear(net.inp)
        except _NoMatch:
            try:
                act, z, act_nodes = _activation(net.inp)
                inp, w, b, nodes = _linear(z)
            except _NoMatch:
                return net
        net.inp = inp
        net.weights.insert(0, w)
        net.biases.insert(0, b)
        net.activations.insert(0, act)
        net.nodes.update(nodes, act_nodes)
