"""The activations the op computes, written once, and the readers of a network's layers.

:data:`VOCABULARY` names each activation as the op takes it (the op's own
list, DDPM_OPS_ACTIVATIONS in csrc/common/activation.h, holds the same names
in the same order; a test compares the two through the op's message for an
unknown name), with its function and the ``nn.Module`` that computes it.
:func:`mlp_layers` reads ``Linear (activation Linear)*`` off an
``nn.Sequential`` for :func:`ddpm_ops.sample`, :class:`ddpm_ops.DiffusionSampler`
and :func:`ddpm_ops.mlp_parameters` (the SiLU network of the time-column op).
:func:`read_network` reads any chain of Linear, activation, LayerNorm, Dropout
and residual blocks (traced with torch.fx) into the op's network program
(:class:`Program`); :func:`run_program` is that program in plain PyTorch.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


@dataclass(frozen=True)
class Program:
    """A network read once (:func:`read_network`): its instructions and the modules that hold
    its parameters, read again at every call (:meth:`parameters`).

    Attributes:
        instructions: the op's ``network`` (without an ``"input:"`` instruction).
        linears: the ``nn.Linear`` modules, one per ``"linear"``, in order.
        norms: the affine ``nn.LayerNorm`` modules, one per ``"layer_norm_affine"``.
    """

    instructions: tuple[str, ...]
    linears: tuple[nn.Module, ...]
    norms: tuple[nn.Module, ...]

    @property
    def first_is_linear(self) -> bool:
        """Whether the first layer is a Linear (then its input's columns can be split into x's
        and bias rows); else the op reads the whole input (an ``"input:"`` instruction)."""
        return self.instructions[0] == "linear"

    def parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(weights, biases, norm_weights, norm_biases)`` as they are now; a Linear or a
        LayerNorm without a bias gets zeros."""
        weights = [m.weight for m in self.linears]
        biases = [bias_or_zeros(m.weight, m.bias) for m in self.linears]
        norm_weights = [m.weight for m in self.norms]
        norm_biases = [bias_or_zeros(m.weight, m.bias) for m in self.norms]
        return weights, biases, norm_weights, norm_biases


def bias_or_zeros(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``bias``, or zeros of ``weight``'s output width for a Linear or LayerNorm built without
    one: the op takes a bias for every layer."""
    return bias if bias is not None else weight.new_zeros(weight.shape[0])


_FUNCTION_ACTIVATIONS = {
    F.silu: "silu", F.mish: "mish", F.relu: "relu", torch.relu: "relu", torch.tanh: "tanh", F.tanh: "tanh",
}
_ADDS = (operator.add, operator.iadd, torch.add)
_DROPOUTS = (F.dropout,)


def refuse_hooks(module: nn.Module, name: str) -> None:
    """Raise ``ValueError`` naming the first of ``module``'s modules that has forward hooks (the
    op computes the modules' own ``forward``, which a hook may change); ``name``: the argument's."""
    for path, sub in module.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            raise ValueError(f"{name}: {path or 'the module'} ({type(sub).__name__}) has forward hooks, which "
                             "may change what it computes")


def read_network(module: nn.Module, *, name: str = "mlp") -> Program:
    """Read ``module`` as a network program, once: a chain of layers and residual blocks.

    The module's ``forward`` is traced with ``torch.fx`` and read as one chain: every layer
    takes the previous one's output; a value used again later is a residual block's input,
    added (``+``) to the block's output. The layers: ``nn.Linear`` (with or without bias),
    the activations of :data:`VOCABULARY` as modules or as ``F.silu``, ``F.mish``,
    ``F.relu``/``torch.relu``, ``F.gelu`` (either ``approximate``), ``torch.tanh``/``F.tanh``;
    ``nn.LayerNorm`` over the last dimension (affine or not, any eps); ``nn.Dropout`` and
    ``F.dropout`` (the identity: the op samples in inference mode), ``nn.Identity``. Residual
    blocks may nest. So the projects' networks read as they are written: IDQL's LN-ResNet
    ``h + Linear(Mish(Linear(LayerNorm(Dropout(h)))))``, its MLP with a LayerNorm over the
    whole input, CleanDiffuser's ``IDQLMlp`` layers, DPPO's pre-activation residual MLP.

    Args:
        module: takes the network's (concatenated) input, returns its output.
        name: what the messages call ``module``.

    Returns:
        The :class:`Program`.

    Raises:
        ValueError: naming the module (by its path in ``module``) or the operation, and why:
            a forward torch.fx cannot trace, a layer the op does not compute, a module with
            forward hooks, a value used other than as a chain or a residual.
    """
    refuse_hooks(module, name)
    try:
        traced = torch.fx.symbolic_trace(module)
    except Exception as error:  # noqa: BLE001 (any tracing failure means: cannot read it)
        raise ValueError(f"{name}: {type(module).__name__}'s forward cannot be read as a chain of layers: "
                         f"torch.fx cannot trace it ({type(error).__name__}: {error})") from None
    modules = dict(traced.named_modules())
    nodes = list(traced.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ValueError(f"{name}: {type(module).__name__}'s forward must take one input (the concatenated "
                         f"input), got {len(inputs)}: {[n.name for n in inputs]}")
    instructions: list[str] = []
    linears: list[nn.Module] = []
    norms: list[nn.Module] = []
    saved: list = []
    current = inputs[0]

    def where(node) -> str:
        if node.op == "call_module":
            return f"{node.target} ({type(modules[node.target]).__name__})"
        return f"{node.op} {getattr(node.target, '__name__', node.target)} ({node.name})"

    def refuse(node, why: str):
        raise ValueError(f"{name}: {where(node)}: {why}")

    def became_current(node):
        nonlocal current
        current = node
        uses = len(node.users)
        if uses > 2:
            refuse(node, f"its output is used {uses} times; the op reads a chain of layers and residual blocks "
                         "(a value used by the next layer and once more by a residual add)")
        if uses == 2:
            instructions.append("save")
            saved.append(node)

    became_current(current)
    for node in nodes:
        if node.op in ("placeholder",):
            continue
        if node.op == "output":
            if node.args[0] is not current:
                refuse(node, "the network's output is not the last layer's")
            break
        if node.op == "call_function" and node.target in _ADDS:
            operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
            if len(operands) != 2 or node.kwargs or len(node.args) != 2:
                refuse(node, "an addition the op reads only as a residual: h + (a saved earlier h)")
            a, b = operands
            other = b if a is current else a if b is current else None
            if other is None or not saved or saved[-1] is not other:
                refuse(node, "adds values other than the previous layer's output and a residual block's input")
            saved.pop()
            instructions.append("add")
            became_current(node)
            continue
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        if node.op in ("call_module", "call_function") and operands != [current]:
            refuse(node, "reads something other than the previous layer's output: not a chain of layers "
                         "and residual blocks")
        if node.op == "call_module":
            layer = modules[node.target]
            instruction = _module_instruction(layer)
            if instruction is None:
                refuse(node, "not a layer the op computes (nn.Linear, an activation of "
                             f"{', '.join(a.module.__name__ for a in VOCABULARY)}, nn.LayerNorm over the last "
                             "dimension, nn.Dropout, residual blocks)")
            if instruction == "linear":
                linears.append(layer)
            elif instruction.startswith("layer_norm_affine"):
                norms.append(layer)
        elif node.op == "call_function" and node.target in _FUNCTION_ACTIVATIONS:
            instruction = _FUNCTION_ACTIVATIONS[node.target]
        elif node.op == "call_function" and node.target is F.gelu:
            approximate = node.kwargs.get("approximate", "none")
            instruction = "gelu" if approximate == "none" else "gelu_tanh" if approximate == "tanh" else None
            if instruction is None:
                refuse(node, f"GELU with approximate={approximate!r}")
        elif node.op == "call_function" and node.target in _DROPOUTS:
            instruction = "identity"
        else:
            refuse(node, "not an operation the op computes (a module of the vocabulary, F.silu, F.mish, F.relu, "
                         "F.gelu, torch.tanh, F.dropout, or a residual +)")
        if instruction != "identity":
            instructions.append(instruction)
        became_current(node)
    if "linear" not in instructions:
        raise ValueError(f"{name}: {type(module).__name__} has no nn.Linear: nothing for the op to compute")
    return Program(tuple(instructions), tuple(linears), tuple(norms))


def _module_instruction(layer: nn.Module) -> str | None:
    """The instruction of one leaf module, ``"identity"`` for one that computes nothing, or None."""
    if _keeps_forward(layer, nn.Linear):
        return "linear"
    if _keeps_forward(layer, nn.LayerNorm):
        if len(layer.normalized_shape) != 1:
            return None
        return layer_norm_instruction(layer.eps, layer.weight is not None)
    if isinstance(layer, nn.Dropout) and type(layer).forward is nn.Dropout.forward:
        return "identity"
    return next((a.name for a in VOCABULARY if a.computed_by(layer)), None)
