"""Typed Python entry points of ``torch.ops.ddpm.fused_sample``.

The schema, the argument checks and the fake (Meta) kernel all live in C++
(csrc/ops.cpp, csrc/checks.cpp), so eager calls, torch.compile, torch.export
and AOTInductor see one definition.
"""
import operator
from collections.abc import Sequence

import torch
from torch import nn

from . import _library  # noqa: F401  (registers ddpm::fused_sample)

PRECISIONS = ("fp32", "tf32", "bf16")


def fused_sample(
    x: torch.Tensor,
    t_start: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    sqrt_recip_alphas: torch.Tensor,
    coef_eps: torch.Tensor,
    num_steps: int,
    total_timesteps: int,
    *,
    validate: bool = False,
    precision: str = "fp32",
) -> torch.Tensor:
    """Run ``num_steps`` reverse-diffusion (DDPM) steps of an MLP noise network as one op.

    Equal to :func:`ddpm_ops.reference.reference` (the loop of DESIGN.md)::

        for k in range(num_steps):
            t = t_start - k
            eps = mlp(cat([x, t / total_timesteps], dim=1))
            x = sqrt_recip_alphas[t] * (x - coef_eps[t] * eps)

    Args:
        x: ``(batch, dim)`` float32, the samples at timestep ``t_start``.
        t_start: ``(batch,)`` int64 or int32, each sample's first timestep.
        weights: the MLP's ``nn.Linear`` weights ``(out_l, in_l)``; ``in_0 = dim + 1``
            (the last input column is ``t / total_timesteps``), the last layer
            outputs ``dim``. SiLU between layers, none after the last.
        biases: one ``(out_l,)`` bias per weight.
        sqrt_recip_alphas, coef_eps: 1-D float32 tables of equal length, indexed
            by timestep (see :func:`ddpm_ops.coefficient_tables`).
        num_steps: how many steps K >= 0 to run; 0 returns a copy of ``x``.
        total_timesteps: T, the divisor of the time input.
        validate: on CUDA, check every timestep on the host before launching
            and raise a ``RuntimeError`` for one outside the tables (this
            synchronises with the GPU). Without it the CUDA kernel never
            synchronises: a sample whose timesteps ``t_start - k`` fall outside
            the tables is never read out of bounds, and its output row is NaN.
            On the CPU the check always runs and always raises.
        precision: ``"fp32"`` (default): float32 accuracy, relative error at
            most 1e-5 against float64 (about 1.5e-7 measured). On CUDA it runs
            on tensor cores where that is faster, split so that fp32's
            precision survives: on an sm_90 GPU (H100, H200), for nets with
            dim <= 64, hidden widths <= 256, at least one hidden layer and at
            most 4 Linear layers at width 256 (narrower nets may be deeper),
            the narrow kernel (from batch 121 while one wave of its 8- to
            32-row tiles holds the batch: seed shape up to 960 rows on an
            H200) and beyond it, from batch 265, the split kernel hold each
            operand as two bf16 numbers and take three bf16 products per
            product (measured the same error as plain fp32); elsewhere, from
            batch 768 (from batch 128 for nets whose weights do not fit on
            chip, such as hidden width 1024), the tiled kernel takes three TF32
            products (3xTF32);
            otherwise plain fp32 FMAs: at small batches (seed shape up to
            batch 120 on an H200), for nets of 2 to 4 Linear layers with
            dim <= 64 and equal hidden widths <= 256 (a multiple of 16) whose
            weights after the first layer are 16-byte aligned (as torch
            allocates them), with every weight in registers; else with the
            weights in shared memory or L2.
            ``"tf32"`` and ``"bf16"`` opt into faster paths on CUDA, with
            relative error up to 5e-3 allowed. ``"tf32"``: one TF32 product
            instead of three wherever the tiled kernel runs (measured 0.7e-5 to
            2.5e-5 on an H200; where the narrow or split kernel runs, it
            runs that, exact and faster). ``"bf16"``: from batch 265, on an
            sm_90 GPU, for nets with dim <= 64, hidden widths <= 256, at least
            one hidden layer and bf16 weights within shared memory (at width
            256 that is at most 3 Linear layers: 192 KB), bf16 operands with
            fp32 accumulation, x and the update in fp32 (measured 3e-5; batch
            32768 of the seed shape about 3x faster than fp32), except where
            the split kernel would run in clusters of 4 (up to about 1900 rows
            at the seed shape on an H200): there the narrow or split kernel
            runs, exact and faster; elsewhere ``"bf16"`` runs as ``"tf32"``.
            Everywhere else, and on the CPU, the op computes in fp32 whatever
            is asked.

    Returns:
        A new contiguous ``(batch, dim)`` float32 tensor; inputs are never
        mutated or aliased.

    Raises:
        RuntimeError: for a bad argument (the message names it, what was
            expected and what was given), and when called under grad mode with
            an input that requires grad: the op is inference-only.
    """
    return torch.ops.ddpm.fused_sample(
        x, t_start, list(weights), list(biases), sqrt_recip_alphas, coef_eps,
        _as_int("num_steps", num_steps), _as_int("total_timesteps", total_timesteps), validate,
        precision,
    )


def _as_int(name: str, value) -> int:
    """``value`` as a Python int (ints, numpy and 0-d integer tensors), else a
    ``TypeError`` that names the argument; a bool is not a count."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")


def mlp_parameters(eps_net: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The weights and biases of an ``nn.Sequential`` of ``Linear`` and ``SiLU``.

    Raises ``ValueError`` unless ``eps_net`` is Linear (SiLU Linear)*, each
    Linear with a bias: the only MLP the op computes. Subclasses that keep
    ``nn.Linear``'s / ``nn.SiLU``'s own ``forward`` (a parametrized Linear,
    e.g. weight norm) count; one that overrides it, or a module with forward
    hooks, is refused: it computes something else.
    """
    layers = list(eps_net.children()) if isinstance(eps_net, nn.Sequential) else [eps_net]
    if not layers:
        raise ValueError("eps_net: expected Linear, SiLU, Linear, ..., Linear, got an empty nn.Sequential")
    for module in (eps_net, *layers):
        if module._forward_hooks or module._forward_pre_hooks:
            raise ValueError(f"eps_net: {type(module).__name__} has forward hooks, which may change "
                             "what it computes; expected plain Linear and SiLU modules")
    weights, biases = [], []
    for position, layer in enumerate(layers):
        expect_linear = position % 2 == 0
        # The forward must be nn.Linear's / nn.SiLU's own (a parametrized Linear
        # keeps it); a subclass that overrides it computes something else.
        if expect_linear and _computes_like(layer, nn.Linear) and layer.bias is not None:
            weights.append(layer.weight)
            biases.append(layer.bias)
        elif not expect_linear and _computes_like(layer, nn.SiLU):
            continue
        else:
            expected = "nn.Linear with bias" if expect_linear else "nn.SiLU"
            given = type(layer).__name__
            expected_cls = nn.Linear if expect_linear else nn.SiLU
            if isinstance(layer, expected_cls):
                given += " without bias" if _computes_like(layer, expected_cls) else " with its own forward"
            raise ValueError(
                f"eps_net: expected Linear, SiLU, Linear, ..., Linear; layer {position} "
                f"should be {expected}, got {given}"
            )
    if len(layers) % 2 == 0:
        raise ValueError(f"eps_net: expected the last layer to be nn.Linear, got {type(layers[-1]).__name__}")
    return weights, biases


def silu_mlp(widths: list[int], *, bias: bool = True) -> nn.Sequential:
    """The network the op computes, as a fresh ``nn.Sequential``: ``Linear``
    layers of ``widths[0] -> widths[1] -> ... -> widths[-1]`` with ``SiLU``
    between them and none after the last (default ``nn.Linear`` init). For the
    op, ``widths[0]`` is ``dim + 1`` and ``widths[-1]`` is ``dim``."""
    if len(widths) < 2:
        raise ValueError(f"widths: expected at least an input and an output width, got {list(widths)}")
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(nn.SiLU())
        layers.append(nn.Linear(fan_in, fan_out, bias=bias))
    return nn.Sequential(*layers)


def _computes_like(layer: nn.Module, cls: type) -> bool:
    return isinstance(layer, cls) and type(layer).forward is cls.forward


class FusedDDPMSampler(nn.Module):
    """``num_steps`` DDPM steps of an MLP noise network, run by the fused op.

    Holds (shares, does not copy) the parameters of ``eps_net`` and the two
    coefficient tables as buffers; ``forward(x, t_start)`` is the reference
    loop of DESIGN.md.
    """

    def __init__(
        self,
        eps_net: nn.Module,
        sqrt_recip_alphas: torch.Tensor,
        coef_eps: torch.Tensor,
        num_steps: int,
        total_timesteps: int,
        *,
        precision: str = "fp32",
    ):
        super().__init__()
        mlp_parameters(eps_net)  # fail at construction, not at the first call
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
        self.eps_net = eps_net
        self.register_buffer("sqrt_recip_alphas", sqrt_recip_alphas)
        self.register_buffer("coef_eps", coef_eps)
        self.num_steps = num_steps
        self.total_timesteps = total_timesteps
        self.precision = precision

    def forward(self, x: torch.Tensor, t_start: torch.Tensor) -> torch.Tensor:
        weights, biases = mlp_parameters(self.eps_net)
        return fused_sample(
            x, t_start, weights, biases, self.sqrt_recip_alphas, self.coef_eps,
            self.num_steps, self.total_timesteps, precision=self.precision,
        )
