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

Or the op computes them itself, once a call, from a :class:`BiasNet`: the
time embedding's MLP and ``W_t`` over one feature row per step index, the
observation and ``W_c`` (what the torch.compile rewrite passes, so that no
matmul is left outside the op)::

    time_net = BiasNet(sinusoidal_features, [lin1.weight, lin2.weight, W_t],
                       [lin1.bias, lin2.bias], ["mish", "identity"])
    cond_net = BiasNet(state, [W_c])
"""
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BiasNet:
    """A small network whose output the op adds to the first Linear's output,
    computed once a call::

        rows = Linear_n(act_{n-1}(... act_1(Linear_1(input))))

    ``Linear_l(h) = h @ weights[l].T + biases[l]``, but the last has no bias:
    it is the first Linear's block of columns for this input (the first
    Linear's bias is ``biases[0]`` of the sampler's network).

    Attributes:
        input: ``(rows, features)``: one row per step index (``time_net``: a
            time embedding's features at every step index of the rule) or one
            per sample (``cond_net``: an observation).
        weights: the ``nn.Linear`` weights, ``(out_l, in_l)``; the last
            ``(H0, in)``, H0 the first Linear's width.
        biases: one per weight but the last.
        activations: after each weight but the last: one name for all, or one
            per layer (:data:`ddpm_ops.reference.ACTIVATIONS`).
    """

    input: torch.Tensor
    weights: Sequence[torch.Tensor]
    biases: Sequence[torch.Tensor] = ()
    activations: str | Sequence[str] = "silu"

    def op_args(self) -> tuple:
        """``(input, weights, biases, activations)`` as the op's ``time_*`` / ``cond_*`` arguments."""
        from .reference import resolve_activations
        if len(self.biases) != len(self.weights) - 1:
            raise ValueError(f"biases: expected one per weight but the last ({len(self.weights) - 1}), "
                             f"got {len(self.biases)}")
        return (self.input, list(self.weights), list(self.biases),
                resolve_activations(self.activations, len(self.weights) - 1))

    def rows(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The network's output as plain PyTorch, in ``dtype`` (default: the input's)."""
        from .reference import ACTIVATIONS
        inp, weights, biases, names = self.op_args()
        dtype = dtype or inp.dtype
        h = inp.to(dtype)
        for w, b, name in zip(weights, biases, names):
            h = ACTIVATIONS[name](F.linear(h, w.to(dtype), b.to(dtype)))
        return F.linear(h, weights[-1].to(dtype))


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


def device_of(module: nn.Module | Callable, default: torch.device) -> torch.device:
    """Where ``module``'s own tensors are (its parameters, else its buffers); ``default`` for a
    function or a module that holds none."""
    if not isinstance(module, nn.Module):
        return default
    held = next(itertools.chain(module.parameters(), module.buffers()), None)
    return default if held is None else held.device


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
    is in, on the device of its tensors (else of ``weight_block``).

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
    device = device_of(time_embedding, weight_block.device)
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
