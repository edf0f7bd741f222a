"""Finding the MLPs of a graph: chains of Linears with an activation between two of them.

:func:`_find_nets` reads every Linear (:func:`.linear._linear`), links a
Linear to the one before it when its input is that Linear's output, directly
(``identity``) or through one activation (:func:`.activations._activation`),
and returns one :class:`_Net` per chain, ending at a Linear no other Linear
reads. A network's ``key`` (its weight and bias nodes and activations) says
when two applications are the same network. :func:`_net_ending_at` reads the
one MLP that ends at a given node (a time embedding's, an observation
encoder's), for the op's bias networks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Graph, Node

from .activations import _activation
from .linear import _linear
from .patterns import _NoMatch, _is, aten

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
        if inp in linears:
            before[node] = (inp, "identity", [])
            continue
        try:
            name, z, act_nodes = _activation(inp)
        except _NoMatch:
            continue
        if z in linears:
            before[node] = (z, name, act_nodes)
    read = {prev for prev, _a, _n in before.values()}
    return [_walk_back(last, linears, before) for last in linears if last not in read]


def _walk_back(last: Node, linears: dict, before: dict) -> _Net:
    weights, biases, acts, nodes = [], [], [], set()
    cur = last
    while True:
        inp, w, b, lin_nodes = linears[cur]
        weights.insert(0, w)
        biases.insert(0, b)
        nodes.update(lin_nodes)
        if cur not in before:
            return _Net(out=last, inp=inp, weights=weights, biases=biases, activations=acts, nodes=nodes)
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
