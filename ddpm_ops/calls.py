"""The one place that builds calls of ``torch.ops.ddpm.fused_sample``: arguments by keyword.

:func:`sample`, :func:`fused_sample`, :class:`DiffusionSampler` and the
torch.compile rewrite's emitter all name the op's arguments and let
:func:`op_args` put them in the schema's order, so a trailing argument the
schema gains later (with its default) needs no change here or in any caller.
The arguments may be tensors or FX nodes standing for them.
"""
from __future__ import annotations

from typing import Any

import torch

from . import _library  # noqa: F401  (registers ddpm::fused_sample)

#: The time-column overload: the loop of :func:`ddpm_ops.reference`.
TIME_COLUMN = torch.ops.ddpm.fused_sample.default
#: The general step: any MLP, any affine update (:func:`ddpm_ops.sample`).
RULE = torch.ops.ddpm.fused_sample.rule


def _signature(overload) -> tuple[str, tuple[tuple[str, bool, Any], ...]]:
    """``overload``'s name and its arguments as (name, has a default, the default)."""
    schema = overload._schema
    return (f"{schema.name}.{schema.overload_name or 'default'}",
            tuple((a.name, a.has_default_value(), a.default_value if a.has_default_value() else None)
                  for a in schema.arguments))


# Read once, as plain tuples: torch.compile traces the wrappers that call
# op_args, and Dynamo cannot iterate a schema's Argument objects.
_SIGNATURES = ((TIME_COLUMN, _signature(TIME_COLUMN)), (RULE, _signature(RULE)))


def op_args(overload, **arguments: Any) -> tuple:
    """``arguments`` as ``overload``'s positional arguments, in its schema's order.

    Arguments left out take their schema default; trailing ones equal to it
    are not written, so a call reads as short as the schema allows (and a
    graph that holds it names no argument an older schema lacks). Raises
    ``TypeError`` for an unknown argument or a missing required one.
    """
    name, signature = next(s for o, s in _SIGNATURES if o is overload)
    known = [argument for argument, _, _ in signature]
    unknown = [argument for argument in arguments if argument not in known]
    if unknown:
        raise TypeError(f"{name}: unknown arguments {sorted(unknown)}")
    args, given = [], 0
    for position, (argument, has_default, default) in enumerate(signature):
        if argument in arguments:
            args.append(arguments[argument])
            given = position + 1
        elif has_default:
            args.append(default)
        else:
            raise TypeError(f"{name}: missing argument {argument}")
    return tuple(args[:given])


def arg_slots(overload) -> tuple[list, dict[str, int]]:
    """``overload``'s arguments as a fresh list of every schema default (``None`` where an
    argument has none) and each argument's position in it, for a caller that fills the
    same slots at every call (:class:`ddpm_ops.DiffusionSampler`: building the call by
    name costs more than the op's own work on a small batch)."""
    _, signature = next(s for o, s in _SIGNATURES if o is overload)
    return [default for _, _, default in signature], {name: i for i, (name, _, _) in enumerate(signature)}


def call(overload, **arguments: Any) -> torch.Tensor:
    """Call ``overload`` with ``arguments`` by name (see :func:`op_args`)."""
    return overload(*op_args(overload, **arguments))


def bias_net_args(prefix: str, net) -> dict:
    """The op's ``{prefix}_input``, ``_weights``, ``_biases`` and ``_activations`` arguments of a
    bias network: a :class:`~ddpm_ops.BiasNet`, or its four values (FX nodes, from the
    rewrite); none for ``None``."""
    if net is None:
        return {}
    values = net.op_args() if hasattr(net, "op_args") else net
    return dict(zip((f"{prefix}_input", f"{prefix}_weights", f"{prefix}_biases", f"{prefix}_activations"),
                    values))
