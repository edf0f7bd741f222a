"""The pass over one graph: every loop read, proved, emitted as one ``ddpm::fused_sample.rule``.

:func:`rewrite_graph` is the pipeline's driver. The stages, each its own
module: read the networks (:mod:`.network`, :mod:`.linear`,
:mod:`.activations`) and chain their applications into loops
(:mod:`.chain`); read and prove every step (:mod:`.plan`, the update by
:mod:`.affine`); build the tables (:mod:`.timesteps`, :mod:`.tables`); emit
the call (:mod:`.emit`); report (:mod:`.report`). Here: the guards a fused
loop must pass before it replaces the loop (an in-place op inside it, inputs
that require grad under grad mode, nodes a preserved signature names), the
replacement and the removal of what only the loop needed.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch.fx import Graph, Node

from .. import _library  # noqa: F401  (registers ddpm::fused_sample)
from .chain import _Loop, _StepNoMatch
from .emit import _emit
from .network import _find_nets
from .nodes import _ASSERT_METADATA, _NoMatch, _is, _val
from .plan import _loops_in, _Plan, _plan
from .report import count as _count, fused as _report_fused

log = logging.getLogger("ddpm_ops.rewrite")


def rewrite_graph(graph: Graph, *, protected: frozenset[str] = frozenset(),
                  renamed: dict[str, str] | None = None, grad_inputs_ok: bool = True) -> int:
    """Replace every sampling loop in ``graph`` by one ``ddpm::fused_sample.rule``.

    Returns the number of fused ops emitted. A graph with nothing the pass
    fully understands is left untouched, with one DEBUG line per loop naming
    why. A loop is also left alone when it would erase a node named in
    ``protected`` (other than its output, which is then reported in
    ``renamed`` as old name -> the fused op's name), or, with
    ``grad_inputs_ok=False`` and grad mode on, when one of the op's inputs
    requires grad (the op has no backward; inductor would call it that way).
    """

    def refusal(plan, fused):
        position = {n: i for i, n in enumerate(graph.nodes)}
        start = min(position[n] for net in plan.loop.nets for n in net.nodes)
        if any(start < position[n] < position[plan.end] and _mutates(n) for n in graph.nodes):
            return "an in-place op runs inside it"
        # The op, under what follows it: a chunk's reshape, a term v * 0 added (read too).
        op, tensors = fused, []
        while _is(op, torch.ops.aten.reshape.default, torch.ops.aten.add.Tensor):
            tensors += [a for a in op.args[1:] if isinstance(a, Node)]
            op = op.args[0]
        tensors += [a for a in torch.utils._pytree.tree_leaves(list(op.args)) if isinstance(a, Node)]
        if not grad_inputs_ok and torch.is_grad_enabled():
            needing = [n.name for n in tensors if _requires_grad(n)]
            if needing:
                return f"grad mode is on and {needing} require grad (the op has no backward)"
        if protected:
            erased = _dead_after_replacing(plan.end) - {plan.end}
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

    emitted = _rewrite_loops(graph, refusal, replace)
    if emitted:
        graph.lint()
    return emitted


def _parts(loop: _Loop, cuts: dict) -> list[_Loop]:
    """``loop`` cut where a step could not be fused: ``cuts`` maps a step's network output to
    ``"drop"`` (the step stays as it is) or ``"cut"`` (a new loop starts at the step: its sample
    is kept, so it ends the loop before)."""
    parts, start = [], 0
    for k, net in enumerate(loop.nets):
        how = cuts.get(net.out)
        if how is None:
            continue
        if k > start:
            parts.append(loop.part(start, k))
        start = k + 1 if how == "drop" else k
    if start < len(loop.nets):
        parts.append(loop.part(start, len(loop.nets)))
    return parts


def _rewrite_loops(graph: Graph, refusal, replace) -> int:
    """Replace every proved loop by ``ddpm::fused_sample.rule``. ``refusal(plan, fused)``
    may veto one (it returns the reason); ``replace(plan, fused)`` makes the fused op
    the loop's result. A step that cannot be fused cuts its loop in two (a kept trajectory:
    just before it; else around it), and each part is read as a loop of its own.
    Returns the number of loops fused."""
    done, tried, cuts = 0, set(), {}
    while True:
        loops, latest_of, reasons = _loops_in(graph)
        position = {n: i for i, n in enumerate(graph.nodes)}
        todo = [(part, latest_of[id(lp)]) for lp in loops for part in _parts(lp, cuts)]
        todo = [(part, latest) for part, latest in todo if _key(part) not in tried]
        if not todo:
            for r in reasons:
                log.debug("ddpm_ops: rewrite: %s", r)
            return done
        loop, latest = todo[0]
        tried.add(_key(loop))
        try:
            plan = _plan(loop, latest, position)
            fused, em = _emit(graph, plan)
        except _StepNoMatch as e:
            step = loop.nets[e.step]
            if len(loop.nets) > 1:
                cuts[step.out] = "cut" if e.sample_kept else "drop"
                log.debug("ddpm_ops: rewrite: loop of %d steps ending near %s cut at its step %d: %s",
                          len(loop.nets), loop.nets[-1].out.name, e.step, e)
                continue
            _left_alone(loop, e)
            continue
        except _NoMatch as e:
            _left_alone(loop, e)
            continue
        why = refusal(plan, fused)
        if why is not None:
            em.rollback()
            _left_alone(loop, why)
            continue
        replace(plan, fused)
        done += 1
        _count("loops_fused")
        _count("steps_fused", len(loop.nets))
        _log(plan)


def _key(loop: _Loop) -> tuple:
    return (loop.nets[0].out.name, len(loop.nets))


def _left_alone(loop: _Loop, why) -> None:
    log.debug("ddpm_ops: rewrite: loop of %d steps ending near %s left alone: %s",
              len(loop.nets), loop.nets[-1].out.name, why)
    _count("loops_left_alone")


def _log(plan: _Plan) -> None:
    net, K = plan.loop.nets[0], len(plan.loop.nets)
    noise = "yes" if any(u.noise is not None for u in plan.updates) else "no"
    # Said only where a step reads it (the lines of other loops stay as they were).
    previous = ", previous x0 yes" if any("p" in u.post for u in plan.updates) else ""
    if plan.eps_read_clip is not None:
        previous += f", eps read back from x0 clamped to {plan.eps_read_clip}"
    _report_fused(
        f"ddpm_ops: fused {K} step{'s' if K != 1 else ''} into one ddpm::fused_sample.rule (batch shape "
        f"{tuple(_val(plan.loop.x(0)).shape)}, {len(net.weights)} layers "
        f"{net.activations if net.program is None else 'program ' + str(list(net.program))}, clip "
        f"{plan.clip}, post_clip {plan.post_clip}, noise {noise}{previous})")


def looks_like_loop(graph: Graph) -> bool:
    """Cheap filter: whether ``graph`` applies an MLP at all (a training graph that does is
    named in the log as left alone)."""
    return bool(_find_nets(graph))


# ----------------------------------------------------------------------------- the guards

def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


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


# ----------------------------------------------------------------------------- dead code

def _dead_after_replacing(out: Node) -> set[Node]:
    """The nodes left unused once ``out``'s users read another node: ``out`` and what only
    it needed, with the ``torch.export`` metadata checks on them."""
    dead: set[Node] = set()
    work = [out]
    while work:
        n = work.pop()
        if n in dead or n.op != "call_function" or n.is_impure():
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
    dead = _dead_after_replacing(out)
    for n in reversed(list(graph.nodes)):  # users before what they read
        if n in dead:
            graph.erase_node(n)
