"""Both overloads of ``ddpm::fused_sample`` on DTensors: a batch sharded over devices.

Every sample's steps depend on its own row alone, so the op runs on a batch
sharded along its first dimension with no communication: each device runs
its rows. :func:`register` tells DTensor so (``register_sharding``):

* sharded along the batch (``Shard(0)``): ``x``, ``t_start``, ``cond_bias``,
  ``cond_input`` and a ``noise_seed`` of one seed per row; ``noise``
  ``(K, batch, dim)`` along its dimension 1; the output along the batch, the
  chain ``(K + 1, batch, dim)`` along its dimension 1;
* replicated: everything else (the networks' weights and biases, the step
  tables, ``time_bias``, ``time_input``).

DTensor redistributes inputs of any other placement to these. Two calls
replicate every input instead and compute the whole batch on every device: a
batch of fewer rows than the mesh has devices, and a single seed shared by a
batch of more than one row (its noise is a function of each row's position in
the whole batch, which a shard does not know; :func:`ddpm_ops.sample`
therefore draws one seed per row for a DTensor ``x``). Either way a sharded
call gives the unsharded call's numbers.
"""
import math

import torch

# Arguments with one row per sample (dimension 0), and the noise, whose batch
# dimension is its second.
_BATCH_ROWS = frozenset({"x", "t_start", "cond_bias", "cond_input", "noise_seed"})
_BATCH_DIM_1 = frozenset({"noise"})


def register() -> bool:
    """Register the sharding rules of both overloads with DTensor.

    Returns:
        Whether they were registered: ``False`` where torch has no
        ``torch.distributed`` (a build without it) or no ``register_sharding``.
    """
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # an experimental API: a torch may move or drop it
        return False

    for overload in (torch.ops.ddpm.fused_sample.default, torch.ops.ddpm.fused_sample.rule):
        register_sharding(overload)(_strategies_of(overload))
    return True


def _strategies_of(overload):
    """The sharding function ``register_sharding`` calls for ``overload``: the
    acceptable ``(output placements, input placements)`` of one mesh dimension."""
    from torch.distributed.tensor import Replicate, Shard

    names = [argument.name for argument in overload._schema.arguments]

    def strategies(*args, **kwargs):
        bound = {**dict(zip(names, args)), **kwargs}
        given = [*zip(names, args), *kwargs.items()]

        def inputs(batch_sharded: bool) -> list:
            # One placement per tensor, tensor lists flattened, in the order
            # DTensor lists the op's inputs: positional arguments, then keywords.
            placements = []
            for name, value in given:
                for _ in _tensors_in(value):
                    if batch_sharded and name in _BATCH_ROWS:
                        placements.append(Shard(0))
                    elif batch_sharded and name in _BATCH_DIM_1:
                        placements.append(Shard(1))
                    else:
                        placements.append(Replicate())
            return placements

        x, seed = bound["x"], bound.get("noise_seed")
        replicated = ([Replicate()], inputs(False))
        if seed is not None and math.prod(seed.shape) == 1 and x.shape[0] != 1:
            return [replicated]
        sharded = ([Shard(1) if bound.get("return_chain", False) else Shard(0)], inputs(True))
        return [sharded] if x.shape[0] >= x.mesh.size() else [sharded, replicated]

    return strategies


def _tensors_in(value) -> list:
    """The tensors (DTensor specs) of one argument: itself, or a list's items."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    items = value if isinstance(value, (list, tuple)) else [value]
    return [item for item in items if isinstance(item, DTensorSpec)]
