"""nn.Modules that run a whole sampler of a user's own MLP as one fused op."""
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .conditioning import BiasNet, cond_bias, time_bias_from_module
from .layers import VOCABULARY, Program, mlp_layers, read_network
from .ops import PRECISIONS, sample
from .step_rules import StepRule


def _activation_name(layer: nn.Module) -> str | None:
    return next((a.name for a in VOCABULARY if a.computed_by(layer)), None)


def _split_time_embedding(time_embedding) -> tuple[nn.Module, nn.Sequential, str] | None:
    """``(features, mlp, last)`` where ``time_embedding`` is an ``nn.Sequential``
    of a parameter-free feature map (a sinusoidal or Fourier embedding of the
    timesteps) followed by ``Linear (act Linear)*`` and optionally one more
    activation (``last``, else ``"identity"``); None for any other form."""
    if not isinstance(time_embedding, nn.Sequential):
        return None
    layers = list(time_embedding.children())
    first = next((i for i, m in enumerate(layers) if isinstance(m, nn.Linear)), None)
    if first is None or first == 0 or any(True for m in layers[:first] for _ in m.parameters()):
        return None
    last = "identity"
    if len(layers) - first >= 2 and _activation_name(layers[-1]) is not None:
        last = _activation_name(layers[-1])
        layers = layers[:-1]
    mlp = nn.Sequential(*layers[first:])
    try:
        mlp_layers(mlp)
    except ValueError:
        return None
    return nn.Sequential(*layers[:first]), mlp, last


def _read_network(mlp: nn.Module) -> Program | None:
    """None for ``Linear (act Linear)*`` (the op's plain network), else ``mlp`` read as a
    network program (LayerNorm, residual blocks, Dropout: :func:`read_network`, whose
    ValueError names the module it cannot read and why)."""
    try:
        mlp_layers(mlp)
        return None
    except ValueError:
        return read_network(mlp, name="mlp")


class DiffusionSampler(nn.Module):
    """A full sampling run of a user's MLP under a step rule, as one fused op.

    The network is ``mlp(cat(inputs, dim=1))`` with ``inputs`` the samples ``x``
    and, optionally, a time embedding and a conditioning vector, in the order
    ``layout`` gives. The first Linear's time and conditioning columns go to
    the op at every call (so trained parameters are always the current ones):
    a time embedding written as a parameter-free feature map followed by an
    MLP (``nn.Sequential(SinusoidalPosEmb(16), nn.Linear(16, 32), nn.Mish(),
    nn.Linear(32, 16))``) becomes the op's ``time_net``, its features of the
    rule's timesteps computed once, here; and a ``(batch, n)`` condition the
    op's ``cond_net``: the op evaluates both inside its one CUDA launch.
    Any other time embedding is evaluated at every call into ``time_bias``.

    Args:
        mlp: ``Linear (act Linear)*`` (see :func:`mlp_layers`), or any network
            of Linear, activation, LayerNorm, Dropout and residual-block
            modules as projects write them (IDQL's LN-ResNet and its MLP with a
            LayerNorm over the whole input, CleanDiffuser's ``IDQLMlp`` layers,
            DPPO's residual MLP: see :func:`ddpm_ops.layers.read_network`),
            read once here, its parameters at every call; its output is what
            the rule expects (epsilon, x0 or v). A network whose first layer
            is not a Linear gets the time embedding's output and the condition
            themselves (the op's ``"input:"`` instruction).
        rule: the :class:`~ddpm_ops.StepRule` of the sampler (DDPM, DDIM,
            flow-matching Euler, DPM-Solver++: see :mod:`ddpm_ops.step_rules`).
        timesteps: ``(len(rule),)``: the training timestep of each step index,
            the input of ``time_embedding`` (``torch.arange(T)`` for
            :func:`ddpm_ops.step_rules.ddpm`; float timesteps for flow
            matching, as :func:`~ddpm_ops.step_rules.from_diffusers` gives them).
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
        # Read once: fail at construction, not at the first call.
        self._program = _read_network(mlp)
        first = mlp_layers(mlp)[0][0] if self._program is None else self._program.linears[0].weight
        if sum(n for _, n in layout) != first.shape[1]:
            raise ValueError(f"layout: expected columns summing to the first Linear's "
                             f"in_features {first.shape[1]}, got {list(layout)}")
        self.mlp = mlp
        self.rule = rule
        self.layout = tuple(layout)
        self.time_embedding = time_embedding
        self.register_buffer("timesteps", None if timesteps is None else torch.as_tensor(timesteps))
        self.precision = precision
        # A tuple, so that the time MLP's modules (the embedding's own) are
        # not registered twice.
        split = _split_time_embedding(time_embedding) if "time" in names else None
        if self._program is not None and not self._program.first_is_linear:
            split = None  # the op reads the embedding's output itself
        self._time_mlp = None if split is None else (split[1], split[2])
        features = None
        if split is not None:
            with torch.no_grad():
                features = split[0](self.timesteps.to(torch.float32)).to(torch.float32)
        self.register_buffer("time_features", features)
        self._t_start_cache = (None, None)

    def _rule_on(self, device: torch.device) -> StepRule:
        """The rule on ``device``, moved once (a move builds and checks the
        tables: kernels that a call would otherwise pay every time)."""
        if self.rule.device == device:
            return self.rule
        if torch.compiler.is_compiling():  # no state written while traced
            return self.rule.to(device)
        self.rule = self.rule.to(device)
        return self.rule

    def _t_start(self, x: torch.Tensor) -> torch.Tensor:
        """The last step index for every row, as a tensor kept for the batch
        size and device (a new one would cost a kernel per call)."""
        if torch.compiler.is_compiling():  # a traced tensor must not outlive the trace
            return torch.full((x.shape[0],), len(self.rule) - 1, dtype=torch.int64, device=x.device)
        key = (x.shape[0], x.device)
        if self._t_start_cache[0] != key:
            self._t_start_cache = (key, torch.full((x.shape[0],), len(self.rule) - 1, dtype=torch.int64,
                                                   device=x.device))
        return self._t_start_cache[1]

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None, *,
                num_steps: int | None = None, noise: torch.Tensor | None = None,
                generator: torch.Generator | None = None, return_chain: bool = False) -> torch.Tensor:
        """Sample from ``x`` at the rule's last step index, ``num_steps``
        steps (all of them by default); ``cond``: ``(batch, n)`` or ``(n,)``.
        ``noise``, ``generator`` and ``return_chain`` as :func:`ddpm_ops.sample`."""
        names = [name for name, _ in self.layout]
        if ("cond" in names) != (cond is not None):
            raise ValueError(f"cond: expected {'a tensor' if 'cond' in names else 'None'} for "
                             f"layout {names}, got {'None' if cond is None else 'a tensor'}")
        if self._program is None:
            weights, biases, activations = mlp_layers(self.mlp)
            program = {}
        else:
            weights, biases, norm_weights, norm_biases = self._program.parameters()
            activations = "silu"
            program = dict(network=list(self._program.instructions), norm_weights=norm_weights,
                           norm_biases=norm_biases)
            if not self._program.first_is_linear:
                return self._sample_whole_input(x, cond, weights, biases, program, num_steps=num_steps,
                                                noise=noise, generator=generator, return_chain=return_chain)
        columns = dict(zip(names, weights[0].detach().split([n for _, n in self.layout], dim=1)))
        time = time_net = None
        if self._time_mlp is not None:
            mlp, last = self._time_mlp
            time_weights, time_biases, time_activations = mlp_layers(mlp)
            time_net = BiasNet(self.time_features, [*time_weights, columns["time"]], time_biases,
                               [*time_activations, last])
        elif self.time_embedding is not None:
            time = time_bias_from_module(self.time_embedding, columns["time"], self.timesteps)
        conditioning = cond_net = None
        if cond is not None and cond.dim() >= 2:
            cond_net = BiasNet(cond.reshape(-1, columns["cond"].shape[1]), [columns["cond"]])
        elif cond is not None:
            conditioning = cond_bias(columns["cond"], cond.reshape(-1, columns["cond"].shape[1]))[0]
        steps = len(self.rule) if num_steps is None else num_steps
        return sample(x, self._t_start(x), [columns["x"]] + weights[1:], biases, self._rule_on(x.device), steps,
                      activations=activations, time_bias=time, cond_bias=conditioning, noise=noise,
                      generator=generator, return_chain=return_chain, precision=self.precision,
                      time_net=time_net, cond_net=cond_net, **program)

    def _sample_whole_input(self, x, cond, weights, biases, program, **options) -> torch.Tensor:
        """A network whose first layer is not a Linear: the op concatenates x, the condition and
        the time embedding's output (at every step index, evaluated here) in the layout's order."""
        names = [name for name, _ in self.layout]
        time_input = None
        if self.time_embedding is not None:
            with torch.no_grad():
                time_input = self.time_embedding(self.timesteps.to(device=x.device, dtype=torch.float32))
            time_input = time_input.to(torch.float32)
        program["network"] = [f"input:{','.join(names)}", *program["network"]]
        num_steps = options.pop("num_steps")
        steps = len(self.rule) if num_steps is None else num_steps
        return sample(x, self._t_start(x), weights, biases, self._rule_on(x.device), steps,
                      precision=self.precision, time_input=time_input,
                      cond_input=None if cond is None else cond.reshape(-1, dict(self.layout)["cond"]),
                      **options, **program)
