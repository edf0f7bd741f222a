"""Compile-time constants: the arguments of a fused call that depend on no input that changes.

A fused loop should run the op and nothing that could have been computed once.
Its step tables, the time embedding's features at every step index and a
shared ``t_start`` are computed from the loop's constants (``arange``,
``full``) and from the module's *buffers* (a schedule's ``alphas_cumprod``,
``posterior_mean_coef1``...), never from parameters or the call's inputs. So
under ``torch.compile`` they are evaluated here, once, with the buffers'
values, and the call reads them as graph constants (``get_attr``): no kernel
computes them per call. What depends on parameters (a time MLP, the first
Linear's columns) is passed to the op, which evaluates it inside its launch.

Where the values come from: inductor's post-grad graph holds a module's
parameters and buffers as placeholders. While Dynamo compiles a frame, its
graph arguments hold the real tensors, one per placeholder in order
(:func:`real_buffers`); a placeholder is folded only when its tensor is a
module buffer (static, not an ``nn.Parameter``) of at most
:data:`MAX_FOLDED_NUMEL` elements. Outside a Dynamo compilation (exported
programs, AOTInductor) nothing is folded: the graph computes the values as
before.

A buffer is thereby read once, when the graph is compiled, as inductor's
``freezing`` reads parameters: a buffer changed in place afterwards is not
seen by the compiled loop (``torch._dynamo.reset()``, or a new
``torch.compile``, reads it again). The FX graph cache keys a compiled graph
by the values of the buffers it may fold (:func:`buffer_digest`, part of the
pass's uuid), so a cached graph is never served to a module with other
schedules.
"""
from __future__ import annotations

import hashlib
import itertools
import logging

import torch
from torch.fx import Graph, Node

log = logging.getLogger("ddpm_ops.rewrite")

#: The largest buffer (in elements) whose values may become a graph constant
#: (a schedule's tables have one entry per training timestep: 1000 or so).
MAX_FOLDED_NUMEL = 1 << 16

_names = itertools.count()


def _dynamo_inputs() -> list | None:
    """The real tensors (or other values) behind the graph Dynamo is compiling now, one per
    placeholder of the graph the backend is given; ``None`` outside a Dynamo compilation."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - no Dynamo frame being compiled
        return None
    if tx is None:
        return None
    # The translator of the last frame Dynamo traced can outlive its compilation (torch.export
    # leaves it behind): only one whose fake mode is the current compilation's counts.
    from torch._guards import TracingContext
    context = TracingContext.try_get()
    if context is None or context.fake_mode is None or getattr(tx.output, "fake_mode", None) is not context.fake_mode:
        return None
    try:
        return [(ga.example, ga.source.name if ga.source is not None else "") for ga in tx.output.graphargs]
    except Exception:  # noqa: BLE001 - a Dynamo version without these attributes
        return None


def _is_foldable(value, source: str) -> bool:
    """A module buffer small enough to read once: not a parameter, not a call's input."""
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return False
    if type(value) is not torch.Tensor or value.requires_grad or value.numel() > MAX_FOLDED_NUMEL:
        return False
    return "._buffers[" in source or getattr(value, "_dynamo_static_input_type", None) is not None


def buffer_digest() -> str | None:
    """A digest of the values of every buffer the graph being compiled may fold (``None``
    outside a Dynamo compilation): the pass's uuid includes it."""
    inputs = _dynamo_inputs()
    if inputs is None:
        return None
    h = hashlib.sha256()
    for value, source in inputs:
        if _is_foldable(value, source):
            h.update(f"{source}:{value.dtype}:{tuple(value.shape)}".encode())
            h.update(value.detach().to("cpu").contiguous().numpy().tobytes()
                     if value.dtype != torch.bfloat16 else value.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def real_buffers(graph: Graph) -> dict[Node, torch.Tensor] | None:
    """The placeholders of ``graph`` that are module buffers, with their values; empty where
    the graph's placeholders cannot be matched one to one with what Dynamo compiles; ``None``
    outside a Dynamo compilation (an exported program: nothing is folded)."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    inputs = _dynamo_inputs()
    if inputs is None:
        return None
    from torch._guards import TracingContext
    mode = TracingContext.get().fake_mode
    if any(getattr(n.meta.get("val"), "fake_mode", mode) is not mode for n in placeholders):
        return {}  # not the graph this compilation traced
    try:  # parameters and buffers lifted by AOTAutograd come first (no inlined nn.Modules)
        from torch._guards import TracingContext
        context = TracingContext.try_get()
        lifted = list(context.params_flat or []) if context is not None else []
    except Exception:  # noqa: BLE001
        lifted = []
    inputs = [(t, "._buffers[" if not isinstance(t, torch.nn.Parameter) else "") for t in lifted] + inputs
    if len(inputs) != len(placeholders):
        return {}
    found = {}
    for node, (value, source) in zip(placeholders, inputs):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) != isinstance(value, torch.Tensor):
            return {}  # not the same list: fold nothing
        if isinstance(value, torch.Tensor):
            if val.dtype != value.dtype or val.device != value.device or \
                    any(not isinstance(a, int) or a != b for a, b in zip(val.shape, value.shape)) or \
                    val.dim() != value.dim():
                if _is_foldable(value, source):
                    return {}
                continue
            if _is_foldable(value, source):
                found[node] = value
    return found


def _random(node: Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def evaluate(graph: Graph, node: Node, buffers: dict[Node, torch.Tensor]) -> torch.Tensor | None:
    """``node``'s value where it depends only on ``buffers`` and constants; else ``None``."""
    module = graph.owning_module
    if module is None or not isinstance(node, Node):
        return None
    needed, work = set(), [node]
    while work:
        n = work.pop()
        if n in needed:
            continue
        if n.op == "placeholder" and n not in buffers:
            return None
        if n.op == "call_function" and (_random(n) or n.is_impure()) or n.op not in (
                "placeholder", "get_attr", "call_function"):
            return None
        needed.add(n)
        work.extend(n.all_input_nodes)
    env: dict[Node, object] = {}
    with torch.no_grad():
        for n in graph.nodes:
            if n not in needed:
                continue
            if n.op == "placeholder":
                env[n] = buffers[n]
            elif n.op == "get_attr":
                value = module
                for part in str(n.target).split("."):
                    value = getattr(value, part)
                env[n] = value
            else:
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
                if any(isinstance(a, torch.SymInt) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
                    return None
                env[n] = n.target(*args, **kwargs)
    value = env[node]
    return value if isinstance(value, torch.Tensor) else None


def fold(graph: Graph, node: Node, buffers: dict[Node, torch.Tensor], fake_mode) -> tuple[Node, Node] | None:
    """``node``'s value as a ``get_attr`` constant of ``graph``'s module where it depends only
    on ``buffers`` and constants: ``(the get_attr node, the node reading it)``; else ``None``
    (the graph is not changed)."""
    module = graph.owning_module
    if module is None or not isinstance(node, Node) or node.op == "get_attr":
        return None
    value = evaluate(graph, node, buffers)
    if value is None:
        return None
    # Stored with a leading dimension of one and read through a select: inductor hands a graph
    # constant given to an op as it is to the op's fake kernel, with the real tensor (which it
    # refuses), but a view of one as a view (no copy: the call reads the constant's storage).
    value = value.detach().clone()[None]
    name = f"_ddpm_ops_constant_{next(_names)}"
    module.register_buffer(name, value, persistent=False)
    with graph.inserting_before(node):
        constant = graph.get_attr(name)
        view = graph.call_function(torch.ops.aten.select.int, (constant, 0, 0))
    if fake_mode is not None:
        constant.meta["val"] = fake_mode.from_tensor(value, static_shapes=True)
        with fake_mode:
            view.meta["val"] = constant.meta["val"][0]
    else:
        constant.meta["val"], view.meta["val"] = value, value[0]
    for key in ("nn_module_stack", "stack_trace"):
        if key in node.meta:
            constant.meta[key] = view.meta[key] = node.meta[key]
    return constant, view
