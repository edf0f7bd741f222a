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
encoder's), for the op's bias networks. :func:`_read_whole_network` reads a
traced module's whole graph as one network program, for
:class:`ddpm_ops.DiffusionSampler` (:func:`ddpm_ops.layers.read_network`):
one reader, one vocabulary of layers, for both.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch.fx import Graph, Node

from .activations import _activation
from .linear import _linear
from .nodes import _NoMatch, _is, _known_eq, _no_kwargs, _shape_eq, _val, aten

_LINEAR_TARGETS = (aten.addmm.default, aten.mm.default, aten.add.Tensor, aten.linear.default, aten.slice.Tensor)


@dataclass
class _Net:
    """One application of an MLP: ``out = Linear_L(act(... Linear_1(inp)))``."""

    out: Node
    inp: Node
    weights: list
    biases: list  # None for a Linear without bias
    activations: list
    nodes: set = field(default_factory=set)  # every node of the MLP, out included, inp not
    terms: list = field(default_factory=list)  # addends of the first Linear's output
    # A network with LayerNorms or residual blocks: the op's ``network`` program (its
    # instructions, "linear" first; ``activations`` is then empty) and the affine LayerNorms'
    # parameters, in order. ``None`` for ``Linear (act Linear)*``.
    program: tuple | None = None
    norm_weights: list = field(default_factory=list)
    norm_biases: list = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (tuple(self.weights), tuple(self.biases), tuple(self.activations), self.program,
                tuple(self.norm_weights), tuple(self.norm_biases))


def _linears(graph: Graph) -> dict[Node, tuple]:
    """``{node: (input, weight, bias, nodes)}`` for every Linear of ``graph`` (:func:`._linear`)."""
    linears = {}
    for node in graph.nodes:
        if _is(node, *_LINEAR_TARGETS):
            try:
                linears[node] = _linear(node)
            except _NoMatch:
                pass
    # The mm of ``mm + bias`` reads as a Linear without bias too: it is part of the one it is in.
    inner = {n for node, (_i, _w, _b, nodes) in linears.items() for n in nodes if n is not node}
    return {node: found for node, found in linears.items() if node not in inner}


def _find_nets(graph: Graph) -> list[_Net]:
    """Every MLP application in ``graph``, in graph order of their outputs."""
    linears = _linears(graph)
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
    nets = [_walk_back(last, linears, before, terms) for last in linears if last not in read]
    return _with_programs(nets, linears)


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


def _unit_views(node) -> tuple:
    """``(source, views)``: ``node`` through views between ``(B, w)`` and ``(B, 1, ..., 1, w)``
    (or that keep its shape), which a Linear or an activation computes alike on either: a Linear
    on a ``(B, 1, w)`` embedding is a view, a 2-D matmul and a view back (DPPO's time MLP)."""
    views = []
    while _is(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default):
        out, src = _val(node), _val(node.args[0])
        if out is None or src is None or min(out.dim(), src.dim()) < 2 \
                or not (_known_eq(out.shape[0], src.shape[0]) and _known_eq(out.shape[-1], src.shape[-1])) \
                or not all(_known_eq(d, 1) for d in (*out.shape[1:-1], *src.shape[1:-1])):
            break
        views.append(node)
        node = node.args[0]
    return node, views


def _net_ending_at(node) -> _Net | None:
    """The MLP whose last Linear makes ``node`` (through views that keep its shape: DPPO's
    ``time_embedding(t).view(B, -1)``), as long as the chain goes back; else ``None``."""
    node, views = _unit_views(node)
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
                between, views = _unit_views(net.inp)
                act, z, act_nodes = _activation(between)
                z, more = _unit_views(z)
                inp, w, b, nodes = _linear(z)
                act_nodes = [*act_nodes, *views, *more]
            except _NoMatch:
                return net
        net.inp = inp
        net.weights.insert(0, w)
        net.biases.insert(0, b)
        net.activations.insert(0, act)
        net.nodes.update(nodes, act_nodes)



# ----------------------------------------------------------------------------- network programs

def _with_programs(nets: list[_Net], linears: dict) -> list[_Net]:
    """``nets`` with each one that ends a network of LayerNorms or residual blocks (IDQL's
    LN-ResNet, DPPO's residual MLP) replaced by that whole network as a program, and the nets
    inside it dropped."""
    programs = []
    for net in nets:
        try:
            program = _read_program(net.out, linears)
        except _NoMatch:
            continue
        if program is not None:
            programs.append(program)
    if not programs:
        return nets
    # A program inside another (a block's Linears read back to the first) is part of it.
    programs = [p for p in programs if not any(p.out in q.nodes and q is not p for q in programs)]
    covered = set().union(*(p.nodes for p in programs))
    kept = [n for n in nets if n.out not in covered and not any(n.out is p.out for p in programs)]
    out = kept + programs
    order = {n: i for i, n in enumerate(next(iter(programs)).out.graph.nodes)}
    return sorted(out, key=lambda n: order[n.out])


def _layer_norm(node) -> tuple[Node, float, Node | None, Node | None, set]:
    """``(z, eps, weight, bias, nodes)`` for a LayerNorm of ``z`` over its last dimension as
    inductor decomposes it (``var_mean`` with ``correction=0``, ``(z - mean) * rsqrt(var +
    eps)``, then ``* weight + bias`` where affine, ``* weight`` alone for
    ``nn.LayerNorm(bias=False)``, whose ``bias`` is None); else raise ``_NoMatch``."""
    nodes, weight, bias = set(), None, None
    n = node
    if _is(n, operator.getitem) and n.args[1] == 0 and _is(n.args[0], aten.native_layer_norm.default):
        n = n.args[0]  # a torch.export graph's LayerNorm, undecomposed
        nodes.add(node)
    if _is(n, aten.layer_norm.default, aten.native_layer_norm.default):
        z, shape = n.args[0], list(n.args[1])
        weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        bias = n.args[3] if len(n.args) > 3 else n.kwargs.get("bias")
        eps = n.args[4] if len(n.args) > 4 else n.kwargs.get("eps", 1e-5)
        zv = _val(z)
        if zv is None or zv.dim() != 2 or len(shape) != 1 or not _known_eq(shape[0], zv.shape[1]) \
                or (weight is None and bias is not None) or not isinstance(eps, float):
            raise _NoMatch(f"{n.name} is not a LayerNorm over the last dimension with a weight (and a bias) "
                           "or neither")
        return z, eps, weight, bias, nodes | {n}
    if _is(n, aten.add.Tensor) and _no_kwargs(n, {"alpha": 1}) and _is(n.args[0], aten.mul.Tensor) \
            and isinstance(n.args[1], Node) and _val(n.args[1]) is not None and _val(n.args[1]).dim() == 1:
        nodes.add(n)
        n, bias = n.args[0], n.args[1]
        if _is(n, aten.mul.Tensor) and isinstance(n.args[1], Node) and _val(n.args[1]) is not None \
                and _val(n.args[1]).dim() == 1 and _is(n.args[0], aten.mul.Tensor):
            nodes.add(n)
            n, weight = n.args[0], n.args[1]
        else:
            raise _NoMatch("an affine LayerNorm without its weight")
    elif _is(n, aten.mul.Tensor) and _is(n.args[0], aten.mul.Tensor) and _is(n.args[0].args[0], aten.sub.Tensor) \
            and isinstance(n.args[1], Node) and _val(n.args[1]) is not None and _val(n.args[1]).dim() == 1:
        nodes.add(n)  # a weight without a bias
        n, weight = n.args[0], n.args[1]
    if not (_is(n, aten.mul.Tensor) and _is(n.args[0], aten.sub.Tensor) and _is(n.args[1], aten.rsqrt.default)):
        raise _NoMatch(f"{getattr(node, 'name', node)} is not a LayerNorm")
    sub, rsqrt = n.args
    add = rsqrt.args[0]
    if not (_is(add, aten.add.Tensor) and isinstance(add.args[1], float) and _no_kwargs(add, {"alpha": 1})):
        raise _NoMatch("not a LayerNorm's rsqrt(var + eps)")
    var, mean = add.args[0], sub.args[1]
    if not (_is(var, operator.getitem) and _is(mean, operator.getitem) and var.args[0] is mean.args[0]
            and var.args[1] == 0 and mean.args[1] == 1):
        raise _NoMatch("not a LayerNorm's var_mean")
    vm, z = var.args[0], sub.args[0]
    zv = _val(z)
    if not (_is(vm, aten.var_mean.correction) and vm.args[0] is z and zv is not None and zv.dim() == 2
            and list(vm.args[1]) in ([1], [-1]) and vm.kwargs == {"correction": 0, "keepdim": True}):
        raise _NoMatch("not a LayerNorm's var_mean over the last dimension")
    if weight is not None and bias is not None and (weight is bias or _val(weight).shape != _val(bias).shape):
        raise _NoMatch("a LayerNorm's weight and bias differ in shape")
    nodes.update({n, sub, rsqrt, add, var, mean, vm})
    return z, add.args[1], weight, bias, nodes


class _Program:
    """A network read backwards from its last Linear (see :func:`_read_program` and
    :func:`_read_whole_network`)."""

    def __init__(self, linears: dict):
        self.linears = linears
        self.instructions: list = []  # backwards
        self.weights: list = []
        self.biases: list = []
        self.norm_weights: list = []
        self.norm_biases: list = []
        self.nodes: set = set()
        self._why: _NoMatch | None = None  # why the last sum tried as a residual block is none

    def layer(self, n: Node):
        """``(instruction, input, nodes, params)`` of the layer that makes ``n``, or ``None``."""
        if n in self.linears:
            inp, w, b, nodes = self.linears[n]
            return "linear", inp, set(nodes), (w, b)
        if _is(n, aten.clone.default, aten.alias.default):  # eval-mode Dropout kept as a copy
            return None, n.args[0], {n}, None
        if _is(n, aten.dropout.default) and (n.args[2] if len(n.args) > 2 else n.kwargs.get("train")) is False:
            return None, n.args[0], {n}, None  # torch.export's training IR: eval-mode Dropout
        try:
            z, eps, w, b, nodes = _layer_norm(n)
        except _NoMatch:
            pass
        else:
            from ..layers import layer_norm_instruction
            return layer_norm_instruction(eps, w is not None), z, nodes, (w, b) if w is not None else None
        try:
            name, z, nodes = _activation(n)
        except _NoMatch:
            return None
        return name, z, set(nodes), None

    def walk(self, n: Node, stop: Node | None) -> Node:
        """Read the layers back from ``n`` to ``stop`` (where given: else a node that is no
        layer raises ``_NoMatch`` naming it) or to the first Linear's input, which it returns;
        residual sums are blocks."""
        while n is not stop:
            if self._is_sum(n) and _no_kwargs(n, {"alpha": 1}) and all(isinstance(a, Node) for a in n.args[:2]) \
                    and self._residual(n):
                n = self._skip
                continue
            found = self.layer(n)
            if found is None:
                if stop is not None:
                    raise self._unread(n)
                if not self.instructions or self.instructions[-1] != "linear":
                    raise _NoMatch("the network's first layer is not a Linear")
                return n
            instruction, inp, nodes, params = found
            if stop is None and instruction == "linear" and self.layer(inp) is None and not self._is_sum(inp):
                self._push(instruction, nodes, params)
                return inp  # the first Linear: what it reads is the network's input
            if instruction is not None:
                self._push(instruction, nodes, params)
            else:
                self.nodes.update(nodes)
            n = inp
        return n

    def _is_sum(self, n) -> bool:
        return _is(n, aten.add.Tensor) and n not in self.linears

    def _unread(self, n: Node) -> _NoMatch:
        """Why the reading stops at ``n``: not a layer; or a sum that is no residual block, for
        the reason its block does not read where the block was read up to a node of its own
        (not past its start to the network's input)."""
        if not self._is_sum(n):
            return _NoMatch(f"{n.name} ({n.target}) is not a layer the op computes", n)
        why = self._why
        if why is not None and why.node is not None and why.node.op != "placeholder":
            return why
        return _NoMatch(f"{n.name} adds values the op adds only as a residual block, h + block(h) with block a "
                        "chain of its layers reading h", n)

    def _push(self, instruction, nodes, params) -> None:
        self.instructions.append(instruction)
        self.nodes.update(nodes)
        if instruction == "linear":
            self.weights.insert(0, params[0])
            self.biases.insert(0, params[1])
        elif params is not None:
            self.norm_weights.insert(0, params[0])
            self.norm_biases.insert(0, params[1])

    def _residual(self, n: Node) -> bool:
        """Whether ``n = skip + block(skip)``: read the block (into the instructions, between
        "add" and "save", backwards) and leave ``skip`` in ``self._skip``; else leave why the
        block does not read in ``self._why``. The block reads the skip, so it is the addend
        later in the graph."""
        self._why = None
        out = _val(n)
        skip, block = sorted(n.args[:2])
        if _val(block) is None or _val(skip) is None or _val(block).shape != out.shape \
                or _val(skip).shape != out.shape:
            return False
        saved = (list(self.instructions), list(self.weights), list(self.biases), list(self.norm_weights),
                 list(self.norm_biases), set(self.nodes))
        self.instructions.append("add")
        try:
            self.walk(block, skip)
        except _NoMatch as why:
            (self.instructions, self.weights, self.biases, self.norm_weights, self.norm_biases,
             self.nodes) = saved
            self._why = why
            return False
        self.instructions.append("save")
        self.nodes.add(n)
        self._skip = skip
        return True


def _read_program(out: Node, linears: dict) -> _Net | None:
    """The network ending at the Linear ``out`` as a program, where it holds a LayerNorm or a
    residual block (else ``None``: a plain MLP, read as before)."""
    program = _Program(linears)
    inp = program.walk(out, None)
    instructions = tuple(reversed(program.instructions))
    if not any(i == "save" or i.startswith("layer_norm") for i in instructions) or instructions[0] != "linear":
        return None
    return _Net(out=out, inp=inp, weights=program.weights, biases=program.biases, activations=[],
                nodes=program.nodes, program=instructions, norm_weights=program.norm_weights,
                norm_biases=program.norm_biases)


def _read_whole_network(out: Node, inp: Node) -> _Net:
    """The network that makes ``out`` from ``inp`` (a traced module's output and input) as a
    program, every node between them read as a layer or a residual block: a chain of Linears
    and activations too ("linear" first, where it is), and a network whose first layer is a
    LayerNorm or an activation. Raises ``_NoMatch`` naming the first node, read back from the
    output, that is neither."""
    program = _Program(_linears(out.graph))
    program.walk(out, inp)
    return _Net(out=out, inp=inp, weights=program.weights, biases=program.biases, activations=[],
                nodes=program.nodes, program=tuple(reversed(program.instructions)),
                norm_weights=program.norm_weights, norm_biases=program.norm_biases)
