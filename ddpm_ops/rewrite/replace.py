"""Replacing runs of steps by ``ddpm::fused_sample``: the guards, the insertion, dead-code removal.

:func:`rewrite_graph` matches the steps (:mod:`.steps`), and for each run
first asks :func:`_refusal` whether it may be replaced at all (an in-place op
inside it, inputs that require grad under grad mode, nodes a preserved
signature names), then inserts the op at the run's end, where the op's own
checks (run on fake tensors) may still refuse it, and erases what only the
run needed.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch.fx import Graph, Node

from .. import _library  # noqa: F401  (registers ddpm::fused_sample)
from . import report
from .patterns import _ASSERT_METADATA, _NoMatch, _is, _val, aten
from .steps import _build_runs, _match_step, _Step, looks_like_update

log = logging.getLogger("ddpm_ops.rewrite")

FUSED_SAMPLE = torch.ops.ddpm.fused_sample.default


def rewrite_graph(graph: Graph, *, protected: frozenset[str] = frozenset(),
                  renamed: dict[str, str] | None = None, grad_inputs_ok: bool = True) -> int:
    """Replace every DDPM sampling run in ``graph`` by one ``ddpm::fused_sample``.

    Returns the number of fused ops emitted. Graphs with nothing it fully
    understands are left untouched. A run is also left alone when it would
    erase a node named in ``protected`` (other than its output, which is then
    reported in ``renamed`` as old name -> the fused op's name), or, with
    ``grad_inputs_ok=False`` and grad mode on, when one of the op's inputs
    requires grad (the op has no backward; inductor would call it that way).
    """
    emitted = _rewrite_runs(graph, protected, renamed, grad_inputs_ok)
    emitted += _rewrite_general(graph, protected, renamed, grad_inputs_ok)
    if emitted:
        graph.lint()
    return emitted


def _rewrite_runs(graph: Graph, protected, renamed, grad_inputs_ok) -> int:
    """The loops of the original contract, as ``ddpm::fused_sample``."""
    steps = _match_steps(graph)
    if not steps:
        return 0
    emitted = 0
    replaced: dict[Node, Node] = {}  # the output of an earlier run -> its fused op
    position = {n: i for i, n in enumerate(graph.nodes)}
    mutations = [position[n] for n in graph.nodes if _mutates(n)]
    for run in _build_runs(steps):
        last = run[-1]
        args = _fused_args(run, replaced)
        why = _refusal(run, args, position, mutations, protected, grad_inputs_ok)
        if why is not None:
            log.debug("ddpm_ops: time-column matcher: run ending at %s left alone: %s", last.out.name, why)
            continue
        fused = _insert_fused(graph, last.out, args)
        if fused is None:
            continue
        last.out.replace_all_uses_with(fused)
        replaced[last.out] = fused
        if renamed is not None:
            renamed[last.out.name] = fused.name
        _remove_dead(graph, last.out)
        emitted += 1
        _log_fused(run, args)
    return emitted


def _rewrite_general(graph: Graph, protected, renamed, grad_inputs_ok) -> int:
    """Every other loop the general reader proves, as ``ddpm::fused_sample.rule``."""
    from .loops import rewrite_loops

    def refusal(plan, fused):
        position = {n: i for i, n in enumerate(graph.nodes)}
        start = min(position[n] for net in plan.loop.nets for n in net.nodes)
        if any(start < position[n] < position[plan.end] and _mutates(n) for n in graph.nodes):
            return "an in-place op runs inside it"
        tensors = [a for a in torch.utils._pytree.tree_leaves(list(fused.args)) if isinstance(a, Node)]
        if not grad_inputs_ok and torch.is_grad_enabled():
            needing = [n.name for n in tensors if _requires_grad(n)]
            if needing:
                return f"grad mode is on and {needing} require grad (the op has no backward)"
        if protected:
            erased = _dead_after_replacing(plan.end, set()) - {plan.end}
            kept_names = sorted(n.name for n in erased if n.name in protected)
            if kept_names:
                return f"it would erase {kept_names}, which a preserved module call signature names"
        return None

    def replace(plan, fused):
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
            if key in plan.end.meta:
                fused.meta[key] = plan.end.meta[key]
        plan.end.replace_all_uses_with(fused)
        if renamed is not None:
            renamed[plan.end.name] = fused.name
        _remove_dead(graph, plan.end)

    return rewrite_loops(graph, refusal, replace)


def _match_steps(graph: Graph) -> list[_Step]:
    """Every step in ``graph``; each near miss (a node that looks like an
    update but is not a step) is logged with its reason."""
    steps = []
    for node in graph.nodes:
        if not looks_like_update(node):
            continue
        try:
            steps.append(_match_step(node))
        except _NoMatch as e:
            log.debug("ddpm_ops: time-column matcher: %s is not the time-column form: %s", node.name, e)
    return steps


def _fused_args(run: list[_Step], replaced: dict[Node, Node]) -> tuple:
    """The op's arguments for ``run``: its first step's inputs (the fused op of
    an earlier run where that run fed this one), K = the run's length."""
    first = run[0]
    x_first = replaced.get(first.x_in, first.x_in)
    t_arg = first.t_root if first.t_offset == 0 else first.t_node
    return (x_first, t_arg, list(first.weights), list(first.biases),
            first.sqrt_recip_alphas, first.coef_eps, len(run), first.total_timesteps)


def _tensor_args(args: tuple) -> list[Node]:
    """The float tensors among the op's arguments: x, weights, biases, tables."""
    x, _t, weights, biases, table_a, table_b = args[:6]
    return [x, *weights, *biases, table_a, table_b]


# ----------------------------------------------------------------------------- the guards

def _refusal(run: list[_Step], args: tuple, position: dict[Node, int], mutations: list[int],
             protected: frozenset[str], grad_inputs_ok: bool) -> str | None:
    """Why ``run`` may not be replaced by the op called with ``args``; None if it may."""
    if _mutated_inside(run, position, mutations):
        return "an in-place op runs inside it"
    tensors = _tensor_args(args)
    if not grad_inputs_ok and torch.is_grad_enabled():
        needing = [n.name for n in tensors if _requires_grad(n)]
        if needing:
            return f"grad mode is on and {needing} require grad (the op has no backward)"
    if protected:
        erased = _dead_after_replacing(run[-1].out, {args[1], *tensors}) - {run[-1].out}
        kept_names = sorted(n.name for n in erased if n.name in protected)
        if kept_names:
            return f"it would erase {kept_names}, which a preserved module call signature names"
    return None


def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def _mutated_inside(run: list[_Step], position: dict[Node, int], mutations: list[int]) -> bool:
    """Whether an in-place op (torch.export's default IR keeps them) runs
    between the run's first node and its end: the op reads its inputs where it
    is inserted (at the run's end), and the mutation could change one between
    the steps' reads and that point."""
    start = min(position[n] for s in run for n in (*s.nodes, s.t_node) if n in position)
    return any(start < m < position[run[-1].out] for m in mutations)


def _requires_grad(node: Any) -> bool:
    """Whether the tensor ``node`` stands for requires grad (a graph input's
    example value, or a module attribute the graph reads)."""
    if not isinstance(node, Node):
        return False
    if node.op == "get_attr":  # its example value may be a detached fake copy
        value = node.graph.owning_module
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        return isinstance(value, torch.Tensor) and value.requires_grad
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.requires_grad


# ----------------------------------------------------------------------------- the insertion

def _insert_fused(graph: Graph, out: Node, args: tuple) -> Node | None:
    """The op, inserted before ``out`` with its metadata; None (and the graph
    as it was) when the op's own checks refuse ``args``."""
    with graph.inserting_before(out):
        fused = graph.call_function(FUSED_SAMPLE, args)
    try:
        val = _fake_value(FUSED_SAMPLE, args)
    except Exception as e:  # the op's own checks refuse: leave the graph as it was
        graph.erase_node(fused)
        log.debug("ddpm_ops: time-column matcher: run at %s left alone: the op refuses its arguments: %s",
                  out.name, e)
        return None
    if val is not None:
        fused.meta["val"] = val
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
        if key in out.meta:
            fused.meta[key] = out.meta[key]
    return fused


def _fake_value(target, args):
    vals = torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(flat)
    if fake_mode is None:
        return None
    with fake_mode, torch.no_grad():  # the op is inference-only; shapes are all we need
        return target(*vals)


def _log_fused(run: list[_Step], args: tuple) -> None:
    first = run[0]
    xv = _val(args[0])
    widths = [tuple(_val(w).shape) for w in first.weights]
    report.fused(f"ddpm_ops: fused {len(run)} DDPM steps into one ddpm::fused_sample (batch shape "
                 f"{tuple(xv.shape)}, {len(widths)} layers with weights {widths}, T={first.total_timesteps})")


# ----------------------------------------------------------------------------- dead code

def _dead_after_replacing(out: Node, kept: set[Node]) -> set[Node]:
    """The nodes left unused once ``out``'s users read another node that reads
    ``kept``: ``out`` and what only it needed, with the ``torch.export``
    metadata checks on them."""
    dead: set[Node] = set()
    work = [out]
    while work:
        n = work.pop()
        if n in dead or n in kept or n.op != "call_function" or n.is_impure():
            continue
        live = [u for u in n.users if u not in dead and not _is(u, _ASSERT_METADATA)]
        if n is not out and live:
            continue
        dead.add(n)
        dead.update(u for u in n.users if _is(u, _ASSERT_METADATA))
        work.extend(n.all_input_nodes)
    return dead


def _remove_dead(graph: Graph, out: Node) -> None:
    """Erase ``out`` (its users moved away) and every node only it needed."""
    dead = _dead_after_replacing(out, set())
    for n in reversed(list(graph.nodes)):  # users before what they read
        if n in dead:
            graph.erase_node(n)
