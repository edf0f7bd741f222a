"""A DPM-Solver++ 2M sampler as CleanDiffuser's ``ode_dpmsolver++_2M`` and diffusers'
multistep scheduler write it: the previous step's x0 prediction kept in a Python variable."""
import torch
from torch import nn


class DPMSolver2M(nn.Module):
    def __init__(self, obs_dim=11, action_dim=3, hidden=64, num_steps=6, T=1000):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(action_dim + 1 + obs_dim, hidden), nn.Mish(),
                                 nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, action_dim))
        betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
        abar = torch.cumprod(1 - betas, 0)
        steps = torch.linspace(T - 1, 0, num_steps + 1).round().long()
        alpha, sigma = abar[steps].sqrt(), (1 - abar[steps]).sqrt()
        alpha[-1], sigma[-1] = 1.0, 0.0  # the data end
        self.times = [int(s) for s in steps]
        self.register_buffer("alpha", alpha.float())
        self.register_buffer("sigma", sigma.float())
        self.register_buffer("lam", (alpha / sigma.clamp(min=1e-12)).log().float())
        self.num_steps, self.T = num_steps, T

    def forward(self, obs, x):
        x0_prev = None
        for i in range(self.num_steps):
            t = torch.full((x.shape[0], 1), self.times[i] / self.T)
            eps = self.net(torch.cat([x, t, obs], dim=-1))
            x0 = ((x - self.sigma[i] * eps) / self.alpha[i]).clamp(-1.0, 1.0)
            if i + 1 == self.num_steps:
                x = x0
                break
            h = self.lam[i + 1] - self.lam[i]
            d = x0
            if x0_prev is not None:
                r = (self.lam[i] - self.lam[i - 1]) / h
                d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
            x = self.sigma[i + 1] / self.sigma[i] * x - self.alpha[i + 1] * torch.expm1(-h) * d
            x0_prev = x0
        return x
