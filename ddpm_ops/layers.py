"""The activations the op computes, written once, and the one reader of a network's layers.

:data:`VOCABULARY` names each activation as the op takes it (the table in
csrc/op/checks.cpp holds the same names; a test compares the two), with its
function and the ``nn.Module`` that computes it. :func:`mlp_layers` reads
``Linear (activation Linear)*`` off an ``nn.Sequential`` for
:func:`ddpm_ops.sample`, :class:`ddpm_ops.DiffusionSampler` and
:func:`ddpm_ops.mlp_parameters` (the SiLU network of the time-column op).
"""
from __future__ import annotations

import functools
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
