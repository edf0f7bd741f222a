"""Turn a network with a concatenated first-layer input into the op's form.

Many diffusion policies feed their first Linear ``cat([x, t_emb, cond], dim=1)``.
The op's first layer sees ``x`` alone; the rest of that Linear is linear in the
other parts, so it becomes two biases::

    W0 @ cat([x, t_emb(t), cond]) + b0
        = W_x @ x + b0 + (W_t @ t_emb(t)) + (W_c @ cond)
        = W_x @ x + b0 + time_bias[s]     + cond_bias

``time_bias`` has one row per step index (the embedding depends only on the
step), ``cond_bias`` one row per sample (the conditioning is fixed during
sampling). Example, a Diffusion-QL policy ``mid(cat([x, time_mlp(t), state]))``
sampled with a diffusers scheduler::

    rule, timesteps = ddpm_ops.step_rules.from_diffusers(scheduler)
    W_x, (W_t, W_c) = split_first_linear(mid[0], (action_dim, t_dim, state_dim))
    tb = time_bias_from_module(time_mlp, W_t, timesteps)       # (len(rule), 256)
    cb = cond_bias(W_c, state)                                 # (batch, 256)
    weights = [W_x] + [m.weight for m in mid[1:] if isinstance(m, nn.Linear)]

Both biases are computed in float64 and rounded once to float32, so they
carry less rounding than the float32 matmul of the concatenated input does;
the split form agrees with the unfused network to float32 accuracy.
"""
from collections.abc import Callable, Sequence

import torch
from torch import nn


def split_first_linear(
    linear: nn.Linear, sizes: Sequence[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Split a Linear's weight by the column blocks of its concatenated input.

    Args:
        linear: the first ``nn.Linear`` (weight ``(H0, in_features)``), fed
            ``cat([x, part1, part2, ...], dim=1)``.
        sizes: the column counts ``(dim, n1, n2, ...)``, summing to ``in_features``.

    Returns:
        ``(W_x, [W_1, W_2, ...])``: detached views of the weight, ``W_x`` of
        shape ``(H0, dim)`` and ``W_i`` of shape ``(H0, n_i)``. The bias stays
        ``linear.bias``.

    Raises:
        TypeError: ``linear`` has no 2-D ``weight``.
        ValueError: a size that is not a positive integer, or sizes that do
            not sum to ``in_features``.

    Example::

        # mid[0] = nn.Linear(action_dim + 16 + state_dim, 256)
        W_x, (W_t, W_s) = split_first_linear(mid[0], (action_dim, 16, state_dim))
    """
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"linear: expected an nn.Linear with a 2-D weight, got {type(linear).__name__}")
    sizes = list(sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"sizes: expected positive integers (dim, n1, ...), got {sizes}")
    if sum(sizes) != weight.shape[1]:
        raise ValueError(f"sizes: expected a sum of in_features = {weight.shape[1]}, got {sizes} (sum {sum(sizes)})")
    blocks = weight.detach().split(sizes, dim=1)
    return blocks[0], list(blocks[1:])


def time_bias(
    weight_block: torch.Tensor, time_features: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The first layer's time contribution at every step index.

    Args:
        weight_block: ``(H0, n)``, the columns the time embedding feeds.
        time_features: ``(S, n)``, the time embedding at every step index.
        dtype: the output dtype.

    Returns:
        ``(S, H0)`` ``time_features @ weight_block.T``, computed in float64.

    Raises:
        ValueError: shapes that do not match.

    Example::

        emb = time_mlp(timesteps.float())            # (len(rule), 16)
        tb = time_bias(W_t, emb)                     # (len(rule), 256)
    """
    return _project("time_features", weight_block, time_features, dtype)


def time_bias_from_module(
    time_embedding: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    weight_block: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Evaluate a time-embedding module at every step index and project it.

    The module runs under ``torch.no_grad`` in whatever mode (train/eval) it
    is in, on the device of its parameters (else of ``weight_block``).

    Args:
        time_embedding: a module or function mapping ``(S,)`` timesteps to
            ``(S, n)`` features, e.g.
            Diffusion-QL's ``SinusoidalPosEmb -> Linear -> Mish -> Linear``.
        weight_block: ``(H0, n)``, the columns the embedding feeds.
        timesteps: ``(S,)``, the training timestep of each step index (the
            ``timesteps`` of :func:`ddpm_ops.from_diffusers`, or
            ``torch.arange(T)`` for :func:`ddpm_ops.ddpm`).
        dtype: the dtype the module is given the timesteps in.
        out_dtype: the output dtype.

    Returns:
        ``(S, H0)`` time bias.

    Raises:
        ValueError: ``timesteps`` is not 1-D, or the module's output does not
            match ``weight_block``.

    Example::

        tb = time_bias_from_module(time_mlp, W_t, timesteps)   # (len(rule), 256)
    """
    timesteps = torch.as_tensor(timesteps)
    if timesteps.dim() != 1:
        raise ValueError(f"timesteps: expected a 1-D tensor, got shape {tuple(timesteps.shape)}")
    parameters = time_embedding.parameters() if isinstance(time_embedding, nn.Module) else ()
    device = next(iter(parameters), weight_block).device
    with torch.no_grad():
        features = time_embedding(timesteps.to(device=device, dtype=dtype))
    return _project("time_embedding output", weight_block, features, out_dtype)


def cond_bias(weight_block: torch.Tensor, cond: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first layer's conditioning contribution for every sample.

    Args:
        weight_block: ``(H0, n)``, the columns the conditioning feeds.
        cond: ``(B, n)``, each sample's conditioning (e.g. the state).
        dtype: the output dtype.

    Returns:
        ``(B, H0)`` ``cond @ weight_block.T``, computed in float64.

    Raises:
        ValueError: shapes that do not match.

    Example::

        cb = cond_bias(W_s, state)                   # (batch, 256)
    """
    return _project("cond", weight_block, cond, dtype)


def _project(name: str, weight_block: torch.Tensor, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if weight_block.dim() != 2:
        raise ValueError(f"weight_block: expected a 2-D (H0, n) tensor, got shape {tuple(weight_block.shape)}")
    if features.dim() != 2 or features.shape[1] != weight_block.shape[1]:
        raise ValueError(
            f"{name}: expected shape (rows, {weight_block.shape[1]}) to match weight_block "
            f"{tuple(weight_block.shape)}, got {tuple(features.shape)}"
        )
    features = features.detach().to(device=weight_block.device, dtype=torch.float64)
    return (features @ weight_block.detach().to(torch.float64).T).to(dtype)
