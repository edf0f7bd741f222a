"""Random problems for ddpm::fused_sample and their float64 reference answers."""
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import torch

import ddpm_ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@dataclass
class Problem:
    x: torch.Tensor
    t_start: torch.Tensor
    weights: list
    biases: list
    sqrt_recip_alphas: torch.Tensor
    coef_eps: torch.Tensor
    num_steps: int
    total_timesteps: int

    def args(self):
        return (self.x, self.t_start, self.weights, self.biases, self.sqrt_recip_alphas,
                self.coef_eps, self.num_steps, self.total_timesteps)

    def reference64(self) -> torch.Tensor:
        """The reference loop evaluated in float64 on the CPU."""
        def f64(t):
            return t.detach().cpu().double()
        return ddpm_ops.reference(
            f64(self.x), self.t_start.cpu(), [f64(w) for w in self.weights],
            [f64(b) for b in self.biases], f64(self.sqrt_recip_alphas), f64(self.coef_eps),
            self.num_steps, self.total_timesteps)


def make_problem(batch, dim, hidden, num_steps, *, device="cpu", t_dtype=torch.int64,
                 total_timesteps=1000, schedule="linear", generator=None) -> Problem:
    """A random problem: ``hidden`` lists the widths of the hidden layers
    (empty for a single Linear); weights drawn like ``nn.Linear``'s default."""
    g = generator if generator is not None else torch.Generator().manual_seed(torch.seed())
    features = [dim + 1, *hidden, dim]
    weights, biases = [], []
    for fan_in, fan_out in zip(features[:-1], features[1:]):
        bound = fan_in ** -0.5
        weights.append((torch.rand(fan_out, fan_in, generator=g) * 2 - 1) * bound)
        biases.append((torch.rand(fan_out, generator=g) * 2 - 1) * bound)
    betas = (ddpm_ops.linear_betas if schedule == "linear" else ddpm_ops.cosine_betas)(total_timesteps)
    c1, c2 = ddpm_ops.coefficient_tables(betas)
    low = max(num_steps - 1, 0)
    t_start = torch.randint(low, total_timesteps, (batch,), generator=g, dtype=torch.int64)
    x = torch.randn(batch, dim, generator=g)
    return Problem(x.to(device), t_start.to(device=device, dtype=t_dtype),
                   [w.to(device) for w in weights], [b.to(device) for b in biases],
                   c1.to(device), c2.to(device), num_steps, total_timesteps)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf."""
    out = out.detach().cpu().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def run_python(script: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter with tests/ importable (for
    settings read once per process, and for code that may crash)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent),
                                              full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True,
                          text=True, timeout=timeout)
