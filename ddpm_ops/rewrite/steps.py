"""Reading one sampling step off the graph, and chaining steps into runs.

:func:`_match_step` proves that a node is one step
``x_out = c1 * (x - c2 * eps)`` of the reference loop, in three parts that
each raise ``_NoMatch`` with the reason: :func:`_read_step`, the structure
(the update, the MLP, its input ``cat([x, tcol])``, one timestep for all of
them); :func:`_check_types`, dtypes, shapes and one device; and
:func:`_check_isolated`, that nothing inside the step is used outside it.
:func:`_build_runs` then chains steps where one reads exactly the previous
one's output with the same parameters and the next timestep.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from .linear import _linear
from .patterns import _NoMatch, _coefficient, _is, _known_eq, _no_kwargs, _resolve_t, _shape_eq, \
    _silu, _time_column, _val, aten

log = logging.getLogger("ddpm_ops.rewrite")


@dataclass
class _Step:
    """One matched step: the nodes the op would take as arguments, and the step's own nodes."""

    out: Node
    x_in: Node
    t_node: Node
    t_root: Node
    t_offset: int
    weights: tuple
    biases: tuple
    sqrt_recip_alphas: Node
    coef_eps: Node
    total_timesteps: int
    nodes: set = field(default_factory=set)   # x-dependent nodes of the step, out included
    entry: set = field(default_factory=set)   # the step's nodes that read x_in

    def same_params(self, other: _Step) -> bool:
        return (self.weights == other.weights and self.biases == other.biases
                and self.sqrt_recip_alphas is other.sqrt_recip_alphas
                and self.coef_eps is other.coef_eps
                and self.total_timesteps == other.total_timesteps
                and self.t_root is other.t_root)


def looks_like_update(node: Node) -> bool:
    """Cheap filter: ``a * (b - c * d)`` in either order."""
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:
        return False
    return any(_is(a, aten.sub.Tensor) and _is(a.args[1], aten.mul.Tensor) for a in node.args)


def _match_step(out: Node) -> _Step:
    """Prove that ``out`` is one DDPM step of the reference loop, or raise ``_NoMatch``."""
    step = _read_step(out)
    _check_types(step)
    _check_isolated(step)
    return step


# ----------------------------------------------------------------------------- the structure

def _read_step(out: Node) -> _Step:
    """The step's structure: which nodes are x, t, the weights and the tables."""
    diff, scaled, eps, (table_a, t_a), (table_b, t_b) = _read_update(out)
    x_in = diff.args[0]
    # the looks of a DDPM step are established; from here on reasons are worth logging
    nodes = {out, diff, scaled}
    weights, biases, cat = _read_mlp(eps, nodes)
    nodes.add(cat)
    t_c, T = _read_mlp_input(cat, x_in)
    t_root, t_offset = _common_timestep(t_a, t_b, t_c)
    return _Step(out=out, x_in=x_in, t_node=t_a, t_root=t_root, t_offset=t_offset,
                 weights=tuple(weights), biases=tuple(biases), sqrt_recip_alphas=table_a,
                 coef_eps=table_b, total_timesteps=T, nodes=nodes, entry={cat, diff})


def _read_update(out: Node):
    """``(diff, scaled, eps, (table_a, t_a), (table_b, t_b))`` for
    ``out = table_a[t_a] * (x - table_b[t_b] * eps)``, either operand order of each ``mul``."""
    if not _is(out, aten.mul.Tensor) or len(out.args) != 2:
        raise _NoMatch("not a mul")
    for c1, diff in (out.args, out.args[::-1]):
        if _is(diff, aten.sub.Tensor) and _no_kwargs(diff, {"alpha": 1}):
            break
    else:
        raise _NoMatch("not c1 * (x - ...)")
    scaled = diff.args[1]
    if not _is(scaled, aten.mul.Tensor):
        raise _NoMatch("not c1 * (x - c2 * eps)")
    errors = []
    for c2, eps in (scaled.args[:2], scaled.args[1::-1]):
        try:
            lookup_b = _coefficient(c2)
            break
        except _NoMatch as e:
            errors.append(str(e))
    else:
        raise _NoMatch(f"c2 is not a table lookup: {errors[0]}")
    try:
        lookup_a = _coefficient(c1)
    except _NoMatch as e:
        raise _NoMatch(f"c1 is not a table lookup: {e}") from None
    return diff, scaled, eps, lookup_a, lookup_b


def _read_mlp(eps: Node, nodes: set) -> tuple[list[Node], list[Node], Node]:
    """``(weights, biases, cat)`` for ``eps = Linear_L(SiLU(... Linear_1(cat)))``,
    first layer first; the MLP's nodes are added to ``nodes``."""
    weights, biases = [], []
    cur = eps
    while True:
        inp, w, b, lin_nodes = _linear(cur)
        nodes.update(lin_nodes)
        weights.insert(0, w)
        biases.insert(0, b)
        if _is(inp, aten.cat.default):
            return weights, biases, inp
        z, act_nodes = _silu(inp)
        nodes.update(act_nodes)
        cur = z


def _read_mlp_input(cat: Node, x_in: Node) -> tuple[Node, int]:
    """``(t, T)`` for the MLP's input ``cat([x_in, t.float() / T], dim=1)``."""
    tensors = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim not in (1, -1) or len(tensors) != 2:
        raise _NoMatch(f"{cat.name} is not cat([x, t_col], dim=1)")
    if tensors[0] is not x_in:
        raise _NoMatch(f"{cat.name} does not put the x of the update first")
    return _time_column(tensors[1])


def _common_timestep(t_a: Node, t_b: Node, t_c: Node) -> tuple[Node, int]:
    """``(root, offset)`` when the two lookups and the time column read one ``root - offset``."""
    ra, rb, rc = _resolve_t(t_a), _resolve_t(t_b), _resolve_t(t_c)
    if not (ra[0] is rb[0] is rc[0] and ra[1] == rb[1] == rc[1]):
        raise _NoMatch("the time column and the two table lookups use different timesteps")
    return ra


# ----------------------------------------------------------------------------- the types

def _check_types(step: _Step) -> None:
    """What the op computes: float32 ``(B, dim)`` x, int ``(B,)`` t, float32
    parameters on x's device, 1-D tables of one length, layers that chain
    from ``dim + 1`` to ``dim`` features."""
    _check_x_and_t(step)
    _check_parameters(step)
    _check_layers(step)


def _check_x_and_t(step: _Step) -> None:
    xv, ov, tv = _val(step.x_in), _val(step.out), _val(step.t_node)
    if xv is None or ov is None or tv is None:
        raise _NoMatch("missing tensor metadata")
    if xv.dtype != torch.float32 or ov.dtype != torch.float32:
        raise _NoMatch(f"x is {xv.dtype}, the op computes float32 only")
    if xv.dim() != 2 or tv.dim() != 1 or not _known_eq(tv.shape[0], xv.shape[0]):
        raise _NoMatch("x is not (B, dim) or t is not (B,)")
    if not _shape_eq(ov.shape, xv.shape):
        raise _NoMatch("the update broadcasts x to another shape")
    if tv.dtype not in (torch.int32, torch.int64):
        raise _NoMatch(f"the timestep is {tv.dtype}, not int32/int64")


def _check_parameters(step: _Step) -> None:
    dev = _val(step.x_in).device
    params = [*step.weights, *step.biases, step.sqrt_recip_alphas, step.coef_eps]
    for p in params:
        pv = _val(p)
        if pv is None or pv.dtype != torch.float32 or pv.device != dev:
            raise _NoMatch(f"{getattr(p, 'name', p)} is not a float32 tensor on {dev}")
    tv = _val(step.t_node)
    if tv.device != dev:
        raise _NoMatch(f"the timestep is on {tv.device}, x on {dev}")
    ta, tb = _val(step.sqrt_recip_alphas), _val(step.coef_eps)
    if ta.dim() != 1 or tb.dim() != 1 or not _known_eq(ta.shape[0], tb.shape[0]):
        raise _NoMatch("the coefficient tables are not 1-D of equal length")


def _check_layers(step: _Step) -> None:
    features = _val(step.x_in).shape[1]
    fan_in = features + 1
    for layer, (w, b) in enumerate(zip(step.weights, step.biases)):
        wv, bv = _val(w), _val(b)
        if wv.dim() != 2 or bv.dim() != 1 or not _known_eq(wv.shape[1], fan_in) \
                or not _known_eq(bv.shape[0], wv.shape[0]):
            raise _NoMatch(f"layer {layer}: weight {tuple(wv.shape)} / bias {tuple(bv.shape)} "
                           "do not chain")
        fan_in = wv.shape[0]
    if not _known_eq(fan_in, features):
        raise _NoMatch("the MLP does not output dim features")


# ----------------------------------------------------------------------------- isolation

def _check_isolated(step: _Step) -> None:
    """Nothing inside the step but its output may be used outside it: the op
    computes no intermediate (and in a training graph every activation is
    saved for backward, so this also keeps training graphs as they are)."""
    for n in step.nodes:
        if n is step.out:
            continue
        outside = [u.name for u in n.users if u not in step.nodes]
        if outside:
            raise _NoMatch(f"intermediate {n.name} is also used by {outside}")


# ----------------------------------------------------------------------------- runs

def _build_runs(steps: list[_Step]) -> list[list[_Step]]:
    """Chains of steps, each reading exactly the previous one's output; every
    step is in one run (a step that chains with nothing is a run of one)."""
    by_input: dict[Node, list[_Step]] = {}
    for s in steps:
        by_input.setdefault(s.x_in, []).append(s)
    successor: dict[int, _Step] = {}
    has_pred: set[int] = set()
    for s in steps:
        for nxt in by_input.get(s.out, []):
            if _chains(s, nxt):
                successor[id(s)] = nxt
                has_pred.add(id(nxt))
    runs = []
    for s in steps:
        if id(s) in has_pred:
            continue
        run = [s]
        while id(run[-1]) in successor:
            run.append(successor[id(run[-1])])
        runs.append(run)
    return runs


def _chains(s: _Step, nxt: _Step) -> bool:
    """Whether ``nxt``, which reads ``s``'s output, continues ``s``'s run."""
    if not nxt.same_params(s):
        log.debug("ddpm_ops: time-column matcher: step %s and step %s not merged: different "
                  "weights, tables, T or timestep root", s.out.name, nxt.out.name)
        return False
    if nxt.t_offset != s.t_offset + 1:
        log.debug("ddpm_ops: time-column matcher: step %s and step %s not merged: timesteps "
                  "t-%d then t-%d are not consecutive", s.out.name, nxt.out.name, s.t_offset, nxt.t_offset)
        return False
    if set(s.out.users) != nxt.entry:
        log.debug("ddpm_ops: time-column matcher: run ends at %s: its x is also used by %s",
                  s.out.name, [u.name for u in s.out.users if u not in nxt.entry])
        return False
    return True
