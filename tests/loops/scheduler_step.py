"""A scheduler's step written for a Python-int ``t`` (a hand-written DDPM scheduler in the style of
diffusers' ``DDPMScheduler.step``): each table read as ``table[torch.full((1,), t)].reshape(-1, 1)``,
x0 clipped, the noise added under ``if t > 0``."""
import torch
from torch import nn

from .common import ddpm_buffers, linear_beta_schedule


class IntTimestepScheduler(nn.Module):
    def __init__(self, num_train_timesteps=10):
        super().__init__()
        self.num_train_timesteps = num_train_timesteps
        ddpm_buffers(self, linear_beta_schedule(num_train_timesteps))

    def _at(self, table, t):
        return table[torch.full((1,), t, dtype=torch.long, device=table.device)].reshape(-1, 1)

    def step(self, model_output, t, sample, noise):
        x0 = self._at(self.sqrt_recip_alphas_cumprod, t) * sample \
            - self._at(self.sqrt_recipm1_alphas_cumprod, t) * model_output
        x0 = x0.clamp(-1.0, 1.0)
        prev = self._at(self.posterior_mean_coef1, t) * x0 + self._at(self.posterior_mean_coef2, t) * sample
        if t > 0:
            prev = prev + self._at(self.posterior_variance, t) ** 0.5 * noise
        return prev


class IntTimestepLoop(nn.Module):
    """``forward(x, noise)``: every timestep of the scheduler, ``noise[k]`` the draw of step ``k``."""

    def __init__(self, dim=3, hidden=32, num_train_timesteps=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, dim))
        self.scheduler = IntTimestepScheduler(num_train_timesteps)

    def forward(self, x, noise):
        T = self.scheduler.num_train_timesteps
        for k, t in enumerate(reversed(range(T))):
            t_col = torch.full((x.shape[0], 1), t / T, device=x.device)
            eps = self.net(torch.cat([x, t_col], dim=1))
            x = self.scheduler.step(eps, t, x, noise[k])
        return x
