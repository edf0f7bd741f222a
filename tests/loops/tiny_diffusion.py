"""tiny-diffusion (ddpm.py): an MLP on [x, linear time embedding], GELU, its NoiseScheduler.step."""
import torch
from torch import nn

from .common import ddpm_buffers, linear_beta_schedule


class LinearEmbedding(nn.Module):
    def __init__(self, size, scale=1.0):
        super().__init__()
        self.size, self.scale = size, scale

    def forward(self, x):
        x = x / self.size * self.scale
        return x.unsqueeze(-1)


class MLP(nn.Module):
    def __init__(self, hidden_size=64, hidden_layers=2, num_timesteps=50):
        super().__init__()
        self.time_mlp = LinearEmbedding(num_timesteps)
        layers = [nn.Linear(2 + 1, hidden_size), nn.GELU()]
        for _ in range(hidden_layers):
            layers += [nn.Linear(hidden_size, hidden_size), nn.GELU()]
        layers.append(nn.Linear(hidden_size, 2))
        self.joint_mlp = nn.Sequential(*layers)

    def forward(self, x, t):
        return self.joint_mlp(torch.cat((x, self.time_mlp(t)), dim=-1))


class TinyDiffusion(nn.Module):
    def __init__(self, num_timesteps=50):
        super().__init__()
        self.model = MLP(num_timesteps=num_timesteps)
        self.num_timesteps = num_timesteps
        ddpm_buffers(self, linear_beta_schedule(num_timesteps))

    def get_variance(self, t):
        if t == 0:
            return 0
        variance = self.betas[t] * (1. - self.alphas_cumprod_prev[t]) / (1. - self.alphas_cumprod[t])
        return variance.clip(1e-20)

    def step(self, model_output, timestep, sample, noise):
        t = timestep
        pred_original_sample = (self.sqrt_recip_alphas_cumprod[t] * sample
                                - self.sqrt_recipm1_alphas_cumprod[t] * model_output)
        pred_prev_sample = self.posterior_mean_coef1[t] * pred_original_sample + self.posterior_mean_coef2[t] * sample
        variance = 0
        if t > 0:
            noise = torch.randn_like(model_output) if noise is None else noise
            variance = (self.get_variance(t) ** 0.5) * noise
        return pred_prev_sample + variance

    def forward(self, batch, noise=None):
        sample = torch.randn(batch, 2) if noise is None else noise[0]
        for k, t in enumerate(reversed(range(self.num_timesteps))):
            ts = torch.full((batch,), t, dtype=torch.long)
            residual = self.model(sample, ts)
            sample = self.step(residual, t, sample, None if noise is None else noise[k + 1])
        return sample
