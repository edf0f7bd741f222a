"""nn.Modules that run a whole sampler of a user's own MLP as one fused op."""
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .conditioning import cond_bias, time_bias_from_module
from .layers import mlp_layers
from .ops import PRECISIONS, sample
from .step_rules import StepRule

class DiffusionSampler(nn.Module):
    """A full sampling run of a user's MLP under a step rule, as one fused op.

    The network is ``mlp(cat(inputs, dim=1))`` with ``inputs`` the samples ``x``
    and, optionally, a time embedding and a conditioning vector, in the order
    ``layout`` gives. The first Linear's time and conditioning columns become
    the op's ``time_bias`` and ``cond_bias`` at every call (so trained
    parameters are always the current ones).

    Args:
        mlp: ``Linear (act Linear)*`` (see :func:`mlp_layers`); its last Linear
            outputs what the rule expects (epsilon, x0 or v).
        rule: the :class:`~ddpm_ops.StepRule` of the sampler.
        timesteps: ``(len(rule),)``: the training timestep of each step index,
            the input of ``time_embedding`` (``torch.arange(T)`` for
            :func:`ddpm_ops.step_rules.ddpm`).
        layout: ``(name, columns)`` pairs in the order the first Linear's input
            concatenates them; names ``"x"`` (required), ``"time"`` and
            ``"cond"``.
        time_embedding: maps ``(S,)`` timesteps to ``(S, n)`` features; needed
            when the layout has ``"time"`` (``lambda t: t[:, None]`` for a raw
            timestep column).
        precision: passed to :func:`ddpm_ops.sample`.

    Example (a diffusers scheduler and a Diffusion-QL-style network)::

        scheduler.set_timesteps(10)
        rule, timesteps = ddpm_ops.step_rules.from_diffusers(scheduler)
        sampler = ddpm_ops.DiffusionSampler(
            mid, rule, timesteps, layout=(("x", 6), ("time", 16), ("cond", 17)),
            time_embedding=time_mlp)
        with torch.no_grad():
            actions = sampler(torch.randn(50, 6), cond=state)
    """

    def __init__(self, mlp: nn.Module, rule: StepRule, timesteps: torch.Tensor | None = None, *,
                 layout: Sequence[tuple[str, int]], time_embedding: Callable | None = None,
                 precision: str = "fp32"):
        super().__init__()
        names = [name for name, _ in layout]
        if names.count("x") != 1 or any(n not in ("x", "time", "cond") for n in names) or \
                len(set(names)) != len(names):
            raise ValueError(f"layout: expected 'x' once and optionally 'time' and 'cond', got {names}")
        if ("time" in names) != (time_embedding is not None):
            raise ValueError("time_embedding: expected one exactly when layout has 'time', got "
                             f"{'none' if time_embedding is None else 'one'} for layout {names}")
        if "time" in names and (timesteps is None or len(timesteps) != len(rule)):
            raise ValueError(f"timesteps: expected one per step index ({len(rule)}), got "
                             f"{None if timesteps is None else len(timesteps)}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
        weights, _, _ = mlp_layers(mlp)  # fail at construction, not at the first call
        if sum(n for _, n in layout) != weights[0].shape[1]:
            raise ValueError(f"layout: expected columns summing to the first Linear's "
                             f"in_features {weights[0].shape[1]}, got {list(layout)}")
        self.mlp = mlp
        self.rule = rule
        self.layout = tuple(layout)
        self.time_embedding = time_embedding
        self.register_buffer("timesteps", None if timesteps is None else torch.as_tensor(timesteps))
        self.precision = precision

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None, *,
                num_steps: int | None = None, noise: torch.Tensor | None = None,
                generator: torch.Generator | None = None, return_chain: bool = False) -> torch.Tensor:
        """Sample from ``x`` at the rule's last step index, ``num_steps``
        steps (all of them by default); ``cond``: ``(batch, n)`` or ``(n,)``.
        ``noise``, ``generator`` and ``return_chain`` as :func:`ddpm_ops.sample`."""
        weights, biases, activations = mlp_layers(self.mlp)
        names = [name for name, _ in self.layout]
        if ("cond" in names) != (cond is not None):
            raise ValueError(f"cond: expected {'a tensor' if 'cond' in names else 'None'} for "
                             f"layout {names}, got {'None' if cond is None else 'a tensor'}")
        columns = dict(zip(names, weights[0].detach().split([n for _, n in self.layout], dim=1)))
        time = None if self.time_embedding is None else time_bias_from_module(
            self.time_embedding, columns["time"], self.timesteps)
        conditioning = None
        if cond is not None:
            conditioning = cond_bias(columns["cond"], cond.reshape(-1, columns["cond"].shape[1]))
            if cond.dim() == 1:
                conditioning = conditioning[0]
        steps = len(self.rule) if num_steps is None else num_steps
        return sample(x, len(self.rule) - 1, [columns["x"]] + weights[1:], biases, self.rule, steps,
                      activations=activations, time_bias=time, cond_bias=conditioning, noise=noise,
                      generator=generator, return_chain=return_chain, precision=self.precision)
