"""The activations the op computes, written once, and the readers of a network's layers.

:data:`VOCABULARY` names each activation as the op takes it (the op's own
list, DDPM_OPS_ACTIVATIONS in csrc/common/activation.h, holds the same names
in the same order; a test compares the two through the op's message for an
unknown name), with its function and the ``nn.Module`` that computes it.
:func:`mlp_layers` reads ``Linear (activation Linear)*`` off an
``nn.Sequential`` for callers of :func:`ddpm_ops.sample` and
:func:`ddpm_ops.mlp_parameters` (the SiLU network of the time-column op).
:func:`read_network` reads any network of Linears, activations, LayerNorms,
Dropout and residual blocks, however its forward is written, into the op's
network program (:class:`Program`): it traces the module with
``torch.export`` and reads the graph with the torch.compile rewrite's reader,
whose vocabulary is this one (each activation's ATen call is its function's).
:func:`run_program` is a program in plain PyTorch.
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize


@dataclass(frozen=True)
class Activation:
    """One activation: the op's name for it, its function, and the module class (with the
    condition on a module's settings, such as GELU's ``approximate``) that computes it."""

    name: str
    function: Callable[[torch.Tensor], torch.Tensor]
    module: type
    settings: Callable[[nn.Module], bool] = lambda module: True

    def computed_by(self, module: nn.Module) -> bool:
        """Whether ``module`` computes this activation: its class's own ``forward``, the settings."""
        return _keeps_forward(module, self.module) and self.settings(module)


#: Every activation the op computes, in the op's order.
VOCABULARY: tuple[Activation, ...] = (
    Activation("silu", F.silu, nn.SiLU),
    Activation("mish", F.mish, nn.Mish),
    Activation("relu", F.relu, nn.ReLU),
    Activation("gelu", F.gelu, nn.GELU, lambda m: m.approximate == "none"),
    Activation("gelu_tanh", functools.partial(F.gelu, approximate="tanh"), nn.GELU,
               lambda m: m.approximate == "tanh"),
    Activation("tanh", torch.tanh, nn.Tanh),
    Activation("identity", lambda h: h, nn.Identity),
)

#: The activations' functions by name ("gelu" is the erf form).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {a.name: a.function for a in VOCABULARY}


def mlp_layers(mlp: nn.Module, *, activations: Sequence[str] | None = None,
               name: str = "mlp") -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """The weights, biases and activation names of ``Linear (act Linear)*``.

    Args:
        mlp: an ``nn.Sequential`` alternating ``nn.Linear`` (with bias) and
            activation modules (:data:`VOCABULARY`: ``SiLU``, ``Mish``,
            ``ReLU``, ``GELU`` in either form, ``Tanh``, ``Identity``),
            starting and ending with a Linear; or one ``nn.Linear``. Modules
            must keep their class's own ``forward`` and carry no forward hooks.
        activations: the names allowed (all of :data:`VOCABULARY` by default).
        name: what the messages call ``mlp``.

    Returns:
        ``(weights, biases, activations)`` as :func:`ddpm_ops.sample` takes
        them (``weights[0]`` is the first Linear's whole weight).

    Raises:
        ValueError: a layer the op does not compute, named by position.
    """
    allowed = [a for a in VOCABULARY if activations is None or a.name in activations]
    wanted = "one of " + ", ".join(dict.fromkeys(a.module.__name__ for a in allowed)) \
        if len(allowed) > 1 else f"nn.{allowed[0].module.__name__}"
    layers = list(mlp.children()) if isinstance(mlp, nn.Sequential) else [mlp]
    if not layers:
        raise ValueError(f"{name}: expected Linear, activation, ..., Linear, got an empty nn.Sequential")
    for module in dict.fromkeys((mlp, *layers)):
        if module._forward_hooks or module._forward_pre_hooks:
            raise ValueError(f"{name}: {type(module).__name__} has forward hooks, which may change what "
                             "it computes")
    weights, biases, names = [], [], []
    for position, layer in enumerate(layers):
        if position % 2 == 0:
            if not (_keeps_forward(layer, nn.Linear) and layer.bias is not None):
                raise ValueError(f"{name}: layer {position} should be nn.Linear with bias, got "
                                 f"{_described(layer, nn.Linear)}")
            weights.append(layer.weight)
            biases.append(layer.bias)
            continue
        found = next((a.name for a in allowed if a.computed_by(layer)), None)
        if found is None:
            classes = tuple(a.module for a in allowed)
            raise ValueError(f"{name}: layer {position} should be {wanted}, got "
                             f"{_described(layer, classes) if isinstance(layer, classes) else repr(layer)}")
        names.append(found)
    if len(layers) % 2 == 0:
        raise ValueError(f"{name}: expected Linear, activation, ..., Linear, got {len(layers)} layers "
                         f"(the last layer should be nn.Linear, got {type(layers[-1]).__name__})")
    return weights, biases, names


def _described(layer: nn.Module, cls) -> str:
    """``layer``'s class, and why an instance of ``cls`` does not count."""
    given = type(layer).__name__
    if isinstance(layer, cls):
        overrides = not any(type(layer).forward is c.forward for c in (cls if isinstance(cls, tuple) else (cls,)))
        given += " with its own forward" if overrides else " without bias"
    return given


def _keeps_forward(layer: nn.Module, cls: type) -> bool:
    return isinstance(layer, cls) and type(layer).forward is cls.forward


# ---- Networks as programs: LayerNorm, residual blocks, Dropout.
#
# The op's ``network`` argument lists instructions run on one row ``h`` (the
# schema's comment in csrc/op/ops.cpp is the reference): ``"linear"``, the
# activations of VOCABULARY, ``"layer_norm:<eps>"`` / ``"layer_norm_affine:<eps>"``,
# ``"save"`` / ``"add"`` (a residual block), and first ``"input:<parts>"``.

#: The instructions besides the activations and LayerNorms.
PROGRAM_WORDS = ("linear", "save", "add")


def layer_norm_instruction(eps: float, affine: bool) -> str:
    """The instruction of a LayerNorm over h's columns with ``eps`` (``repr`` keeps every digit)."""
    return f"layer_norm{'_affine' if affine else ''}:{float(eps)!r}"


def run_program(network: Sequence[str], h: torch.Tensor, weights: Sequence[torch.Tensor],
                biases: Sequence[torch.Tensor], norm_weights: Sequence[torch.Tensor] = (),
                norm_biases: Sequence[torch.Tensor] = (), *,
                first_rows: torch.Tensor | None = None) -> torch.Tensor:
    """A network program on the rows ``h`` in plain PyTorch, in ``h``'s dtype (the reference of
    the op's ``network``). ``h`` is the program's input (for an ``"input:..."`` program, the
    concatenation it names); ``first_rows`` are added to the first Linear's output."""
    saved, linear, norm = [], 0, 0
    for instruction in network:
        if instruction.startswith("input:"):
            continue
        if instruction == "linear":
            h = F.linear(h, weights[linear].to(h.dtype), biases[linear].to(h.dtype))
            if linear == 0 and first_rows is not None:
                h = h + first_rows
            linear += 1
        elif instruction in ACTIVATIONS:
            h = ACTIVATIONS[instruction](h)
        elif instruction.startswith("layer_norm_affine:"):
            eps = float(instruction.split(":", 1)[1])
            h = F.layer_norm(h, (h.shape[-1],), norm_weights[norm].to(h.dtype), norm_biases[norm].to(h.dtype), eps)
            norm += 1
        elif instruction.startswith("layer_norm:"):
            h = F.layer_norm(h, (h.shape[-1],), None, None, float(instruction.split(":", 1)[1]))
        elif instruction == "save":
            saved.append(h)
        elif instruction == "add":
            h = h + saved.pop()
        else:
            raise ValueError(f"network: unknown instruction {instruction!r}")
    return h


def plain_activations(instructions: Sequence[str]) -> tuple[str, ...] | None:
    """The activation after each Linear but the last (``"identity"`` between two Linears) of a
    network ``Linear (activation? Linear)*``, the op's plain form; None for any other program."""
    if not instructions or instructions[0] != "linear" or instructions[-1] != "linear":
        return None
    names, pending = [], None
    for instruction in instructions[1:]:
        if instruction == "linear":
            names.append(pending or "identity")
            pending = None
        elif instruction in ACTIVATIONS and pending is None:
            pending = instruction
        else:  # a LayerNorm, a residual block, two activations in a row
            return None
    return tuple(names)


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor of a network lives: ``getattr(owner, name)``, a parameter, a buffer, a
    tensor attribute, or a tensor that a parametrization of ``owner`` computes when read."""

    owner: nn.Module
    name: str

    def read(self) -> torch.Tensor:
        return getattr(self.owner, self.name)

    def holder(self) -> dict | None:
        """The dictionary that holds the tensor itself, for a call to read it without
        ``nn.Module.__getattr__``; None for a parametrized tensor (computed when read)."""
        owner = self.owner
        if parametrize.is_parametrized(owner, self.name):
            return None
        return next((d for d in (owner._parameters, owner._buffers, owner.__dict__) if self.name in d), None)


@dataclass(frozen=True)
class Program:
    """A network read once (:func:`read_network`): its instructions and where its tensors live,
    read again at every call (:meth:`parameters`).

    Attributes:
        instructions: the op's ``network`` (without an ``"input:"`` instruction).
        weights, biases: one per ``"linear"``, in order; a bias None for a Linear without one.
        norm_weights, norm_biases: one per ``"layer_norm_affine"``; a bias None for a LayerNorm
            without one.
    """

    instructions: tuple[str, ...]
    weights: tuple[TensorRef, ...]
    biases: tuple[TensorRef | None, ...]
    norm_weights: tuple[TensorRef, ...] = ()
    norm_biases: tuple[TensorRef | None, ...] = ()

    @property
    def first_is_linear(self) -> bool:
        """Whether the first layer is a Linear (then its input's columns can be split into x's
        and bias rows); else the op reads the whole input (an ``"input:"`` instruction)."""
        return self.instructions[0] == "linear"

    @property
    def activations(self) -> tuple[str, ...] | None:
        """The op's plain form of the network (:func:`plain_activations`), or None."""
        return plain_activations(self.instructions)

    def linear_refs(self) -> tuple[TensorRef | None, ...]:
        """Every Linear's weight and bias in turn."""
        return _interleaved(self.weights, self.biases)

    def norm_refs(self) -> tuple[TensorRef | None, ...]:
        """Every affine LayerNorm's weight and bias in turn."""
        return _interleaved(self.norm_weights, self.norm_biases)

    def parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(weights, biases, norm_weights, norm_biases)`` as they are now; a Linear or a
        LayerNorm without a bias gets zeros."""
        weights = [ref.read() for ref in self.weights]
        norm_weights = [ref.read() for ref in self.norm_weights]
        return (weights, _biases(weights, self.biases), norm_weights, _biases(norm_weights, self.norm_biases))


def _interleaved(weights, biases) -> tuple:
    return tuple(ref for pair in zip(weights, biases) for ref in pair)


def _biases(weights: Sequence[torch.Tensor], refs: Sequence[TensorRef | None]) -> list[torch.Tensor]:
    return [bias_or_zeros(w, None if ref is None else ref.read()) for w, ref in zip(weights, refs)]


def bias_or_zeros(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``bias``, or zeros of ``weight``'s output width for a Linear or LayerNorm built without
    one: the op takes a bias for every layer."""
    return bias if bias is not None else weight.new_zeros(weight.shape[0])


def refuse_hooks(module: nn.Module, name: str) -> None:
    """Raise ``ValueError`` naming the first of ``module``'s modules that has forward hooks (the
    op computes the modules' own ``forward``, which a hook may change); ``name``: the argument's."""
    for path, sub in module.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            raise ValueError(f"{name}: {path or 'the module'} ({type(sub).__name__}) has forward hooks, which "
                             "may change what it computes")


#: What the op computes, as :func:`read_network`'s refusals list it.
_COMPUTED = ("Linears, the activations " + ", ".join(a.name for a in VOCABULARY if a.name != "identity")
             + " (as modules or functions), LayerNorms over the last dimension, eval-mode Dropout and residual "
             "blocks h + block(h)")


def read_network(module: nn.Module, width: int, *, name: str = "mlp") -> Program:
    """Read ``module`` as a network program, once, with the rewrite's reader of traced graphs.

    ``module`` is traced with ``torch.export`` on a ``(batch, width)`` input, in eval mode
    (Dropout is the identity: the op samples in inference mode), and the traced graph is read
    as the torch.compile rewrite reads a loop's network
    (:func:`ddpm_ops.rewrite.network._read_whole_network`): a chain of layers and residual
    blocks ``h + block(h)``, which may nest. So a network reads however its forward is
    written: layers in an ``nn.Sequential`` or looped over in a ``ModuleList``, activations as
    modules, functions or formulas (IDQL's Mish ``x * tanh(softplus(x))``), ``F.layer_norm``.

    Args:
        module: takes the network's (concatenated) input, returns its output.
        width: the input's columns.
        name: what the messages call ``module``.

    Returns:
        The :class:`Program`, its tensors named by the module that holds them.

    Raises:
        ValueError: a module with forward hooks; a forward that cannot be traced on a
            ``(batch, width)`` input; or naming the node of the traced graph (its module and
            line of source), and why: not a layer the op computes, a sum that is not a
            residual block, a layer's weight computed in the forward.
    """
    refuse_hooks(module, name)
    exported = _exported(module, width, name)
    from .rewrite.network import _read_whole_network  # (the rewrite reads this module's vocabulary)
    from .rewrite.nodes import _NoMatch
    graph = exported.graph
    inp = next(n for n in graph.nodes if n.op == "placeholder" and n.name in exported.graph_signature.user_inputs)
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    if len(outputs) != 1:
        raise ValueError(f"{name}: expected a forward returning one tensor, got {len(outputs)} outputs")
    try:
        net = _read_whole_network(outputs[0], inp)
    except _NoMatch as why:
        raise ValueError(f"{name}: {_where(why.node)}: {why}; the op computes {_COMPUTED}") from None
    if "linear" not in net.program:
        raise ValueError(f"{name}: {type(module).__name__} has no Linear: nothing for the op to compute")
    refs = _tensor_refs(exported, module)

    def ref(node):
        if node is None:
            return None
        if node not in refs:
            raise ValueError(f"{name}: {_where(node)}: a layer's weight or bias is computed in the forward "
                             f"({node.name}), not a parameter, buffer or parametrized tensor of "
                             f"{type(module).__name__}")
        return refs[node]

    return Program(net.program, *(tuple(map(ref, nodes)) for nodes in (net.weights, net.biases, net.norm_weights,
                                                                       net.norm_biases)))


def _exported(module: nn.Module, width: int, name: str):
    """``module`` traced by ``torch.export`` on a ``(2, width)`` input, every submodule in eval
    mode for the trace and in its own mode again after."""
    tensor = next((t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()), None)
    if tensor is None:
        raise ValueError(f"{name}: {type(module).__name__} has no parameters: nothing for the op to compute")
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        return torch.export.export(module, (torch.zeros(2, width, dtype=tensor.dtype, device=tensor.device),),
                                   strict=False)
    except Exception as error:  # noqa: BLE001 (any tracing failure means: cannot read it)
        raise ValueError(f"{name}: {type(module).__name__}'s forward cannot be traced on a (batch, {width}) "
                         f"input ({type(error).__name__}: {str(error).strip().splitlines()[0]})") from None
    finally:
        for m, training in modes:
            m.training = training


#: The fully qualified name of a parametrization's original tensor.
_ORIGINAL = re.compile(r"(?:(?P<path>.*)\.)?parametrizations\.(?P<name>\w+)\.original\d*")


def _tensor_refs(exported, module: nn.Module) -> dict:
    """``{node: TensorRef}`` for every node of the exported graph that is a tensor of
    ``module``: its parameters, buffers and tensor attributes (placeholders), and each tensor a
    parametrization computes (the node computed from that parametrization's originals alone)."""
    signature = exported.graph_signature
    names = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
             **signature.inputs_to_lifted_tensor_constants}
    refs, parametrized = {}, {}
    for node in exported.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            path, _, attribute = names[node.name].rpartition(".")
            refs[node] = TensorRef(module.get_submodule(path), attribute)
            original = _ORIGINAL.fullmatch(names[node.name])
            parametrized[node] = None if original is None else (original["path"] or "", original["name"])
        elif node.op == "call_function":
            sources = {parametrized.get(n) for n in node.all_input_nodes}
            parametrized[node] = sources.pop() if len(sources) == 1 else None
            if parametrized[node] is not None:
                refs[node] = TensorRef(module.get_submodule(parametrized[node][0]), parametrized[node][1])
    return refs


#: One frame of a node's ``stack_trace``.
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in \S+\n\s*(?P<code>[^\n]*)')


def _where(node) -> str:
    """The module whose forward made ``node`` (its path and class) and the innermost line of
    source outside torch that made it, where the trace recorded them."""
    stack = node.meta.get("nn_module_stack") or {}
    path, cls = next(reversed(stack.values()), ("", None))
    if cls is None:
        where = node.name
    else:  # the class as export records it: its qualified name
        where = f"{path or 'the module'} ({getattr(cls, '__name__', str(cls).rsplit('.', 1)[-1])})"
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in _FRAME.finditer(node.meta.get("stack_trace") or "") if not f["file"].startswith(torch_dir)]
    if frames:
        where += f", {os.path.basename(frames[-1]['file'])}:{frames[-1]['line']} `{frames[-1]['code'].strip()}`"
    return where
